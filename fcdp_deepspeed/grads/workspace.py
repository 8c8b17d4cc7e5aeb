"""The gradient stages' workspace: fixed buffers for what a bucket's two stages send and receive, reused every bucket.

[Note: a fixed workspace per stage]
DeepSpeed's ZeRO-3 reduces every bucket through one contiguous buffer allocated once, plus the flattened
reduce-scatter input that its ``reduce_scatter_coalesced`` allocates and frees per bucket. The hierarchical reduce
holds more per bucket (the packed stage-1 input, what stage 1 receives, stage 2's input and output), and stages
stay in flight while later buckets are reduced. Allocated per bucket, those buffers have as many sizes as there
are buckets (the window's first bucket leaves at a quarter, the last one is short), and the caching allocator keeps
blocks per stream: on the first H200 run the reduce stream held 8.8 buckets reserved while only 1.16 buckets more
than ZeRO-3's were allocated at the peak (docs/gpu.md, case b). So each kind of buffer (:class:`Role`) comes from a
pool of equal buffers, sized at the largest request the role has seen, taken by a bucket's stage when it is issued
and given back when that stage's result has been consumed. After the first window the pools allocate nothing.

A request above the role's limit (:meth:`StageWorkspace.set_bucket`: twice what a full bucket asks of the role, its
padding included) is a one-off: allocated for that stage and dropped when given back, so one parameter larger than
the bucket (DeepSpeed reduces it alone) does not make every pooled buffer its size.

Bounds, per reducer (C: a bucket's elements padded to W chunks; L ranks per node; D: ``grad_inflight_buckets``),
pools only: one packed input (C), one stage-1 receive buffer (C/L; C on gloo, whose all-to-all receives the whole
bucket), and D + 1 stage-2 pairs (C/L sent, C/W received; on gloo C/L received), each at most twice that where a
bucket's padding or a larger dtype on the wire (fp16 window sums travel in fp32) asks for more. One packed input is
enough because a bucket's stage 1 completes before the next bucket is packed (``GradReducer.reduce``); the window
flush batches its stage 2 at C/L elements (``GradReducer.flush``). Not the workspace's, allocated per bucket as
before: DeepSpeed's partitions and stage 2's results (tensors of their own: [Note: what leaves the workspace] in
``collectives.py``), node sums converted to the accumulation dtype, the flush's copies of host slots, and the
compressed stage 2's buffers (``grad_compression``).

[Note: when a buffer may be reused]
A buffer is given back (:meth:`Lease.release`) only after the collective that used it completed (``wait()``: on
NCCL the then current stream waits for the collective's stream) and after the stage's result was consumed. Every
take, collective issue and give-back runs on DeepSpeed's reduce stream (the bucket path runs in its context, the
deliveries after the backward in ``_reduce_stream_block``), so a later write to a reused buffer is ordered after
every earlier use *on that stream* by stream order alone. One reader runs elsewhere: node sums added into a host
slot of the node buffer are read on the buffer's own stream (``buffer.py``, [Note: host buffer round trip]); their
release carries that stream's event (``release(after=...)``), and the next take of the buffer makes the current
stream wait for it (a device-side wait, no host wait). The workspace never frees a pooled buffer while a lease on it
is out: a pool that grows drops only buffers that were given back.
The lab's broken variant ``grads.workspace_early`` gives a stage's buffers back at issue (the next stage then writes
what an in-flight collective still sends and receives): ``tests/test_grad_overlap.py`` (values) and
``tests/test_device_discipline.py`` (the stream-order model, which also names a take that does not wait for the
buffer stream's event) fail it.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

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
    """One role's buffers: all ``capacity`` bytes, those given back in ``free`` with the event their last reader on
    another stream recorded (``None``: none)."""

    capacity: int = 0
    free: list = field(default_factory=list)
    out: int = 0
    #: Requests above this many elements are one-offs (``None``: no limit yet).
    limit: Optional[int] = None


@dataclass(eq=False)
class Lease:
    """One buffer of the workspace, taken until :meth:`release`; ``tensor`` is the view the caller asked for."""

    tensor: torch.Tensor
    role: Role
    _raw: Optional[torch.Tensor]
    _workspace: "StageWorkspace"
    #: Allocated for this stage alone (above the role's limit): dropped when given back.
    one_off: bool = False

    def release(self, after: Any = None) -> None:
        """Give the buffer back ([Note: when a buffer may be reused]); ``after``: an event a reader on another stream
        recorded after its last read, which the buffer's next take waits for. A second call does nothing."""
        raw, self._raw = self._raw, None
        if raw is not None:
            self._workspace._give_back(self, raw, after)


