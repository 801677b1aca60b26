"""Ensembles: the mean of the members' next-token probabilities (``EnsembleDecoder``), ensemble
files, and `aiayn translate` / `aiayn ensemble` with several checkpoints."""
from __future__ import annotations

import json
import math

import pytest
import torch

import aiayn.model as M
from aiayn.cli import main
from aiayn.decode.adapter import CachedDecoder, EnsembleDecoder, RecomputeDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import SpecialIds, search
from aiayn.decode.translator import Translator
from aiayn.errors import UserError
from aiayn.checkpoint import (ENSEMBLE_FORMAT, atomic_save, average_checkpoints, ensemble_checkpoint,
                                    load_checkpoint)

from tests.decode.stub import EOS, TableDecoder
from tests.decode.test_adapter import sources
from tests.arith import PT_EXP_REL_ERR, PT_LOG_REL_ERR, U32, gamma
from tests.rounding import same_float_search
from tests.decode.test_translator import LINES, make_checkpoint, spm_bytes  # noqa: F401 (fixture)

V = 24


def mean_log_bound(members: list[float]) -> float:
    """How far the ensemble's float32 log(mean of the members' p) may be from its exact value, from
    the members' exact log p (-inf: p = 0, left out), as ``EnsembleDecoder.step`` computes it:
    logsumexp over the M members (m = max; log Σ exp(x - m) + m), then - log M. Each member's log p
    rounded to float32 (u |x|: logsumexp moves by at most the largest); x - m (u |x - m|); exp (2u
    each) and the sum of M positive terms (γ_{M-1}), which move log s by their relative error; log
    (2u |log s|); + m, log M and - log M (u each of their magnitudes)."""
    xs = [x for x in members if x != float("-inf")]
    m, M = max(xs), len(members)
    log_s = math.log(sum(math.exp(x - m) for x in xs))
    rel_s = (PT_EXP_REL_ERR + float(gamma(M - 1))) * (1 + float(gamma(M)))  # of s; |log(1 + e)| <= e / (1 - e)
    out = log_s + m - math.log(M)
    terms = [U32 * max(abs(x) for x in xs), U32 * max(abs(x - m) for x in xs), rel_s / (1 - rel_s),
             PT_LOG_REL_ERR * abs(log_s), U32 * abs(log_s + m), U32 * math.log(M), U32 * abs(out)]
    return sum(terms) * (1 + float(gamma(2)))  # (the bound's own float64 sum, generously)



def test_the_mean_of_the_members_probabilities_by_hand():
    # after BOS, member A: p(4) = 0.6, p(5) = 0.4; member B: p(4) = 0.2, p(5) = 0.3, p(6) = 0.5.
    # The ensemble: p(4) = (0.6 + 0.2) / 2 = 0.4, p(5) = (0.4 + 0.3) / 2 = 0.35, p(6) = (0 + 0.5) / 2 = 0.25;
    # every other token has probability 0 in both, so -inf.
    a = TableDecoder({7: {(): {4: 0.6, 5: 0.4}}})
    b = TableDecoder({7: {(): {4: 0.2, 5: 0.3, 6: 0.5}}})
    ens = EnsembleDecoder([a, b])
    src = torch.tensor([[7, EOS]])
    log_probs, _ = ens.step(torch.tensor([2]), ens.start(src, 5))
    for tok, a_p, b_p in ((4, 0.6, 0.2), (5, 0.4, 0.3), (6, 0.0, 0.5)):
        members = [math.log(p) if p else float("-inf") for p in (a_p, b_p)]
        assert abs(log_probs[0, tok].item() - math.log((a_p + b_p) / 2)) <= mean_log_bound(members), tok
    assert log_probs[0, :4].eq(float("-inf")).all() and log_probs[0, 7].item() == float("-inf")


def test_greedy_follows_the_ensemble_not_a_member():
    # A prefers 4 (0.55), B prefers 5 (0.9): the mean prefers 5 (0.675 against 0.3, and 0.025
    # for 6); each then ends.
    ends = {(4,): {EOS: 1.0}, (5,): {EOS: 1.0}, (6,): {EOS: 1.0}}
    a = TableDecoder({7: {(): {4: 0.55, 5: 0.45}, **ends}})
    b = TableDecoder({7: {(): {4: 0.05, 5: 0.9, 6: 0.05}, **ends}})
    cfg, src = DecodeConfig(beam_size=1, alpha=0.0), torch.tensor([[7, EOS]])
    assert search(a, src, cfg)[0][0].tokens == (4,)
    hyp = search(EnsembleDecoder([a, b]), src, cfg)[0][0]
    # A hypothesis' log-probability: its token's step, then EOS's (log of the mean of 1 and 1: not
    # exactly 0 in float32), summed in float32.
    eos_step = mean_log_bound([0.0, 0.0])

    def within(h, pa: float, pb: float) -> bool:
        exact = math.log((pa + pb) / 2)
        bound = mean_log_bound([math.log(p) if p else float("-inf") for p in (pa, pb)]) + eos_step
        return abs(h.log_prob - exact) <= bound + float(gamma(1)) * (abs(exact) + bound)

    assert hyp.tokens == (5,) and within(hyp, 0.45, 0.9)  # (0.45 + 0.9) / 2
    beam = search(EnsembleDecoder([a, b]), src, DecodeConfig(beam_size=3, alpha=0.0, nbest=3))[0]
    assert [h.tokens for h in beam] == [(5,), (4,), (6,)]
    assert all(within(h, pa, pb) for h, (pa, pb) in zip(beam, [(0.45, 0.9), (0.55, 0.05), (0.0, 0.05)]))


