"""The web page of ``aiayn serve``: one self-contained HTML document (inline CSS and JS, no CDN).

The page names the model served (name, language pair when known, parameter count). A person
types or pastes text, presses Translate (or Ctrl+Enter / Cmd+Enter), and sees the translation.
The text is split into sentences (``splitText``: at line breaks, then after . ! or ? and its
closing quotes, followed by whitespace and an uppercase letter or a quote) and sent in one
request; the output is joined back in the text's lines. "attention" beside a sentence shows its
encoder-decoder attention (§3.2.3) as a heat map table: target tokens on the rows, source
tokens on the columns, one layer and head at a time or the mean over heads. A disabled control
shows why, in a note beside it and in its title. User text is only ever inserted with
``textContent``.
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
  button[disabled] { cursor: not-allowed; }
  #model { color: #555; margin-top: -.5em; }
  #model b { color: #222; }
  .note { color: #8a4b00; font-size: .85em; }
  #error { color: #b00020; white-space: pre-wrap; }
  #output { white-space: pre-wrap; font-size: 1.1em; border-left: 3px solid #9ab; padding: .2em .8em; }
  #translations .source { display: block; color: #777; font-size: .85em; }
  #translations .note { margin-left: .6em; }
  #translations li { margin: .35em 0; }
  #translations .text { font-size: 1.1em; margin-right: .6em; }
  #status, #count, #scale { color: #666; font-size: .9em; }
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
__MODEL__
<p>Type or paste text. It is split into sentences at line breaks and after . ! or ? followed by a
space and a capital letter or a quote, at most __MAX_SENTENCES__ per request.
Ctrl+Enter or Cmd+Enter translates.</p>
<textarea id="source" rows="5" placeholder="A man is riding a bicycle. Two dogs play in the snow."></textarea>
<div class="controls">
  <label>beam <input id="beam" type="number" min="1" value="__BEAM__"></label>
  <label>&alpha; <input id="alpha" type="number" min="0" step="0.1" value="__ALPHA__"></label>
__KEY_INPUT__  <button id="translate">Translate</button>
  <span id="translate-note" class="note"></span>
  <span id="count"></span>
  <span id="status"></span>
</div>
<div id="error"></div>
<div id="output" class="hidden"></div>
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
const MAX_SENTENCES = __MAX_SENTENCES__;  // the service's max_sentences
const ATTENTION_VALUES = __ATTENTION_VALUES__;  // the service's max_attention_values (0: no maps)
let current = null;  // attention of the sentence shown: {src_tokens, tgt_tokens, cross (L,H,T,S)}
let busy = false;  // a request is in flight

// The split rule: at line breaks, then after . ! or ? (and the closing quotes right after it)
// followed by whitespace and an uppercase letter or a quote. Simple on purpose: "Dr. Smith" is
// split too, "e.g. this" and "3. 4" are not.
const BREAK = /(?<=[.!?]["'\u201c\u201d\u2019\u00bb]*)\s+(?=[\p{Lu}"'\u201c\u2018\u00ab\u201e])/u;

function splitText(text) {  // one list of sentences per line ([] for a blank line)
  return text.trim().split(/\r?\n/).map((line) => (line.trim() ? line.trim().split(BREAK) : []));
}

function joinText(lines, outputs) {  // the outputs in the lines' shape: a line's sentences joined by spaces
  let k = 0;
  return lines.map((line) => line.map(() => outputs[k++]).join(" ")).join("\n");
}

function setReason(control, note, reason, detail) {  // disabled iff a reason: shown in the note and the title
  control.disabled = Boolean(reason);
  control.title = reason ? (detail || reason) : "";
  note.textContent = reason;
}

function refresh() {  // the Translate button's state from the text
  const n = splitText($("source").value).flat().length;
  $("count").textContent = n ? `${n} sentence${n === 1 ? "" : "s"}` : "";
  let reason = "", detail = "";
  if (busy) reason = "waiting for the answer";
  else if (n === 0) reason = "type or paste text first";
  else if (n > MAX_SENTENCES) {
    reason = `${n} sentences: at most ${MAX_SENTENCES} per request`;
    detail = `This text has ${n} sentences; the service translates at most ${MAX_SENTENCES} per request ` +
      `(max_sentences). Shorten it or translate it in parts.`;
  }
  setReason($("translate"), $("translate-note"), reason, detail);
}

function attentionReason(data, i) {  // [short reason, detail] why sentence i has no map, or ["", ""]
  if (ATTENTION_VALUES === 0) return ["no maps on this service", "This service returns no attention maps (max_attention_values = 0)."];
  if (data.attention && data.attention[i]) return ["", ""];
  return ["map over the service's limit", `Not returned: the attention maps of this answer would exceed the ` +
    `service's limit of ${ATTENTION_VALUES} values (a long output, or the sentences before it used the budget). ` +
    `Translate this sentence alone to see its map.`];
}

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

function number(id) {  // a number field's value; undefined when empty
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

async function answerOf(resp) {  // the JSON answer; an error (the service's message, else the HTTP status) when not ok
  const text = await resp.text();
  let data = null;
  try { data = JSON.parse(text); } catch (err) { data = null; }  // a proxy's HTML error page, say
  if (resp.ok && data) return data;
  throw new Error((data && data.error) || `HTTP ${resp.status} ${resp.statusText}`.trim());
}

async function translate() {
  if ($("translate").disabled) return;  // its reason is shown beside it
  const lines = splitText($("source").value), sentences = lines.flat();
  $("error").textContent = "";
  $("status").textContent = "translating...";
  busy = true;
  refresh();
  try {
    const headers = {"Content-Type": "application/json"};
    if ($("api-key") && $("api-key").value) headers.Authorization = `Bearer ${$("api-key").value}`;
    const resp = await fetch("translate", {  // relative: the service behind a proxy under a path prefix
      method: "POST", headers,  // an emptied field is left out (undefined): the service's default
      body: JSON.stringify({sentences, beam: number("beam"), alpha: number("alpha"), attention: ATTENTION_VALUES > 0}),
    });
    const data = await answerOf(resp);
    const list = $("translations");
    list.replaceChildren();
    data.translations.forEach((text, i) => {
      const li = document.createElement("li");
      li.appendChild(cell("span", sentences[i])).className = "source";
      li.appendChild(cell("span", text)).className = "text";
      const btn = cell("button", "attention"), note = cell("span", "");
      btn.className = "show-attention";
      note.className = "note";
      const [reason, detail] = attentionReason(data, i);
      setReason(btn, note, reason, detail);
      btn.addEventListener("click", () => showAttention(data.attention[i], sentences[i]));
      li.append(btn, note);
      list.appendChild(li);
    });
    $("output").textContent = joinText(lines, data.translations);
    $("output").classList.toggle("hidden", sentences.length < 2);
    $("attention").classList.add("hidden");
    $("status").textContent = `translated in ${data.time_ms} ms`;
  } catch (err) {
    $("error").textContent = String(err.message || err);
    $("status").textContent = "";
  } finally {
    busy = false;
    refresh();
  }
}

$("translate").addEventListener("click", translate);
$("source").addEventListener("input", refresh);
$("source").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); translate(); }
});
$("layer").addEventListener("change", drawMap);
$("head").addEventListener("change", drawMap);
refresh();
</script>
</body>
</html>
"""


