"""Workers of test_layered.py: layered (breadth-first) accumulation against ZeRO-3's accumulation window."""
from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F

import deepspeed
from deepspeed import comm as dist
from deepspeed.utils import safe_get_local_grad

import fcdp_deepspeed
from fcdp_deepspeed.grads import own_chunk_numel
from fcdp_lab.harness import toy
from workers.common import setup

HIDDEN = 32


def _engine(block: dict | None, ga: int, micro: int, regime: str, lora: int, ckpt: bool, dtype: str = "fp32",
            zero: dict | None = None):
    cfg = toy.ds_config(block, regime=regime, grad_accum=ga, micro_batch=micro, dtype=dtype, **(zero or {}))
    return toy.build_engine(cfg, hidden=HIDDEN, lora_rank=lora, activation_checkpointing=ckpt)


def _window(step: int, ga: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of optimizer step ``step`` as ZeRO-3 with ``ga`` micro-steps of ``micro`` reads them."""
    return [toy.batch(step * ga + m, micro, HIDDEN) for m in range(ga)]


def _exact_grads(engine, window, lora: int) -> dict[str, torch.Tensor]:
    """This rank's share of the float64 gradient of the window's mean loss, averaged over every rank."""
    weights = toy.gather_weights(engine)
    replica = _like(engine.module, weights, lora)
    ga = len(window)
    replica.zero_grad()
    for x, y in window:
        (F.mse_loss(replica(x.double()), y.double()) / ga).backward()
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        exact = dict(replica.named_parameters())[n].grad.reshape(-1).clone()
        dist.all_reduce(exact)
        chunk, own = -(-p.ds_numel // world), own_chunk_numel(p.ds_numel, world, rank)
        out[n] = (exact / world).narrow(0, rank * chunk, own) if own else exact[:0]
    return out


class _Reference64:
    """The run in float64 from the engine's first weights: each step the window mean's gradient over every rank,
    applied by the engine's own optimizer class and settings (what ZeRO-3's and the layered weights are within)."""

    def __init__(self, engine, lora: int) -> None:
        self.model = _like(engine.module, toy.gather_weights(engine), lora)
        basic = engine.optimizer.optimizer  # ZeRO-3's wrapped torch optimizer
        accepted = inspect.signature(type(basic).__init__).parameters
        settings = {k: v for k, v in basic.defaults.items()
                    if k in accepted and k not in ("fused", "foreach", "capturable")}
        self.optimizer = type(basic)([p for p in self.model.parameters() if p.requires_grad], **settings)

    def step(self, window) -> None:
        self.optimizer.zero_grad()
        for x, y in window:
            (F.mse_loss(self.model(x.double()), y.double()) / len(window)).backward()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def _like(module, weights: dict, lora: int) -> torch.nn.Module:
    layers = sum(1 for k in weights if k.endswith(".fc.weight"))
    replica = toy.ToyModel(HIDDEN, layers, lora).double()
    replica.load_state_dict({k: v.double() for k, v in weights.items()})
    for n, p in replica.named_parameters():
        p.requires_grad = dict(module.named_parameters())[n].requires_grad
    return replica


def _grad_error(engine, exact: dict) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    err = 0.0
    for n, p in engine.module.named_parameters():
        if n in exact and exact[n].numel():
            own = own_chunk_numel(p.ds_numel, world, rank)
            err = max(err, (safe_get_local_grad(p).reshape(-1)[:own].double() - exact[n]).abs().max().item())
    t = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run(block: dict | None, *, ga: int, micro: int, chunks_of: int, steps: int, regime: str, lora: int = 0,
        ckpt: bool = False, check_grads: bool = True, dtype: str = "fp32", zero: dict | None = None) -> dict:
    """``steps`` optimizer steps; each reads the window of ``chunks_of`` micro-batches of ``micro`` examples, as
    ``ga`` micro-steps of ``chunks_of // ga`` batches each (ZeRO-3: ga = chunks_of; layered: ga = 1)."""
    engine = _engine(block, ga, micro * chunks_of // ga, regime, lora, ckpt, dtype, zero)
    reference = _Reference64(engine, lora) if check_grads else None
    cast = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    losses, errors = [], []
    keys = ("intra_node_allgather_calls", "inter_node_allgather_calls", "intra_node_allgather_bytes",
            "inter_node_allgather_bytes")
    per_step = dict.fromkeys(keys, 0.0)
    for step in range(steps):
        window = _window(step, chunks_of, micro)
        exact = _exact_grads(engine, window, lora) if check_grads else {}  # its gathers are not the window's
        if reference is not None:
            reference.step(window)
        before = fcdp_deepspeed.get_stats(engine)
        per = chunks_of // ga
        window_loss = 0.0
        for m in range(ga):
            part = window[m * per:(m + 1) * per]
            x, y = torch.cat([p[0] for p in part]), torch.cat([p[1] for p in part])
            loss = F.mse_loss(engine(x.to(cast)).float(), y)
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and check_grads:
                errors.append(_grad_error(engine, exact))
            engine.step()
            window_loss += loss.item() / ga
        losses.append(window_loss)
        after = fcdp_deepspeed.get_stats(engine)
        for k in keys:
            per_step[k] += (after.get(k, 0) - before.get(k, 0)) / steps
    weights = toy.gather_weights(engine)
    stats = fcdp_deepspeed.get_stats(engine)
    rank0 = dist.get_rank() == 0
    return {"losses": losses, "grad_errors": errors, "weights": weights if rank0 else {},
            "reference_weights": reference.weights() if reference is not None and rank0 else {},
            "stats": {k: v for k, v in stats.items() if k.startswith(("layered_", "paths", "cache_"))}, "per_step": per_step}


def compare(regime: str = "large", chunks: int = 4, micro: int = 2, steps: int = 3, lora: int = 0,
            ckpt: bool = False, fcdp_extra: dict | None = None, ranks_per_node: int = 2, dtype: str = "fp32",
            zero: dict | None = None, with_whole: bool = True, layered_extra: dict | None = None) -> dict:
    """ZeRO-3 accumulating ``chunks`` micro-steps, FCDP without layered at GA 1 over the whole window (the
    gathers a window should cost), and FCDP layered in ``chunks`` chunks at GA 1."""
    setup(ranks_per_node)
    fcdp = {"enabled": True, "ranks_per_node": ranks_per_node, **(fcdp_extra or {})}
    common = dict(micro=micro, chunks_of=chunks, steps=steps, regime=regime, lora=lora, ckpt=ckpt, dtype=dtype,
                  zero=zero, check_grads=dtype == "fp32")
    out = {"zero3": run(None, ga=chunks, **common),
           "layered": run({**fcdp, "layered": {"chunks": chunks, **(layered_extra or {})}}, ga=1, **common)}
    if with_whole:
        out["whole"] = run(fcdp, ga=1, **{**common, "check_grads": False})
    dist.barrier()
    return out


def gathers(regime: str = "large", chunks: int = 4, micro: int = 2, steps: int = 2, link: str = "slow",
            ranks_per_node: int = 2) -> dict:
    """All-gather calls and bytes per step (``get_stats``): the window as one batch without ``fcdp.layered``, and
    layered in ``chunks`` chunks, on the paths ``link`` declares (no check between the steps)."""
    setup(ranks_per_node)
    fcdp = {"enabled": True, "ranks_per_node": ranks_per_node, "link": link}
    common = dict(ga=1, micro=micro, chunks_of=chunks, steps=steps, regime=regime, check_grads=False)
    out = {"whole": run(fcdp, **common)["per_step"], "layered": run({**fcdp, "layered": chunks}, **common)["per_step"]}
    dist.barrier()
    return out


def _tiny_hf(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=3, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # tied embeddings


def hf_trainer(kind: str = "llama", chunks: int = 4, steps: int = 3, ranks_per_node: int = 2) -> dict:
    """The HF Trainer on a tiny ``kind`` model: ZeRO-3 accumulating ``chunks`` micro-batches of one sequence, and FCDP
    layered in ``chunks`` chunks of a batch of ``chunks`` sequences; losses logged and the final weights."""
    import json
    import os
    import tempfile

    from transformers import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    out = {}
    for name in ("zero3", "layered"):
        ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10**9}
        if name == "layered":
            ds["fcdp"] = {"enabled": True, "ranks_per_node": ranks_per_node, "layered": chunks}
        tmp = tempfile.mkdtemp()
        with open(os.path.join(tmp, "ds.json"), "w") as f:
            json.dump(ds, f)
        batch, ga = (1, chunks) if name == "zero3" else (chunks, 1)
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
                                 max_steps=steps, learning_rate=1e-3, deepspeed=os.path.join(tmp, "ds.json"),
                                 use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                                 disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0)
        trainer = Trainer(model=_tiny_hf(kind), args=args, train_dataset=Tokens())
        trainer.train()
        engine = trainer.model_wrapped
        weights = {}
        for n, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                weights[n] = p.detach().float().clone()
        stats = fcdp_deepspeed.get_stats(engine)
        out[name] = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                     "weights": weights if dist.get_rank() == 0 else {},
                     "stats": {k: v for k, v in stats.items() if k.startswith("layered_")}}
    dist.barrier()
    return out
