"""Stream order in strict device mode: fake streams and events with vector clocks, and every tensor access
checked against the stream that last wrote (or read) its memory, on DeepSpeed's CPU accelerator.

[Note: the stream-order model]
CUDA orders work within a stream; across streams only through ``wait_event``/``wait_stream``; against the
host only through host waits (``Event.synchronize``, ``Stream.synchronize``, a device synchronize, a
successful ``query()``, or the implicit wait of a blocking read such as ``.item()``). Each fake stream
keeps a vector clock: its own position (one tick per tensor op issued on it) and, for every other stream,
the latest position it is known to run after. The host is a stream too; work issued after a host wait is
ordered after what the host waited for, so every stream op takes in the host's knowledge.

Every tensor op on the thread that installed strict mode (forward, backward and DeepSpeed's hooks: the CPU
accelerator runs them all there) is seen by a ``TorchDispatchMode`` and is an access on the current fake
stream, or on the host when it touches door-allocated host memory only (outside the door's asynchronous
copies). Per storage the model keeps the last write and the reads since, each with its call site, and
reports (:class:`StreamOrderError`, both call sites named):

- a read or write after a write on another stream that its stream is not ordered after (a missing
  ``wait_event``/``wait_stream``; on the host: a read of a pinned buffer before its copy's event was waited on);
- a write after a read on another stream that its stream is not ordered after (memory reused too early);
- door memory freed (its last view dies) while a stream other than the one that allocated it used it
  without ``record_stream`` and without the allocating stream having waited for it; pinned memory the door
  drops (``device.drop_host``) while a stream's use of it is not known complete on the host (what
  ``DS_PIN_MEMORY_BACKEND=native``, which frees with no event, requires).

A collective runs on one fake stream per process group (NCCL's internal stream): it waits for the issuing
stream, does its reads and writes, and the handle's ``wait()`` (at once for a blocking call) makes the then
current stream wait for it. Inputs are held by the process group until the work ends, as NCCL does, so
collective streams are exempt from the free check. DeepSpeed's streams (the coordinator's all-gather stream,
``reduce_and_partition_stream``, the default stream) are fakes too, see :func:`install_deepspeed_streams`.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from fcdp_lab.strict.strict_log import LOG, call_site


class StreamOrderError(RuntimeError):
    """An access not ordered after a conflicting access on another stream (or memory freed too early)."""


class FakeStream:
    """A stream of the model: a name, its position, and the positions of other streams it runs after."""

    def __init__(self, name: str, comm: bool = False, fcdp: bool = False) -> None:
        self.name = name
        self.comm = comm
        #: One of FCDP's own streams (``device.side_stream``): only FCDP issues work there.
        self.fcdp = fcdp
        self.pos = 0
        self.clock: dict[FakeStream, int] = {}

    def snapshot(self) -> dict:
        return {**self.clock, self: self.pos}

    def wait_event(self, event: Any) -> None:
        if event is not None:
            MODEL.wait(self, event.clock)

    def wait_stream(self, other: Any) -> None:
        if other is not None:
            MODEL.wait(self, other.snapshot())

    def synchronize(self) -> None:
        LOG.record("stream_synchronize")
        MODEL.wait(MODEL.host, self.snapshot())

    def query(self) -> bool:
        MODEL.wait(MODEL.host, self.snapshot())  # reported done: the host knows it finished
        return True

    def record_event(self, event: Any = None) -> "FakeEvent":
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"


class FakeEvent:
    """An event of the model: the clock of the stream it was recorded on, at that point. ``query()`` answers
    "not yet" the first time it is asked after a record (work just queued is rarely done), then "done", and
    the host then knows it finished."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.clock: dict = {}
        self.stream: Optional[FakeStream] = None
        self._asked = False

    def record(self, stream: Any = None) -> None:
        self.stream = stream if isinstance(stream, FakeStream) else MODEL.current()
        self.clock, self._asked = self.stream.snapshot(), False

    def wait(self, stream: Any = None) -> None:
        (stream if isinstance(stream, FakeStream) else MODEL.current()).wait_event(self)

    def query(self) -> bool:
        if not self._asked and self.clock:
            self._asked = True
            return False
        MODEL.wait(MODEL.host, self.clock)
        return True

    def synchronize(self) -> None:
        LOG.record("event_synchronize")
        MODEL.wait(MODEL.host, self.clock)

    def elapsed_time(self, other: Any) -> float:
        return 0.0


