"""A plain-PyTorch reference of ``python -m fcdp_lab converge``'s fp32 training, exact or DiLoCo: one process, no DeepSpeed engine,
no ZeRO, no collectives, to tell an implementation bug from the algorithm's own behaviour.

It trains what a converge setting trains: the same initial weights, the same per-rank batches (``textdata``), AdamW
as DeepSpeed's ``"Adam"`` with ``torch_adam`` builds it, DeepSpeed's own ``WarmupDecayLR``, ZeRO-3's clipping
formula over each replica's gradient; exact: one replica fed every rank's batch (the mean gradient); DiLoCo
(``diloco{H}...`` names, :func:`converge.diloco_block`): one replica per node with its own AdamW and clipping, and
every ``sync_every`` steps the outer SGD step of ``diloco/outer.py`` on the nodes' mean pseudo-gradient
``outer - local``, after which every replica holds the outer parameters. ``single`` trains node 0 alone.

    python -m fcdp_lab.converge.reference --setting diloco10_lr1_mom0 --steps 500

prints the final held-out loss on all held-out windows, as ``python -m fcdp_lab converge``'s final evaluation (which for DiLoCo
follows a sync when ``steps`` is a multiple of ``sync_every``).
"""
from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass, field
from typing import Optional

import torch

from fcdp_lab.converge import converge, textdata, tinylm


@dataclass
class Replica:
    """One node's model, its inner optimizer and LR schedule, and the ranks whose batches it trains on."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: object
    ranks: list = field(default_factory=list)


def clip_(params: list, max_norm: float) -> None:
    """ZeRO-3's clipping (``unscale_and_clip_grads``): divide by ``(norm + 1e-6) / max_norm`` when that is > 1."""
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in params)).item()
    c = (norm + 1e-6) / max_norm
    if max_norm > 0 and c > 1:
        for p in params:
            p.grad.div_(c)


def heldout_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, x.shape[0], batch):
            logits = model(x[i:i + batch])
            total += torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                       y[i:i + batch].reshape(-1), reduction="sum").item()
            tokens += y[i:i + batch].numel()
    model.train()
    return total / tokens


def _replicas(s: converge.ConvergeSpec, setting: str, base: torch.nn.Module, lr: float) -> list[Replica]:
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    rpn, world = s.ranks_per_node, s.nodes * s.ranks_per_node
    if setting == "exact":
        groups = [list(range(world))]
    elif setting == "single":
        groups = [list(range(rpn))]
    else:
        groups = [list(range(n * rpn, (n + 1) * rpn)) for n in range(s.nodes)]
    out = []
    for ranks in groups:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = WarmupDecayLR(opt, total_num_steps=s.steps, warmup_min_lr=0.0, warmup_max_lr=lr,
                              warmup_num_steps=s.warmup_steps, warmup_type="linear")
        out.append(Replica(model, opt, sched, ranks))
    return out


@torch.no_grad()
def outer_sync(replicas: list[Replica], outer: list, momentum: list, block: dict) -> None:
    """``diloco/outer.py``'s step on the replicas' mean pseudo-gradient; every replica := the new outer values."""
    from fcdp_deepspeed.config.diloco import DiLoCoConfig
    defaults = DiLoCoConfig()  # the engine's defaults for what the setting name leaves out
    lr, mu = block.get("outer_lr", defaults.outer_lr), block.get("outer_momentum", defaults.outer_momentum)
    nesterov = block.get("nesterov", defaults.nesterov)
    params = [list(r.model.parameters()) for r in replicas]
    for i, o in enumerate(outer):
        g = sum(o - ps[i] for ps in params) / len(params)
        momentum[i].mul_(mu).add_(g)
        update = g.add(momentum[i], alpha=mu) if nesterov else momentum[i].clone()
        o.sub_(lr * update)
        for ps in params:
            ps[i].copy_(o)


@torch.no_grad()
def average_grads_(replicas: list[Replica]) -> None:
    """Every replica's gradients := the replicas' mean (the exact warm-up: replicas stay equal)."""
    grads = [[p.grad for p in r.model.parameters()] for r in replicas]
    for i in range(len(grads[0])):
        mean = sum(g[i] for g in grads) / len(grads)
        for g in grads:
            g[i].copy_(mean)


def train(s: converge.ConvergeSpec, setting: str, final_eval: bool = True) -> dict:
    """``train_losses`` (the mean over ranks per step, as converge records them) and ``final_heldout_loss``."""
    block: Optional[dict] = converge.diloco_block(setting)
    if block is not None and (block.get("compression", "off") != "off" or block.get("fragments", 1) != 1):
        raise ValueError(f"{setting}: the reference has no codec and no fragments")
    lr = s.lr * converge.inner_lr_scale(setting)
    split = textdata.split_corpus(textdata.corpus_bytes())
    train_tokens, held_tokens = textdata.as_tokens(split.train), textdata.as_tokens(split.heldout)
    cfg = tinylm.LMConfig(context=s.context, width=s.width, layers=s.layers, heads=s.heads)
    base = tinylm.build(cfg, seed=s.seed)
    replicas = _replicas(s, setting, base, lr)
    outer = [p.detach().clone() for p in base.parameters()]
    momentum = [torch.zeros_like(p) for p in outer]
    losses = []
    warmup = block.get("warmup_steps", 0) if block is not None else 0
    for step in range(s.steps):
        step_losses = []
        for rep in replicas:
            rep.opt.zero_grad(set_to_none=True)
            for micro in range(s.grad_accum):
                for r in rep.ranks:
                    x, y = textdata.train_batch(train_tokens, s.context, s.micro_batch, seed=s.seed,
                                                step=step * s.grad_accum + micro, rank=r)
                    loss = tinylm.loss_fn(rep.model(x), y)
                    (loss / (len(rep.ranks) * s.grad_accum)).backward()  # the replica's mean gradient
                    step_losses.append(loss.item())
        if step < warmup:  # exact data parallelism across the nodes: every replica steps on the mean gradient
            average_grads_(replicas)
        for rep in replicas:
            clip_(list(rep.model.parameters()), s.grad_clip)
            rep.opt.step()
            rep.sched.step()
        if step + 1 == warmup:
            for o, p in zip(outer, replicas[0].model.parameters()):
                o.copy_(p.detach())
        losses.append(sum(step_losses) / len(step_losses))
        if block is not None and step >= warmup and (step + 1 - warmup) % block["sync_every"] == 0:
            outer_sync(replicas, outer, momentum, block)
    out = {"setting": setting, "steps": s.steps, "train_losses": losses}
    if final_eval:
        x, y = textdata.heldout_windows(held_tokens, s.context)
        world = s.nodes * s.ranks_per_node
        shards = [textdata.shard(x, y, r, world) for r in range(world)]  # converge evaluates each rank's shard
        hx, hy = torch.cat([a for a, _ in shards]), torch.cat([b for _, b in shards])
        out["final_heldout_loss"] = heldout_loss(replicas[0].model, hx, hy, s.eval_batch)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fcdp_lab.converge.reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = converge.ConvergeSpec()
    ap.add_argument("--setting", required=True, help="exact, single (node 0 alone) or diloco{H}[_lr..][_mom..][_hb][_ilr..]")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--micro-batch", type=int, default=d.micro_batch)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the record (with every step's train loss) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = converge.ConvergeSpec(steps=args.steps, micro_batch=args.micro_batch, lr=args.lr)
    rec = train(s, args.setting)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f)
    print(json.dumps({k: v for k, v in rec.items() if k != "train_losses"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
