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

import threading
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import deepspeed.comm.comm as _comm_module
from deepspeed.accelerator import get_accelerator

from fcdp_deepspeed.config import FCDPConfigError
from fcdp_deepspeed.machine import device
from fcdp_lab.strict import strict_streams
from fcdp_lab.strict.strict_log import LOG, SyncEvent, SyncLog, call_site  # noqa: F401  (re-exported)
from fcdp_lab.strict.strict_streams import MODEL, FakeEvent, FakeStream, StreamOrderError  # noqa: F401

ENV = "FCDP_STRICT_DEVICE"


class DeviceMismatchError(RuntimeError):
    """A host tensor met an accelerator tensor in one op (CUDA: "Expected all tensors to be on the same device")."""


class HostTensorInCollective(RuntimeError):
    """A host tensor was handed to a collective of an accelerator-backend (NCCL) group."""


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
                                          f"in {getattr(func, '__name__', func)}; copy through fcdp_deepspeed.machine.device")
            if not getattr(_LOCAL, "in_door", False):  # a copy outside the door
                if not (kwargs or {}).get("non_blocking", len(args) > 2 and args[2] is True):
                    LOG.record("blocking_copy")
                elif not all(t.untyped_storage().data_ptr() in _PINNED for t in hosts):
                    LOG.record("blocking_copy_pageable")
        return super().__torch_function__(func, types, args, kwargs)


def _is_host(t: Any) -> bool:
    return isinstance(t, HostTensor)


