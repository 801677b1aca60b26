"""How a run's configuration is put together from a preset or recipe, ``--set`` and the named options
(``--max-steps``, the demo's ``--minutes``), and how each kind of mistake in them is refused: one line
naming the option, or the recipe file and line."""
from __future__ import annotations

import argparse
import json
import re

import pytest

from aiayn.cli import main
from aiayn.commands.train import resolve_run_config
from aiayn.config import ConfigError, apply_sets
from aiayn.demo.stages import recipe_sets
from aiayn.train.config import RECIPES, load_recipe, run_config_from_preset


def _args(preset="tiny", recipe=None, sets=(), max_steps=None) -> argparse.Namespace:
    return argparse.Namespace(recipe=recipe, preset=preset, set=list(sets), max_steps=max_steps)


def test_preset_then_recipe_fields_then_sets_in_order_then_named_options(tmp_path):
    """The documented order (docs/training.md): the recipe's fields over its preset's, each --set over
    them in the order given (the last of two wins), --max-steps over all."""
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"preset": "tiny", "train": {"seed": 5, "warmup_steps": 10}}))
    cfg = resolve_run_config(_args(preset=None, recipe=str(recipe), max_steps=7,
                                   sets=["train.seed=6", "train.seed=8", "model.p_drop=0.2"]))
    assert (cfg.train.seed, cfg.train.warmup_steps, cfg.train.max_steps, cfg.model.p_drop) == (8, 10, 7, 0.2)
    assert cfg.model.d_model == run_config_from_preset("tiny").model.d_model


@pytest.mark.parametrize("sets, max_steps", [(["train.max_steps=5"], 10), (["train.max_steps=10", "train.max_steps=5"], 10)])
def test_a_named_option_and_a_set_of_its_field_that_disagree_are_refused(sets, max_steps):
    """--set train.max_steps=5 --max-steps 10 trained 10 steps without a word: which was meant is not known."""
    with pytest.raises(ConfigError, match=r"^--set train.max_steps=5 and --max-steps 10 disagree; give the field once$"):
        resolve_run_config(_args(sets=sets, max_steps=max_steps))


def test_a_named_option_and_a_set_that_agree_are_one_value():
    assert resolve_run_config(_args(sets=["train.max_steps=1e1"], max_steps=10)).train.max_steps == 10


def test_parse_trains_own_defaults_yield_to_max_steps(monkeypatch, tmp_path):
    """`aiayn parse train` sets train.max_steps=4000 itself: its --max-steps replaces it, not contradicts it."""
    seen = {}
    monkeypatch.setattr("aiayn.train.loop.train", lambda data, out, cfg, **kw: seen.setdefault("cfg", cfg))
    assert main(["parse", "train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--max-steps", "3",
                 "--set", "train.seed=4"]) == 0
    assert (seen["cfg"].train.max_steps, seen["cfg"].train.seed, seen["cfg"].train.warmup_steps) == (3, 4, 1000)


def test_the_demos_named_options_and_sets_that_disagree_are_refused():
    assert recipe_sets("train.max_time_min=3,train.seed=2", 3, 40) == [
        "train.max_time_min=3", "train.seed=2", "train.max_time_min=3.0", "train.max_steps=40"]
    with pytest.raises(ConfigError, match=r"--set train.max_time_min=3 and --minutes 5.0 disagree"):
        recipe_sets("train.max_time_min=3", 5, 0)
    with pytest.raises(ConfigError, match=r"--set train.threads=2 and --threads 1 disagree"):
        recipe_sets("train.threads=2", 0, 0, 1)


