"""Tiny models and a deterministic training loop shared by the tests, the demo and the benchmark.

Each rank draws different data (a real data-parallel job), the same on every run, so a plain
ZeRO-3 run and an FCDP run of the same scenario must produce identical losses and weights.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import deepspeed
from deepspeed import comm as dist


class Block(torch.nn.Module):
    def __init__(self, hidden: int, lora_rank: int = 0) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(hidden, hidden)
        self.lora_a = self.lora_b = None
        if lora_rank:
            self.lora_a = torch.nn.Parameter(torch.randn(lora_rank, hidden) * 0.02)
            self.lora_b = torch.nn.Parameter(torch.randn(hidden, lora_rank) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.lora_a is not None:
            y = y + F.linear(F.linear(x, self.lora_a), self.lora_b)
        return torch.tanh(y) + x


class ToyModel(torch.nn.Module):
    """An MLP stack; with ``lora_rank`` > 0, a frozen base with trainable low-rank adapters."""

    def __init__(self, hidden: int = 32, layers: int = 4, lora_rank: int = 0, activation_checkpointing: bool = False):
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, lora_rank) for _ in range(layers))
        self.out = torch.nn.Linear(hidden, hidden)
        self.activation_checkpointing = activation_checkpointing
        if lora_rank:
            for name, p in self.named_parameters():
                p.requires_grad = "lora_" in name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.activation_checkpointing and self.training else block(h)
        return self.out(h)


def no_backward_numel(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Parameters whose module needs no backward: frozen, and no input carries a gradient
    (e.g. layers before the first adapter in LoRA). ZeRO-3 does not re-gather them in backward."""
    skipped: dict[int, int] = {}

    def hook(module, inputs, output):
        params = list(module.parameters(recurse=False))
        if params and not any(p.requires_grad for p in params) and not any(
                isinstance(i, torch.Tensor) and i.requires_grad for i in inputs):
            skipped[id(module)] = sum(p.numel() for p in params)

    handles = [m.register_forward_hook(hook) for m in model.modules() if list(m.parameters(recurse=False))]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return sum(skipped.values())


def ds_config(fcdp: Optional[dict] = None, *, regime: str = "large", grad_accum: int = 1, micro_batch: int = 4,
              lr: float = 1e-2, dtype: str = "fp32", hpz: int = 0, loss_scale_power: int = 8,
              **zero_extra: Any) -> dict:
    """A ZeRO-3 config for the toy jobs.

    ``regime="large"`` releases every parameter after use (``stage3_max_reuse_distance=0``,
    ``stage3_prefetch_bucket_size=0``): what a model larger than accelerator memory does, and the
    case where backward re-gathers everything. ``"default"`` keeps DeepSpeed's settings, under which a
    small model is prefetched and kept between forward and backward. ``"prefetch"`` keeps DeepSpeed's prefetch
    bucket but releases after use (``stage3_max_reuse_distance=0``).
    """
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                            "stage3_gather_16bit_weights_on_model_save": True}
    if regime == "large":
        zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    elif regime == "prefetch":
        zero.update(stage3_max_reuse_distance=0)
    if hpz:
        zero["zero_hpz_partition_size"] = hpz
    zero.update(zero_extra)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": loss_scale_power}
    if fcdp is not None:
        cfg["fcdp"] = fcdp
    return cfg


@dataclass
class RunResult:
    losses: list = field(default_factory=list)
    weights: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    step_stats: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def batch(step: int, micro_batch: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent but reproducible data for one micro-step."""
    g = torch.Generator().manual_seed(seed * 1000003 + dist.get_rank() * 7919 + step)
    x = torch.randn(micro_batch, hidden, generator=g)
    return x, torch.sin(x)


def gather_weights(engine) -> dict[str, torch.Tensor]:
    """Full fp32 copies of every parameter (a bypass gather, outside the cache), one parameter at a time.

    [Note: DeepSpeed 0.16.9-0.18.9 gather several parameters with async all-gathers and wait only on the
    last one; on the CPU accelerator (gloo) the others may still be running when ``param.data`` is read,
    so a multi-parameter ``GatheredParameters`` intermittently returns garbage, with plain ZeRO-3 too
    (``scripts/deepspeed_gather_race.py``). A single parameter takes DeepSpeed's blocking path.]
    """
    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            out[name] = param.detach().float().clone()
    return out


def build_engine(cfg: dict, *, hidden: int = 32, layers: int = 4, lora_rank: int = 0, seed: int = 0,
                 activation_checkpointing: bool = False, zero_init: bool = False):
    """Build a toy model (optionally under ``zero.Init(config_dict_or_path=cfg)``) and its engine."""
    import fcdp_deepspeed
    fcdp_deepspeed.install()
    torch.manual_seed(seed)
    if zero_init:
        # dtype comes from the config (passing dtype= hits a precedence bug in Init._set_dtype on CPU)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = ToyModel(hidden, layers, lora_rank, activation_checkpointing)
    else:
        model = ToyModel(hidden, layers, lora_rank, activation_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=copy.deepcopy(cfg))
    return engine


def evaluate(engine, x: torch.Tensor) -> torch.Tensor:
    """A ``no_grad`` forward in eval mode (what an evaluation loop between steps does)."""
    engine.eval()
    with torch.no_grad():
        out = engine(x).detach().float().clone()
    engine.train()
    return out


def train(engine, steps: int, *, hidden: int = 32, seed: int = 0, record_step_stats: bool = False,
          record_phases: bool = False, dtype: torch.dtype = torch.float32, spans: Optional[list] = None) -> RunResult:
    """``steps`` optimizer steps (``grad_accum`` micro-steps each); losses per micro-step.

    ``record_phases`` stores stats after every forward and backward in ``extra["phases"]`` as
    ``(micro_step, "forward"|"backward", stats)`` to attribute traffic to a phase. ``spans`` (a list) receives
    ``(name, start, end)`` in ``time.time()`` seconds for every ``train_step``, ``forward``, ``backward`` and
    ``step`` call ([Note: the trace] in ``fcdp_deepspeed/reporting/timeline.py``).
    """
    import fcdp_deepspeed
    result = RunResult()
    ga = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    micro = 0

    def timed(name: str, fn, *args):
        start = time.time()
        out = fn(*args)
        if spans is not None:
            spans.append((name, start, time.time()))
        return out

    for _ in range(steps):
        t0, wall = time.perf_counter(), time.time()
        for _ in range(ga):
            x, y = batch(micro, mb, hidden, seed)
            x, y = x.to(engine.device, dtype), y.to(engine.device)  # no copy on the CPU accelerator
            loss = F.mse_loss(timed("forward", engine, x).float(), y)
            if record_phases:
                result.extra.setdefault("phases", []).append((micro, "forward", fcdp_deepspeed.get_stats(engine)))
            timed("backward", engine.backward, loss)
            if record_phases:
                result.extra["phases"].append((micro, "backward", fcdp_deepspeed.get_stats(engine)))
            timed("step", engine.step)
            result.losses.append(loss.item())
            micro += 1
        result.step_times.append(time.perf_counter() - t0)
        if spans is not None:
            spans.append(("train_step", wall, time.time()))
        if record_step_stats:
            result.step_stats.append(fcdp_deepspeed.get_stats(engine))
    result.stats = fcdp_deepspeed.get_stats(engine)
    return result
