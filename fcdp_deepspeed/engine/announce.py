"""The one line that says FCDP is on: logged by rank 0 at WARNING when an FCDP engine is built.

[Note: why WARNING] DeepSpeed's logger starts at WARNING, and every other FCDP line is INFO, so a user
who added ``"fcdp": {"enabled": true}`` would otherwise see nothing and could not tell FCDP from plain
ZeRO-3. One line per engine names what it runs: the layout, where the cache lives and its budget, the
parameter gather, the gradient modes and whether anything is compressed (lossy).
"""
from __future__ import annotations

from typing import Any, Optional

from deepspeed import comm as dist
from deepspeed.utils import logger

from fcdp_deepspeed.reporting.stats import fmt_bytes, plural
from fcdp_deepspeed.storage.cache import EntryState, Placement


def compression_words(config: Any) -> str:
    """``exact (no compression)`` or ``LOSSY int8/int4 ...`` for the block's compression keys."""
    param, grad = getattr(config, "param_compression", "off"), getattr(config, "grad_compression", "off")
    if param == "off" and grad == "off":
        return "exact (param_compression and grad_compression off)"
    codecs = "/".join(sorted({c for c in (param, grad) if c != "off"}, reverse=True))
    return (f"LOSSY {codecs}: param_compression {param}, grad_compression {grad}, "
            f"block {getattr(config, 'compression_block', 128)}")


def _cache_words(runtime: Any) -> str:
    cache, allocation, topo = runtime.cache, runtime.allocation, runtime.topology
    entries = list(cache.entries.values())
    cached = [e for e in entries if e.state is not EntryState.DISABLED]
    if topo.num_nodes == 1:
        return "no cache (one node: nothing to save across nodes)"
    where = {p.value: sum(e.nbytes for e in cached if e.placement is p) for p in Placement}
    slots = " + ".join(f"{fmt_bytes(n)} {name}" for name, n in where.items() if n) or "0 B"
    host_node = allocation.host_budget * topo.ranks_per_node
    budget = f"host budget {fmt_bytes(host_node)} per node (fcdp.host_budget {runtime.config.host_budget!r})"
    if runtime.config.cache_device == "device":
        budget += f", device budget {fmt_bytes(allocation.device_budget)} per rank"
    # [Note: the parameters never entered] persistent, too small or quantized parameters get no entry; counting
    # only entries printed "0 of 0 parameters cached" for a model whose 8 parameters were all persistent.
    skipped = dict(getattr(getattr(runtime, "attachment", None), "uncached", None) or {})
    total = len(entries) + sum(skipped.values())
    why = "".join(f", {n} {reason}" for reason, n in sorted(skipped.items()))
    empty = ("the cache holds no parameter, so every gather crosses nodes (the param_gather and gradient modes "
             "that follow still run); " if not cached else "")
    return (f"{empty}cache_device {runtime.config.cache_device}, {budget}; {len(cached)} of "
            f"{plural(total, 'parameter')} cached{f' (not cached: {why[2:]})' if why else ''}, slots per rank: {slots}")


def grad_words(grad_plan: Optional[Any]) -> str:
    """The gradient modes that run (``grad_plan`` a :class:`~fcdp_deepspeed.grads.plan.GradPlan`, ``None``: no
    optimizer), said as FCDP's own path or DeepSpeed's, whatever the cache holds."""
    if grad_plan is None:
        return "no optimizer, no gradients"
    modes = f"grad_reduce {grad_plan.grad_reduce}, grad_accumulation {grad_plan.grad_accumulation}"
    if grad_plan.grad_reduce == "flat" and grad_plan.grad_accumulation == "rank":
        return f"{modes} (DeepSpeed's gradient path)"
    node = " and accumulated in the node buffer" if grad_plan.grad_accumulation == "node" else ""
    return f"{modes} (gradients reduced in two stages, inside the node then across nodes{node})"


def engine_line(runtime: Any, grad_plan: Optional[Any]) -> str:
    """The line for one engine: ``runtime`` an :class:`~fcdp_deepspeed.runtime.FCDPRuntime`, ``grad_plan``
    its :class:`~fcdp_deepspeed.grads.plan.GradPlan` (``None``: an engine without an optimizer)."""
    topo, config = runtime.topology, runtime.config
    grads = grad_words(grad_plan)
    choice = getattr(runtime, "paths", None)
    probed = (f"FCDP's paths ({choice.why}); " if choice is not None and choice.paths.value == "fcdp"
              and choice.times is not None else "")
    return (f"fcdp: ON for this engine: {plural(topo.num_nodes, 'node')} x {plural(topo.ranks_per_node, 'rank')} per node "
            f"(from {topo.source}); {probed}{_cache_words(runtime)}; param_gather {runtime.param_gather}; {grads}; "
            f"{compression_words(config)}. Statistics: fcdp_deepspeed.get_stats(engine), and an [fcdp] line every "
            f"{runtime.log_interval or 'no'} steps at INFO "
            f"(deepspeed.utils.logging.set_log_level_from_string(\"info\")).")


