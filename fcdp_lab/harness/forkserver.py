"""A fork server for :func:`fcdp_lab.harness.launch.run_local`: import torch and DeepSpeed once, fork the ranks.

A spawned rank spends about a CPU second importing torch and DeepSpeed (4 ranks: ~4.4 CPU s, ~3.3 s on
2 cores, before any training); a forked one starts with both already imported. The server is one
process per distinct rank environment (every variable except the per-rank ones in :data:`PER_RANK`),
so whatever a module reads from the environment at import time (``DS_ACCELERATOR``, ``FCDP_AUTOLOAD``,
strict modes) is what a spawned rank would have read. A rank is forked from a server that has started
no thread (checked before every fork: forking a threaded process can deadlock in the child), gets its
own session (so ``os.killpg`` kills it and its children, as with ``start_new_session``), its log on
stdout/stderr, its full environment, and runs the same ``_worker.main``. The server reaps the ranks
and reports their exit codes as :class:`subprocess.Popen` would (negative: killed by that signal).

``FCDP_FORKSERVER=0`` spawns every rank instead; cluster (network namespace) runs and ranks on an
accelerator other than the CPU always spawn, and a server that has started a thread or CUDA refuses
to fork (the rank is spawned, with a note on stderr).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from typing import Mapping, Optional, Sequence

#: Set to ``0`` to spawn every rank (``python -m fcdp_lab.harness._worker``) instead of forking.
FORKSERVER_ENV = "FCDP_FORKSERVER"
#: Variables that differ between the ranks of one run or between runs and are read when the rank runs,
#: not at import: they do not pick the server, and the server never has them. (PYTEST_CURRENT_TEST changes with
#: every test. FCDP_LAB_BREAK names a run's broken variants: ``fcdp_lab/startup.py`` would patch a server started
#: with it, and every rank forked from it later would inherit the patch; each rank installs its own, in
#: ``_worker.main``; so does FCDP_LAB_LINK.)
PER_RANK = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "LOCAL_WORLD_SIZE",
            "PYTEST_CURRENT_TEST", "FCDP_LAB_BREAK", "FCDP_LAB_LINK")
#: Starts every line of the server's protocol on its stdout (replies ``ready``/``pid N``/``refused: why``,
#: reports ``exit PID CODE``); other lines are output of the modules it imports.
MARK = "fcdp-forkserver: "
#: [Note: what the first engine imports] Building a rank's first engine imports ``torch._dynamo`` (torch's optimizer
#: constructor disables it, importing it to do so) and DeepSpeed's Muon optimizer module (its optimizer check; that
#: module calls ``torch.compile``, which pulls in inductor, sympy and networkx): about 1,400 modules, 2.0 CPU s of a
#: 2.4 s first ``deepspeed.initialize`` on this machine (0.34 s with them imported; a second engine 0.26 s). A forked
#: rank paid it every launch; the server pays it once. Neither starts a thread (checked: forking stays safe). Both
#: are imported where they exist (older DeepSpeed releases have no Muon module).
PRELOAD = ("torch", "deepspeed", "deepspeed.comm", "fcdp_deepspeed", "fcdp_lab.harness._worker")
FIRST_ENGINE_IMPORTS = ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer")
#: Comma-separated modules the server imports as well. Part of the environment, so ranks that do not ask
#: for them come from a server that never imported them. [Note: not for transformers] Hugging Face ranks
#: forked from a server that had imported transformers, peft and accelerate took 89 CPU s for two
#: 4-rank Trainer runs against 52 s spawned and 45 s forked without them (cause not found).
PRELOAD_ENV = "FCDP_FORKSERVER_PRELOAD"


def enabled(env: Mapping[str, str]) -> bool:
    """Fork ranks with this environment? Only on the CPU accelerator: [Note: CUDA] a rank that is forked
    must not inherit a CUDA context, and importing DeepSpeed for an accelerator may create one."""
    return env.get(FORKSERVER_ENV, "1").strip().lower() not in ("0", "false", "no", "off") \
        and env.get("DS_ACCELERATOR") == "cpu" and hasattr(os, "fork")


class ForkedRank:
    """The part of :class:`subprocess.Popen` that ``run_local`` uses, for a rank forked by a server."""

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            self.server.wait_for_exit(self.pid)
        return self.returncode


class ForkServer:
    """Client side: one server process, its requests serialized, its exit reports read by one thread."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", __name__], env=dict(env), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.exits: dict[int, int] = {}
        self.replies: list[str] = []
        self.dead = False
        threading.Thread(target=self._read, daemon=True).start()
        if self._reply(timeout=300) != "ready":
            self.close()
            raise RuntimeError("fork server did not start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith(MARK):  # something a preloaded module printed
                sys.stderr.write(line)
                continue
            kind, _, rest = line[len(MARK):].strip().partition(" ")
            with self.cond:
                if kind == "exit":
                    pid, code = rest.split()
                    self.exits[int(pid)] = int(code)
                else:
                    self.replies.append(line[len(MARK):].strip())
                self.cond.notify_all()
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def _reply(self, timeout: float) -> str:
        with self.cond:
            self.cond.wait_for(lambda: self.replies or self.dead, timeout=timeout)
            return self.replies.pop(0) if self.replies else "dead"

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: str) -> ForkedRank:
        with self.lock:
            self.proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "log": log, "cwd": os.getcwd()}) + "\n")
            self.proc.stdin.flush()
            reply = self._reply(timeout=60)
        if not reply.startswith("pid "):
            raise RuntimeError(f"fork server could not fork a rank: {reply}")
        return ForkedRank(self, int(reply.split()[1]))

    def exit_code(self, pid: int) -> Optional[int]:
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
            # [Note: a dead server] cannot report; its orphaned ranks are killed by run_local's _kill
            return -9 if self.dead and not _alive(pid) else None

    def wait_for_exit(self, pid: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exits or self.dead, timeout=1.0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan whose reaper never waits must not look alive forever)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


