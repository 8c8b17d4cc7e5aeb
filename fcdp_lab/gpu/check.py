"""The GPU check: what the CPU tests cannot see, in one command (``scripts/gpu_check.py``).

Each case runs in its own process (:func:`~fcdp_lab.harness.launch.run_local`) and returns a
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
  times against ZeRO-3 and ZeRO++ hpZ, the two-stage gather's stage-1/stage-2 timeline.
- ``d_sanitizer``: the fake world of (b), small model, under ``TORCH_CUDA_SANITIZER=1``: no stream race in
  FCDP's code (staged hits, the node buffer's round trip, the flush).
- ``e_host_memory``: pinning time and pinned bytes against the cgroup's ``memory.current``; host-to-device
  GB/s, pinned and pageable, with every local GPU's rank copying at once.
- ``f_codec``: the inter-node codec's torch ops on the device: deterministic, within its error, the same bytes and
  bits as the CPU's or not, device and host-issue time per call at bucket-sized rows (``fcdp_lab/gpu/codec.py``).
- ``g_diloco_anchor``: DiLoCo (2 workers, H = 30, outer Nesterov 0.9, lr 0.7) against data parallelism at the same
  tokens, plain PyTorch, a ~11M-parameter byte-level model on the standard library's source, as many tokens per
  parameter (up to the anchor's 20) as its deadline fits: the gap against the scaling-law anchor
  (``fcdp_lab/gpu/diloco_anchor.py``).
- ``h_one_gpu_ranks``: four real ranks on one GPU (2 emulated nodes x 2, one CUDA context each) through
  ``deepspeed.initialize`` on gloo with CUDA tensors (natively, or staged through pinned host memory where gloo lacks
  the collective): flat FCDP, the run-ahead on streams and LoRA bit-identical to ZeRO-3, the defaults within 1e-5,
  int4 and DiLoCo replicas in lockstep, a checkpoint round trip, and last the defaults under the CUDA sanitizer in
  every rank (``fcdp_lab/gpu/one_gpu.py``).
(a) also warms up two communicators as FCDP does at attach and reports the memory each took.

``dry_run=True`` runs (a) on gloo and (b) on the CPU accelerator: the logic, not the device.
"""
from __future__ import annotations

import tempfile
import time
from typing import Callable

from fcdp_lab.gpu.cases import multi_gpu_case
from fcdp_lab.gpu.codec import codec_case
from fcdp_lab.gpu.memory import host_memory_case
from fcdp_lab.gpu.one_gpu import one_gpu_case
from fcdp_lab.gpu.report import CaseResult, summary

__all__ = ["run", "summary"]


#: The case functions (``module:function`` run by :func:`~fcdp_lab.harness.launch.run_local`).
CASES = "fcdp_lab.gpu.cases"
FAKE_PG = "fcdp_lab.gpu.fake_pg"
SANITIZER = "fcdp_lab.gpu.sanitizer"
MEMORY = "fcdp_lab.gpu.memory"
CODEC = "fcdp_lab.gpu.codec"
ANCHOR = "fcdp_lab.gpu.diloco_anchor"
ONE_GPU = "fcdp_lab.gpu.one_gpu"


def _in_process(target: str, world: int, kwargs: dict, timeout: float, accelerator: str, env: dict = None) -> list:
    from fcdp_lab.harness.launch import run_local
    return run_local(target, world, kwargs, timeout=timeout,
                     env={"DS_ACCELERATOR": accelerator, "PYTHONWARNINGS": "ignore", **(env or {})})


def _case(name: str, fn: Callable[[], CaseResult]) -> CaseResult:
    """Run one case; a crashed or timed-out process becomes a failed case with its log tail."""
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # RankFailure carries the rank's log tail
        text = str(exc)
        res = CaseResult(name, error=f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}\n{text[-3000:]}")
    res.numbers["seconds"] = round(time.perf_counter() - t0, 2)
    # as each case ends: a run cut short by its budget still says what finished and what it cost
    print(f"gpu_check: {name} {'passed' if res.passed else 'FAILED'} in {res.numbers['seconds']} s", flush=True)
    return res


#: Per-case deadlines on one GPU (seconds): a, b, d, e (pinning + copies), f at most 395 s in all (b: 66 s measured
#: on the H200 with 6 variants, 8 now); g and h, 420 s (h: nine variants, the last under the CUDA sanitizer): the
#: next device run asks for them first (``--cases hg``, within gpu_run.sh's 450 s), the rest in a second call.
DEADLINES = {"a_grad_flush": 45, "b_fake_pg": 160, "d_sanitizer": 100, "e_pin": 30, "e_h2d": 30, "f_codec": 30,
             "g_diloco_anchor": 250, "h_one_gpu_ranks": 170}
