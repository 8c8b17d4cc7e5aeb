"""The run-ahead on an accelerator with streams (NCCL): stage 1 ahead into pinned host memory
(``fcdp.param_runahead_streams``, opt-in).

[Note: the run-ahead on streams]
On gloo the run-ahead (``runahead.py``) holds each pending group's stage 1 in host memory because host memory is
where gloo works. With streams (CUDA, NCCL) the inter-node all-gather must write accelerator memory, and holding
a pending group's W x P buffer there would be a prefetch paid in accelerator memory, which the node cache exists
not to need. So a group issued ahead crosses the nodes into a transient accelerator buffer of its node bundle only
(N x P elements: 1/L of the group) and is copied at once into pinned host memory (the *stash*); the accelerator
buffer is freed right after, on the stream that used it, so the caching allocator hands the same block to the next
group: about one bundle of the largest group at a time, whatever the budget. The fetch that takes the group
copies its stash back into its own flat buffer's bundle and runs stage 2 from there. The bytes that cross the
nodes are the same; each group also crosses PCIe twice (N x P each way, 1/L of the group).

Streams (see [Note: streams] in ``gather.py`` for the issuing, gather and waiting streams):

- the *stage-1* stream (``StreamAhead.inter``, FCDP's own, ``fcdp_stage1`` in strict mode) runs every stage 1
  of the gather while this is on: the run-ahead's and a fetch's own (:func:`stages_on_streams`), in the one order
  every rank issues them, so a fetch's stage 2 (on the gather stream) is not queued behind the stage 1s issued
  ahead of it. (The peer group's communicator is also used by the gradient's inter-node stage, from the
  process group's own stream: NCCL runs one communicator's kernels in launch order whatever their streams, and
  every rank launches them in one order.) A group issued ahead: the stream waits for the events after the last
  writes of the partitions ([Note: the optimizer's writes]), copies this rank's partitions into the bundle, runs
  stage 1 (``async_op=False``: on the current stream from torch 2.8, no host wait), copies the bundle into the
  stash and records the stash's event;
- the *gather* stream waits for that event before it copies the stash into the fetch's flat buffer (never read
  before complete: :meth:`StreamAhead.stash_ready`; a test that skips it must see the stream-order model name the
  read), then issues stage 2; the stash is dropped only once that copy is known complete on the host (:class:`Stashes`,
  [Note: deferred release] in ``storage/cache.py``).

Freshness is the run-ahead's own: every invalidation drops the pending groups it names before a fetch can take
them, and records an event on the stream that wrote the partitions (``edited``, waited for with ``stepped`` by
every later copy of partitions, including a planned group issued after the edit). A dropped group's stash is
retired with its event and nothing waits for it: its read of the partitions may race a later write of them (the
next optimizer step), which only tears a stash nobody reads.

Refused with ``fcdp.param_compression`` (the compressed stage 1 decodes into its references on the gather stream)
and with partitions offloaded to pageable host memory (each copy would hold the host behind the stage-1 stream's
queue). Stashes come from torch's caching host allocator (reused from the second step; rounded up to a power of two,
and not counted against the budget while retired); with ``DS_PIN_MEMORY_BACKEND=native`` each is a fresh
page-locked allocation. Before torch 2.8 a synchronous NCCL collective runs on the process group's stream and is
waited for (a host wait under ``TORCH_NCCL_BLOCKING_WAIT``), as the gather's stage 1 always did. A fetch's own stage
1 waits for the issuing stream (its partition copies), and so for DeepSpeed's waits queued there, as the gather
stream did before. Unmeasured on a GPU: no accelerator was lent to the sessions that built it, so it stays opt-in;
``tests/test_device_discipline.py`` checks its orderings on the CPU with the stream model, the values against
ZeRO-3 and each ordering's broken variant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.machine import device
from fcdp_deepspeed.storage import freshness


@dataclass(eq=False)
class Stashes:
    """Pinned stashes whose last copy may still run: dropped once their event is done, never before."""

    retired: list = field(default_factory=list)

    def retire(self, stash: torch.Tensor, event: Any) -> None:
        self.retired.append((stash, event))

    def reap(self) -> None:
        done, self.retired = device.split_done(self.retired)
        for stash in done:
            device.drop_host(stash)


@dataclass(eq=False)
class Staged:
    """One group's stage 1 issued ahead on streams: its node bundle in pinned host memory once ``event`` is done."""

    stash: torch.Tensor
    event: Any
    part: int
    stashes: Stashes

    def discard(self) -> None:
        """Dropped unused (an invalidation, or no fetch took it): retired with its event; nothing waits for it."""
        self.stashes.retire(self.stash, self.event)


