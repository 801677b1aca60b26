"""Accelerators ``aiayn estimate`` knows, as plain data: their peak rates and Table 2's figures.

``peak_tflops`` is the vendor's dense peak (no structured sparsity) in the precision aiayn trains
in on that device (``train.precision=auto``: bf16 where the device has it, fp16 with a gradient
scaler on V100; the older GPUs' in fp32, as the paper trained them: with ``train.precision=fp32``
on a P100, where auto takes fp16, ``train.runtime.fast_fp16``). ``table2_tflops`` is the "sustained
TFLOPS" Table 2 of the paper multiplies by time and device count (2.8 K80, 3.7 K40, 6.0 M40,
9.5 P100); for devices the paper did not use it is the peak, Table 2's convention carried over.

``aiayn_tflops`` is aiayn's own training throughput where it was measured on the device, per
Table 3 model (``_H200_AIAYN``: one H200, BENCHMARKS.md §7). The H100 has the H200's compute and
less memory bandwidth; its figures are the H200's, an assumption. (CPU measurements live in
bench/results and are read from there.)

Elsewhere a throughput is ``peak_tflops x utilization``, model FLOP/s over the peak, taken from
published runs of the same models by other code (model FLOPs by ``aiayn.train.flops`` with
31-token sentences), so an upper bound more than a forecast for aiayn: for the P100 (and the
older K80, K40, M40) the paper's own step time (§5.2), for the V100 NVIDIA's DeepLearningExamples
Transformer, for the A100 FlagPerf's run of that code, for the H100 and H200 (models other than
base and big) the A100's. docs/wmt14.md, "Time and cost", derives each figure.

``utilization`` is a default: ``aiayn estimate --utilization`` replaces it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """One accelerator: its name, training precision, dense peak and Table 2's figure (TFLOP/s)."""

    name: str
    precision: str
    peak_tflops: float
    table2_tflops: float
    utilization: float
    source: str
    aiayn_tflops: tuple[tuple[str, float], ...] = ()  # (Table 3 model, aiayn's model TFLOP/s on it)
    aiayn_source: str = ""
    aiayn_measured: bool = False  # measured on this device (else carried over from a like one)


_H200_AIAYN = (("base", 152.8), ("big", 293.8))

DEVICES: dict[str, Device] = {
    "k80": Device("NVIDIA K80 (one GK210)", "fp32", 4.37, 2.8, 0.28, "K80 datasheet: 8.73 TFLOP/s fp32 boost per two-GPU board; Table 2: 2.8"),
    "k40": Device("NVIDIA K40", "fp32", 4.29, 3.7, 0.28, "K40 datasheet: 4.29 TFLOP/s fp32 boost; Table 2: 3.7"),
    "m40": Device("NVIDIA M40", "fp32", 7.0, 6.0, 0.28, "M40 datasheet: 7 TFLOP/s fp32 boost; Table 2: 6.0"),
    "p100": Device("NVIDIA P100 SXM2", "fp32", 10.6, 9.5, 0.28, "P100 datasheet: 10.6 TFLOP/s fp32 (SXM2); Table 2: 9.5"),
    "v100": Device("NVIDIA V100 SXM2", "fp16", 125.0, 125.0, 0.30, "V100 datasheet: 125 TFLOP/s fp16 tensor cores"),
    "a100": Device("NVIDIA A100 SXM4", "bf16", 312.0, 312.0, 0.16, "A100 datasheet: 312 TFLOP/s bf16 dense"),
    "h100": Device("NVIDIA H100 SXM5", "bf16", 989.0, 989.0, 0.16, "H100 datasheet: 989 TFLOP/s bf16 dense (1,979 with sparsity)",
                   _H200_AIAYN, "assumed: aiayn's H200 figure (BENCHMARKS.md, GPU training and decoding), the same compute"),
    "h200": Device("NVIDIA H200 SXM", "bf16", 989.0, 989.0, 0.16, "H200 datasheet: 989 TFLOP/s bf16 dense, the H100's compute",
                   _H200_AIAYN, "measured: BENCHMARKS.md, GPU training and decoding (one H200, bf16, synthetic "
                   "780 x 32 batches)", True),
}
