"""Collective byte counting by link class, and per-engine FCDP counters.

DeepSpeed's comms logger keys records by message size only (no process group), so it cannot tell
an intra-node gather from an inter-node one. Every DeepSpeed collective goes through the backend
object ``deepspeed.comm.comm.cdb``; wrapping its methods once counts every collective, whichever
DeepSpeed path issued it (coordinator, ``GatheredParameters``, gradient reduce-scatter).

Byte model: the bytes *this rank receives* in the collective, assuming ring/bandwidth-optimal
algorithms (all-gather: (W-1) input chunks; reduce-scatter: (W-1)/W of the input; all-reduce:
2(W-1)/W of the tensor). A collective is *inter-node* when its group spans more than one node.
"""
from __future__ import annotations

import enum
import threading
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from deepspeed import comm as dist
import deepspeed.comm.comm as _comm_module  # the live ``cdb`` global (the package re-export is a stale copy)

from fcdp_deepspeed.machine.topology import group_ranks

INTER = "inter_node"
INTRA = "intra_node"
#: Tag under which every gradient-reduction collective is also counted (``*_grad_reduce_bytes``),
#: whichever collectives carry it (DeepSpeed's reduce-scatter, FCDP's all-to-alls).
GRAD_FAMILY = "grad_reduce"

