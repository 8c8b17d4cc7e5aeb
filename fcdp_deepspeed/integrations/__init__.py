"""Integrations with training frameworks; each imports its framework only when used.

They sit on top of the core: they import it, it never imports them (``tests/test_architecture.py``).
:func:`install` registers their post-import patches; the startup hook and ``fcdp_deepspeed.install()``
call it. [Note: the patches are imported only when their framework is, so the startup hook, which
imports this package at every interpreter start, stays standard-library-only and small.]
"""
from __future__ import annotations

import sys

from fcdp_deepspeed.activation import post_import

HF = "fcdp_deepspeed.integrations.hf"


def _patch_hf_trainer(module: object) -> None:
    from fcdp_deepspeed.integrations import hf
    hf.patch_trainer(module)


#: (module, patch): each patch runs once its module has finished importing.
PATCHES = (("transformers.trainer", _patch_hf_trainer), )


def install() -> None:
    """Patch each framework once it is imported (now, if it already is). Idempotent."""
    for module, patch in PATCHES:
        post_import.when_imported(module, patch)


def uninstall() -> None:
    """Undo :func:`install`: drop patches not yet applied and undo the applied ones."""
    for module, patch in PATCHES:
        post_import.forget(module, patch)
    if HF in sys.modules:
        sys.modules[HF].unpatch_trainer()
