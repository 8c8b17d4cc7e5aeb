"""The GPU check's case g: DiLoCo against its scaling-law anchor, in plain PyTorch on one GPU.

Charles et al., "Scaling Laws for DiLoCo" (arXiv 2503.09799, Table 4, M = 2 workers, H = 30): DiLoCo's evaluation
loss is 0.7% above data parallelism's at 35M parameters (0.5% at 90M), at about 20 tokens per parameter, with an
outer Nesterov SGD (momentum 0.9, outer learning rate 0.6-0.7 for two workers). On the CPU the product's DiLoCo was
judged at 1.33M parameters and 500 steps, where it ended 14% above exact and so did the plain-PyTorch reference
(``fcdp_lab/converge/reference.py``): the scale's miss, not the code's. This case runs the same algorithm at the
anchor's scale, where a GPU makes it minutes: two workers against data parallelism at the same tokens and the same
global batch, on real text that ships with Python (the standard library's source, byte-level), one model per worker
in one process.

- **Data parallelism**: one model, AdamW, every step on the global batch.
- **DiLoCo**: two models from the same initial weights, each with its own AdamW, each on its half of the global batch
  (the same windows DP reads, split); every ``sync_every`` steps the outer step on their mean pseudo-gradient
  ``outer - local`` (``diloco/outer.py``'s rule: Nesterov momentum, outer learning rate), after which both hold the
  outer parameters.

The step count fits the case's deadline: a few timed steps measure the step time and the run takes
``min(tokens_per_param x params, what fits) / tokens per step`` steps, rounded down to whole syncs; the report says
the tokens per parameter reached. ``dry_run``: a tiny model, a few syncs, on the CPU: the logic, not the scale.
"""
from __future__ import annotations

import copy
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fcdp_lab.converge import textdata, tinylm
from fcdp_lab.gpu.report import CaseResult

#: The anchor's gaps (DiLoCo M = 2, H = 30, against data parallelism), Table 4 of arXiv 2503.09799.
ANCHOR_GAP = {35e6: 0.007, 90e6: 0.005}


@dataclass(frozen=True)
class AnchorSpec:
    width: int = 384
    layers: int = 6
    heads: int = 6
    context: int = 256
    batch: int = 64
    """Global batch in windows per step (each DiLoCo worker: half)."""
    tokens_per_param: float = 20.0
    sync_every: int = 30
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_lr: float = 3e-3
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    workers: int = 2
    seed: int = 0
    eval_windows: int = 256


DRY = AnchorSpec(width=48, layers=2, heads=2, context=32, batch=8, tokens_per_param=0.1, sync_every=3,
                 eval_windows=16)


