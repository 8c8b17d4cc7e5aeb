"""The GPU check: what the CPU tests cannot see, in one command (``scripts/gpu_check.py``).

Each case runs in its own process (:func:`~fcdp_deepspeed.tools.launch.run_local`) and returns a
:class:`CaseResult`; :func:`run` collects them into one JSON report.

- ``a_grad_flush``: NCCL at world size 1. A :class:`~fcdp_deepspeed.grads.GradReducer` with a
  *host* node buffer accumulates real gradients, delivers one at the boundary and flushes one that
  got no gradient there; every window sum is checked against a reference sum (bit-exact).
- ``b_fake_pg``: a fake process group of world size 4 (2 nodes x 2; this process is rank 0) through
  ``deepspeed.initialize``, prefetch on, a gated block; plain ZeRO-3 vs FCDP host/device/auto:
  peak device memory, profiler counts of synchronizations and synchronous copies per step, the
  fraction of H2D copy time that overlaps compute kernels. Collectives move no data, so values
  are meaningless; memory, copies, synchronizations and overlap are real.
- ``c_multi_gpu`` (4 or more GPUs): real NCCL, 2 emulated nodes x L; losses against ZeRO-3, step
  times against ZeRO-3 and ZeRO++ hpZ.

``dry_run=True`` runs (a) on gloo and (b) on the CPU accelerator: the logic, not the device.
"""
from __future__ import annotations

import time
from typing import Callable

from fcdp_deepspeed.tools.gpu_cases import multi_gpu_case
from fcdp_deepspeed.tools.gpu_report import CaseResult, summary

__all__ = ["run", "summary"]


#: The case functions (``module:function`` run by :func:`~fcdp_deepspeed.tools.launch.run_local`).
CASES = "fcdp_deepspeed.tools.gpu_cases"
FAKE_PG = "fcdp_deepspeed.tools.gpu_fake_pg"


def _in_process(target: str, world: int, kwargs: dict, timeout: float, accelerator: str) -> list:
    from fcdp_deepspeed.tools.launch import run_local
    return run_local(target, world, kwargs, timeout=timeout,
                     env={"DS_ACCELERATOR": accelerator, "PYTHONWARNINGS": "ignore"})


def _case(name: str, fn: Callable[[], CaseResult]) -> CaseResult:
    """Run one case; a crashed or timed-out process becomes a failed case with its log tail."""
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # RankFailure carries the rank's log tail
        text = str(exc)
        res = CaseResult(name, error=f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}\n{text[-3000:]}")
    res.numbers["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def run(dry_run: bool, gpus: int, hidden: int, layers: int, steps: int) -> dict:
    """Every case that fits this machine; the JSON report as a dict (``passed`` over all checks).
    Deadlines: 60 + 120 + 120 s on a GPU machine (the 5-minute bound), doubled for a dry run."""
    accel = "cpu" if dry_run else "cuda"
    slow = 2 if dry_run else 1
    size = dict(hidden=hidden, layers=layers, steps=steps)
    cases = [
        _case("a_grad_flush", lambda: _in_process(f"{CASES}:grad_flush_case", 1,
                                                  {"backend": "gloo" if dry_run else "nccl"}, 60 * slow, accel)[0]),
        _case("b_fake_pg", lambda: _in_process(f"{FAKE_PG}:fake_pg_case", 1, dict(dry_run=dry_run, **size),
                                               120 * slow, accel)[0]),
    ]
    if not dry_run and gpus >= 4:
        per_node = gpus // 2
        cases.append(_case("c_multi_gpu", lambda: multi_gpu_case(
            _in_process(f"{CASES}:multi_gpu_rank", 2 * per_node, dict(per_node=per_node, **size), 120, accel),
            per_node)))
    return {"mode": "dry-run-cpu" if dry_run else "gpu", "gpus": gpus, "passed": all(c.passed for c in cases),
            "cases": {c.case: c.to_json() for c in cases}}
