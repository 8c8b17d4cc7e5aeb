"""The hook into DeepSpeed's reduce-scatter: buckets inside a :func:`bucket` block go to their engine's reducer."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch

from fcdp_deepspeed.grads.reducer import GradReducer

_LOCAL = threading.local()


@contextmanager
def bucket(reducer: Optional[GradReducer], params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Route the next ``reduce_scatter_coalesced`` call on this thread to ``reducer`` for ``params``."""
    previous = getattr(_LOCAL, "active", None)
    _LOCAL.active = (reducer, list(params)) if reducer is not None else None
    try:
        yield
    finally:
        _LOCAL.active = previous


def make_dispatch(original: Any) -> Any:
    """A drop-in for ``reduce_scatter_coalesced`` (as imported by DeepSpeed's stage-3 module): buckets
    of an engine with a :class:`GradReducer` go to it, everything else to DeepSpeed's function."""

    def reduce_scatter_coalesced(tensors, group=None):
        active = getattr(_LOCAL, "active", None)
        if active is not None and active[0].handles(group):
            reducer, params = active
            return reducer.reduce(params, tensors)
        return original(tensors, group)

    reduce_scatter_coalesced.__wrapped__ = original  # type: ignore[attr-defined]
    reduce_scatter_coalesced._fcdp_dispatch = True  # type: ignore[attr-defined]
    return reduce_scatter_coalesced


def install_dispatch() -> None:
    """Route DeepSpeed's stage-3 reduce-scatter through :func:`make_dispatch` (idempotent). Only
    buckets inside a :func:`bucket` block of an engine with a reducer are affected."""
    import deepspeed.runtime.zero.stage3 as stage3_module
    if not getattr(stage3_module.reduce_scatter_coalesced, "_fcdp_dispatch", False):
        stage3_module.reduce_scatter_coalesced = make_dispatch(stage3_module.reduce_scatter_coalesced)


def uninstall_dispatch() -> None:
    import deepspeed.runtime.zero.stage3 as stage3_module
    fn = stage3_module.reduce_scatter_coalesced
    if getattr(fn, "_fcdp_dispatch", False):
        stage3_module.reduce_scatter_coalesced = fn.__wrapped__
