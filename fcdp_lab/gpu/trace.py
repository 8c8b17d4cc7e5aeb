"""Per-step numbers from a ``torch.profiler`` trace: host-blocking synchronizations, synchronous copies,
and how much host-to-device copy time overlaps compute kernels.

Used by :mod:`fcdp_lab.gpu.check`. On the CPU accelerator the trace has no device
activity, so every count is 0 and the overlap fraction is ``None``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from torch.autograd import DeviceType

#: CUDA runtime calls that block the host until device work finishes.
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})
#: Runtime copies that block the host (the ``Async`` variants do not, unless the host side is pageable).
SYNC_COPY_CALLS = frozenset({"cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol"})


@dataclass
class StepTrace:
    """Counts and times (microseconds) of one traced step."""

    syncs: int = 0
    sync_memcpys: int = 0
    pageable_copies: int = 0
    """Device-side copies from or to pageable host memory (staged by the driver, host-synchronous)."""
    h2d_copies: int = 0
    h2d_us: float = 0.0
    h2d_overlap_us: float = 0.0
    """H2D copy time during which some compute kernel was running."""
    kernels: int = 0

    @property
    def overlap_fraction(self) -> Optional[float]:
        return self.h2d_overlap_us / self.h2d_us if self.h2d_us > 0 else None


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    """Length of ``interval`` inside the disjoint ``union``."""
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def summarize(events: Iterable) -> StepTrace:
    """Count one step's profiler events (``prof.events()``)."""
    trace = StepTrace()
    h2d: list[tuple[float, float]] = []
    kernels: list[tuple[float, float]] = []
    for e in events:
        name = e.name
        if e.device_type == DeviceType.CUDA:
            span = (e.time_range.start, e.time_range.end)
            if name.startswith("Memcpy"):
                trace.pageable_copies += "Pageable" in name
                if "HtoD" in name:
                    h2d.append(span)
            elif not name.startswith("Memset"):
                kernels.append(span)
        elif name in SYNC_CALLS:
            trace.syncs += 1
        elif name in SYNC_COPY_CALLS:
            trace.sync_memcpys += 1
    union = merge(kernels)
    trace.kernels = len(kernels)
    trace.h2d_copies = len(h2d)
    trace.h2d_us = sum(b - a for a, b in h2d)
    trace.h2d_overlap_us = sum(covered(span, union) for span in h2d)
    return trace


@contextmanager
def traced(device_activity: bool) -> Iterator[list]:
    """Profile the block; the yielded list receives its :class:`StepTrace` on exit."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_activity:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    holder: list = []
    with torch.profiler.profile(activities=activities) as prof:
        yield holder
    events = prof.events()
    holder += [summarize(events), gather_timeline(events)]


# -- the two-stage gather's timeline ----------------------------------------------------------------------
#: ``record_function`` ranges the GPU check wraps around the two-stage gather's collectives (:func:`stage_ranges`).
STAGE_RANGES = ("fcdp.gather.stage1", "fcdp.gather.stage1.wait", "fcdp.gather.stage2")


@contextmanager
def stage_ranges(group_spans_nodes) -> Iterator[None]:
    """Profiler ranges around ``runtime/gather.py``'s collectives: stage 1 (a group spanning nodes), its handle's
    ``wait()``, stage 2 (the node group). The tool patches the module's ``dist``; FCDP's code is unchanged."""
    from fcdp_deepspeed.runtime import gather as gather_module

    comm = gather_module.dist

    class _Waited:
        def __init__(self, work) -> None:
            self._work = work

        def wait(self, *args, **kwargs):
            with torch.profiler.record_function(STAGE_RANGES[1]):
                return self._work.wait(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._work, name)

    class _Ranged:
        def allgather_fn(self, output_tensor, input_tensor, group=None, async_op=False, **kwargs):
            stage1 = group_spans_nodes(group)
            if stage1 and not async_op:  # [Note: streams] in gather.py: synchronous on the gather stream, so the
                # call is its own wait (NCCL: an enqueue; a host stall shows here)
                with torch.profiler.record_function(STAGE_RANGES[0]), torch.profiler.record_function(STAGE_RANGES[1]):
                    return comm.allgather_fn(output_tensor, input_tensor, group=group, async_op=async_op, **kwargs)
            with torch.profiler.record_function(STAGE_RANGES[0] if stage1 else STAGE_RANGES[2]):
                work = comm.allgather_fn(output_tensor, input_tensor, group=group, async_op=async_op, **kwargs)
            return _Waited(work) if stage1 and async_op else work

        def __getattr__(self, name):
            return getattr(comm, name)

    gather_module.dist = _Ranged()
    try:
        yield
    finally:
        gather_module.dist = comm


def gather_timeline(events: Iterable) -> dict:
    """The two-stage gathers of one traced step, from :func:`stage_ranges`' ranges and the NCCL kernels:

    - ``host_stage1_to_stage2_us``: per gather, host time from issuing stage 1 to issuing stage 2 (what the host
      spends on stage 1 before the node stage can start: its ``wait()`` included);
    - ``host_stage1_wait_us``: the host time inside stage 1's ``wait()``, or inside the whole stage-1 call where it
      is synchronous on the gather stream (NCCL: a stream wait or an enqueue, near zero; a host stall shows here);
    - ``nccl_kernels``: ``(stream, start, end)`` of each all-gather kernel; ``ordered``: on every stream pair,
      no kernel of the second stage's stream starts before the first stage's preceding kernel ended
      (``None`` without kernels, e.g. a fake process group).
    """
    ranges: dict[str, list[tuple[float, float]]] = {name: [] for name in STAGE_RANGES}
    kernels: list[tuple[int, float, float]] = []
    for e in events:
        if e.name in ranges:
            ranges[e.name].append((e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CUDA and "nccl" in e.name.lower() and "allgather" in e.name.lower():
            kernels.append((getattr(e, "device_resource_id", 0), e.time_range.start, e.time_range.end))
    s1, s2 = sorted(ranges[STAGE_RANGES[0]]), sorted(ranges[STAGE_RANGES[2]])
    gaps = [min((b[0] for b in s2 if b[0] >= a[0]), default=a[1]) - a[0] for a in s1]
    kernels.sort(key=lambda k: k[1])
    ordered = None
    if len({k[0] for k in kernels}) >= 2:  # stage 1 and stage 2 run on their communicators' streams
        first = kernels[0][0]
        ordered = all(k[1] >= prev[2] for prev, k in zip(kernels, kernels[1:]) if prev[0] == first and k[0] != first)
    return {"gathers": len(s1), "host_stage1_to_stage2_us": gaps,
            "host_stage1_wait_us": [b - a for a, b in sorted(ranges[STAGE_RANGES[1]])],
            "nccl_kernels": kernels, "ordered": ordered}
