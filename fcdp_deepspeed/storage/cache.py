"""Cache entries (one per parameter) and the pooled slot storage behind them.

[Note: entry states]
Every managed parameter has one :class:`CacheEntry` whose :class:`EntryState` says which memory
exists and whether DeepSpeed may use it:

- ``DISABLED``: no slot. The parameter takes the plain ZeRO-3 path (over budget, excluded, or
  degraded after a fault). ``param.ds_secondary_tensor`` is ``None`` forever.
- ``EMPTY``: a slot is reserved in a pool but holds no valid data. ``ds_secondary_tensor is None``,
  so the next fetch is a full-group (inter-node) all-gather; the release that follows fills it.
- ``FILLED``: the slot holds this rank's 1/L slice of the parameter's *current* value and
  ``param.ds_secondary_tensor is entry.slot``, so DeepSpeed's hpZ gather path fetches the parameter
  over the node-local group from it.

Only :class:`NodeCache` changes states. Hit/miss decide which collective runs, so every event that
changes a state must happen on all ranks of the data-parallel group at the same logical point
(releases, optimizer steps, checkpoint events, agreed planning); nothing is evicted on one rank.
"""
from __future__ import annotations

import enum
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable, Iterator, Optional

import torch

from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from fcdp_deepspeed import faults
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting.stats import CacheCounters
from fcdp_deepspeed.storage import freshness
from fcdp_deepspeed.storage.memory import chunk_groups, chunks_cost, pinned_cost  # noqa: F401  (chunk_groups: re-exported)


#: The invalidation reason of a slot found older than its partition when read ([Note: freshness by construction]).
STALE_AT_USE = "stale_at_use"
#: The attribute naming the :class:`NodeCache` whose slot a parameter's ``ds_secondary_tensor`` is.
SLOT_OWNER = "ds_fcdp_slot_owner"


class EntryState(enum.Enum):
    DISABLED = "disabled"
    EMPTY = "empty"
    FILLED = "filled"


class Placement(enum.Enum):
    HOST = "host"
    DEVICE = "device"


@dataclass(eq=False)
class CacheEntry:
    """One parameter's slice of the node cache on this rank."""

    param: torch.nn.Parameter
    name: str
    slot_numel: int
    """Elements per rank: aligned_numel / L (DeepSpeed's hpZ secondary size)."""
    start: int
    """Offset of this rank's slice in the flattened parameter."""
    dtype: torch.dtype
    state: EntryState = EntryState.EMPTY
    placement: Optional[Placement] = None
    slot: Optional[torch.Tensor] = field(default=None, repr=False)
    disabled_reason: str = ""
    hits: int = 0
    checksum: Optional[float] = None
    staged: Optional[torch.Tensor] = field(default=None, repr=False)
    """Device copy of a host slot while one gather is being issued (see ``SlotCopies.staged``)."""
    ready: Any = field(default=None, repr=False)
    """Event recorded after the last copy into the slot (``None`` without streams): readers wait on it."""
    taken: int = -1
    """The partition's stamp when the slot was filled (``freshness.py``): the slot is served only while it matches."""

    @property
    def valid_numel(self) -> int:
        """Elements of the slice inside the parameter (the rest of the slot is zero padding)."""
        return max(0, min(self.param.ds_numel - self.start, self.slot_numel))

    @property
    def nbytes(self) -> int:
        return self.slot_numel * self.dtype.itemsize


#: Pools are carved into chunks of at most this size so an allocation failure costs a chunk, not all.
#: A power of two: a full pinned chunk costs exactly its size (see ``memory.pinned_cost``).
CHUNK_BYTES = 256 * 2**20


