"""Broken variants and test-only skews, injected into rank processes from the tests, never read by the product.

A test names the variants in the environment of the processes it starts::

    FCDP_LAB_BREAK="push.read_early,compression.own_row@1,push.delay@1=0.05"

``name`` applies in every process, ``name@R`` only in the process of global rank ``R``, ``=VALUE`` hands the variant
an argument. Each variant is a monkeypatch of the product, registered here with :func:`variant` by one of
:data:`MODULES`; an unknown name is an error (a misspelt broken variant must not pass as the working one).

Every rank process applies them when it starts (:func:`install`, idempotent): the harness's rank entry point
(``fcdp_lab/harness/_worker.py``) after taking the test's environment (forked ranks included), and
``fcdp_lab/startup.py``, which ``fcdp_lab.pth`` (``scripts/setup_env.sh``) runs at every interpreter start of the
venv, for processes started by torchrun, the deepspeed launcher or a test's own subprocess.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Optional

ENV = "FCDP_LAB_BREAK"
#: The modules that register variants (imported by :func:`install` only when a variant is named).
MODULES: tuple[str, ...] = ("fcdp_lab.sabotage.params", "fcdp_lab.sabotage.grads", "fcdp_lab.sabotage.compression",
                            "fcdp_lab.sabotage.diloco")

Patch = Callable[[Optional[str]], None]
_VARIANTS: dict[str, Patch] = {}
_INSTALLED: set[str] = set()


def variant(name: str) -> Callable[[Patch], Patch]:
    """Register ``patch(value)`` as the broken variant ``name`` (``value``: the text after ``=``, or None)."""
    def register(patch: Patch) -> Patch:
        if name in _VARIANTS and _VARIANTS[name] is not patch:
            raise ValueError(f"broken variant {name!r} registered twice")
        _VARIANTS[name] = patch
        return patch
    return register


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


def install(value: Optional[str] = None) -> list[str]:
    """Apply the variants ``value`` (default: ``$FCDP_LAB_BREAK``) that concern this process; return their names."""
    value = os.environ.get(ENV, "") if value is None else value
    if not value.strip():
        return []
    names = known()
    rank = int(os.environ.get("RANK", "0"))
    applied = []
    for name, only, arg in parse(value):
        if name not in _VARIANTS:
            raise ValueError(f"{ENV}: unknown broken variant {name!r}; known: {names}")
        if only is not None and only != rank:
            continue
        key = f"{name}={arg}"
        if key not in _INSTALLED:
            _VARIANTS[name](arg)
            _INSTALLED.add(key)
        applied.append(name)
    return applied
