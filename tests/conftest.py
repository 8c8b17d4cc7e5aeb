"""Shared test helpers: run a worker function on N gloo ranks.

Workers live next to what they test: ``tests/test_<concern>.py`` runs functions of
``tests/workers/<concern>.py`` (shared helpers in ``workers/common.py``).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TESTS_DIR = str(Path(__file__).parent)


def worker_target(worker: str) -> str:
    """``"<concern>:<function>"`` -> the ``module:function`` a rank imports (``tests/`` on its path)."""
    return f"workers.{worker}"


def run_ranks(worker: str, world_size: int = 4, timeout: float = 240, **kwargs):
    """Run ``tests/workers/<concern>.py:<function>(**kwargs)`` on ``world_size`` ranks, given as
    ``"<concern>:<function>"``; return per-rank results."""
    from fcdp_deepspeed.tools.launch import run_local
    return run_local(worker_target(worker), world_size, kwargs, timeout=timeout, pythonpath=[TESTS_DIR])


@pytest.fixture
def ranks():
    return run_ranks
