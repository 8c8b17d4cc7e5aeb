"""Refuse a ``fcdp`` block that DeepSpeed would otherwise ignore, or reject without a hint.

The stage-3 classes check the block when they are built, but a config with ZeRO stage 0, 1 or 2
never builds them, and DeepSpeed ignores unknown top-level keys: the job would train as plain
DeepSpeed with no word about it. ``deepspeed.initialize`` parses every config with the
``DeepSpeedConfig`` it imported by name (both branches: plain/hybrid engines and pipeline
engines), so :func:`~fcdp_deepspeed.install` puts :class:`FCDPCheckedConfig` there; it checks the block
once DeepSpeed has parsed the config and the ZeRO stage is known. ``zero.Init(config_dict_or_path=...)``
(what Hugging Face runs under ZeRO-3) parses the config through ``deepspeed.runtime.config``, where
``install()`` puts :class:`PlacementCheckedConfig`.

Both check *before* DeepSpeed parses that the block is not inside ``zero_optimization`` (where DeepSpeed
rejects it with a raw pydantic error) and that no top-level key is a near miss of ``fcdp`` (``FCDP``,
``fcpd``: silently ignored otherwise).
"""
from __future__ import annotations

import os
from typing import Any

from deepspeed.runtime.config import DeepSpeedConfig

from fcdp_deepspeed.config import check_block_placement, check_ds_config_compatible, load_ds_config, parse_fcdp_config


def _check_placement(config: Any) -> None:
    """The placement check on what DeepSpeed is about to parse: a dict or a path (base64 strings are left to it)."""
    if isinstance(config, dict) or (isinstance(config, (str, os.PathLike)) and os.path.exists(config)):
        check_block_placement(load_ds_config(config))


class PlacementCheckedConfig(DeepSpeedConfig):
    """DeepSpeed's config object; raises ``FCDPConfigError`` for a misplaced or misspelled ``fcdp`` block."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        _check_placement(config)
        super().__init__(config, *args, **kwargs)


class FCDPCheckedConfig(PlacementCheckedConfig):
    """Also raises ``FCDPConfigError`` for an enabled block DeepSpeed cannot honour."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if parse_fcdp_config(self._param_dict).enabled:  # a malformed block fails here, naming the key
            check_ds_config_compatible(self._param_dict)  # the stage, and features that bypass the cache
