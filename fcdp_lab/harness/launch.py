"""Run a function on N local ranks (one process each, gloo on the CPU) and collect the results.

Used by the tests, the demo and the benchmark: real processes and a real process group, with a
deadline so a hang fails instead of stalling, and every rank's log kept for the error message.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from fcdp_lab.harness import forkserver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    """A rank exited non-zero or the run passed its deadline; the message holds the log tails."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while running ranks, so ``finally`` blocks kill the ranks and
    remove temporary files (the default action would just end the process and leave them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: Whether this process already said why ranks are spawned (one line, not one per rank).
_SPAWN_SAID: list[bool] = [False]


def _fork(server: "forkserver.ForkServer", argv: list[str], env: dict, log: Path) -> Optional["forkserver.ForkedRank"]:
    """Rank from the fork server, or None (then it is spawned) when the server refuses or is gone."""
    try:
        return server.spawn(argv, env, str(log))
    except (OSError, RuntimeError, ValueError) as err:
        if not _SPAWN_SAID[0]:
            _SPAWN_SAID[0] = True
            print(f"fcdp launch: spawning ranks instead of forking them ({err})", file=sys.stderr)
        return None


def run_local(target: str, world_size: int = 4, kwargs: Optional[Mapping[str, Any]] = None, timeout: float = 300,
              env: Optional[Mapping[str, str]] = None, pythonpath: Sequence[str] = (),
              rank_env: Optional[Mapping[int, Mapping[str, str]]] = None, cluster: Any = None) -> list[Any]:
    """Call ``module:function(**kwargs)`` on ``world_size`` ranks; return each rank's return value.

    Rank r gets RANK/LOCAL_RANK=r, WORLD_SIZE, MASTER_ADDR/PORT on loopback, DS_ACCELERATOR=cpu
    (unless set) and OMP_NUM_THREADS=1, plus ``env`` and ``rank_env[r]``. With an
    :class:`~fcdp_lab.harness.cluster.EmulatedCluster`, rank r runs inside node r // (world/nodes),
    rendezvous at node 0's address and gloo binds to the node's uplink address.
    """
    with sigterm_raises():
        return _run_local(target, world_size, kwargs, timeout, env, pythonpath, rank_env, cluster)


def _run_local(target, world_size, kwargs, timeout, env, pythonpath, rank_env, cluster) -> list[Any]:
    workdir = Path(tempfile.mkdtemp(prefix="fcdp-run-"))
    with open(workdir / "kwargs.pkl", "wb") as f:
        pickle.dump(dict(kwargs or {}), f)
    port = str(free_port())
    per_node = world_size // cluster.nodes if cluster is not None else world_size
    path = os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    procs = []
    server = None  # [Note: fork server] ranks forked with torch and DeepSpeed imported; see fcdp_lab/harness/forkserver.py
    try:
        for r in range(world_size):
            e = dict(os.environ)
            e.setdefault("DS_ACCELERATOR", "cpu")
            e.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # torch's c10d deprecation spam
            e.update({"RANK": str(r), "LOCAL_RANK": str(r % per_node), "WORLD_SIZE": str(world_size),
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
                      "PYTHONUNBUFFERED": "1"})
            if cluster is not None:
                e.update({"MASTER_ADDR": cluster.address(0), "GLOO_SOCKET_IFNAME": "eth0", "GROUP_RANK": str(r // per_node),
                          "LOCAL_WORLD_SIZE": str(per_node)})
            e.update(env or {})
            e.update((rank_env or {}).get(r, {}))
            if cluster is None and forkserver.enabled(e):
                server = forkserver.server_for(e)
            log = open(workdir / f"rank{r}.log", "wb")
            argv = [sys.executable, "-m", "fcdp_lab.harness._worker", target, str(workdir)]
            if cluster is not None:
                procs.append(cluster.popen(r // per_node, argv, env=e, stdout=log, stderr=subprocess.STDOUT))
            elif server is not None and (forked := _fork(server, argv[3:], e, workdir / f"rank{r}.log")):
                procs.append(forked)
            else:
                procs.append(subprocess.Popen(argv, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                _kill(procs)
                raise RankFailure(f"{target} on {world_size} ranks passed its {timeout:.0f} s deadline.\n" +
                                  "\n".join(f"--- rank {r} ---\n{_tail(workdir / f'rank{r}.log')}" for r in range(world_size)))
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2)  # let the others print their side, then stop them
                _kill(procs)
                break
            time.sleep(0.1)
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RankFailure(f"{target}: ranks {bad} failed.\n" + "\n".join(
                f"--- rank {r} (exit {procs[r].returncode}) ---\n{_tail(workdir / f'rank{r}.log')}" for r in bad))
        results = []
        for r in range(world_size):
            with open(workdir / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        _kill(procs)
        shutil.rmtree(workdir, ignore_errors=True)
        _remove_shm_buffers(port)


def _remove_shm_buffers(port: str) -> None:
    """[Note: leaked shm buffers] DeepSpeed's CPU ``shm_comm`` keeps its all-reduce buffers in ``/dev/shm``, named with
    the run's master port, and a rank that ends without its teardown (gloo's abort at exit) leaves them there: 67 MB
    per rank and run, 19 GB after a day of test runs on the 2-core machine, which the CPU accelerator then counts as
    memory in use (a measured device headroom near zero: residuals placed on the host, a failed placement test).
    Every rank has exited here, so the run's buffers go."""
    for path in glob.glob(f"/dev/shm/deepspeed_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass
