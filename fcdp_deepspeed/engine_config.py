"""Refuse an enabled ``fcdp`` block that DeepSpeed would otherwise ignore.

The stage-3 classes check the block when they are built, but a config with ZeRO stage 0, 1 or 2
never builds them, and DeepSpeed ignores unknown top-level keys: the job would train as plain
DeepSpeed with no word about it. ``deepspeed.initialize`` parses every config with the
``DeepSpeedConfig`` it imported by name (both branches: plain/hybrid engines and pipeline
engines), so :func:`~fcdp_deepspeed.install` puts this subclass there; it checks the block once
DeepSpeed has parsed the config and the ZeRO stage is known.
"""
from __future__ import annotations

from typing import Any

from deepspeed.runtime.config import DeepSpeedConfig

from fcdp_deepspeed.config import check_ds_config_compatible, parse_fcdp_config


class FCDPCheckedConfig(DeepSpeedConfig):
    """DeepSpeed's config object; raises ``FCDPConfigError`` for an enabled block DeepSpeed cannot honour."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if parse_fcdp_config(self._param_dict).enabled:  # a malformed block fails here, naming the key
            check_ds_config_compatible(self._param_dict)  # the stage, and features that bypass the cache
