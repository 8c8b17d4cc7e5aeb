"""Checkpoint file ownership under DiLoCo: every node saves and loads its own ZeRO files.

[Note: one set of files per node] With stage 3 partitioned over the node, DeepSpeed 0.19.8 names a rank's ZeRO
files by its rank in the optimizer's ``dp_process_group`` (the node group), and only ranks whose node rank equals
their data-parallel rank save them (``_configure_checkpointing``: node 0 only). The nodes' inner states differ
between syncs, so a resume mid-interval needs every node's. Two engine methods are wrapped, for DiLoCo engines
only (``optimizer.fcdp_diloco`` set; every other engine runs DeepSpeed's unchanged):

- ``_configure_checkpointing``: every rank saves its ZeRO optimizer-state file, and only node 0 writes the
  ``*_model_states.pt`` files (every node would write the same names, with the same content at a sync);
- ``_get_zero_ckpt_prefix``: node ``n > 0`` keeps its files in a sub-directory of the tag,
  ``fcdp_diloco_node{n}/zero_pp_rank_{r}_*`` (``_save_zero_checkpoint`` creates it); node 0 keeps DeepSpeed's names
  in the tag directory itself, so that directory alone is a plain ZeRO-3 checkpoint of L partitions
  (``zero_to_fp32`` and ``ds_to_universal`` read it; taken at a sync it holds the outer model every node shares).

[Note: loading across modes] A ZeRO-3 checkpoint is loaded rigidly: each rank copies its own file's flat
partitions, whose size is set by the partition count (the world for exact ZeRO-3, the node for DiLoCo). Loading
one mode's checkpoint into the other would fail deep inside DeepSpeed (a missing file, a size mismatch) or load
optimizer moments of other elements (or load on some ranks only: a missing model-states file is skipped with a
warning); ``_load_checkpoint`` refuses it before anything is read, on every rank alike (the decision reads only
the tag directory), naming the fix: DeepSpeed's universal checkpoint, which is keyed by
parameter, not by partition. A universal load carries no DiLoCo state: the outer state restarts from the loaded
weights (``diloco/state.py``).

[Note: loading another data-parallel size] The same rigidity refuses a DiLoCo checkpoint saved with another
data-parallel world size (another node count, or ranks per node): DeepSpeed 0.16.9-0.19.8 raise "used a DP world size
of ..." in ``_load_zero_checkpoint`` (when it loads optimizer states, not ``load_module_only``), but only on the
ranks that found their own ``*_model_states.pt`` (only node 0's ranks write them); a rank whose rank in its node is
beyond the saved ranks per node finds none and fails earlier with a bare ``AssertionError``. ``_load_checkpoint`` refuses the same loads first, on every rank alike (it
reads ``dp_world_size`` from node 0's first model-states file, which every DiLoCo checkpoint has), naming the fix:
the universal checkpoint. The same size with another node layout (4 x 1 into 2 x 2, or back) is not caught
here: DeepSpeed fails on every rank (a partition size mismatch, a missing node file, a bare ``AssertionError``).
"""
from __future__ import annotations

import functools
import glob
import os
from typing import Any, Callable

from deepspeed.runtime.engine import DeepSpeedEngine

_ORIGINAL: dict[str, Callable] = {}
#: The sub-directory of a tag holding node ``n > 0``'s files.
NODE_DIR = "fcdp_diloco_node{node}"


def _node_index(engine: Any) -> int | None:
    sync = getattr(getattr(engine, "optimizer", None), "fcdp_diloco", None)
    if sync is None:
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
        return prefix if not node else f"{NODE_DIR.format(node=node)}/{prefix}"
    return wrapped


