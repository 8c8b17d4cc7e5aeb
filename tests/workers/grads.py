"""Rank workers for the gradient modes (grad_reduce / grad_accumulation): error against an exact
float64 reduction, parity with plain ZeRO-3, traffic per optimizer step.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.nn.functional as F

import deepspeed
from deepspeed import comm as dist
from deepspeed.utils import safe_get_local_grad

import fcdp_deepspeed
from fcdp_deepspeed import grads
from fcdp_deepspeed.grads import own_chunk_numel
from fcdp_lab.harness import toy
from workers.common import DTYPES, LogCapture, setup


def sabotage(kind: str) -> None:
    """Deliberately broken variants, to show the tests can fail."""
    if kind == "wrong_peers":  # pair each rank with the wrong node peers' chunks
        original = grads.build_layout

        def build_layout(dp_ranks, node_of_rank, me):
            layout = original(dp_ranks, node_of_rank, me)
            return dataclasses.replace(layout, blocks=tuple(b[::-1] for b in layout.blocks))

        grads.build_layout = build_layout
    elif kind == "drop_buffer":  # forget the accumulated window at the boundary
        original_reduce = grads.GradReducer.reduce

        def reduce(self, params, tensors):
            if self.is_boundary():
                self.buffer.dirty.clear()
            return original_reduce(self, params, tensors)

        grads.GradReducer.reduce = reduce
    elif kind == "no_late_buffer":  # decide the buffer at build time only (accumulation steps set later are missed)
        from fcdp_deepspeed.engine.stage3 import FCDPStage3
        FCDPStage3._plan_buffer_if_window_grew = lambda self: None
    elif kind:
        raise ValueError(kind)


class GatedToy(toy.ToyModel):
    """The toy MLP whose last block runs only on micro-steps ``gate`` allows (every rank alike), so
    some parameters get no gradient in some micro-steps (conditional computation, MoE-like)."""

    def forward(self, x: torch.Tensor, use_last: bool = True) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i == len(self.blocks) - 1 and not use_last:
                continue
            if self.activation_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
            else:
                h = block(h)
        return self.out(h)


def build(sc: dict, cfg: dict):
    """Build the scenario's engine (``toy.build_engine`` unless the scenario gates a block or uses
    reentrant checkpointing)."""
    kw = dict(hidden=sc.get("hidden", 32), lora_rank=sc.get("lora_rank", 0), layers=sc.get("layers", 4))
    if not sc.get("gate") and not sc.get("reentrant"):
        return toy.build_engine(copy.deepcopy(cfg), activation_checkpointing=sc.get("ckpt", False),
                                zero_init=sc.get("zero_init", False), **kw)
    fcdp_deepspeed.install()
    torch.manual_seed(0)
    model = GatedToy(kw["hidden"], kw["layers"], kw["lora_rank"], sc.get("ckpt", False) or sc.get("reentrant", False))
    model.reentrant = bool(sc.get("reentrant"))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=copy.deepcopy(cfg))
    return engine


def gate(sc: dict, micro: int) -> dict:
    """Forward kwargs of micro-step ``micro``: ``sc["gate"]`` = micro-steps (mod GA) that skip the last block."""
    skip = sc.get("gate")
    if not skip:
        return {}
    return {"use_last": micro % sc.get("grad_accum", 1) not in skip}


def train(engine, sc: dict) -> toy.RunResult:
    """``toy.train`` with the scenario's gate (the loop is the same: forward, backward, step)."""
    if not sc.get("gate"):
        return toy.train(engine, sc.get("steps", 10), hidden=sc.get("hidden", 32), record_step_stats=True,
                         dtype=DTYPES[sc.get("dtype", "fp32")])
    res = toy.RunResult()
    micro = 0
    for _ in range(sc.get("steps", 10)):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), sc.get("hidden", 32))
            loss = F.mse_loss(engine(x, **gate(sc, micro)), y)
            engine.backward(loss)
            engine.step()
            res.losses.append(loss.item())
            micro += 1
        res.step_stats.append(fcdp_deepspeed.get_stats(engine))
    res.stats = fcdp_deepspeed.get_stats(engine)
    return res


