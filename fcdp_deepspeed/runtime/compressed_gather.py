"""The compressed stage 1 of the two-stage parameter gather (``fcdp.param_compression``).

[Note: the compressed stage 1]
For parameters whose reference is valid (``compression_reference.py``), stage 1 does not move the exact
partitions among the node peers. On the gather stream (``runtime/gather.py``'s [Note: streams]):

1. the owner computes ``delta = ds_tensor - own reference partition`` in fp32 (elements past the
   parameter's end, uninitialized in DeepSpeed's last partition, are zeroed so they cannot poison a
   block's scale), each parameter's segment padded to whole blocks (a scale never spans two
   parameters, so a reconstruction does not depend on what it was coalesced with);
2. encodes it (``codec.encode``: a fixed-size ``uint8`` message, aligned to ``ALIGN`` bytes in the
   buffer) and all-gathers the N messages among its peers (``async_op=False``: ordered on the stream);
3. every rank, the owner included, decodes all N messages in peer order and writes
   ``(reference + decoded delta)`` cast to the parameter's dtype into the bundle of the flat buffer,
   and into the reference (the new reference is that reconstruction);
4. stage 2 (intra-node, exact) gathers the reconstructed bundles as for exact parameters.

So every rank computes with the same reconstruction, bit for bit (same bytes, same torch ops in the
same order, [Note: determinism] in ``quant.py``), and the optimizer's master weights and ``ds_tensor``
stay exact. The owner measures the drift ``|w - reconstruction| / |w|`` of its own partition (relative
L2 per parameter and gather) on the accelerator, without a host read (:class:`DriftMeter`).
Exact stage 1s of parameters with a reference slot seed their reference from the exact bundle.
"""
from __future__ import annotations

import itertools
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.compress.quant import Codec
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import INTER, LEDGER, CommCounters
from fcdp_deepspeed.runtime.compression_reference import CompressionCounters, ReferenceStore, RefState
from fcdp_deepspeed.storage.cache import Placement

#: Ledger families of the inter-node stage 1 while compression is on (``inter_node_param_*_bytes``).
PARAM_COMPRESSED = "param_compressed"
PARAM_EXACT = "param_exact"
#: Parameter dtypes the fp32 delta arithmetic reconstructs (other trainable dtypes are refused).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Each peer's message starts at a multiple of this many bytes (the decode views its fp32 scales in place).
ALIGN = 16