@dataclass(eq=False)
class StreamAhead:
    """One engine's stage-1 stream and stashes (see [Note: the run-ahead on streams]); ``gather``: its
    ``HierarchicalGather`` (not imported: ``gather.py`` imports this module)."""

    gather: Any
    inter: Any
    stashes: Stashes = field(default_factory=Stashes)

    def _offsets(self, part: int) -> tuple[int, int]:
        """``(bundle start in the flat buffer, own slot's offset in the bundle)``, in elements ([Note: the two-stage
        gather] in ``gather.py``)."""
        nodes, own = self.gather.layout.nodes, self.gather.own_slot
        return (own // nodes) * nodes * part, (own % nodes) * part

    def issue(self, params: list) -> Staged:
        """Stage 1 of ``params`` on the stage-1 stream into a pinned stash."""
        gather, dtype = self.gather, params[0].ds_tensor.dtype
        part, nodes = sum(p.ds_tensor.ds_numel for p in params), gather.layout.nodes
        with device.stream(self.inter):
            bundle = device.accel_empty(nodes * part, dtype)  # allocated, used and freed on this stream
            mine = copy_partitions(params, bundle.narrow(0, self._offsets(part)[1], part), gather.stepped,
                                   gather.edited, freshness.last_write())
            dist.allgather_fn(bundle, mine, group=gather.peer_group, async_op=False)  # ordered on this stream
            stash = device.to_host(bundle, out=device.pin_empty(nodes * part, dtype))
            event = device.record_event()
        self.stashes.reap()
        return Staged(stash, event, part, self.stashes)

    def stage2(self, staged: Staged) -> tuple[torch.Tensor, Any]:
        """A new flat buffer (issuing stream) and, on the gather stream, the stash copied into its bundle after the
        stash's event, then stage 2: ``(flat, stage 2's work)``."""
        gather, part = self.gather, staged.part
        flat = device.accel_empty(part * gather.layout.dp_size, staged.stash.dtype)
        bundle = flat.narrow(0, self._offsets(part)[0], gather.layout.nodes * part)
        issuing = device.current_stream()
        with device.stream(gather.stream):
            device.wait_stream(issuing)  # the flat buffer's allocation
            device.record_stream(flat)
            self.stash_ready(staged)
            device.to_accel(staged.stash, out=bundle)
            self.stashes.retire(staged.stash, device.record_event())
            work = dist.allgather_fn(flat, bundle, group=gather.node_group, async_op=True)
        self.stashes.reap()  # the stashes whose copies are done (never this one before its copy ran)
        return flat, work


    @staticmethod
    def stash_ready(staged: Staged) -> None:
        """The current stream waits for ``staged``'s stage 1 and its copy into the stash (never read before
        complete)."""
        device.wait_event(staged.event)


def copy_partitions(params: list, mine: torch.Tensor, *written: Any) -> torch.Tensor:
    """This rank's partitions of ``params`` copied into ``mine`` on the current stream, after the ``written`` events;
    returns ``mine``.

    [Note: the optimizer's writes] The partitions were last written by the optimizer step on the step's stream,
    which the issuing stream (DeepSpeed's all-gather stream) is not ordered after: in 0.19.8 only the throughput
    timer's device synchronize (from step 2, when enabled) orders them. FCDP's copy waits for ``stepped`` (the
    event ``FCDPRuntime.on_step_end`` records) and ``edited`` (the last write outside the step, e.g. a
    ``GatheredParameters`` edit: :func:`partitions_edited`)."""
    for event in written:
        device.wait_event(event)
    offset = 0
    for p in params:  # host-resident under offload_param: an async copy
        device.to_accel(p.ds_tensor, out=mine.narrow(0, offset, p.ds_tensor.ds_numel))
        offset += p.ds_tensor.ds_numel
    return mine


def stages_on_streams(gather: Any, params: list, flat: torch.Tensor, bundle: torch.Tensor, mine: torch.Tensor,
                      part: int, lossy: bool) -> Any:
    """A fetch's two stages on streams ([Note: streams] in ``gather.py``): stage 1 on the gather stream, or with the
    run-ahead on the stage-1 stream (after every stage 1 issued ahead of it) and the gather stream waiting for it;
    then stage 2 from the gather stream. Returns stage 2's work."""
    issuing, inter = device.current_stream(), gather.staged.inter if gather.staged is not None else gather.stream
    with device.stream(inter):
        device.wait_stream(issuing)  # the partition copies above
        device.record_stream(flat)  # allocated on the issuing stream, written on this one
        gather.stage1(params, bundle, mine, part, lossy, async_op=False)  # ordered by the stream
        done = device.record_event() if inter is not gather.stream else None
    with device.stream(gather.stream):
        if done is not None:
            device.wait_stream(issuing)
            device.record_stream(flat)
            device.wait_event(done)
        return dist.allgather_fn(flat, bundle, group=gather.node_group, async_op=True)


def partitions_edited(gather: Any, *_: Any) -> None:
    """An invalidation event or ``partition(has_been_updated=True)`` (listener arguments ignored): the partitions may
    have been written on the current stream; later copies of partitions wait for this event too."""
    gather.edited = device.record_event()