def _models(n: int) -> list[M.Transformer]:
    out = []
    for seed in range(n):
        torch.manual_seed(seed)
        out.append(M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0)).double().eval())
    return out


def test_one_member_is_that_member_bit_for_bit():
    (model,) = _models(1)
    cfg = DecodeConfig(beam_size=3, max_len_b=6)
    single, ens = search(CachedDecoder(model), sources(), cfg), search(EnsembleDecoder([CachedDecoder(model)]), sources(), cfg)
    assert single == ens


def test_two_copies_of_a_model_decode_as_the_model():
    (model,) = _models(1)
    cfg = DecodeConfig(beam_size=3, max_len_b=6, nbest=2)
    single = search(CachedDecoder(model), sources(), cfg)
    twice = search(EnsembleDecoder([CachedDecoder(model), CachedDecoder(model)]), sources(), cfg)
    same_float_search([model, model], sources(), twice, single, cfg, SpecialIds(), "fp64")  # float64's roundings


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=1, max_len_b=6), DecodeConfig(beam_size=4, max_len_b=6, nbest=2)])
def test_cached_ensemble_equals_recomputed_ensemble(cfg):
    # the members' caches are reordered with the beams (EnsembleState.reorder); recomputation has no cache
    models = _models(3)
    fast = search(EnsembleDecoder([CachedDecoder(m) for m in models]), sources(), cfg)
    slow = search(EnsembleDecoder([RecomputeDecoder(m) for m in models]), sources(), cfg)
    same_float_search(models, sources(), fast, slow, cfg, SpecialIds(), "fp64")  # float64's roundings, derived
    members = [search(CachedDecoder(m), sources(), cfg) for m in models]
    assert any([[h.tokens for h in hs] for hs in r] != [[h.tokens for h in hs] for hs in fast] for r in members)


def test_each_sentence_alone_equals_inside_the_batch():
    dec = EnsembleDecoder([CachedDecoder(m) for m in _models(2)])
    cfg = DecodeConfig(beam_size=3, max_len_b=6)
    src = sources()
    batch = search(dec, src, cfg)
    for b in range(src.size(0)):
        n = int((src[b] != 0).sum())
        alone = search(dec, src[b:b + 1, :n], cfg)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batch[b]]


@pytest.fixture
def two_ckpts(tmp_path, spm_bytes):  # noqa: F811
    a = make_checkpoint(tmp_path / "a.pt", spm_bytes)
    torch.manual_seed(5)  # a second model: other weights, same tokenizer
    b = make_checkpoint(tmp_path / "b.pt", spm_bytes)
    ckpt = load_checkpoint(b)
    ckpt["model"] = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    ckpt["optimizer"] = {"state": "dropped from ensembles"}
    atomic_save(ckpt, b)
    return a, b


def test_ensemble_file_translates_as_the_checkpoints_together(two_ckpts, tmp_path):
    a, b = two_ckpts
    cfg = DecodeConfig(max_len_b=3, beam_size=3)
    together = Translator.from_checkpoint([a, b], cfg)
    assert len(together.models) == 2 and isinstance(together.decoder, EnsembleDecoder)
    atomic_save(ensemble_checkpoint([a, b]), tmp_path / "ens.pt")
    ens = load_checkpoint(tmp_path / "ens.pt", ensemble_ok=True)
    assert ens["format"] == ENSEMBLE_FORMAT and len(ens["members"]) == 2
    assert "optimizer" not in ens["members"][1]
    from_file = Translator.from_checkpoint(tmp_path / "ens.pt", cfg)
    assert from_file.translate(LINES) == together.translate(LINES)
    assert together.translate(LINES) != Translator.from_checkpoint(a, cfg).translate(LINES)
    # an ensemble file inside a list counts each of its members
    assert len(Translator.from_checkpoint([tmp_path / "ens.pt", a], cfg).models) == 3


def test_ensemble_files_are_for_translation_only(two_ckpts, tmp_path, spm_bytes):  # noqa: F811
    a, b = two_ckpts
    atomic_save(ensemble_checkpoint([a, b]), tmp_path / "ens.pt")
    with pytest.raises(UserError, match="an ensemble of 2 models"):
        load_checkpoint(tmp_path / "ens.pt")
    with pytest.raises(UserError, match="an ensemble of 2 models"):
        average_checkpoints([tmp_path / "ens.pt"])
    # members must share the tokenizers
    other = make_checkpoint(tmp_path / "other.pt", spm_bytes.replace(b"house", b"horse"))
    with pytest.raises(UserError, match="other.pt: its tokenizers differ"):
        ensemble_checkpoint([a, other])
    with pytest.raises(UserError, match="other.pt: its tokenizers differ"):
        Translator.from_checkpoint([a, other])


