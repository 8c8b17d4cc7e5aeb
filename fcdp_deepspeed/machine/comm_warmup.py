"""FCDP's communicators warmed up at attach, and the accelerator memory their first use took.

[Note: why warm up]
NCCL creates a communicator at the first collective on a group, allocating its buffers outside PyTorch's
caching allocator (on H100/H200 with NVLink SHARP, NVLS buffers can take hundreds of MiB or more per
communicator). FCDP adds two groups per rank, the node group and the node-peer group; left lazy, their
buffers would appear mid-forward (first cache hit) or mid-backward (first two-stage reduction), unbudgeted,
after placement decided. So each is initialised here with a one-element all-reduce through the door, and the
free accelerator memory is read around it; the measured step that places the cache (``runtime.promotion``)
then sees them as memory outside the allocator. Values are process-wide: a later engine reuses the groups.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from fcdp_deepspeed.machine import device

#: Group name -> accelerator bytes its first collective took (free memory before minus after), this process.
MEASURED: dict[str, int] = {}
#: Seconds the warm-ups took, this process.
SECONDS: list[float] = []
_WARMED: set[int] = set()


def warm_up(groups: Mapping[str, Any]) -> dict[str, int]:
    """Collective over each group (every member calls it, in the same order): a one-element all-reduce, waited
    for, on every group not warmed yet; returns the bytes measured for those. ``None`` groups are skipped."""
    acc = get_accelerator()
    out: dict[str, int] = {}
    for name, group in groups.items():
        if group is None or id(group) in _WARMED:
            continue
        _WARMED.add(id(group))
        t0 = time.perf_counter()
        before = acc.available_memory()
        t = device.small_to_accel([1], torch.int32)
        dist.all_reduce(t, group=group)
        device.small_to_host(t)  # blocking: the communicator exists and has run once
        out[name] = max(0, before - acc.available_memory())
        SECONDS.append(time.perf_counter() - t0)
    MEASURED.update(out)
    return out
