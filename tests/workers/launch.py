"""Workers of test_launch.py: a rank that only waits, to be interrupted."""
from __future__ import annotations

from workers.common import setup


def sleeper(seconds: float = 120, pid_dir: str = "") -> None:
    """Wait; with ``pid_dir``, first leave ``rank<r>`` there holding this rank's pid and its parent's."""
    import os
    import time
    setup()
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{os.environ['RANK']}.tmp"), "w") as f:
            f.write(f"{os.getpid()} {os.getppid()}")
        os.replace(os.path.join(pid_dir, f"rank{os.environ['RANK']}.tmp"), os.path.join(pid_dir, f"rank{os.environ['RANK']}"))
    time.sleep(seconds)