Site = tuple[str, str]  # (owner, "dir/file:line function")


@dataclass(eq=False)
class Access:
    stream: FakeStream
    pos: int
    site: Site
    #: Made by FCDP: its code, or inside a stream context FCDP entered through the door.
    fcdp: bool = False


@dataclass(eq=False)
class Span:
    """An access to bytes ``[start, end)`` of a storage."""

    start: int
    end: int
    acc: Access
    write: bool


@dataclass(eq=False)
class Record:
    """One storage's accesses as the model knows them: the last write of each byte range and the reads since."""

    label: str
    alloc: FakeStream
    host: bool = False
    #: Allocated by the door (FCDP's memory): every conflicting access is FCDP's to order.
    door: bool = False
    spans: list = field(default_factory=list)
    uses: dict = field(default_factory=dict)  # stream -> last access (the free check)
    recorded: set = field(default_factory=set)  # streams record_stream-ed
    alloc_site: Site = ("other", "?")
    #: A DeepSpeed collective's output ([Note: DeepSpeed's gathered parameters]): only FCDP's uses are checked at free.
    adopted: bool = False


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class StreamClocks:
    """The streams, the current stream per thread and the orderings between them."""

    def __init__(self) -> None:
        self.host = FakeStream("host")
        self.default = FakeStream("default")
        self.streams: list[FakeStream] = [self.host, self.default]
        self.local = threading.local()
        self.lock = threading.RLock()

    def new_stream(self, name: str, comm: bool = False, fcdp: bool = False) -> FakeStream:
        s = FakeStream(name, comm, fcdp)
        with self.lock:
            self.streams.append(s)
        return s

    def side(self, name: str) -> FakeStream:
        """FCDP's own stream ``name`` (``device.side_stream``), one per process."""
        with self.lock:
            found = next((s for s in self.streams if s.fcdp and s.name == f"fcdp_{name}"), None)
        return found or self.new_stream(f"fcdp_{name}", fcdp=True)

    def current(self) -> FakeStream:
        return getattr(self.local, "stream", None) or self.default

    def in_fcdp_context(self) -> bool:
        return getattr(self.local, "fcdp", False)

    @contextmanager
    def on(self, s: FakeStream, fcdp: bool = False) -> Iterator[None]:
        """``s`` is current; ``fcdp``: FCDP entered it (through the door), so what runs inside is FCDP's to order."""
        previous, self.local.stream = getattr(self.local, "stream", None), s
        outer, self.local.fcdp = self.in_fcdp_context(), self.in_fcdp_context() or fcdp
        try:
            yield
        finally:
            self.local.stream, self.local.fcdp = previous, outer

    def tick(self, s: FakeStream) -> int:
        """One op issued on ``s``: it runs after everything the host knows finished, and after host work so far."""
        if s is not self.host:
            self.wait(s, self.host.clock)
            s.clock[self.host] = self.host.pos
        s.pos += 1
        return s.pos

    def wait(self, s: FakeStream, clock: dict) -> None:
        with self.lock:
            for other, pos in clock.items():
                if other is not s and s.clock.get(other, 0) < pos:
                    s.clock[other] = pos

    def synchronize_all(self) -> None:
        for s in list(self.streams):
            self.wait(self.host, s.snapshot())

    @staticmethod
    def ordered(s: FakeStream, acc: Access) -> bool:
        return acc.stream is s or s.clock.get(acc.stream, 0) >= acc.pos


def _where(acc: Access) -> str:
    return f"on stream {acc.stream.name!r} at {acc.site[1]} (position {acc.pos})"


