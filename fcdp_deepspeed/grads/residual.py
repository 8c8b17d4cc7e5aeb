"""Error-feedback residuals of the compressed inter-node gradient stage: their slots, placement and commit rule.

[Note: error feedback]
For every parameter chunk block a rank sends across nodes, ``x = node_sum + residual`` is quantized, and what
quantization dropped, ``residual = x - decode(encode(x))`` (the sender decodes its own bytes, as every receiver
does), is added to the next window's ``x`` before it is quantized. Over K steps the decoded sums then add up to
the exact sums minus the last residual instead of drifting by K rounding errors (qgZ has no such feedback and
diverges, DeepSpeed #4886). A residual covers what this rank sends to other nodes: ``(N - 1) x P`` fp32 elements per
parameter (N node peers, ``P = ceil(numel / W)``; its own row is summed exact, [Note: the own row] in ``compressed.py``),
(N - 1)/N of 1/L of the trainable parameters per rank.

[Note: residual commit]
A window's residual becomes the next window's input only if DeepSpeed applies the step. Each covered parameter
has two slots: the *committed* residual and the *pending* one this window writes (the first exchange of a window
reads the committed slot, later ones under per-rank accumulation read and rewrite the pending one). ``commit``
(``FCDPStage3._post_step``: the step was applied) makes the pending slot the committed one by flipping an index,
with no copy; ``discard`` (an overflow-skipped step, ``zero_grad`` outside an applied step) forgets the pending
slot, so the committed residual is left bit for bit as it was. A checkpoint event inside a window (save, 16-bit
consolidation, load) keeps the pending slot, as DeepSpeed keeps the window's partial sums it belongs to: the
window's next exchange reads it, not the committed residual the window already used; a load (or a reset) replaces
only the committed slot. Both slots are needed for
every precision: DeepSpeed 0.19.8 skips a step whenever the global gradient norm is not finite
(``is_invalid_grad_norm`` in ``step()``), also in fp32 and bf16, and such a window's residual is NaN.

[Note: residuals and the loss scale] Under fp16 dynamic loss scaling gradients (and so residuals) are in scaled
units. A residual records the loss scale it was written at; the first read of a window multiplies it by
``current / recorded`` (powers of two: exact), so a scale change (e.g. halved after an overflow) does not feed a
residual of the wrong size into the next sum.

Placement follows the node buffer's rules (``grad_buffer_device``, ``grad_buffer_budget``): pinned host memory by
default, never read by the host on the hot path: a host slot is copied to the accelerator asynchronously, the
add runs there and the new residual is copied back asynchronously on the same (reduce) stream, so the next read
is ordered after it ([Note: host buffer, device add] in ``grads/buffer.py``); an event recorded after the writes
is what checkpoint save/load wait on before the host touches the slots.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger

from fcdp_deepspeed import faults
from fcdp_deepspeed.grads.buffer import BufferPlanner, fitting_prefix
from fcdp_deepspeed.grads.layout import ReduceLayout, chunk_numel
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting.stats import fmt_bytes
from fcdp_deepspeed.storage import memory

#: Bytes per residual element (fp32) and slots per parameter (committed + pending).
ELEMENT_BYTES = 4
SLOTS = 2


#: [Note: batched residual reads] The compressed exchange reads the residuals of a whole bucket (or flush batch) at
#: once: a host store copies the span of the bucket's slots to the accelerator in one copy per slot index when they are
#: dense in the flat (buckets hold neighbouring parameters; at most twice the bytes they need), else one copy per
#: parameter. Each parameter's values are those :meth:`ResidualStore.read` returns, loss-scale rescale included.
#: [Note: residual copies] Host residual slots cross PCIe on FCDP's own stream, as the node gradient buffer's round
#: trip does (grads/buffer.py), not on DeepSpeed's reduce stream, whose reduce-scatters would queue behind them. A
#: write waits for an event after the value (reduce stream); a read's device copy is waited for by the reduce
#: stream through an event and ``record_stream``-ed there. Reads and writes of one slot stay in order on the one
#: residual stream; host readers (checkpoints) wait on ``written``, recorded there.
STREAM = "grad_residual"


def _host_to_accel(slot: torch.Tensor) -> torch.Tensor:
    """``slot`` (pinned host) on the accelerator for the current (reduce) stream, copied on the residual stream."""
    with device.stream(device.side_stream(STREAM)):
        residual = device.to_accel(slot)
        copied = device.record_event()
    device.wait_event(copied)
    device.record_stream(residual)  # allocated on the residual stream, read on this one
    return residual


@dataclass
class ResidualStore:
    """One rank's error-feedback residuals: two fp32 slots per covered parameter (see [Note: residual commit])."""

    flats: tuple[Optional[torch.Tensor], ...] = (None, None)
    offsets: dict[int, tuple[int, int]] = field(default_factory=dict)  # ds_id -> (offset, numel)
    device: str = "host"
    committed: dict[int, int] = field(default_factory=dict)  # ds_id -> index of the committed slot (default 0)
    scales: dict[int, float] = field(default_factory=dict)  # ds_id -> loss scale of its committed residual
    pending: dict[int, float] = field(default_factory=dict)  # ds_id -> loss scale of this window's residual
    written: Any = None  # event after the last write of a host slot (checkpoint readers wait on it)
    retired: list = field(default_factory=list)  # host allocations emptied by the move, with the copy's event
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def covers(self, ds_id: int) -> bool:
        return ds_id in self.offsets

    def _slot(self, ds_id: int, index: int) -> torch.Tensor:
        offset, numel = self.offsets[ds_id]
        return self.flats[index].narrow(0, offset, numel)

    def read(self, ds_id: int, shape: tuple[int, int], loss_scale: float) -> Optional[torch.Tensor]:
        """The residual to add to this window's sum, on the accelerator (``None``: zero, nothing written yet)."""
        return self.read_many([ds_id], [shape], loss_scale)[0]

    def read_many(self, ds_ids: Sequence[int], shapes: Sequence[tuple[int, int]],
                  loss_scale: float) -> list[Optional[torch.Tensor]]:
        """The residuals to add to this window's sums of ``ds_ids``, on the accelerator (``None``: zero, nothing written
        yet): each as :meth:`read` returns it, read in one go ([Note: batched residual reads])."""
        with self._lock:
            where = []
            for ds_id in ds_ids:
                first = ds_id not in self.pending
                recorded = self.scales.get(ds_id) if first else self.pending[ds_id]
                where.append((recorded, self.committed.get(ds_id, 0) ^ (0 if first else 1)))
        out: list[Optional[torch.Tensor]] = [None] * len(ds_ids)
        for index in (0, 1):
            mine = [i for i, (recorded, slot) in enumerate(where) if recorded is not None and slot == index]
            if not mine:
                continue
            spans = [self.offsets[ds_ids[i]] for i in mine]
            low, high = min(o for o, _ in spans), max(o + n for o, n in spans)
            source, base = self.flats[index], 0
            if self.device == "host" and high - low <= 2 * sum(n for _, n in spans):
                source, base = _host_to_accel(source.narrow(0, low, high - low)), low  # one copy for the bucket
            elif self.device == "host":
                source = None  # scattered slots: one copy each, as read() does
            for i, (offset, numel) in zip(mine, spans):
                slot = (_host_to_accel(self.flats[index].narrow(0, offset, numel)) if source is None
                        else source.narrow(0, offset - base, numel))
                recorded = where[i][0]
                residual = slot.view(shapes[i])
                out[i] = residual * (loss_scale / recorded) if loss_scale != recorded else residual
        return out

    def write(self, ds_id: int, value: torch.Tensor, loss_scale: float) -> None:
        """This window's new residual (accelerator ``value``) into the pending slot."""
        self.write_many([ds_id], [value], loss_scale)

    def write_many(self, ds_ids: Sequence[int], values: Sequence[torch.Tensor], loss_scale: float) -> None:
        """This window's new residuals (accelerator ``values``) into their pending slots (then :meth:`writes_done`): one
        event and one stream switch for all of them, one ``_foreach_copy_`` where the slots are accelerator memory."""
        with self._lock:
            indices = [self.committed.get(ds_id, 0) ^ 1 for ds_id in ds_ids]
            for ds_id in ds_ids:
                self.pending[ds_id] = loss_scale
        slots = [self._slot(ds_id, index).view(v.shape) for ds_id, index, v in zip(ds_ids, indices, values)]
        if self.device == "host":
            produced = device.record_event()  # on the reduce stream: the values exist
            with device.stream(device.side_stream(STREAM)):  # [Note: residual copies]
                device.wait_event(produced)
                for slot, value in zip(slots, values):
                    device.to_host(value, out=slot)  # the door record_streams ``value`` on this stream
        elif len(slots) > 1 and hasattr(torch, "_foreach_copy_"):  # torch >= 2.1
            torch._foreach_copy_(slots, list(values))
        else:
            for slot, value in zip(slots, values):
                slot.copy_(value)

    def writes_done(self) -> None:
        if self.device == "host":
            with device.stream(device.side_stream(STREAM)):
                self.written = device.record_event()

    def commit(self) -> int:
        """The step was applied: pending residuals become the committed ones (an index flip). Returns how many."""
        with self._lock:
            for ds_id, scale in self.pending.items():
                self.committed[ds_id] = self.committed.get(ds_id, 0) ^ 1
                self.scales[ds_id] = scale
            count, self.pending = len(self.pending), {}
        return count

    def discard(self) -> bool:
        """Forget this window's residuals; the committed ones stay as they were. Whether any was pending."""
        with self._lock:
            dropped, self.pending = bool(self.pending), {}
        return dropped

    # -- checkpoints (host reads: not on the hot path) ---------------------------------------------------------
    def snapshot(self) -> tuple[Optional[torch.Tensor], list[Optional[float]]]:
        """The committed residuals, concatenated in ds_id order (``None`` when nothing was written yet), and
        their loss scales. Host slots are read after the last write's event."""
        ids = sorted(self.offsets)
        if not ids or not self.scales:
            return None, [None] * len(ids)
        device.host_wait(self.written)
        parts = [self._slot(i, self.committed.get(i, 0)) for i in ids]
        return torch.cat(parts).clone(), [self.scales.get(i) for i in ids]

    def restore(self, flat: Optional[torch.Tensor], scales: Sequence[Optional[float]]) -> None:
        """Set the committed residuals (``None``: zero); a window's pending ones stay ([Note: residual commit])."""
        device.host_wait(self.written)
        ids = sorted(self.offsets)
        with self._lock:
            self.scales = {}
        offset = 0
        for ds_id, scale in zip(ids, scales):
            numel = self.offsets[ds_id][1]
            slot = self._slot(ds_id, self.committed.get(ds_id, 0))
            if flat is None or scale is None:
                slot.zero_()
            else:
                slot.copy_(flat.narrow(0, offset, numel))  # checkpoint load: the host waits anyway
                self.scales[ds_id] = float(scale)
            offset += numel
        self.writes_done()

    @property
    def nbytes(self) -> int:
        return sum(0 if f is None else f.numel() * f.element_size() for f in self.flats)


