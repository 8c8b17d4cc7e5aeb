"""Per-step numbers from a ``torch.profiler`` trace: host-blocking synchronizations, synchronous copies,
and how much host-to-device copy time overlaps compute kernels.

Used by :mod:`fcdp_deepspeed.tools.gpu_check`. On the CPU accelerator the trace has no device
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
    holder.append(summarize(prof.events()))
