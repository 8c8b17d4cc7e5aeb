"""Checkpoint file ownership under DiLoCo: every node saves and loads its own ZeRO files.

[Note: one set of files per node] With stage 3 partitioned over the node, DeepSpeed 0.19.8 names a rank's ZeRO
files by its rank in the optimizer's ``dp_process_group`` (the node group), and only ranks whose node rank equals
their data-parallel rank save them (``_configure_checkpointing``: node 0 only). The nodes' inner states differ
between syncs, so a resume mid-interval needs every node's. Two engine methods are wrapped, for DiLoCo engines
only (``optimizer.fcdp_diloco`` set; every other engine runs DeepSpeed's unchanged):

- ``_configure_checkpointing``: every rank saves its ZeRO optimizer-state file, and only node 0 writes the
  ``*_model_states.pt`` files (every node would write the same names, with the same content at a sync);
- ``_get_zero_ckpt_prefix``: node ``n > 0`` names its files ``fcdp_diloco_node{n}_zero_pp_rank_{r}``; node 0
  keeps DeepSpeed's names, so its L files are a plain ZeRO-3 checkpoint of L partitions (``zero_to_fp32`` reads
  it; taken at a sync boundary it holds the outer model every node shares).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

from deepspeed.runtime.engine import DeepSpeedEngine

_ORIGINAL: dict[str, Callable] = {}
#: Test-only: ``FCDP_BREAK_DILOCO=node_files`` leaves DeepSpeed's file ownership (node 0 writes, every node reads
#: node 0's), the variant ``tests/test_diloco.py`` must catch (a resume mid-interval is then not exact).
BREAK_ENV = "FCDP_BREAK_DILOCO"


def _node_index(engine: Any) -> int | None:
    sync = getattr(getattr(engine, "optimizer", None), "fcdp_diloco", None)
    if sync is None or "node_files" in os.environ.get(BREAK_ENV, ""):
        return None
    return int(sync.layout["node"])


def _configure_checkpointing(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        node = _node_index(self)
        if node is not None:
            self.save_zero_checkpoint = True
            self.save_non_zero_checkpoint = self.save_non_zero_checkpoint and node == 0
        return out
    return wrapped


def _get_zero_ckpt_prefix(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapped(self, dp_rank, bf16_mode):
        prefix = original(self, dp_rank, bf16_mode)
        node = _node_index(self)
        return prefix if not node else f"fcdp_diloco_node{node}_{prefix}"
    return wrapped


_WRAPPERS = {"_configure_checkpointing": _configure_checkpointing, "_get_zero_ckpt_prefix": _get_zero_ckpt_prefix}


def install() -> None:
    """Wrap the engine's two methods (idempotent)."""
    for name, wrap in _WRAPPERS.items():
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(DeepSpeedEngine, name)
            setattr(DeepSpeedEngine, name, wrap(_ORIGINAL[name]))


def uninstall() -> None:
    for name, original in list(_ORIGINAL.items()):
        setattr(DeepSpeedEngine, name, original)
        del _ORIGINAL[name]
