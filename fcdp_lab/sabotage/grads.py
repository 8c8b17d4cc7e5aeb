"""Broken variants of the grads path (registered with :func:`fcdp_lab.sabotage.variant`).

- ``grads.read_early``: a stage's completion reads what it received before waiting for the collective
  (``Inflight.complete``);
- ``grads.no_drain``: the backward's end (and the step) leave the stages in flight undelivered;
- ``grads.delay=SECONDS``: a test-only skew, not a broken variant: this process issues every inter-node stage
  ``SECONDS`` late (``grads.delay@2=0.05``: rank 2 only), so that a read before completion shows on gloo;
- ``grads.reduce_scatter``: both stages take ``reduce_scatter_tensor`` (NCCL's branch) on gloo too;
- ``grads.workspace_early``: a stage gives its workspace buffers back when it is issued, not after its result was
  consumed (``StageWorkspace.take``: every lease is released at once), so the next stage writes buffers an
  in-flight collective still sends from and receives into ([Note: when a buffer may be reused]).
"""
from __future__ import annotations

import time
from typing import Any, Optional

from fcdp_lab.sabotage import replace, variant

@variant("grads.read_early")
def read_early(_: Optional[str]) -> None:
    from fcdp_deepspeed.grads.inflight import Inflight

    def complete(self: Inflight) -> list:
        out = self.finish()  # before the works completed
        for work in self.works:  # the buffers die only once they are done
            if work is not None:
                work.wait()
        self.buffers, self.works = (), []
        return out
    replace(Inflight, "complete", complete)


@variant("grads.no_drain")
def no_drain(_: Optional[str]) -> None:
    from fcdp_deepspeed.config import ds_compat
    from fcdp_deepspeed.engine.grad_steps import GradSteps

    def after_backward(self: Any) -> None:  # the boundary's flush only, nothing in flight delivered
        if self.fcdp_grads is not None and ds_compat.is_boundary(self):
            self._flush_node_buffer()
    replace(GradSteps, "_grads_after_backward", after_backward)
    replace(GradSteps, "_grads_drain_window", lambda self: None)


@variant("grads.delay")
def delay(value: Optional[str]) -> None:
    from fcdp_deepspeed.grads.collectives import StageCollectives
    if value is None:
        raise ValueError("grads.delay needs its seconds: grads.delay=SECONDS")
    seconds = float(value)
    original = StageCollectives.issue_across_nodes

    def issue_across_nodes(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(self, *args, **kwargs)
    if seconds:  # [Note: no sleep(0) on a hot path]
        replace(StageCollectives, "issue_across_nodes", issue_across_nodes)


@variant("grads.reduce_scatter")
def reduce_scatter(_: Optional[str]) -> None:
    from fcdp_deepspeed.grads.collectives import StageCollectives
    original = StageCollectives.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.use_alltoall = False
    replace(StageCollectives, "__init__", __init__)


@variant("grads.workspace_early")
def workspace_early(_: Optional[str]) -> None:
    from fcdp_deepspeed.grads.workspace import StageWorkspace
    original = StageWorkspace.take

    def take(self: Any, *args: Any, **kwargs: Any) -> Any:
        lease = original(self, *args, **kwargs)
        raw = lease._raw
        lease.release()  # given back at once: the next take may hand out the same buffer
        lease._raw = None
        assert raw is not None
        return lease
    replace(StageWorkspace, "take", take)