class SlotPool:
    """Flat buffers per dtype, allocated once at planning time; every slot is a view into one.

    Why pooled: pinned allocations are slow and a known source of host OOMs, so the pool is sized
    from the plan, allocated before the first step and never grows or shrinks per step. A pinned
    chunk is allocated at its power-of-two rounded size (what the caching host allocator takes
    anyway), so ``nbytes`` is the memory really held and :meth:`cost` predicts it.
    """

    def __init__(self, placement: Placement, pin: bool) -> None:
        self.placement = placement
        self.pin = pin and placement is Placement.HOST
        self.chunks: list[torch.Tensor] = []
        self.allocations = 0
        #: Host seconds spent allocating (pinning) and zeroing the chunks.
        self.alloc_seconds = 0.0
        #: Chunks no entry uses any more, each with the event after the last copy that read it.
        self.retired: list[tuple[torch.Tensor, Any]] = []

    @property
    def nbytes(self) -> int:
        """Bytes held, retired chunks still waiting for their copies included."""
        return sum(c.numel() * c.element_size() for c in self.chunks + [c for c, _ in self.retired])

    @property
    def pinned_nbytes(self) -> int:
        """Bytes actually page-locked (0 where the accelerator cannot pin host memory, e.g. the CPU)."""
        return sum(c.numel() * c.element_size() for c in self.chunks if self.pin and device.is_pinned(c))

    @property
    def rounds(self) -> bool:
        """Whether chunks are pinned for real, so each costs its power-of-two rounding."""
        return self.pin and device.pins_host_memory()

    def cost(self, entries: Iterable[CacheEntry]) -> int:
        """Bytes :meth:`reserve` would allocate for ``entries`` (chunking and pinned rounding included)."""
        return sum(chunks_cost([e.nbytes for e in group], CHUNK_BYTES, self.rounds)
                   for group in self._by_dtype(entries).values())

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        faults.maybe_fail(f"alloc_{self.placement.value}")
        t0 = time.perf_counter()
        if self.placement is Placement.DEVICE:
            buf = device.accel_empty(numel, dtype)
        elif self.pin:
            numel = pinned_cost(numel * dtype.itemsize, self.rounds) // dtype.itemsize
            buf = device.pin_empty(numel, dtype)
        else:
            buf = device.host_empty(numel, dtype)
        # [Note: zero padding] Slots are zeroed once here: fills write only the parameter's elements, so the
        # padding past ``valid_numel`` stays zero without a host write racing an in-flight copy.
        buf.zero_()
        self.alloc_seconds += time.perf_counter() - t0
        self.allocations += 1
        return buf

    @staticmethod
    def _by_dtype(entries: Iterable[CacheEntry]) -> dict[torch.dtype, list[CacheEntry]]:
        by_dtype: dict[torch.dtype, list[CacheEntry]] = {}
        for e in entries:
            by_dtype.setdefault(e.dtype, []).append(e)
        return by_dtype

    def reserve(self, entries: Iterable[CacheEntry]) -> list[CacheEntry]:
        """Give each entry a slot; return the entries whose chunk could not be allocated."""
        failed: list[CacheEntry] = []
        for dtype, group in self._by_dtype(entries).items():
            for indices in chunk_groups([e.nbytes for e in group], CHUNK_BYTES, self.rounds):
                chunk = [group[i] for i in indices]
                try:
                    buf = self._allocate(sum(c.slot_numel for c in chunk), dtype)
                except (RuntimeError, MemoryError, faults.InjectedFault):
                    failed.extend(chunk)
                    continue
                self.chunks.append(buf)
                offset = 0
                for c in chunk:
                    c.slot = buf.narrow(0, offset, c.slot_numel)
                    c.placement = self.placement
                    offset += c.slot_numel
        return failed

    def release_unused(self, entries: Iterable[CacheEntry], last_use: Any = None) -> None:
        """Retire chunks no live entry points into (after an agreement disabled them, or a move emptied them).

        [Note: deferred release] ``last_use`` is an event after the last copy that read them (the move's):
        they are dropped by :meth:`reap` once it has completed, never while a copy may still read them.
        Pinned memory from ``DS_PIN_MEMORY_BACKEND=native`` is freed with no event, and even torch's caching
        host allocator only protects copies it saw."""
        used = {e.slot.untyped_storage().data_ptr() for e in entries if e.slot is not None}
        self.retired += [(c, last_use) for c in self.chunks if c.untyped_storage().data_ptr() not in used]
        self.chunks = [c for c in self.chunks if c.untyped_storage().data_ptr() in used]
        self.reap()

    def reap(self) -> int:
        """Drop retired chunks whose last copy has completed (non-blocking); return the bytes freed. Freed
        pinned chunks go back to the system (torch's caching host allocator would keep them cached)."""
        done, self.retired = device.split_done(self.retired)
        if not done:
            return 0
        freed = 0
        for chunk in done:
            freed += chunk.numel() * chunk.element_size()
            if self.placement is Placement.HOST:
                device.drop_host(chunk)
        del chunk, done
        if self.placement is Placement.HOST:
            device.empty_host_cache()
        return freed