def padded(numel: int, block: int) -> int:
    return -(-numel // block) * block


def pays(codec: Codec, partition_numel: int, dtype: torch.dtype) -> bool:
    """Whether a partition's message is smaller compressed than exact (tiny partitions cross exactly)."""
    return codec.wire_numel(padded(partition_numel, codec.block)) < partition_numel * dtype.itemsize


def _norms(tensors: list) -> list:
    """The L2 norm of each tensor: one ``_foreach_norm`` (torch >= 2.0; each norm that of ``linalg.vector_norm``)."""
    return list(torch._foreach_norm(tensors)) if tensors else []


@dataclass(eq=False)
class DriftMeter:
    """Drift of this rank's own reconstructions since the last report, kept on the accelerator."""

    #: ``[max, sum]`` of the per-parameter relative errors, fp32 on the accelerator (``None``: none yet).
    values: Optional[torch.Tensor] = None
    count: int = 0
    ready: Any = None

    def add(self, errors: torch.Tensor, norms: torch.Tensor) -> None:
        """On the gather stream: ``errors``/``norms``: per-parameter L2 norms of ``w - r`` and ``w``."""
        rel = errors / norms.clamp_min(torch.finfo(torch.float32).tiny)
        if self.values is None:
            self.values = torch.zeros(2, dtype=torch.float32, device=rel.device)
        self.values[0] = torch.maximum(self.values[0], rel.max())
        self.values[1] += rel.sum()
        self.count += rel.numel()
        self.ready = device.record_event()

    def read(self) -> tuple[float, float, int]:
        """``(max, mean, samples)`` (a host read: report time only)."""
        if self.values is None or not self.count:
            return 0.0, 0.0, 0
        device.host_wait(self.ready)
        top, total = device.small_to_host(self.values)
        return top, total / self.count, self.count

    def reset(self) -> None:
        self.values, self.count, self.ready = None, 0, None


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive pieces of ``sizes`` starts."""
    return list(itertools.accumulate(sizes[:-1], initial=0)) if sizes else []


@dataclass(eq=False)
class ParamCompression:
    """One engine's compressed stage 1: the codec, the references, the counters and the drift."""

    codec: Codec
    store: ReferenceStore
    counters: CompressionCounters
    #: Nodes (peers per bundle), this rank's index among its peers and in the DP group.
    nodes: int
    peer_index: int
    dp_index: int
    drift: DriftMeter = field(default_factory=DriftMeter)
    #: ``(max, mean)`` drift over every rank in the last report interval (:meth:`collect_drift`).
    drift_all_ranks: tuple[float, float] = (0.0, 0.0)
    #: Inside ``fcdp_deepspeed.exact_gathers``: every stage 1 exact, references neither read nor seeded
    #: ([Note: exact gathers] in ``evaluation.py``).
    exact_only: bool = False

    def split(self, params: Sequence[torch.nn.Parameter], count: bool = True) -> tuple[list, list]:
        """``(exact, compressed)``: compressed where the reference is valid (agreed: see [Note: references]);
        an exact parameter with a reference slot is counted under why its reference was empty (not when ``count``
        is false: the run-ahead's planning, ``runtime/runahead.py``)."""
        exact, compressed = [], []
        for p in params:
            ref = self.store.get(p)
            if ref is not None and self.exact_only:
                exact.append(p)
                if count:
                    self.counters.exact("exact_gathers")
            elif ref is not None and self.store.usable(ref):
                compressed.append(p)
            else:
                exact.append(p)
                if ref is not None and count:
                    self.counters.exact(ref.why)
        return exact, compressed

    def issued(self, params: Sequence[torch.nn.Parameter], lossy: bool) -> None:
        """A fetch issued the two-stage gather of ``params``, compressed or not: :meth:`lossy` says so from now on,
        though a compressed one decodes only when its fetch waits ([Note: the compressed stage 1 in flight]; the
        fetch's verify sampling asks at issue)."""
        for p in params:
            ref = self.store.get(p)
            if ref is not None:
                ref.lossy = lossy

    def lossy(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s last two-stage gather was compressed (its gathered value is a reconstruction)."""
        ref = self.store.get(param)
        return ref is not None and ref.lossy

    def exact_stage(self) -> AbstractContextManager:
        """Around an exact stage 1 while compression is on: its bytes are counted as ``param_exact``."""
        return LEDGER.tagged(PARAM_EXACT)

    def seed(self, params: list, bundle: torch.Tensor, part: int) -> None:
        """After an exact stage 1 (gather stream): the exact bundle becomes each slotted parameter's reference
        (not inside ``exact_gathers``: training's references stay as they were)."""
        if self.exact_only:
            return
        rows, offset, refs, values = bundle.view(self.nodes, part), 0, [], []
        for p in params:
            size, ref = p.ds_tensor.ds_numel, self.store.get(p)
            if ref is not None and not p.requires_grad:
                self.store.mark_frozen(ref)  # [Note: frozen after build] in compression_reference.py
            elif ref is not None:
                refs.append(ref)
                values.append(rows[:, offset:offset + size])
            offset += size
        self.store.write_many(refs, values, lossy=False)

    @staticmethod
    def messages(packed: torch.Tensor, nodes: int, stride: int, wire: int) -> torch.Tensor:
        """The N peers' messages in the gathered buffer, ``(N, wire)``, in peer order."""
        return packed.view(nodes, stride).narrow(1, 0, wire)

    def start(self, params: list, bundle: torch.Tensor, mine: torch.Tensor, part: int, group: Any, *, lossy: bool,
              async_op: bool, clock: Optional[timeline.PhaseClock] = None) -> "StageOne":
        """Issue stage 1 of ``params`` (one dtype) into ``bundle`` while compression is on: compressed (``lossy``:
        every parameter has a valid reference) or exact (its bytes counted as ``param_exact``, the references seeded
        when it completes). Returns the :class:`StageOne` whose ``wait`` completes it.

        [Note: the compressed stage 1 in flight] On gloo (``async_op``) the encode runs here, at the fetch's issue, and
        the all-gather among the peers is asynchronous; the decode, the reference writes and the drift run in
        ``wait``, which the gather's queue calls before it issues stage 2 (``runtime/sequencer.py``): the host does not
        wait for the slow hop at issue, as for an exact stage 1 ([Note: stage 1 does not block the host]). A
        reference is read at issue and written at completion; nothing reads or writes it in between (its parameter
        is INFLIGHT, and the events that drop references come between steps, when no gather is in flight). With
        streams (``async_op`` false) the all-gather is ordered on the gather stream and ``wait`` follows at once, as
        before. Either way the same ops run on the same operands, so the bits are those of the synchronous stage 1."""
        if not lossy:
            with self.exact_stage():
                work = dist.allgather_fn(bundle, mine, group=group, async_op=async_op)
            return StageOne(self, params, bundle, part, work if async_op else None, clock)
        with timeline.waiting(timeline.Phase.CODEC, clock):
            state = _encode(self, params, bundle, part)
        packed, mine_packed = state.packed, state.mine
        with LEDGER.tagged(PARAM_COMPRESSED):
            if async_op:
                work = dist.allgather_fn(packed, mine_packed, group=group, async_op=True)
            else:
                with timeline.waiting(timeline.fetch_phase()):
                    dist.allgather_fn(packed, mine_packed, group=group, async_op=False)  # ordered on the stream
                work = None
        return StageOne(self, params, bundle, part, work, clock, state=state)

    def collect_drift(self, group: Any) -> None:
        """Collective over ``group`` at the report cadence: the drift over every rank since the last report
        (blocking control reads, as the report's own), then a new interval."""
        top, mean, samples = self.drift.read()
        highest = device.small_to_accel([top], torch.float32)
        sums = device.small_to_accel([mean * samples, float(samples)], torch.float32)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(sums, group=group)
        (top,), (total, count) = device.small_to_host(highest), device.small_to_host(sums)
        self.drift_all_ranks = (top, total / count if count else 0.0)
        self.drift.reset()

    def stats(self, comm: CommCounters) -> dict:
        top, mean, samples = self.drift.read()
        store, c = self.store, self.counters
        out = {
            "param_compression": self.codec.name,
            "param_compressed_gathers": c.compressed_gathers,
            "param_exact_gathers": dict(c.exact_gathers),
            "param_refreshes": c.refreshes,
            "param_reference_slots": len(store.refs),
            "param_references": sum(1 for r in store.refs.values() if r.state is RefState.VALID),
            "param_reference_bytes": store.held_bytes(),
            "param_reference_host_pool_bytes": store.pool_bytes(Placement.HOST),
            "param_reference_device_pool_bytes": store.pool_bytes(Placement.DEVICE),
            "param_drift_max": top, "param_drift_mean": mean, "param_drift_samples": samples,
            "param_drift_max_all_ranks": self.drift_all_ranks[0], "param_drift_mean_all_ranks": self.drift_all_ranks[1],
        }
        for family in (PARAM_COMPRESSED, PARAM_EXACT):
            out[f"{INTER}_{family}_bytes"], out[f"{INTER}_{family}_calls"] = comm.get(family, INTER)
        return out


@dataclass(eq=False)
class StageOne:
    """One stage 1 issued while compression is on ([Note: the compressed stage 1 in flight]): its collective's work
    (``None`` when it completed at issue) and what completing it does (decode, or seed the references)."""

    owner: ParamCompression
    params: list
    bundle: torch.Tensor
    part: int
    work: Any
    clock: Optional[timeline.PhaseClock] = None
    #: The compressed stage 1's message and what its decode needs (``None``: an exact stage 1, which seeds the
    #: references when it completes, not inside ``exact_gathers``).
    state: Optional["Encoded"] = None
    done: bool = False

    def wait(self) -> None:
        """Complete it: the collective, then the decode into the bundle (or the seeding), once."""
        if self.done:
            return
        self.done = True
        if self.work is not None:
            self.work.wait()
        if self.state is not None:
            with timeline.waiting(timeline.Phase.CODEC, self.clock):
                _decode(self.owner, self.params, self.bundle, self.part, self.state)
            self.state = None
        else:
            self.owner.seed(self.params, self.bundle, self.part)

    def discard(self) -> None:
        """Complete the collective only (every peer issued it) and write nothing: an invalidation dropped it."""
        if not self.done:
            self.done, self.state = True, None
            if self.work is not None:
                self.work.wait()


@dataclass(eq=False)
class Encoded:
    """One compressed stage 1 between its encode and its decode: the message buffer and what the decode needs."""

    refs: list
    sizes: list
    valid: list
    pads: list
    offsets: list
    total: int
    #: Each parameter's reference, ``(N, p)`` on the accelerator, read at the encode.
    on_accel: list
    #: The N peers' messages (``N * stride`` bytes) and this rank's (its input to the all-gather).
    packed: torch.Tensor
    mine: torch.Tensor
    stride: int
    wire: int
    #: The exact own partition in fp32, before the reconstruction overwrites it (the drift).
    exact: torch.Tensor


def _encode(pc: ParamCompression, params: list, bundle: torch.Tensor, part: int) -> Encoded:
    """[Note: the vectorised stage 1] A fixed number of whole-bundle ops, whatever the number of parameters: one
    delta (two ``cat`` of per-parameter views, zero views for padding and the elements past a parameter's end),
    one encode, one decode of all N messages, one add writing every reconstruction into the bundle, the drift's
    norms in one ``_foreach_norm``, the references read and written in one batch. Each element is computed by the
    same fp32 op on the same operands as the per-parameter loop was, so the bytes on the wire and every
    reconstruction keep their bits (``tests/test_compress_params.py``). This half: the delta and its message."""
    codec, nodes, me = pc.codec, pc.nodes, pc.peer_index
    refs = [pc.store.get(p) for p in params]
    sizes = [p.ds_tensor.ds_numel for p in params]
    valid = [max(0, min(n, p.ds_numel - pc.dp_index * n)) for p, n in zip(params, sizes)]
    pads = [padded(n, codec.block) for n in sizes]
    offsets = _starts(sizes)
    total = sum(pads)
    rows = bundle.view(nodes, part)
    on_accel = pc.store.on_accel_many(refs)  # (N, p) per parameter
    zero = rows.new_zeros(1)

    def own(pieces: list) -> torch.Tensor:  # fp32: each parameter's valid elements, then zeros to its padded end
        out = device.accel_empty(total, torch.float32)
        return torch.cat([t for piece, n, pad in zip(pieces, valid, pads)
                          for t in (piece.narrow(0, 0, n), zero.expand(pad - n))], out=out)
    delta = own([rows[me].narrow(0, off, n) for off, n in zip(offsets, sizes)])
    delta.sub_(own([r[me] for r in on_accel]))  # past the parameter's end: zero (DeepSpeed leaves it uninitialized)
    wire = codec.wire_numel(total)
    stride = padded(wire, ALIGN)
    packed = device.accel_empty(nodes * stride, torch.uint8)
    mine = packed.narrow(0, me * stride, stride)
    mine.zero_()
    mine.narrow(0, 0, wire).copy_(codec.encode(delta))
    return Encoded(refs, sizes, valid, pads, offsets, total, on_accel, packed, mine, stride, wire,
                   exact=rows[me].to(torch.float32, copy=True))


def _decode(pc: ParamCompression, params: list, bundle: torch.Tensor, part: int, enc: Encoded) -> None:
    """The other half of [Note: the vectorised stage 1]: every message decoded, the reconstructions written into the
    bundle and the references, the drift."""
    nodes, me, sizes, offsets, valid = pc.nodes, pc.peer_index, enc.sizes, enc.offsets, enc.valid
    rows = bundle.view(nodes, part)
    decoded = pc.codec.decode_rows(pc.messages(enc.packed, nodes, enc.stride, enc.wire), enc.total)  # (N, total)
    if enc.pads != sizes:  # drop each parameter's block padding: the bundle's layout
        decoded = torch.cat([decoded.narrow(1, o, n) for o, n in zip(_starts(enc.pads), sizes)], dim=1)
    torch.add(torch.cat(enc.on_accel, dim=1), decoded.narrow(1, 0, part), out=rows)  # fp32 sums, cast to the dtype
    error = rows[me].float() - enc.exact
    errors = _norms([error.narrow(0, off, n) for off, n in zip(offsets, valid)])
    norms = _norms([enc.exact.narrow(0, off, n) for off, n in zip(offsets, valid)])
    pc.store.write_many(enc.refs, [rows[:, off:off + n] for off, n in zip(offsets, sizes)], lossy=True)
    pc.drift.add(torch.stack(errors), torch.stack(norms))
    pc.counters.bump(compressed_gathers=len(params))