class StreamModel(StreamClocks):
    """The clocks plus every storage's accesses and the checks (see [Note: the stream-order model])."""

    def __init__(self) -> None:
        super().__init__()
        self.records: "weakref.WeakKeyDictionary[Any, Record]" = weakref.WeakKeyDictionary()
        self.violations: list[str] = []
        #: ``False``: collect violations in :attr:`violations` (tests of broken variants) instead of raising.
        self.raise_errors = True
        #: Whether tensor ops are tracked (off: e.g. a plain ZeRO-3 baseline run; streams are still modeled).
        self.enabled = True
        self._pending: list[str] = []

    def fail(self, message: str, deferred: bool = False) -> None:
        message = "fcdp strict streams: " + message
        self.violations.append(message)
        if self.raise_errors:
            if deferred:  # inside a finalizer: raised by the next tracked op
                self._pending.append(message)
            else:
                raise StreamOrderError(message)

    def raise_pending(self) -> None:
        if self._pending:
            message, self._pending = self._pending[0], []
            raise StreamOrderError(message)

    def register(self, t: torch.Tensor, label: str, host: bool = False, free_check: bool = False) -> None:
        """Door memory: a fresh record allocated on the current stream (the host for host memory)."""
        storage = _storage(t)
        if storage is None:
            return
        rec = Record(label=label, alloc=self.host if host else self.current(), host=host, door=True,
                     alloc_site=call_site(2))
        self.records[storage] = rec
        if free_check and not host:
            weakref.finalize(storage, self.freed, rec)

    def label(self, t: torch.Tensor, label: str) -> None:
        rec = self.records.get(_storage(t))
        if rec is not None:
            rec.label = label

    def _fcdps(self, rec: Record, earlier: Access, now: Access) -> bool:
        """Whether a conflict is FCDP's to order: its memory, its earlier access, its own stream now, or its access
        now (FCDP's code: e.g. the two-stage gather's copies of the optimizer-written ``ds_tensor``, which wait for
        the step's event, [Note: the optimizer's writes] in runtime/staged.py).
        [Note: DeepSpeed's own orderings] are DeepSpeed's: e.g. in 0.19.8 the optimizer's writes to ``ds_tensor``
        and the next forward's gathers on the all-gather stream (DeepSpeed's own, for its flat path) are ordered
        only by the throughput timer's device synchronize, which starts at step 2."""
        return rec.door or earlier.fcdp or now.stream.fcdp or now.fcdp

    def access(self, s: FakeStream, reads: Iterable[tuple], writes: Iterable[tuple], site: Site,
               fcdp: bool = False) -> None:
        """One op on ``s``: ``reads``/``writes`` are ``(storage, start byte, end byte)``."""
        now = Access(s, self.tick(s), site, fcdp)
        for (storage, a, b), write in [(r, False) for r in reads] + [(w, True) for w in writes]:
            rec = self.records.get(storage)
            if rec is None:
                if not fcdp:  # [Note: what is tracked] memory FCDP never touched is DeepSpeed's to order
                    continue
                rec = self.records[storage] = Record(label="tensor", alloc=s, alloc_site=site)
            keep = []
            for span in rec.spans:
                if span.end <= a or span.start >= b:
                    keep.append(span)
                    continue
                if (span.write or write) and not self.ordered(s, span.acc) and self._fcdps(rec, span.acc, now):
                    self.fail(self._conflict(rec, now, write, span))
                superseded = write and a <= span.start and span.end <= b
                repeated = not write and not span.write and span.acc.stream is s and (span.start, span.end) == (a, b)
                if not (superseded or repeated):
                    keep.append(span)
            keep.append(Span(a, b, now, write))
            rec.spans = keep
            rec.uses[s] = now

    def _conflict(self, rec: Record, now: Access, write: bool, span: Span) -> str:
        hint = ("the host must wait on that copy's event first" if now.stream is self.host else
                "no wait_event/wait_stream on that stream since" if span.write else
                "the memory is rewritten while that stream may still read it")
        return (f"{'write' if write else 'read'} of {rec.label} {_where(now)} is not ordered after its "
                f"{'write' if span.write else 'read'} {_where(span.acc)} ({hint}; {now.stream.name!r} runs after "
                f"position {now.stream.clock.get(span.acc.stream, 0)} of {span.acc.stream.name!r})")

    def record_stream(self, t: torch.Tensor, s: FakeStream) -> None:
        rec = self.records.get(_storage(t))
        if rec is not None:
            rec.recorded.add(s)

    def freed(self, rec: Record) -> None:
        """A door allocation's last view died: the caching allocator may hand it to new work on its stream."""
        for s, use in rec.uses.items():
            if s is rec.alloc or s.comm or s in rec.recorded or self.ordered(rec.alloc, use) or self.ordered(self.host, use):
                continue
            if rec.adopted and not use.fcdp:  # DeepSpeed's memory, DeepSpeed's use
                continue
            owner, site = call_site(2)
            self.fail(f"{rec.label} (allocated {_where(Access(rec.alloc, 0, rec.alloc_site))}) was freed at {site} while "
                      f"its use {_where(use)} may still run: record_stream it on that stream before dropping it",
                      deferred=True)

    def drop_host(self, t: torch.Tensor) -> None:
        """Pinned memory the caller drops now: every stream's use of it must be known complete on the host."""
        rec = self.records.get(_storage(t))
        if rec is None:
            return
        for s, use in rec.uses.items():
            if s is not self.host and not self.ordered(self.host, use):
                self.fail(f"{rec.label} dropped at {call_site(2)[1]} while its use {_where(use)} may still run "
                          f"(DS_PIN_MEMORY_BACKEND=native frees pinned memory with no event): wait until that "
                          f"copy's event is done first")

    def is_host(self, t: torch.Tensor) -> bool:
        rec = self.records.get(_storage(t))
        return rec is not None and rec.host


