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


#: Read when the module is imported: in a fork server that preloads it, at server start (tests/test_forkserver.py).
AT_IMPORT = __import__("os").environ.get("FCDP_TEST_PROBE")


def environment() -> dict:
    """What this rank sees: its process ids, its env, the env its modules saw at import."""
    import os
    import sys
    return {"pid": os.getpid(), "ppid": os.getppid(), "rank": os.environ["RANK"], "probe": os.environ.get("FCDP_TEST_PROBE"),
            "at_import": AT_IMPORT, "cwd": os.getcwd(), "path0": sys.path[0]}


def fail_on_rank(rank: int, how: str = "exit") -> None:
    """Rank ``rank`` exits 3 (``exit``) or raises (``raise``); the others return."""
    import os
    import sys
    if int(os.environ["RANK"]) == rank:
        if how == "exit":
            sys.exit(3)
        raise ValueError("deliberate failure on this rank")
