"""The web page of ``aiayn serve``: one self-contained HTML document (inline CSS and JS, no CDN).

A person types sentences (one per line), presses Translate (or Ctrl+Enter), sees the
translations, and clicks "attention" beside one to see its encoder-decoder attention (§3.2.3)
as a heat map table: target tokens on the rows, source tokens on the columns, one layer and
head at a time or the mean over heads. User text is only ever inserted with ``textContent``.
"""
from __future__ import annotations

import html

_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>aiayn: translate</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; padding: 0 1em; color: #222; }
  h1 { font-size: 1.4em; }
  textarea { width: 100%; font-size: 1.05em; padding: .4em; box-sizing: border-box; }
  .controls { margin: .6em 0; display: flex; gap: 1em; align-items: center; flex-wrap: wrap; }
  .controls input[type=number] { width: 5em; }
  button { font-size: 1em; padding: .3em .9em; cursor: pointer; }
  #error { color: #b00020; white-space: pre-wrap; }
  #translations li { margin: .35em 0; }
  #translations .text { font-size: 1.1em; margin-right: .6em; }
  #status, #scale { color: #666; font-size: .9em; }
  #attention { margin-top: 1.2em; overflow-x: auto; }
  #attention table { border-collapse: collapse; font-size: .8em; }
  #attention td.w { width: 1.9em; height: 1.9em; border: 1px solid #fff; }
  #attention th { font-weight: normal; padding: 0 .3em; white-space: nowrap; }
  #attention thead th { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; }
  #attention tbody th { text-align: right; }
  .hidden { display: none; }
</style>
</head>
<body>
<h1>Transformer translation</h1>
<p>One sentence per line (at most __MAX_SENTENCES__). Ctrl+Enter translates.</p>
<textarea id="source" rows="4" placeholder="A man is riding a bicycle."></textarea>
<div class="controls">
  <label>beam <input id="beam" type="number" min="1" value="__BEAM__"></label>
  <label>&alpha; <input id="alpha" type="number" min="0" step="0.1" value="__ALPHA__"></label>
__KEY_INPUT__  <button id="translate">Translate</button>
  <span id="status"></span>
</div>
<div id="error"></div>
<ol id="translations"></ol>
<div id="attention" class="hidden">
  <h2 id="attention-title">Encoder-decoder attention</h2>
  <div class="controls">
    <label>layer <select id="layer"></select></label>
    <label>head <select id="head"></select></label>
  </div>
  <p id="scale"></p>
  <table id="attention-map"></table>
</div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let current = null;  // attention of the sentence shown: {src_tokens, tgt_tokens, cross (L,H,T,S)}

function color(w, top) {  // 0 -> white, top (the largest weight shown) -> dark blue
  const t = Math.max(0, Math.min(1, w / top));
  const r = Math.round(255 - 230 * t), g = Math.round(255 - 190 * t), b = Math.round(255 - 100 * t);
  return `rgb(${r},${g},${b})`;
}

function weights(layer, head) {  // (T,S) for one head, or the mean over heads
  const heads = current.cross[layer];
  if (head !== "mean") return heads[Number(head)];
  return heads[0].map((row, t) => row.map((_, s) => heads.reduce((acc, h) => acc + h[t][s], 0) / heads.length));
}

function cell(tag, text) {
  const el = document.createElement(tag);
  el.textContent = text;
  return el;
}

function drawMap() {
  const w = weights(Number($("layer").value), $("head").value);
  const top = Math.max(1e-6, ...w.flat());
  $("scale").textContent = `Rows: target tokens; columns: source tokens; each row sums to 1. ` +
    `White = 0, darkest = ${top.toFixed(3)} (hover a cell for its weight).`;
  const table = $("attention-map");
  table.replaceChildren();
  const head = document.createElement("thead"), headRow = document.createElement("tr");
  headRow.appendChild(cell("th", ""));
  current.src_tokens.forEach((tok) => headRow.appendChild(cell("th", tok)));
  head.appendChild(headRow);
  const body = document.createElement("tbody");
  current.tgt_tokens.forEach((tok, t) => {
    const tr = document.createElement("tr");
    tr.appendChild(cell("th", tok));
    w[t].forEach((v, s) => {
      const td = cell("td", "");
      td.className = "w";
      td.style.background = color(v, top);
      td.dataset.weight = v.toFixed(4);
      td.title = `${tok} -> ${current.src_tokens[s]}: ${v.toFixed(3)}`;
      tr.appendChild(td);
    });
    body.appendChild(tr);
  });
  table.append(head, body);
}

function options(select, values, labels) {
  select.replaceChildren(...values.map((v, i) => { const o = cell("option", labels[i]); o.value = v; return o; }));
}

function showAttention(att, sentence) {
  current = att;
  const L = att.cross.length, H = att.cross[0].length;
  options($("layer"), [...Array(L).keys()].map(String), [...Array(L).keys()].map((i) => String(i + 1)));
  options($("head"), ["mean", ...[...Array(H).keys()].map(String)], ["mean", ...[...Array(H).keys()].map((i) => String(i + 1))]);
  $("layer").value = String(L - 1);
  $("attention-title").textContent = `Encoder-decoder attention: ${sentence}`;
  $("attention").classList.remove("hidden");
  drawMap();
}

async function translate() {
  const sentences = $("source").value.split("\n").map((s) => s.trim()).filter((s) => s.length > 0);
  $("error").textContent = "";
  if (sentences.length === 0) { $("error").textContent = "Type a sentence first."; return; }
  $("status").textContent = "translating...";
  $("translate").disabled = true;
  try {
    const headers = {"Content-Type": "application/json"};
    if ($("api-key") && $("api-key").value) headers.Authorization = `Bearer ${$("api-key").value}`;
    const resp = await fetch("/translate", {
      method: "POST", headers,
      body: JSON.stringify({sentences, beam: Number($("beam").value), alpha: Number($("alpha").value), attention: true}),
    });
    const data = await resp.json();
    if (!resp.ok) throw new Error(data.error || resp.statusText);
    const list = $("translations");
    list.replaceChildren();
    data.translations.forEach((text, i) => {
      const li = document.createElement("li");
      li.appendChild(cell("span", text)).className = "text";
      const btn = cell("button", "attention");
      btn.className = "show-attention";
      btn.disabled = !(data.attention && data.attention[i]);
      btn.addEventListener("click", () => showAttention(data.attention[i], sentences[i]));
      li.appendChild(btn);
      list.appendChild(li);
    });
    $("attention").classList.add("hidden");
    $("status").textContent = `${data.time_ms} ms`;
  } catch (err) {
    $("error").textContent = String(err.message || err);
    $("status").textContent = "";
  } finally {
    $("translate").disabled = false;
  }
}

$("translate").addEventListener("click", translate);
$("source").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) translate(); });
$("layer").addEventListener("change", drawMap);
$("head").addEventListener("change", drawMap);
</script>
</body>
</html>
"""


_KEY_INPUT = '  <label>key <input id="api-key" type="password" autocomplete="off"></label>\n'


def index_html(beam: int, alpha: float, max_sentences: int, key_input: bool = False) -> str:
    """The page, with the server's default beam and α filled into the form (and a field for the
    API key when the service asks for one)."""
    return (_PAGE.replace("__BEAM__", html.escape(str(beam))).replace("__ALPHA__", html.escape(str(alpha)))
            .replace("__MAX_SENTENCES__", str(max_sentences)).replace("__KEY_INPUT__", _KEY_INPUT if key_input else ""))
