"""The gradient stages' workspace: fixed buffers for what a bucket's two stages send and receive, reused every bucket.

[Note: a fixed workspace per stage]
DeepSpeed's ZeRO-3 reduces every bucket through one contiguous buffer allocated once, plus the flattened
reduce-scatter input that its ``reduce_scatter_coalesced`` allocates and frees per bucket. The hierarchical reduce
holds more per bucket (the packed stage-1 input, what stage 1 receives, stage 2's input and output), and stages
stay in flight while later buckets are reduced. Allocated per bucket, those buffers have as many sizes as there
are buckets (the window's first bucket leaves at a quarter, the last one is short, a parameter larger than the
bucket is a bucket of its own), and the caching allocator keeps blocks per stream: on the first H200 run the
reduce stream held 8.8 buckets reserved while only 1.16 buckets more than ZeRO-3's were allocated at the peak
(docs/gpu.md, case b). So each kind of buffer (:class:`Role`) comes from a pool of equal buffers, sized at the
largest request the role has seen, taken by a bucket's stage when it is issued and given back when that stage's
result has been consumed. After the first window nothing is allocated: reserved memory is the pool.

Bounds, per reducer (C: a bucket's elements padded to W chunks, in the communication dtype; L ranks per node;
D: ``grad_inflight_buckets``): one packed input (C), one stage-1 receive buffer (C/L; C on gloo, whose
all-to-all receives the whole bucket), and D + 1 stage-2 pairs (C/L sent, C/W received; on gloo C/L received).
One packed input is enough because a bucket's stage 1 completes before the next bucket is packed
(``GradReducer.reduce``). The results handed on (node sums in the accumulation dtype, DeepSpeed's partitions)
are not the workspace's: see [Note: what leaves the workspace].

[Note: when a buffer may be reused]
A buffer is given back (:meth:`Lease.release`) only after the collective that used it completed (``wait()``: on
NCCL the then current stream waits for the collective's stream) and after the stage's result was consumed; every
take, use and give-back runs on DeepSpeed's reduce stream (the bucket path runs in its context, the deliveries
after the backward in ``_reduce_stream_block``), so the next bucket's write to a reused buffer is ordered after
every earlier read of it by stream order alone, with no event and no host wait. The workspace never frees a
buffer while a lease on it is out: a pool that grows (a larger request) drops only buffers that were given back.
The lab's broken variant ``grads.workspace_early`` gives a stage's buffers back at issue (the next stage then
writes what an in-flight collective still sends and receives): ``tests/test_grad_overlap.py`` (values) and
``tests/test_device_discipline.py`` (the stream-order model) fail it.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from fcdp_deepspeed.machine import device


class Role(enum.Enum):
    """What a workspace buffer holds; each role has its own pool of equal buffers."""

    PACK = "pack"
    """Stage 1's input: the bucket's chunks permuted into the layout's order (``layout.pack_chunks``)."""
    NODE_RECV = "node_recv"
    """What stage 1 receives (NCCL: the node sums; gloo: every node rank's rows, summed at completion)."""
    PEER_SEND = "peer_send"
    """Stage 2's input: the node sums of the parameters that cross nodes, in the wire dtype."""
    PEER_RECV = "peer_recv"
    """What stage 2 receives."""


@dataclass
class _Pool:
    """One role's buffers: all ``capacity`` bytes, those given back in ``free``."""

    capacity: int = 0
    free: list = field(default_factory=list)
    out: int = 0


@dataclass(eq=False)
class Lease:
    """One buffer of the workspace, taken until :meth:`release`; ``tensor`` is the view the caller asked for."""

    tensor: torch.Tensor
    role: Role
    _raw: Optional[torch.Tensor]
    _workspace: "StageWorkspace"

    def release(self) -> None:
        """Give the buffer back ([Note: when a buffer may be reused]); a second call does nothing."""
        raw, self._raw = self._raw, None
        if raw is not None:
            self._workspace._give_back(self.role, raw)


class StageWorkspace:
    """The pools of one reducer ([Note: a fixed workspace per stage]). Thread-safe: buckets are reduced on autograd
    threads, the deliveries after the backward on the engine's."""

    def __init__(self) -> None:
        self._pools: dict[Role, _Pool] = {}
        self._lock = threading.Lock()
        #: Buffers allocated since the engine was built (``grad_workspace_allocations``): flat after the first window.
        self.allocations = 0
        self._bytes = 0
        #: The most leases out at once per role (``grad_workspace_peak_leases``).
        self.peak_out: dict[str, int] = {}

    def take(self, role: Role, numel: int, dtype: torch.dtype) -> Lease:
        """A buffer of ``role`` in accelerator memory (the door's), viewed as ``numel`` elements of ``dtype``
        (contents undefined); taken on the reduce stream ([Note: when a buffer may be reused])."""
        need = max(1, numel * dtype.itemsize)
        with self._lock:
            pool = self._pools.setdefault(role, _Pool())
            if need > pool.capacity:  # larger than any so far: the role's buffers grow (those given back go now)
                self._bytes -= sum(b.numel() for b in pool.free)
                pool.capacity, pool.free = need, []
            raw = pool.free.pop() if pool.free else None
            if raw is None:
                raw = device.accel_empty(pool.capacity, torch.uint8)
                self.allocations += 1
                self._bytes += pool.capacity
            pool.out += 1
            self.peak_out[role.value] = max(self.peak_out.get(role.value, 0), pool.out)
        return Lease(raw[:need].view(dtype)[:numel], role, raw, self)

    def _give_back(self, role: Role, raw: torch.Tensor) -> None:
        with self._lock:
            pool = self._pools[role]
            pool.out -= 1
            if raw.numel() == pool.capacity:
                pool.free.append(raw)
            else:  # a buffer from before the pool grew is dropped
                self._bytes -= raw.numel()

    def nbytes(self) -> int:
        """Bytes the pools hold now, given back or out (``grad_workspace_bytes``)."""
        return self._bytes

    def stats(self) -> dict:
        return {"grad_workspace_bytes": self.nbytes(), "grad_workspace_allocations": self.allocations,
                "grad_workspace_peak_leases": dict(self.peak_out)}