_KEY_INPUT = '  <label>key <input id="api-key" type="password" autocomplete="off"></label>\n'


def parameters_text(n: int) -> str:
    """A parameter count as the page shows it: 63082496 -> "63.1M parameters"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= 0.99995 * scale:  # what rounds to 1.0 of a unit is shown in it
            return f"{n / scale:.1f}{unit} parameters"
    return f"{n} parameters"


def model_html(model: dict) -> str:
    """The line naming the model: its name, its language pair (left out when unknown) and size."""
    parts = []
    if model.get("name"):
        parts.append(f'<b id="model-name">{html.escape(model["name"])}</b>')
    if model.get("languages"):
        pair = f'{model["languages"]["source"]} \u2192 {model["languages"]["target"]}'
        parts.append(f'<span id="model-pair">{html.escape(pair)}</span>')
    size = parameters_text(model["parameters"])
    if model.get("ensemble", 1) > 1:
        size += f' (ensemble of {model["ensemble"]})'
    parts.append(f'<span id="model-size">{html.escape(size)}</span>')
    return '<p id="model">Model: ' + " &middot; ".join(parts) + "</p>"


def index_html(beam: int, alpha: float, max_sentences: int, key_input: bool = False, *,
               model: dict, attention_values: int) -> str:
    """The page, with the server's default beam and α filled into the form, a field for the API
    key when the service asks for one, the line naming ``model`` (/health's "model") and the
    caps the page checks before sending (max_sentences, max_attention_values)."""
    return (_PAGE.replace("__BEAM__", html.escape(str(beam))).replace("__ALPHA__", html.escape(str(alpha)))
            .replace("__MAX_SENTENCES__", str(int(max_sentences)))
            .replace("__ATTENTION_VALUES__", str(int(attention_values))).replace("__MODEL__", model_html(model))
            .replace("__KEY_INPUT__", _KEY_INPUT if key_input else ""))
