"""The resolved plan: which gradient modes an engine runs, and why, from what was asked and the layout.

``grad_reduce`` / ``grad_accumulation`` default to ``auto``. :func:`resolve_grad_plan` turns the asked
modes into the modes that run, as a pure function of the topology (N nodes x L ranks), the gradient
accumulation steps, the DeepSpeed settings that bypass the reduce-scatter FCDP replaces, and whether
the node buffer fits its budget. Every input is identical on every rank of the DP group, so every rank
resolves the same plan (the buffer fit is agreed by an all-reduce before it gets here).

[Note: refuse only what cannot work]
An explicit mode is refused only where it would run and cannot: more than one node, more than one
rank per node, and a DeepSpeed setting that bypasses the path. Where the layout has nothing to split
(one node, or one rank per node) any mode falls back to DeepSpeed's flat path, said once in the plan
line. ``auto`` never refuses: it picks the flat path (or per-rank accumulation) and says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from fcdp_deepspeed.config import FCDPConfigError
from fcdp_deepspeed.reporting.stats import fmt_bytes


@dataclass(frozen=True)
class BufferFit:
    """The node accumulation buffer against its budget, agreed over the DP group (min over ranks)."""

    need_bytes: int
    """Bytes per rank to buffer every trainable parameter."""
    budget_bytes: int
    """This rank's share of ``grad_buffer_budget`` (the smallest over the DP group)."""
    device: str = "host"

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.budget_bytes


@dataclass(frozen=True)
class GradPlan:
    """The gradient modes that run for one engine, each with the reason it was chosen."""

    nodes: int
    ranks_per_node: int
    grad_reduce: str
    """``flat`` (DeepSpeed's reduce-scatter, bit-identical to ZeRO-3) or ``hierarchical``."""
    grad_accumulation: str
    """``rank`` (DeepSpeed's) or ``node`` (the node buffer)."""
    reduce_reason: str
    accumulation_reason: str
    fell_back: bool = False
    """An explicitly asked mode could not run here and DeepSpeed's path runs instead."""

    @property
    def active(self) -> bool:
        """Whether gradients leave DeepSpeed's flat, per-rank path (summation order changes)."""
        return self.grad_reduce != "flat"

    def log_line(self) -> str:
        return (f"fcdp plan: {self.nodes} nodes x {self.ranks_per_node}; grad_reduce={self.grad_reduce} "
                f"({self.reduce_reason}), grad_accumulation={self.grad_accumulation} ({self.accumulation_reason})")

    def stats(self) -> dict:
        return {"grad_reduce": self.grad_reduce, "grad_accumulation": self.grad_accumulation}


def _buffer_words(fit: Optional[BufferFit], accumulation_steps: int) -> str:
    if fit is None:
        return ""
    when = "" if accumulation_steps > 1 else ", allocated at the first micro-step that is not a boundary"
    return f", buffer {fmt_bytes(fit.need_bytes)}/rank {fit.device}{when}"