class StrictDoor(device.Door):
    """The door of strict device mode (CPU accelerator only): see [Note: why a strict door]; streams, events
    and every access of door memory follow ``strict_streams`` ([Note: the stream-order model])."""

    strict = True

    def __init__(self) -> None:
        self.default_stream = MODEL.default

    def host_is_accel(self) -> bool:
        return False

    def has_streams(self) -> bool:
        return True

    def is_host(self, t: torch.Tensor) -> bool:
        return _is_host(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return _is_host(t) and t.untyped_storage().data_ptr() in _PINNED

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with strict_streams.paused():
            t = torch.empty(numel, dtype=dtype).as_subclass(HostTensor)
        MODEL.register(t, "pageable host memory", host=True)
        return t

    def pin_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = self.host_empty(numel, dtype)
        _PINNED.add(t.untyped_storage().data_ptr())
        MODEL.label(t, "pinned host memory")
        return t

    def accel_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with strict_streams.paused():
            t = torch.empty(numel, dtype=dtype)
        MODEL.register(t, "door accelerator memory", free_check=True)
        return t

    def _copy(self, out: torch.Tensor, src: torch.Tensor, host: torch.Tensor, blocking: bool = False) -> torch.Tensor:
        pageable = not self.is_pinned(host)
        if pageable:
            LOG.record("blocking_copy_pageable")
        _LOCAL.in_door = True
        try:
            with _raw():
                strict_streams.door_copy(out, src, blocking=blocking or pageable)
        finally:
            _LOCAL.in_door = False
        return out

    def to_accel(self, t: torch.Tensor, out: Optional[torch.Tensor] = None, *, non_blocking: bool = True) -> torch.Tensor:
        if _is_host(out):
            raise DeviceMismatchError(f"fcdp strict device: {call_site()[1]}: to_accel into host memory")
        if not _is_host(t):  # already accelerator memory
            return t if out is None else out.copy_(t)
        if out is None:
            out = self.accel_empty(t.numel(), t.dtype).view(t.shape)
            MODEL.label(out, "accelerator copy of host memory")
        if not non_blocking:
            LOG.record("blocking_copy")
        return self._copy(out, t, t, blocking=not non_blocking)

    def to_host(self, t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.pin_empty(t.numel(), t.dtype).view(t.shape) if out is None else out
        if not _is_host(out):
            raise DeviceMismatchError(f"fcdp strict device: {call_site()[1]}: to_host into accelerator memory")
        self._copy(out, t, out)
        self.record_stream(t)  # as the real door does: the source may be freed while the copy reads it
        return out

    def small_to_accel(self, values: list, dtype: torch.dtype, where: Optional[torch.device] = None) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        MODEL.wait(MODEL.host, MODEL.current().snapshot())  # a blocking copy: done when it returns
        return t

    def small_to_host(self, t: torch.Tensor) -> list:
        LOG.record("control_read")
        MODEL.wait(MODEL.host, MODEL.current().snapshot())  # a blocking read: the host waits for the stream
        with _raw():
            return t.tolist()

    # -- streams and events (strict_streams) ---------------------------------------------------------
    def current_stream(self) -> Any:
        return MODEL.current()

    def stream(self, s: Any) -> ContextManager:
        return MODEL.on(s, fcdp=True) if isinstance(s, FakeStream) else nullcontext()

    def side_stream(self, name: str) -> Any:
        return MODEL.side(name)

    def record_stream(self, t: torch.Tensor) -> None:
        MODEL.record_stream(t, MODEL.current())

    def record_event(self) -> Any:
        return MODEL.current().record_event()

    def wait_event(self, event: Any) -> None:
        if event is not None and not isinstance(event, FakeEvent):
            raise TypeError(f"fcdp strict device: {call_site()[1]} waits on {event!r}, not an event of the door")
        MODEL.current().wait_event(event)

    def wait_stream(self, s: Any) -> None:
        if isinstance(s, FakeStream):
            MODEL.current().wait_stream(s)

    def host_wait_stream(self, s: Any) -> None:
        if s is not None:
            s.synchronize()

    def drop_host(self, t: torch.Tensor) -> None:
        MODEL.drop_host(t)


# -- collectives ------------------------------------------------------------------------------------
_GUARDED = "_fcdp_strict_guard"
_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_gather_coalesced", "reduce_scatter_tensor",
                "reduce_scatter", "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "broadcast",
                "all_to_all_single", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "all_gather_base")


#: Parameters of ``deepspeed.comm``'s backend collectives (deepspeed/comm/torch.py; its decorators hide them).
_PARAMS = {
    "all_reduce": ("tensor", "op", "group", "async_op"), "inference_all_reduce": ("tensor", "op", "group"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"), "reduce": ("tensor", "dst", "op", "group", "async_op"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op"), "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_base": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_coalesced": ("output_tensors", "input_tensors", "group", "async_op"),
    "reduce_scatter_tensor": ("output_tensor", "input_tensor", "op", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    "send": ("tensor", "dst", "group", "tag"), "recv": ("tensor", "src", "group", "tag"),
    "isend": ("tensor", "dst", "group", "tag"), "irecv": ("tensor", "src", "group", "tag"),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op"),
}


def _guard(method: str, original: Any) -> Any:
    names = _PARAMS[method]

    def guarded(*args, **kwargs):
        if any(_is_host(t) for t in _tensors(args, kwargs)):
            raise HostTensorInCollective(f"fcdp: {call_site()[1]} handed a host tensor to {method} on an "
                                         f"accelerator-backend group")
        bound = {**dict(zip(names, args)), **kwargs}
        if method in ("isend", "irecv"):
            bound["async_op"] = True
        return strict_streams.modeled_collective(method, bound, lambda: original(*args, **kwargs))

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
        acc.synchronize = original


def configure() -> device.Door:
    """At engine build (:func:`fcdp_lab.strict.install` wraps the engines' ``__init__``): install the strict door
    once and guard the live backend's collectives."""
    if get_accelerator().device_name() != "cpu":
        raise FCDPConfigError(f"{ENV}=1 is a test mode of the CPU accelerator (DS_ACCELERATOR=cpu); unset it on "
                              f"{get_accelerator().device_name()}")
    if not device.current().strict:
        door = StrictDoor()
        device.install(door)
        strict_streams.install_deepspeed_streams(door.current_stream)
        strict_streams.track_this_thread()
    guard_collectives()
    return device.current()
