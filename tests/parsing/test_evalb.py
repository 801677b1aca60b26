"""EVALB reproduction: the reference outputs shipped with EVALB, then single semantics by hand."""
import dataclasses
import math

import pytest

from aiayn.errors import InputError
from aiayn.parsing.evalb import ERROR, OK, SKIP, EvalbAborted, evalb, read_lines, score_sentence
from aiayn.parsing.evalb_params import COLLINS, EvalbParams, parse_params, read_params
from aiayn.parsing.evalb_report import format_report

RULE = "=" * 76


def split_rsl(text):
    """(table rows as token lists, totals row tokens, summary lines) of an EVALB report."""
    lines = text.split("\n")
    first, second = [i for i, line in enumerate(lines) if line == RULE]
    rows = [line.split() for line in lines[first + 1:second] if line.strip()]
    totals = lines[second + 1].split()
    summary = [line for line in lines[second + 2:] if line.strip()]
    return rows, totals, summary


def run_fixture(evalb_dir, gold, test, prm):
    result = evalb(read_lines(evalb_dir / gold), read_lines(evalb_dir / test), read_params(evalb_dir / prm))
    return result, format_report(result)


def test_sample_fixture_exact(evalb_dir):
    result, report = run_fixture(evalb_dir, "sample/sample.gld", "sample/sample.tst", "sample/sample.prm")
    expected = (evalb_dir / "sample/sample.rsl").read_text()
    # sample.rsl predates the "Bracketing FMeasure" line; otherwise identical, character for character.
    without_f = "".join(line for line in report.splitlines(True) if not line.startswith("Bracketing FMeasure"))
    assert without_f == expected
    assert [r.status for r in result.sentences].count(ERROR) == 5
    assert [line for line in report.splitlines() if "FMeasure" in line] == [
        "Bracketing FMeasure       =  89.12", "Bracketing FMeasure       =  83.20"]


def test_bug_fixture_exact(evalb_dir):
    """new.prm with QUOTE_LABEL: the bug-fixed EVALB re-inserts deleted quotes (bug.rsl-new)."""
    result, report = run_fixture(evalb_dir, "bug/bug.gld", "bug/bug.tst", "new.prm")
    exp_rows, exp_totals, exp_summary = split_rsl((evalb_dir / "bug/bug.rsl-new").read_text())
    rows, totals, summary = split_rsl(report)
    assert rows == exp_rows            # whole per-sentence table (bug.rsl-new lost its leading blanks)
    assert totals == exp_totals
    assert summary == exp_summary      # includes Bracketing FMeasure 60.17 / 59.26
    assert result.errors == []


def test_bug_fixture_old_evalb(evalb_dir):
    """Without QUOTE_LABEL (sample.prm) every sentence is a length error, as bug.rsl-old shows."""
    result = evalb(read_lines(evalb_dir / "bug/bug.gld"), read_lines(evalb_dir / "bug/bug.tst"),
                   read_params(evalb_dir / "sample/sample.prm"))
    expected = (evalb_dir / "bug/bug.rsl-old").read_text()
    assert result.errors == [line for line in expected.splitlines() if "Length unmatch" in line]
    exp_rows, exp_totals, exp_summary = split_rsl(
        "\n".join(line for line in expected.splitlines() if "unmatch" not in line))
    rows, totals, summary = split_rsl(format_report(result))
    # That EVALB version printed 0 words on error rows; sample.rsl's prints the gold count (ours).
    assert [r[:9] + r[10:] for r in rows] == [r[:9] + r[10:] for r in exp_rows]
    assert [r[9] for r in rows] == ["33", "19", "44", "24", "38"]
    assert totals == exp_totals == ["0", "0", "0.00"]
    assert summary == exp_summary
    assert result.all.valid == 0 and math.isnan(result.all.fmeasure)


def test_collins_prm_file_equals_builtin(evalb_dir):
    assert read_params(evalb_dir / "COLLINS.prm") == COLLINS


def test_new_prm(evalb_dir):
    p = read_params(evalb_dir / "new.prm")
    assert p.delete_labels == ("TOP", "S1", "-NONE-", ",", ":", "``", "''", ".", "?", "!")
    assert p.quote_labels == ("``", "''", "POS", "NN", "CD", "VBZ", ":")
    assert (p.max_error, p.cutoff_len, p.labeled, p.debug) == (10, 40, 1, 0)
    assert read_params(evalb_dir / "nk.prm").max_error == 10000


