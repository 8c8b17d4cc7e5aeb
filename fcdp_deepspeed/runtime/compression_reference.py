"""The reference store: per parameter, the bundle this rank's node-peer group reconstructed at its last
two-stage gather (``fcdp.param_compression``).

[Note: references]
Stage 1 of the two-stage gather moves, among a rank's node peers (one rank per node), the N partitions
of the peer group: the *bundle* (N*p elements; not the cache slot's layout, which is a contiguous 1/L
of the parameter). With compression each owner sends its partition as a quantized delta against the
partition's last reconstruction, which every peer holds: the reference. It is the bundle reconstructed
at the parameter's last two-stage gather, written by the same decode on every peer, so it is bitwise
the same on every rank of the peer group. Because the reference *is* the last reconstruction (not the
last exact value), each step's delta carries the previous step's error: the error of a reconstruction
is the quantization error of one delta and never accumulates.

States (:class:`RefState`) change only at the same logical points on every rank, as the cache's entry
states do (``cache.py``'s [Note: entry states]): at two-stage gathers (collective, agreed), at optimizer
step boundaries (the periodic refresh), at checkpoint loads and at agreed planning. A parameter whose
requires_grad flipped, or that ``GatheredParameters(modifier_rank=...)`` rewrote outside a checkpoint
event, drops its reference (its next gather crosses exactly). Optimizer steps do *not* drop references:
that is the point. Only :class:`ReferenceStore` changes states; the gather writes slots through it.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting.stats import EventCounters
from fcdp_deepspeed.storage.cache import Placement, SlotPool


class RefState(enum.Enum):
    NONE = "none"
    """A slot without valid content: the next two-stage gather crosses exactly and fills it
    (``Reference.why`` says why, counted when it does)."""
    VALID = "valid"
    """The slot holds the bundle every peer reconstructed at the last two-stage gather: the next one
    sends a delta against it."""


@dataclass(eq=False)
class Reference:
    """One parameter's reference on this rank (a :class:`~fcdp_deepspeed.storage.cache.SlotPool` slot of N*p elements)."""

    param: torch.nn.Parameter
    #: The parameter's name in the module (what checkpoints key references by: ``ds_id`` differs between processes).
    name: str
    #: Elements of one partition (``ds_tensor.ds_numel``) and partitions in the bundle (nodes).
    partition_numel: int
    nodes: int
    dtype: torch.dtype
    state: RefState = RefState.NONE
    why: str = "first gather"
    placement: Optional[Placement] = None
    slot: Optional[torch.Tensor] = field(default=None, repr=False)
    #: Event after the last write into the slot, on the gather stream (``None`` without streams): host readers wait on it.
    ready: Any = field(default=None, repr=False)
    #: The parameter's last two-stage gather was compressed: what it gathered is a reconstruction.
    lossy: bool = False
    #: ``requires_grad`` at the last gather: a flip drops the reference.
    requires_grad: bool = True

    @property
    def slot_numel(self) -> int:
        return self.nodes * self.partition_numel

    @property
    def nbytes(self) -> int:
        return self.slot_numel * self.dtype.itemsize


@dataclass
class CompressionCounters(EventCounters):
    """Per-engine parameter-compression events (``get_stats``)."""

    compressed_gathers: int = 0
    refreshes: int = 0
    #: Parameters with a reference slot gathered exactly, by why their reference was empty.
    exact_gathers: dict = field(default_factory=dict)

    def exact(self, why: str, count: int = 1) -> None:
        with self._lock:
            self.exact_gathers[why] = self.exact_gathers.get(why, 0) + count


