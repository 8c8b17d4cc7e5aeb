"""Stage 2 of the two-stage gather, issued in FIFO order by the waits that need it (backends without streams).

[Note: stage 1 does not block the host]
On gloo every collective runs on the host, and a blocking stage 1 (the inter-node all-gather among node peers,
``gather.py``) held the host for its whole transfer inside DeepSpeed's fetch, before the compute that a
prefetch (DeepSpeed's, or the run-ahead's, ``runahead.py``) was meant to overlap. So where the engine has no
streams, stage 1 is issued asynchronously and stage 2 (the all-gather inside the node, which reads stage 1's
output) is issued not at issue time but by the first ``wait`` that needs it: that wait issues, in issue order,
the pending stage 2 of every earlier two-stage gather, then its own (:meth:`StageTwo.drain`), each only after its
stage 1 completed (``Work.wait``: never read before complete).

Why FIFO: gloo pairs the collectives of one group by their issue order, so every rank must issue the stage-2
all-gathers on the node group in one order. Issue points are program order, identical on every rank; wait
points are not quite: DeepSpeed waits the handles of one module in the iteration order of a ``set``, which
differs per rank. Draining everything up to the waited handle makes the issue order the FIFO order whatever
handle a rank waits first, and every rank has drained the same prefix when the module's wait loop ends, so
the node-group collectives issued at the next issue point (cache hits over the node group) come after the
same stage 2s on every rank. The tests put each rule's violation back (``fcdp_lab/sabotage/params.py``: only the
waited handle's stage 2, in the per-rank order; stage 2 without waiting for stage 1) and must see each fail.

On an accelerator with streams nothing here runs: stage 1 is enqueued on the gather stream and stage 2 right
after it, stream-ordered without a host wait ([Note: streams] in ``gather.py``).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import attributed_to, current_sinks


@dataclass(eq=False)
class Deferred:
    """One two-stage gather whose stage 2 waits in the queue: the ``allgather_handle`` of DeepSpeed's
    ``AllGatherCoalescedHandle`` (its ``wait`` is the only call DeepSpeed makes on it)."""

    queue: "StageTwo"
    flat: torch.Tensor
    bundle: torch.Tensor
    #: What completes stage 1: its work, or with ``fcdp.param_compression`` a ``StageOne`` whose ``wait`` also
    #: decodes into the bundle ([Note: the compressed stage 1 in flight] in ``runtime/compressed_gather.py``).
    stage1: Any
    #: Stage 1 was issued at the previous step's end (``runahead.py``): its wait is the timeline's push wait.
    pushed: bool = False
    stage2: Any = None
    #: The engines' counters the fetch that queued it counted into (``stats.current_sinks``): stage 2 is issued
    #: later, inside DeepSpeed's wait, and is still that engine's collective.
    sinks: tuple = ()

    def wait(self) -> None:
        self.queue.drain(self)
        self.stage2.wait()
        if self.stage1 is not None:  # a stage 2 issued without the wait: stage 1 completes before its buffer dies
            self.stage1.wait()


@dataclass(eq=False)
class StageTwo:
    """One engine's queue of deferred stage 2s (see [Note: stage 1 does not block the host])."""

    node_group: Any
    clock: Optional[timeline.PhaseClock] = None
    pending: deque = field(default_factory=deque)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def add(self, flat: torch.Tensor, bundle: torch.Tensor, stage1: Any, pushed: bool = False) -> Deferred:
        """Queue the stage 2 of a gather whose stage 1 was issued (in issue order)."""
        entry = Deferred(self, flat, bundle, stage1, pushed, sinks=current_sinks())
        with self._lock:
            self.pending.append(entry)
        return entry

    def drain(self, upto: Deferred) -> None:
        """Issue the stage 2 of every queued gather up to ``upto``, in issue order, each after its stage 1."""
        with self._lock:
            if upto.stage2 is not None:
                return
            while self.pending:
                entry = self.pending.popleft()
                self._issue(entry)
                if entry is upto:
                    return

    def _issue(self, entry: Deferred) -> None:
        if entry.stage1 is not None:
            self.wait_stage1(entry)
        with attributed_to(entry.sinks):
            entry.stage2 = dist.allgather_fn(entry.flat, entry.bundle, group=self.node_group, async_op=True)

    def wait_stage1(self, entry: Deferred) -> None:
        """Stage 1 of ``entry`` complete before its stage 2 reads the bundle (never read before complete); a stage 1
        issued ahead (``runahead.py``) is waited for in the timeline's push wait."""
        if entry.pushed:
            with timeline.waiting(timeline.Phase.PUSH_WAIT, self.clock):
                entry.stage1.wait()
        else:
            entry.stage1.wait()
        entry.stage1 = None
