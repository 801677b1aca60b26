"""The speed figures the documents state are those of the results files they name, and each results
folder holds what its name says. Pure reading: nothing is run or timed.

* BENCHMARKS.md's Machines table names each machine's results folder; the CPU speed tables of §2
  (training) and §3 (translation), whose rows begin "machine, date", and the ten targets' table,
  whose columns do, state target tokens/s and ratios that the folder of that machine and date
  (``train_{base,small}.json``, ``translate_{base,small}.json``) gives, to the precision written:
  "1.21x" is the ratio of the raw tokens/s rounded to two decimals, "2,024" the tokens/s rounded
  to an integer. In the ten targets a ratio is bold exactly where it misses its target, and
  "N of 10" counts the targets met.
* The README's headline speed table is of the machine and date its Results section names; that
  machine's folder is the one BENCHMARKS.md's Machines table names (the current one), every
  tokens/s in the table is one that folder's files give, and each ratio is its row's aiayn tokens/s
  over its row's rival's.
* Every results folder's files agree with the folder's name: the vendor (``amd-epyc-``,
  ``intel-xeon-``, ``nvidia-h200-``), the CPU generation where the name gives one (``zen3``: no
  AVX-512; ``zen4``, ``zen5``: AVX-512 bf16, no AMX; ``amx``: AMX), ``held`` where a file records
  instruction sets held by the environment, CUDA for a demo's training in an ``nvidia-`` folder
  only, and a date within a day of the folder's (a run that crossed midnight).
"""
from __future__ import annotations

import datetime
import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import BEST_OF  # noqa: E402  (each side judged by its better use of the threads)

NUMBER = re.compile(r"(?<![\w.])[0-9][0-9,]*(?:\.[0-9]+)?(?=x?(?!\w))", re.ASCII)  # "1.21x", "2,024"; not "fp32"
DATE = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}")

# Columns of the §2 (train) and §3 (translate) tables: a system's tokens/s, or (numerator, denominator).
TRAIN_COLUMNS = {"aiayn fp32": "aiayn-fp32", "aiayn bf16": "aiayn-bf16", "HF": "hf-fp32",
                 "HF, aiayn's allocator": "hf-fp32-reuse",
                 "fp32 / HF": ("aiayn-fp32", "hf-fp32"), "bf16 / fp32": ("aiayn-bf16", "aiayn-fp32")}
TRANSLATE_COLUMNS = {"aiayn fp32": "aiayn-fp32", "fp32, 2 workers": "aiayn-fp32-inter",
                     "bf16 weights, 2 workers": "aiayn-bf16w-inter", "int8-bf16, 2 workers": "aiayn-int8bf16-inter",
                     "CT2 fp32": "ct2-fp32", "CT2 fp32 inter": "ct2-fp32-inter", "CT2 int8": "ct2-int8", "HF": "hf-fp32",
                     "fp32 / CT2": ("aiayn-best-fp32", "ct2-best-fp32"), "fp32 / HF": ("aiayn-best-fp32", "hf-fp32"),
                     "reduced / CT2": ("aiayn-best-reduced", "ct2-best-fp32")}
# The ten targets: (bench, numerator, denominator, target), by the start of the row's label.
TARGETS = {"training fp32 / HF": ("train", "aiayn-fp32", "hf-fp32", 1.1),
           "training bf16 / fp32": ("train", "aiayn-bf16", "aiayn-fp32", 1.8),
           "translation fp32 / CT2": ("translate", "aiayn-best-fp32", "ct2-best-fp32", 1.2),
           "translation fp32 / HF": ("translate", "aiayn-best-fp32", "hf-fp32", 3.0),
           "reduced / CT2": ("translate", "aiayn-best-reduced", "ct2-best-fp32", 2.0)}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header cells, rows of cells) of every markdown table in ``text``."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()) and \
                (i == 0 or not lines[i - 1].startswith("|")):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            tables.append((_cells(line), rows))
    return tables


def _stated(cell: str) -> list[tuple[float, int, bool]]:
    """The numbers a cell states: (value, decimals written, inside **bold**), footnote marks aside."""
    found = []
    for k, part in enumerate(cell.split("**")):
        for m in NUMBER.finditer(part):
            text = m.group().replace(",", "")
            found.append((float(text), len(text.split(".")[1]) if "." in text else 0, k % 2 == 1))
    return found