def move_residuals(store: ResidualStore, budget: int) -> int:
    """``grad_buffer_device: device``, at the measured step ([Note: the device buffer comes from a measured step] in
    ``grads/buffer.py``): both slots to the accelerator when they fit ``budget`` (one allocation, as planned), the
    values copied on the current stream after the last write's event; the host allocation is dropped once that copy
    completed (:func:`reap_residuals`). Returns the bytes moved."""
    host = store.flats[0]
    if store.device != "host" or host is None or host._base is None or store.nbytes > budget:
        return 0
    base = host._base
    try:
        faults.maybe_fail("alloc_residual_device")
        moved = device.accel_empty(base.numel(), torch.float32)
    except (RuntimeError, MemoryError, faults.InjectedFault):
        return 0
    device.wait_event(store.written)  # the residual stream's last copies into the host slots
    device.to_accel(base, out=moved)
    total = host.numel()
    with store._lock:
        store.flats, store.device, store.written = (moved.narrow(0, 0, total), moved.narrow(0, total, total)), "device", None
        store.retired.append((base, device.record_event()))
    reap_residuals(store)
    return moved.numel() * moved.element_size()


def reap_residuals(store: ResidualStore) -> None:
    """Drop the host allocation the move emptied once its copy completed (non-blocking)."""
    done, store.retired = device.split_done(store.retired)
    if done:
        for t in done:
            device.drop_host(t)
        del t, done


