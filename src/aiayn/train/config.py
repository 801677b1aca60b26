"""Training configuration (§5): one frozen dataclass, plus the run configuration that
combines it with the model's. The CLI's ``--set section.field=value``, recipe files, the
run directory's ``config.json`` and every checkpoint derive from these fields. The parts of a run
receive only what they need of it: a section cut out here (``batching``: the training batches'
fields), the ``TrainConfig`` or a few of its values.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from aiayn.checkpoint.format import upgrade
from aiayn.config import ConfigError, apply_sets, check_json_fields, from_dict, param, replace, unknown_field
from aiayn.data.stream import Batching
from aiayn.model.config import PRESET_TRAIN, ModelConfig, get_preset
from aiayn.execution.linear import MAX_ROW_BITS, ROW_BITS

log = logging.getLogger(__name__)
RECIPES = Path(__file__).resolve().parents[1] / "recipes"  # installed with aiayn (package data; recipes/ in the checkout links here)


@dataclass(frozen=True)
class TrainConfig:
    """The paper's recipe by default (§5.1-§5.4; the batch per device, which the paper's 8 GPUs fixed,
    is 4,096 tokens); every other value is a named deviation (docs/paper-deviations.md)."""

    # optimizer and schedule (§5.3)
    adam_beta1: float = param(0.9, "Adam beta_1 (§5.3)")
    adam_beta2: float = param(0.98, "Adam beta_2 (§5.3)")
    adam_eps: float = param(1e-9, "Adam epsilon (§5.3)")
    warmup_steps: int = param(4000, "warmup_steps of Eq. 3")
    lr_scale: float = param(1.0, "factor on Eq. 3 (1 = the paper); the peak rate is lr_scale * d_model^-0.5 * warmup^-0.5")
    lr_decay_frac: float = param(0.0, "multiply Eq. 3 by a linear ramp from 1 to 0 over the last fraction of the run: of max_steps, or of max_epochs where that is further along (0 = off, the paper); for short fixed-budget runs")
    lr_decay_by_time: bool = param(False, "measure the lr_decay_frac ramp in the run's budget (max_time_min, max_flops) as well as in max_steps (whichever is further along), so a budget-bounded run ends its ramp on any machine")
    lr_schedule_by_time: bool = param(False, "take Eq. 3 and the lr_decay_frac ramp at max(step, b * max_steps), b the share of the budget spent (elapsed / max_time_min or FLOPs / max_flops, the larger): a machine too slow to reach max_steps in the budget runs the whole schedule, compressed (docs/recipe.md)")
    weight_decay: float = param(0.0, "decoupled weight decay (AdamW); 0 = the paper's Adam")
    clip_norm: float = param(0.0, "clip the gradient norm to this value; 0 = off (the paper does not clip)")
    fused_adam: bool = param(True, "Adam's update of all parameters in one fused kernel (CPU, CUDA); the same math as PyTorch's per-tensor loop (False) without its many small operations per tensor")
    c_kernels: bool = param(True, "the loss and (AVX-512, d_k = d_v of 32 or 64) the attention in C on the CPU (docs/kernels.md): the same sums up to rounding, faster; false, no C compiler or a GPU = PyTorch's operations")
    fused_loss: str = param("auto", "auto | on | off: the output projection (§3.4) and the loss (§5.4) a chunk of rows at a time, never holding the whole logits (Triton on CUDA); auto = on for CUDA where triton imports (docs/gpu.md)")
    cpu_row_bits: int = param(ROW_BITS, "CPU, bf16/fp16: pad each linear map's rows with zero rows to a count that keeps this many leading bits, so oneDNN keeps kernels for few row counts and memory stays flat (docs/training.md); 0 = off; never under compile")
    fast_dropout: bool = param(True, "on the CPU, dropout masks by thresholding random_() integers instead of F.dropout's bernoulli_: the same Bernoulli law, cheaper (docs/training.md); CUDA and a compiled model always use F.dropout")
    attn_fp32: bool = param(True, "on the CPU under bf16 autocast, the attention core (QK^T, softmax, .V) in float32: the same math, a faster backward; CUDA's fused kernels keep the softmax in float32 anyway")
    cast_weights_once: bool = param(False, "under bf16/fp16 autocast, the linear maps' weights cast to that dtype in one batched copy at each forward, and their gradients back in one, where autocast casts each at its use: the same numbers, fewer operations for the host to issue (docs/training.md); off until measured faster on a GPU (no faster on a CPU); never under compile")
    # regularization (§5.4)
    eps_ls: float = param(0.1, "label smoothing epsilon_ls (§5.4)")
    bpe_dropout: float = param(0.0, "BPE-dropout (Provilkov et al., 2020): re-segment the training pairs at every epoch, skipping each BPE merge with this probability; 0 = off (the paper segments once, §5.1); needs a BPE vocabulary")
    bpe_dropout_target: bool = param(True, "apply bpe_dropout to the target side too (as Provilkov et al. do); false re-segments the source side only")
    rdrop_alpha: float = param(0.0, "R-Drop (Liang et al., 2021): weight of the symmetric KL between two dropout passes of each batch, added to their losses; about twice the compute per step; needs dropout; 0 = off (the paper)")
    # batching (§5.1)
    max_src_tokens: int = param(4096, "source tokens per batch per device, padding included (§5.1: ~25,000 a step, 3,125 on each of 8 GPUs)")
    max_tgt_tokens: int = param(4096, "target tokens per batch per device, padding included")
    accum_steps: int = param(1, "batches accumulated per optimizer step (tokens per step = per-device tokens x devices x accum_steps)")
    local_sgd_period: int = param(0, "data parallel only: average the processes' weights every N optimizer steps, each with its own Adam (local SGD), instead of their gradients every step; 0 = off, the paper's DDP (docs/training.md)")
    # length of the run
    max_steps: int = param(100_000, "stop after this many optimizer steps (base: 100K, big: 300K); 0 takes none (not 'no limit', as fairseq's --max-update 0): the starting weights (with --init-from, the checkpoint's) are validated and saved")
    max_epochs: int = param(0, "stop after this many epochs; 0 = no limit")
    max_time_min: float = param(0.0, "stop after this many minutes of training wall time; 0 = no limit")
    max_flops: float = param(0.0, "stop after this many counted training FLOPs, all processes together (aiayn.train.flops: 3 x the forward's matmuls); 0 = no limit. A budget that means the same on every machine: the time-based schedules follow it as they follow max_time_min (docs/recipe.md)")
    # checkpoints (§6.1: written at 10-minute intervals)
    save_every_steps: int = param(0, "write a checkpoint every N optimizer steps; 0 = off")
    save_every_min: float = param(10.0, "write a checkpoint every M minutes of wall time; 0 = off")
    save_every_frac: float = param(0.0, "write a checkpoint each time the run's progress crosses a multiple of F, in (0, 1): the largest share done of its limits (max_steps, max_time_min, max_flops, max_epochs), so that a budgeted run's last checkpoints span the same share of it on a machine that reaches max_steps first and on one that reaches its time first; 0 = off")
    keep_last: int = param(20, "keep the last K step checkpoints (plus last.pt and best.pt); 0 keeps them all")
    # validation
    validate_every_steps: int = param(1000, "validate every N optimizer steps (and at the end); 0 = only at the end")
    validate_at_save: bool = param(True, "also validate whenever a checkpoint is written (so best.pt is tracked)")
    patience: int = param(0, "stop after this many validations without a gain in best_metric; 0 = off")
    valid_bleu: bool = param(False, "also translate the validation set at each validation (beam search, valid_beam, the paper's alpha 0.6) and score it with sacreBLEU against the raw references prepare read")
    valid_bleu_max_lines: int = param(0, "validation lines valid_bleu translates (the first N); 0 = all")
    valid_beam: int = param(4, "beam size of valid_bleu's translations (§6.1: 4; 1 = greedy, cheaper)")
    best_metric: str = param("loss", "loss | bleu: what best.pt and patience follow (bleu needs valid_bleu)")
    ema_decay: float = param(0.0, "an exponential moving average of the weights, ema = d * ema + (1 - d) * weights after each update, validated and written to ema.pt; 0 = off (the paper averages checkpoints, §6.1)")
    # machinery
    seed: int = param(1, "seed for initialization, dropout, batch order and the draws of corpus weights; not for BPE-dropout, which SentencePiece draws unseeded (docs/training.md, Reproducibility)")
    device: str = param("auto", "auto | cpu | cuda | cuda:N")
    precision: str = param("auto", "auto | fp32 | bf16 | fp16 (fp16 only on CUDA, with a gradient scaler); auto = bf16 where the device computes it natively (CUDA compute capability >= 8.0, CPUs with AVX512-BF16/AMX), else fp16 on CUDA where its fp16 is fast (compute capability 7.0 on; P100), fp32 elsewhere")
    threads: int = param(0, "CPU threads for torch; 0 = leave torch's default")
    dist_timeout_s: float = param(120.0, "data parallel: seconds a process waits for the others before it stops with an error, so a dead or hung rank ends the run (PyTorch's default: 30 minutes; docs/training.md)")
    log_every_steps: int = param(50, "write a log line / scalars every N optimizer steps")
    max_bad_steps: int = param(5, "stop after this many consecutive steps whose loss or gradient norm is not finite (skipped; fp16's overflows, which its scaler skips, do not count)")
    compile: bool = param(False, "wrap the model in torch.compile (a model that fails to compile trains without it); dynamic shapes; off: slower on the CPUs measured; on a GPU its compiling costs the GPU demo more of its minutes than its faster step gives back; not yet timed at base or big (docs/gpu.md)")
    tf32: bool = param(True, "CUDA: float32 matmuls in TF32 on the tensor cores (inputs rounded to 10 mantissa bits, float32 sums); bf16, fp16 and the CPU untouched; false = full float32 (docs/gpu.md)")
    cudnn_attention: bool = param(False, "CUDA: let PyTorch's attention pick cuDNN's kernel, which plans again for each new batch shape (nearly every step with length buckets); false = flash or memory-efficient (docs/gpu.md)")

    def __post_init__(self) -> None:
        for f in fields(self):  # NaN or infinity would reach the optimizer or the schedule as such
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        if self.lr_scale <= 0:
            raise ConfigError(f"lr_scale must be > 0 (1 = the paper), got {self.lr_scale}")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            raise ConfigError(f"adam_beta1 and adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        if self.adam_eps < 0:
            raise ConfigError(f"adam_eps must be >= 0, got {self.adam_eps}")
        if not 0 <= self.seed < 1 << 63:
            raise ConfigError(f"seed must be in [0, 2^63), got {self.seed}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ConfigError(f"precision must be auto, fp32, bf16 or fp16, got {self.precision!r}")
        if self.best_metric not in ("loss", "bleu"):
            raise ConfigError(f"best_metric must be loss or bleu, got {self.best_metric!r}")
        if self.best_metric == "bleu" and not self.valid_bleu:
            raise ConfigError("best_metric=bleu needs valid_bleu=true")
        if self.valid_beam < 1 or self.valid_bleu_max_lines < 0:
            raise ConfigError("valid_beam must be >= 1 and valid_bleu_max_lines >= 0")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in [0, 1) (0 = off), got {self.ema_decay}")
        if self.fused_loss not in ("auto", "on", "off"):
            raise ConfigError(f"fused_loss must be auto, on or off, got {self.fused_loss!r}")
        if not 0 < self.dist_timeout_s < 1e7:
            raise ConfigError(f"dist_timeout_s must be > 0 (seconds), got {self.dist_timeout_s}")
        if self.accum_steps < 1:
            raise ConfigError("accum_steps must be >= 1")
        if self.warmup_steps < 1:
            raise ConfigError("warmup_steps must be >= 1 (Eq. 3 divides by warmup_steps^1.5)")
        if self.max_src_tokens < 1 or self.max_tgt_tokens < 1:
            raise ConfigError("max_src_tokens and max_tgt_tokens must be >= 1")
        if self.local_sgd_period < 0:
            raise ConfigError("local_sgd_period must be >= 0 (0 = synchronous data parallelism)")
        if not 0.0 <= self.eps_ls < 1.0:
            raise ConfigError("eps_ls must be in [0, 1)")
        if not 0.0 <= self.bpe_dropout < 1.0:
            raise ConfigError("bpe_dropout must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay must be >= 0 (0 = the paper's Adam)")
        if self.rdrop_alpha < 0:
            raise ConfigError("rdrop_alpha must be >= 0")
        if self.clip_norm < 0:  # a negative norm would turn clipping off, as 0 does, without a word
            raise ConfigError(f"clip_norm must be >= 0 (0 = off), got {self.clip_norm}")
        if self.keep_last < 0:
            raise ConfigError("keep_last must be >= 0 (0 keeps every step checkpoint)")
        if not 0.0 <= self.lr_decay_frac <= 1.0:
            raise ConfigError("lr_decay_frac must be in [0, 1]")
        if self.max_flops < 0:
            raise ConfigError("max_flops must be >= 0 (0 = no limit)")
        if not 0.0 <= self.save_every_frac < 1.0:
            raise ConfigError(f"save_every_frac must be in [0, 1) (0 = off), got {self.save_every_frac}")
        for name in ("max_steps", "max_epochs", "max_time_min", "save_every_steps", "save_every_min",
                     "validate_every_steps", "patience", "log_every_steps", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_bad_steps < 1:
            raise ConfigError(f"max_bad_steps must be >= 1, got {self.max_bad_steps}")
        if not 0 <= self.cpu_row_bits <= MAX_ROW_BITS:
            raise ConfigError(f"cpu_row_bits must be in [0, {MAX_ROW_BITS}] (0 = off), got {self.cpu_row_bits}")
        budget = self.max_time_min > 0 or self.max_flops > 0
        if self.lr_decay_by_time and not (self.lr_decay_frac > 0 and budget):
            raise ConfigError("lr_decay_by_time needs lr_decay_frac > 0 and max_time_min or max_flops > 0 "
                              "(for a run without a time budget, set train.lr_decay_by_time=false)")
        if self.lr_schedule_by_time and not budget:
            raise ConfigError("lr_schedule_by_time needs max_time_min or max_flops > 0 "
                              "(for a run without a budget, set train.lr_schedule_by_time=false)")


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs besides the data: model and train sections."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "model hyperparameters"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "training recipe"})


def run_config_from_preset(name: str) -> RunConfig:
    """A preset's model plus the training settings its Table 3 row changes (D3/D4 eps_ls, big steps)."""
    return RunConfig(model=get_preset(name), train=replace(TrainConfig(), **PRESET_TRAIN.get(name, {})))