def _config(sc: dict, fcdp: dict | None) -> dict:
    cfg = toy.ds_config(fcdp, regime=sc.get("regime", "large"), grad_accum=sc.get("grad_accum", 1),
                        dtype=sc.get("dtype", "fp32"), **sc.get("zero", {}))
    cfg.update(sc.get("top", {}))  # top-level DeepSpeed keys (gradient_predivide_factor, communication_data_type)
    return cfg


def reference_errors(sc: dict, fcdp: dict | None) -> list[dict]:
    """Train ``sc`` and, at every accumulation boundary, compare this rank's gradient partition with
    the exact (float64) average of every rank's full fp32 gradient over the window."""
    cfg = _config(sc, fcdp)
    hidden = sc.get("hidden", 32)
    engine = build(sc, cfg)
    ga = engine.gradient_accumulation_steps()
    world, rank = dist.get_world_size(), dist.get_rank()
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    out = []
    micro = 0
    for _ in range(sc.get("steps", 2)):
        weights = toy.gather_weights(engine)
        replica = GatedToy(hidden, sc.get("layers", 4), sc.get("lora_rank", 0))
        replica.load_state_dict(weights)
        exact = {n: torch.zeros(p.ds_numel, dtype=torch.float64) for n, p in named}
        for _ in range(ga):
            x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), hidden)
            replica.zero_grad()
            (F.mse_loss(replica(x, **gate(sc, micro)), y) / ga).backward()
            rp = dict(replica.named_parameters())
            for n, _ in named:
                if rp[n].grad is not None:
                    exact[n] += rp[n].grad.reshape(-1).double()
            engine.backward(F.mse_loss(engine(x, **gate(sc, micro)), y))
            if engine.is_gradient_accumulation_boundary():
                err = ref_max = 0.0
                for n, p in named:
                    dist.all_reduce(exact[n], group=None)
                    chunk = -(-p.ds_numel // world)
                    own = own_chunk_numel(p.ds_numel, world, rank)
                    ref = (exact[n] / world).narrow(0, rank * chunk, own) if own else exact[n][:0]
                    got = safe_get_local_grad(p).reshape(-1)[:own].double()
                    err = max(err, (got - ref).abs().max().item() if own else 0.0)
                    ref_max = max(ref_max, ref.abs().max().item() if own else 0.0)
                out.append({"abs_err": err, "ref_max": ref_max})
            engine.step()
            micro += 1
    return out


def _errors_by_mode(scenarios: list[dict], ranks_per_node: int, break_kind: str, errors) -> dict:
    """Per scenario: ``errors(sc, block)`` for plain ZeRO-3 (block None) and each FCDP gradient mode."""
    setup(ranks_per_node)
    sabotage(break_kind)
    result = {}
    for sc in scenarios:
        modes = {"zero3": None, **{name: {"enabled": True, "ranks_per_node": ranks_per_node, **block}
                                   for name, block in sc["modes"].items()}}
        result[sc["name"]] = {name: errors(sc, block) for name, block in modes.items()}
    return result


def error_bounds(scenarios: list[dict], ranks_per_node: int, break_kind: str = "") -> dict:
    """Per scenario: boundary errors of plain ZeRO-3 (flat) and of each FCDP gradient mode."""
    return _errors_by_mode(scenarios, ranks_per_node, break_kind, reference_errors)


def inject_overflow(engine, steps: set) -> None:
    """Make the optimizer see an overflow at the given optimizer steps (0-based), as fp16 dynamic loss
    scaling would after an inf/nan gradient (the CPU accelerator has no fp16): DeepSpeed then skips
    the step and runs its overflow clean-up (``zero_grad``), exactly as after a real overflow."""
    opt = engine.optimizer
    original = opt._overflow_check_and_loss_scale_update
    seen = [0]

    def check(update_scale: bool = True) -> bool:
        original(update_scale=False)
        opt.overflow = opt.overflow or seen[0] in steps
        seen[0] += 1
        return opt.overflow if not update_scale else opt._loss_scale_update_and_overflow_cleanup()

    opt._overflow_check_and_loss_scale_update = check


def parity(scenarios: list[dict], ranks_per_node: int = 2, break_kind: str = "") -> dict:
    """Each scenario with plain ZeRO-3 and with FCDP (``sc["fcdp"]``): losses, weights, stats."""
    setup(ranks_per_node)
    sabotage(break_kind)
    out = {}
    plain_runs: dict[str, object] = {}
    for sc in scenarios:
        runs = {}
        # [Note: one plain run per distinct setting] plain ZeRO-3 ignores the fcdp block (and the fault, injected
        # only into FCDP): scenarios that differ only there share one seeded, deterministic plain run.
        plain_key = repr(sorted((k, v) for k, v in sc.items() if k not in ("name", "fcdp", "fault")))
        for mode in ("plain", "fcdp"):
            if mode == "plain" and plain_key in plain_runs:
                runs[mode] = plain_runs[plain_key]
                continue
            block = {"enabled": True, "ranks_per_node": ranks_per_node, **sc.get("fcdp", {})} if mode == "fcdp" else None
            if mode == "fcdp" and sc.get("fault"):
                os.environ["FCDP_INJECT_FAULT"] = sc["fault"]  # read at the fault site, at engine creation
            try:
                engine = build(sc, _config(sc, block))
            finally:
                os.environ.pop("FCDP_INJECT_FAULT", None)
            if sc.get("set_ga"):  # as Megatron-DeepSpeed does after initialize
                engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * sc["set_ga"])
            if sc.get("overflow_at"):
                inject_overflow(engine, sc["overflow_at"])
            res = train(engine, sc)
            res.extra["skipped_steps"] = engine.skipped_steps
            weights = toy.gather_weights(engine)
            res.weights = weights if dist.get_rank() == 0 else {}
            res.extra["optimizer_class"] = type(engine.optimizer).__name__
            runs[mode] = res
            if mode == "plain":
                plain_runs[plain_key] = res
        out[sc["name"]] = runs
    return out


