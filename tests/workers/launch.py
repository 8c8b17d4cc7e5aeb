"""Workers of test_launch.py: a rank that only waits, to be interrupted."""
from __future__ import annotations

from workers.common import setup


def sleeper(seconds: float = 120) -> None:
    import time
    setup()
    time.sleep(seconds)
