"""Broken variants of the grads path (registered with :func:`fcdp_lab.sabotage.variant`).

- ``grads.read_early``: a stage's completion reads what it received before waiting for the collective
  (``Inflight.complete``);
- ``grads.no_drain``: the backward's end (and the step) leave the stages in flight undelivered;
- ``grads.delay=SECONDS``: a test-only skew, not a broken variant: this process issues every inter-node stage
  ``SECONDS`` late (``grads.delay@2=0.05``: rank 2 only), so that a read before completion shows on gloo;
- ``grads.reduce_scatter``: both stages take ``reduce_scatter_tensor`` (NCCL's branch) on gloo too.

Each patch is reversible: :func:`applied` runs a block with some variants and undoes them after, for workers that
run a working and a broken engine in one process.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import time
from typing import Any, Callable, Iterator, Optional
from unittest import mock

from fcdp_lab import sabotage
from fcdp_lab.sabotage import variant

#: The variants of this module and of ``compression.py``, by name (what :func:`applied` can apply and undo).
PATCHES: dict[str, sabotage.Patch] = {}
_STARTED: list = []


def reversible(name: str) -> Callable[[sabotage.Patch], sabotage.Patch]:
    """:func:`~fcdp_lab.sabotage.variant`, also applicable (and undone) by :func:`applied`; the patch replaces
    attributes with :func:`replace` only."""
    def register(patch: sabotage.Patch) -> sabotage.Patch:
        PATCHES[name] = patch
        return variant(name)(patch)
    return register


def replace(owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until :func:`applied`'s block ends (for the process's life when installed at start)."""
    patcher = mock.patch.object(owner, name, value)
    patcher.start()
    _STARTED.append(patcher)


@contextlib.contextmanager
def applied(spec: str) -> Iterator[list[str]]:
    """The variants ``spec`` (``FCDP_LAB_BREAK``'s syntax, ``name@RANK=VALUE``) in this process for the block only;
    yields the names applied here. An unknown name is an error, as at start."""
    for module in sabotage.MODULES:
        importlib.import_module(module)
    rank = int(os.environ.get("RANK", "0"))
    mark, names = len(_STARTED), []
    try:
        for name, only, arg in sabotage.parse(spec):
            if name not in PATCHES:
                raise ValueError(f"{sabotage.ENV}: unknown reversible broken variant {name!r}; known: {sorted(PATCHES)}")
            if only is None or only == rank:
                PATCHES[name](arg)
                names.append(name)
        yield names
    finally:
        while len(_STARTED) > mark:
            _STARTED.pop().stop()


@reversible("grads.read_early")
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


@reversible("grads.no_drain")
def no_drain(_: Optional[str]) -> None:
    from fcdp_deepspeed.config import ds_compat
    from fcdp_deepspeed.engine.grad_steps import GradSteps

    def after_backward(self: Any) -> None:  # the boundary's flush only, nothing in flight delivered
        if self.fcdp_grads is not None and ds_compat.is_boundary(self):
            self._flush_node_buffer()
    replace(GradSteps, "_grads_after_backward", after_backward)
    replace(GradSteps, "_grads_drain_window", lambda self: None)


@reversible("grads.delay")
def delay(value: Optional[str]) -> None:
    from fcdp_deepspeed.grads.collectives import StageCollectives
    seconds = float(value or 0)
    original = StageCollectives.issue_across_nodes

    def issue_across_nodes(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(self, *args, **kwargs)
    if seconds:  # [Note: no sleep(0) on a hot path]
        replace(StageCollectives, "issue_across_nodes", issue_across_nodes)


@reversible("grads.reduce_scatter")
def reduce_scatter(_: Optional[str]) -> None:
    from fcdp_deepspeed.grads.collectives import StageCollectives
    original = StageCollectives.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.use_alltoall = False
    replace(StageCollectives, "__init__", __init__)