#: Servers kept at once (one per distinct rank environment; most sessions need one or two).
MAX_SERVERS = 4
_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(env: Mapping[str, str]) -> Optional[ForkServer]:
    """The server for ranks with this environment (started on first use), or None when it cannot start."""
    key = tuple(sorted((k, v) for k, v in env.items() if k not in PER_RANK))
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.proc.poll() is None:
            return server
        while len(_servers) >= MAX_SERVERS:  # [Note: memory] each holds torch and DeepSpeed (~0.5 GB): drop the oldest
            _servers.pop(next(iter(_servers))).close()
        try:
            server = _servers[key] = ForkServer({k: v for k, v in env.items() if k not in PER_RANK})
        except (OSError, RuntimeError):
            _servers.pop(key, None)
            return None
        return server


@atexit.register
def _close_all() -> None:
    for server in _servers.values():
        server.close()


# --------------------------------------------------------------------------------------------- server side
def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def _unsafe_to_fork() -> str:
    """Why forking this server now could break the child ('' when it cannot)."""
    import torch
    if _threads() != 1:  # a lock held by another thread stays locked forever in the child
        return f"the server runs {_threads()} threads"
    if torch.cuda.is_initialized():  # a CUDA context does not survive fork
        return "CUDA is initialized in the server"
    return ""


def _child(request: dict) -> None:
    """In the forked rank: become what ``python -m fcdp_lab.harness._worker`` would be; never returns."""
    code = 1
    try:
        os.setsid()
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[0] = request["cwd"]  # what ``python -m`` puts first: the directory the rank starts in
        sys.path[1:1] = [p for p in paths if p not in sys.path]
        sys.argv = [sys.argv[0], *request["argv"]]
        import random
        random.seed()  # [Note: a fresh process seeds from the OS; forked ranks would share the server's state]
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        from fcdp_lab.harness import _worker
        _worker.main()  # ends with os._exit(0)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _say(line: str) -> None:
    sys.stdout.write(MARK + line + "\n")
    sys.stdout.flush()


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    for name in FIRST_ENGINE_IMPORTS + tuple(filter(None, os.environ.get(PRELOAD_ENV, "").split(","))):
        try:
            __import__(name.strip())
        except Exception:  # the rank that needs it imports it (and reports what failed) itself
            pass
    _say("ready")
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.05)
        if readable:
            line = sys.stdin.readline()
            if not line:
                break
            request = json.loads(line)
            why = _unsafe_to_fork()
            if why:
                _say(f"refused: {why}")
                continue
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)
            children.add(pid)
            _say(f"pid {pid}")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    for pid in children:  # the client is gone: stop its ranks, as run_local's finally would
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    serve()
