"""How a run computes the model, applied to a plain ``aiayn.model.Transformer`` from outside.

The model (``aiayn.model``) is §3 and nothing else. A training or decoding run then puts its own
modules in place of the model's, the same parameters and state-dict keys, the same function:

- Eq. 1 (``ScaledDotProductAttention``) -> ``attention.ExecutedAttention``: the C kernels on the
  CPU (``train.c_kernels``), float32 under bf16 autocast (``train.attn_fp32``), an additive key
  mask made once on CUDA;
- dropout (``nn.Dropout``) -> ``dropout.FastDropout``: the CPU's mask from thresholded integers
  (``train.fast_dropout``);
- the linear maps (``nn.Linear``, and the tied embedding's pre-softmax use) -> ``linear.RowPaddedLinear``,
  ``linear.RowPaddedEmbedding``: rows padded on the CPU in reduced precision (``train.cpu_row_bits``,
  ``DecodeConfig.cpu_row_bits``); the maps' weights cast to autocast's dtype once per forward in one
  batched copy (``casts.WeightCasts``, ``train.cast_weights_once``).

``apply`` does all of them from an ``Execution``; training calls it where it builds its step
(``train.step.TrainStep``), decoding where it makes its bfloat16 copy (``decode.loading``).
``attention.attention_backends`` is the CUDA attention kernels' choice, a context around a forward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from aiayn.execution.attention import ExecutedAttention, _LastMask
from aiayn.execution.casts import WeightCasts
from aiayn.execution.dropout import FastDropout
from aiayn.execution.linear import RowPaddedEmbedding, RowPaddedLinear
from aiayn.model.attention import ScaledDotProductAttention
from aiayn.model.positional import ScaledEmbedding

if TYPE_CHECKING:
    from aiayn.kernels.loader import Kernels


@dataclass(frozen=True)
class Execution:
    """How a run computes the model: the same function, the run's speed. All off: the model as built."""
    kernels: "Kernels | None" = None  # the C kernels for Eq. 1 (CPU), or None for PyTorch's attention
    attn_fp32: bool = False  # Eq. 1 in float32 under bf16 autocast (CPU)
    fast_dropout: bool = False  # dropout masks from thresholded integers (CPU)
    row_bits: int | None = None  # pad the linear maps' rows to keep this many leading bits; None = leave them
    cast_weights_once: bool = False  # under autocast, the linear maps' weights cast in one copy a forward


def training(t, device: torch.device, kernels: "Kernels | None") -> Execution:
    """A training run's execution, from its ``aiayn.train.config.TrainConfig`` ``t``: its C kernels (``train.c_kernels``, None where
    the net is compiled: torch.compile traces PyTorch's attention), ``train.attn_fp32``,
    ``train.fast_dropout``, on the CPU ``train.cpu_row_bits`` (elsewhere 0), and
    ``train.cast_weights_once`` (off where the net is compiled: inductor fuses the casts itself)."""
    return Execution(kernels, t.attn_fp32, t.fast_dropout, t.cpu_row_bits if device.type == "cpu" else 0,
                     t.cast_weights_once)


def compiled(ex: Execution) -> Execution:
    """What of ``ex`` a net compiled by torch.compile keeps: the fp32 attention alone. Not the C
    kernels (it traces PyTorch's attention), nor the weights cast once (inductor fuses autocast's
    casts into its kernels), nor the fast dropout (its in-place integer draw breaks the graph at
    every dropout, some frames then left to eager) or the padded rows (each padded row count is a
    guard on the shape: a graph compiled anew for nearly every batch, the dynamic shapes lost, until
    torch.compile's recompile limit leaves the frames to eager); inductor generates its own dropout."""
    return replace(ex, kernels=None, cast_weights_once=False, fast_dropout=False, row_bits=0)


def apply(model: nn.Module, ex: Execution) -> nn.Module:
    """Put ``ex``'s modules in ``model`` (in place; applied again, ``ex`` replaces the settings); returns ``model``."""
    masks = _LastMask()  # one for the whole model: its layers share each forward's source mask
    _swap(model, lambda m: isinstance(m, ScaledDotProductAttention),
          lambda m: ExecutedAttention(m.p_drop_attn, ex.kernels, ex.attn_fp32, masks))
    if ex.fast_dropout:
        _swap(model, lambda m: type(m) is nn.Dropout, lambda m: FastDropout(m.p))
    else:
        _swap(model, lambda m: type(m) is FastDropout, lambda m: nn.Dropout(m.p))
    if ex.row_bits is not None:
        pad_linear_rows(model, ex.row_bits)
    _cast_weights_once(model, ex.cast_weights_once)
    return model


def _cast_weights_once(model: nn.Module, on: bool) -> None:
    """``casts.WeightCasts`` over the model's ``RowPaddedLinear`` maps, hooked on its forward (on), or
    none (off); what an earlier ``apply`` hooked is removed first."""
    for handle in getattr(model, "_weight_cast_hooks", []):
        handle.remove()
    maps = [m for m in model.modules() if isinstance(m, RowPaddedLinear)]
    casts = WeightCasts(maps) if on and maps else None
    for m in maps:
        m.casts = casts
    model._weight_cast_hooks = casts.attach(model) if casts is not None else []


def use_attention_kernels(model: nn.Module, kernels: "Kernels | None") -> None:
    """Attend through the C kernels (``aiayn.kernels.loader.Kernels``, seq_attention.c) where they apply
    (``ExecutedAttention._use_kernels``), or through PyTorch's attention with None; the rest as it was
    (a model's own attention becomes ``ExecutedAttention`` with ``attn_fp32``, the kernels' arithmetic).
    Decoding with a cache has kernels of its own (``aiayn.decode.cache.DecoderCache.kernels``)."""
    masks = _LastMask()
    _swap(model, lambda m: type(m) is ScaledDotProductAttention,
          lambda m: ExecutedAttention(m.p_drop_attn, kernels, True, masks))
    for module in model.modules():
        if isinstance(module, ExecutedAttention):
            module.kernels = kernels


def pad_linear_rows(model: nn.Module, bits: int) -> None:
    """Pad the rows of every linear map (the tied output layer's too) to keep ``bits`` leading bits of
    their count on the CPU in reduced precision, 0 for never (``aiayn.execution.linear``: the same
    outputs, oneDNN kernels for few shapes)."""
    _swap(model, lambda m: type(m) is nn.Linear, lambda m: RowPaddedLinear.of(m, bits))
    _swap(model, lambda m: type(m) is ScaledEmbedding, lambda m: RowPaddedEmbedding.of(m, bits))
    for module in model.modules():
        if isinstance(module, (RowPaddedLinear, RowPaddedEmbedding)):
            module.row_bits = int(bits)


def _swap(model: nn.Module, chosen: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]) -> None:
    """Every ``chosen`` submodule replaced by ``make(it)``, wherever it is held (a module held twice, as
    tied embeddings are, stays one module), in training or evaluation mode as it was."""
    made: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):  # every name, a module held twice under both
            if child is not None and chosen(child):
                if id(child) not in made:
                    made[id(child)] = make(child).train(child.training)
                setattr(parent, name, made[id(child)])