def tag_secondary(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """The attributes DeepSpeed's hpZ path expects on a secondary tensor."""
    tensor.ds_numel = numel
    tensor.status = PartitionedParamStatus.AVAILABLE
    tensor.final_location = None
    return tensor


class SlotCopies:
    """Host<->accelerator copies of filled slots: device copies of host hits while a gather is issued, and
    re-placing entries into another pool. Entry states are unchanged (only :class:`NodeCache` changes them);
    runs under the owning cache's lock."""

    def __init__(self, lock: Any, counters: CacheCounters) -> None:
        self._lock = lock
        self.counters = counters
        self.last_move: Any = None

    @contextmanager
    def staged(self, entries: Iterable[CacheEntry]) -> Iterator[None]:
        """Serve host-resident hits from device copies issued asynchronously.

        [Note: staged copies] Called while DeepSpeed issues a gather, i.e. on its all-gather stream. The
        copies run on FCDP's own copy stream (``device.side_stream("param_h2d")``): each first waits for its
        slot's fill (``entry.ready``: fills are asynchronous copies on the fill stream), then copies
        from the pinned pool; the all-gather stream waits for one event after the batch, right before the
        gather that reads them. So hit copies never queue ahead of other gathers on the all-gather stream
        (prefetches issue many), and they overlap compute and the other direction's copies. The device
        copies are allocated on the copy stream and read on the all-gather stream: ``record_stream`` before
        they are dropped. A device-resident hit is read by the gather itself, which waits on its fill.
        On a CPU accelerator nothing is copied.
        """
        if device.host_is_accel():
            yield
            return
        moved = []
        with self._lock:
            copies = device.side_stream("param_h2d")
            for e in entries:
                if e.state is not EntryState.FILLED or e.slot is None:
                    continue
                if e.placement is not Placement.HOST:
                    device.wait_event(e.ready)
                    continue
                with device.stream(copies):
                    device.wait_event(e.ready)
                    e.staged = tag_secondary(device.to_accel(e.slot), e.slot_numel)
                e.param.ds_secondary_tensor = e.staged
                moved.append(e)
            if moved:
                with device.stream(copies):
                    copied = device.record_event()
                device.wait_event(copied)
                self.counters.bump(staged_copies=len(moved), staged_bytes=sum(e.nbytes for e in moved))
        try:
            yield
        finally:
            with self._lock:
                for e in moved:
                    device.record_stream(e.staged)  # read by the gather on this stream
                    if e.param.ds_secondary_tensor is e.staged:
                        e.param.ds_secondary_tensor = e.slot
                    e.staged = None

    def move(self, entries: list[CacheEntry], pool: SlotPool) -> list[CacheEntry]:
        """Re-place entries into ``pool`` (validity unchanged: placement is a per-rank decision).

        Returns the entries that moved; the others keep their old slot. The copies run on the current
        stream, each after its slot's fill; ``self.last_move`` is an event after them (the old chunks'
        release waits for it, see [Note: deferred release]).
        """
        with self._lock:
            old = {id(e): e.slot for e in entries}
            failed = pool.reserve(entries)
            moved = [e for e in entries if e not in failed]
            for e in moved:
                if e.state is EntryState.FILLED:
                    device.wait_event(e.ready)
                    copy = device.to_accel if pool.placement is Placement.DEVICE else device.to_host
                    copy(old[id(e)], out=e.slot)
                    e.ready = device.record_event()
                    tag_secondary(e.slot, e.slot_numel)
                    e.param.ds_secondary_tensor = e.slot
            self.last_move = device.record_event()
        return moved


class NodeCache:
    """The entries of one engine on this rank and the only code that changes their state."""

    def __init__(self, rank_in_node: int, counters: CacheCounters, checksums: bool) -> None:
        self.rank_in_node = rank_in_node
        self.counters = counters
        self.checksums = checksums
        self.entries: dict[int, CacheEntry] = {}  # by ds_id
        self.pools: dict[Placement, Optional[SlotPool]] = {p: None for p in Placement}
        #: Bumped whenever entries are dropped or disabled (the same points on every rank): a new set of
        #: stale entries (``runtime.refill`` decides once per generation).
        self.generation = 0
        # Fills run on the releasing thread (forward: main thread; backward: autograd threads).
        self._lock = threading.RLock()
        self.copies = SlotCopies(self._lock, counters)

    # -- queries ------------------------------------------------------------------------------
    def entry(self, param: torch.nn.Parameter) -> Optional[CacheEntry]:
        return self.entries.get(getattr(param, "ds_id", -1))

    def is_hit(self, entry: CacheEntry) -> bool:
        """Whether the slot may serve the next gather: filled, and from the partition as it is now (a slot whose
        invalidation never came is dropped here and refetched, [Note: freshness by construction])."""
        with self._lock:
            self._reconcile(entry)
            if entry.state is EntryState.FILLED and not freshness.is_current(entry.param, entry.taken):
                self.invalidate([entry], STALE_AT_USE)
                self.counters.bump(stale_refetched=1)
            return entry.state is EntryState.FILLED

    def held_bytes(self, placement: Placement) -> int:
        return sum(e.nbytes for e in self.entries.values()
                   if e.state is EntryState.FILLED and e.placement is placement)

    # -- transitions --------------------------------------------------------------------------
    def _reconcile(self, entry: CacheEntry) -> None:
        """Catch an external drop of the secondary (e.g. DeepSpeed's own invalidation)."""
        current = entry.param.ds_secondary_tensor
        if entry.state is EntryState.FILLED and current is not entry.slot and current is not entry.staged:
            entry.state = EntryState.EMPTY

    # -- host<->device copies of slots (SlotCopies) ----------------------------------------------
    def staged(self, entries: Iterable[CacheEntry]) -> ContextManager[None]:
        """See :meth:`SlotCopies.staged` (under this cache's lock)."""
        return self.copies.staged(entries)

    def move(self, entries: list[CacheEntry], pool: SlotPool) -> list[CacheEntry]:
        """See :meth:`SlotCopies.move` (under this cache's lock)."""
        return self.copies.move(entries, pool)

    def on_partition(self, entry: CacheEntry, has_been_updated: bool) -> None:
        """DeepSpeed is partitioning ``entry.param`` (release, or ``partition(has_been_updated=True)``)."""
        with self._lock:
            if entry.state is EntryState.DISABLED:
                return
            self._reconcile(entry)
            param = entry.param
            if param.ds_status is not ZeroParamStatus.AVAILABLE:
                # Values rewritten while partitioned: we cannot refill without the full tensor.
                if has_been_updated:
                    self.invalidate([entry], "updated_while_partitioned")
                return
            if entry.state is EntryState.FILLED and not has_been_updated:
                return
            # the slot holds what the full tensor holds: the partitions it was gathered from, or the edit just made
            taken = freshness.stamp(param) if has_been_updated else freshness.gathered_stamp(param)
            self._fill(entry, refresh=has_been_updated and entry.state is EntryState.FILLED, taken=taken)

    def _fill(self, entry: CacheEntry, refresh: bool, taken: int) -> None:
        """Copy this rank's slice of the gathered parameter into the slot, asynchronously, off the compute stream.

        [Note: asynchronous fill] DeepSpeed releases in the post-forward hook, on the compute stream: a copy
        queued there would cross PCIe in line with the forward kernels. The copy runs on FCDP's fill stream
        (``device.side_stream("fill")``) instead, ordered by events:

        - the copy waits for the producer: an event recorded on the releasing stream, after the gather (and
          whatever the releasing stream ran) that wrote the full parameter;
        - the slot's first reader waits for the copy: ``entry.ready`` is recorded on the fill stream after it
          (the staged copy on the copy stream, a device slot's gather, a move, verify mode's host checksum);
        - the source stays alive until the copy is done: the full tensor is freed right after this partition
          call, and the door ``record_stream``-s it on the fill stream, so the caching allocator does not hand
          its memory to new work before the copy has read it.

        A slot being rewritten (a refresh) was last read by work the releasing stream is ordered after, so the
        producer event orders the rewrite after those reads too. Padding past ``valid_numel`` is zero from
        allocation.
        """
        param, slot = entry.param, entry.slot
        assert slot is not None
        entry.taken = taken
        setattr(param, SLOT_OWNER, self)  # whichever engine's fetch path reads the slot finds its cache
        n = entry.valid_numel
        fills = device.side_stream("fill")
        produced = device.record_event()
        with device.stream(fills):
            device.wait_event(produced)
            if n > 0:
                src = param.data.contiguous().view(-1).narrow(0, entry.start, n)
                with torch.no_grad():
                    if entry.placement is Placement.HOST:
                        device.to_host(src, out=slot.narrow(0, 0, n))
                    else:
                        slot.narrow(0, 0, n).copy_(src)  # same device, on the fill stream
                        device.record_stream(src)
                        device.record_stream(slot)  # the pool's chunk, allocated on another stream, written here
            entry.ready = device.record_event()
        tag_secondary(slot, entry.slot_numel)
        if self.checksums:  # verify (a debug mode): the host reads the slot, so it waits for the copy
            device.host_wait(entry.ready)
        entry.checksum = float(slot.double().sum()) if self.checksums else None
        entry.state = EntryState.FILLED
        param.ds_secondary_tensor = slot
        self.counters.bump(refreshes=1) if refresh else self.counters.bump(fills=1)

    def invalidate(self, entries: Iterable[CacheEntry], reason: str) -> int:
        """FILLED -> EMPTY; the slot stays reserved. Returns how many entries were dropped."""
        count = 0
        with self._lock:
            for entry in entries:
                self._reconcile(entry)
                if entry.state is EntryState.FILLED:
                    entry.param.ds_secondary_tensor = None
                    entry.state = EntryState.EMPTY
                    entry.checksum = None
                    count += 1
        if count:
            self.generation += 1
            self.counters.invalidated(reason, count)
        return count

    def disable(self, entries: Iterable[CacheEntry], reason: str) -> None:
        """Any state -> DISABLED: the parameter takes the plain ZeRO-3 path from now on."""
        with self._lock:
            for entry in entries:
                if entry.state is EntryState.FILLED:
                    entry.param.ds_secondary_tensor = None
                entry.state = EntryState.DISABLED
                entry.slot = None
                entry.placement = None
                entry.disabled_reason = reason
            self.generation += 1
