"""The DeepSpeed internals that differ between the supported releases, one entry per difference.

Differences the core must branch on are functions, feature-detected (no version numbers): they work
on whichever release is installed, and each docstring says where each branch was seen. Differences
absorbed without a branch are documented constants (``AVG_SCATTER_ARGS``, ``REDUCED_PARTITION_DTYPE``).
Internals that are the same on every supported release (``__avg_scatter_grads``, ``partition_grads``, the
invalidation hooks, ``Init._partition_param_sec``/``_aligned_size``, the hpZ secondary fields,
``reduce_scatter_coalesced`` in the stage-3 module, ``micro_step_id``, ``reduce_and_partition_stream``,
``ds_config=``) are used directly by the core and checked once by :func:`missing_internals`.
The supported releases are listed in ``fcdp_deepspeed.activation.version_gate.TESTED_DEEPSPEED_VERSIONS``;
docs/deepspeed-releases.md has the table.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def is_boundary(optimizer: Any) -> bool:
    """Whether the current micro-step ends a gradient-accumulation window.

    0.19: ``is_gradient_accumulation_boundary()`` is a method (set via
    ``set_gradient_accumulation_boundary``). 0.16-0.18: a plain bool attribute that the engine assigns
    before every backward.
    [Note: read it at call time; a bool captured at construction would be stale for the whole run.]
    """
    flag = optimizer.is_gradient_accumulation_boundary
    return bool(flag()) if callable(flag) else bool(flag)


def boundary_reader(optimizer: Any) -> Callable[[], bool]:
    """A zero-argument callable returning :func:`is_boundary` of ``optimizer`` at call time."""
    return lambda: is_boundary(optimizer)


def param_names(optimizer: Any, module: torch.nn.Module) -> dict:
    """``{param: qualified name}`` of the model the stage-3 optimizer partitions.

    0.18-0.19: the engine passes ``param_names`` to the optimizer, which keeps it as
    ``self.param_names``. 0.16-0.17: the optimizer has no such attribute; the engine builds the same
    mapping from ``module.named_parameters()``, so build it here the same way.
    """
    names = getattr(optimizer, "param_names", None)
    return dict(names) if names is not None else {p: n for n, p in module.named_parameters()}


def zenflow_config(zero_config: Any) -> Any:
    """The ``zero_optimization.zenflow`` block, or ``None``. 0.17-0.19 have ZenFlow (FCDP refuses it);
    0.16's ZeRO config has no such field, so there is nothing to refuse."""
    return getattr(zero_config, "zenflow", None)


def offload_device(zero_config: Any, which: str) -> str:
    """``zero_optimization.<which>.device`` (``offload_param``/``offload_optimizer``) as a string, ``"none"``
    without the block (the device is an enum on every supported release)."""
    block = getattr(zero_config, which, None)
    return "none" if block is None else str(getattr(block.device, "value", block.device))


def all_gather_object(object_list: list, obj: Any, group: Any = None) -> None:
    """``deepspeed.comm.all_gather_object`` where it exists (0.17-0.19); 0.16's ``deepspeed.comm`` has
    none, and there the call goes to ``torch.distributed``, which is what DeepSpeed's backend calls too."""
    from deepspeed import comm as dist
    gather = getattr(dist, "all_gather_object", None)
    if gather is None:
        gather = torch.distributed.all_gather_object
    gather(object_list, obj, group=group)



def autocast_comm_dtype(param: torch.nn.Parameter) -> Optional[torch.dtype]:
    """The dtype ZeRO-3 all-gathers ``param`` in when ``torch_autocast`` marked it, else ``None``.

    0.17-0.19: ``deepspeed.runtime.torch_autocast`` marks such parameters (``has_comm_dtype``).
    0.16: no such module; ZeRO-3 gathers every parameter in its partition's dtype, so nothing is marked.
    """
    try:
        from deepspeed.runtime.torch_autocast import get_comm_dtype, has_comm_dtype
    except ImportError:
        return None
    return get_comm_dtype(param) if has_comm_dtype(param) else None

#: Arguments of ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`` after the bucket's parameters.
#: 0.17-0.19: ``(params_to_reduce, communication_data_type)``; 0.16: ``(params_to_reduce)`` (it reads
#: ``self.communication_data_type`` itself). FCDP's override only needs the parameters, so it passes
#: the rest through unchanged (``FCDPStage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads``).
AVG_SCATTER_ARGS = {"0.16": (), "0.17-0.19": ("communication_data_type", )}


#: The dtype ``__avg_scatter_grads`` casts the reduced partitions to (when the communication dtype differs):
#: 0.16-0.18 the parameters' dtype (``self.dtype``), 0.19 ``gradient_accumulation_dtype``. The gradient
#: modes' reducer returns the accumulation dtype either way and DeepSpeed's cast runs on it, so nothing
#: here needs a branch; with bf16 parameters and bf16 communication on 0.16-0.18, ``partition_grads``
#: rounds the fp32 partitions to bf16 as it copies them (ZeRO-3 rounds them before). fp32 runs are
#: unaffected (the release smoke runs fp32).
REDUCED_PARTITION_DTYPE = {"0.16-0.18": "dtype", "0.19": "gradient_accumulation_dtype"}

#: (module, class or None) -> attributes the core touches directly; identical on every supported release.
_SHARED_INTERNALS = {
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"): (
        "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", "partition_grads", "_unflatten_partitioned_parameters",
        "invalidate_secondary_tensor", "_post_step", "_pre_step", "checkpoint_event_epilogue", "zero_grad",
        "independent_gradient_partition_epilogue", "reduce_ready_partitions_and_remove_grads"),
    ("deepspeed.runtime.zero.stage3", None): ("reduce_scatter_coalesced", ),
    ("deepspeed.runtime.zero.partition_parameters", "Init"): ("_partition_param_sec", "_aligned_size"),
}


def ipg_bucket(optimizer: Any, param: torch.nn.Parameter) -> tuple[Optional[torch.dtype], Any]:
    """``(comm dtype, bucket)``: stage 3's bucket that ``param``'s gradient went into (``elements``, ``params``) and its
    key, DeepSpeed 0.19's per-dtype ``ipg_buckets``; ``(None, None)`` on older releases (one bucket in loose
    attributes: left to DeepSpeed's rule)."""
    buckets = getattr(optimizer, "ipg_buckets", None)
    if not isinstance(buckets, dict) or not hasattr(optimizer, "get_param_comm_dtype"):
        return None, None
    comm_dtype = optimizer.get_param_comm_dtype(param)
    return comm_dtype, buckets.get(comm_dtype)


def missing_internals() -> list[str]:
    """Dotted names of the shared internals absent from the installed DeepSpeed (empty when all are there)."""
    import importlib
    missing = []
    for (module_name, cls), attrs in _SHARED_INTERNALS.items():
        owner = importlib.import_module(module_name)
        owner = getattr(owner, cls) if cls else owner
        prefix = f"{module_name}.{cls}" if cls else module_name
        missing += [f"{prefix}.{a}" for a in attrs if not hasattr(owner, a)]
    return missing
