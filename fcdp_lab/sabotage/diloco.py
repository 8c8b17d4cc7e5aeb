"""Broken variants of the diloco path (registered with :func:`fcdp_lab.sabotage.variant`): each puts back one bug the
tests must catch.

- ``diloco.read_early``: a completion reads the peers' messages without waiting for the exchange
  (``diloco/exchange.py``; strict device mode names the read);
- ``diloco.skip_reassign``: a completion leaves the 16-bit partitions as they were (``DiLoCoSync.reassign``);
- ``diloco.skip_warmup``: a warm-up step leaves each node's gradients unaveraged (``engine/diloco_steps.py``);
- ``diloco.node_files``: DeepSpeed's file ownership (node 0 writes, every node reads node 0's), so a resume
  mid-interval is not exact (``diloco/files.py``).
"""
from __future__ import annotations

from typing import Optional

from fcdp_lab.sabotage import replace, variant


@variant("diloco.read_early")
def _read_early(value: Optional[str]) -> None:
    import functools

    from fcdp_deepspeed.diloco.exchange import PseudoGradExchange
    original = PseudoGradExchange.finish

    @functools.wraps(original)
    def finish(self, flight, wait=True):
        return original(self, flight, wait=False)
    replace(PseudoGradExchange, "finish", finish)


@variant("diloco.skip_reassign")
def _skip_reassign(value: Optional[str]) -> None:
    from fcdp_deepspeed.diloco.sync import DiLoCoSync
    replace(DiLoCoSync, "reassign", staticmethod(lambda optimizer, pieces: None))


@variant("diloco.skip_warmup")
def _skip_warmup(value: Optional[str]) -> None:
    from fcdp_deepspeed.engine.diloco_steps import DiLoCoSteps
    replace(DiLoCoSteps, "_diloco_before_step", lambda self: None)


@variant("diloco.node_files")
def _node_files(value: Optional[str]) -> None:
    """Every file wrapper finds no node index (DeepSpeed's names and ownership), and a load checks nothing."""
    from fcdp_deepspeed.diloco import files
    replace(files, "_node_index", lambda engine: None)
    replace(files, "cross_mode_problem", lambda diloco, tag_dir: None)
    replace(files, "saved_dp_world_size", lambda engine, tag_dir: None)