def plan_residuals(params: Sequence[torch.nn.Parameter], layout: ReduceLayout, planner: BufferPlanner,
                   reserved_bytes: int, pin: bool) -> tuple[ResidualStore, int]:
    """Collective over the DP group: slots for a prefix (ds_id order) of ``params`` whose residuals fit what the
    gradient budget leaves after ``reserved_bytes`` (the node buffer's need), agreed over every rank; one
    allocation holds both slots. Returns the store and the residual bytes of the parameters left out (their
    gradients cross nodes exact, one warning)."""
    params = sorted(params, key=lambda p: p.ds_id)
    numels = [(layout.nodes - 1) * chunk_numel(p.ds_numel, layout.dp_size) for p in params]  # the sent rows
    on_device = planner.on_device()  # grad_buffer_device: device starts on the host, as the node buffer does
    # one allocation: a pinned one costs its power-of-two rounding (the node buffer's chunks do not, grads/buffer.py)
    budget = memory.pinned_capacity(max(0, planner.budget_bytes(on_device) - reserved_bytes),
                                    pin and not on_device and device.pins_host_memory())
    fits = planner.agree_min(fitting_prefix([SLOTS * n * ELEMENT_BYTES for n in numels], budget))
    total = sum(numels[:fits])
    flat = _allocate(SLOTS * total, on_device, pin) if fits else None
    if fits and planner.agree_min(1 if flat is not None else 0) == 0:
        flat, fits, total = None, 0, 0
    store = ResidualStore(device="device" if on_device else "host")
    if flat is not None:
        store.flats = (flat.narrow(0, 0, total), flat.narrow(0, total, total))
        offset = 0
        for p, numel in zip(params[:fits], numels):
            store.offsets[p.ds_id] = (offset, numel)
            offset += numel
    left_out = sum(numels[fits:]) * SLOTS * ELEMENT_BYTES
    if fits < len(params) and dist.get_rank() == 0:
        logger.warning(f"fcdp: grad_compression error-feedback residuals need {fmt_bytes(sum(numels) * SLOTS * 4)} "
                       f"per rank but {fmt_bytes(budget)} of fcdp.grad_buffer_budget is left (or allocation failed); "
                       f"{len(params) - fits} of {len(params)} trainable parameters cross nodes exact instead. Raise "
                       f"fcdp.grad_buffer_budget to compress them.")
    return store, left_out


def _allocate(numel: int, on_device: bool, pin: bool) -> Optional[torch.Tensor]:
    try:
        faults.maybe_fail(f"alloc_residual_{'device' if on_device else 'host'}")
        alloc = device.accel_empty if on_device else device.pin_empty if pin else device.host_empty
        return alloc(numel, torch.float32).zero_()
    except (RuntimeError, MemoryError, faults.InjectedFault):
        return None