class ReferenceStore:
    """The references of one engine on this rank, and the only code that changes their state."""

    def __init__(self, counters: CompressionCounters, refresh_interval: int) -> None:
        self.counters = counters
        self.refresh_interval = refresh_interval
        self.refs: dict[int, Reference] = {}  # by ds_id: parameters with a slot only
        self.pools: dict[Placement, SlotPool] = {}
        #: Optimizer steps seen (the refresh cadence; saved in checkpoints).
        self.steps = 0
        #: Between ``checkpoint_event_prologue`` and ``_epilogue``: saves and 16-bit consolidation rewrite
        #: parameters with the values they had (``partition(has_been_updated=True)``); that drops nothing.
        self.in_checkpoint_event = False
        self._lock = threading.RLock()

    def get(self, param: torch.nn.Parameter) -> Optional[Reference]:
        return self.refs.get(getattr(param, "ds_id", -1))

    # -- slots (called on the gather stream) ------------------------------------------------------
    def on_accel(self, ref: Reference) -> torch.Tensor:
        """The reference on the accelerator: the slot itself, or a copy of the pinned host slot issued
        asynchronously on the current stream (ordered after the last write, which ran on it too)."""
        return ref.slot if ref.placement is Placement.DEVICE else device.to_accel(ref.slot)

    def on_accel_many(self, refs: list[Reference]) -> list[torch.Tensor]:
        """:meth:`on_accel` of several references, each viewed ``(nodes, partition_numel)``: host slots that lie
        together in one pool chunk (a module's parameters: neighbouring ``ds_id``) cross in one copy of their span."""
        out = [r.slot if r.placement is Placement.DEVICE else None for r in refs]
        chunks: dict[int, list[int]] = {}
        for i, r in enumerate(refs):
            if out[i] is None:
                chunks.setdefault(id(r.slot._base) if r.slot._base is not None else -i - 1, []).append(i)
        for group in chunks.values():
            slots = [refs[i].slot for i in group]
            low = min(t.storage_offset() for t in slots)
            high = max(t.storage_offset() + t.numel() for t in slots)
            chunk = slots[0]._base
            if chunk is None or len(group) == 1 or high - low > 2 * sum(t.numel() for t in slots):
                for i in group:  # one copy each
                    out[i] = device.to_accel(refs[i].slot)
                continue
            span = device.to_accel(chunk.narrow(0, low - chunk.storage_offset(), high - low))
            for i, t in zip(group, slots):
                out[i] = span.narrow(0, t.storage_offset() - low, t.numel())
        return [t.view(r.nodes, r.partition_numel) for t, r in zip(out, refs)]

    def write_many(self, refs: list[Reference], values: list[torch.Tensor], *, lossy: bool) -> None:
        """:meth:`write` of several references (``values[i]``: ``refs[i]``'s bundle), one event after all of them, the
        accelerator slots in one ``_foreach_copy_``."""
        if not refs:
            return
        with self._lock:
            targets = [r.slot.view(r.nodes, r.partition_numel) for r in refs]
            device_pairs = [(t, v) for r, t, v in zip(refs, targets, values)
                            if r.placement is Placement.DEVICE and t.data_ptr() != v.data_ptr()]
            if len(device_pairs) > 1 and hasattr(torch, "_foreach_copy_"):  # torch >= 2.1
                torch._foreach_copy_([t for t, _ in device_pairs], [v for _, v in device_pairs])
            else:
                for t, v in device_pairs:
                    t.copy_(v)
            for r, t, v in zip(refs, targets, values):
                if r.placement is not Placement.DEVICE:
                    device.to_host(v, out=t)
            ready = device.record_event()
            for r in refs:
                r.ready = ready
                r.state, r.why, r.lossy, r.requires_grad = RefState.VALID, "", lossy, r.param.requires_grad

    def write(self, ref: Reference, values: torch.Tensor, *, lossy: bool) -> None:
        """The bundle just reconstructed (``values``: N x p on the accelerator) becomes the reference, on the
        current (gather) stream; host slots by an asynchronous copy into pinned memory. ``ref.ready`` is
        recorded after it, for host readers (checkpoint saves)."""
        self.write_many([ref], [values], lossy=lossy)

    def host_ready(self) -> None:
        """The host waits for every pending write into a slot (checkpoint saves and loads only)."""
        for ref in self.refs.values():
            device.host_wait(ref.ready)

    # -- transitions --------------------------------------------------------------------------------
    def usable(self, ref: Reference) -> bool:
        """Whether ``ref`` can serve the next gather as a delta reference; drops it when its parameter's
        ``requires_grad`` flipped since (the same decision on every rank: flips are made on all of them)."""
        with self._lock:
            if ref.state is RefState.VALID and ref.requires_grad != ref.param.requires_grad:
                self._drop(ref, "requires_grad flip")
            return ref.state is RefState.VALID and ref.param.requires_grad

    def _drop(self, ref: Reference, why: str) -> bool:
        if ref.state is not RefState.VALID:
            return False
        ref.state, ref.why = RefState.NONE, why
        return True

    def mark_frozen(self, ref: Reference) -> None:
        """[Note: frozen after build] A slotted parameter frozen after the engine was built is still gathered
        (exactly) while the optimizer owns it; seeding its reference made it VALID with an empty ``why``, so every
        later exact gather was counted under ``""``. It gets no reference while frozen (it never changes, so a
        delta would save nothing) and its gathers count under ``"frozen"``; unfreezing is a ``requires_grad``
        flip away from NONE, so its next gather seeds the reference."""
        with self._lock:
            ref.state, ref.why, ref.requires_grad = RefState.NONE, "frozen", False

    def drop(self, refs: Iterable[Reference], why: str) -> int:
        with self._lock:
            return sum(self._drop(r, why) for r in refs)

    def drop_all(self, why: str) -> int:
        return self.drop(list(self.refs.values()), why)

    def on_partition(self, param: torch.nn.Parameter, has_been_updated: bool) -> None:
        """DeepSpeed partitions ``param``; ``has_been_updated``: its values were rewritten in place
        (``GatheredParameters(modifier_rank=...)``), outside checkpoint events a new value: cross exactly."""
        ref = self.get(param) if has_been_updated and not self.in_checkpoint_event else None
        if ref is not None:
            self.drop([ref], "modified in place")

    def on_step_end(self) -> None:
        """An applied optimizer step: every ``refresh_interval`` steps all references are dropped, so every
        changed parameter crosses exactly once and the references restart from exact values."""
        self.steps += 1
        if self.refresh_interval and self.steps % self.refresh_interval == 0:
            self.drop_all("refresh")
            self.counters.bump(refreshes=1)

    # -- memory ---------------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        return sum(r.nbytes for r in self.refs.values() if r.state is RefState.VALID)

    def pool_bytes(self, placement: Placement) -> int:
        pool = self.pools.get(placement)
        return pool.nbytes if pool is not None else 0


