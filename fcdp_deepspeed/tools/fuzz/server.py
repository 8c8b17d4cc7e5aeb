"""The rank server: every rank runs :func:`serve`; rank 0 takes commands from the driver over a socket.

Started once (``driver.RankServer``) and kept for every sequence: rank 0 reads a command, broadcasts
it, every rank runs it, and rank 0 sends back every rank's result. Commands: ``begin`` (fresh engines
for a sequence, checked), ``event`` (one event on every engine, checked), ``end``, ``shutdown``.

[Note: gc.freeze] DeepSpeed's stage-3 optimizer calls ``gc.collect()`` at every build
(``runtime/zero/utils.py: defragment``), which took ~1 s per engine on the shared 2-core machine with
torch's ~400k objects tracked; the server builds one warm-up pair (which finishes the lazy imports),
then freezes what exists, so a build takes ~0.15 s.
"""
from __future__ import annotations

import gc
import os
import pickle
import socket
import struct
import time
import traceback
from typing import Any, Optional

from deepspeed import comm as dist

from fcdp_deepspeed.faults import BREAK_ENV

#: Frame: 8-byte big-endian length, then a pickle.
_HEADER = struct.Struct(">Q")


def send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv(sock: socket.socket) -> Any:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the other side closed the connection")
            buf += chunk
        return bytes(buf)
    (n,) = _HEADER.unpack(exactly(_HEADER.size))
    return pickle.loads(exactly(n))


def _warm_up() -> None:
    from fcdp_deepspeed.tools.fuzz import events
    seq = events.Sequence.begin({"engines": ("zero3", "fcdp"), "mode": "lora", "placement": {}, "dtype": "fp32",
                                 "regime": "large", "zero_init": True})
    events.train(seq, 2, ckpt=True)
    seq.end()


class _Session:
    """One rank's side of the commands."""

    def __init__(self) -> None:
        from fcdp_deepspeed.tools.fuzz import events
        self.events = events
        self.seq: Optional[events.Sequence] = None
        self.probe = False

    def run(self, cmd: dict) -> dict:
        from fcdp_deepspeed.tools.fuzz.checks import check
        op = cmd["op"]
        if op == "begin":
            if cmd.get("faults"):
                os.environ[BREAK_ENV] = cmd["faults"]
            else:
                os.environ.pop(BREAK_ENV, None)
            self.seq = self.events.Sequence.begin(cmd["config"])
            self.probe = bool(cmd["config"].get("probe", False))
            return {"failures": check(self.seq, "begin", {}, self.probe)}
        if op == "event":
            obs = self.events.EVENTS[cmd["name"]](self.seq, **cmd.get("args", {}))
            return {"failures": check(self.seq, cmd["name"], obs, self.probe)}
        if op == "end":
            if self.seq is not None:
                self.seq.end()
            self.seq = None
            os.environ.pop(BREAK_ENV, None)
            return {"failures": []}
        if op == "ping":
            return {"failures": []}
        raise ValueError(f"unknown command {op!r}")


def serve(port: int, warm_up: bool = True) -> dict:
    """Every rank: run commands until ``shutdown``; returns how many commands this rank ran."""
    import deepspeed
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    import fcdp_deepspeed
    fcdp_deepspeed.install()
    if warm_up:
        _warm_up()
    gc.collect()
    gc.freeze()  # [Note: gc.freeze]
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    sock = None
    if dist.get_rank() == 0:
        sock = socket.create_connection(("127.0.0.1", port), timeout=None)
        send(sock, {"hello": True, "pids": pids})
    session, count = _Session(), 0
    while True:
        box = [recv(sock) if sock is not None else None]
        dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if cmd["op"] == "shutdown":
            break
        t0 = time.perf_counter()
        try:
            result = session.run(cmd)
        except Exception:  # reported; a rank that raised alone leaves the others in a collective (driver timeout)
            result = {"failures": [], "error": f"[rank {dist.get_rank()}] {traceback.format_exc()}"}
            session.seq = None
        result["seconds"] = time.perf_counter() - t0
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
        count += 1
        if sock is not None:
            send(sock, {"failures": [f for r in everyone for f in r["failures"]],
                        "errors": [r["error"] for r in everyone if r.get("error")],
                        "seconds": max(r["seconds"] for r in everyone)})
    if sock is not None:
        send(sock, {"bye": count})
        sock.close()
    return {"commands": count}
