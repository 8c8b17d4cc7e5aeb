"""The device door: the one place FCDP issues host<->accelerator copies, streams, events and pinned allocations.

[Note: the door's rules]
Every host/accelerator crossing FCDP makes goes through the current :class:`Door`, which encodes the
CUDA rules once instead of at every call site:

- host -> accelerator (:func:`to_accel`): a non-blocking copy on the *issuing* stream; from pinned
  memory it overlaps compute, and work queued later on that stream sees the data.
- accelerator -> host (:func:`to_host`): a non-blocking copy into (pinned) host memory on the issuing
  stream; the caller records an event (:func:`record_event`) and every *host* reader waits on it
  (:func:`host_wait`, debug paths only) while every *stream* reader waits on the stream
  (:func:`wait_event`). The source is ``record_stream``-ed on the issuing stream, DeepSpeed's
  discipline for a tensor that may be freed (and its memory reused) while a copy still reads it.
- no host-side synchronize on the hot path: stream-to-stream ordering (:func:`wait_stream`,
  :func:`wait_event`) instead.
- tiny control tensors (agreement all-reduces at planning time) go through :func:`small_to_accel` /
  :func:`small_to_host`, which are blocking by design and must not run per step.

The door is swappable (:func:`install`, :func:`use`), so that a test can run FCDP through a stricter door on the
CPU, one that tells host memory from accelerator memory and counts blocking operations (``Door.strict``: code that
must behave as on CUDA under such a door asks it).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Optional

import torch

from deepspeed.accelerator import get_accelerator


class Door:
    """Host/accelerator traffic on the real accelerator (CUDA, or DeepSpeed's CPU accelerator, where host
    memory *is* accelerator memory, streams do not exist and every copy is a no-op or a memcpy)."""

    strict = False

    # -- where memory lives -----------------------------------------------------------------------
    def accel_device(self) -> torch.device:
        return torch.device(get_accelerator().current_device_name())

    def host_is_accel(self) -> bool:
        """True when host memory is the accelerator's (the CPU accelerator): nothing to stage or copy."""
        return self.accel_device().type == "cpu"

    def has_streams(self) -> bool:
        return not get_accelerator().is_synchronized_device()

    def is_host(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and not self.host_is_accel()

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and get_accelerator().is_pinned(t)

    # -- allocation -------------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="cpu")

    def pins_host_memory(self) -> bool:
        """Whether pinning really page-locks memory (so the caching host allocator's power-of-two
        rounding is paid); not on the CPU accelerator, strict mode included."""
        return self.accel_device().type != "cpu"

    def pin_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory, allocated page-locked directly (never a pageable buffer copied into a pinned
        one); plain host memory where the accelerator cannot pin, e.g. the CPU. See :func:`pin_path`."""
        if not self.pins_host_memory():
            return self.host_empty(numel, dtype)
        if pin_path() == "accelerator":
            return get_accelerator().pin_empty(numel, dtype=dtype)
        return self.torch_pinned_empty(numel, dtype)

    def torch_pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """From torch's caching host allocator (a CPU-only torch has none: ``RuntimeError``, caught by the pools)."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)

    def accel_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.accel_device())

    # -- copies -----------------------------------------------------------------------------------
    def to_accel(self, t: torch.Tensor, out: Optional[torch.Tensor] = None, *, non_blocking: bool = True) -> torch.Tensor:
        """``t`` on the accelerator, copied asynchronously on the current stream (``non_blocking=False``:
        the host waits; never on the hot path). Without ``out``, a tensor already there is returned as is
        (it may alias ``t``: treat it as read-only)."""
        device = self.accel_device()
        if out is None:
            if t.device == device:
                return t
            out = torch.empty(t.shape, dtype=t.dtype, device=device)
        out.copy_(t, non_blocking=non_blocking)
        return out

    def to_host(self, t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``t`` copied into host memory (``out``, pinned, or a new pinned buffer) asynchronously on the
        current stream. Host readers must wait on an event recorded right after (:func:`record_event`)."""
        if out is None:
            out = self.pin_empty(t.numel(), t.dtype).view(t.shape)
        out.copy_(t, non_blocking=True)
        self.record_stream(t)
        return out

    def small_to_accel(self, values: list, dtype: torch.dtype, where: Optional[torch.device] = None) -> torch.Tensor:
        """A tiny control tensor on ``where`` (default: the current accelerator device), blocking: planning
        time, or once per cached index (see ``grads.layout.order_index``)."""
        return torch.tensor(values, dtype=dtype).to(where if where is not None else self.accel_device())

    def small_to_host(self, t: torch.Tensor) -> list:
        """The values of a tiny control tensor (blocking: planning time only)."""
        return t.cpu().tolist()

    # -- streams and events -----------------------------------------------------------------------
    def current_stream(self) -> Any:
        return get_accelerator().current_stream() if self.has_streams() else None

    def stream(self, s: Any) -> ContextManager:
        return get_accelerator().stream(s) if s is not None and self.has_streams() else nullcontext()

    def side_stream(self, name: str) -> Any:
        """FCDP's own stream ``name`` on the current device, created once: copies that must not queue behind
        DeepSpeed's collectives on its streams (``None`` without streams)."""
        if not self.has_streams():
            return None
        key = (name, str(self.accel_device()))
        streams = self.__dict__.setdefault("_side", {})
        if key not in streams:
            streams[key] = get_accelerator().Stream()
        return streams[key]

    def record_stream(self, t: torch.Tensor) -> None:
        """``t`` is used by work on the current stream: the allocator must not reuse it before that work ran."""
        if self.has_streams() and t.device.type != "cpu":
            t.record_stream(get_accelerator().current_stream())

    def record_event(self) -> Any:
        if not self.has_streams():
            return None
        event = get_accelerator().Event()
        event.record()
        return event

    def wait_event(self, event: Any) -> None:
        """The current stream waits for ``event`` (no host wait)."""
        if event is not None:
            get_accelerator().current_stream().wait_event(event)

    def wait_stream(self, s: Any) -> None:
        """The current stream waits for work queued on ``s`` so far (no host wait)."""
        if s is not None and self.has_streams():
            get_accelerator().current_stream().wait_stream(s)

    def host_wait(self, event: Any) -> None:
        """Block the host until ``event`` completed: debug readers only (verify checksums)."""
        if event is not None:
            event.synchronize()

    def host_wait_stream(self, s: Any) -> None:
        """Block the host until ``s`` drained: only where the host itself reads what ``s`` wrote."""
        if s is not None and self.has_streams():
            s.synchronize()

    def event_done(self, event: Any) -> bool:
        """Whether the work before ``event`` has finished, without waiting (``True`` without streams)."""
        return event is None or bool(event.query())

    # -- releasing pinned memory ------------------------------------------------------------------
    def drop_host(self, t: torch.Tensor) -> None:
        """The caller drops its last reference to pinned ``t`` now. Every copy that used it must have
        finished (:func:`event_done`): ``DS_PIN_MEMORY_BACKEND=native`` frees pinned memory with no event.
        Nothing to do here (the strict door checks it)."""

    def empty_host_cache(self) -> None:
        """Hand cached, unused pinned blocks of torch's caching host allocator back to the system (they stay
        cached, counted against the cgroup, after their tensors died)."""
        if self.pins_host_memory():
            empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            if empty is not None:
                empty()

    def empty_accel_cache(self) -> None:
        """Hand the accelerator allocator's cached, unused blocks back to the device (a no-op on the CPU)."""
        get_accelerator().empty_cache()


_DOOR: Door = Door()
_LOCK = threading.Lock()


def current() -> Door:
    return _DOOR


def install(door: Door) -> Door:
    """Make ``door`` the process-wide door; returns the previous one."""
    global _DOOR
    with _LOCK:
        previous, _DOOR = _DOOR, door
    return previous


@contextmanager
def use(door: Door) -> Iterator[Door]:
    """Run a block with ``door`` (tests)."""
    previous = install(door)
    try:
        yield door
    finally:
        install(previous)


# Module-level entry points: the names call sites use (``device.to_accel(t)``), bound to the current door.
def accel_device() -> torch.device:
    return _DOOR.accel_device()


def host_is_accel() -> bool:
    return _DOOR.host_is_accel()


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is host memory that is not the accelerator's (never on the CPU accelerator)."""
    return _DOOR.is_host(t)


def is_pinned(t: torch.Tensor) -> bool:
    return _DOOR.is_pinned(t)


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return _DOOR.host_empty(numel, dtype)


def pins_host_memory() -> bool:
    return _DOOR.pins_host_memory()


def pin_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return _DOOR.pin_empty(numel, dtype)


def pin_path() -> str:
    """Which allocator :meth:`Door.pin_empty` uses where memory is pinned: ``"accelerator"`` (DeepSpeed >= 0.19's
    ``pin_empty``) or ``"torch"`` (``torch.empty(..., pin_memory=True)``).

    [Note: pinning before DeepSpeed 0.19] ``get_accelerator().pin_empty`` is new in 0.19 (it honours
    ``DS_PIN_MEMORY_BACKEND=native``); 0.16-0.18's accelerators have only ``pin_memory(tensor)``, which copies a
    pageable buffer. There the door allocates page-locked memory with torch itself
    (:meth:`Door.torch_pinned_empty`), what 0.19's CUDA accelerator does without the native backend."""
    return "accelerator" if callable(getattr(get_accelerator(), "pin_empty", None)) else "torch"


def accel_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return _DOOR.accel_empty(numel, dtype)


def to_accel(t: torch.Tensor, out: Optional[torch.Tensor] = None, *, non_blocking: bool = True) -> torch.Tensor:
    return _DOOR.to_accel(t, out, non_blocking=non_blocking)


def to_host(t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _DOOR.to_host(t, out)


def small_to_accel(values: list, dtype: torch.dtype, where: Optional[torch.device] = None) -> torch.Tensor:
    return _DOOR.small_to_accel(values, dtype, where)


def small_to_host(t: torch.Tensor) -> list:
    return _DOOR.small_to_host(t)


def current_stream() -> Any:
    return _DOOR.current_stream()


def stream(s: Any) -> ContextManager:
    return _DOOR.stream(s)


def side_stream(name: str) -> Any:
    return _DOOR.side_stream(name)


def side_streams() -> list[tuple[str, Any]]:
    """``(name, stream)`` of every side stream made so far (a diagnostic: the GPU check's reserved memory by stream)."""
    return [(name, s) for (name, _where), s in _DOOR.__dict__.get("_side", {}).items()]


def record_stream(t: torch.Tensor) -> None:
    _DOOR.record_stream(t)


def record_event() -> Any:
    return _DOOR.record_event()


def wait_event(event: Any) -> None:
    _DOOR.wait_event(event)


def wait_stream(s: Any) -> None:
    _DOOR.wait_stream(s)


def host_wait(event: Any) -> None:
    _DOOR.host_wait(event)


def host_wait_stream(s: Any) -> None:
    _DOOR.host_wait_stream(s)


def event_done(event: Any) -> bool:
    return _DOOR.event_done(event)


def drop_host(t: torch.Tensor) -> None:
    _DOOR.drop_host(t)


def split_done(retired: list[tuple[torch.Tensor, Any]]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, Any]]]:
    """``(tensor, event)`` pairs of retired host memory -> the tensors whose last copy finished (non-blocking,
    :func:`event_done`) and the pairs left waiting (a tensor is done with every pair that names it). The caller drops
    the done ones (:func:`drop_host`); [Note: deferred release] in ``cache.py``."""
    done = [t for t, ev in retired if event_done(ev)]
    return done, [(t, ev) for t, ev in retired if all(t is not d for d in done)]


def empty_host_cache() -> None:
    _DOOR.empty_host_cache()


def empty_accel_cache() -> None:
    _DOOR.empty_accel_cache()