#: Seconds of case g's deadline its training may use (the rest: start-up, the corpus, the two evaluations).
ANCHOR_MARGIN_S = 40


def _host_memory(dry_run: bool, gpus: int, accel: str, slow: int) -> CaseResult:
    pin = _in_process(f"{MEMORY}:pin_rank", 1, dict(pin_bytes=(2**26 if dry_run else 2**31), dry_run=dry_run),
                      DEADLINES["e_pin"] * slow, accel)[0]
    with tempfile.TemporaryDirectory(prefix="fcdp-gpu-check-") as rendezvous:
        h2d = _in_process(f"{MEMORY}:h2d_rank", max(1, gpus), dict(nbytes=(2**22 if dry_run else 2**28), reps=8,
                                                                       rendezvous=rendezvous, dry_run=dry_run),
                          DEADLINES["e_h2d"] * slow, accel)
    return host_memory_case(pin, h2d, dry_run)


def _one_gpu(dry_run: bool, accel: str, slow: int) -> CaseResult:
    with tempfile.TemporaryDirectory(prefix="fcdp-gpu-ckpt-") as root:
        ranks = _in_process(f"{ONE_GPU}:one_gpu_rank", 4, dict(hidden=64 if dry_run else 512, layers=3 if dry_run else 8,
                                                              steps=4, dry_run=dry_run, ckpt_root=root),
                            DEADLINES["h_one_gpu_ranks"] * slow, accel)
    return one_gpu_case(ranks, dry_run)


def run(dry_run: bool, gpus: int, hidden: int, layers: int, steps: int, only: str = "") -> dict:
    """Every case that fits this machine; the JSON report as a dict (``passed`` over all checks).
    Deadlines (:data:`DEADLINES`): at most 395 s on one GPU, doubled for a dry run.
    ``only``: the case letters to run (``"bd"``: a rerun that spends device time on two cases); all when empty."""
    accel = "cpu" if dry_run else "cuda"
    slow = 2 if dry_run else 1
    size = dict(hidden=hidden, layers=layers, steps=steps)
    small = dict(hidden=min(hidden, 256), layers=min(layers, 4), steps=2)  # the sanitizer runs every op in Python
    wanted = (lambda name: not only or name[0] in only)
    plan: list[tuple[str, Callable[[], CaseResult]]] = [
        ("a_grad_flush", lambda: _in_process(f"{CASES}:grad_flush_case", 1, {"backend": "gloo" if dry_run else "nccl"},
                                             DEADLINES["a_grad_flush"] * slow, accel)[0]),
        ("b_fake_pg", lambda: _in_process(f"{FAKE_PG}:fake_pg_case", 1, dict(dry_run=dry_run, **size),
                                          DEADLINES["b_fake_pg"] * slow, accel)[0]),
        ("d_sanitizer", lambda: _in_process(f"{SANITIZER}:sanitizer_case", 1, dict(dry_run=dry_run, **small),
                                            DEADLINES["d_sanitizer"] * slow, accel,
                                            env={} if dry_run else {"TORCH_CUDA_SANITIZER": "1"})[0]),
        ("e_host_memory", lambda: _host_memory(dry_run, gpus, accel, slow)),
        ("f_codec", lambda: codec_case(_in_process(f"{CODEC}:codec_rank", 1, dict(
            dry_run=dry_run, numel=2**16 if dry_run else 2**22), DEADLINES["f_codec"] * slow, accel)[0], dry_run)),
        ("g_diloco_anchor", lambda: _in_process(f"{ANCHOR}:anchor_rank", 1, dict(
            dry_run=dry_run, budget_s=DEADLINES["g_diloco_anchor"] - ANCHOR_MARGIN_S), DEADLINES["g_diloco_anchor"] * slow,
            accel)[0]),
        ("h_one_gpu_ranks", lambda: _one_gpu(dry_run, accel, slow)),
    ]
    cases = [_case(name, fn) for name, fn in plan if wanted(name)]
    if not dry_run and gpus >= 4 and wanted("c"):
        per_node = gpus // 2
        cases.append(_case("c_multi_gpu", lambda: multi_gpu_case(
            _in_process(f"{CASES}:multi_gpu_rank", 2 * per_node, dict(per_node=per_node, **size), 120, accel),
            per_node)))
    return {"mode": "dry-run-cpu" if dry_run else "gpu", "gpus": gpus, "passed": all(c.passed for c in cases),
            "cases": {c.case: c.to_json() for c in cases}}