def test_the_cli_says_a_disagreement_in_one_line(tmp_path, capsys):
    argv = ["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--preset", "tiny",
            "--set", "train.max_steps=5", "--max-steps", "10"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == "aiayn train: error: --set train.max_steps=5 and --max-steps 10 disagree; give the field once\n"


@pytest.mark.parametrize("item", ["train.warmup_steps=", "model.n_dec_layers=", "model.n_dec_layers= "])
def test_an_empty_value_is_refused_not_read_as_none(item):
    """`--set model.n_dec_layers=$N` with N unset gave a decoder as deep as the encoder without a word."""
    key = item.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^--set {re.escape(key)}: no value \(expected section.field=value; none for none\)$"):
        apply_sets(run_config_from_preset("tiny"), [item])


def test_an_empty_set_is_refused_by_the_demo_as_by_train():
    from aiayn.commands.demo import config_with_sets
    from aiayn.demo.config import DemoConfig
    with pytest.raises(ConfigError, match=r"^--set '': expected section.field=value$"):
        config_with_sets(DemoConfig, argparse.Namespace(set=["train.seed=2", ""]))
    assert config_with_sets(DemoConfig, argparse.Namespace(set=["train.seed=2"])).sets == "train.seed=2"


@pytest.mark.parametrize("item, says", [
    ("train.warmup_step=100", "--set train.warmup_step: unknown field 'warmup_step' in TrainConfig; did you mean warmup_steps?"),
    ("model.pdrop=0.2", "--set model.pdrop: unknown field 'pdrop' in ModelConfig; did you mean p_drop?"),
    ("trian.seed=2", "--set trian.seed: unknown field 'trian' in RunConfig; did you mean train?"),
])
def test_a_misspelt_field_names_the_close_one(item, says):
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}$"):
        apply_sets(run_config_from_preset("tiny"), [item])


def test_an_unknown_field_without_a_close_one_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown field 'zzz' in TrainConfig; known: accum_steps, adam_beta1"):
        apply_sets(run_config_from_preset("tiny"), ["train.zzz=1"])


def _refusal(tmp_path, text: str) -> str:
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}")
    return message.removeprefix(f"{path}")


def test_a_misspelt_recipe_key_names_its_line_and_the_close_one(tmp_path):
    assert _refusal(tmp_path, '{"preset": "tiny",\n "train": {\n  "warmup_step": 100}}') == (
        ":3: train.warmup_step: unknown field 'warmup_step' in TrainConfig; did you mean warmup_steps?")


@pytest.mark.parametrize("text, says", [
    ('{"preset": "tiny",\n "train": {"warmup_steps": 100,\n  "warmup_steps": 200}}',
     ':3: "warmup_steps" given twice in one object; give each key once'),
    ('{"preset": "tiny",\n "train": {"seed": 3},\n "train": {"warmup_steps": 200}}',
     ':3: "train" given twice in one object; give each key once'),
])
def test_a_key_given_twice_is_refused(tmp_path, text, says):
    """JSON keeps the last of two keys silently: a second "train" section dropped the first whole."""
    assert _refusal(tmp_path, text) == says


def test_a_comment_is_named_as_one(tmp_path):
    assert _refusal(tmp_path, '{"preset": "tiny",\n  // shorter\n  "train": {}}') == (
        ':2: invalid JSON: a comment (JSON has none; a recipe\'s "description" holds text)')


@pytest.mark.parametrize("section, field, value, says", [
    ("model", "p_drop", '"0.1"', 'expected float (a number), got "0.1"'),
    ("train", "warmup_steps", "true", "expected int (a whole number), got true"),
    ("train", "compile", "1", "expected a boolean (true or false), got 1"),
    ("train", "device", '["cpu"]', 'expected a string, got ["cpu"]'),
    ("train", "max_steps", "null", "expected int (a whole number), got null"),
    ("model", "n_dec_layers", '"2"', 'expected int (a whole number) or null, got "2"'),
    ("train", "seed", '{"a": 1}', 'expected int (a whole number), got {"a": 1}'),
])
def test_a_value_of_the_wrong_json_type_names_the_field_and_the_type(tmp_path, section, field, value, says):
    """A quoted number was read as the number and a 1 as true: a recipe says what it means."""
    text = f'{{"preset": "tiny",\n "{section}": {{\n  "{field}": {value}}}}}'
    assert _refusal(tmp_path, text) == f":3: {section}.{field}: {says}"


@pytest.mark.parametrize("value, says", [("1e400", "lr_scale must be a finite number, got inf"),
                                         ("NaN", "lr_scale must be a finite number, got nan"),
                                         ("-1", "lr_scale must be > 0")])
def test_a_number_out_of_range_names_the_field(tmp_path, value, says):
    assert says in _refusal(tmp_path, f'{{"preset": "tiny", "train": {{"lr_scale": {value}}}}}')


