"""Shared test helpers: run a worker function from tests/dist_workers.py on N gloo ranks."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TESTS_DIR = str(Path(__file__).parent)


def run_ranks(func: str, world_size: int = 4, timeout: float = 240, **kwargs):
    """Run ``dist_workers.<func>(**kwargs)`` on ``world_size`` ranks; return per-rank results."""
    from fcdp_deepspeed.tools.launch import run_local
    return run_local(f"dist_workers:{func}", world_size, kwargs, timeout=timeout, pythonpath=[TESTS_DIR])


@pytest.fixture
def ranks():
    return run_ranks
