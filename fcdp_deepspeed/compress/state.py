"""Compression state in DeepSpeed checkpoints: one envelope in each rank's optimizer state, a registry of parts.

[Note: the envelope]
What compression keeps between steps is optimizer state: the parameter references
(``runtime/compression_reference.py``) and the gradient residuals are part of where training is, so a run saved
and resumed must get them back to continue bit for bit. Each rank saves its own part in its own
optimizer state file (``FCDPStage3.state_dict``), under one key::

    state_dict["fcdp_compression"] = {"version": 1, "params": {...}, "grads": {...}}

Each concern registers one :class:`StatePart` under its name; a part validates what it gets back
itself (layout, codec, block size) and starts from nothing when it does not fit. A checkpoint without
the envelope (written without compression, or by plain ZeRO-3) gives every part ``None``.
``load_state`` runs on every rank of the data-parallel group together (``load_checkpoint`` is
collective), so a part may agree across ranks there.

[Note: weights rewritten without the optimizer state]
DeepSpeed calls the optimizer's ``load_state_dict`` only for loads of the optimizer states and universal
loads; ``load_checkpoint(load_optimizer_states=False)`` and ``load_module_only=True`` rewrite the weights
through ``_restore_from_bit16_weights`` (as ``refresh_fp32_params`` does) and never hand us a state. The
compression state of the old weights is then meaningless: ``FCDPStage3._restore_from_bit16_weights``
calls :meth:`CompressionState.reset`, which starts every part from nothing (empty references, the refresh
counter at 0, zero committed residuals), as a checkpoint without the envelope does. Every rank resets
alike (the decision is local: no collective, ``refresh_fp32_params`` may be called outside a load).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol

#: The key of the envelope in a rank's optimizer state dict.
ENVELOPE = "fcdp_compression"
#: Bumped when the envelope's own layout changes (a part versions its own content).
VERSION = 1


class StatePart(Protocol):
    """One concern's compression state (``"params"``, ``"grads"``)."""

    def state(self) -> dict:
        """What to save: plain containers and CPU tensors."""

    def load_state(self, saved: Optional[Mapping[str, Any]]) -> None:
        """Restore from ``saved`` (``None``: the checkpoint has none; start from nothing). Collective."""

    def reset(self, why: str) -> None:
        """Start from nothing, as a load of ``None`` does, without a collective ([Note: weights rewritten
        without the optimizer state])."""


@dataclass(eq=False)
class CompressionState:
    """The parts of one engine, by name (registered once, when the engine is built)."""

    parts: dict[str, StatePart] = field(default_factory=dict)

    def register(self, name: str, part: StatePart) -> None:
        if name in self.parts:
            raise ValueError(f"compression state part {name!r} registered twice")
        self.parts[name] = part

    def save_into(self, state_dict: dict) -> dict:
        """Add the envelope to a rank's optimizer ``state_dict`` (nothing when no part is registered)."""
        if self.parts:
            state_dict[ENVELOPE] = {"version": VERSION, **{name: part.state() for name, part in self.parts.items()}}
        return state_dict

    def load_from(self, state_dict: Optional[Mapping[str, Any]]) -> None:
        """Hand each part its saved state from a rank's optimizer ``state_dict`` (``None`` where absent)."""
        envelope = state_dict.get(ENVELOPE) if isinstance(state_dict, Mapping) else None
        if not isinstance(envelope, Mapping) or envelope.get("version") != VERSION:
            envelope = {}
        for name, part in self.parts.items():
            saved = envelope.get(name)
            part.load_state(saved if isinstance(saved, Mapping) else None)

    def reset(self, why: str) -> None:
        """Every part starts from nothing (``why``: what rewrote the weights), see [Note: weights rewritten without
        the optimizer state]."""
        for part in self.parts.values():
            part.reset(why)