def _agrees(stated: float, decimals: int, value: float) -> bool:
    """``stated`` is ``value`` written to ``decimals`` places."""
    return abs(stated - value) <= 0.5 * 10 ** -decimals + 1e-9


@functools.cache
def _tokens_per_s(folder: str, bench: str, size: str) -> dict[str, float]:
    """Target tokens/s of each system of ``bench/results/FOLDER/{bench}_{size}.json``, with the composites
    of the better use of the threads."""
    systems = json.loads((RESULTS / folder / f"{bench}_{size}.json").read_text())["systems"]
    tps = {name: s["tgt_tokens_per_s"] for name, s in systems.items() if s.get("tgt_tokens_per_s")}
    for best, members in BEST_OF.items():
        if any(m in tps for m in members):
            tps[best] = max(tps[m] for m in members if m in tps)
    return tps


def _value(folder: str, bench: str, size: str, column: str | tuple[str, str]) -> float | None:
    tps = _tokens_per_s(folder, bench, size)
    if isinstance(column, str):
        return tps.get(column)
    numerator, denominator = column
    return tps[numerator] / tps[denominator] if numerator in tps and denominator in tps else None


@functools.cache
def _machines() -> dict[str, str]:
    """BENCHMARKS.md's Machines table: the name a table uses for a machine -> its results folder."""
    for header, rows in _tables((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")):
        if header[0] == "name below":
            return {row[0]: re.search(r"`([^`]+)`", row[-1]).group(1) for row in rows}
    raise AssertionError("BENCHMARKS.md has no Machines table (a header beginning 'name below')")


def _folder(machine_and_date: str) -> str:
    """The results folder of a "Zen 4, 2026-11-29 ³" cell: the Machines table's folder of that name, of
    that date."""
    name, date = machine_and_date.split(", 20")[0].strip(), DATE.search(machine_and_date).group()
    assert name in _machines(), f"'{machine_and_date}': a machine the Machines table does not name"
    folder = DATE.sub(date, _machines()[name])
    assert (RESULTS / folder).is_dir(), f"'{machine_and_date}': no folder bench/results/{folder}"
    return folder


def _speed_table_errors(text: str) -> tuple[int, list[str]]:
    """(figures checked, disagreements) of the §2 and §3 tables and the ten targets in ``text``."""
    checked, wrong = 0, []
    for header, rows in _tables(text):
        if header[:2] == ["machine, date", "model"]:
            bench, columns = ("train", TRAIN_COLUMNS) if "aiayn bf16" in header else ("translate", TRANSLATE_COLUMNS)
            for row in rows:
                folder, sizes = _folder(row[0]), [s.strip() for s in row[1].split("/")]
                for title, cell in zip(header[2:], row[2:]):
                    stated = _stated(cell)
                    if title not in columns or len(stated) != len(sizes):
                        continue  # a column of no system, or "no bf16 instructions"
                    for size, (number, decimals, _) in zip(sizes, stated):
                        value = _value(folder, bench, size, columns[title])
                        checked += 1
                        if value is None or not _agrees(number, decimals, value):
                            wrong.append(f"{row[0]}, {size}, {title}: {cell} against {value} in bench/results/{folder}")
        elif header[0].startswith("target"):
            folders = [_folder(title) for title in header[1:]]
            met = dict.fromkeys(folders, 0)
            for row in rows:
                target = next((t for label, t in TARGETS.items() if row[0].startswith(label)), None)
                for folder, cell in zip(folders, row[1:]):
                    if target is None and "of 10" in cell:  # the row of targets met
                        checked += 1
                        if _stated(cell)[0][0] != met[folder]:
                            wrong.append(f"{folder}: '{cell}' targets met, the files give {met[folder]}")
                    if target is None or len(_stated(cell)) != 2:
                        continue
                    bench, numerator, denominator, minimum = target
                    for size, (number, decimals, bold) in zip(("base", "small"), _stated(cell)):
                        value = _value(folder, bench, size, (numerator, denominator))
                        checked += 1
                        if value is None or not _agrees(number, decimals, value):
                            wrong.append(f"{row[0]}, {folder}, {size}: {cell} against {value}")
                        elif bold != (value < minimum):
                            wrong.append(f"{row[0]}, {folder}, {size}: {number} bold is 'target missed'")
                        met[folder] += value >= minimum
    return checked, wrong


def test_the_speed_tables_are_their_files():
    checked, wrong = _speed_table_errors((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    assert checked >= 150, f"only {checked} figures found: the tables' headers changed?"
    assert not wrong, "figures that are not their results files':\n" + "\n".join(wrong)


def _readme_errors(readme: str) -> tuple[int, list[str]]:
    """(figures checked, disagreements) of the README's Results section: its machine and date are
    BENCHMARKS.md's current run of that machine; each tokens/s of its table is one that folder gives,
    and each ratio is its row's aiayn tokens/s over its row's rival's (or, where the rival's are not in
    the row, a ratio of two of the folder's)."""
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"\((Zen [0-9])\), (20[0-9]{2}-[0-9]{2}-[0-9]{2})", section)
    assert m, "the README's Results section names no '(Zen N), DATE'"
    folder, name = _folder(f"{m.group(1)}, {m.group(2)}"), m.group(1)
    checked, wrong = 1, []
    if folder != _machines()[name]:
        wrong.append(f"the headline is of bench/results/{folder}; BENCHMARKS.md's current run of {name} is "
                     f"{_machines()[name]}")
    tps = [v for bench in ("train", "translate") for size in ("base", "small")
           for v in _tokens_per_s(folder, bench, size).values()]

    def measured(cell: str) -> list[float | None]:
        """The folder's tokens/s that the cell's numbers are (None for one it does not give)."""
        nonlocal checked
        found = []
        for number, decimals, _ in _stated(cell):
            checked += 1
            found.append(next((v for v in tps if _agrees(number, decimals, v)), None))
            if found[-1] is None:
                wrong.append(f"{cell}: {number} is no tokens/s of bench/results/{folder}")
        return found

    for row in _tables(section)[0][1]:
        if not row[0].startswith(("training", "translation")):
            continue
        aiayn, rival = measured(row[1]), measured(row[2])
        pairs = list(zip(aiayn, rival)) if len(rival) == len(aiayn) else [(None, None)] * len(aiayn)
        for (number, decimals, _), (a, b) in zip(_stated(row[3]), pairs):
            checked += 1
            ratios = [a / b] if a and b else [x / y for x in tps for y in tps]
            if not any(_agrees(number, decimals, r) for r in ratios):
                wrong.append(f"{row[0]}: {number}x is not {ratios[0] if len(ratios) == 1 else 'a ratio'} "
                             f"of bench/results/{folder}")
    return checked, wrong


def test_the_readme_headline_is_the_current_run():
    checked, wrong = _readme_errors((ROOT / "README.md").read_text(encoding="utf-8"))
    assert checked >= 25
    assert not wrong, "\n".join(wrong)


def _metadata(data) -> list[dict]:
    """The machine records of a results file: its ``machine`` (a record, or a description), ``cpu`` or
    ``device``, the machines of its ``runs``, and its training's device."""
    found = []
    if not isinstance(data, dict):
        return found
    for key in ("machine", "cpu", "device"):
        value = data.get(key)
        found += [value] if isinstance(value, dict) else [{"description": value}] if isinstance(value, str) else []
    runs = data.get("runs")
    for run in (runs.values() if isinstance(runs, dict) else runs if isinstance(runs, list) else []):
        if isinstance(run, dict) and isinstance(run.get("machine"), dict):
            found.append(run["machine"])
    if isinstance(data.get("train"), dict) and isinstance(data["train"].get("device"), str):
        found.append({"trained_on": data["train"]["device"]})
    return found


VENDORS = {"amd-epyc-": "amd epyc", "intel-xeon-": "intel", "nvidia-": "nvidia"}


def _disagreements(folder: str, record: dict) -> list[str]:
    """What of a machine record disagrees with the folder's name."""
    name, wrong = folder.lower(), []
    text = " ".join(str(record.get(k, "")) for k in ("cpu_model", "description")).strip().lower()
    isa, held = set(record.get("isa", [])), record.get("isa_held")
    generation = re.search(r"zen([0-9])", name)
    if text not in ("", "cpu"):  # "cpu": a training summary's device
        wrong += [f"'{text}' is not {word}" for prefix, word in VENDORS.items()
                  if name.startswith(prefix) and word not in text]
        if name.startswith("nvidia-") and name.split("-")[1] not in text:
            wrong.append(f"'{text}' is not {name.split('-')[1]}")
        if generation and re.search(r"zen ?[0-9]", text) and f"zen {generation.group(1)}" not in text:
            wrong.append(f"'{text}' is not {generation.group()}")
    if "trained_on" in record and record["trained_on"].startswith("cuda") != name.startswith("nvidia-"):
        wrong.append(f"trained on {record['trained_on']}")
    if isa:
        if generation and generation.group(1) == "3" and "avx512f" in isa:
            wrong.append("AVX-512 on a zen3")
        if generation and generation.group(1) in "45" and ("avx512_bf16" not in isa or "amx_bf16" in isa):
            wrong.append(f"{sorted(isa)} on a {generation.group()}")
        if "amx" in name.split("-") and "amx_bf16" not in isa:
            wrong.append("no AMX")
    if held is not None and bool(held) != ("-held-" in name):
        wrong.append(f"isa_held {held}")
    if "date" in record:
        days = (datetime.date.fromisoformat(record["date"][:10]) - datetime.date.fromisoformat(DATE.search(folder).group())).days
        if abs(days) > 1:
            wrong.append(f"measured {record['date'][:10]}")
    return wrong


def test_results_folders_hold_what_their_names_say():
    checked, wrong = 0, []
    for path in sorted(RESULTS.rglob("*.json")):
        folder = path.relative_to(RESULTS).parts[0]
        for record in _metadata(json.loads(path.read_text())):
            checked += 1
            wrong += [f"{path.relative_to(RESULTS)}: {w}" for w in _disagreements(folder, record)]
    assert checked >= 100
    assert not wrong, "results files whose machine is not their folder's:\n" + "\n".join(wrong)


def test_a_wrong_figure_or_machine_is_caught():
    """The checks themselves: a tokens/s or a ratio off by one in its last digit, a ratio bolded as
    missed that met its target, a count of targets met, and a file of another machine."""
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert _speed_table_errors(text)[1] == []
    row = "| Zen 5, 2026-11-26 | base | 646 | 2,024 | 533 | 618 | **1.21x** | **3.14x** |"
    assert row in text
    for planted in (row.replace("2,024", "2,025"), row.replace("3.14x", "3.13x")):
        assert len(_speed_table_errors(text.replace(row, planted))[1]) == 1
    targets = "| training fp32 / HF ≥ 1.1x | 1.21x, 1.88x |"
    assert targets in text
    wrong = _speed_table_errors(text.replace(targets, "| training fp32 / HF ≥ 1.1x | **1.21x**, 1.88x |"))[1]
    assert len(wrong) == 1 and "bold" in wrong[0]
    assert len(_speed_table_errors(text.replace("| **10 of 10** |", "| **9 of 10** |"))[1]) == 1
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _readme_errors(readme)[1] == [] and "| 1.62x / 1.50x |" in readme and "(Zen 5), 2026-11-26" in readme
    assert len(_readme_errors(readme.replace("| 1.62x / 1.50x |", "| 1.62x / 1.51x |"))[1]) == 1
    stale = _readme_errors(readme.replace("(Zen 5), 2026-11-26", "(Zen 5), 2026-11-25"))[1]
    assert stale and "current run" in stale[0]
    xeon = {"cpu_model": "Intel(R) Xeon(R) Processor", "isa": ["amx_bf16", "avx512_bf16", "avx512f"],
            "date": "2026-11-26T10:49:41+00:00"}
    assert _disagreements("intel-xeon-amx-2026-11-26", xeon) == []
    assert len(_disagreements("amd-epyc-zen5-2026-11-26", xeon)) == 2  # the vendor, and AMX on a Zen 5
    assert _disagreements("intel-xeon-amx-2026-11-29", xeon) == ["measured 2026-11-26"]
    assert _disagreements("amd-epyc-zen4-2026-11-28", {"trained_on": "cuda:0"}) == ["trained on cuda:0"]