class StageWorkspace:
    """The pools of one reducer ([Note: a fixed workspace per stage]). Thread-safe: buckets are reduced on autograd
    threads, the deliveries after the backward on the engine's."""

    def __init__(self) -> None:
        self._pools: dict[Role, _Pool] = {role: _Pool() for role in Role}
        self._lock = threading.Lock()
        #: Pooled buffers allocated since the engine was built (``grad_workspace_allocations``): flat after the first
        #: window.
        self.allocations = 0
        #: One-off buffers (requests above a role's limit: ``grad_workspace_one_offs``).
        self.one_offs = 0
        self._bytes = 0
        #: The most leases out at once per role (``grad_workspace_peak_leases``).
        self.peak_out: dict[str, int] = {}

    def set_bucket(self, limits: dict[Role, int]) -> None:
        """Each role's limit in elements (twice a full bucket's request: ``StageCollectives.set_bucket``)."""
        with self._lock:
            for role, limit in limits.items():
                self._pools[role].limit = limit

    def take(self, role: Role, numel: int, dtype: torch.dtype) -> Lease:
        """A buffer of ``role`` in accelerator memory (the door's), viewed as ``numel`` elements of ``dtype``
        (contents undefined); taken on the reduce stream ([Note: when a buffer may be reused])."""
        need = numel * dtype.itemsize
        if need == 0:
            return Lease(device.accel_empty(0, dtype), role, None, self)
        ready = None
        with self._lock:
            pool = self._pools[role]
            if pool.limit is not None and numel > pool.limit:  # a one-off: not pooled
                self.one_offs += 1
                raw, one_off = device.accel_empty(need, torch.uint8), True
            else:
                one_off = False
                if need > pool.capacity:  # larger than any so far: the role's buffers grow (those given back go)
                    self._bytes -= sum(b.numel() for b, _ in pool.free)
                    pool.capacity, pool.free = need, []
                raw, ready = pool.free.pop() if pool.free else (None, None)
                if raw is None:
                    raw = device.accel_empty(pool.capacity, torch.uint8)
                    self.allocations += 1
                    self._bytes += pool.capacity
                pool.out += 1
                self.peak_out[role.value] = max(self.peak_out.get(role.value, 0), pool.out)
        if ready is not None:
            device.wait_event(ready)  # its last reader on another stream (the node buffer's): device-side
        return Lease(raw[:need].view(dtype)[:numel], role, raw, self, one_off)

    def _give_back(self, lease: Lease, raw: torch.Tensor, after: Any) -> None:
        if lease.one_off:
            return  # dropped: any other stream that read it recorded its use (``record_stream``)
        with self._lock:
            pool = self._pools[lease.role]
            pool.out -= 1
            if raw.numel() == pool.capacity:
                pool.free.append((raw, after))
            else:  # a buffer from before the pool grew is dropped
                self._bytes -= raw.numel()

    def nbytes(self) -> int:
        """Bytes the pools hold now, given back or out (``grad_workspace_bytes``)."""
        return self._bytes

    def stats(self) -> dict:
        return {"grad_workspace_bytes": self.nbytes(), "grad_workspace_allocations": self.allocations,
                "grad_workspace_one_offs": self.one_offs, "grad_workspace_peak_leases": dict(self.peak_out)}