# Argument names of the TorchBackend methods we wrap (its decorators hide the signatures).
_ARGS = {
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_coalesced": ("output_tensors", "input_tensors", "group", "async_op"),
    "reduce_scatter_tensor": ("output_tensor", "input_tensor", "op", "group", "async_op"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "inference_all_reduce": ("tensor", "op", "group"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
}
#: Op family each backend method is reported under.
OP_FAMILY = {
    "all_gather_into_tensor": "allgather", "all_gather": "allgather", "all_gather_coalesced": "allgather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "all_reduce": "allreduce", "inference_all_reduce": "allreduce", "all_reduce_coalesced": "allreduce",
    "broadcast": "broadcast", "all_to_all_single": "alltoall",
}


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def received_bytes(method: str, args: dict, world: int, rank_in_group: int) -> int:
    """Bytes this rank receives in one collective under the ring byte model (see module doc)."""
    if world <= 1:
        return 0
    if method == "all_gather_into_tensor":
        return _nbytes(args.get("input_tensor")) * (world - 1)
    if method == "all_gather":
        return _nbytes(args.get("tensor")) * (world - 1)
    if method == "all_gather_coalesced":
        return _nbytes(args.get("input_tensors")) * (world - 1)
    if method in ("reduce_scatter_tensor", "all_to_all_single"):
        return _nbytes(args.get("input_tensor", args.get("input"))) * (world - 1) // world
    if method == "reduce_scatter":
        return _nbytes(args.get("input_list")) * (world - 1) // world
    if method in ("all_reduce", "inference_all_reduce"):
        return 2 * _nbytes(args.get("tensor")) * (world - 1) // world
    if method == "all_reduce_coalesced":
        return 2 * _nbytes(args.get("tensors")) * (world - 1) // world
    if method == "broadcast":
        return 0 if rank_in_group == args.get("src") else _nbytes(args.get("tensor"))
    return 0


#: gloo protocol bytes per message that crosses a node boundary (buffer-ready notifications and
#: per-send preambles), calibrated with 64-byte collectives on the emulated cluster (torch 2.13's
#: gloo): ring steps cost ~290 B (both directions of the link), tree (broadcast) sends ~147 B.
GLOO_RING_MESSAGE_BYTES = 290
GLOO_TREE_MESSAGE_BYTES = 147


def wire_bytes_sent(method: str, args: dict, ranks: Sequence[int], me: int, node_of_rank: Sequence[str]) -> int:
    """Bytes this rank puts on inter-node links in one collective, under gloo's algorithms.

    Measured on the emulated cluster (kernel counters, 2 nodes x 2): all-gather and all-reduce
    are rings in group-rank order (a rank sends to its successor; only successors on another node
    cross the uplink), gloo's reduce-scatter costs a ring all-reduce of the whole input, broadcast
    is a binomial tree rooted at the source. Used to check our counts against the
    kernel's; NCCL's algorithms differ.
    """
    world = len(ranks)
    if world <= 1 or me < 0:
        return 0
    me_node = node_of_rank[ranks[me]]
    crosses = node_of_rank[ranks[(me + 1) % world]] != me_node
    others = sum(1 for r in ranks if node_of_rank[r] != me_node)
    if method in ("all_gather_into_tensor", "all_gather", "all_gather_coalesced"):
        chunk = _nbytes(args.get("input_tensor", args.get("tensor", args.get("input_tensors"))))
        return (chunk + GLOO_RING_MESSAGE_BYTES) * (world - 1) if crosses else 0
    if method in ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor",
                  "reduce_scatter"):
        n = _nbytes(args.get("tensor", args.get("tensors", args.get("input_tensor", args.get("input_list")))))
        return 2 * (world - 1) * (n // world + GLOO_RING_MESSAGE_BYTES) if crosses else 0
    if method == "broadcast":
        # binomial tree over ranks relative to the root: in round k, relative ranks i < 2^k send to i + 2^k
        root = args.get("src_in_group", -1)
        if root < 0:
            return 0
        rel, n, sent, step = (me - root) % world, _nbytes(args.get("tensor")), 0, 1
        while step < world:
            if rel < step and rel + step < world:
                dest = ranks[(rel + step + root) % world]
                sent += n + GLOO_TREE_MESSAGE_BYTES if node_of_rank[dest] != me_node else 0
            step *= 2
        return sent
    if method == "all_to_all_single":
        return _nbytes(args.get("input")) * others // world
    return 0


def classify(method: str, args: dict, ranks: tuple[int, ...], me: int,
             nodes: Optional[Sequence[str]]) -> tuple[str, int]:
    """Link class of one collective under the layout ``nodes`` (inter-node when unknown), and the
    bytes this rank sends over inter-node links (:func:`wire_bytes_sent`; 0 when unknown)."""
    if nodes is None:
        return INTER, 0
    if len({nodes[r] for r in ranks}) == 1:
        return INTRA, 0
    if method == "broadcast":  # deepspeed.comm takes a global src rank
        args = dict(args, src_in_group=ranks.index(args["src"]) if args.get("src") in ranks else -1)
    return INTER, wire_bytes_sent(method, args, ranks, me, nodes) if method else 0


class LayoutKind(enum.Enum):
    """Where the ledger's node layout came from, weakest first (see :meth:`CommLedger.install`)."""

    GUESS = 0
    ENGINE_SETTING = 1
    DISCOVERED = 2
    EXPLICIT = 3


@dataclass
class CommCounters:
    """Bytes and calls per (op family, link class). Thread-safe: backward runs on autograd threads."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    wire: Counter = field(default_factory=Counter)
    """Estimated bytes this rank sent over inter-node links, by op family (see wire_bytes_sent)."""
    node_of_rank: Optional[tuple[str, ...]] = None
    """This engine's own node layout (``None``: the process's), see :meth:`CommLedger.layout_for`."""
    layout_source: str = ""
    follows_process: bool = False
    """A plain engine's launcher guess: yields to a layout discovered from the machine or asked for."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, family: str, link: str, nbytes: int, wire: int = 0) -> None:
        with self._lock:
            self.bytes[(family, link)] += nbytes
            self.calls[(family, link)] += 1
            if wire:
                self.wire[family] += wire

    def get(self, family: str, link: str) -> tuple[int, int]:
        with self._lock:
            return self.bytes[(family, link)], self.calls[(family, link)]

    def copy(self) -> "CommCounters":
        with self._lock:
            return CommCounters(bytes=Counter(self.bytes), calls=Counter(self.calls), wire=Counter(self.wire))

    def minus(self, other: Optional["CommCounters"]) -> "CommCounters":
        """Counts since ``other`` was copied from this ledger."""
        if other is None:
            return self.copy()
        with self._lock:
            return CommCounters(bytes=self.bytes - other.bytes, calls=self.calls - other.calls,
                                wire=self.wire - other.wire)

    def allgather_summary(self) -> dict[str, int]:
        """The all-gather and gradient-reduction keys of ``get_stats``: bytes and calls by link class,
        zeros included."""
        out = {}
        for family in ("allgather", GRAD_FAMILY):
            for link in (INTER, INTRA):
                nbytes, calls = self.get(family, link)
                out[f"{link}_{family}_bytes"], out[f"{link}_{family}_calls"] = nbytes, calls
        return out

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            out = {}
            for (family, link), nbytes in self.bytes.items():
                out[f"{link}_{family}_bytes"] = nbytes
                out[f"{link}_{family}_calls"] = self.calls[(family, link)]
            for family, nbytes in self.wire.items():
                out[f"wire_sent_inter_node_{family}_bytes"] = nbytes
            out["wire_sent_inter_node_bytes"] = sum(self.wire.values())
            return out


class CommLedger:
    """Process-wide collective counter with per-thread attribution to engine counters.

    One per process because there is one communication backend per process.
    """

    def __init__(self) -> None:
        self.totals = CommCounters()
        self._local = threading.local()
        self._node_of_rank: Optional[Sequence[str]] = None
        #: Where the node layout came from (reported as ``node_layout_source``).
        self.layout_source: str = "none"
        #: Where the layout came from, weakest first: a guess (no collective), one FCDP engine's
        #: ``fcdp.ranks_per_node`` (that engine's setting, often several nodes simulated on one machine),
        #: discovered from the machine by an FCDP engine, or asked for by enable_comm_counting.
        self._kind = LayoutKind.GUESS
        self._group_cache: dict[int, tuple[tuple[int, ...], int]] = {}
        self._originals: dict[str, Callable] = {}
        self._backend: Any = None

    # -- installation ------------------------------------------------------------------------
    def install(self, node_of_rank: Optional[Sequence[str]], source: str = "discovered",
                kind: Optional[LayoutKind] = None) -> None:
        """Wrap the backend's collectives (idempotent); ``node_of_rank`` classifies groups.

        A layout replaces the process's unless that one is of a stronger :class:`LayoutKind`: a guess
        (derived without a collective, for plain ZeRO-3 engines) never replaces one discovered by a
        collective (FCDP engines), and nothing replaces :func:`~fcdp_deepspeed.enable_comm_counting`'s.
        """
        kind = LayoutKind.DISCOVERED if kind is None else kind
        if kind.value >= self._kind.value:
            self._node_of_rank = tuple(node_of_rank) if node_of_rank is not None else None
            self.layout_source = source
            self._kind = kind
        backend = _comm_module.cdb
        if self._backend is backend:
            return
        self._backend = backend
        self._group_cache.clear()
        for method in _ARGS:
            original = getattr(backend, method, None)
            if original is None:
                continue
            self._originals[method] = original
            setattr(backend, method, self._wrap(method, original))

    def uninstall(self) -> None:
        if self._backend is not None:
            for method, original in self._originals.items():
                setattr(self._backend, method, original)
        self._originals.clear()
        self._backend = None

    @property
    def installed(self) -> bool:
        return self._backend is not None and self._backend is _comm_module.cdb

    def _wrap(self, method: str, original: Callable) -> Callable:
        names = _ARGS[method]

        def counted(*args, **kwargs):
            bound = dict(zip(names, args))
            bound.update(kwargs)
            self._record(method, bound)
            return original(*args, **kwargs)

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    # -- recording ---------------------------------------------------------------------------
    def _group_info(self, group: Any) -> tuple[tuple[int, ...], int]:
        key = id(group)
        info = self._group_cache.get(key)
        if info is None:
            ranks = group_ranks(group)
            me = dist.get_rank()
            info = (ranks, ranks.index(me) if me in ranks else -1)
            self._group_cache[key] = info
        return info

    def layout_for(self, counters: CommCounters) -> tuple[Optional[tuple[str, ...]], str]:
        """The layout (and its source) ``counters``' collectives are classified by.

        [Note: per-engine layouts] An FCDP engine classifies by its own topology. A plain engine
        classifies by the process's layout when that was discovered from the machine or asked for
        (enable_comm_counting), else by its own launcher guess: an FCDP engine that simulates several
        nodes on one machine (``fcdp.ranks_per_node``) must not turn a plain engine's collectives
        inside that machine into inter-node bytes, whichever engine was built first.
        """
        own = counters.node_of_rank
        if own is None or (counters.follows_process and self._kind.value >= LayoutKind.DISCOVERED.value):
            return self._node_of_rank, self.layout_source
        return own, counters.layout_source

    def link_of(self, ranks: Sequence[int]) -> str:
        return classify("", {}, tuple(ranks), -1, self._node_of_rank)[0]

    def _record(self, method: str, args: dict) -> None:
        ranks, me = self._group_info(args.get("group"))
        if len(ranks) <= 1:
            return
        nbytes = received_bytes(method, args, len(ranks), me)
        family = OP_FAMILY[method]
        tag = getattr(self._local, "tag", None)
        classified: dict[Any, tuple[str, int]] = {}
        for counters in (self.totals, *getattr(self._local, "sinks", ())):
            nodes = self.layout_for(counters)[0]
            if nodes not in classified:  # each engine classifies by its own layout (see layout_for)
                classified[nodes] = classify(method, args, ranks, me, nodes)
            link, wire = classified[nodes]
            counters.add(family, link, nbytes, wire)
            if tag is not None:
                counters.add(tag, link, nbytes)  # bytes and calls only: wire bytes stay per op family

    @contextmanager
    def tagged(self, family: str) -> Iterator[None]:
        """Also count collectives issued by this thread inside the block under ``family`` (e.g. all
        gradient-reduction traffic, whichever collectives carry it)."""
        previous = getattr(self._local, "tag", None)
        self._local.tag = family
        try:
            yield
        finally:
            self._local.tag = previous

    @contextmanager
    def attribute(self, sink: CommCounters) -> Iterator[None]:
        """Also count collectives issued by this thread inside the block into ``sink``."""
        stack = getattr(self._local, "sinks", ())
        if sink in stack:
            yield
            return
        self._local.sinks = stack + (sink, )
        try:
            yield
        finally:
            self._local.sinks = stack


#: The process-wide ledger (one communication backend per process).
LEDGER = CommLedger()


def current_sinks() -> tuple:
    """The counters this thread's collectives count into now (:meth:`CommLedger.attribute`): a collective issued
    later on another call path (a deferred stage 2, ``runtime/sequencer.py``) is counted where it was asked for
    with :func:`attributed_to`."""
    return getattr(LEDGER._local, "sinks", ())


@contextmanager
def attributed_to(sinks: Sequence[CommCounters]) -> Iterator[None]:
    """:meth:`CommLedger.attribute` for each of ``sinks``."""
    with ExitStack() as stack:
        for sink in sinks:
            stack.enter_context(LEDGER.attribute(sink))
        yield


@dataclass
class EventCounters:
    """Integer event counters bumped under one lock (backward runs on autograd threads)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


@dataclass
class CacheCounters(EventCounters):
    """Per-engine cache events."""

    hits: int = 0
    misses: int = 0
    uncached_fetches: int = 0
    fills: int = 0
    refreshes: int = 0
    invalidations: Counter = field(default_factory=Counter)
    verified_hits: int = 0
    optimizer_steps: int = 0
    staged_copies: int = 0
    staged_bytes: int = 0
    hierarchical_gathers: int = 0
    """Cache misses (and uncached fetches) gathered in two stages (``fcdp.param_gather``)."""
    batched_refills: int = 0
    """Batched refills of small stale parameters (``fcdp.miss_batch_bytes``); ``batched_params``: parameters in them."""
    batched_params: int = 0
    verified_gathers: int = 0
    stale_refetched: int = 0
    """Copies found older than their partition when read, dropped and refetched (``storage/freshness.py``)."""
    gather_fallbacks: Counter = field(default_factory=Counter)
    """Parameters the two-stage gather handed to DeepSpeed's flat ring, by reason."""

    def invalidated(self, reason: str, count: int) -> None:
        with self._lock:
            self.invalidations[reason] += count

    def gather_fell_back(self, reason: str, count: int) -> bool:
        """Count a flat fallback; whether it is the first for ``reason``."""
        with self._lock:
            first = reason not in self.gather_fallbacks
            self.gather_fallbacks[reason] += count
            return first


def fmt_bytes(n: float) -> str:
    """Human-readable bytes (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024.0
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def plural(n: int, word: str) -> str:
    """``"1 node"``, ``"2 nodes"``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


#: Counters the ``[fcdp]`` line reports per optimizer step of its interval (differences of running totals).
INTERVAL_KEYS = ("inter_node_allgather_bytes", "inter_node_grad_reduce_bytes", "intra_node_allgather_bytes",
                 "intra_node_grad_reduce_bytes", "cache_hits", "cache_misses")


def format_stats_line(stats: dict, previous: Optional[dict] = None) -> str:
    """Rank 0's line every ``fcdp.log_interval`` steps: the interval since ``previous`` (the stats of the
    last line, or none: since the engine was built), per optimizer step, and the cache's memory now.

    [Note: per interval] The counters are running totals since the engine was created; printed as they
    are they read like per-step figures and grow without bound, so the line reports differences."""
    prev = previous or {}
    first = int(prev.get("optimizer_steps", 0)) + 1
    last = int(stats["optimizer_steps"])
    steps = max(1, last - first + 1)
    d = {k: (stats.get(k, 0) - prev.get(k, 0)) for k in INTERVAL_KEYS}
    per = {k: v / steps for k, v in d.items()}
    lookups = d["cache_hits"] + d["cache_misses"]
    rate = f"{d['cache_hits'] / lookups:.1%}" if lookups else "n/a (no lookups)"
    rate += hit_rate_hint(d["cache_hits"], d["cache_misses"])
    span = f"step {first}" if first == last else f"steps {first}-{last}"
    slots = stats.get("host_slot_bytes", 0) + stats.get("device_slot_bytes", 0)
    valid = stats.get("host_cache_bytes", 0) + stats.get("device_cache_bytes", 0)
    return (f"[fcdp] step {last}: per optimizer step over {span}: inter-node all-gather "
            f"{fmt_bytes(per['inter_node_allgather_bytes'])}, grad reduce {fmt_bytes(per['inter_node_grad_reduce_bytes'])}; "
            f"intra-node all-gather {fmt_bytes(per['intra_node_allgather_bytes'])}, grad reduce "
            f"{fmt_bytes(per['intra_node_grad_reduce_bytes'])} (bytes this rank received); cache hit rate {rate} "
            f"({per['cache_hits']:g} hits, {per['cache_misses']:g} misses per step); cache slots {fmt_bytes(slots)} "
            f"per rank (host {fmt_bytes(stats.get('host_slot_bytes', 0))}, device "
            f"{fmt_bytes(stats.get('device_slot_bytes', 0))}), valid now {fmt_bytes(valid)}" + _compression_part(stats)
            + _timeline_part(stats, prev, steps))


def hit_rate_hint(hits: int, misses: int) -> str:
    """Why a hit rate is 0% when the cache was looked up (empty otherwise).

    [Note: a 0% hit rate] The cache serves a parameter's gathers after the first one of a step (trainable) or
    every one (frozen). DeepSpeed keeps a parameter gathered from its forward use to its backward use when the
    elements gathered in between stay under ``stage3_max_reuse_distance`` (default 1e9) and prefetches up to
    ``stage3_prefetch_bucket_size``; on a model that fits in them, with every parameter trainable, each lookup is
    then a step's first gather and the cache has nothing to serve (nothing crosses nodes twice either)."""
    if hits or not misses:
        return ""
    return (" (the cache served nothing: each lookup was a parameter's first gather after a step, and DeepSpeed kept "
            "the parameters gathered from forward to backward under zero_optimization.stage3_max_reuse_distance "
            "(default 1e9) and stage3_prefetch_bucket_size; lower them, e.g. stage3_max_reuse_distance 0, when device "
            "memory is short, and the backward's gathers come from the cache)")


#: The ``[fcdp]`` line's timeline phases (``timeline.Phase`` values) and their short names.
_TIMELINE_LINE = (("forward_gather", "forward gather"), ("backward_refill", "backward refill"),
                  ("grad_node_stage", "grad node stage"), ("grad_inter_node", "grad inter-node"),
                  ("grad_bucket", "grad other"), ("codec", "codec"), ("push_wait", "push wait"),
                  ("optimizer_step", "step"))


def _timeline_part(stats: dict, prev: dict, steps: int) -> str:
    """The line's host seconds per step and phase over the interval (``timeline.py``; empty without a timeline)."""
    if "timeline_view" not in stats:
        return ""
    parts = [f"{label} {(stats.get(f'timeline_{k}_s', 0.0) - prev.get(f'timeline_{k}_s', 0.0)) / steps:.3f}"
             for k, label in _TIMELINE_LINE]
    return f"; host s/step ({stats['timeline_view']} view): " + ", ".join(parts)


def _compression_part(stats: dict) -> str:
    """The log line's ``fcdp.param_compression`` part (empty when off)."""
    if stats.get("param_compression", "off") == "off":
        return ""
    return (f", param compression {stats['param_compression']}: inter-node {fmt_bytes(stats['inter_node_param_compressed_bytes'])}"
            f" compressed / {fmt_bytes(stats['inter_node_param_exact_bytes'])} exact, drift max "
            f"{stats['param_drift_max_all_ranks']:.2e} mean {stats['param_drift_mean_all_ranks']:.2e} (all ranks)")
