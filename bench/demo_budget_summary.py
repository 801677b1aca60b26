"""Collect `aiayn demo` runs to a budget (bench/demo_budget.sh) into one JSON: per run, the recipe,
budget, seed, steps, counted FLOPs, training seconds, α and the scores.

    python bench/demo_budget_summary.py OUT.json RUN/results.json ...
"""
import argparse
import json
from pathlib import Path

TOK = "Multi30k tokenized BLEU (lc.norm.tok, fairseq-score style)"


def summary(path: Path) -> dict:
    d = json.loads(path.read_text())
    t, sets = d["train"], d["config"]["sets"]
    return {"run": path.parent.name, "recipe": Path(d["config"]["recipe"]).name, "sets": sets,
            "steps": t["steps"], "counted_flops": t["counted_flops"], "stop_reason": t["stop_reason"],
            "train_seconds": t["train_seconds"], "params": t["params"], "alpha": d["alpha"],
            "valid_multi30k_bleu": round(d["valid"]["multi30k_bleu"], 2), "test_multi30k_bleu": d["test"][TOK]["score"],
            "test_sacrebleu": d["test"]["sacreBLEU"]["score"], "test_chrf2": d["test"]["chrF2"]["score"]}


def main(out: str, *paths: str) -> None:
    runs = [summary(Path(p)) for p in paths]
    Path(out).write_text(json.dumps({"bench": "demo_budget", "runs": runs}, indent=2) + "\n")
    for r in runs:
        print(f"{r['run']}: {r['steps']} steps, {r['counted_flops']:.3g} FLOPs, test {r['test_multi30k_bleu']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the summary JSON to write")
    parser.add_argument("results", nargs="+", help="the runs' results.json files")
    args = parser.parse_args()
    main(args.out, *args.results)