def installed_recipe(path: Path) -> Path:
    """``path``; or, where it reads ``recipes/NAME.json`` and no file is there, the recipe of that name
    installed with aiayn (``RECIPES``), so the docs' ``--recipe recipes/NAME.json`` runs in any folder,
    with or without a checkout."""
    if path.is_absolute() or path.parent != Path("recipes") or path.exists() or not (RECIPES / path.name).is_file():
        return path
    log.info("%s: none in this folder; taking the recipe installed with aiayn, %s", path, RECIPES / path.name)
    return RECIPES / path.name


RECIPE_KEYS = ("preset", "model", "train", "description")  # a recipe file's top-level keys


def _key_lines(text: str, key: str) -> list[int]:
    """The lines of the JSON ``text`` where ``"key":`` stands, in order."""
    return [text.count("\n", 0, m.start()) + 1 for m in re.finditer(rf'"{re.escape(key)}"\s*:', text)]


def load_recipe(path: str | Path) -> RunConfig:
    """A recipe file: JSON ``{"preset": NAME?, "model": {...}, "train": {...}}`` (unknown keys are errors).
    A run directory's ``config.json`` is one: it names every field, so it trains the same configuration again.
    ``recipes/NAME.json`` where no such file is here is the recipe installed with aiayn (``installed_recipe``)."""
    path = installed_recipe(Path(path))
    try:
        text = path.read_text()
        data = json.loads(text, object_pairs_hook=_once_each)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: recipe file not found") from exc
    except _Repeated as exc:  # JSON itself keeps the last silently: a second "train" would drop the first
        lines = _key_lines(text, exc.key)
        at = f":{lines[1]}" if len(lines) > 1 else ""
        raise ConfigError(f'{path}{at}: "{exc.key}" given twice in one object; give each key once') from None
    except json.JSONDecodeError as exc:
        comment = exc.doc[exc.pos:].lstrip().startswith(("//", "/*", "#"))
        why = ("a comment (JSON has none; a recipe's \"description\" holds text)" if comment
               else f"{exc.msg.removesuffix(' at')} at column {exc.colno}")  # msg alone: "Invalid control character at"
        raise ConfigError(f"{path}:{exc.lineno}: invalid JSON: {why}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a recipe (not UTF-8 text)") from None
    except OSError as exc:  # a folder, no permission
        raise ConfigError(f"{path}: cannot read the recipe ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise ConfigError(f'{path}: a recipe is a JSON object {{"preset": ..., "model": {{...}}, "train": {{...}}}}')
    wrong = [k for k in ("model", "train") if not isinstance(data.get(k, {}), dict)]
    if wrong:
        raise ConfigError(f"{path}: {wrong[0]} must be an object of fields, got {type(data[wrong[0]]).__name__}")
    extra = [k for k in data if k not in RECIPE_KEYS]  # (the file's first)
    if extra:  # a misspelt section ("trian") as a misspelt field: its line and the close name
        lines = _key_lines(text, extra[0])
        line = f":{lines[0]}" if lines else ""
        raise ConfigError(f"{path}{line}: {unknown_field(extra[0], RECIPE_KEYS, 'a recipe')}")
    preset = data.get("preset", "base")
    if not isinstance(preset, str):
        raise ConfigError(f"{path}: preset must be a name (a string), got {json.dumps(preset)}")
    try:
        base = run_config_from_preset(preset)
    except ConfigError as exc:  # an unknown name: the file it came from
        raise ConfigError(f"{path}: {exc}") from None
    model, execution = upgrade(data.get("model", {}))  # a config.json of older versions: see ``upgrade``
    sections = {"model": model, "train": {**execution, **data.get("train", {})}}
    sets = [f"{section}.{k}={_as_text(v)}" for section, fields in sections.items() for k, v in fields.items()]

    def where(key: str) -> str:  # "section.field" -> "FILE:LINE: section.field", the field's line in its section
        section, _, field = key.partition(".")
        start = text.find(f'"{section}"')
        at = text.find(f'"{field}"', max(start, 0))
        return f"{path}:{text.count(chr(10), 0, at) + 1}: {key}" if at >= 0 else f"{path}: {key}"

    try:
        for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
            check_json_fields(cls, sections[section], lambda name: where(f"{section}.{name}"))
        return apply_sets(base, sets, where)
    except ConfigError as exc:  # a section's own check (``train: ...``) names no line: the file, at least
        raise ConfigError(str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}") from None


class _Repeated(ValueError):
    """A key given twice in one JSON object of a recipe."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _once_each(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict, refused where a key comes twice (``json.loads``' ``object_pairs_hook``)."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _Repeated(key)
        seen.add(key)
    return dict(pairs)


def _as_text(value) -> str:
    """A JSON value as ``--set`` writes it: null -> none, true -> true, [a, b] -> a,b."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(_as_text(v) for v in value)
    return str(value)


def batching(t: TrainConfig) -> Batching:
    """What the training batches follow (``aiayn.data.stream.BatchStream``): the fields of the same names."""
    return Batching(max_src_tokens=t.max_src_tokens, max_tgt_tokens=t.max_tgt_tokens, accum_steps=t.accum_steps,
                    seed=t.seed, max_epochs=t.max_epochs, bpe_dropout=t.bpe_dropout,
                    bpe_dropout_target=t.bpe_dropout_target)


# Fields that refine another one, and the condition under which that one is off: set away from their
# defaults while it is, they change nothing, which the run says at its start (``unused_settings``).
_REFINES = {
    "valid_beam": ("train.valid_bleu=true", lambda t: not t.valid_bleu),
    "valid_bleu_max_lines": ("train.valid_bleu=true", lambda t: not t.valid_bleu),
    "bpe_dropout_target": ("train.bpe_dropout > 0", lambda t: t.bpe_dropout == 0),
}


def unused_settings(t: TrainConfig) -> list[str]:
    """One line for each field of ``t`` set away from its default that the run does not use, as what it
    refines is off (``valid_beam`` without ``valid_bleu``): said, since the setting looks in force, but
    not refused, as a recipe may carry it for a run that turns the other on."""
    default = {f.name: f.default for f in fields(TrainConfig)}
    return [f"train.{name}={_as_text(getattr(t, name))} has no effect without {needs}"
            for name, (needs, off) in _REFINES.items() if getattr(t, name) != default[name] and off(t)]


def run_config_from_dict(data: dict) -> RunConfig:
    return from_dict(RunConfig, data)