def test_members_without_tokenizer_hashes_are_compared_by_their_tokenizers(two_ckpts, tmp_path):
    """A checkpoint whose ``tokenizers`` entry lacks the SHA-256 keys (which loading accepts) is
    compared by its tokenizer models' bytes: another tokenizer of the same size is refused, the same
    one joins a checkpoint that carries its hashes."""
    a, _ = two_ckpts
    spm = load_checkpoint(a)["tokenizers"]["src"]
    other = make_checkpoint(tmp_path / "other.pt", spm.replace(b"house", b"horse"))
    unhashed = {}
    for name, path in (("a", a), ("other", other)):
        ckpt = load_checkpoint(path)
        ckpt["tokenizers"] = {k: v for k, v in ckpt["tokenizers"].items() if not k.endswith("_sha256")}
        unhashed[name] = tmp_path / f"{name}_unhashed.pt"
        atomic_save({k: v for k, v in ckpt.items() if k != "sha256"}, unhashed[name])
    with pytest.raises(UserError, match="other_unhashed.pt: its tokenizers differ"):
        ensemble_checkpoint([unhashed["a"], unhashed["other"]])
    with pytest.raises(UserError, match="other_unhashed.pt: its tokenizers differ"):
        Translator.from_checkpoint([unhashed["a"], unhashed["other"]])
    assert len(ensemble_checkpoint([a, unhashed["a"]])["members"]) == 2


def test_cli_translate_with_several_checkpoints_and_aiayn_ensemble(two_ckpts, tmp_path, capsys):
    a, b = two_ckpts
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    expected = Translator.from_checkpoint([a, b], DecodeConfig(max_len_b=3)).translate(LINES)
    args = ["translate", "--input", str(tmp_path / "in.txt"), "--max-len-b", "3"]
    assert main(args + ["--checkpoint", a, b]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected
    assert main(["ensemble", a, b, "--out", str(tmp_path / "e.pt")]) == 0
    assert "an ensemble of 2 model(s)" in capsys.readouterr().out
    assert main(args + ["--checkpoint", str(tmp_path / "e.pt")]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected
    assert main(["average", str(tmp_path / "e.pt"), "--out", str(tmp_path / "avg.pt")]) == 2
    assert "training, resuming, averaging and export take single checkpoints" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(tmp_path / "e.pt"), "--out", str(tmp_path / "ct2")]) == 2
    assert "an ensemble of 2 models" in capsys.readouterr().err


def test_cli_evaluate_with_several_checkpoints_scores_their_ensemble(two_ckpts, tmp_path, capsys):
    """`aiayn evaluate` takes the ensembles `aiayn translate` does (several --checkpoint files)."""
    a, b = two_ckpts
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    expected = Translator.from_checkpoint([a, b], DecodeConfig(max_len_b=3)).translate(LINES)
    hyp = tmp_path / "hyp.txt"
    assert main(["evaluate", "--checkpoint", a, b, "--src", str(tmp_path / "in.txt"), "--ref", str(tmp_path / "in.txt"),
                 "--max-len-b", "3", "--json", "--out", str(hyp)]) == 0
    capsys.readouterr()
    assert hyp.read_text().split("\n")[:-1] == expected
    assert main(["evaluate", "--checkpoint", a, str(hyp), "--src", str(tmp_path / "in.txt"),
                 "--ref", str(tmp_path / "in.txt"), "--out", str(hyp)]) == 2  # --out is one of the checkpoints
    assert "the same file as the input" in capsys.readouterr().err


def test_cli_evaluate_of_a_lowercasing_model_adds_sacrebleu_lc(two_ckpts, tmp_path, capsys, monkeypatch):
    """A model whose target tokenizer lowercases writes lowercase translations: evaluate reports
    sacreBLEU -lc beside the cased score (as the demo does with --lowercase); a cased one does not."""
    from aiayn.data.vocab import Tokenizer
    a, _ = two_ckpts
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    argv = ["evaluate", "--checkpoint", a, "--src", str(tmp_path / "in.txt"), "--ref", str(tmp_path / "in.txt"),
            "--max-len-b", "3", "--json"]
    assert main(argv) == 0
    assert "sacreBLEU -lc" not in [s["label"] for s in json.loads(capsys.readouterr().out)["scores"]]
    monkeypatch.setattr(Tokenizer, "lowercases", property(lambda self: True))
    assert main(argv) == 0
    labels = [s["label"] for s in json.loads(capsys.readouterr().out)["scores"]]
    assert labels[:2] == ["sacreBLEU", "sacreBLEU -lc"]