def _save_zero_checkpoint(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapped(self, save_path, tag):
        if _node_index(self):
            os.makedirs(os.path.dirname(self._get_zero_ckpt_name(save_path, tag)), exist_ok=True)
        return original(self, save_path, tag)
    return wrapped


def cross_mode_problem(diloco: bool, tag_dir: str) -> str | None:
    """Why a rigid load of the checkpoint in ``tag_dir`` into this engine (DiLoCo or not) must be refused, with the
    fix ([Note: loading across modes]); ``None`` when the modes match."""
    written_by_diloco = os.path.isdir(os.path.join(tag_dir, NODE_DIR.format(node=1)))
    if diloco == written_by_diloco:
        return None
    what = ("an exact ZeRO-3 checkpoint (partitioned over the whole world) into a DiLoCo engine (partitioned over "
            "each node)" if diloco else "a DiLoCo checkpoint (partitioned over each node, one set of files per node) "
                                        "into an exact engine (partitioned over the whole world)")
    return (f"fcdp.diloco: cannot load {what} from {tag_dir}: ZeRO-3 checkpoints load rigidly, partition by partition. "
            f"Fix: convert it to a universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
            f"{tag_dir} --output_folder {tag_dir}_universal) and load that with \"checkpoint\": {{\"load_universal\": "
            f"true}} in the config (the DiLoCo outer state then restarts from the loaded weights), or export the "
            f"weights with zero_to_fp32 and load them into the model before deepspeed.initialize.")


def saved_dp_world_size(engine: Any, tag_dir: str) -> int | None:
    """``dp_world_size`` of the checkpoint in ``tag_dir`` from its first data-parallel rank's model-states file (the
    same file on every rank), ``None`` without one."""
    first = sorted(glob.glob(os.path.join(glob.escape(tag_dir), "zero_pp_rank_0_mp_rank_*_model_states.pt")))
    if not first:
        return None
    saved = engine.checkpoint_engine.load(first[0], map_location="cpu").get("dp_world_size")
    return int(saved) if saved is not None else None


def dp_size_problem(saved: int | None, now: int, tag_dir: str) -> str | None:
    """Why a rigid load of a DiLoCo checkpoint of data-parallel world size ``saved`` into a DiLoCo engine of ``now``
    must be refused, with the fix ([Note: loading another data-parallel size]); ``None`` when the sizes match."""
    if saved is None or saved == now:
        return None
    return (f"fcdp.diloco: cannot load the checkpoint in {tag_dir}: it was saved with a data-parallel world size of "
            f"{saved} and this job has {now}; ZeRO-3 checkpoints load rigidly, partition by partition, so DeepSpeed "
            f"refuses it (\"used a DP world size of {saved}\"). Fix: convert it to a universal checkpoint (python -m "
            f"deepspeed.checkpoint.ds_to_universal --input_folder {tag_dir} --output_folder {tag_dir}_universal) and "
            f"load that with \"checkpoint\": {{\"load_universal\": true}} in the config (the weights load as node 0 "
            f"saved them; the DiLoCo outer state restarts from them), or resume with the data-parallel world size it "
            f"was saved with.")


def _load_checkpoint(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapped(self, load_dir, tag, *args, **kwargs):
        if not self.load_universal_checkpoint():
            diloco, tag_dir = getattr(getattr(self, "optimizer", None), "fcdp_diloco", None) is not None, \
                os.path.join(load_dir, str(tag))
            problem = cross_mode_problem(diloco, tag_dir)
            # DeepSpeed's own refusal of another DP size, on every rank ([Note: loading another data-parallel size])
            if problem is None and diloco and kwargs.get("load_optimizer_states", True) and \
                    not kwargs.get("load_module_only", False):
                problem = dp_size_problem(saved_dp_world_size(self, tag_dir), self.seq_dp_world_size, tag_dir)
            if problem is not None:
                raise RuntimeError(problem)
        return original(self, load_dir, tag, *args, **kwargs)
    return wrapped


_WRAPPERS = {"_configure_checkpointing": _configure_checkpointing, "_get_zero_ckpt_prefix": _get_zero_ckpt_prefix,
             "_save_zero_checkpoint": _save_zero_checkpoint, "_load_checkpoint": _load_checkpoint}


def install() -> None:
    """Wrap the engine's checkpoint methods (idempotent)."""
    for name, wrap in _WRAPPERS.items():
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(DeepSpeedEngine, name)
            setattr(DeepSpeedEngine, name, wrap(_ORIGINAL[name]))


def uninstall() -> None:
    for name, original in list(_ORIGINAL.items()):
        setattr(DeepSpeedEngine, name, original)
        del _ORIGINAL[name]
