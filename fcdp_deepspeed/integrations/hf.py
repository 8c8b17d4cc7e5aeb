"""FCDP's counters in the Hugging Face Trainer's logs (console, wandb, TensorBoard, like the loss).

DeepSpeed's monitor and FCDP's ``[fcdp]`` line do not reach where Trainer users look, so
:class:`FCDPStatsCallback` adds ``fcdp/*`` entries (this rank's :func:`~fcdp_deepspeed.get_stats`
counters, under the names DeepSpeed's monitor gets) to the ``logs`` dict of every ``on_log`` event (and to that event's ``state.log_history``
entry); the Trainer reports rank 0's.

Reporting callbacks read that same dict in list order, and the Trainer puts ``callbacks=[...]``
*after* its own reporters, so the callback must be first: :func:`add_stats_callback` puts it there,
and every Trainer whose DeepSpeed config has an enabled ``fcdp`` block gets it automatically once
:func:`patch_trainer` has run (the startup hook runs it when ``transformers.trainer`` is imported,
whether or not DeepSpeed is; so does ``fcdp_deepspeed.install()``) (``FCDP_HF_CALLBACK=0`` or ``trainer.remove_callback(FCDPStatsCallback)`` opts out).
Nothing here imports ``transformers`` until the callback class is used.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

#: Set to ``0`` to keep Trainers with an enabled ``fcdp`` block from getting the callback automatically.
HF_CALLBACK_ENV = "FCDP_HF_CALLBACK"
_PATCHED = "_fcdp_original_init"


def stats_for_logs(stats: dict) -> dict[str, float]:
    """The ``fcdp/*`` log entries for one ``get_stats`` dict: the names and keys DeepSpeed's monitor gets
    (:data:`fcdp_deepspeed.reporting.monitor.REPORTED_KEYS`)."""
    from fcdp_deepspeed.reporting.monitor import reported_values
    return reported_values(stats)


def find_stage3(*candidates: Any) -> Optional[Any]:
    """The ZeRO-3 optimizer (or offload object) behind an engine, an optimizer wrapper (accelerate's
    ``DeepSpeedOptimizerWrapper``) or the optimizer itself; ``None`` if FCDP's classes did not build it."""
    for obj in candidates:
        for _ in range(4):
            if obj is None:
                break
            if hasattr(obj, "fcdp_comm"):
                return obj
            obj = getattr(obj, "optimizer", None)
    return None


@functools.lru_cache(maxsize=None)
def callback_class() -> type:
    """Build the ``TrainerCallback`` subclass (imports ``transformers``)."""
    from transformers import TrainerCallback

    from fcdp_deepspeed.reporting.engine_stats import stats_of

    class FCDPStatsCallback(TrainerCallback):
        """Adds ``fcdp/*`` counters to every Trainer log event (see :mod:`fcdp_deepspeed.integrations.hf`)."""

        def __init__(self, engine: Any = None) -> None:
            self.engine = engine

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
            optimizer = find_stage3(self.engine, kwargs.get("optimizer"))
            if logs is None or optimizer is None:
                return
            entries = stats_for_logs(stats_of(optimizer))
            logs.update(entries)
            # the Trainer appended a copy of this event's logs to the history just before: complete it too
            history = getattr(state, "log_history", None)
            if history and all(history[-1].get(k) == v for k, v in logs.items() if k not in entries):
                history[-1].update(entries)

    FCDPStatsCallback.__module__ = __name__
    return FCDPStatsCallback


def __getattr__(name: str) -> Any:
    if name == "FCDPStatsCallback":
        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_stats_callback(trainer: Any) -> Any:
    """Put the callback first in ``trainer``'s list (before the reporters that read ``logs``); idempotent."""
    cls = callback_class()
    callbacks = trainer.callback_handler.callbacks
    existing = next((cb for cb in callbacks if isinstance(cb, cls)), None)
    if existing is not None:
        callbacks.remove(existing)
    callback = existing or cls()
    callbacks.insert(0, callback)
    return callback


def trainer_block_enabled(trainer: Any) -> bool:
    """Whether the Trainer's DeepSpeed config (via accelerate's plugin or ``args.deepspeed``) enables ``fcdp``."""
    from fcdp_deepspeed.config import parse_fcdp_config

    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    holder = getattr(plugin, "hf_ds_config", None) or getattr(getattr(trainer, "args", None), "hf_deepspeed_config", None)
    config = getattr(holder, "config", None)
    if not isinstance(config, dict):
        return False
    try:
        return parse_fcdp_config(config).enabled
    except ValueError:  # a bad block fails at deepspeed.initialize, with the key named
        return False


def patch_trainer(module: Any) -> None:
    """Wrap ``transformers.trainer.Trainer.__init__``: Trainers with an enabled block get the callback."""
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or _PATCHED in trainer_cls.__dict__:
        return
    original = trainer_cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if os.environ.get(HF_CALLBACK_ENV, "1") != "0" and trainer_block_enabled(self):
            add_stats_callback(self)

    trainer_cls.__init__ = __init__
    setattr(trainer_cls, _PATCHED, original)


def unpatch_trainer() -> None:
    import sys
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is not None and _PATCHED in trainer_cls.__dict__:
        trainer_cls.__init__ = trainer_cls.__dict__[_PATCHED]
        delattr(trainer_cls, _PATCHED)
