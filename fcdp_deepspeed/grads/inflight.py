"""The gradient's stages in flight: one issued collective (:class:`Inflight`) and the FIFO of those not taken on yet
(:class:`InterNodeQueue`).

[Note: the inter-node stage runs behind the backward]
Both stages of the hierarchical reduce-scatter (``layout.py``, [Note: the two-stage reduction]) are issued per bucket
asynchronously (``async_op=True``) when the on-gloo path is the default (``fcdp.grad_inflight_buckets`` > 0), and their
results are taken on later, in issue order:

- stage 1 (inside the node) of bucket k completes when bucket k + 1 is reduced, before it is packed (or at the
  backward's end; [Note: one packed input] in ``reducer.py``): its node sums go into the
  node buffer (a micro-step before the boundary under node accumulation) or stage 2 is issued at once;
- stage 2 (across nodes) completes when more than ``grad_inflight_buckets`` are in flight (the oldest, at the next
  bucket: the memory bound, each holds its send and receive buffers, about 3/L of its bucket's elements in fp32) and
  at the backward's end (``independent_gradient_partition_epilogue``, after DeepSpeed's last bucket and before the
  window flush): the fixed-order sum, then DeepSpeed's copy/add into its partition. So every stage completes before
  anything reads a gradient partition (the fp16 overflow check, the norm, the step, ``safe_get_full_grad``), and
  ``step()`` checks that none is left.

Until then the bucket's parameters are *skip* in DeepSpeed's ``partition_grads`` (their full gradients are freed, as
for buffered ones). Under node accumulation stage 2 is issued only at the boundary micro-step, when the window's sum
exists; under ``grad_accumulation: rank`` every micro-step.

Completion is FIFO on every rank: gloo pairs a group's collectives by issue order, and the issue points (buckets in
DeepSpeed's program order, completions triggered by counts, never by timing) are the same on every rank; FIFO also
keeps a parameter delivered twice in a window (reentrant checkpointing) copied before it is added to. Completion
itself issues no collective but the stage 2 it may start.

Backends ([Note: NCCL vs gloo] in the overlap notes): on gloo a collective runs on its group's worker threads and
``wait()`` is the host's only wait, at completion; on NCCL it runs on the group's stream, which waits for the issuing
stream (DeepSpeed's reduce stream), and ``wait()`` at completion makes the then current stream (the reduce stream
again) wait for it, with no host wait, so the next buckets' stage 1 is not queued behind a stage 2. Buffers handed to
an in-flight collective are held by its :class:`Inflight` and never written before it completed. Strict mode models
each collective on its group's stream: reading its output before ``wait()`` is an ordering error
(the lab's broken variant ``grads.read_early``, which replaces :meth:`Inflight.complete`:
``tests/test_device_discipline.py``; on gloo with a late peer, different values: ``tests/test_grad_overlap.py``).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch


@dataclass(eq=False)
class Inflight:
    """One issued stage: the works to wait for, the buffers they use (held until then), ``finish``, which turns the
    received data into the stage's result (after every wait), and the workspace buffers it holds (``leases``: given
    back by :meth:`release`, once the result was consumed: [Note: when a buffer may be reused] in ``workspace.py``)."""

    works: list
    finish: Callable[[], list]
    buffers: tuple = ()
    leases: tuple = ()

    def complete(self) -> list[torch.Tensor]:
        """Wait for every work, then turn the received data into the result; the buffers are let go after, the
        workspace's are not (:meth:`release`)."""
        for work in self.works:
            if work is not None:
                work.wait()
        out = self.finish()
        self.buffers, self.works = (), []
        return out

    def release(self, after: Any = None) -> None:
        """Give the workspace buffers back: after :meth:`complete`, once nothing on this stream reads its result any
        more (``after``: the event of a reader on another stream, ``workspace.Lease.release``)."""
        leases, self.leases = self.leases, ()
        for lease in leases:
            lease.release(after)

    def result(self) -> list[torch.Tensor]:
        """:meth:`complete`, then :meth:`release`: for a result of tensors of its own ([Note: what leaves the
        workspace] in ``collectives.py``)."""
        try:
            return self.complete()
        finally:
            self.release()

    @staticmethod
    def done(parts: list[torch.Tensor]) -> "Inflight":
        """An already complete stage (nothing to send)."""
        return Inflight([], lambda: parts)

    @staticmethod
    def merged(count: int, pieces: Sequence[tuple[Sequence[int], "Inflight"]]) -> "Inflight":
        """Several stages for one list of ``count`` parameters: piece ``(indices, inflight)`` covers ``indices``;
        their workspace buffers go back with the merged stage's."""
        def finish() -> list:
            out: list[Optional[torch.Tensor]] = [None] * count
            for indices, inflight in pieces:
                for i, part in zip(indices, inflight.complete()):
                    out[i] = part
            return out
        return Inflight([], finish, leases=tuple(lease for _, inflight in pieces for lease in inflight.leases))


@dataclass(eq=False)
class Pending:
    """A bucket's (or flush batch's) parameters whose partitions arrive with ``inflight``."""

    params: list
    inflight: Inflight
    #: Each partition's length in DeepSpeed's layout (``own_chunk_numel``).
    lengths: list


@dataclass
class InterNodeQueue:
    """The FIFO of :class:`Pending` stages of one reducer (see [Note: the inter-node stage runs behind the backward]).
    Thread-safe: buckets are reduced on autograd threads, the epilogue on the engine's."""

    depth: int
    entries: deque = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: The most stages in flight at once since the engine was built (``grad_inflight_max``).
    high_water: int = 0

    def add(self, entry: Pending) -> None:
        with self._lock:
            self.entries.append(entry)
            self.high_water = max(self.high_water, len(self.entries))

    def __len__(self) -> int:
        return len(self.entries)

    def take(self, keep: int) -> Iterator[Pending]:
        """The oldest entries, in issue order, until at most ``keep`` are left."""
        while True:
            with self._lock:
                if len(self.entries) <= keep:
                    return
                entry = self.entries.popleft()
            yield entry
