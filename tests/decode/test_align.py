"""Word alignments from attention: the argmax rule on hand-made weights and on a trained copy model."""
from __future__ import annotations

import numpy as np
import pytest

from aiayn.cli import main
from aiayn.decode.align import hard_alignment, pharaoh
from aiayn.errors import UserError
from tests.conftest import copy_lines


def test_argmax_rule_on_hand_made_attention():
    """2 layers, 2 heads, 3 target tokens + EOS row, 3 source tokens + EOS column."""
    cross = np.zeros((2, 2, 4, 4), dtype=np.float32)
    # layer 1: head 0 says 2, 0, 1; head 1 is uniform; the EOS column is the largest of all, and ignored
    cross[1, 0, :, :] = [[0.1, 0.1, 0.5, 0.3], [0.4, 0.0, 0.0, 0.6], [0.2, 0.3, 0.0, 0.5], [0, 0, 0, 1]]
    cross[1, 1, :, :] = 0.25
    # layer 0: heads disagree; their mean decides (head 0 weakly on 0, head 1 strongly on 1)
    cross[0, 0, :, :] = [0.4, 0.3, 0.3, 0.0]
    cross[0, 1, :, :] = [0.0, 0.9, 0.1, 0.0]
    assert hard_alignment(cross, -1, 3, 3) == [(2, 0), (0, 1), (1, 2)]
    assert hard_alignment(cross, 1, 3, 3) == hard_alignment(cross, -1, 3, 3)
    assert hard_alignment(cross, 0, 3, 3) == [(1, 0), (1, 1), (1, 2)]
    assert hard_alignment(cross, 0, 3, 2) == [(1, 0), (1, 1)]  # a target of 2 tokens: 2 rows
    assert hard_alignment(cross, 0, 0, 3) == [] and pharaoh([]) == ""
    assert pharaoh([(2, 0), (0, 1), (1, 2)]) == "2-0 0-1 1-2"
    with pytest.raises(UserError, match="the model has 2 decoder layers"):
        hard_alignment(cross, 2, 3, 3)


# What a trained model's attention attends to is learnt, so it moves with every rounding of its training
# (AVX2, AVX-512 and AMX builds train different copy models: 84-91% of tokens on the diagonal, either
# layer, 200 or 400 steps). The floor asks for what any of them has: far above chance (a random source
# position of 3-8 words is right about 1 time in 5), with room for the spread between instruction sets.
@pytest.mark.parametrize("layer", ["-1", "0"])
def test_copy_task_aligns_each_token_with_itself(copy_checkpoint, tmp_path, capsys, layer, share=0.75):
    lines = copy_lines(30, seed=7)
    src = tmp_path / "src.txt"
    src.write_text("\n".join(lines) + "\n\n")  # a last empty line: " ||| "
    assert main(["translate", "--checkpoint", str(copy_checkpoint), "--input", str(src), "--beam-size", "1",
                 "--alignments", "--alignment-layer", layer]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 31 and out[-1] == " ||| "
    right = total = copied = 0
    for line, row in zip(lines, out):
        text, align = row.split(" ||| ")
        pairs = [tuple(map(int, p.split("-"))) for p in align.split()]
        n_tgt = len(text.split())  # one piece per word in this task
        assert [j for _, j in pairs] == list(range(n_tgt))
        assert all(0 <= i < len(line.split()) for i, _ in pairs)
        if text == line:  # a copy: the right alignment is i-i
            copied += 1
            right += sum(i == j for i, j in pairs)
            total += len(pairs)
    assert copied >= 20 and right >= share * total, (copied, right, total)


def test_alignment_layer_out_of_range(copy_checkpoint, tmp_path, capsys):
    src = tmp_path / "src.txt"
    src.write_text("a b\n")
    assert main(["translate", "--checkpoint", str(copy_checkpoint), "--input", str(src), "--alignments",
                 "--alignment-layer", "2"]) == 2
    assert "the model has 2 decoder layers" in capsys.readouterr().err


def test_nbest_lines_end_with_their_alignment(copy_checkpoint, tmp_path, capsys):
    src = tmp_path / "src.txt"
    src.write_text("a b c\n")
    assert main(["translate", "--checkpoint", str(copy_checkpoint), "--input", str(src), "--alignments",
                 "--beam-size", "2", "--nbest", "2"]) == 0
    rows = [r.split(" ||| ") for r in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(len(r) == 4 and r[0] == "0" for r in rows)
    assert rows[0][1] == "a b c" and rows[0][3] == "0-0 1-1 2-2"
