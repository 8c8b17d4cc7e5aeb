"""The node gradient-accumulation buffer: its slots, and how it is sized against the budget and allocated.

[Note: node accumulation]
With ``grad_accumulation: node``, a micro-step that is not the accumulation boundary runs stage 1 only
and adds the result into :class:`NodeGradBuffer` (N*P fp32 elements per trainable parameter: 1/L of
the trainable parameters per rank). At the boundary, each bucket adds its stage-1 result to the buffer
and runs stage 2 once; parameters that got no gradient in the boundary micro-step are flushed at the
end of that backward (``FCDPStage3.independent_gradient_partition_epilogue``). DeepSpeed's partitions
receive a parameter's window sum once (copy), or in parts when reentrant checkpointing splits the
backward (add), see :meth:`~fcdp_deepspeed.grads.delivery.DeliveryLedger.split`. Inter-node gradient bytes
per optimizer step no longer grow with the number of micro-steps. The buffer is empty at every step
boundary, so an overflow-skipped step discards nothing that was not already handed to DeepSpeed
(``zero_grad`` also drops a partly filled window, as DeepSpeed's ``micro_step_id = 0`` does).

[Note: a checkpoint inside a window]
``save_checkpoint``, the 16-bit consolidation (``_zero3_consolidated_16bit_state_dict``, HF's ``save_model``)
and ``load_checkpoint`` may run between micro-steps. DeepSpeed 0.19.8 keeps the window's partial sums in its
gradient partitions through all three (``checkpoint_event_epilogue`` only invalidates secondary tensors and
re-gathers persistent parameters; no load path touches the gradient partitions or ``micro_step_id``), so the
window's remaining micro-steps add to them and the step applies the whole window (after a load: to the loaded
weights). FCDP keeps its part of the window likewise: the node buffer's partial sums, the delivery ledger
(a parameter delivered earlier in the window is added to, not overwritten) and the pending error-feedback
residuals ([Note: residual commit] in ``grads/residual.py``). A saved checkpoint holds no partial window
sums, in DeepSpeed as here. Readers of DeepSpeed's gradient partitions *between* micro-steps
(``safe_get_local_grad`` before the boundary) see nothing of the window so far under node accumulation; at
the boundary they see the full sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from fcdp_deepspeed import faults
from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.grads.layout import ReduceLayout, chunk_numel
from fcdp_deepspeed.grads.plan import BufferFit
from fcdp_deepspeed.machine import device
from fcdp_deepspeed.reporting.stats import fmt_bytes
from fcdp_deepspeed.storage import memory


@dataclass
class NodeGradBuffer:
    """The node-shard accumulation buffer of one rank: N*P fp32 elements per buffered parameter.

    ``dirty`` holds the ds_ids with a partial window sum; every rank of the DP group reduces the same
    parameters in the same micro-steps, so the set is identical on all of them.
    """

    chunks: list[torch.Tensor] = field(default_factory=list)
    """The buffer's allocations ([Note: buffer chunks])."""
    offsets: dict[int, tuple[int, int]] = field(default_factory=dict)  # ds_id -> (offset in its chunk, numel)
    chunk_of: dict[int, int] = field(default_factory=dict)  # ds_id -> index into ``chunks``
    dirty: set[int] = field(default_factory=set)
    placements: list[str] = field(default_factory=list)
    """Where each chunk lives, ``"host"`` or ``"device"`` ([Note: the device buffer comes from a measured step])."""
    #: Event after the last round trip of host slots on the buffer's stream (``None``: none, or no streams).
    done: Any = None
    #: Host chunks emptied by the move to the accelerator, each with the event after the last copy into it.
    retired: list[tuple[torch.Tensor, Any]] = field(default_factory=list)

    @property
    def flat(self) -> Optional[torch.Tensor]:
        """The first chunk (``None``: no buffer): where the buffer lives and whether it is pinned."""
        return self.chunks[0] if self.chunks else None

    @property
    def device(self) -> str:
        """``"device"`` when every chunk is accelerator memory, else ``"host"`` (for messages; see the byte counts)."""
        return "device" if self.placements and all(p == "device" for p in self.placements) else "host"

    def placed_bytes(self, placement: str) -> int:
        """Bytes of the chunks placed there (``"host"``: retired chunks not yet dropped included)."""
        held = sum(c.numel() * c.element_size() for c, p in zip(self.chunks, self.placements) if p == placement)
        return held + (sum(c.numel() * c.element_size() for c, _ in self.retired) if placement == "host" else 0)

    def _on_device(self, ds_id: int) -> bool:
        return self.placements[self.chunk_of[ds_id]] == "device"

    def slot(self, ds_id: int) -> Optional[torch.Tensor]:
        where = self.offsets.get(ds_id)
        return None if where is None or not self.chunks else self.chunks[self.chunk_of[ds_id]].narrow(0, *where)

    def accumulate(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Add each ``(ds_id, cols)`` (accelerator, accumulation dtype) into its slot; a clean slot is overwritten.

        [Note: host buffer round trip] A host slot is never read by the host: its partial sum is copied to the
        accelerator, the add runs there and the sum is copied back, all on FCDP's own stream
        (``device.side_stream("grad_buffer")``). The reduce stream only records an event after the node sums,
        which the buffer's stream waits for before the adds (the slot copies to the accelerator are issued
        before that wait, so they overlap the reduction). So the reduce stream's reduce-scatters never queue
        behind the copies, and DeepSpeed's reduce backpressure (two events on the reduce stream) does not turn
        them into host stalls. Micro-steps stay in order on the one buffer stream; :meth:`take` waits on
        :attr:`done` before reading a slot."""
        host = [(ds_id, cols) for ds_id, cols in items if not self._on_device(ds_id)]
        for ds_id, cols in items:
            if self._on_device(ds_id):
                slot = self.slot(ds_id).view_as(cols)
                slot.add_(cols) if ds_id in self.dirty else slot.copy_(cols)
                self.dirty.add(ds_id)
        if host:
            self._round_trip(host)

    def _round_trip(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """The host slots' part of :meth:`accumulate` ([Note: host buffer round trip])."""
        sums = device.record_event()  # on the reduce stream: the node sums exist
        with device.stream(device.side_stream("grad_buffer")):
            partial = [device.to_accel(self.slot(i).view_as(c)) if i in self.dirty else None for i, c in items]
            device.wait_event(sums)
            for (ds_id, cols), part in zip(items, partial):
                device.record_stream(cols)  # allocated on the reduce stream, read on this one
                device.to_host(cols if part is None else part.add_(cols), out=self.slot(ds_id).view_as(cols))
                self.dirty.add(ds_id)
            self.done = device.record_event()

    def take(self, ds_id: int, shape: tuple[int, int]) -> torch.Tensor:
        """The window sum on the accelerator (read it before the next :meth:`accumulate`); the slot is clean."""
        self.dirty.discard(ds_id)
        device.wait_event(self.done)  # the slot's last round trip, on the buffer's stream
        return device.to_accel(self.slot(ds_id).view(shape))

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)

    def move(self, budget: int) -> int:
        """Move the host chunks that fit ``budget`` (in order, at the bytes their slots use) to the accelerator, at a
        step boundary (the buffer holds no partial sum then: a new chunk starts zeroed, nothing is copied); the host
        chunks wait in :attr:`retired` for the last round trip's copies. Returns the bytes moved."""
        assert not self.dirty, "fcdp: the node gradient buffer moves only between windows"
        used: dict[int, int] = {}
        for ds_id, (offset, numel) in self.offsets.items():
            index = self.chunk_of[ds_id]
            used[index] = max(used.get(index, 0), offset + numel)
        moved = 0
        for index, (chunk, placement) in enumerate(zip(self.chunks, self.placements)):
            nbytes = used.get(index, 0) * chunk.element_size()
            if placement != "host" or moved + nbytes > budget:
                break  # a prefix: the same parameters on the accelerator on every step
            try:
                faults.maybe_fail("alloc_gradbuf_device")
                self.chunks[index] = device.accel_empty(used.get(index, 0), chunk.dtype).zero_()
            except (RuntimeError, MemoryError, faults.InjectedFault):
                break  # the rest stays on the host
            self.placements[index] = "device"
            self.retired.append((chunk, self.done))
            moved += nbytes
        self.reap()
        return moved

    def reap(self) -> None:
        """Drop retired host chunks whose last copy has completed (non-blocking; [Note: deferred release] in
        ``cache.py``)."""
        done, self.retired = device.split_done(self.retired)
        if done:
            for chunk in done:
                device.drop_host(chunk)
            del chunk, done
            device.empty_host_cache()


