"""The ``fcdp.layered`` block: layered (breadth-first) gradient accumulation, parsed strictly, and what it refuses.

``"layered": 4`` (or ``{"chunks": 4}``) runs every batch the engine sees as four chunks that each pass a layer before
any chunk passes the next one (``fcdp_deepspeed/layered/``). DeepSpeed then sees one micro-step per optimizer step:
the window that ``gradient_accumulation_steps: 4`` would run is one batch four times larger, so the user's config
moves the accumulation count into the batch (the refusal below names the numbers).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Mapping, Optional

from pydantic import BeforeValidator, Field, ValidationError

from fcdp_deepspeed.config.errors import FCDP_KEY, sub_block_error
from fcdp_deepspeed.config.model import StrictConfigModel

KEY = f"{FCDP_KEY}.layered"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20,
          "GiB": 2**30, "TiB": 2**40}


def _size(value: Any) -> Any:
    """A size string ("2GiB", "500MB") as whole bytes; ``"none"``/``None``: no budget; anything else to the check."""
    if isinstance(value, str):
        if value.strip().lower() in ("none", "unlimited"):
            return None
        m = _SIZE.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    return value


class LayeredConfig(StrictConfigModel):
    """``fcdp.layered``: each batch runs as ``chunks`` chunks, layer by layer (docs/layered.md)."""

    chunks: int = Field(1, ge=1)
    """Chunks per batch (the accumulation count it replaces). 1: off."""
    layers: str = "auto"
    """The module list whose entries are the layers: ``auto`` (a Hugging Face model's decoder layers, else the
    longest ``nn.ModuleList`` / ``nn.Sequential`` of one class), or its dotted name such as ``"model.layers"``."""
    boundary_budget: Annotated[Optional[int], BeforeValidator(_size)] = Field(None, ge=0)
    """Bytes of a batch's layer boundaries kept on the accelerator; the layers past it keep theirs in pinned host
    memory until the backward ([Note: host boundaries] in ``layered/boundary.py``). Default: no budget (all on the
    accelerator); ``0``: every layer's on the host."""


_FIXES = {
    "chunks": "a whole number >= 1 (the accumulation count it replaces; 1 turns it off)",
    "layers": "\"auto\" or the dotted name of the model's layer list, such as \"model.layers\"",
    "boundary_budget": "bytes of layer boundaries kept on the accelerator: a whole number >= 0 or a size such as "
                       "\"2GiB\" (leave it out for no budget)",
}


def parse_layered(value: Any) -> Optional[LayeredConfig]:
    """``fcdp.layered`` as given (a chunk count, a mapping, or absent) -> the parsed block, ``None`` when off."""
    if value is None or value is False:
        return None
    if isinstance(value, LayeredConfig):
        return value if value.chunks > 1 else None
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"chunks": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"{KEY} must be a chunk count such as 4 or an object like {{\"chunks\": 4}}, got {value!r}. "
                         f"Fix: give the number of chunks per batch, or leave it out.")
    try:
        parsed = LayeredConfig(**dict(value))
    except ValidationError as err:
        raise sub_block_error(KEY, err.errors()[0], _FIXES) from None
    return parsed if parsed.chunks > 1 else None


#: The type of ``FCDPConfig.layered``: parsed by :func:`parse_layered` (``None``: layered accumulation off).
LayeredBlock = Annotated[Optional[LayeredConfig], BeforeValidator(parse_layered)]


class LayeredField(StrictConfigModel):
    """The base of ``FCDPConfig`` that holds its ``layered`` key (kept here, with the block it parses)."""

    layered: LayeredBlock = None
    """Layered (breadth-first) gradient accumulation: each batch in ``chunks`` chunks, every chunk through a layer
    before any chunk enters the next; each layer gathered once in forward and once in backward per step."""


def ds_problems(layered: LayeredConfig, ds_config: Mapping[str, Any]) -> list[str]:
    """What an enabled ``fcdp.layered`` cannot run with, each with the fix (numbers from ``ds_config``).

    [Note: the window becomes the batch] The chunks are the accumulation: DeepSpeed must see one micro-step per
    optimizer step, with a batch ``chunks`` times the chunk. A config that still accumulates would run
    ``gradient_accumulation_steps`` layered batches per step, a different (larger) global batch than the job
    meant; so it is refused with the rewrite, not rewritten behind the training loop's back (the loop, or the HF
    Trainer's arguments, feed the batches and must change with it)."""
    chunks, out = layered.chunks, []
    ga = ds_config.get("gradient_accumulation_steps", 1)
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    if isinstance(ga, int) and not isinstance(ga, bool) and ga > 1:
        batch = f"{ga} x {micro} = {ga * micro}" if isinstance(micro, int) else f"{ga} x the micro-batch"
        out.append(f"{KEY}.chunks = {chunks} with gradient_accumulation_steps = {ga}: layered accumulation runs the "
                   f"window as one batch split into chunks, so DeepSpeed must not accumulate as well. Fix: set "
                   f"gradient_accumulation_steps to 1 and train_micro_batch_size_per_gpu to {batch}, feed that batch "
                   f"per step, and set {KEY}.chunks to {ga} (HF Trainer: per_device_train_batch_size={batch.split(' = ')[-1]}, "
                   f"gradient_accumulation_steps=1)")
    return out