def test_sample_prm_settings(evalb_dir):
    p = read_params(evalb_dir / "sample/sample.prm")
    assert p.eq_labels == (("T", "TT"),) and p.eq_words == (("This", "this"),)
    assert "." not in p.delete_labels and ":" in p.delete_labels


@pytest.mark.parametrize("text,message", [
    ("LABELLED 0\n", "unknown keyword"),
    ("MAX_ERROR ten\n", "integer"),
    ("EQ_LABEL ADVP\n", "two values"),
    ("DELETE_LABEL A B\n", "one label"),
    ("# c\nDEBUG\n", "no value"),
])
def test_param_errors_name_the_line(text, message):
    with pytest.raises(InputError, match=message) as info:
        parse_params(text, "x.prm")
    assert info.value.line == text.count("\n")


def test_params_come_from_the_file(evalb_dir):
    """Editing the parameter text changes the verdicts: nothing is hard-coded."""
    gold = read_lines(evalb_dir / "sample/sample.gld")
    test = read_lines(evalb_dir / "sample/sample.tst")
    text = (evalb_dir / "sample/sample.prm").read_text()
    base = evalb(gold, test, parse_params(text))
    assert base.sentences[18].status == OK                       # "This" = "this" by EQ_WORD
    assert base.sentences[17].correct_tags == 4                  # T = TT by EQ_LABEL
    edited = text.replace("EQ_WORD", "#EQ_WORD").replace("EQ_LABEL T TT", "#").replace(
        "CUTOFF_LEN 40", "CUTOFF_LEN 3").replace("LABELED 1", "LABELED 0")
    changed = evalb(gold, test, parse_params(edited))
    assert changed.sentences[18].status == ERROR
    assert changed.sentences[17].correct_tags == 3
    assert changed.cut.sentences == 0 and "-- len<=3 --" in format_report(changed)
    assert changed.sentences[1].match == 4                       # A vs C label ignored when unlabeled
    assert base.sentences[1].match == 3


def test_max_error(evalb_dir):
    gold = read_lines(evalb_dir / "sample/sample.gld")
    test = read_lines(evalb_dir / "sample/sample.tst")
    # 5 errors; EVALB exits on the error it counts past MAX_ERROR (its test: count++ > MAX_ERROR).
    params = read_params(evalb_dir / "sample/sample.prm")
    assert len(evalb(gold, test, dataclasses.replace(params, max_error=4)).errors) == 5
    with pytest.raises(EvalbAborted, match=r"g:20( and t:20)?: .*MAX_ERROR=3"):
        evalb(gold, test, dataclasses.replace(params, max_error=3), gold_name="g", test_name="t")


def test_line_count_mismatch():
    line = "(S (A (P a)) (B (Q b)))"
    r = evalb([line, line], [line], EvalbParams())
    assert len(r.sentences) == 1 and r.errors == ["2 : Number of lines unmatch (too many lines in gold file)"]
    r = evalb([line], [line, line], EvalbParams())
    assert r.all.valid == 1 and r.errors == ["2 : Number of lines unmatch (too many lines in test file)"]


def test_hand_computed_sentence():
    """Gold brackets (after deleting '.'): S[0,4] NP[0,2] VP[2,4] PP[3,4]; test: S[0,4] NP[0,3] ADVP->PRT."""
    gold = "(S (NP (DT the) (NN dog)) (VP (VBZ runs) (PRT (RB off))) (. .))"
    test = "(S (NP (DT the) (NN dog) (VBZ runs)) (ADVP (RB off)) (. .))"
    r = score_sentence(gold, test, COLLINS)
    # matched: S, ADVP=PRT (EQ_LABEL); NP[0,3] crosses VP[2,4]; length counts '.' (only -NONE- excluded)
    assert (r.status, r.length, r.words, r.gold, r.test, r.match, r.crossing) == (OK, 5, 4, 4, 3, 2, 1)
    assert r.correct_tags == 4
    assert round(r.recall, 2) == 50.0 and round(r.precision, 2) == 66.67


