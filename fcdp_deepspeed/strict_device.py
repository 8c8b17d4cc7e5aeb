"""Strict device mode: the CUDA discipline checked on DeepSpeed's CPU accelerator (``FCDP_STRICT_DEVICE=1``).

[Note: why a strict door]
On the CPU accelerator host memory *is* accelerator memory, streams are no-ops and collectives are gloo,
so a host tensor handed to an NCCL collective, a CPU-device mismatch or a blocking copy on the hot path
cannot show up in a CPU test. The strict door tells the two memories apart:

- host allocations of the door (``pin_empty``/``host_empty``/``to_host``) are :class:`HostTensor`\\ s; torch
  propagates the subclass through ops (``torch.cat``, ``.to(dtype)``, views), and an op mixing a
  ``HostTensor`` with a plain (= accelerator) tensor raises :class:`DeviceMismatchError`, as CUDA would,
  except copies (which count as blocking unless the door issued them asynchronously);
- the door says host is *not* the accelerator, so paths skipped on the CPU (staging host slots before a
  gather) run as on CUDA; ``to_accel`` returns plain tensors;
- every tensor collective of ``deepspeed.comm`` refuses a ``HostTensor`` (:class:`HostTensorInCollective`,
  naming the call site): on CUDA the groups are NCCL groups, which need accelerator tensors;
- streams and events are counting fakes: a host wait (``Stream.synchronize``, ``Event.synchronize``), a
  blocking copy across host/accelerator (pageable memory, or outside the door) and a control-tensor read
  are logged in :data:`LOG` with the call site and its owner (``fcdp``, ``deepspeed`` or ``user``).
  :func:`counting` adds host reads of accelerator tensors (``.item()``, ``.tolist()``, ``.cpu()``, ...),
  ``torch.tensor(..., device=...)`` and ``get_accelerator().synchronize()`` for any code, to compare FCDP
  with plain ZeRO-3. Not seen: ``.to("cpu")`` of an accelerator tensor (on the CPU accelerator it cannot be
  told from ``.to(accel_device())``); FCDP's core makes no such call (it copies through the door).
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import deepspeed.comm.comm as _comm_module
from deepspeed.accelerator import get_accelerator

from fcdp_deepspeed import device
from fcdp_deepspeed.config import FCDPConfigError

ENV = "FCDP_STRICT_DEVICE"


class DeviceMismatchError(RuntimeError):
    """A host tensor met an accelerator tensor in one op (CUDA: "Expected all tensors to be on the same device")."""


class HostTensorInCollective(RuntimeError):
    """A host tensor was handed to a collective of an accelerator-backend (NCCL) group."""


# -- the log of blocking operations -----------------------------------------------------------------
_SKIP = (os.sep + "torch" + os.sep, "strict_device.py", os.sep + "device.py", "contextlib.py", "threading.py",
         os.sep + "comm" + os.sep + "comm.py", os.sep + "comm" + os.sep + "torch.py", "fcdp_deepspeed" + os.sep + "stats.py",
         "deepspeed" + os.sep + "utils" + os.sep + "nvtx.py")


def call_site() -> tuple[str, str]:
    """``(owner, "file:line function")`` of the innermost frame outside torch, the door and comm wrappers."""
    frame = sys._getframe(1)
    while frame is not None and any(s in frame.f_code.co_filename for s in _SKIP):
        frame = frame.f_back
    if frame is None:
        return "other", "?"
    path = frame.f_code.co_filename
    owner = "other"
    if "fcdp_deepspeed" + os.sep in path:
        user = any(os.sep + d + os.sep in path for d in ("tools", "integrations"))
        owner = "user" if user else "fcdp"
    elif os.sep + "deepspeed" + os.sep in path:
        owner = "deepspeed"
    elif os.sep + "tests" + os.sep in path:
        owner = "user"
    return owner, f"{path.rsplit(os.sep, 2)[-2]}/{os.path.basename(path)}:{frame.f_lineno} {frame.f_code.co_name}"


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
        owner, site = call_site()
        with self._lock:
            self.events.append(SyncEvent(kind, owner, site))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> list[SyncEvent]:
        with self._lock:
            return list(self.events[mark:])


LOG = SyncLog()


# -- host memory ------------------------------------------------------------------------------------
_PINNED: set[int] = set()  # storage pointers of the door's pinned allocations
_COPIES = frozenset({torch.Tensor.copy_, torch.Tensor.__setitem__})
_SHAPE_ONLY = frozenset({torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as})
_LOCAL = threading.local()


def _raw() -> ContextManager:
    """Inside the door: operate on the bytes without the subclass checks (the door knows the direction)."""
    return torch._C.DisableTorchFunctionSubclass()


def _tensors(args: Any, kwargs: Optional[dict]) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [t for t in flat if isinstance(t, torch.Tensor)]


class HostTensor(torch.Tensor):
    """Host memory handed out by the strict door; ops keep the subclass, mixing with accelerator tensors raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tensors = _tensors(args, kwargs)
        hosts = [t for t in tensors if isinstance(t, HostTensor)]
        plain = [t for t in tensors if not isinstance(t, HostTensor) and t.dim() > 0]
        if hosts and plain and func not in _SHAPE_ONLY:
            if func not in _COPIES:
                raise DeviceMismatchError(f"fcdp strict device: {call_site()[1]} mixes host and accelerator tensors "
                                          f"in {getattr(func, '__name__', func)}; copy through fcdp_deepspeed.device")
            if not getattr(_LOCAL, "in_door", False):  # a copy outside the door
                if not (kwargs or {}).get("non_blocking", len(args) > 2 and args[2] is True):
                    LOG.record("blocking_copy")
                elif not all(t.untyped_storage().data_ptr() in _PINNED for t in hosts):
                    LOG.record("blocking_copy_pageable")
        return super().__torch_function__(func, types, args, kwargs)