def checkpoint_resume(ckpt_dir: str, ranks_per_node: int = 2, grad_accum: int = 4) -> dict:
    """Node accumulation across a checkpoint at a step boundary: a job that saves and trains on
    vs a fresh job (node mode, and plain ZeRO-3) that loads the checkpoint and trains on."""
    setup(ranks_per_node)
    node = {"enabled": True, "ranks_per_node": ranks_per_node, "grad_accumulation": "node"}
    sc = {"grad_accum": grad_accum}
    engine = build(sc, _config(sc, node))
    toy.train(engine, 3)
    engine.save_checkpoint(ckpt_dir, tag="s3")
    out = {"continued": toy.train(engine, 2, seed=5).losses}
    for name, block in (("node_loads", node), ("zero3_loads", None)):
        sc2 = dict(sc)
        engine = toy.build_engine(_config(sc2, block), seed=99)  # different init: the load must overwrite it
        engine.load_checkpoint(ckpt_dir, tag="s3")
        out[name] = toy.train(engine, 2, seed=5).losses
    return out


def refusals(cases: list[dict]) -> list[dict]:
    """``deepspeed.initialize`` with each case's config: the error it raised ("ok" if none), the resolved
    gradient modes and the plan lines logged while building it."""
    setup(2)
    log = LogCapture()
    out = []
    for case in cases:
        block = {"enabled": True, "ranks_per_node": 2, **case.get("fcdp", {})}
        cfg = toy.ds_config(block, **case.get("zero", {}))
        cfg.update(case.get("top", {}))
        first = len(log.messages)
        try:
            stats = fcdp_deepspeed.get_stats(toy.build_engine(cfg))
            row = {"error": "ok", "modes": [stats.get("grad_reduce"), stats.get("grad_accumulation")]}
        except Exception as err:  # noqa: BLE001 - the test reads the message
            row = {"error": f"{type(err).__name__}: {err}", "modes": None}
        row["plan"] = [m for m in log.messages[first:] if m.startswith("fcdp plan:")]
        out.append(row)
    return out