def test_labels_are_trimmed_and_deleted_brackets_ignored():
    gold = "(TOP (S-1 (NP-SBJ=2 (PRP it)) (VP (VBZ is) (-NONE- *)) (. .)))"
    test = "(S (NP (PRP it)) (VP (VBZ is)) (. .))"
    r = score_sentence(gold, test, COLLINS)
    assert (r.gold, r.test, r.match, r.length, r.words) == (3, 3, 3, 3, 2)


def test_skip_and_errors():
    gold = "(S (NN a) (NN b))"
    assert score_sentence(gold, "", COLLINS).status == SKIP
    assert score_sentence(gold, "(S (. .))", COLLINS).status == SKIP     # no word survives deletion
    assert score_sentence(gold, "(S (NN a) (NN c))", COLLINS).errors == ("Words unmatch (b|c)",)
    unbalanced = score_sentence(gold, "(S (NN a) (NN b)", COLLINS)
    assert unbalanced.status == ERROR and "too many open" in unbalanced.errors[0]
    with pytest.raises(EvalbAborted, match="outside"):
        score_sentence(gold, "(S a b)", COLLINS)


def test_warnings_and_aborts_name_the_file_they_are_about(caplog):
    """A reading error names the file it is in (gold or test), a pair's words both files; an extra
    line the file that has it."""
    gold = "(S (NN a) (NN b))"
    with caplog.at_level("WARNING"):
        evalb([gold, gold, gold], [gold, "(S (NN a) (NN b)", "(S (NN a) (NN c))", gold], COLLINS,
              gold_name="g.txt", test_name="t.txt")
    assert [r.getMessage() for r in caplog.records] == [
        "t.txt:2: Bracketing is unbalanced (too many open bracket)",
        "g.txt:3 and t.txt:3: Words unmatch (b|c)",
        "t.txt:4: Number of lines unmatch (too many lines in test file)"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        evalb([gold, "(S (NN a) (NN b)))"], [gold], COLLINS, gold_name="g.txt", test_name="t.txt")
    assert [r.getMessage() for r in caplog.records] == ["g.txt:2: Number of lines unmatch (too many lines in gold file)"]
    with pytest.raises(EvalbAborted, match=r"^t\.txt:2: Reading sentence: 'stray' outside"):
        evalb([gold, gold], [gold, "(S stray (NN a) (NN b))"], COLLINS, gold_name="g.txt", test_name="t.txt")
    with pytest.raises(EvalbAborted, match=r"^g\.txt:1: Reading sentence"):
        evalb(["(S (NN a) stray (NN b))"], [gold], COLLINS, gold_name="g.txt", test_name="t.txt")


def test_files_are_read_as_text_files_are_everywhere(tmp_path):
    """Bracketing and parameter files: gzip by content, a BOM dropped, invalid UTF-8 named by line and byte."""
    import gzip

    from aiayn.errors import InputError, UserError
    line = "(S (NN a) (NN b))"
    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbf" + (line + "\n").encode())
    assert read_lines(tmp_path / "bom") == [line]
    (tmp_path / "gz").write_bytes(gzip.compress((line + "\n" + line + "\n").encode()))
    assert read_lines(tmp_path / "gz") == [line, line]
    (tmp_path / "bad").write_bytes((line + "\n").encode() + b"(S (NN \xe9t\xe9))\n")
    with pytest.raises(InputError, match=r"bad:2: invalid UTF-8 \(byte 8 of the line"):
        read_lines(tmp_path / "bad")
    with pytest.raises(UserError, match=r": not a regular file"):
        read_lines(tmp_path)
    (tmp_path / "mac.prm").write_bytes(b"DEBUG 1\rMAX_ERROR 7\r\nCUTOFF_LEN 9\r")  # line ends as text mode reads them
    mac = read_params(tmp_path / "mac.prm")
    assert (mac.debug, mac.max_error, mac.cutoff_len) == (1, 7, 9)
    (tmp_path / "p.prm").write_bytes(b"DEBUG 0\nMAX_ERROR \xff\n")
    with pytest.raises(InputError, match=r"p\.prm:2: invalid UTF-8"):
        read_params(tmp_path / "p.prm")
