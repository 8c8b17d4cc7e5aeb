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


#: What the fork server imports besides torch and DeepSpeed for a concern's ranks (tools/forkserver.py):
#: transformers alone costs each spawned rank more than torch and DeepSpeed together.
PRELOAD = {"hf": "transformers,transformers.trainer,peft,accelerate"}


def run_ranks(worker: str, world_size: int = 4, timeout: float = 240, **kwargs):
    """Run ``tests/workers/<concern>.py:<function>(**kwargs)`` on ``world_size`` ranks, given as
    ``"<concern>:<function>"``; return per-rank results."""
    from fcdp_deepspeed.tools.forkserver import PRELOAD_ENV
    from fcdp_deepspeed.tools.launch import run_local
    preload = PRELOAD.get(worker.split(":")[0])
    return run_local(worker_target(worker), world_size, kwargs, timeout=timeout, pythonpath=[TESTS_DIR],
                     env={PRELOAD_ENV: preload} if preload else None)


@pytest.fixture
def ranks():
    return run_ranks
