"""One rank of :func:`~fcdp_lab.harness.launch.run_local` that runs a training script unchanged.

``run_local("fcdp_lab.harness.script_rank:run", 4, {"script": "train.py", "argv": [...]})`` runs the
script as ``__main__`` with ``sys.argv = [script, *argv]`` on each rank, as a launcher's rank would
(``RANK``, ``WORLD_SIZE``, ``MASTER_*`` come from ``run_local``), but forked from the fork server.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence


def run(script: str, argv: Sequence[str]) -> None:
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
