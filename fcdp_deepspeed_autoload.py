"""The startup hook: what ``fcdp_deepspeed_autoload.pth`` runs at every interpreter start.

``pip install`` puts the ``.pth`` file into site-packages; Python's ``site`` module runs its one
line in every process (launcher-spawned ranks included), which calls :func:`startup`. That only
registers post-import hooks; the logic lives in the package (:mod:`fcdp_deepspeed.activation.autoload`,
:mod:`fcdp_deepspeed.integrations`), whose lazy ``__init__`` imports neither torch nor DeepSpeed.
Nothing in the package imports this module (``tests/test_architecture.py``). DeepSpeed 0.19.8 has
no plugin entry point (no entry-point group, no import hook), hence the startup file.
Opt out with ``FCDP_AUTOLOAD=0``.
"""
from __future__ import annotations


def startup() -> None:
    """Install FCDP when DeepSpeed is imported, and patch the HF Trainer when ``transformers.trainer`` is,
    each on its own: a script may import transformers first and DeepSpeed only inside the Trainer."""
    from fcdp_deepspeed.activation import autoload

    if autoload.autoload_enabled():
        from fcdp_deepspeed import integrations
        autoload.start()
        integrations.install()
