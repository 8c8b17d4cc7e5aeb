"""Broken variants and test-only skews, injected into rank processes from the tests, never read by the product.

A test names the variants in the environment of the processes it starts::

    FCDP_LAB_BREAK="push.read_early,compression.own_row@1,push.delay@1=0.05"

``name`` applies in every process, ``name@R`` only in the process of global rank ``R``, ``=VALUE`` hands the variant
an argument. Each variant is a monkeypatch of the product, registered here with :func:`variant` by one of
:data:`MODULES`, that sets attributes only through :func:`replace` or :func:`wrap`; an unknown name is an error (a
misspelt broken variant must not pass as the working one).

Every rank process applies them when it starts (:func:`install`, idempotent): the harness's rank entry point
(``fcdp_lab/harness/_worker.py``) after taking the test's environment (forked ranks included), and
``fcdp_lab/startup.py``, which ``fcdp_lab.pth`` (``scripts/setup_env.sh``) runs at every interpreter start of the
venv, for processes started by torchrun, the deepspeed launcher or a test's own subprocess. A worker that compares
a working and a broken run in one process, and the event machine's rank server between sequences, apply variants for a
while instead: :func:`apply` returns what undoes them, :func:`applied` is the same as a context manager. A variant takes
effect for the engines built after it is applied (an engine may keep bound methods it took at build).
"""
from __future__ import annotations

import functools
import importlib
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

ENV = "FCDP_LAB_BREAK"
#: The modules that register variants (imported by :func:`install` only when a variant is named).
MODULES: tuple[str, ...] = ("fcdp_lab.sabotage.params", "fcdp_lab.sabotage.grads", "fcdp_lab.sabotage.compression",
                            "fcdp_lab.sabotage.diloco")

Patch = Callable[[Optional[str]], None]
_VARIANTS: dict[str, Patch] = {}
_INSTALLED: set[str] = set()
#: While :func:`apply` runs: ``(owner, attribute, previous value)`` of every attribute set, to restore.
_UNDO: Optional[list] = None
_MISSING = object()


def variant(name: str) -> Callable[[Patch], Patch]:
    """Register ``patch(value)`` as the broken variant ``name`` (``value``: the text after ``=``, or None)."""
    def register(patch: Patch) -> Patch:
        if name in _VARIANTS and _VARIANTS[name] is not patch:
            raise ValueError(f"broken variant {name!r} registered twice")
        _VARIANTS[name] = patch
        return patch
    return register


def replace(owner: Any, attribute: str, value: Any) -> None:
    """``owner.attribute = value``: for the process's life when installed at start, until :func:`apply`'s undo
    otherwise."""
    if _UNDO is not None:
        _UNDO.append((owner, attribute, vars(owner).get(attribute, _MISSING)))
    setattr(owner, attribute, value)


def wrap(owner: Any, attribute: str, make: Callable[[Callable], Callable]) -> None:
    """``owner.attribute`` replaced by ``make(original)`` (``__wrapped__``: the original), as :func:`replace`."""
    original = getattr(owner, attribute)
    replace(owner, attribute, functools.wraps(original)(make(original)))


def parse(value: str) -> list[tuple[str, Optional[int], Optional[str]]]:
    """``"a,b@1,c@0=0.5"`` -> ``[(a, None, None), (b, 1, None), (c, 0, "0.5")]``."""
    out = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        item, _, arg = item.partition("=")
        name, _, where = item.partition("@")
        out.append((name, int(where) if where else None, arg or None))
    return out


def known() -> list[str]:
    for module in MODULES:
        importlib.import_module(module)
    return sorted(_VARIANTS)


def _named(value: str) -> list[tuple[str, Optional[int], Optional[str]]]:
    names, named = known(), parse(value)
    unknown = [name for name, _, _ in named if name not in _VARIANTS]
    if unknown:
        raise ValueError(f"{ENV}: unknown broken variant {unknown}; known: {names}")
    return named


def apply(value: str) -> Callable[[], None]:
    """Apply the variants ``value`` names for this process (``@RANK`` against ``$RANK``) now; return what restores
    every attribute they set."""
    global _UNDO
    rank = int(os.environ.get("RANK", "0"))
    undo: list = []

    def restore() -> None:
        for owner, attribute, previous in reversed(undo):
            if previous is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, previous)
        undo.clear()

    _UNDO = undo
    try:
        for name, only, arg in _named(value):
            if only is None or only == rank:
                _VARIANTS[name](arg)
    except BaseException:
        restore()  # a variant that failed half-way leaves nothing behind
        raise
    finally:
        _UNDO = None
    return restore


@contextmanager
def applied(value: str) -> Iterator[None]:
    """:func:`apply` for the block (``""``: nothing)."""
    restore = apply(value)
    try:
        yield
    finally:
        restore()


def install(value: Optional[str] = None) -> list[str]:
    """Apply the variants ``value`` (default: ``$FCDP_LAB_BREAK``) that concern this process; return their names."""
    value = os.environ.get(ENV, "") if value is None else value
    if not value.strip():
        return []
    rank = int(os.environ.get("RANK", "0"))
    installed = []
    for name, only, arg in _named(value):
        if only is not None and only != rank:
            continue
        key = f"{name}={arg}"
        if key not in _INSTALLED:
            _VARIANTS[name](arg)
            _INSTALLED.add(key)
        installed.append(name)
    return installed
