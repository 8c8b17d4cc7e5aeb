"""Old module paths of the tooling (``fcdp_deepspeed.launch``, ...) as aliases of the moved modules.

Each old path is a two-line module calling :func:`alias`, so imports, monkeypatches and
``python -m`` through the old path reach the one module object under ``fcdp_deepspeed.tools``
(never a second copy with its own classes).
"""
from __future__ import annotations

import importlib
import runpy
import sys


def alias(name: str, target: str) -> None:
    """Make module ``name`` the module ``target``; run ``target`` as ``__main__`` under ``python -m``."""
    if name == "__main__":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.modules[name] = importlib.import_module(target)