class ReferenceCheckpoint:
    """The ``"params"`` part of the checkpoint envelope (``compress/state.py``): this rank's share of its valid
    references, the refresh cadence, and the key they are valid under (codec, block, node layout, this rank's peers).

    [Note: reference shares] Every node peer holds the same bundle (N partitions), so saving it whole wrote each
    bundle N times: references alone cost ``2N`` bytes per bf16 parameter in a checkpoint (16 at 8 nodes), more
    than the parameters. Each rank saves only its own row (``peer_index``, p elements: 1/N of the bundle); a load
    at the same layout (the key names the peers) all-gathers the rows among the peers, in peer order, and
    rebuilds the bundle bit for bit. A load at another layout (another key) starts every reference empty anyway,
    so nothing there needs the other rows."""

    #: Version of this part's content (2: one row of the bundle per rank).
    VERSION = 2

    def __init__(self, store: ReferenceStore, key: dict, agree: Callable[[list[bool]], list[bool]],
                 peer_group: Any = None, peer_index: int = 0) -> None:
        self.store = store
        self.key = key
        #: Collective over the DP group: a flag stays true only where it is true on every rank.
        self.agree = agree
        self.peer_group, self.peer_index = peer_group, peer_index

    def state(self) -> dict:
        store = self.store
        store.host_ready()  # every slot's last write (on the gather stream) has landed
        saved = {}
        for ref in store.refs.values():
            if ref.state is RefState.VALID:
                values = device.host_empty(ref.partition_numel, ref.dtype)
                row = ref.slot.view(ref.nodes, ref.partition_numel)[self.peer_index]  # [Note: reference shares]
                if ref.placement is Placement.DEVICE:
                    device.to_host(row, out=values)
                else:
                    values.copy_(row)
                saved[ref.name] = {"partition_numel": ref.partition_numel, "nodes": ref.nodes, "dtype": str(ref.dtype),
                                "requires_grad": ref.requires_grad, "values": values}
        device.host_wait(device.record_event())  # the device slots' copies (checkpoint time, not per step)
        return {"version": self.VERSION, "key": dict(self.key), "steps": store.steps, "references": saved}

    def reset(self, why: str) -> None:
        """Weights rewritten without an optimizer state: every reference empty (the next gathers cross exactly,
        counted under ``why``), the refresh cadence restarted."""
        self.store.host_ready()
        self.store.drop_all(why)
        for ref in self.store.refs.values():
            ref.why = why
        self.store.steps = 0

    def _fits(self, ref: Reference, saved: Any) -> bool:
        return (isinstance(saved, dict) and saved.get("partition_numel") == ref.partition_numel
                and saved.get("nodes") == ref.nodes and saved.get("dtype") == str(ref.dtype)
                and isinstance(saved.get("values"), torch.Tensor) and saved["values"].numel() == ref.partition_numel)

    def load_state(self, saved: Optional[Mapping[str, Any]]) -> None:
        """Collective: restore the references the checkpoint holds for this layout and codec, agreed across
        ranks; every other reference starts empty, so its parameter crosses exactly once."""
        store = self.store
        refs = [store.refs[i] for i in sorted(store.refs)]
        same = bool(saved) and saved.get("version") == self.VERSION and saved.get("key") == self.key
        held = saved.get("references", {}) if same else {}
        flags = self.agree([same] + [same and self._fits(r, held.get(r.name)) for r in refs])
        store.host_ready()  # no copy of an earlier gather still lands in a slot overwritten below
        store.drop_all("checkpoint load")
        for ref in store.refs.values():
            ref.why = "checkpoint load"  # those restored below become valid
        if not flags[0]:
            store.steps = 0  # the refresh cadence restarts with the references (nothing restored)
            return
        store.steps = int(saved["steps"])
        restored = [ref for ref, ok in zip(refs, flags[1:]) if ok]
        for ref, bundle in zip(restored, self._gather_shares([held[r.name]["values"] for r in restored], restored)):
            with store._lock:
                if ref.placement is Placement.DEVICE:
                    ref.slot.view(ref.nodes, ref.partition_numel).copy_(bundle)
                else:
                    device.to_host(bundle, out=ref.slot.view(ref.nodes, ref.partition_numel))
                ref.state, ref.why, ref.lossy, ref.ready = RefState.VALID, "", False, None
                ref.requires_grad = bool(held[ref.name]["requires_grad"])
        device.host_wait(device.record_event())  # the host slots' copies (load time)

    def _gather_shares(self, shares: list, refs: list) -> list:
        """Collective over the peer group (the same refs on every peer: agreed above): each ref's bundle on the
        accelerator, ``(N, p)``, from every peer's saved row, one all-gather per dtype ([Note: reference shares])."""
        out: dict[int, torch.Tensor] = {}
        for dtype in sorted({r.dtype for r in refs}, key=str):
            idx = [i for i, r in enumerate(refs) if r.dtype == dtype]
            sizes = [refs[i].partition_numel for i in idx]
            mine = device.to_accel(torch.cat([shares[i].reshape(-1) for i in idx]), non_blocking=False)
            nodes = refs[idx[0]].nodes
            gathered = device.accel_empty(nodes * mine.numel(), dtype)
            dist.allgather_fn(gathered, mine, group=self.peer_group, async_op=False)
            rows = gathered.view(nodes, mine.numel())
            offset = 0
            for i, size in zip(idx, sizes):
                out[i] = rows[:, offset:offset + size]
                offset += size
        return [out[i] for i in range(len(refs))]
