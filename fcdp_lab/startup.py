"""Run by ``fcdp_lab.pth`` at every interpreter start of the venv: nothing, unless a test named broken variants
(``FCDP_LAB_BREAK``), a declared link (``FCDP_LAB_LINK``) or strict device mode (``FCDP_STRICT_DEVICE=1``) for the processes it starts. Standard library
only until then: every interpreter of the venv pays for this file."""
from __future__ import annotations

import os
import sys


def after_import(module: str, then) -> None:
    """Call ``then()`` right after ``module`` (a submodule, found on its package's path) is first executed."""
    import importlib.abc
    import importlib.machinery

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != module:
                return None
            sys.meta_path.remove(self)  # once
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            execute = spec.loader.exec_module

            def exec_module(mod):
                execute(mod)
                then()
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())


def _strict() -> None:
    from fcdp_lab import strict
    strict.install()


def _link() -> None:
    from fcdp_lab import link_declaration
    link_declaration.install()


def run() -> None:
    if os.environ.get("FCDP_LAB_BREAK"):
        # [Note: a bad variant ends the process] Python reports an exception raised while it runs a .pth line and
        # starts the process anyway: a misspelt variant would then run the working code under a broken name.
        try:
            from fcdp_lab import sabotage
            sabotage.install()
        except Exception as exc:  # noqa: BLE001 - any failure to install is fatal here
            sys.stderr.write(f"fcdp_lab: FCDP_LAB_BREAK={os.environ['FCDP_LAB_BREAK']!r}: {exc}\n")
            sys.stderr.flush()
            os._exit(2)
    if os.environ.get("FCDP_LAB_LINK"):  # [Note: why the suite declares its link] (link_declaration.py)
        if "fcdp_deepspeed.machine.link" in sys.modules:
            _link()
        else:
            after_import("fcdp_deepspeed.machine.link", _link)
    if os.environ.get("FCDP_STRICT_DEVICE", "").strip().lower() in ("1", "true"):
        # the engines' module imports DeepSpeed: wrapped when the process imports it, not at every start
        if "fcdp_deepspeed.engine.stage3" in sys.modules:
            _strict()
        else:
            after_import("fcdp_deepspeed.engine.stage3", _strict)


run()
