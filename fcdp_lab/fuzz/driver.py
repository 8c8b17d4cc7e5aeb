"""The driver's side of the rank server: start it once, send commands, restart it after a hang or crash.

The ranks run :func:`fcdp_lab.fuzz.server.serve` under ``launch.run_local`` (a background
thread; forked ranks on the CPU accelerator). Rank 0 connects back and reports every rank's pid, so a
command that passes its deadline (a hang, a rank that died) kills exactly those ranks (``os.killpg``:
each rank leads its own session) and the next command starts a fresh server.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any, Mapping, Optional

from fcdp_lab.fuzz.server import recv, send

TARGET = "fcdp_lab.fuzz.server:serve"


class RankServerDied(RuntimeError):
    """A command passed its deadline or the ranks went away (the server is restarted at the next call)."""


class RankServer:
    """A persistent set of ranks that runs event sequences (``with RankServer() as server: ...``)."""

    def __init__(self, world_size: int = 4, env: Optional[Mapping[str, str]] = None, start_timeout: float = 600,
                 call_timeout: float = 300, pythonpath: tuple[str, ...] = ()) -> None:
        self.world_size = world_size
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.pythonpath = pythonpath
        self.sock: Optional[socket.socket] = None
        self.pids: list[int] = []
        self.thread: Optional[threading.Thread] = None
        self.outcome: dict[str, Any] = {}
        self.starts = 0
        self.commands = 0
        self.busy_seconds = 0.0  # the ranks' time in commands (max over ranks), from their replies

    # -- lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> "RankServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        from fcdp_lab.harness.launch import run_local
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(self.start_timeout)
        port = listener.getsockname()[1]
        outcome: dict[str, Any] = {}

        def ranks() -> None:
            try:
                outcome["results"] = run_local(TARGET, self.world_size, {"port": port}, timeout=10**7, env=self.env,
                                               pythonpath=self.pythonpath)
            except BaseException as err:  # noqa: BLE001 - reported by close() / the next call
                outcome["error"] = err

        self.outcome = outcome
        self.thread = threading.Thread(target=ranks, name="fcdp-rank-server", daemon=True)
        self.thread.start()
        # [Note: a server that dies before it connects] poll, so ranks that fail at start-up end the wait at once
        listener.settimeout(1.0)
        deadline = time.monotonic() + self.start_timeout
        try:
            while True:
                try:
                    conn, _ = listener.accept()
                    break
                except socket.timeout:
                    if "error" in outcome or not self.thread.is_alive():
                        raise RankServerDied(f"the rank server failed before it connected: {outcome.get('error')}")
                    if time.monotonic() > deadline:
                        raise RankServerDied(f"the rank server did not connect within {self.start_timeout:.0f} s: "
                                             f"{outcome.get('error')}")
        finally:
            listener.close()
        conn.settimeout(self.start_timeout)
        hello = recv(conn)
        self.sock, self.pids = conn, list(hello["pids"])
        self.starts += 1

    def kill(self) -> None:
        """Kill this server's ranks (by pid) and forget the connection."""
        for pid in self.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.sock is not None:
            self.sock.close()
        self.sock, self.pids = None, []
        if self.thread is not None:
            self.thread.join(timeout=60)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.settimeout(60)
                send(self.sock, {"op": "shutdown"})
                recv(self.sock)
            except (OSError, ConnectionError, EOFError):
                self.kill()
                return
            self.sock.close()
            self.sock = None
        if self.thread is not None:
            self.thread.join(timeout=120)

    # -- commands -----------------------------------------------------------------------------------
    def call(self, cmd: dict, timeout: Optional[float] = None) -> dict:
        """Run one command on every rank; raises :class:`RankServerDied` (and kills the ranks) when it does
        not answer within ``timeout``."""
        if self.sock is None:
            self.start()
        try:
            self.sock.settimeout(timeout or self.call_timeout)
            send(self.sock, cmd)
            reply = recv(self.sock)
        except (OSError, ConnectionError, EOFError) as err:
            why = "passed its deadline" if isinstance(err, socket.timeout) else f"lost the ranks ({err})"
            self.kill()
            detail = self.outcome.get("error")
            raise RankServerDied(f"{cmd.get('op')} {cmd.get('name', '')} {why}"
                                 + (f"\n{detail}" if detail else "")) from None
        self.commands += 1
        self.busy_seconds += reply.get("seconds", 0.0)
        return reply

