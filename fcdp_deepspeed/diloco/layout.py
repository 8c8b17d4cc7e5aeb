"""DiLoCo's layout: every parameter partitioned over its node (one replica per node), built once at engine build.

[Note: re-partition at build] DeepSpeed 0.19.8 reads a parameter's partition layout from the parameter itself
each time it is used (``Init.get_partition_dp_group`` returns ``param.ds_process_group``; partition size and rank
derive from it, gathers split parameters by it). A model handed to ``deepspeed.initialize`` is partitioned over
the world (``DeepSpeedZeRoOffload._convert_to_zero_parameters`` without an ``mpu``), and so is one built under
``zero.Init`` (Hugging Face's ``from_pretrained``). :func:`repartition_over_node` runs right after the
optimizer's ``DeepSpeedZeRoOffload`` is built and before stage 3 groups, flattens or copies any partition: each
parameter is gathered over the world once (in ``ds_id`` order, the same on every rank), pointed at the node
group and partitioned again, so every node starts from the same full model by construction.

[Note: padding tails] A partition's tail past the parameter's end is ``torch.empty`` (``_partition_param``);
it is zeroed here so the fp32 master copies start at 0 there, and the pseudo-gradient masks it anyway
(:func:`valid_ranges`): garbage there would give an int4 block a NaN scale or a wrong drift norm.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.machine import device


def repartition_over_node(params: Sequence[torch.nn.Parameter], node_group: Any) -> int:
    """Collective over each parameter's current group: re-partition every ZeRO-3 parameter over ``node_group``.
    Returns how many parameters moved (0 when all already were partitioned over the node)."""
    rank, size = dist.get_rank(group=node_group), dist.get_world_size(group=node_group)
    moved = 0
    for p in sorted(params, key=lambda q: q.ds_id):
        if p.ds_process_group is node_group:
            continue
        p.all_gather(param_list=[p])
        p.ds_process_group = node_group
        p.ds_zero_partition_process_group = node_group
        p.ds_zero_partition_rank, p.ds_zero_partition_world_size = rank, size
        p.ds_tensor = None  # partition() allocates a 1/L partition and copies this rank's slice
        p.partition(param_list=[p])
        valid = _valid_numel(p.ds_numel, p.ds_tensor.ds_numel, rank)
        with torch.no_grad():
            p.ds_tensor.narrow(0, valid, p.ds_tensor.ds_numel - valid).zero_()
        moved += 1
    return moved


def _valid_numel(numel: int, partition_numel: int, rank: int) -> int:
    return max(0, min(partition_numel, numel - rank * partition_numel))


def valid_ranges(sub_group: Sequence[torch.nn.Parameter], rank: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the real elements of this rank's flat partition of ``sub_group`` (stage 3 lays a
    sub-group's partitions out back to back, in the sub-group's order, ``_set_fp16_partitioned_groups_flat``)."""
    out, offset = [], 0
    for p in sub_group:
        part = p.partition_numel()
        valid = _valid_numel(p.ds_numel, part, rank)
        if valid:
            out.append((offset, valid))
        offset += part
    return out


def mask_padding_(flat: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Zero ``flat`` outside ``ranges`` (in place)."""
    end = 0
    for start, length in ranges:
        if start > end:
            flat.narrow(0, end, start - end).zero_()
        end = start + length
    if flat.numel() > end:
        flat.narrow(0, end, flat.numel() - end).zero_()
    return flat


def check_same_start(tensors: Sequence[torch.Tensor], peer_group: Any, what: str) -> None:
    """Collective over ``peer_group``: refuse to train when this rank's ``tensors`` differ from its peers' (the
    outer parameters must start equal on every node, and frozen weights never cross nodes after this)."""
    sums = [torch.stack([t.double().sum(), (t.double() * torch.arange(t.numel(), dtype=torch.float64,
                                                                     device=t.device).remainder(97)).sum()])
            for t in tensors if t.numel()]
    where = device.accel_device()
    mine = torch.cat([s.to(where) for s in sums]) if sums else torch.zeros(2, dtype=torch.float64, device=where)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=peer_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=peer_group)
    if not torch.equal(low, high):
        raise RuntimeError(f"fcdp.diloco: the nodes start from different {what} (checksums differ between node "
                           f"peers). Fix: load the same weights on every node before deepspeed.initialize.")
