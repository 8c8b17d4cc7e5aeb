"""The compressed inter-node gradient stage (``fcdp.grad_compression``): quantized rows with error feedback.

[Note: the compressed exchange]
Stage 2 of the hierarchical reduce-scatter hands each rank the ``(N, S)`` fp32 node sums of a bucket's (or a
flush batch's) parameters, row q destined for node peer q (``grads/layout.py``, [Note: the two-stage
reduction]); they are already divided by the DP size W, where DeepSpeed pre-divides (before the node stage).
Here each row becomes ``x = node_sum + residual`` (fp32: an fp16 window sum is encoded from fp32, never cast),
is encoded blockwise (``encode_rows``: fixed-size uint8 rows, blocks never span rows; a row's blocks run over
the bucket's parameters in order), and the N rows go out in one ``all_to_all_single`` over the peer group, on
gloo and NCCL alike: there is no quantized reduce-scatter, so every receiver decodes the N rows it got and sums
them in fp32 in group-rank order, as the exact gloo path does, except its own row, which never leaves it and is
summed exact ([Note: the own row]). The sum is the partition, final: nothing divides
it again (qgZ in DeepSpeed 0.19.8 divides its decoded sum by the node count on one path while its fallback is
divided by the world size, a factor a compressed path hides; ``tests/test_compress_grads.py`` catches either).
The sender decodes its own bytes to form the residual ([Note: error feedback] in ``residual.py``). Everything
runs with torch ops on the reduce stream: no host read, no host wait. Parameters without a residual slot (over
budget) take the exact stage in the same call.

[Note: the own row] Row ``me`` (this rank's index among its node peers) is this rank's own node sum for its own
partition: the all-to-all hands it back to this rank. Quantizing it would only add error (about a quarter of the
per-step error at 2 nodes, measured in docs/compression.md), so the decoded row is replaced by the exact one and it
has no residual: residuals hold the ``N - 1`` sent rows (``grads/residual.py``), 1/N less memory. The identity
codec's guard is unchanged (identity decodes the exact row anyway); every rank applies the same rule to its own row.

[Note: residuals and clipping] A residual is in the units of the pre-clip gradient sum. Under
``gradient_clipping`` the step applies ``coef * sum`` with ``coef = 1 / max(1, (norm + 1e-6) / clip)``, DeepSpeed's
own coefficient (``unscale_and_clip_grads``) from the global norm every rank shares; after a spike an unscaled
residual (what the spike's quantization lost) would dominate the next steps. ``commit(clip=coef)`` keeps the
coefficient (a device tensor, no host read) for each residual that step committed (a parameter not exchanged in a
later window keeps its own step's), and the next window's first read of a committed residual is multiplied by it,
so the residual enters in the units it would have been applied in; a checkpoint saves the scaled residual (format
2). Every rank multiplies by the same value, so replicas stay bitwise equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.compress.quant import Codec, codec_for, ready
from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.grads.inflight import Inflight
from fcdp_deepspeed.grads.layout import ReduceLayout
from fcdp_deepspeed.grads.plan import GradPlan, check_grad_compression
from fcdp_deepspeed.grads.reducer import GradReducer
from fcdp_deepspeed.grads.residual import ResidualStore, plan_residuals
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import EventCounters, fmt_bytes, received_bytes

#: Checkpoint format of the "grads" part: 2 = residuals of the N - 1 sent rows, clip coefficient applied.
FORMAT = 2

#: Test hook: a codec used instead of the configured one (``IdentityCodec`` guards the exchange's scale,
#: divide factor and row/block order). Never a config value; set it before ``deepspeed.initialize``.
TEST_CODEC: Optional[Codec] = None


@dataclass
class CompressionCounters(EventCounters):
    exchanges: int = 0
    """Compressed inter-node collectives."""
    compressed_bytes: int = 0
    """Bytes this rank received in them (the ledger's model: (N-1)/N of the packed rows); the rest of the engine's
    ``inter_node_grad_reduce_bytes`` crossed exact (``grad_exact_inter_node_bytes``, ``engine_stats.py``)."""
    restores: int = 0
    """Overflow-skipped steps that left the committed residual as it was (a pending one was dropped)."""
    discards: int = 0
    """Pending residuals dropped by ``zero_grad`` outside an applied step or by a checkpoint event."""
    zeroed_loads: int = 0
    """Checkpoint loads that started from zero residuals (none saved for this setting)."""


class GradCompressor:
    """One engine's compressed inter-node stage and its residuals (built by :func:`attach_compressor`)."""

    def __init__(self, codec: Codec, layout: ReduceLayout, peer_group: Any, store: ResidualStore,
                 accumulation_dtype: torch.dtype, loss_scale: Callable[[], float], left_out_bytes: int = 0) -> None:
        self.codec, self.layout, self.peer_group, self.store = codec, layout, peer_group, store
        self.accumulation_dtype = accumulation_dtype
        self.loss_scale = loss_scale
        self.left_out_bytes = left_out_bytes
        #: This rank's row (its index among its node peers): summed exact, no residual ([Note: the own row]).
        self.me = layout.peer_ranks.index(dist.get_rank())
        #: ds_id -> the clip coefficient of the step that committed its residual (absent: 1), see [Note: residuals
        #: and clipping].
        self.clips: dict[int, torch.Tensor] = {}
        self.counters = CompressionCounters()
        self._window_sq: Optional[torch.Tensor] = None  # [sum r^2, sum x^2] of this window's exchanges (device)
        self._step_sq: Optional[torch.Tensor] = None  # the same for the last applied step

    def inter_node(self, node_sums: Sequence[torch.Tensor], ds_ids: Sequence[int],
                   exact: Callable[[list], Inflight]) -> Inflight:
        """Stage 2 for several parameters, issued: compressed where a residual slot exists, ``exact`` for the rest."""
        mine = [i for i, d in enumerate(ds_ids) if self.store.covers(d)]
        if len(mine) == len(ds_ids):
            return self.exchange(node_sums, ds_ids)
        rest = sorted(set(range(len(ds_ids))) - set(mine))
        pieces = [(mine, self.exchange([node_sums[i] for i in mine], [ds_ids[i] for i in mine]))] if mine else []
        return Inflight.merged(len(ds_ids), pieces + [(rest, exact([node_sums[i] for i in rest]))])

    def exchange(self, node_sums: Sequence[torch.Tensor], ds_ids: Sequence[int]) -> Inflight:
        """See [Note: the compressed exchange]: ``(N, P_i)`` node sums -> this rank's ``P_i`` partitions, at completion.
        Encode (and the residual write) at issue, decode at completion ([Note: the inter-node stage runs behind the
        backward] in ``grads/inflight.py``); both timed as the codec's phase, the all-to-all as the inter-node stage
        (``timeline.py``)."""
        with timeline.waiting(timeline.Phase.CODEC):
            return self._exchange(node_sums, ds_ids)

    def _exchange(self, node_sums: Sequence[torch.Tensor], ds_ids: Sequence[int]) -> Inflight:
        sizes = [t.shape[1] for t in node_sums]
        x = torch.cat([t.to(torch.float32) for t in node_sums], dim=1)
        scale, me, exact_own = self.loss_scale(), self.me, self.own_row_exact()
        add_residuals(x, me, self.store.read_many, self._clips(ds_ids), ds_ids, sizes, scale)
        packed, sent = encode_sent(self.codec, x, me, exact_own)
        self._accumulate(sent, x.square().sum() - x[me].square().sum())
        self.store.write_many(ds_ids, sent.split(sizes, dim=1), scale)
        self.store.writes_done()
        recv = torch.empty_like(packed)
        with timeline.waiting(timeline.Phase.GRAD_INTER_NODE):
            work = dist.all_to_all_single(recv, packed, group=self.peer_group, async_op=True)
        self.counters.bump(exchanges=1, compressed_bytes=received_bytes(
            "all_to_all_single", {"input": packed}, self.layout.nodes, 0))
        return Inflight([work], lambda: self._decode(recv, x, sizes, exact_own), (packed, recv))

    def _decode(self, recv: torch.Tensor, x: torch.Tensor, sizes: Sequence[int], exact_own: bool) -> list[torch.Tensor]:
        """The completed exchange's partitions: every received row decoded and summed (the own row exact)."""
        with timeline.waiting(timeline.Phase.CODEC):
            total = decode_sum(self.codec, recv, x, self.me, exact_own)
            return list(total.to(self.accumulation_dtype).split(sizes))

    def own_row_exact(self) -> bool:
        """Whether row ``me`` is summed exact and left out of the residuals ([Note: the own row]): always; every rank
        applies the same rule to its own row."""
        return True

    def _clips(self, ds_ids: Sequence[int]) -> list[Optional[torch.Tensor]]:
        """The clip coefficient each parameter's residual is read with: that of the step that committed it, for the
        first read of a window (a pending residual is already in this window's units), ``None`` for 1."""
        return [None if d in self.store.pending else self.clips.get(d) for d in ds_ids]

    def _accumulate(self, left: torch.Tensor, quantized_sq: torch.Tensor) -> None:
        sq = torch.stack([left.square().sum(), quantized_sq])
        self._window_sq = sq if self._window_sq is None else self._window_sq + sq

    # -- the step (called by FCDPStage3, see [Note: residual commit]) ---------------------------------------
    def commit(self, clip: Optional[torch.Tensor] = None) -> None:
        """The step was applied; ``clip``: its clip coefficient ([Note: residuals and clipping])."""
        ids = list(self.store.pending)
        if self.store.commit():
            self._step_sq, self._window_sq = self._window_sq, None
            for ds_id in ids:
                if clip is None:
                    self.clips.pop(ds_id, None)
                else:
                    self.clips[ds_id] = clip

    def discard(self, skipped: bool) -> None:
        self._window_sq = None
        if self.store.discard():
            self.counters.bump(restores=1) if skipped else self.counters.bump(discards=1)

    # -- checkpoints (the "grads" part of the fcdp_compression envelope) ------------------------------------
    def fingerprint(self) -> dict:
        """What a saved residual must match to be loaded: codec, block, the rank's layout and its slots (elements per
        covered parameter in ds_id order: ds_ids count across the engines of a process, their order does not)."""
        lay = self.layout
        return {"codec": self.codec.name, "block": self.codec.block, "dp_size": lay.dp_size, "dp_rank": lay.dp_rank,
                "node_ranks": list(lay.node_ranks), "peer_ranks": list(lay.peer_ranks),
                "slots": [self.store.offsets[d][1] for d in sorted(self.store.offsets)]}

    def save(self) -> dict:
        flat, scales = self.store.snapshot()
        if flat is not None and self.clips:  # what the next window would read ([Note: residuals and clipping])
            offset = 0  # the snapshot is a fresh tensor
            for ds_id in sorted(self.store.offsets):  # the snapshot's order
                numel = self.store.offsets[ds_id][1]
                if ds_id in self.clips:
                    value = device.small_to_host(self.clips[ds_id].reshape(1))[0]
                    flat.narrow(0, offset, numel).mul_(torch.tensor(value, dtype=flat.dtype))
                offset += numel
        return {"format": FORMAT, "fingerprint": self.fingerprint(), "residual": flat, "scales": scales}

    def load(self, part: Optional[dict]) -> None:
        if part is not None and part.get("format") == FORMAT and part.get("fingerprint") == self.fingerprint():
            self.clips = {}
            return self.store.restore(part["residual"], part["scales"])
        why = "was written without grad_compression" if part is None else "holds residuals of another setting"
        self._zero(f"the checkpoint {why} (codec, block, layout or budget)")

    def reset(self, why: str) -> None:
        """Weights rewritten without an optimizer state (``why``): the committed residuals (and their clip
        coefficients) start from zero (a window's pending ones stay, [Note: residual commit])."""
        self._zero(f"{why} without the optimizer state")

    def _zero(self, why: str) -> None:
        self.clips = {}
        self.store.restore(None, [])
        self.counters.bump(zeroed_loads=1)
        if dist.get_rank() == 0:
            from deepspeed.utils import logger
            logger.info(f"fcdp: {why}: error-feedback residuals start from zero")

    def stats(self) -> dict:
        return compressor_stats(self)


# -- [Note: the vectorised exchange] ----------------------------------------------------------------------------
# One residual read, one encode and one decode per side for a whole bucket (or flush batch), whatever its number of
# parameters. The own row is neither encoded nor decoded ([Note: the own row]: the bytes a rank sends itself never
# cross a link and their decode was replaced by ``x[me]``): its packed row is zeros. Every value that reaches a link,
# a residual or a gradient is bit for bit what the per-parameter form computed (``tests/test_compress_grads.py``:
# the identity guard, and the in-process comparison with ``tests/codec_reference.py``).
def others(t: torch.Tensor, me: int) -> torch.Tensor:
    """``t`` without row ``me`` (a view when ``me`` is the first or last row)."""
    return t[1:] if me == 0 else t[:me] if me == t.shape[0] - 1 else torch.cat([t[:me], t[me + 1:]])


def add_residuals(x: torch.Tensor, me: int, read: Callable, clips: Sequence[Optional[torch.Tensor]],
                  ds_ids: Sequence[int], sizes: Sequence[int], scale: float) -> None:
    """``x``'s sent rows (every row but ``me``) plus each parameter's residual (``read``: the store's
    ``read_many``), times its clip coefficient where one is given ([Note: residuals and clipping]): one add per row
    range. A parameter without a residual adds ``-0.0``, which leaves every value and its sign as it was."""
    sent = x.shape[0] - 1
    residuals = read(ds_ids, [(sent, p) for p in sizes], scale)
    if not sent or all(r is None for r in residuals):
        return
    neutral = x.new_full((1, 1), -0.0)
    r = torch.cat([neutral.expand(sent, p) if res is None else res for res, p in zip(residuals, sizes)], dim=1)
    clips = [c if res is not None else None for c, res in zip(clips, residuals)]
    if any(c is not None for c in clips):
        one = x.new_ones(1)
        r.mul_(torch.cat([(one if c is None else c.reshape(1)).expand(p) for c, p in zip(clips, sizes)]))
    x[:me].add_(r[:me])
    x[me + 1:].add_(r[me:])


def encode_sent(codec: Codec, x: torch.Tensor, me: int, exact_own: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, sent)``: the ``(N, wire)`` rows of the all-to-all and the residual of the ``N - 1`` sent rows,
    ``x - decode(encode(x))`` (the sender decodes its own bytes; not in place: a codec's packed rows may alias its
    input, ``IdentityCodec``)."""
    n = x.shape[1]
    if not exact_own:  # the own row quantized like the others
        packed = codec.encode_rows(x)
        return packed, others(x - codec.decode_rows(packed, n), me)
    rows = others(x, me)
    encoded = codec.encode_rows(rows)
    packed = encoded.new_empty(x.shape[0], encoded.shape[1])
    packed[me].zero_()
    packed[:me].copy_(encoded[:me])
    packed[me + 1:].copy_(encoded[me:])
    return packed, rows - codec.decode_rows(encoded, n)


def decode_sum(codec: Codec, recv: torch.Tensor, x: torch.Tensor, me: int, exact_own: bool) -> torch.Tensor:
    """The received rows decoded and summed in fp32 in group-rank order (as the exact gloo path sums), the own row
    exact (``x[me]``: what this rank sent itself, residual-free)."""
    n = x.shape[1]
    if not exact_own:
        rows = list(codec.decode_rows(recv, n))
    else:
        decoded = codec.decode_rows(others(recv, me), n)
        rows = [*decoded[:me], x[me], *decoded[me:]]
    total = rows[0].clone()
    for row in rows[1:]:  # fixed order
        total.add_(row)
    return total


def compressor_stats(compressor: "GradCompressor") -> dict:
    """The ``grad_*`` keys of ``get_stats`` for one engine's compressor."""
    c, store = compressor.counters, compressor.store
    r2, x2 = device.small_to_host(compressor._step_sq) if compressor._step_sq is not None else (0.0, 0.0)
    return {
        "grad_compression": compressor.codec.name,
        "grad_compressed_inter_node_bytes": c.compressed_bytes, "grad_compressed_exchanges": c.exchanges,
        "grad_residual_host_bytes": store.nbytes if store.device == "host" else 0,
        "grad_residual_device_bytes": store.nbytes if store.device == "device" else 0,
        "grad_residual_params": len(store.offsets),
        "grad_residual_left_out_bytes": compressor.left_out_bytes,
        "grad_residual_norm": r2 ** 0.5,
        "grad_quantized_norm": x2 ** 0.5,
        "grad_residual_rel_norm": (r2 / x2) ** 0.5 if x2 > 0 else 0.0,
        "grad_residual_restores": c.restores, "grad_residual_discards": c.discards,
        "grad_residual_zeroed_loads": c.zeroed_loads,
    }


def clip_coefficient(norm: Any, clip_grad: float) -> Optional[torch.Tensor]:
    """``1 / max(1, (norm + 1e-6) / clip_grad)``, the factor DeepSpeed 0.19.8's ``unscale_and_clip_grads`` applies
    beyond the loss scale (``norm``: the unscaled global norm, ``_global_grad_norm``), as a tensor on the norm's
    device; ``None`` without clipping or without a norm tensor."""
    if not clip_grad > 0 or not isinstance(norm, torch.Tensor):
        return None
    return torch.clamp((norm.float() + 1e-6) / clip_grad, min=1.0).reciprocal()


def attach_compressor(config: FCDPConfig, plan: GradPlan, reducer: Optional[GradReducer],
                      trainable: Sequence[torch.nn.Parameter], communication_dtype: torch.dtype,
                      loss_scale: Callable[[], float]) -> Optional[GradCompressor]:
    """Collective over the DP group (the residual budget is agreed): give ``reducer`` the compressed inter-node
    stage when ``fcdp.grad_compression`` asks for one. Refuses (:class:`FCDPConfigError`, by name) a plan
    without the hierarchical reduce and unsupported dtypes (:func:`~fcdp_deepspeed.grads.plan.check_grad_compression`)."""
    if config.grad_compression == "off":
        return None
    accumulation_dtype = reducer.accumulation_dtype if reducer is not None else torch.float32
    check_grad_compression(config.grad_compression, plan, communication_dtype, accumulation_dtype)
    assert reducer is not None  # an active plan has a reducer
    codec = TEST_CODEC if TEST_CODEC is not None else ready(
        codec_for(config.grad_compression, config.compression_block, side="grads"), device.accel_device())
    planner = reducer.planner
    # the node buffer may be allocated later (accumulation steps set after initialize): its need comes first
    reserved = sum(planner.sizes(trainable)[1]) * accumulation_dtype.itemsize if plan.grad_accumulation == "node" else 0
    store, left_out = plan_residuals(trainable, reducer.layout, planner, reserved, config.pin_memory)
    reducer.comm.compressor = GradCompressor(codec, reducer.layout, reducer.comm.peer_group, store,
                                             accumulation_dtype, loss_scale, left_out)
    if dist.get_rank() == 0:
        from deepspeed.utils import logger
        logger.info(f"fcdp: grad_compression {codec.name} (block {codec.block}) on the inter-node gradient stage, "
                    f"error-feedback residuals {fmt_bytes(store.nbytes)}/rank {store.device}")
    return reducer.comm.compressor


@dataclass(eq=False)
class GradState:
    """The ``"grads"`` part of the ``fcdp_compression`` envelope (``compress/state.StatePart``): this rank's
    error-feedback residuals, restored only into the same codec, block, layout and budget."""

    compressor: GradCompressor

    def state(self) -> dict:
        return self.compressor.save()

    def load_state(self, saved: Optional[Mapping[str, Any]]) -> None:
        self.compressor.load(dict(saved) if saved is not None else None)

    def reset(self, why: str) -> None:
        self.compressor.reset(why)
