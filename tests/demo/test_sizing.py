"""aiayn.demo.sizing: the demo's recipe chosen by the budget of training FLOPs this machine counts
in the demo's minutes, and kept for a re-run."""
import json

import pytest

from aiayn.demo.config import MINUTES, QUICK_MINUTES, RECIPES
from aiayn.demo.sizing import QUICK_SIZES, SIZES, UTILIZATION, Size, choose_size, describe, predicted_budget, sized_recipe
from aiayn.errors import UserError
from aiayn.train.config import load_recipe


def test_choose_size_takes_the_last_size_the_budget_reaches():
    sizes = (Size("a.json", 0.0), Size("b.json", 3e14), Size("c.json", 7e14))
    assert [choose_size(sizes, b).recipe for b in (0, 1.7e14, 3e14, 6.9e14, 7e14, 1e16)] == \
        ["a.json", "a.json", "b.json", "b.json", "c.json", "c.json"]


def test_predicted_budget_golden():
    # the demo's minutes x 60 s x 2 processes x 0.062 TFLOP/s (a Zen 3 core) x UTILIZATION
    budget, tflops = predicted_budget(MINUTES, 2, 1, measure=lambda: 0.062)
    assert tflops == 0.062
    assert budget == pytest.approx(MINUTES * 60 * 2 * 0.062e12 * UTILIZATION, rel=1e-12)
    assert 1.3e14 < budget < 1.7e14  # the Zen 3's demo counted 1.66e14 at 49%


def test_the_demos_recipes_train_for_the_demos_minutes():
    """``MINUTES`` says how long the demo trains; the recipes are plain data and hold it too."""
    for size in SIZES:
        assert load_recipe(RECIPES / size.recipe).train.max_time_min == MINUTES, size.recipe
    for size in QUICK_SIZES:
        assert load_recipe(RECIPES / size.recipe).train.max_time_min == QUICK_MINUTES, size.recipe
    assert load_recipe(RECIPES / "parse-sample.json").train.max_time_min == MINUTES  # aiayn parse demo's


def test_the_sizes_are_recipes_in_increasing_budget():
    for sizes in (SIZES, QUICK_SIZES):
        assert sizes[0].from_flops == 0 and list(sizes) == sorted(sizes, key=lambda s: s.from_flops)
        for s in sizes:
            load_recipe(RECIPES / s.recipe)  # a valid recipe of the package


def test_the_choice_is_printed_kept_and_resumed(tmp_path):
    slow, fast = (lambda: 0.062), (lambda: 1.0)
    recipe, record = sized_recipe(False, MINUTES, 2, 1, tmp_path, measure=slow)
    assert recipe == RECIPES / SIZES[0].recipe and record["predicted_flops"] < SIZES[-1].from_flops
    line = describe(record)
    assert SIZES[0].recipe in line and "62 GFLOP/s" in line and "--recipe forces one" in line
    # a re-run keeps the first choice, whatever the machine measures now
    again, _ = sized_recipe(False, MINUTES, 2, 1, tmp_path, measure=fast)
    assert again == recipe
    assert json.loads((tmp_path / "sizing.json").read_text())["recipe"] == SIZES[0].recipe
    other = tmp_path / "fast"
    other.mkdir()
    assert sized_recipe(False, MINUTES, 2, 1, other, measure=fast)[0] == RECIPES / SIZES[-1].recipe
    (other / "sizing.json").write_text("[]")
    with pytest.raises(UserError, match="not the demo's sizing record"):
        sized_recipe(False, MINUTES, 2, 1, other, measure=fast)


