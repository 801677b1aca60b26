"""Every shipped recipe resolves, builds its model, and the WMT14 ones match the paper."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from aiayn.model.transformer import count_preset_parameters
from aiayn.config import ConfigError, apply_sets, to_dict
from aiayn.files import write_json_atomic
from aiayn.model.config import PRESETS
from aiayn.train.config import load_recipe, run_config_from_preset, unused_settings

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.json")), ids=lambda p: p.name)
def test_recipe_resolves_and_builds(path):
    cfg = load_recipe(path)
    assert count_preset_parameters(cfg.model) > 0


@pytest.mark.parametrize("name,preset,vocab,params,steps,p_drop", [
    ("wmt14-ende-base.json", "base", 37_000, 63_045_632, 100_000, 0.1),
    ("wmt14-ende-big.json", "big", 37_000, 214_171_648, 300_000, 0.3),
    # §6.1: En-Fr big with P_drop 0.1 and a 32,000 word-piece vocabulary: 5,000 x 1,024 fewer embedding weights
    ("wmt14-enfr-big.json", "big", 32_000, 214_171_648 - 5_000 * 1024, 300_000, 0.1),
])
def test_wmt14_recipes_follow_the_paper(name, preset, vocab, params, steps, p_drop):
    import dataclasses

    from aiayn.model.config import get_preset
    cfg = load_recipe(RECIPES / name)
    t = cfg.train
    assert dataclasses.replace(cfg.model, p_drop=get_preset(preset).p_drop) == get_preset(preset, vocab_size=vocab)
    assert count_preset_parameters(cfg.model) == params  # 65M / 213M in Table 3 (see test_params.py)
    assert t.max_steps == steps and cfg.model.p_drop == p_drop
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.warmup_steps, t.eps_ls) == (0.9, 0.98, 1e-9, 4000, 0.1)
    assert t.max_tgt_tokens * 8 * t.accum_steps == 25_000  # per-device x 8 devices x accumulation
    assert not cfg.model.pre_norm


@pytest.mark.parametrize("name, step_s, averaged", [
    ("wmt14-ende-base.json", 0.4, 5), ("wmt14-ende-big.json", 1.0, 20), ("wmt14-enfr-big.json", 1.0, 20)])
def test_wmt14_checkpoints_are_saved_by_steps_for_the_papers_average(name, step_s, averaged):
    """§6.1 averages the last 5 (base) / 20 (big) checkpoints "written at 10-minute intervals" on 8 P100s
    at ~0.4 / ~1.0 s a step (§5.2): the recipes save every that many steps, on any hardware, and keep
    the ones averaged, so the average spans the updates the paper's did (50 / 200 minutes of them)."""
    cfg = load_recipe(RECIPES / name)
    t = cfg.train
    assert t.save_every_min == 0 and t.save_every_steps > 0  # by steps only: no checkpoint by wall time
    assert t.save_every_steps * averaged * step_s == pytest.approx(averaged * 10 * 60)  # steps x s/step = 10 min each
    assert t.keep_last == averaged  # what the average stage reads, and no more
    assert f"average the last {averaged} checkpoints" in json.loads((RECIPES / name).read_text())["description"]


