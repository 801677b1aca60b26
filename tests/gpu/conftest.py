"""Fixtures of the CUDA tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def float32_sums():
    """cuBLAS's products with float32 sums: no TF32, no reduced-precision reductions of bfloat16
    products (what the derived bounds, tests/rounding.py and tests/arith.py, assume; a training run
    may have turned TF32 on)."""
    m = torch.backends.cuda.matmul
    before = m.allow_tf32, m.allow_bf16_reduced_precision_reduction
    m.allow_tf32, m.allow_bf16_reduced_precision_reduction = False, False
    yield
    m.allow_tf32, m.allow_bf16_reduced_precision_reduction = before
