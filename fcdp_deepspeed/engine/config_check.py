"""Refuse a ``fcdp`` block that DeepSpeed would otherwise ignore, or reject without a hint.

The stage-3 classes check the block when they are built, but a config with ZeRO stage 0, 1 or 2
never builds them, and DeepSpeed ignores unknown top-level keys: the job would train as plain
DeepSpeed with no word about it. ``deepspeed.initialize`` parses every config with the
``DeepSpeedConfig`` it imported by name (both branches: plain/hybrid engines and pipeline
engines), so :func:`~fcdp_deepspeed.install` puts :class:`FCDPCheckedConfig` there; it checks the block
once DeepSpeed has parsed the config and the ZeRO stage is known.

Before DeepSpeed parses a config, it and ``zero.Init(config_dict_or_path=...)`` (what Hugging Face runs
under ZeRO-3, which parses through ``deepspeed.runtime.config``) check that the block is not inside
``zero_optimization`` (where DeepSpeed rejects it with a raw pydantic error) and that no top-level key is
a near miss of ``fcdp`` (``FCDP``, ``fcpd``: silently ignored otherwise).

[Note: why zero.Init is wrapped, not its config class] ``DeepSpeedConfig.__init__`` calls
``super(DeepSpeedConfig, self)`` by its module-level name, so replacing ``deepspeed.runtime.config.DeepSpeedConfig``
with a subclass makes that ``super`` call recurse into DeepSpeed's own ``__init__`` without its arguments.
"""
from __future__ import annotations

import functools
import os
from typing import Any

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.partition_parameters import Init

from fcdp_deepspeed.config import check_block_placement, check_ds_config_compatible, load_ds_config, parse_fcdp_config


def _check_placement(config: Any) -> None:
    """The placement check on what DeepSpeed is about to parse: a dict or a path (base64 strings are left to it)."""
    if isinstance(config, dict) or (isinstance(config, (str, os.PathLike)) and os.path.exists(config)):
        check_block_placement(load_ds_config(config))


class FCDPCheckedConfig(DeepSpeedConfig):
    """DeepSpeed's config object; raises ``FCDPConfigError`` for a misplaced or misspelled ``fcdp`` block and
    for an enabled block DeepSpeed cannot honour."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        _check_placement(config)
        super().__init__(config, *args, **kwargs)
        if parse_fcdp_config(self._param_dict).enabled:  # a malformed block fails here, naming the key
            check_ds_config_compatible(self._param_dict)  # the stage, and features that bypass the cache


_ORIGINAL_INIT = Init.__init__


@functools.wraps(_ORIGINAL_INIT)
def _checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
    config = kwargs.get("config_dict_or_path", kwargs.get("config"))
    if config is not None:
        _check_placement(config)
    _ORIGINAL_INIT(self, *args, **kwargs)


def check_zero_init(on: bool) -> None:
    """Put the placement check in front of ``zero.Init(config_dict_or_path=...)`` (``install()``), or take it away."""
    Init.__init__ = _checked_init if on else _ORIGINAL_INIT
