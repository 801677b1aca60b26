"""Shared fixtures: a seed for every test, and the location of ../shared/data.

The data location comes from $AIAYN_SHARED_DATA, else ../shared/data beside the checkout.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    env = os.environ.get("AIAYN_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.fail(f"shared data not found at {path}; set AIAYN_SHARED_DATA")
    return path