MODEL = StreamModel()


# -- the tracker: every tensor call on the installing thread -----------------------------------------
_LOCAL = threading.local()  # paused: inside the door's own copies or a modeled collective
#: Calls that read no tensor data.
_METADATA = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "storage_offset", "data_ptr",
                       "untyped_storage", "storage", "element_size", "is_pinned", "is_contiguous", "get_device",
                       "requires_grad_", "share_memory_", "retain_grad", "record_stream", "register_hook", "set_",
                       "__len__", "__repr__", "__format__", "__hash__", "__reduce_ex__", "__get__", "__set__",
                       "__delete__", "is_floating_point", "is_complex", "_is_view", "type", "__iter__", "as_subclass",
                       "is_nonzero_", "pin_memory", "detach_"})
#: Calls that read a device value into the host: the host waits for the stream (CUDA: an implicit synchronize).
_HOST_SYNC = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "equal",
                        "allclose", "nonzero", "masked_select", "unique", "is_nonzero"})
_IN_PLACE_DUNDER = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


def _written(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call writes: the first argument of an in-place call (``add_``, ``__setitem__``,
    ``_foreach_mul_``), and ``out=``."""
    out = _tensors_of(kwargs.get("out"))
    if args and (name in _IN_PLACE_DUNDER or (name.endswith("_") and (not name.startswith("_") or name.startswith("_foreach_")))):
        out += _tensors_of(args[0])
    return out


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple]:
    """``(storage, start byte, end byte)`` of each tensor's view (meta and empty tensors excluded)."""
    out = []
    for t in tensors:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        storage = _storage(t)
        if storage is not None:
            size = t.element_size()
            start = t.storage_offset() * size
            extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
            out.append((storage, start, start + extent * size))
    return out


@contextmanager
def paused() -> Iterator[None]:
    previous, _LOCAL.paused = getattr(_LOCAL, "paused", False), True
    try:
        yield
    finally:
        _LOCAL.paused = previous


def door_copy(out: torch.Tensor, src: torch.Tensor, blocking: bool) -> None:
    """The door's host<->accelerator copy ``out <- src``: on the current stream, FCDP's; a blocking one also
    makes the host wait for it."""
    stream = MODEL.current()
    with torch._C.DisableTorchFunctionSubclass():
        MODEL.access(stream, _spans([src]), _spans([out]), call_site(2), fcdp=True)
    with paused():
        out.copy_(src)
    if blocking:
        MODEL.wait(MODEL.host, stream.snapshot())


def _backward_tracked(mode: TorchFunctionMode, func: Any, args: tuple, kwargs: dict) -> None:
    """``Tensor.backward``/``torch.autograd.backward`` with the tracker on the stack again: a mode is popped while
    its handler runs, and the backward hooks (DeepSpeed's reductions, FCDP's) must be tracked. What
    ``torch.autograd.backward`` does after its own torch-function check."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    names = (("gradient", "retain_graph", "create_graph", "inputs") if func is torch.Tensor.backward else
             ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs"))
    bound = {**dict(zip(names, args[1:])), **kwargs}
    tensors = (args[0],) if isinstance(args[0], torch.Tensor) else tuple(args[0])
    grads = bound.get("gradient", bound.get("grad_tensors"))
    create = bool(bound.get("create_graph") or False)
    retain = create if bound.get("retain_graph") is None else bound["retain_graph"]
    inputs = bound.get("inputs")
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grads_ = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False)
    with mode:
        _engine_run_backward(tensors, grads_, retain, create, inputs, allow_unreachable=True, accumulate_grad=True)


class Tracker(TorchFunctionMode):
    """Every torch call with tensors as an access of the model: on the host when it touches door host memory
    only, else on the current stream. Views (the result shares the input's memory, nothing written) are not
    accesses. Calls inside torch's own C++ (autograd's backward kernels) are not seen: they touch DeepSpeed's
    memory, never FCDP's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "backward" and args:  # it runs the backward hooks (DeepSpeed's reductions, FCDP's): track them
            return _backward_tracked(self, func, args, kwargs)
        if not MODEL.enabled or name in _METADATA or getattr(_LOCAL, "paused", False):
            return func(*args, **kwargs)
        MODEL.raise_pending()
        with paused():
            out = func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            self._account(name, args, kwargs, out)
        return out

    @staticmethod
    def _account(name: str, args: tuple, kwargs: dict, out: Any) -> None:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        written = _written(name, args, kwargs)
        ws = _spans(written)
        ids = {id(t) for t in written}
        rs = _spans([t for t in tensors if id(t) not in ids])
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        outs = _spans(results)
        inputs = {id(span[0]) for span in rs + ws}
        if results and not ws and all(id(span[0]) in inputs for span in outs):
            return  # a view (or the input itself): no access
        touched = [MODEL.records.get(span[0]) for span in rs + ws]
        site = call_site(3)
        fcdp = site[0] == "fcdp" or MODEL.in_fcdp_context()
        host = bool(touched) and all(rec is not None and rec.host for rec in touched)
        stream = MODEL.host if host else MODEL.current()
        if fcdp or any(rec is not None for rec in touched):
            MODEL.access(stream, rs, ws, site, fcdp)
            if fcdp:  # FCDP's new tensors: tracked, and checked when freed
                written_at = Access(stream, stream.pos, site, fcdp)
                for storage, _, _ in outs:
                    if id(storage) not in inputs:
                        rec = MODEL.records[storage] = Record(label="tensor", alloc=stream, host=host, alloc_site=site,
                                                              spans=[Span(0, storage.nbytes(), written_at, True)])
                        if not host:
                            weakref.finalize(storage, MODEL.freed, rec)
        if name in _HOST_SYNC and not host:  # an implicit synchronize, whoever reads
            MODEL.wait(MODEL.host, stream.snapshot())


_TRACKER: Optional[Tracker] = None


def track_this_thread() -> None:
    """Install the tracker on this thread for the rest of the process (idempotent)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = Tracker()
        _TRACKER.__enter__()


@contextmanager
def tracking() -> Iterator[StreamModel]:
    """The tracker for a block (in-process tests), violations raised."""
    with Tracker():
        yield MODEL


# -- collectives ------------------------------------------------------------------------------------
#: Argument names a collective writes (``tensor``/``tensors`` too for the in-place ones).
_OUTPUTS = frozenset({"output_tensor", "output", "tensor_list", "output_tensors", "gather_list"})
_IN_PLACE = frozenset({"all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "recv",
                       "irecv", "scatter"})


class _Work:
    """A collective's handle: ``wait()`` makes the then-current stream wait for the collective's stream."""

    def __init__(self, work: Any, event: FakeEvent, stream: FakeStream) -> None:
        self._work, self._event, self.stream = work, event, stream

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs) if self._work is not None else None
        MODEL.current().wait_event(self._event)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_COMM: dict[Any, FakeStream] = {}


def _comm_stream(group: Any) -> FakeStream:
    s = _COMM.get(id(group))
    if s is None:
        try:
            ranks = torch.distributed.get_process_group_ranks(group) if group is not None else "world"
        except Exception:  # not a torch process group: name it by id
            ranks = id(group)
        s = _COMM[id(group)] = MODEL.new_stream(f"collectives{tuple(ranks) if isinstance(ranks, list) else ranks}",
                                                comm=True)
        s.ranks = tuple(ranks) if isinstance(ranks, list) else ()
    return s


def _adopt_outputs(spans: list, issuing: FakeStream, site: Site) -> None:
    """[Note: DeepSpeed's gathered parameters] DeepSpeed's collectives write memory FCDP did not allocate (the
    gathered ``param.data`` that the release hook copies into a cache slot, on FCDP's fill stream): its outputs
    are tracked from here, allocated on the issuing stream, so an FCDP stream reading them unordered, or a free
    while an FCDP stream still reads them without ``record_stream``, is reported. DeepSpeed's own later accesses
    stay DeepSpeed's to order (:meth:`StreamModel._fcdps`)."""
    for storage, _, _ in spans:
        if storage not in MODEL.records:
            rec = MODEL.records[storage] = Record(label="gathered tensor", alloc=issuing, alloc_site=site, adopted=True)
            weakref.finalize(storage, MODEL.freed, rec)


def modeled_collective(method: str, bound: dict, call: Callable[[], Any]) -> Any:
    """Run a ``deepspeed.comm`` backend collective on its group's fake stream (see the note above)."""
    issuing = MODEL.current()
    comm = _comm_stream(bound.get("group"))
    MODEL.wait(comm, issuing.snapshot())  # NCCL's stream waits for the issuing stream
    reads, writes = [], []
    for name, value in bound.items():
        written = name in _OUTPUTS or (method in _IN_PLACE and name in ("tensor", "tensors"))
        (writes if written else reads).extend(_tensors_of(value))
    site = call_site(2)
    fcdp = site[0] == "fcdp" or MODEL.in_fcdp_context()
    with torch._C.DisableTorchFunctionSubclass():
        if not fcdp:
            _adopt_outputs(_spans(writes), issuing, site)
        MODEL.access(comm, _spans(reads), _spans(writes), site, fcdp)
    with paused():
        work = call()
    event = comm.record_event()
    if bound.get("async_op"):
        return _Work(work, event, comm)
    issuing.wait_event(event)
    return work


# -- DeepSpeed's streams ---------------------------------------------------------------------------
def _fake_attribute(name: str, label: str) -> property:
    """A class attribute that reads a per-instance fake stream where DeepSpeed stored ``None`` (the CPU
    accelerator's "no streams")."""
    def get(self: Any) -> Any:
        value = self.__dict__.get(name)
        if value is None:
            value = self.__dict__[name] = MODEL.new_stream(label)
        return value

    def set_(self: Any, value: Any) -> None:
        self.__dict__[name] = value

    return property(get, set_)


_INSTALLED = False


def install_deepspeed_streams(current: Callable[[], Any]) -> None:
    """Route DeepSpeed's stream calls on the CPU accelerator through the model (once per process):
    ``current_stream``/``default_stream``/``stream(s)``/``synchronize`` of the accelerator, the ordering
    DeepSpeed skips on synchronized devices (``resolves_data_dependency`` is false: its ``wait_stream`` and
    ``synchronize`` calls run, on fakes), and fake streams in place of the coordinator's all-gather stream
    and ``reduce_and_partition_stream``. ``is_synchronized_device`` stays true, so DeepSpeed still skips
    ``record_stream`` on CPU tensors: its own frees are not modeled."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    acc = get_accelerator()
    original_sync = acc.synchronize

    def synchronize(*args: Any, **kwargs: Any) -> Any:
        MODEL.synchronize_all()
        return original_sync(*args, **kwargs)

    acc.current_stream = lambda device_index=None: current()
    acc.default_stream = lambda device_index=None: MODEL.default
    acc.stream = lambda s: MODEL.on(s) if isinstance(s, FakeStream) else nullcontext()
    acc.synchronize = synchronize
    acc.resolves_data_dependency = lambda: False
    DeepSpeedZeRoOffload._DeepSpeedZeRoOffload__allgather_stream = _fake_attribute(
        "_DeepSpeedZeRoOffload__allgather_stream", "ds_allgather")
    PartitionedParameterCoordinator._PartitionedParameterCoordinator__allgather_stream = _fake_attribute(
        "_PartitionedParameterCoordinator__allgather_stream", "ds_allgather")
    DeepSpeedZeroOptimizer_Stage3.reduce_and_partition_stream = _fake_attribute(
        "reduce_and_partition_stream", "ds_reduce_and_partition")
