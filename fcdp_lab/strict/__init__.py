"""Strict device mode (``FCDP_STRICT_DEVICE=1``): the CUDA discipline checked on DeepSpeed's CPU accelerator.

``strict_device.py`` (the strict door: host memory told from accelerator memory, collectives refusing host tensors,
blocking operations counted), ``strict_streams.py`` (the stream-order model) and ``strict_log.py`` (the log and the
call-site finder both share). The package knows none of it: it has a swappable door (``fcdp_deepspeed.machine.device``:
:func:`~fcdp_deepspeed.machine.device.install`, ``Door.strict``), and this lab puts the strict door there.

When: at every stage-3 engine build, before DeepSpeed's ``__init__`` runs (:func:`install` wraps the ``__init__`` of
``CountedStage3`` and ``CountedZeROOffload``), because the door guards the live backend's collectives, and
``deepspeed.comm`` is initialized only then; the first build installs the door, every build guards its backend.
Who: the harness's rank entry point (``harness/_worker.py``) and ``fcdp_lab/startup.py`` (for processes started any
other way, once the engine module is imported) call :func:`install_if_requested`; a worker that turns the mode on
for itself calls :func:`install`.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping, Optional

ENV = "FCDP_STRICT_DEVICE"
#: The module whose engines' ``__init__`` :func:`install` wraps.
ENGINE_MODULE = "fcdp_deepspeed.engine.stage3"
_WRAPPED = "_fcdp_lab_strict"


def requested(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``env`` (default: this process's environment) asks for strict device mode."""
    return (os.environ if env is None else env).get(ENV, "").strip().lower() in ("1", "true")


def _configuring(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from fcdp_lab.strict import strict_device
        strict_device.configure()
        original(self, *args, **kwargs)
    setattr(__init__, _WRAPPED, True)
    return __init__


def install() -> None:
    """Every later stage-3 engine build first installs the strict door and guards the collectives (idempotent)."""
    from fcdp_deepspeed.engine import stage3
    for cls in (stage3.CountedStage3, stage3.CountedZeROOffload):
        if not getattr(cls.__dict__["__init__"], _WRAPPED, False):
            cls.__init__ = _configuring(cls.__dict__["__init__"])


def install_if_requested(env: Optional[Mapping[str, str]] = None) -> bool:
    """:func:`install` when ``FCDP_STRICT_DEVICE=1``; whether it did."""
    if not requested(env):
        return False
    install()
    return True
