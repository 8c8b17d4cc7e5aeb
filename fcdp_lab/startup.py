"""Run by ``fcdp_lab.pth`` at every interpreter start of the venv: nothing, unless a test named broken variants
(``FCDP_LAB_BREAK``) or strict device mode for the processes it starts. Standard library only until then."""
from __future__ import annotations

import os


def run() -> None:
    if os.environ.get("FCDP_LAB_BREAK"):
        from fcdp_lab import sabotage
        sabotage.install()


run()