#: [Note: the device buffer comes from a measured step] ``grad_buffer_device: device`` used to take
#: ``grad_buffer_budget`` (25%) of the accelerator's free memory at engine build, before activations, prefetch
#: buffers, the reduce buckets or NCCL's buffers existed: memory ZeRO-3 would have used for a larger batch. Like the
#: cache's accelerator modes (``runtime/promotion.py``) the buffer now starts in pinned host memory and, at the step
#: the cache measures (the first complete one), moves the chunks that fit ``grad_buffer_budget`` resolved against the
#: headroom that step left (total minus the allocator's peak reserved memory, minus memory outside the allocator and
#: a margin: ``memory.measured_device_headroom``), before the cache takes its share. Placement is per rank (no
#: collective depends on it). A buffer planned after that step (the accumulation steps raised later) measures again
#: when it is planned. The error-feedback residuals of ``grad_compression`` follow (``grads/residual.py``).
#: [Note: buffer chunks] The buffer is carved into chunks of at most this size (a slot larger than it opens a
#: chunk of its own), as the cache's pools are (``cache.CHUNK_BYTES``): a pinned allocation costs its power-of-two
#: rounding, so one flat pinned buffer could hold only the largest power of two under its budget (as little as
#: half of it); chunks of a power-of-two size cost what they hold, and only the last chunk's rounding is paid.
CHUNK_BYTES = 256 * 2**20


