"""The base of every ``fcdp`` config model: DeepSpeed's ``DeepSpeedConfigModel`` with strict types.

[Note: strict types] JSON has booleans and numbers, so ``"enabled": "yes"``, ``"enabled": 1`` or
``"min_numel": "1000"`` are refused (the message says how to write them) instead of coerced. One
exception: byte counts (``miss_batch_bytes``) take a size string such as "32MiB", like the budgets.
"""
from __future__ import annotations

from pydantic import ConfigDict

from deepspeed.runtime.config_utils import DeepSpeedConfigModel


class StrictConfigModel(DeepSpeedConfigModel):
    """A DeepSpeed config model with strict types (the ``fcdp`` block and any sub-block)."""

    model_config = ConfigDict(strict=True)
