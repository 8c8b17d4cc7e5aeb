"""Where a step's host time goes: seconds per phase of inter-node work, per engine (``get_stats``'s ``timeline``).

[Note: the host's view] Each phase is ``time.perf_counter`` around the host calls that issue or wait for
inter-node work (a fetch's issue and its handle's wait, a gradient bucket's stages, the compression codec, the
optimizer step). On gloo (the CPU test suite, the emulated cluster) a collective runs on the host, so these are
the seconds compute waited on the network. On NCCL the host only enqueues: the same clocks then measure
issue overhead, not the GPU's waits; a CUDA-event view (what the GPU waited on which stream) is what a GPU run
would add, and nothing here pretends to be it.

Phases nest (a codec call inside a gradient's inter-node stage): each records its *exclusive* time, so the
phases of a step add up to at most its wall time.

[Note: the trace] While ``PhaseClock.events`` is a list (``python -m fcdp_lab bench`` turns it on for its timed steps), every
timed block is also recorded as ``(phase, start, end)`` in ``time.time()`` seconds, and so is every asynchronous
inter-node transfer registered with :func:`in_flight`, from its issue to its completion (a ``Work`` future's
callback, gloo's worker thread): the wall clock is one clock for every process of a machine, so the ranks of an
emulated cluster line up in one picture (``tools/bench/timeline_plot.py``). Off (``None``) it costs nothing.
"""
from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch


class Phase(enum.Enum):
    """One kind of host wait on communication (the ``timeline_*`` keys of ``get_stats``)."""

    FORWARD_GATHER = "forward_gather"
    """Forward fetches: issue (on gloo stage 1 of the two-stage gather is issued asynchronously) and wait."""
    BACKWARD_REFILL = "backward_refill"
    """Backward fetches (cache hits over the node group, or misses)."""
    GRAD_BUCKET = "grad_bucket"
    """A gradient bucket's reduction outside the two stages below (DeepSpeed's flat reduce-scatter, packing)."""
    GRAD_NODE_STAGE = "grad_node_stage"
    GRAD_INTER_NODE = "grad_inter_node"
    """The gradient's inter-node stage (per bucket at the boundary, and the window flush)."""
    CODEC = "codec"
    """Compression encode/decode (``fcdp.param_compression``/``grad_compression``)."""
    OPTIMIZER_STEP = "optimizer_step"
    """``step()`` outside the phases above: the norm's all-reduce, the optimizer's compute, invalidation."""
    PUSH_WAIT = "push_wait"
    """Waiting for a run-ahead stage 1 (``fcdp.param_runahead_bytes``/``param_push_bytes``) at the fetch that uses it."""


#: Names of the spans :func:`in_flight` records (not phases: nobody waits in them, the transfer runs beside the host).
IN_FLIGHT_STAGE1 = "in_flight_stage1"


@dataclass
class PhaseClock:
    """One engine's seconds and calls per phase, since the engine was built. Thread-safe (backward threads)."""

    seconds: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    #: ``None`` (off), or every timed block and in-flight span as ``(name, start, end)``: [Note: the trace].
    events: Optional[list] = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, phase: Phase, seconds: float) -> None:
        with self._lock:
            self.seconds[phase.value] += seconds
            self.calls[phase.value] += 1

    def record(self, name: str, start: float, end: float) -> None:
        """One span of the trace (``time.time()`` seconds); nothing when tracing is off."""
        with self._lock:
            if self.events is not None:
                self.events.append((name, start, end))

    def stats(self) -> dict:
        with self._lock:
            out = {f"timeline_{p.value}_s": round(self.seconds[p.value], 6) for p in Phase}
            out.update({f"timeline_{p.value}_calls": self.calls[p.value] for p in Phase})
        out["timeline_view"] = "host"  # [Note: the host's view]
        return out


_local = threading.local()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward (a fetch there is a backward refill)."""
    return torch._C._current_autograd_node() is not None


def fetch_phase() -> Phase:
    return Phase.BACKWARD_REFILL if in_backward() else Phase.FORWARD_GATHER


@contextmanager
def waiting(phase: Phase, clock: Optional[PhaseClock] = None) -> Iterator[None]:
    """Time the block as ``phase`` of ``clock`` (default: the clock of the enclosing block on this thread;
    none: not timed). Exclusive of nested blocks (see the module's note)."""
    stack = _stack()
    clock = clock if clock is not None else (stack[-1][0] if stack else None)
    if clock is None:
        yield
        return
    frame = [clock, phase, time.perf_counter(), 0.0]
    wall = time.time() if clock.events is not None else 0.0
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        elapsed = time.perf_counter() - frame[2]
        clock.add(phase, max(0.0, elapsed - frame[3]))
        if wall:
            clock.record(phase.value, wall, wall + elapsed)
        if stack:
            stack[-1][3] += elapsed


def in_flight(clock: Optional[PhaseClock], name: str, work: Any) -> None:
    """Trace an asynchronous transfer from now to its completion ([Note: the trace]); nothing when not tracing."""
    if clock is None or clock.events is None or work is None:
        return
    start = time.time()
    try:
        work.get_future().add_done_callback(lambda _: clock.record(name, start, time.time()))
    except (AttributeError, RuntimeError):  # a backend or work without a future: not traced
        pass


def per_step(before: dict, after: dict, steps: int) -> dict:
    """The ``timeline_*_s`` keys of two ``get_stats`` readings as seconds per step (``steps`` between them)."""
    steps = max(1, steps)
    return {p.value: (after.get(f"timeline_{p.value}_s", 0.0) - before.get(f"timeline_{p.value}_s", 0.0)) / steps
            for p in Phase}
