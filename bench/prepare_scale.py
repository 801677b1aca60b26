"""``aiayn prepare`` and the training data loader on a corpus the size of WMT14 En-De (4.5M pairs).

No download: the En-De pairs in ../shared/data (Multi30k train, newstest2013, newstest2014, the
IWSLT14 test set, OpenNMT's toy corpus: about 52,000 pairs) are repeated and perturbed until the
corpus has --pairs pairs. Copy r of a pair (r >= 1) has one word on each side changed by a
suffix drawn from r, and its words rotated by r positions, so SentencePiece sees new words and
no two copies are the same text. newstest2013 is the valid split, newstest2014 the test split.

For each size, three child processes, each with its own peak RSS (``wait4``'s ru_maxrss):

1. ``aiayn prepare`` (shared BPE of --vocab-size, SentencePiece trained on its default sample of
   1M pairs): wall time, the SentencePiece and encoding stages (from its log), disk of the
   data directory;
2. the loader (``--loader DIR``, this script): open the split (memory maps), build the
   token-bounded sampler (3,125 + 3,125 tokens per batch, the WMT14 recipes' per-GPU share),
   the first batch, then --loader-batches more; the seconds to each point, and the process's
   anonymous memory (RssAnon, /proc/self/status: what the process holds beyond file pages,
   which the kernel can drop) against the file-backed pages of the memory maps (RssFile);
3. ``aiayn train`` of the tiny preset for --train-steps steps (200) on the data directory,
   validating on newstest2013 every 100 steps and at the end: the seconds from the command's
   start to its first logged step (train_log.jsonl, polled every 0.1 s), its resident memory at
   steps 1, 10, N/2 and N (the log's rss_mb), its peak RSS and its median tokens/s. Batches of a
   larger corpus come in more shapes (a row count for nearly every sentence length), which is what
   made a training process grow with its corpus (aiayn/execution/linear.py, aiayn/host/allocator.py);
   --train-src runs another revision's src/ on the same data for comparison, --reuse-data skips
   preparing again.

Corpora and data directories go under runs/prepare_scale/ (git-ignored; --keep keeps them).
Results: bench/results/<machine-date>/prepare_scale.json (--name), and a table on stdout.

    nice -n 10 python bench/prepare_scale.py --pairs 500000,1000000,2000000
    git worktree add /tmp/before <rev> && python bench/prepare_scale.py --reuse-data --keep --train-src /tmp/before/src
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "src"))

import benchlib  # noqa: E402  (bench/: standard library only)

SUFFIXES = ("en", "er", "ung", "heit", "lich", "s", "ed", "ing", "ly", "ness", "keit", "chen", "ist", "ion")


def shared_pairs(root: Path) -> list[tuple[str, str]]:
    """The En-De pairs in ../shared/data (English source, German target)."""
    files = [("multi30k/raw/train.en.gz", "multi30k/raw/train.de.gz"),
             ("wmt14-newstest/newstest2013.en.gz", "wmt14-newstest/newstest2013.de.gz"),
             ("wmt14-newstest/newstest2014-deen.en.gz", "wmt14-newstest/newstest2014-deen.de.gz"),
             ("iwslt14-de-en-test/test.en.gz", "iwslt14-de-en-test/test.de.gz"),
             ("opennmt-toy-ende/src-train.txt.gz", "opennmt-toy-ende/tgt-train.txt.gz")]
    pairs = []
    for s, t in files:
        with gzip.open(root / s, "rt", encoding="utf-8") as fs, gzip.open(root / t, "rt", encoding="utf-8") as ft:
            pairs += [(a.strip(), b.strip()) for a, b in zip(fs, ft) if a.strip() and b.strip()]
    return pairs


def perturb(text: str, r: int) -> str:
    """Copy r of a sentence: one word gets a suffix chosen by r, the words rotate by r."""
    if r == 0:
        return text
    words = text.split()
    k = (r * 7919) % len(words)
    words[k] += SUFFIXES[r % len(SUFFIXES)] + (str(r // len(SUFFIXES)) if r >= len(SUFFIXES) else "")
    j = r % len(words)
    return " ".join(words[j:] + words[:j])


def build_corpus(out: Path, n: int, root: Path) -> dict:
    """train.{en,de} of n pairs, valid (newstest2013) and test (newstest2014) beside them."""
    if (out / "done").is_file():
        return json.loads((out / "done").read_text())
    out.mkdir(parents=True, exist_ok=True)
    pairs = shared_pairs(root)
    t0 = time.perf_counter()
    with open(out / "train.en", "w", encoding="utf-8") as fe, open(out / "train.de", "w", encoding="utf-8") as fd:
        for i in range(n):
            r, (s, t) = divmod(i, len(pairs))[0], pairs[i % len(pairs)]
            fe.write(perturb(s, r) + "\n")
            fd.write(perturb(t, r) + "\n")
    for split, name in (("valid", "newstest2013"), ("test", "newstest2014-deen")):
        for lang in ("en", "de"):
            with gzip.open(root / "wmt14-newstest" / f"{name}.{lang}.gz", "rb") as f:
                (out / f"{split}.{lang}").write_bytes(f.read())
    info = {"pairs": n, "distinct_source_pairs": len(pairs), "build_s": round(time.perf_counter() - t0, 1),
            "train_bytes": sum((out / f"train.{x}").stat().st_size for x in ("en", "de"))}
    (out / "done").write_text(json.dumps(info))
    return info


def run_child(argv: list[str], log_path: Path, first_step_log: Path | None = None, src: Path = REPO / "src") -> dict:
    """Run argv with aiayn from ``src``; wall seconds, peak RSS (MiB, of the child alone) and exit status;
    with ``first_step_log`` (a run's train_log.jsonl) also the seconds until its first train_loss line."""
    t0 = time.perf_counter()
    first, memory, peak_anon = None, {}, 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(src)})
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if first_step_log is not None and first is None and first_step_log.is_file() \
                    and "train_loss" in first_step_log.read_text():
                first = round(time.perf_counter() - t0, 1)
            now = memory_kb(proc.pid)
            if "RssAnon" in now:  # (an exited child, not yet reaped, has no memory lines)
                memory = now
                peak_anon = max(peak_anon, now["RssAnon"])
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)
    out = {"wall_s": round(time.perf_counter() - t0, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
           "exit": proc.returncode, "log": os.path.relpath(log_path, REPO),
           # anonymous memory (what the process holds beyond file pages the kernel can drop), polled
           # every 0.1 s: its peak, and the last sample with the mapped file pages beside it
           "peak_anon_mb": round(peak_anon / 1024, 1), "last_anon_mb": round(memory.get("RssAnon", 0) / 1024, 1),
           "last_file_mb": round(memory.get("RssFile", 0) / 1024, 1)}
    return out | ({"first_step_s": first} if first_step_log is not None else {})


def _stage_seconds(log_text: str) -> dict:
    found = {}
    m = re.search(r"trained SentencePiece .* on (\d+) sampled pairs in ([\d.]+)s", log_text)
    if m:
        found["spm_sample_pairs"], found["spm_train_s"] = int(m.group(1)), float(m.group(2))
    m = re.search(r"wrote \S+ in ([\d.]+)s", log_text)
    if m:
        found["prepare_s"] = float(m.group(1))
    return found


def memory_kb(pid="self") -> dict:
    """RssAnon, RssFile and VmHWM of process ``pid`` (this one by default), kB; {} once it is gone."""
    status = benchlib.proc_status_kb(pid)
    return {k: status[k] for k in ("RssAnon", "RssFile", "VmHWM") if k in status}


def loader(data_dir: Path, n_batches: int, tokens: int) -> dict:
    """Open the train split, build the sampler, collate the first batch and n_batches more."""
    t0 = time.perf_counter()
    points = {"start": {"s": 0.0, **memory_kb()}}
    import torch  # noqa: F401  (the training process has it loaded; count its memory before the data)
    from aiayn.data.batching import TokenBatchSampler, TokenBounds, collate
    from aiayn.data.dataset import DataDir
    points["imports"] = {"s": time.perf_counter() - t0, **memory_kb()}
    data = DataDir(data_dir).split("train")
    points["opened"] = {"s": time.perf_counter() - t0, **memory_kb()}
    sampler = TokenBatchSampler(data.src_lens + 1, data.tgt_lens + 1, TokenBounds(tokens, tokens), seed=1, shuffle=True)
    points["sampler"] = {"s": time.perf_counter() - t0, **memory_kb()}
    it = iter(sampler)
    collate([data[i] for i in next(it)])
    points["first_batch"] = {"s": time.perf_counter() - t0, **memory_kb()}
    done = 0
    for idx in it:
        if done == n_batches:
            break
        collate([data[i] for i in idx])
        done += 1
    points[f"after_{done}_batches"] = {"s": time.perf_counter() - t0, **memory_kb()}
    return {"pairs": len(data), "batches_per_epoch": len(sampler), "tokens_per_batch": tokens,
            "points": {k: {kk: round(vv, 3) if kk == "s" else vv for kk, vv in v.items()} for k, v in points.items()}}


def measure(n: int, args, work: Path) -> dict:
    corpus = work / f"corpus-{n}"
    info = build_corpus(corpus, n, Path(args.data_root))
    data = work / f"data-{n}"
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    result = {"pairs": n, "corpus": info}
    if not (args.reuse_data and (data / "manifest.json").is_file()):
        result |= prepare_and_load(n, args, corpus, data, logs)
        if result["prepare"]["exit"] != 0:
            return result
    result["train"] = train_steps(n, args, work, data, logs)
    result["loadavg_end"] = os.getloadavg()
    if not args.keep:
        shutil.rmtree(data, ignore_errors=True)
    return result


def prepare_and_load(n: int, args, corpus: Path, data: Path, logs: Path) -> dict:
    """``aiayn prepare`` of the corpus into ``data``, then the loader child on it."""
    shutil.rmtree(data, ignore_errors=True)
    py = sys.executable
    argv = [py, "-m", "aiayn.cli", "prepare", "--out", str(data), "--vocab-size", str(args.vocab_size),
            "--num-workers", str(args.threads)]
    for split in ("train", "valid", "test"):
        argv += [f"--{split}-src", str(corpus / f"{split}.en"), f"--{split}-tgt", str(corpus / f"{split}.de")]
    prep = run_child(argv, logs / f"prepare-{n}.log")
    prep.update(_stage_seconds((logs / f"prepare-{n}.log").read_text()))
    if prep["exit"] != 0:
        return {"prepare": prep}
    manifest = json.loads((data / "manifest.json").read_text())
    prep["disk_bytes"] = sum(f.stat().st_size for f in data.iterdir())
    prep["train_pairs_kept"] = manifest["splits"]["train"]["pairs"]
    prep["train_tokens"] = {s: manifest["splits"]["train"][s]["tokens"] for s in ("src", "tgt")}
    load = run_child([sys.executable, str(Path(__file__).resolve()), "--loader", str(data), "--loader-batches",
                      str(args.loader_batches), "--out-json", str(logs / f"loader-{n}.json")], logs / f"loader-{n}.log")
    if load["exit"] == 0:
        load.update(json.loads((logs / f"loader-{n}.json").read_text()))
    return {"prepare": prep, "loader": load}


def train_steps(n: int, args, work: Path, data: Path, logs: Path) -> dict:
    """``aiayn train`` of the tiny preset for --train-steps steps (validation on newstest2013 every
    100 steps and at the end, a checkpoint at the end), aiayn taken from --train-src; its resident
    memory at each step (train_log.jsonl's rss_mb), its peak and its median tokens/s after step 10."""
    run = work / f"run-{n}"
    shutil.rmtree(run, ignore_errors=True)
    argv = [sys.executable, "-m", "aiayn.cli", "train", "--data", str(data), "--out", str(run), "--preset", "tiny",
            "--max-steps", str(args.train_steps), "--no-progress", "--set", "train.validate_every_steps=100",
            "--set", "train.save_every_min=0", "--set", f"train.threads={args.threads}",
            "--set", "train.max_src_tokens=3125", "--set", "train.max_tgt_tokens=3125",
            "--set", "train.log_every_steps=1"] + [x for kv in args.train_set for x in ("--set", kv)]
    train = run_child(argv, logs / f"train-{n}.log", first_step_log=run / "train_log.jsonl", src=Path(args.train_src))
    log_file = run / "train_log.jsonl"
    rows = [json.loads(x) for x in log_file.read_text().splitlines() if "train_loss" in x] if log_file.is_file() else []
    rss = {r["step"]: r.get("rss_mb") for r in rows}
    tps = sorted(r["tokens_per_s"] for r in rows if r["step"] > 10)
    train |= {"steps": len(rows), "rss_mb_at": {k: rss.get(k) for k in (1, 10, len(rows) // 2, len(rows)) if k in rss},
              "tokens_per_s_median": round(tps[len(tps) // 2]) if tps else None,
              "src": str(args.train_src), "sets": args.train_set}
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    return train


def summary_rows(results: list[dict]) -> list[str]:
    rows = ["| pairs | prepare wall s | SentencePiece s | prepare peak RSS MiB | disk MiB | loader: open + sampler s | "
            "+ first batch s | RssAnon at first batch MiB | RssAnon / RssFile after batches MiB | train: first step s | "
            "train RSS at steps 1 / 10 / N/2 / N MiB | train peak MiB (anonymous) | tok/s |", "|" + "---|" * 13]
    for r in results:
        p, ld, t = r.get("prepare", {}), r.get("loader", {}), r.get("train", {})
        pts = ld.get("points", {})
        last = next((v for k, v in pts.items() if k.startswith("after_")), {})
        since = lambda k: f"{pts[k]['s'] - pts['imports']['s']:.2f}" if k in pts else "-"  # noqa: E731
        mib = lambda kb: f"{kb / 1024:.0f}" if kb is not None else "-"  # noqa: E731
        at = " / ".join(f"{v:.0f}" for v in t.get("rss_mb_at", {}).values() if v is not None)
        rows.append(f"| {r['pairs']:,} | {p.get('wall_s', 0):.0f} | {p.get('spm_train_s', '-')} | {p.get('peak_rss_mb', 0):.0f} | "
                    f"{p.get('disk_bytes', 0) / 2**20:.0f} | {since('sampler')} | {since('first_batch')} | {mib(pts.get('first_batch', {}).get('RssAnon'))} | "
                    f"{mib(last.get('RssAnon'))} / {mib(last.get('RssFile'))} | {t.get('first_step_s', '-')} | "
                    f"{at} | {t.get('peak_rss_mb', '-')} ({t.get('peak_anon_mb', '-')}) | {t.get('tokens_per_s_median', '-')} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="500000,1000000,2000000", help="corpus sizes, comma-separated")
    ap.add_argument("--vocab-size", type=int, default=37000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loader-batches", type=int, default=2000, help="batches the loader collates after the first")
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--work", default=str(REPO / "runs" / "prepare_scale"))
    ap.add_argument("--name", default=None, help="results folder under bench/results (default: machine-date)")
    ap.add_argument("--keep", action="store_true", help="keep the data directories and runs")
    ap.add_argument("--train-steps", type=int, default=200, help="steps of the training phase")
    ap.add_argument("--train-src", default=str(REPO / "src"),
                    help="the aiayn source tree the training phase runs (another revision's src/ to compare)")
    ap.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a --set for the training phase (repeatable)")
    ap.add_argument("--reuse-data", action="store_true",
                    help="train on data directories under --work that have a manifest, without preparing again")
    ap.add_argument("--loader", help=argparse.SUPPRESS)
    ap.add_argument("--out-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loader:
        Path(args.out_json).write_text(json.dumps(loader(Path(args.loader), args.loader_batches, 3125)))
        return 0
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    machine = benchlib.machine_info(args.threads)
    name = args.name or f"{'amd' if 'AMD' in machine.get('cpu_model', '') else 'cpu'}-{machine['logical_cpus']}core-" \
                        f"{machine['date'][:10]}"
    out = REPO / "bench" / "results" / name / "prepare_scale.json"
    results = []
    for n in [int(x) for x in args.pairs.split(",")]:
        results.append(measure(n, args, work))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"bench": "prepare_scale", "machine": machine, "args": vars(args),
                                   "results": results}, indent=2))
        print("\n".join(summary_rows(results)), flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