def test_values_of_the_right_json_type_still_load(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"preset": "tiny", "model": {"n_dec_layers": None, "p_drop": 0},
                                "train": {"max_steps": 1e2, "compile": False, "device": "cpu"}}))
    cfg = load_recipe(path)
    assert (cfg.model.n_dec_layers, cfg.model.p_drop, cfg.train.max_steps, cfg.train.device) == (None, 0.0, 100, "cpu")


@pytest.mark.parametrize("sets, max_steps, says", [
    ("train.warmup_step=10", 0, "--set train.warmup_step: unknown field 'warmup_step' in TrainConfig; did you mean warmup_steps?"),
    ("train.max_steps=5", 10, "--set train.max_steps=5 and --max-steps 10 disagree; give the field once"),
])
def test_the_parse_demo_reads_its_sets_before_any_work(monkeypatch, tmp_path, sets, max_steps, says):
    """`aiayn parse demo --set ...` said a misspelt key only after preparing the treebank; `aiayn demo` at once."""
    from aiayn.parsing import demo
    monkeypatch.setattr(demo, "_stage_prepare", lambda *a, **k: pytest.fail("prepared before reading --set"))
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}$"):
        demo.run_parse_demo(demo.ParseDemoConfig(out=str(tmp_path / "out"), sets=sets, max_steps=max_steps))


class _Trained(Exception):
    pass


@pytest.mark.parametrize("sets, processes, expected", [
    # a per-process batch over the share of the demo's 4,096-token step: kept as given, not cut to 2,048
    ("train.max_src_tokens=4096,train.max_tgt_tokens=4096", 2, (4096, 4096, 1)),
    # under the share: kept, and accumulated to the demo's step
    ("train.max_src_tokens=1024,train.max_tgt_tokens=1024", 2, (1024, 1024, 2)),
    ("", 2, (2048, 2048, 1)),  # multi30k.json as the demo runs it on 2 processes
    ("", 4, (1024, 1024, 1)),
])
def test_the_demos_step_never_replaces_a_batch_given_by_set(monkeypatch, tmp_path, sets, processes, expected):
    """`aiayn demo --set train.max_tgt_tokens=4096` on 2 processes trained 2,048-token batches without a word:
    the demo's step overrides of the recipe (``step_sets``) came after the user's own."""
    from aiayn.config import apply_sets
    from aiayn.demo import stages
    from aiayn.demo.config import RECIPES, DemoConfig

    def train_recipe(data_dir, run_dir, recipe, sets, processes, stage):
        raise _Trained(apply_sets(load_recipe(recipe), sets).train)

    monkeypatch.setattr(stages, "_sized_recipe", lambda *a: RECIPES / "multi30k.json")
    monkeypatch.setattr(stages, "train_recipe", train_recipe)
    with pytest.raises(_Trained) as info:
        stages.stage_train(DemoConfig(members=1, processes=processes, sets=sets), tmp_path, tmp_path / "run", {})
    t = info.value.args[0]
    assert (t.max_src_tokens, t.max_tgt_tokens, t.accum_steps) == expected


def test_estimate_reads_set_as_train_does(capsys):
    """`aiayn estimate` took no --set: the cost of a recipe with one field changed needed a copy of the file."""
    recipe = str(RECIPES / "wmt14-ende-base.json")
    seconds = []
    for extra in ([], ["--set", "train.max_steps=50000"]):
        assert main(["estimate", "--recipe", recipe, "--json", *extra]) == 0
        seconds.append(json.loads(capsys.readouterr().out)["seconds"])
    assert seconds[1] == pytest.approx(seconds[0] / 2, rel=1e-12)  # the same step, half the steps
    assert main(["estimate", "--recipe", recipe, "--set", "train.precision=fp16", "--precision", "bf16"]) == 2
    assert capsys.readouterr().err == ("aiayn estimate: error: --set train.precision=fp16 and --precision bf16 "
                                       "disagree; give the field once\n")


@pytest.mark.parametrize("text, says", [
    ('{"preset": "tiny",\n "train": {"seed": 3,}}', ":2: invalid JSON: Expecting property name enclosed in double quotes "
                                                    "at column 22"),
    ('{"preset": "ti\tny"}', ":1: invalid JSON: Invalid control character at column 15"),
])
def test_invalid_json_names_its_column(tmp_path, text, says):
    """json's message alone reads cut short ("Invalid control character at"); the column ends it."""
    assert _refusal(tmp_path, text) == says