def stdlib_source(limit: int = 0) -> bytes:
    """Every ``.py`` file of this Python's standard library (sorted by path), joined: real text, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    out, size = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        size += len(data)
        if limit and size >= limit:
            break
    return b"\n\n".join(out)


def _schedule(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10%: the multiplier of the inner learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class _Worker:
    def __init__(self, model: torch.nn.Module, spec: AnchorSpec, total: int) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=spec.inner_lr, weight_decay=spec.weight_decay,
                                     betas=(0.9, 0.95))
        warmup = max(1, int(spec.warmup_fraction * total))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: _schedule(s, total, warmup))
        self.clip = spec.grad_clip

    def step(self, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = tinylm.loss_fn(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        return loss.detach()


@torch.no_grad()
def _outer_step(workers: list[_Worker], outer: list, momentum: list, spec: AnchorSpec) -> None:
    params = [list(w.model.parameters()) for w in workers]
    for i, o in enumerate(outer):
        g = sum(o - ps[i].float() for ps in params) / len(params)
        momentum[i].mul_(spec.outer_momentum).add_(g)
        o.sub_(spec.outer_lr * g.add(momentum[i], alpha=spec.outer_momentum))  # Nesterov
        for ps in params:
            ps[i].copy_(o)


@torch.no_grad()
def _heldout(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> float:
    model.eval()
    total = 0.0
    for i in range(0, x.shape[0], 32):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x[i:i + 32])
        total += torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y[i:i + 32].reshape(-1),
                                                   reduction="sum").item()
    model.train()
    return total / y.numel()


def _batches(tokens: torch.Tensor, spec: AnchorSpec, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = textdata.train_batch(tokens, spec.context, spec.batch, seed=spec.seed, step=step, rank=0)
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def run(spec: AnchorSpec, device: str, budget_s: float) -> dict:
    """Data parallelism and DiLoCo at the same tokens; the held-out losses and the gap."""
    corpus = stdlib_source(limit=2**21 if device == "cpu" else 0)
    split = textdata.split_corpus(corpus)
    train, held = textdata.as_tokens(split.train), textdata.as_tokens(split.heldout)
    hx, hy = textdata.heldout_windows(held, spec.context, spec.eval_windows)
    hx, hy = hx.to(device), hy.to(device)
    cfg = tinylm.LMConfig(context=spec.context, width=spec.width, layers=spec.layers, heads=spec.heads)
    base = tinylm.build(cfg, seed=spec.seed).to(device)
    params = sum(p.numel() for p in base.parameters())
    autocast = device == "cuda"
    tokens_per_step = spec.batch * spec.context

    # time a few steps of data parallelism (a throwaway copy), then fit the run into the budget: DP + DiLoCo
    probe = _Worker(copy.deepcopy(base), spec, 100)
    for s in range(3):
        probe.step(*_batches(train, spec, s, device), autocast)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(5):
        probe.step(*_batches(train, spec, s, device), autocast)
    if device == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / 5
    del probe
    wanted = int(spec.tokens_per_param * params / tokens_per_step)
    # DP, then DiLoCo: two half-batch models, up to twice a DP step where kernel launches bound a small model
    fits = int(budget_s / (3.2 * step_s))
    steps = max(spec.sync_every, min(wanted, fits) // spec.sync_every * spec.sync_every)

    out: dict = {"spec": asdict(spec), "params": params, "steps": steps, "step_s": step_s,
                 "tokens_per_param": steps * tokens_per_step / params, "corpus_bytes": len(corpus),
                 "corpus_sha256": split.sha256}
    t0 = time.perf_counter()
    dp = _Worker(copy.deepcopy(base), spec, steps)
    for s in range(steps):
        dp.step(*_batches(train, spec, s, device), autocast)
    out["dp_heldout"] = _heldout(dp.model, hx, hy, autocast)
    out["dp_seconds"] = time.perf_counter() - t0
    del dp

    t0 = time.perf_counter()
    workers = [_Worker(copy.deepcopy(base), spec, steps) for _ in range(spec.workers)]
    outer = [p.detach().float().clone() for p in base.parameters()]
    momentum = [torch.zeros_like(o) for o in outer]
    half = spec.batch // spec.workers
    for s in range(steps):
        x, y = _batches(train, spec, s, device)
        for k, w in enumerate(workers):
            w.step(x[k * half:(k + 1) * half], y[k * half:(k + 1) * half], autocast)
        if (s + 1) % spec.sync_every == 0:
            _outer_step(workers, outer, momentum, spec)
    out["diloco_heldout"] = _heldout(workers[0].model, hx, hy, autocast)
    out["diloco_seconds"] = time.perf_counter() - t0
    out["replicas_equal"] = all(torch.equal(a, b) for a, b in zip(workers[0].model.parameters(),
                                                                     workers[-1].model.parameters()))
    out["gap"] = out["diloco_heldout"] / out["dp_heldout"] - 1
    return out


def anchor_rank(dry_run: bool, budget_s: float) -> CaseResult:
    """Case g in its own process: the run, its numbers and checks."""
    res = CaseResult("g_diloco_anchor")
    device = "cpu" if dry_run else "cuda"
    spec = DRY if dry_run else AnchorSpec()
    rec = run(spec, device, budget_s)
    res.numbers.update({k: v for k, v in rec.items() if k != "spec"}, spec=rec["spec"])
    res.check("replicas equal after the last sync", rec["replicas_equal"])
    res.check("losses finite", math.isfinite(rec["dp_heldout"]) and math.isfinite(rec["diloco_heldout"]))
    res.check("at the anchor's scale (10-35M parameters)", 10e6 <= rec["params"] <= 35e6, f"{rec['params']:,}",
              applicable=not dry_run)
    # not a pass/fail of DiLoCo: the gap is the finding; the anchor's is 0.7% at 35M and 20 tokens per parameter
    # (2x: noise and a smaller model). Compared only where the run reached most of the anchor's tokens: an
    # undertrained gap says nothing about the anchor's.
    res.numbers["anchor_gap_35m"] = ANCHOR_GAP[35e6]
    reached = rec["tokens_per_param"] >= 0.75 * spec.tokens_per_param
    res.numbers["within_2x_anchor"] = (rec["gap"] <= 2 * ANCHOR_GAP[35e6]) if reached else None
    return res
