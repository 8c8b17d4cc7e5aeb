"""fcdp-deepspeed: Fully Cached Data Parallel for DeepSpeed ZeRO-3.

Add ``"fcdp": {"enabled": true}`` to a ZeRO-3 DeepSpeed config. Once this package is pip-installed
that is all: its startup hook (``fcdp_deepspeed_autoload``) calls :func:`install` when a process
imports DeepSpeed. Without the hook (``FCDP_AUTOLOAD=0``), call :func:`install` once before building
the model, use :func:`initialize` instead of ``deepspeed.initialize``, or launch with
``python -m fcdp_deepspeed.run``.

[Note: this ``__init__`` is lazy (PEP 562 ``__getattr__``) so that the startup hook can import the
package's standard-library-only modules at every interpreter start without torch or DeepSpeed.]
"""
from __future__ import annotations

from importlib import import_module

#: Public names -> the module that defines them, imported on first access.
_LAZY = {
    "get_stats": "fcdp_deepspeed.activation.api", "is_installed": "fcdp_deepspeed.activation.api",
    "enable_comm_counting": "fcdp_deepspeed.activation.api", "FCDPConfig": "fcdp_deepspeed.config",
    "FCDPConfigError": "fcdp_deepspeed.config", "parse_fcdp_config": "fcdp_deepspeed.config",
    "StaleCacheError": "fcdp_deepspeed.runtime", "TopologyError": "fcdp_deepspeed.machine.topology",
    "__version__": "fcdp_deepspeed.version", "exact_gathers": "fcdp_deepspeed.engine.evaluation",
}

__all__ = ["install", "uninstall", "initialize", *_LAZY]


def install() -> None:
    """Make ``deepspeed.initialize`` build FCDP's stage-3 classes for configs with an enabled block
    (:func:`fcdp_deepspeed.activation.api.install`), and give HF Trainers with one the stats callback. Idempotent."""
    from fcdp_deepspeed import integrations
    from fcdp_deepspeed.activation import api
    api.install()
    integrations.install()


def uninstall() -> None:
    """Undo :func:`install` for engines and Trainers created afterwards."""
    from fcdp_deepspeed import integrations
    from fcdp_deepspeed.activation import api
    api.uninstall()
    integrations.uninstall()


def initialize(*args: object, **kwargs: object) -> object:
    """Drop-in for ``deepspeed.initialize`` (same arguments and return value) with FCDP installed."""
    install()
    import deepspeed
    return deepspeed.initialize(*args, **kwargs)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
