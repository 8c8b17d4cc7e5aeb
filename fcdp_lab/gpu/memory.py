"""Case (e) of the GPU check: pinned host memory and host-to-device bandwidth.

- ``pin_rank`` (one process): pin and zero ``pin_bytes`` through FCDP's door, timed (what the cache pool's
  allocation costs at engine build), against the cgroup's ``memory.current`` before and after (page-locked
  memory is charged to the job's cgroup, which is what FCDP's host budgets assume).
- ``h2d_rank`` (one process per local GPU, started together): host-to-device copies from pinned and from
  pageable memory with every local rank copying at once (L ranks share PCIe switches and host memory
  bandwidth), GB/s per rank.
- :func:`host_memory_case` combines them into one :class:`~fcdp_lab.gpu.report.CaseResult`.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from fcdp_lab.gpu.report import CaseResult

#: Pinned H2D slower than this per rank, with every local rank copying, fails (PCIe 3.0 x16 does ~12 GB/s;
#: pageable copies typically reach 3-6).
MIN_PINNED_GBPS = 5.0
#: Of the pinned bytes, at least this fraction must show up in the cgroup's memory.current.
CHARGED_FRACTION = 0.9


def pin_rank(pin_bytes: int, dry_run: bool) -> dict:
    """Pin and zero ``pin_bytes`` (uint8) through the door; seconds and the cgroup's usage around it."""
    from deepspeed.accelerator import get_accelerator

    from fcdp_deepspeed.machine import device
    from fcdp_deepspeed.storage import memory
    if not dry_run:
        get_accelerator().set_device(0)
    before = memory.cgroup_current()
    t0 = time.perf_counter()
    buf = device.pin_empty(pin_bytes, torch.uint8)
    pinned_s = time.perf_counter() - t0
    buf.zero_()
    seconds = time.perf_counter() - t0
    after = memory.cgroup_current()
    out = {"pin_bytes": pin_bytes, "pinned": device.is_pinned(buf), "pin_seconds": pinned_s,
           "pin_and_zero_seconds": seconds, "cgroup": before[0] if before else None,
           "cgroup_delta_bytes": after[1] - before[1] if before and after else None}
    del buf
    device.empty_host_cache()
    return out


def _barrier(rendezvous: str, name: str, world: int, timeout: float = 60.0) -> None:
    """Every local rank reaches ``name`` before any goes on (files in a shared directory, no process group)."""
    Path(rendezvous, f"{name}.{os.environ.get('RANK', '0')}").touch()
    deadline = time.time() + timeout
    while len(list(Path(rendezvous).glob(f"{name}.*"))) < world and time.time() < deadline:
        time.sleep(0.01)


def h2d_rank(nbytes: int, reps: int, rendezvous: str, dry_run: bool) -> dict:
    """Copies of ``nbytes`` to this rank's GPU, pinned then pageable, every local rank starting together."""
    from deepspeed.accelerator import get_accelerator

    from fcdp_deepspeed.machine import device
    acc = get_accelerator()
    if not dry_run:
        acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pinned, pageable = device.pin_empty(nbytes, torch.uint8), device.host_empty(nbytes, torch.uint8)
    dst = device.accel_empty(nbytes, torch.uint8)
    out = {}
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        device.to_accel(src, out=dst)  # warm-up
        acc.synchronize()
        _barrier(rendezvous, name, world)
        t0 = time.perf_counter()
        for _ in range(reps):
            device.to_accel(src, out=dst)
        acc.synchronize()
        out[f"{name}_gbps"] = nbytes * reps / (time.perf_counter() - t0) / 1e9
    return out


def host_memory_case(pin: dict, h2d: list[dict], dry_run: bool) -> CaseResult:
    """(e) Pinning time and pinned bytes against the cgroup; H2D GB/s with every local rank copying at once."""
    res = CaseResult("e_host_memory")
    on_gpu = not dry_run
    why = "" if on_gpu else "CPU accelerator: nothing is page-locked, no device"
    gib = pin["pin_bytes"] / 2**30
    rate = gib / pin["pin_and_zero_seconds"] if pin["pin_and_zero_seconds"] > 0 else None
    res.numbers.update(pin=pin, pin_and_zero_gib_per_s=rate,
                       minutes_to_pin_100_gib=(100 / rate / 60) if rate else None, h2d=h2d)
    res.check("pool memory is page-locked", pin["pinned"], why, on_gpu)
    delta = pin["cgroup_delta_bytes"]
    res.check(f"pinned bytes show in the cgroup's memory.current (>= {CHARGED_FRACTION:.0%})",
              delta is not None and delta >= CHARGED_FRACTION * pin["pin_bytes"],
              f"{delta} of {pin['pin_bytes']} bytes ({pin['cgroup']})", on_gpu and pin["cgroup"] is not None)
    for r, run in enumerate(h2d):
        res.check(f"rank {r}: pinned H2D >= {MIN_PINNED_GBPS} GB/s with {len(h2d)} local rank(s) copying",
                  run["pinned_gbps"] >= MIN_PINNED_GBPS, f"{run['pinned_gbps']:.1f} GB/s {why}", on_gpu)
        res.check(f"rank {r}: pinned H2D faster than pageable", run["pinned_gbps"] > run["pageable_gbps"],
                  f"{run['pinned_gbps']:.1f} vs {run['pageable_gbps']:.1f} GB/s {why}", on_gpu)
    res.numbers["h2d_pinned_gbps_total"] = sum(run["pinned_gbps"] for run in h2d)
    return res