def test_the_demo_sizes_its_default_recipe_and_says_why(tmp_path, capsys, monkeypatch):
    from aiayn.demo import stages
    from aiayn.demo.config import DemoConfig

    monkeypatch.setattr(stages, "default_recipe", lambda quick, cuda=None: RECIPES / "multi30k-quick.json")  # no CUDA
    results = {}
    # (run_demo resolves --members 0 before the stages: 1 on a CPU)
    recipe = stages._sized_recipe(DemoConfig(quick=True, members=1), tmp_path, results)  # measures this machine (1 s)
    assert recipe == RECIPES / QUICK_SIZES[0].recipe and results["sizing"]["minutes"] == QUICK_MINUTES
    assert results["sizing"]["processes"] >= 1 and results["sizing"]["matmul_tflops_per_process"] > 0
    assert "[2/7] sized to this machine: multi30k-quick.json" in capsys.readouterr().out
    assert stages._sized_recipe(DemoConfig(quick=True, members=1), tmp_path, {}) == recipe  # a re-run: kept, said
    assert "[2/7] sized to this machine when the run began (sizing.json): multi30k-quick.json" in capsys.readouterr().out
    monkeypatch.setattr(stages, "default_recipe", lambda quick, cuda=None: RECIPES / "multi30k-gpu.json")  # CUDA
    assert stages._sized_recipe(DemoConfig(), tmp_path / "gpu", {}) == RECIPES / "multi30k-gpu.json"


@pytest.mark.parametrize("precision, dtype", [("fp32", "torch.float32"), ("bf16", "torch.bfloat16")])
def test_the_budget_is_measured_in_the_precision_training_will_use(monkeypatch, precision, dtype):
    """A CPU with native bf16 trains in bf16 (several times its fp32 rate on a Zen 5 or a Xeon with
    AMX): its budget comes from its bf16 matmuls, or the fast machines would be sized as slow ones."""
    from aiayn.train import runtime

    seen = []
    monkeypatch.setattr(runtime, "matmul_tflops", lambda device, n, seconds, dtype: seen.append(str(dtype)) or 0.5)
    budget, tflops = predicted_budget(MINUTES, 2, 1, precision=precision)
    assert seen == [dtype] and tflops == 0.5
    assert budget == pytest.approx(MINUTES * 60 * 2 * 0.5e12 * UTILIZATION, rel=1e-12)


@pytest.mark.parametrize("native, sets, precision", [(True, "", "bf16"), (False, "", "fp32"),
                                                     (True, "train.precision=fp32", "fp32")])
def test_the_demo_sizes_by_the_precision_of_its_training(tmp_path, monkeypatch, native, sets, precision):
    from aiayn.demo import stages
    from aiayn.demo.config import DemoConfig
    from aiayn.train import runtime

    monkeypatch.setattr(stages, "default_recipe", lambda quick, cuda=None: RECIPES / "multi30k.json")  # no CUDA
    monkeypatch.setattr(runtime, "cpu_supports_bf16", lambda: native)
    monkeypatch.setattr(runtime, "matmul_tflops", lambda device, n, seconds, dtype: 0.062)
    results = {}
    stages._sized_recipe(DemoConfig(sets=sets, members=1), tmp_path, results)
    assert results["sizing"]["precision"] == precision
    assert f"this machine's {precision} matmuls run at 62 GFLOP/s" in describe(results["sizing"])


@pytest.mark.parametrize("first_quick", [True, False])
def test_a_run_of_the_other_variant_is_not_resumed(tmp_path, first_quick):
    """A folder whose run began with --quick is not resumed by the full demo (nor the other way round):
    its stored choice would have the full demo train, score and record the quick model (or resume a
    half-trained quick run with the full demo's batches); the error names both and the way out."""
    recipe, _ = sized_recipe(first_quick, 1.0, 2, 1, tmp_path, measure=lambda: 0.062)
    with pytest.raises(UserError, match=rf"sizing\.json: the run here began {'--quick' if first_quick else 'without --quick'}"
                                        rf" \({recipe.name}\), but this run is {'without --quick' if first_quick else '--quick'}"
                                        r"; use another --out, or --overwrite"):
        sized_recipe(not first_quick, 1.0, 2, 1, tmp_path, measure=lambda: 0.062)
    assert sized_recipe(first_quick, 1.0, 2, 1, tmp_path, measure=lambda: 1.0)[0] == recipe  # the same variant: resumed


def test_the_quick_choice_is_not_said_to_be_one_of_several(tmp_path):
    """--quick has one recipe: the line does not list "recipes by budget" as if the machine chose it."""
    _, record = sized_recipe(True, QUICK_MINUTES, 2, 1, tmp_path, measure=lambda: 0.062)
    assert "recipes by budget" not in describe(record) and "the one recipe on any machine" in describe(record)