def _is_host(t: Any) -> bool:
    return isinstance(t, HostTensor)


# -- counting fakes for streams and events ------------------------------------------------------------
class FakeEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        LOG.record("event_synchronize")


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        LOG.record("stream_synchronize")


class StrictDoor(device.Door):
    """The door of strict device mode (CPU accelerator only): see [Note: why a strict door]."""

    strict = True

    def __init__(self) -> None:
        self.default_stream = FakeStream("default")

    def host_is_accel(self) -> bool:
        return False

    def has_streams(self) -> bool:
        return True

    def is_host(self, t: torch.Tensor) -> bool:
        return _is_host(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return _is_host(t) and t.untyped_storage().data_ptr() in _PINNED

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype).as_subclass(HostTensor)

    def pin_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = self.host_empty(numel, dtype)
        _PINNED.add(t.untyped_storage().data_ptr())
        return t

    def _copy(self, out: torch.Tensor, src: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        if not self.is_pinned(host):
            LOG.record("blocking_copy_pageable")
        _LOCAL.in_door = True
        try:
            with _raw():
                out.copy_(src)
        finally:
            _LOCAL.in_door = False
        return out

    def to_accel(self, t: torch.Tensor, out: Optional[torch.Tensor] = None, *, non_blocking: bool = True) -> torch.Tensor:
        if _is_host(out):
            raise DeviceMismatchError(f"fcdp strict device: {call_site()[1]}: to_accel into host memory")
        if not _is_host(t):  # already accelerator memory
            return t if out is None else out.copy_(t)
        with _raw():
            out = torch.empty(t.shape, dtype=t.dtype) if out is None else out
        if not non_blocking:
            LOG.record("blocking_copy")
        return self._copy(out, t, t)

    def to_host(self, t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.pin_empty(t.numel(), t.dtype).view(t.shape) if out is None else out
        if not _is_host(out):
            raise DeviceMismatchError(f"fcdp strict device: {call_site()[1]}: to_host into accelerator memory")
        return self._copy(out, t, out)

    def small_to_accel(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    def small_to_host(self, t: torch.Tensor) -> list:
        LOG.record("control_read")
        with _raw():
            return t.tolist()

    def current_stream(self) -> Any:
        return getattr(_LOCAL, "stream", None) or self.default_stream

    def new_stream(self, name: str) -> Any:
        return FakeStream(name)

    @contextmanager
    def _on(self, s: FakeStream) -> Iterator[None]:
        previous, _LOCAL.stream = getattr(_LOCAL, "stream", None), s
        try:
            yield
        finally:
            _LOCAL.stream = previous

    def stream(self, s: Any) -> ContextManager:
        return self._on(s) if isinstance(s, FakeStream) else nullcontext()

    def record_stream(self, t: torch.Tensor) -> None:
        pass

    def record_event(self) -> Any:
        return FakeEvent()

    def wait_event(self, event: Any) -> None:
        if event is not None and not isinstance(event, FakeEvent):
            raise TypeError(f"fcdp strict device: {call_site()[1]} waits on {event!r}, not an event of the door")

    def wait_stream(self, s: Any) -> None:
        pass

    def host_wait_stream(self, s: Any) -> None:
        if s is not None:
            s.synchronize()


# -- collectives ------------------------------------------------------------------------------------
_GUARDED = "_fcdp_strict_guard"
_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_gather_coalesced", "reduce_scatter_tensor",
                "reduce_scatter", "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "broadcast",
                "all_to_all_single", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv")


def _guard(method: str, original: Any) -> Any:
    def guarded(*args, **kwargs):
        if any(_is_host(t) for t in _tensors(args, kwargs)):
            raise HostTensorInCollective(f"fcdp: {call_site()[1]} handed a host tensor to {method} on an "
                                         f"accelerator-backend group")
        return original(*args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(guarded, _GUARDED, True)
    return guarded


def guard_collectives() -> None:
    """Wrap the live backend's tensor collectives (idempotent per backend object)."""
    backend = _comm_module.cdb
    if backend is None:
        raise FCDPConfigError(f"{ENV}=1: deepspeed.comm is not initialized yet (call deepspeed.init_distributed first)")
    for method in _COLLECTIVES:
        fn = getattr(backend, method, None)
        if fn is not None and not getattr(fn, _GUARDED, False):
            setattr(backend, method, _guard(method, fn))


# -- counting host reads of accelerator tensors, for any code -----------------------------------------
_HOST_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
                         torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
                         torch.Tensor.__index__, torch.equal, torch.allclose, torch.Tensor.nonzero, torch.nonzero})


_FROM_PYTHON = frozenset({torch.tensor, torch.as_tensor})


class _HostTraffic(TorchFunctionMode):
    """Host reads of accelerator tensors, and accelerator tensors built from Python data (a pageable copy)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS and not any(_is_host(t) for t in _tensors(args, kwargs)):
            LOG.record(f"host_read:{getattr(func, '__name__', func)}")
        elif func in _FROM_PYTHON and (kwargs or {}).get("device") is not None:
            LOG.record("h2d_from_python")
        return func(*args, **(kwargs or {}))


@contextmanager
def counting() -> Iterator[SyncLog]:
    """Also log, on this thread, host reads of accelerator tensors, accelerator tensors built from Python
    data and ``get_accelerator().synchronize()``, whoever issues them."""
    acc = get_accelerator()
    original = acc.synchronize

    def synchronize(*args, **kwargs):
        LOG.record("device_synchronize")
        return original(*args, **kwargs)

    acc.synchronize = synchronize
    try:
        with _HostTraffic():
            yield LOG
    finally:
        del acc.synchronize


def configure_from_env() -> device.Door:
    """At engine build: with ``FCDP_STRICT_DEVICE=1``, install the strict door and guard the collectives."""
    if os.environ.get(ENV, "") not in ("1", "true"):
        return device.current()
    if get_accelerator().device_name() != "cpu":
        raise FCDPConfigError(f"{ENV}=1 is a test mode of the CPU accelerator (DS_ACCELERATOR=cpu); unset it on "
                              f"{get_accelerator().device_name()}")
    if not device.current().strict:
        device.install(StrictDoor())
    guard_collectives()
    return device.current()