def test_recipe_unknown_key_is_an_error(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text('{"preset": "tiny", "train": {"warmup": 5}}')
    with pytest.raises(ValueError, match="unknown field 'warmup'"):
        load_recipe(bad)


def test_multi30k_tiny_is_wu_et_al_transformer_tiny():
    """recipes/multi30k-tiny.json is fairseq's transformer_tiny as Wu et al. (2021) trained it:
    d_model 128, d_ff 256, 4+4 layers, 4 heads, post-norm, all embeddings shared, dropout 0.3,
    peak rate 0.005 reached at step 2,000."""
    from aiayn.train.objective import learning_rate
    cfg = load_recipe(RECIPES / "multi30k-tiny.json")
    m, t = cfg.model, cfg.train
    assert (m.d_model, m.d_ff, m.n_layers, m.n_heads, m.d_k, m.p_drop) == (128, 256, 4, 4, 32, 0.3)
    assert not m.pre_norm and m.tie_embeddings and m.tie_src_tgt_embeddings
    # 8000 x 128 shared embedding + 4 x (4 x 128^2 + 4 x 128 attn, 2 x 128 x 256 + 256 + 128 FFN, 2 LN)
    # encoder layers + 4 decoder layers with a second attention and LN; the paper's models have no final LN
    assert count_preset_parameters(m) == 2_349_056
    peak = learning_rate(t.warmup_steps, m.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.lr_decay_frac)
    assert peak == pytest.approx(0.005, rel=2e-3)
    assert t.max_tgt_tokens == 8192 and t.max_time_min == 45


@pytest.mark.parametrize("name,tokens,steps,warmup,scale,peak,peak_rel,probe,lsgd,p_drop,weight_decay,d_ff,params", [
    # aiayn demo's: 2,048-token batches per process, 2 DDP processes, so 4,096-token steps, half the
    # baseline's batch: peak 0.005 * sqrt(4096 / 8192) = 0.00354, rounded to 0.0035
    # (scale 2.5 * 128^-0.5 * 4000^-0.5 = 0.00349), ramp to 0 over steps 7,250-14,500; dropout 0.25
    # here, the baseline's 0.3 otherwise; decoupled weight decay 0.2 here, none otherwise; d_ff 1536 here:
    # 2,349,056 + 4 x 2 x (128 x 1280 + 1280 x 128 + 1280) parameters
    ("multi30k.json", 2048, 14500, 4000, 2.5, 0.0035, 2e-3, 10875, 0, 0.25, 0.2, 1536, 4_980_736),
    # local SGD: the same batches, the d_ff 256 model, each process its own 2,048-token steps:
    # peak 0.005 * sqrt(2048 / 8192) = 0.0025 (scale 1.77 * 128^-0.5 * 4000^-0.5 = 0.00247)
    ("multi30k-lsgd.json", 2048, 14500, 4000, 1.77, 0.0025, 0.02, 10875, 8, 0.3, 0.0, 256, 2_349_056),
    # 4,096-token steps in one process, peak 0.0035 (scale 1.77 * 128^-0.5 * 2000^-0.5),
    # ramp to 0 over steps 4,000-8,000
    ("multi30k-4k.json", 4096, 8000, 2000, 1.77, 0.0035, 2e-3, 6000, 0, 0.3, 0.0, 256, 2_349_056),
])
def test_demo_recipes_are_the_tiny_model_with_a_smaller_batch(name, tokens, steps, warmup, scale, peak, peak_rel,
                                                                   probe, lsgd, p_drop, weight_decay, d_ff, params):
    """recipes/multi30k.json (aiayn demo's), multi30k-lsgd.json and multi30k-4k.json are
    multi30k-tiny.json with fewer tokens per step, more steps, the peak rate scaled by about the square
    root of the batch ratio, then a linear ramp to 0 over the second half; multi30k.json also with less
    dropout, weight decay and a wider feed-forward layer."""
    import dataclasses

    from aiayn.train.objective import learning_rate
    main_job, tiny = load_recipe(RECIPES / name), load_recipe(RECIPES / "multi30k-tiny.json")
    assert (main_job.model.p_drop, main_job.model.d_ff) == (p_drop, d_ff)
    assert dataclasses.replace(main_job.model, p_drop=tiny.model.p_drop, d_ff=tiny.model.d_ff) == tiny.model
    assert count_preset_parameters(main_job.model) == params
    t = main_job.train
    assert (t.max_src_tokens, t.max_tgt_tokens, t.max_steps, t.warmup_steps) == (tokens, tokens, steps, warmup)
    assert (t.max_time_min, t.lr_decay_frac, t.save_every_min, t.local_sgd_period) == (45, 0.5, 2.5, lsgd)
    assert t.lr_scale == scale and t.weight_decay == weight_decay and tiny.train.weight_decay == 0
    assert learning_rate(warmup, 128, warmup, t.lr_scale, t.max_steps, t.lr_decay_frac) == pytest.approx(peak, rel=peak_rel)
    # Eq. 3 at the probe step (three quarters of the run) times the ramp, which is at one half there
    assert learning_rate(probe, 128, warmup, t.lr_scale, t.max_steps, t.lr_decay_frac) == pytest.approx(
        scale * 128 ** -0.5 * probe ** -0.5 * 0.5, rel=1e-6)
    assert t.lr_decay_by_time == (name != "multi30k-4k.json")


def test_recipe_errors_name_the_file_and_line(tmp_path):
    """A bad field or value in a recipe is reported at its line of the file, not as a --set option."""
    bad = tmp_path / "r.json"
    bad.write_text('{\n  "preset": "tiny",\n  "model": {"d_model": 64},\n  "train": {\n    "seed": 3,\n'
                   '    "d_model": 7,\n    "fused_adam": "perhaps"\n  }\n}\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:6: train.d_model: unknown field 'd_model'"):
        load_recipe(bad)
    bad.write_text(bad.read_text().replace('    "d_model": 7,\n', ""))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:6: train.fused_adam: expected a boolean"):
        load_recipe(bad)


def test_gpu_recipe_is_the_cpu_recipe_in_one_process():
    """recipes/multi30k-gpu.json: multi30k.json's model, regularization and schedule, its 4,096-token
    steps taken by one process (2 x 2,048 on the CPU), on an 8-minute clock; the demo takes it where
    CUDA is present and no recipe is named."""
    import dataclasses

    from aiayn.demo.stages import default_recipe
    cpu, gpu = load_recipe(RECIPES / "multi30k.json"), load_recipe(RECIPES / "multi30k-gpu.json")
    assert gpu.model == cpu.model
    same = ("max_src_tokens", "max_tgt_tokens", "max_time_min", "save_every_min", "save_every_frac", "keep_last",
            "log_every_steps", "threads")
    assert dataclasses.replace(gpu.train, **{k: getattr(cpu.train, k) for k in same}) == cpu.train
    assert (gpu.train.max_src_tokens, gpu.train.max_tgt_tokens) == (2 * cpu.train.max_src_tokens, 4096)
    assert (gpu.train.max_time_min, gpu.train.threads) == (8, 0)
    # checkpoints by the share of the run, which ends at its step cap on a fast GPU, at 8 minutes on a slow one
    assert (gpu.train.save_every_min, gpu.train.save_every_frac, gpu.train.keep_last) == (0, 0.04, 10)
    assert default_recipe(False, cuda=True).name == "multi30k-gpu.json"
    assert default_recipe(False, cuda=False).name == "multi30k.json"
    assert default_recipe(True, cuda=True).name == "multi30k-quick.json"


def test_recipes_ship_inside_the_package():
    """The recipes are package data (an installed aiayn runs `aiayn demo` without a checkout);
    recipes/ in the checkout is the same folder."""
    import aiayn
    from aiayn.demo.config import RECIPES
    assert RECIPES == Path(aiayn.__file__).resolve().parent / "recipes"
    assert {p.name for p in RECIPES.glob("*.json")} == {p.name for p in (RECIPES.parents[2] / "recipes").glob("*.json")}
    assert (RECIPES / "multi30k.json").is_file() and (RECIPES / "multi30k-gpu.json").is_file()


def test_the_docs_recipe_paths_run_outside_a_checkout(tmp_path, monkeypatch):
    """`--recipe recipes/NAME.json`, as the docs write it, in a folder without recipes/ (an installed
    aiayn, run anywhere): the installed recipe of that name; a file of that path that is there wins."""
    monkeypatch.chdir(tmp_path)
    assert load_recipe("recipes/wmt14-ende-base.json") == load_recipe(RECIPES / "wmt14-ende-base.json")
    with pytest.raises(ConfigError, match=r"recipes/no-such\.json: recipe file not found"):
        load_recipe("recipes/no-such.json")
    with pytest.raises(ConfigError, match=r"elsewhere/wmt14-ende-base\.json: recipe file not found"):
        load_recipe("elsewhere/wmt14-ende-base.json")  # only recipes/NAME.json, the installed folder's name
    (tmp_path / "recipes").mkdir()
    write_json_atomic(tmp_path / "recipes" / "wmt14-ende-base.json", {"preset": "tiny"})
    assert load_recipe("recipes/wmt14-ende-base.json").model == run_config_from_preset("tiny").model


@pytest.mark.parametrize("text, want", [("2", 2), ("none", None), ("null", None), ("None", None)])
def test_set_reads_a_field_that_may_be_none(text, want):
    """``n_dec_layers: int | None``: a number, or none (the encoder's depth)."""
    cfg = apply_sets(run_config_from_preset("tiny"), [f"model.n_dec_layers={text}"])
    assert cfg.model.n_dec_layers == want


def test_set_refuses_a_word_for_a_number_that_may_be_none():
    with pytest.raises(ConfigError, match=r"--set model.n_dec_layers: expected int, got 'two'"):
        apply_sets(run_config_from_preset("tiny"), ["model.n_dec_layers=two"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_run_directorys_config_json_is_its_recipe(preset, tmp_path):
    """config.json, as the checkpoints write it (every field, null for none), read back as a recipe
    gives the same configuration: ``--recipe RUN/config.json`` trains the run again."""
    cfg = apply_sets(run_config_from_preset(preset), ["model.n_dec_layers=1", "model.tie_src_tgt_embeddings=false",
                                                      "model.tgt_vocab_size=37", "train.eps_ls=0"])
    path = tmp_path / "config.json"
    write_json_atomic(path, to_dict(cfg))  # RunCheckpoints' own call
    assert load_recipe(path) == cfg
    path.write_text(json.dumps(to_dict(run_config_from_preset(preset))))
    assert load_recipe(path) == run_config_from_preset(preset)


@pytest.mark.parametrize("order", [1, -1])
def test_fields_that_change_together_may_come_in_either_order(order):
    """Separate vocabularies need the untied embeddings: the section is checked once, with both set."""
    sets = ["model.tgt_vocab_size=37", "model.tie_src_tgt_embeddings=false"][::order]
    cfg = apply_sets(run_config_from_preset("tiny"), sets)
    assert (cfg.model.tgt_vocab_size, cfg.model.tie_src_tgt_embeddings) == (37, False)
    with pytest.raises(ConfigError, match="need tie_src_tgt_embeddings=false"):
        apply_sets(run_config_from_preset("tiny"), sets[:1] if order == 1 else sets[1:])


@pytest.mark.parametrize("key", ["max_steps", "max_epochs", "max_time_min", "save_every_steps", "save_every_min",
                                 "validate_every_steps", "patience", "log_every_steps", "threads"])
def test_a_negative_count_or_length_is_refused(key):
    """train.max_steps=-5 trained 0 steps and said nothing: a count or a length of the run is >= 0."""
    with pytest.raises(ConfigError, match=f"{key} must be >= 0, got -5"):
        apply_sets(run_config_from_preset("tiny"), [f"train.{key}=-5"])


def test_a_sections_own_check_names_the_section_and_the_recipe(tmp_path):
    """A check across a section's fields names the section (the key a user writes), and in a recipe the file."""
    with pytest.raises(ConfigError, match=r"^train: best_metric=bleu needs valid_bleu=true$"):
        apply_sets(run_config_from_preset("tiny"), ["train.best_metric=bleu"])
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"preset": "tiny", "train": {"best_metric": "bleu"}}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: train: best_metric=bleu needs valid_bleu=true$"):
        load_recipe(path)
    path.write_text('{"train": {\n  "accum_steps": "x"}}')  # a field's own parse keeps its line
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2: train.accum_steps: expected int"):
        load_recipe(path)


@pytest.mark.parametrize("setting, says", [
    ("train.lr_scale=nan", "lr_scale must be a finite number, got nan"),
    ("train.weight_decay=inf", "weight_decay must be a finite number, got inf"),
    ("train.lr_scale=0", "lr_scale must be > 0"),
    ("train.adam_beta1=1.5", "adam_beta1 and adam_beta2 must be in [0, 1)"),
    ("train.adam_eps=-1", "adam_eps must be >= 0"),
    ("train.clip_norm=-1", "clip_norm must be >= 0 (0 = off), got -1.0"),
    ("train.seed=-1", "seed must be in [0, 2^63)"),
    ("train.seed=99999999999999999999", "seed must be in [0, 2^63)"),
    ("train.device=tpu", "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("model.max_positions=0", "max_positions = 0: outside [1, 1,048,576]"),
    ("train.max_steps=2.5e0", "expected int, got '2.5e0'"),
    ("train.save_every_steps=5e-1", "expected int, got '5e-1'"),
])
def test_a_value_the_run_cannot_use_is_refused_before_it_starts(setting, says):
    """Values that torch or numpy would refuse with a traceback mid-start, and sizes every later load
    of the checkpoints refuses (``check_limits``), are one ConfigError at once."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        apply_sets(run_config_from_preset("tiny"), [setting])


@pytest.mark.parametrize("sets, says", [
    (["train.valid_beam=1"], ["train.valid_beam=1 has no effect without train.valid_bleu=true"]),
    (["train.valid_bleu_max_lines=50"], ["train.valid_bleu_max_lines=50 has no effect without train.valid_bleu=true"]),
    (["train.bpe_dropout_target=false"], ["train.bpe_dropout_target=false has no effect without train.bpe_dropout > 0"]),
    (["train.valid_beam=1", "train.valid_bleu=true"], []),
    (["train.bpe_dropout_target=false", "train.bpe_dropout=0.1"], []),
    (["train.valid_beam=4"], []),  # the default: nothing was asked for
])
def test_a_setting_that_refines_one_that_is_off_is_said(sets, says):
    """A field set away from its default whose run ignores it, as what it refines is off, is a line
    (the run logs it as a warning at its start), not an error: a recipe may carry it on purpose."""
    assert unused_settings(apply_sets(run_config_from_preset("tiny"), sets).train) == says


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.json")), ids=lambda p: p.name)
def test_shipped_recipes_set_nothing_they_do_not_use(path):
    assert unused_settings(load_recipe(path).train) == []


def test_a_whole_number_may_be_written_as_a_float():
    cfg = apply_sets(run_config_from_preset("tiny"), ["train.max_steps=1e2"])
    assert cfg.train.max_steps == 100


@pytest.mark.parametrize("text, says", [
    ('{"preset": "tiny", "model": [1]}', "model must be an object of fields, got list"),
    ('{"preset": "tiny", "train": "x"}', "train must be an object of fields, got str"),
    ('[1, 2]', "a recipe is a JSON object"),
    ('{"preset": "bse"}', "unknown preset 'bse'; known: base,"),
    ('{"preset": ["base"]}', 'preset must be a name (a string), got ["base"]'),
    ('{"train": {"max_steps": 1e2}}', None),
])
def test_a_recipe_of_the_wrong_shape_names_the_file(tmp_path, text, says):
    path = tmp_path / "r.json"
    path.write_text(text)
    if says is None:
        assert load_recipe(path).train.max_steps == 100
        return
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {re.escape(says)}"):
        load_recipe(path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}: cannot read the recipe"):
        load_recipe(tmp_path)


@pytest.mark.parametrize("name", ["multi30k-quick.json", "multi30k-gpu.json"])
def test_budgeted_recipes_space_checkpoints_by_the_share_of_the_run(name):
    """The recipes that stop at their step cap on a fast machine and at their budget on a slow one
    write a checkpoint at every 4% of the run, not by the clock: the 5 that the demo averages span the
    run's last 16% either way (saved by the clock, a run that reached its step cap in half its minutes
    averaged weights from the first half of it), and the run keeps twice those."""
    from aiayn.demo.config import DemoConfig
    t = load_recipe(RECIPES / name).train
    averaged = DemoConfig().average_last
    assert (t.save_every_min, t.save_every_steps) == (0, 0)
    assert t.save_every_frac * (averaged - 1) == pytest.approx(0.16)
    assert t.keep_last == 2 * averaged