def record_rank_gradients(engine) -> dict[int, torch.Tensor]:
    """Observe (not change) each parameter's full gradient on this rank as it is handed to the
    reduction: ``ds_id`` -> float64 sum over the micro-steps of the current window."""
    opt = engine.optimizer
    original = opt.reduce_ready_partitions_and_remove_grads
    seen: dict[int, torch.Tensor] = {}

    def observe(param):
        g = param.grad.detach().reshape(-1).double()
        seen[param.ds_id] = seen[param.ds_id] + g if param.ds_id in seen else g.clone()
        return original(param)

    opt.reduce_ready_partitions_and_remove_grads = observe
    return seen


def bf16_errors(sc: dict, fcdp: dict | None) -> list[dict]:
    """Train ``sc`` in bf16 and, at every accumulation boundary, compare this rank's fp32 gradient
    partition with the exact (float64) average over ranks and micro-steps of the bf16 gradients the
    ranks really produced (recorded as each is handed to the reduction), so only the reduction's
    rounding is measured, not bf16's forward/backward."""
    cfg = _config({**sc, "dtype": "bf16"}, fcdp)
    hidden = sc.get("hidden", 32)
    engine = build(sc, cfg)
    seen = record_rank_gradients(engine)
    world, rank = dist.get_world_size(), dist.get_rank()
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    out = []
    micro = 0
    for _ in range(sc.get("steps", 2)):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), hidden)
            engine.backward(F.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
            if engine.is_gradient_accumulation_boundary():
                err = ref_max = rel = 0.0
                for n, p in named:
                    exact = seen.pop(p.ds_id).clone()
                    dist.all_reduce(exact)
                    chunk = -(-p.ds_numel // world)
                    own = own_chunk_numel(p.ds_numel, world, rank)
                    if not own:
                        continue
                    ref = (exact / world).narrow(0, rank * chunk, own)
                    got = safe_get_local_grad(p).reshape(-1)[:own].double()
                    diff = (got - ref).abs()
                    err = max(err, diff.max().item())
                    ref_max = max(ref_max, ref.abs().max().item())
                    rel = max(rel, (diff / ref.abs().clamp_min(1e-30))[ref.abs() > 1e-3 * ref.abs().max()].max().item())
                out.append({"abs_err": err, "ref_max": ref_max, "rel_err": rel,
                            "grad_dtype": str(safe_get_local_grad(named[0][1]).dtype)})
            engine.step()
            micro += 1
    return out


def bf16_error_bounds(scenarios: list[dict], ranks_per_node: int, break_kind: str = "") -> dict:
    """Per scenario, in bf16: boundary errors of plain ZeRO-3 and of each FCDP gradient mode."""
    return _errors_by_mode(scenarios, ranks_per_node, break_kind, bf16_errors)


class _Offset(torch.nn.Module):
    """A parameter with a gradient of its own: ``c`` per element, the same on every rank and micro-step."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n))

    def forward(self) -> torch.Tensor:
        return self.weight * 1.0  # a new tensor: the parameter itself is released after the forward


class OffsetToy(toy.ToyModel):
    def __init__(self) -> None:
        super().__init__(32, 2)
        self.offset = _Offset(32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x), self.offset()


#: ``fp16_window`` runs: plain ZeRO-3, node accumulation, and node accumulation casting window sums to fp16.
FP16_RUNS = {"plain": None, "node": {"grad_reduce": "hierarchical", "grad_accumulation": "node"},
             "cast_first": {"grad_reduce": "hierarchical", "grad_accumulation": "node"}}


def fp16_window(steps: int = 4, grad_accum: int = 4, scale_power: int = 16, scaled_grad: float = 40000.0,
                overflow_step: int = 1, grad_accum_dtype: str = "fp32") -> dict:
    """fp16 with dynamic loss scaling (initial scale 2**scale_power), GA ``grad_accum`` on 2 x 2, gradients
    accumulated in ``grad_accum_dtype`` (DeepSpeed's ``data_types``; its default for fp16 is fp16). The offset
    parameter's scaled fp16 gradient is ``scaled_grad`` on every rank and micro-step (DeepSpeed divides the
    loss by GA first): finite, and so is ZeRO-3's per-micro-step reduction, but a node's window sum is
    K*L/W = 2x that (past fp16's 65504). The
    first micro-step of step ``overflow_step`` scales the loss by 1e4, so every run overflows there for
    real. Per run: skipped steps and loss scale after each step, losses, weights.

    [Note: fp16 on the CPU accelerator] DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16
    kernels (``is_fp16_supported``), as on the CI machine; torch's CPU fp16 ops run anyway (slowly), so the
    check is lifted here for these tiny models."""
    from deepspeed.accelerator import get_accelerator
    setup(2)
    type(get_accelerator()).is_fp16_supported = lambda self: True
    c = scaled_grad * grad_accum / 2**scale_power
    out = {}
    for name, block in FP16_RUNS.items():
        if name == "cast_first":  # the broken variant: window sums cast to the fp16 communication dtype
            grads.StageCollectives.wire_dtype = lambda self, comm_dtype, window_sums: comm_dtype
        cfg = toy.ds_config({"enabled": True, "ranks_per_node": 2, **block} if block else None, regime="large",
                            grad_accum=grad_accum, dtype="fp16", loss_scale_power=scale_power)
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
        fcdp_deepspeed.install()
        torch.manual_seed(0)
        model = OffsetToy()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        res = {"losses": [], "skipped": [], "scale": []}
        micro = 0
        for step in range(steps):
            for k in range(grad_accum):
                x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), 32)
                pred, offset = engine(x.half())
                loss = F.mse_loss(pred.float(), y) + c * offset.float().sum()
                engine.backward(loss * (1e4 if (step, k) == (overflow_step, 0) else 1.0))
                engine.step()
                res["losses"].append(loss.item())
                micro += 1
            res["skipped"].append(engine.skipped_steps)
            res["scale"].append(float(engine.optimizer.loss_scale))
        res["weights"] = toy.gather_weights(engine)
        res["optimizer"] = type(engine.optimizer).__name__
        stats = fcdp_deepspeed.get_stats(engine)
        res["modes"] = (stats.get("grad_reduce"), stats.get("grad_accumulation"))
        out[name] = res
    return out


def forced_reduce_scatter(scenarios: list[dict], bf16_scenarios: list[dict], ranks_per_node: int) -> dict:
    """The gradient modes on NCCL's branch (``reduce_scatter_tensor``, the lab's ``grads.reduce_scatter``) instead of
    gloo's all-to-all: fp32 and bf16 boundary errors against the float64 reference, and how many of FCDP's stage
    reductions took each branch (the forced one ran)."""
    from fcdp_deepspeed.grads.collectives import StageCollectives
    from fcdp_lab.sabotage import applied
    branches = {"reduce_scatter_tensor": 0, "all_to_all": 0}
    original = StageCollectives._issue_scatter_sum

    def counted(self, inp, group, parts, *args, **kwargs):
        branches["all_to_all" if self.use_alltoall else "reduce_scatter_tensor"] += 1
        return original(self, inp, group, parts, *args, **kwargs)

    StageCollectives._issue_scatter_sum = counted
    try:
        with applied("grads.reduce_scatter"):
            fp32 = _errors_by_mode(scenarios, ranks_per_node, "", reference_errors)
            bf16 = _errors_by_mode(bf16_scenarios, ranks_per_node, "", bf16_errors)
    finally:
        StageCollectives._issue_scatter_sum = original
    return {"fp32": fp32, "bf16": bf16, "branches": branches}