def zero3_paths_line(topology: Any, choice: Any) -> str:
    """The line for an engine on ZeRO-3's paths (``fcdp.link``): DeepSpeed's own engine, counted."""
    return (f"fcdp: ON for this engine: {plural(topology.num_nodes, 'node')} x "
            f"{plural(topology.ranks_per_node, 'rank')} per node (from {topology.source}); ZeRO-3's paths: "
            f"DeepSpeed's own ZeRO-3, nothing cached, its gather and gradient path ({choice.why}). Statistics: "
            f"fcdp_deepspeed.get_stats(engine).")


def announce_zero3_paths(topology: Any, choice: Any) -> None:
    """Log :func:`zero3_paths_line` once, on rank 0, at WARNING."""
    if dist.get_rank() == 0:
        logger.warning(zero3_paths_line(topology, choice))


def announce(runtime: Any, grad_plan: Optional[Any]) -> None:
    """Log :func:`engine_line` once, on rank 0, at WARNING (see the module note)."""
    if dist.get_rank() == 0:
        logger.warning(engine_line(runtime, grad_plan))


def _streaming(config: Any) -> str:
    overlap = f", each exchange overlapped with the next {config.overlap} step(s)" if config.overlap else ""
    if config.fragments == 1:
        return overlap
    return f"; streaming: {config.fragments} fragments, one every {config.interval} steps{overlap}"


def _warmup(config: Any) -> str:
    if not config.warmup_steps:
        return ""
    return f", after {config.warmup_steps} exact data-parallel warm-up steps (gradients averaged across nodes)"


#: What a DiLoCo engine does instead of the cache and the cross-node gradient path (the on line and ``fcdp doctor``).
DILOCO_NO_CACHE = "no FCDP cache (nothing is gathered across nodes)"


def diloco_words(config: Any) -> str:
    """What a DiLoCo block (``fcdp.diloco``) runs: lossy, its H, outer step, codec, streaming and warm-up; shared by
    the on line and ``fcdp doctor``, so the two describe a config in the same words."""
    codec = "uncompressed (fp32)" if config.compression == "off" else f"{config.compression} with error feedback"
    return (f"exact ZeRO-3 inside each node, an outer sync every H = {config.sync_every} optimizer steps (outer_lr "
            f"{config.outer_lr}, outer_momentum {config.outer_momentum}, nesterov {str(config.nesterov).lower()}, "
            f"pseudo-gradients {codec}{_streaming(config)}){_warmup(config)}")


def diloco_line(topology: Any, config: Any, outer_host_bytes: int) -> str:
    """The line for a DiLoCo engine (``fcdp.diloco``): lossy, its H, its codec, where the outer state lives."""
    return (f"fcdp: ON for this engine: LOSSY DiLoCo across {topology.num_nodes} nodes x {topology.ranks_per_node} "
            f"ranks per node (from {topology.source}): {diloco_words(config)}; {DILOCO_NO_CACHE}; outer state "
            f"{fmt_bytes(outer_host_bytes)} of host memory per rank. Statistics: "
            f"fcdp_deepspeed.get_stats(engine) (diloco_*).")


def announce_diloco(topology: Any, config: Any, outer_host_bytes: int) -> None:
    """Log :func:`diloco_line` once, on rank 0, at WARNING."""
    if dist.get_rank() == 0:
        logger.warning(diloco_line(topology, config, outer_host_bytes))


def layered_line(stack: Any) -> str:
    """The line for ``fcdp.layered``: the chunks, the layers, what it costs in memory and what it turned off."""
    cache = "; the model's use_cache turned off (a key/value cache would mix the chunks)" if stack.cache_turned_off else ""
    return (f"fcdp: layered accumulation: each batch in {stack.chunks} chunks, every chunk through a layer before any "
            f"enters the next, over the {len(stack.layers)} layers of {stack.name or 'the model'} (each gathered once in "
            f"forward and once in backward per step, checkpointed per layer and chunk: the layer inputs of the whole "
            f"batch stay alive for the backward, get_stats' layered_boundary_bytes){cache}.")


def announce_layered(stack: Any) -> None:
    """Log :func:`layered_line` once, on rank 0, at WARNING."""
    if dist.get_rank() == 0:
        logger.warning(layered_line(stack))