def fit_prefix_cost(sizes: Sequence[int], budget: int, rounds: bool) -> int:
    """How many of ``sizes`` (bytes, in order) fit ``budget`` once chunked (:data:`CHUNK_BYTES`), pinned rounding
    counted when ``rounds``. The cost of a prefix only grows: binary search."""
    lo, hi = 0, len(sizes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if memory.chunks_cost(list(sizes[:mid]), CHUNK_BYTES, rounds) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fitting_prefix(sizes: Sequence[int], budget: int) -> int:
    """How many of ``sizes``, taken in order, fit in ``budget`` (an order every rank shares)."""
    used = 0
    for count, size in enumerate(sizes):
        if used + size > budget:
            return count
        used += size
    return len(sizes)


class BufferPlanner:
    """Sizes one reducer's :class:`NodeGradBuffer` against the agreed budget and allocates it (collectives
    over the DP group); the parameters it buffers, in ds_id order, and the bytes it could not buffer."""

    def __init__(self, config: FCDPConfig, layout: ReduceLayout, dp_group: Any, accumulation_dtype: torch.dtype,
                 buffer: NodeGradBuffer) -> None:
        self.config = config
        self.layout = layout
        self.dp_group = dp_group
        self.accumulation_dtype = accumulation_dtype
        self.buffer = buffer
        self.trainable: list = []
        self.params_by_id: dict[int, torch.nn.Parameter] = {}
        self.unbuffered_bytes = 0
        self.planned = False
        #: Resident bytes of every rank on this node (SLURM's per-node limit), from the runtime's planning.
        self.node_rss: Optional[int] = None
        #: ``grad_buffer_device: device``: the accelerator bytes granted at the measured step (``None`` before it:
        #: the buffer starts on the host), [Note: the device buffer comes from a measured step].
        self.device_budget: Optional[int] = None

    def on_device(self) -> bool:
        """Whether a buffer planned now goes to accelerator memory: asked for, and a step was measured."""
        return self.config.grad_buffer_device == "device" and self.device_budget is not None

    def promote(self, headroom: int) -> int:
        """At the measured step ([Note: the device buffer comes from a measured step]): ``grad_buffer_budget``
        resolved against the accelerator ``headroom`` that step left (25% of it by default, never more than it), and
        the buffer's host chunks that fit it moved there. Returns the bytes moved (what the cache may no longer take)."""
        if self.config.grad_buffer_device != "device":
            return 0
        self.device_budget = min(headroom, self.config.grad_buffer_budget_spec.resolve(headroom, auto_fraction=0.25))
        return self.buffer.move(self.device_budget) if self.buffer.chunks else 0

    def sizes(self, params: Sequence[torch.nn.Parameter]) -> tuple[list, list[int]]:
        params = sorted(params, key=lambda p: p.ds_id)
        return params, [self.layout.nodes * chunk_numel(p.ds_numel, self.layout.dp_size) for p in params]

    def measure(self, params: Sequence[torch.nn.Parameter]) -> BufferFit:
        """Collective over the DP group: what buffering every trainable parameter needs, against the
        smallest budget share of any rank (an agreed input of :func:`~fcdp_deepspeed.grads.plan.resolve_grad_plan`)."""
        params, numels = self.sizes(params)
        self.trainable = params
        on_device = self.on_device()
        return BufferFit(need_bytes=memory.chunks_cost([n * self.accumulation_dtype.itemsize for n in numels],
                                                       CHUNK_BYTES, self.rounds(on_device)),
                         budget_bytes=self.agree_min(self.budget_bytes(on_device)),
                         device=self.config.grad_buffer_device)

    def plan(self, params: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        """Collective over the DP group: reserve buffer slots for a prefix (ds_id order) of the trainable
        parameters (default: those given to :meth:`measure`) that fits the budget on every rank;
        the rest accumulate per rank, with one warning. Runs once."""
        if self.planned:
            return
        self.planned = True
        params, numels = self.sizes(self.trainable if params is None else params)
        self.params_by_id = {p.ds_id: p for p in params}
        itemsize = self.accumulation_dtype.itemsize
        on_device = self.on_device()
        budget = self.budget_bytes(on_device)
        sizes = [n * itemsize for n in numels]
        rounds = self.rounds(on_device)
        fits = self.agree_min(fit_prefix_cost(sizes, budget, rounds))
        groups = memory.chunk_groups(sizes[:fits], CHUNK_BYTES, rounds)
        chunks = self._allocate([sum(numels[i] for i in g) for g in groups], on_device, rounds) if fits else None
        if fits and self.agree_min(1 if chunks is not None else 0) == 0:
            chunks, fits = None, 0
        if chunks is not None:
            for index, group in enumerate(groups):
                offset = 0
                for i in group:
                    self.buffer.offsets[params[i].ds_id] = (offset, numels[i])
                    self.buffer.chunk_of[params[i].ds_id] = index
                    offset += numels[i]
            self.buffer.chunks = chunks
            self.buffer.placements = ["device" if on_device else "host"] * len(chunks)
        self.unbuffered_bytes = sum(numels[fits:]) * itemsize
        if fits < len(params) and dist.get_rank() == 0:
            from deepspeed.utils import logger
            key = "fcdp.grad_buffer_budget" + (" (accelerator memory, grad_buffer_device = device)" if on_device else "")
            logger.warning(f"fcdp: the node gradient-accumulation buffer needs {fmt_bytes(sum(numels) * itemsize)} per "
                           f"rank but {fmt_bytes(budget)} is allowed (or allocation failed); {len(params) - fits} of "
                           f"{len(params)} trainable parameters ({fmt_bytes(self.unbuffered_bytes)}) are reduced across "
                           f"nodes on every micro-step instead. Raise {key} to buffer them.")

    def budget_bytes(self, on_device: bool) -> int:
        """This rank's share: accelerator budget per rank (after a measured step: :meth:`promote`), or the host
        budget per node (resolved against ``memory.host_limit`` less its margin) split over its ranks. What the
        buffer's chunks cost, pinned rounding included, must fit it ([Note: buffer chunks])."""
        spec = self.config.grad_buffer_budget_spec
        if on_device:  # planned after the measured step (accumulation steps raised later): measured again now
            acc = get_accelerator()
            headroom = memory.measured_device_headroom(acc.total_memory(), acc.max_memory_reserved(),
                                                       acc.memory_reserved(), acc.available_memory())
            return min(headroom, spec.resolve(headroom, auto_fraction=0.25))
        usable = memory.usable_host(memory.host_limit(used_bytes=self.node_rss))
        return min(spec.resolve(usable, auto_fraction=0.25), usable) // self.layout.per_node

    def rounds(self, on_device: bool) -> bool:
        """Whether each host chunk costs its power-of-two rounding (pinned for real)."""
        return not on_device and self.config.pin_memory and device.pins_host_memory()

    def _allocate(self, numels: list[int], on_device: bool, rounds: bool) -> Optional[list[torch.Tensor]]:
        """The buffer's chunks, allocated once (pinned on the host; a pinned chunk at its rounded size, what the
        caching host allocator takes anyway); ``None`` when an allocation fails here."""
        try:
            faults.maybe_fail(f"alloc_gradbuf_{'device' if on_device else 'host'}")
            alloc = device.accel_empty if on_device else device.pin_empty if self.config.pin_memory else device.host_empty
            itemsize = self.accumulation_dtype.itemsize
            return [alloc(memory.pinned_cost(n * itemsize, rounds) // itemsize, self.accumulation_dtype).zero_()
                    for n in numels]
        except (RuntimeError, MemoryError, faults.InjectedFault):
            return None

    def agree_min(self, value: int) -> int:
        t = device.small_to_accel([value], torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.dp_group)
        return int(device.small_to_host(t)[0])