def resolve_grad_plan(grad_reduce: str, grad_accumulation: str, nodes: int, ranks_per_node: int,
                      accumulation_steps: int, path_blockers: Sequence[str] = (),
                      accumulation_blockers: Sequence[str] = (), fit: Optional[BufferFit] = None) -> GradPlan:
    """The modes that run for the asked ``grad_reduce``/``grad_accumulation`` (``auto`` or explicit).

    ``path_blockers``: DeepSpeed settings that bypass the bucketed reduce-scatter (each "setting. Fix: ...");
    ``accumulation_blockers``: settings that hide the accumulation boundary from backward; ``fit``: the
    node buffer against its budget (``None``: not measured, the layout has nothing to split). Raises
    :class:`FCDPConfigError` for an explicit mode that would run and cannot (see the module note).
    """
    base = dict(nodes=nodes, ranks_per_node=ranks_per_node)
    asked = f"fcdp.grad_reduce = {grad_reduce!r} / fcdp.grad_accumulation = {grad_accumulation!r}"
    explicit = grad_reduce == "hierarchical" or grad_accumulation == "node"
    if grad_reduce == "flat":
        return GradPlan(**base, grad_reduce="flat", grad_accumulation="rank", reduce_reason="set",
                        accumulation_reason="set" if grad_accumulation == "rank" else "auto, grad_reduce flat")
    if nodes == 1 or ranks_per_node == 1:
        why = "one node" if nodes == 1 else "one rank per node"
        words = f"{why}: nothing to split, DeepSpeed's path"
        return GradPlan(**base, grad_reduce="flat", grad_accumulation="rank",
                        reduce_reason=("fell back, " if grad_reduce == "hierarchical" else "auto, ") + words,
                        accumulation_reason=("fell back, " if grad_accumulation == "node" else "auto, ") + words,
                        fell_back=explicit)
    if path_blockers:
        if explicit:
            raise FCDPConfigError(f"{asked} cannot run with this DeepSpeed config: " + "; ".join(path_blockers) +
                                  ". Or leave both keys out (auto picks DeepSpeed's path here).")
        words = "auto, DeepSpeed config bypasses the reduce-scatter: " + path_blockers[0].split(".")[0]
        return GradPlan(**base, grad_reduce="flat", grad_accumulation="rank", reduce_reason=words,
                        accumulation_reason=words)
    reduce_reason = "set" if grad_reduce == "hierarchical" else "auto"
    if grad_accumulation == "node":
        if accumulation_blockers:
            raise FCDPConfigError(f"{asked} cannot run with this DeepSpeed config: " + "; ".join(accumulation_blockers) +
                                  ". Or leave grad_accumulation out (auto picks per-rank accumulation here).")
        return GradPlan(**base, grad_reduce="hierarchical", grad_accumulation="node", reduce_reason=reduce_reason,
                        accumulation_reason="set" + _buffer_words(fit, accumulation_steps))
    if grad_accumulation == "rank":
        return GradPlan(**base, grad_reduce="hierarchical", grad_accumulation="rank", reduce_reason=reduce_reason,
                        accumulation_reason="set")
    if accumulation_blockers:
        return GradPlan(**base, grad_reduce="hierarchical", grad_accumulation="rank", reduce_reason=reduce_reason,
                        accumulation_reason="auto, " + accumulation_blockers[0].split(".")[0])
    if fit is None or not fit.fits:
        words = "auto, buffer not measured" if fit is None else \
            (f"auto, buffer {fmt_bytes(fit.need_bytes)}/rank over the {fmt_bytes(fit.budget_bytes)} "
             f"fcdp.grad_buffer_budget: every micro-step crosses nodes")
        return GradPlan(**base, grad_reduce="hierarchical", grad_accumulation="rank", reduce_reason=reduce_reason,
                        accumulation_reason=words)
    return GradPlan(**base, grad_reduce="hierarchical", grad_accumulation="node", reduce_reason=reduce_reason,
                    accumulation_reason="auto" + _buffer_words(fit, accumulation_steps))


#: Gradient dtypes the compressed inter-node stage reads and returns (it encodes their fp32 sums).
COMPRESSIBLE_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


def check_grad_compression(codec: str, plan: GradPlan, communication_dtype: object, accumulation_dtype: object) -> None:
    """Refuse ``fcdp.grad_compression`` (by name, with the fix) where it cannot run: it compresses the inter-node
    stage of the hierarchical reduce-scatter, so the resolved plan must be hierarchical, and it reads and returns
    fp32/bf16/fp16 gradients (ZeRO++ qgZ is refused earlier, by ``check_ds_config_compatible``)."""
    asked = f"fcdp.grad_compression = {codec!r}"
    if not plan.active:
        raise FCDPConfigError(
            f"{asked} compresses the inter-node stage of grad_reduce \"hierarchical\", but this job runs grad_reduce = "
            f"\"flat\" ({plan.reduce_reason}). Fix: set grad_compression to \"off\", or run grad_reduce \"hierarchical\" "
            f"(several nodes of several ranks each).")
    for key, dtype in (("communication_data_type", communication_dtype),
                       ("gradient accumulation dtype (data_types.grad_accum_dtype)", accumulation_dtype)):
        if str(dtype) not in COMPRESSIBLE_DTYPES:
            raise FCDPConfigError(f"{asked} supports fp32, bf16 and fp16 gradients, but the {key} is {dtype}. Fix: use "
                                  f"one of those, or set grad_compression to \"off\".")
