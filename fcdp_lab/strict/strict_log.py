"""Strict device mode's log of blocking operations and the call-site finder both strict modules share."""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

_SKIP = (os.sep + "torch" + os.sep, "strict_device.py", "strict_streams.py", "strict_log.py", os.sep + "device.py",
         "contextlib.py", "threading.py", "weakref.py", os.sep + "comm" + os.sep + "comm.py",
         os.sep + "comm" + os.sep + "torch.py", "fcdp_deepspeed" + os.sep + "reporting" + os.sep + "stats.py",
         "deepspeed" + os.sep + "utils" + os.sep + "nvtx.py")
#: co_filename -> whether call_site skips frames of that file (the walk runs once per tracked tensor op).
_SKIPPED: dict[str, bool] = {}


def _skipped(path: str) -> bool:
    hit = _SKIPPED.get(path)
    if hit is None:
        hit = _SKIPPED[path] = any(s in path for s in _SKIP)
    return hit


def owner_of(path: str) -> str:
    """``fcdp``, ``deepspeed``, ``user`` (tests, tools, integrations) or ``other``."""
    if "fcdp_deepspeed" + os.sep in path:
        return "user" if any(os.sep + d + os.sep in path for d in ("tools", "integrations")) else "fcdp"
    if os.sep + "deepspeed" + os.sep in path:
        return "deepspeed"
    if os.sep + "tests" + os.sep in path:
        return "user"
    return "other"


def call_site(depth: int = 1) -> tuple[str, str]:
    """``(owner, "dir/file:line function")`` of the innermost frame outside torch, the door and comm wrappers."""
    frame = sys._getframe(depth)
    while frame is not None and _skipped(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "other", "?"
    path = frame.f_code.co_filename
    where = "/".join(path.rsplit(os.sep, 2)[-2:])
    return owner_of(path), f"{where}:{frame.f_lineno} {frame.f_code.co_name}"


@dataclass(frozen=True)
class SyncEvent:
    kind: str
    owner: str
    site: str


class SyncLog:
    """Blocking host/accelerator operations, in order (thread-safe)."""

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self._lock = threading.Lock()

    def record(self, kind: str) -> None:
        owner, site = call_site(2)
        with self._lock:
            self.events.append(SyncEvent(kind, owner, site))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> list[SyncEvent]:
        with self._lock:
            return list(self.events[mark:])


LOG = SyncLog()
