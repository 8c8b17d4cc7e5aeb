"""One line per rank for a config error: FCDP's refusals end a job without a traceback.

A bad ``fcdp`` block (or a DeepSpeed config FCDP cannot run with) raises :class:`FCDPConfigError` from
``deepspeed.initialize`` on every rank; Python's default hook printed a 50-line traceback per rank (204 lines
at 4 ranks) around a message that already names the key and the fix. :func:`install` (called by
``fcdp_deepspeed.install()``) chains ``sys.excepthook``: an uncaught FCDP config error prints as
``[rank R] FCDPConfigError: ...``; every other exception goes to the previous hook unchanged.
``FCDP_TRACEBACK=1`` keeps the full traceback. Standard library only.
"""
from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Optional

#: Set to 1 for the full traceback of a config error.
TRACEBACK_ENV = "FCDP_TRACEBACK"
#: The exception classes printed as one line (by name: they live in modules this one must not import).
ONE_LINE = ("FCDPConfigError", "UnsupportedDeepSpeedVersion", "TopologyError", "LayeredCallError")
_PREVIOUS: list = []


def _hook(kind: type, value: BaseException, tb: Optional[TracebackType]) -> None:
    ours = any(c.__name__ in ONE_LINE and c.__module__.startswith("fcdp_deepspeed") for c in kind.__mro__)
    if ours and os.environ.get(TRACEBACK_ENV, "0") != "1":
        rank = os.environ.get("RANK", "")
        where = f"[rank {rank}] " if rank else ""
        sys.stderr.write(f"{where}{kind.__name__}: {value}\n(full traceback: {TRACEBACK_ENV}=1)\n")
        sys.stderr.flush()
        return
    (_PREVIOUS[0] if _PREVIOUS else sys.__excepthook__)(kind, value, tb)


def install() -> None:
    """Chain :func:`_hook` in front of the current ``sys.excepthook``. Idempotent."""
    if sys.excepthook is not _hook:
        _PREVIOUS[:] = [sys.excepthook]
        sys.excepthook = _hook


def uninstall() -> None:
    if sys.excepthook is _hook:
        sys.excepthook = _PREVIOUS[0] if _PREVIOUS else sys.__excepthook__
