"""The rank server: every rank runs :func:`serve`; rank 0 takes commands from the driver over a socket.

Started once (``driver.RankServer``) and kept for every sequence: rank 0 reads a command, broadcasts
it, every rank runs it, and rank 0 sends back every rank's result. Commands: ``begin`` (fresh engines
for a sequence, checked), ``event`` (one event on every engine, checked), ``end``, ``shutdown``.

[Note: gc.freeze] DeepSpeed's stage-3 optimizer calls ``gc.collect()`` at every build
(``runtime/zero/utils.py: defragment``, to free the partitions it just copied), which took ~1 s per engine
on the shared 2-core machine with torch's ~400k objects tracked. The server builds one warm-up pair (which
finishes the lazy imports), then freezes what exists, and points ``defragment`` at a young-generation
collection; the full collection runs every few sequences instead (:data:`FULL_GC_EVERY`). A build then
takes ~0.15 s. Only memory is at stake: no FCDP or DeepSpeed code path changes.
"""
from __future__ import annotations

import gc
import os
import pickle
import shutil
import socket
import struct
import time
import traceback
from typing import Any, Optional

from deepspeed import comm as dist

from fcdp_deepspeed.storage import freshness
from fcdp_lab import sabotage

#: Sequences between full garbage collections ([Note: gc.freeze]).
FULL_GC_EVERY = 8
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


class _YoungGC:
    """Stands in for the ``gc`` module in DeepSpeed's ``zero/utils.py`` ([Note: gc.freeze])."""

    @staticmethod
    def collect(generation: int = 0) -> int:
        return gc.collect(0)


def _warm_up() -> None:
    from fcdp_lab.fuzz import events
    seq = events.Sequence.begin({"engines": ("zero3", "fcdp"), "mode": "lora", "placement": {}, "dtype": "fp32",
                                 "regime": "large", "zero_init": True})
    events.train(seq, 2, ckpt=True)
    seq.end()


#: A fault name of the searches (not a product switch): the check at use ([Note: freshness by construction] in
#: ``storage/freshness.py``) replaced by one that finds every copy current, injected here in the rank server.
UNCHECKED = "unchecked"
_CHECKED = freshness.is_current


def _never_stale(param, taken) -> bool:
    return True


class _Session:
    """One rank's side of the commands."""

    def __init__(self) -> None:
        from fcdp_lab.fuzz import events
        self.events = events
        self.seq: Optional[events.Sequence] = None
        self.probe = False
        self.ended = 0
        #: Undoes the broken variants of the sequence running (``sabotage.apply``).
        self.restore = lambda: None

    def run(self, cmd: dict) -> dict:
        from fcdp_lab.fuzz.checks import check
        op = cmd["op"]
        if op == "begin":
            named = [f for f in (cmd.get("faults") or "").split(",") if f]
            # UNCHECKED (lab-only): the check at use skipped, so a broken listener serves its stale copy
            freshness.is_current = _never_stale if UNCHECKED in named else _CHECKED
            named = [f for f in named if f != UNCHECKED]
            self.restore()
            self.restore = sabotage.apply(",".join(named))  # until the sequence ends
            self.seq = self.events.Sequence.begin(cmd["config"])
            self.probe = bool(cmd["config"].get("probe", False))
            failures, digests = check(self.seq, "begin", {}, self.probe)
            return {"failures": failures, "digests": digests}
        if op == "event":
            t0 = time.perf_counter()
            obs = self.events.EVENTS[cmd["name"]](self.seq, **cmd.get("args", {}))
            t1 = time.perf_counter()
            failures, digests = check(self.seq, cmd["name"], obs, self.probe)
            return {"failures": failures, "digests": digests, "event_seconds": t1 - t0,
                    "check_seconds": time.perf_counter() - t1}
        if op == "end":
            coverage = {}
            if self.seq is not None:
                self.seq.end()
                coverage = dict(self.seq.coverage)
            self.seq = None
            self.restore()
            self.restore = lambda: None
            self.ended += 1
            if self.ended % FULL_GC_EVERY == 0:
                gc.collect()
            return {"failures": [], "coverage": coverage}
        if op == "ping":
            return {"failures": []}
        raise ValueError(f"unknown command {op!r}")


def lockstep_failures(results: list[dict]) -> list[str]:
    """Outputs of the same input (eval, probe, gathered reads; ``checks.digests``) must be identical on
    every rank: rank lockstep, whatever the engine's comparison with ZeRO-3."""
    out = []
    first = results[0].get("digests", {})
    for key, digest in first.items():
        others = [r for r, res in enumerate(results) if res.get("digests", {}).get(key) != digest]
        if others:
            out.append(f"{key.split('.')[0]}: {key} differs between rank 0 and ranks {others} (rank lockstep)")
    return out


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
    import deepspeed.runtime.zero.utils as zero_utils
    zero_utils.gc = _YoungGC
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
        except session.events.Unsupported as err:  # ZeRO-3 itself cannot run this sequence: discarded
            result = {"failures": [], "unsupported": str(err)}
        except Exception:  # reported; a rank that raised alone leaves the others in a collective (driver timeout)
            result = {"failures": [], "error": f"[rank {dist.get_rank()}] {traceback.format_exc()}"}
            if session.seq is not None and dist.get_rank() == 0:
                shutil.rmtree(session.seq.workdir, ignore_errors=True)
            session.seq = None
        result["seconds"] = time.perf_counter() - t0
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
        count += 1
        if sock is not None:
            send(sock, {"failures": [f for r in everyone for f in r["failures"]] + lockstep_failures(everyone),
                        "errors": [r["error"] for r in everyone if r.get("error")],
                        "unsupported": next((r["unsupported"] for r in everyone if r.get("unsupported")), None),
                        "coverage": everyone[0].get("coverage", {}),
                        **{k: max(r.get(k, 0.0) for r in everyone)
                           for k in ("seconds", "event_seconds", "check_seconds")}})
    if sock is not None:
        send(sock, {"bye": count})
        sock.close()
    return {"commands": count}
