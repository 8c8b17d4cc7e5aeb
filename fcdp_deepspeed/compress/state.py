"""Compression state in checkpoints: the ``fcdp_compression`` envelope of ``FCDPStage3.state_dict``.

[Note: the compression envelope]
Compression keeps optimizer-like state per rank (the gradient path's error-feedback residuals; the parameter
path's references). It is saved in each rank's own DeepSpeed optimizer-state file, under one key of the
optimizer's ``state_dict`` (:data:`ENVELOPE_KEY`), with one sub-key per registered part (``"grads"``,
``"params"``). Each part registers a ``save(optimizer) -> dict | None`` and ``load(optimizer, part | None)``
pair; ``load`` gets ``None`` when the checkpoint has no such part (written without compression, or loaded with
``load_optimizer_states=False`` or as a universal checkpoint) and must then start from a clean state. The key
is written only when some part has state, so a checkpoint of a job without compression is unchanged, and
DeepSpeed (plain ZeRO-3 loading an FCDP checkpoint, ``zero_to_fp32``) ignores it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

ENVELOPE_KEY = "fcdp_compression"

SaveFn = Callable[[Any], Optional[dict]]
LoadFn = Callable[[Any, Optional[dict]], None]
_PARTS: dict[str, tuple[SaveFn, LoadFn]] = {}


def register_part(name: str, save: SaveFn, load: LoadFn) -> None:
    """Register (or replace) the save/load pair of one part of the envelope."""
    _PARTS[name] = (save, load)


def save_envelope(optimizer: Any) -> dict:
    """Every part with state, by name (empty: nothing to save)."""
    saved = {name: save(optimizer) for name, (save, _) in sorted(_PARTS.items())}
    return {name: part for name, part in saved.items() if part is not None}


def load_envelope(optimizer: Any, envelope: Optional[dict]) -> None:
    """Hand each registered part its saved state (``None`` when the envelope has none)."""
    for name, (_, load) in sorted(_PARTS.items()):
        load(optimizer, None if envelope is None else envelope.get(name))
