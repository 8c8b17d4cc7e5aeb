"""Workers of test_diloco.py: DiLoCo across the 2 emulated nodes x 2 ranks, through ``deepspeed.initialize``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_deepspeed.reporting.engine_stats import stats_of
from fcdp_lab.harness import toy
from workers.common import DTYPES, LogCapture, fcdp_block, setup

HIDDEN = 32


def _config(dtype: str = "fp32", grad_accum: int = 1, loss_scale_power: int = 8, persist: bool = False,
            ranks_per_node: int = 2, **diloco) -> dict:
    block = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, **diloco}
    zero = {"stage3_param_persistence_threshold": 10**9} if persist else {}  # persist: every parameter stays gathered
    return toy.ds_config(fcdp_block(ranks_per_node, diloco=block), regime="large", dtype=dtype, grad_accum=grad_accum,
                         loss_scale_power=loss_scale_power, **zero)


def _step(engine, step: int, dtype: str, seed: int = 0) -> float:
    """One optimizer step of the toy regression on this rank's own data (``toy.batch`` depends on the rank)."""
    ga, mb = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    for micro in range(ga):
        x, y = toy.batch(step * ga + micro, mb, HIDDEN, seed)
        loss = F.mse_loss(engine(x.to(engine.device, DTYPES[dtype])).float(), y.to(engine.device))
        engine.backward(loss)
        engine.step()
    return loss.item()


def _spy(sync) -> list:
    """Record, around every step's DiLoCo hook, this rank's fp32 masters, 16-bit partitions and outer shards before
    and after it, and which fragment sync (if any) completed."""
    records, real = [], sync.after_step

    def spied(optimizer):
        snap = lambda ts: [t.detach().float().clone().view(-1) for t in ts]  # noqa: E731
        rec = {"local": snap(optimizer.fp32_partitioned_groups_flat), "outer": snap(sync.outer.params),
               "momentum": snap(sync.outer.momentum)}
        done = real(optimizer)
        rec.update(done=done, step=sync.steps, last=sync.last, in_flight=sync.pending is not None, outer_after=snap(sync.outer.params),
                   momentum_after=snap(sync.outer.momentum), master_after=snap(optimizer.fp32_partitioned_groups_flat),
                   partitions_after=snap(optimizer.fp16_partitioned_groups_flat),
                   diloco_bytes=stats_of(optimizer).get("inter_node_diloco_bytes", 0))
        records.append(rec)
        return done

    sync.after_step = spied
    return records


def train(steps: int = 7, dtype: str = "fp32", grad_accum: int = 1, lora_rank: int = 0, loss_scale_power: int = 8,
          persist: bool = False, activation_checkpointing: bool = False, ranks_per_node: int = 2, **diloco) -> dict:
    """Train ``steps`` steps; after every step gather this node's full model (a node-local gather)."""
    setup(ranks_per_node)
    if dtype == "fp16":  # [Note: fp16 on the CPU accelerator] in workers/grads.py
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    logs = LogCapture()
    engine = toy.build_engine(_config(dtype, grad_accum, loss_scale_power, persist, ranks_per_node, **diloco),
                              lora_rank=lora_rank,
                              activation_checkpointing=activation_checkpointing)
    sync = engine.optimizer.fcdp_diloco
    every_step = _spy(sync)
    weights, losses = [], []
    for step in range(steps):
        losses.append(_step(engine, step, dtype))
        weights.append(toy.gather_weights(engine))
    stats = fcdp_deepspeed.get_stats(engine)
    return {"records": [r for r in every_step if r["done"]], "every_step": every_step,
            "fragments": [[(p.group, p.start, p.length) for p in f] for f in sync.fragments], "weights": weights, "losses": losses, "stats": stats,
            "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
            "persistent": len(engine.optimizer.persistent_parameters),
            "forward": toy.evaluate(engine, torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(7)).to(
                engine.device, DTYPES[dtype])),
            "on_lines": logs.fcdp("ON for this engine", min_level=30), "rank": dist.get_rank(),
            "node_group_size": dist.get_world_size(group=engine.optimizer.dp_process_group),
            "partition_world": sorted({p.ds_zero_partition_world_size for p in engine.module.parameters()})}


class IndexData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return torch.tensor([float(i)])


def data() -> dict:
    """Which samples DeepSpeed's own loader hands this rank under DiLoCo, and the global batch."""
    setup()
    cfg = _config()
    fcdp_deepspeed.install()
    import deepspeed
    model = toy.ToyModel(HIDDEN, 2, 0, False)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg,
                                                training_data=IndexData())
    seen = sorted(int(b.item()) for batch in loader for b in batch.view(-1))
    return {"seen": seen, "train_batch_size": engine.train_batch_size(),
            "micro": engine.train_micro_batch_size_per_gpu(), "ga": engine.gradient_accumulation_steps()}


def checkpoint(ckpt_dir: str, save_at: int = 4, steps: int = 8, dtype: str = "fp32", **diloco) -> dict:
    """Run A trains ``steps`` straight; run B saves at ``save_at`` (mid-interval), a fresh engine (other init)
    loads it and trains on. Both return their losses and models after every step."""
    setup()
    out = {}
    cfg = _config(dtype, **diloco)
    engine = toy.build_engine(cfg)
    out["straight"] = [_step(engine, s, dtype) for s in range(steps)]
    out["straight_weights"] = toy.gather_weights(engine)
    out["straight_stats"] = {k: v for k, v in fcdp_deepspeed.get_stats(engine).items() if k.startswith("diloco_")}
    engine = toy.build_engine(cfg)
    out["before"] = [_step(engine, s, dtype) for s in range(save_at)]
    engine.save_checkpoint(ckpt_dir, tag="mid")
    engine = toy.build_engine(cfg, seed=123)  # another init: the load must overwrite everything
    engine.load_checkpoint(ckpt_dir, tag="mid")
    out["loaded_steps"] = engine.optimizer.fcdp_diloco.steps
    out["loaded_in_flight"] = engine.optimizer.fcdp_diloco.pending is not None
    out["after"] = [_step(engine, s, dtype) for s in range(save_at, steps)]
    out["resumed_weights"] = toy.gather_weights(engine)
    out["resumed_stats"] = {k: v for k, v in fcdp_deepspeed.get_stats(engine).items() if k.startswith("diloco_")}
    return out


def one_node(**diloco) -> str:
    """DiLoCo on a single node (4 ranks on one node): refused at build."""
    setup(ranks_per_node=4)
    cfg = toy.ds_config({**fcdp_block(ranks_per_node=4), "diloco": {"sync_every": 2, **diloco}})
    try:
        toy.build_engine(cfg)
    except Exception as err:  # noqa: BLE001 - the test checks the message
        return f"{type(err).__name__}: {err}"
    return "built"


def core(**kwargs) -> dict:
    """One launch for the core tests: :func:`train`, then :func:`data` on a second engine."""
    return {**train(**kwargs), "data": data()}


def _load_error(cfg: dict, ckpt_dir: str, tag: str) -> str:
    engine = toy.build_engine(cfg, seed=123)
    try:
        engine.load_checkpoint(ckpt_dir, tag=tag)
    except Exception as err:  # noqa: BLE001 - the test checks the message
        return f"{type(err).__name__}: {err}"
    return "loaded"


def _universal(ckpt_dir: str, tag: str) -> None:
    """``ds_to_universal`` of ``ckpt_dir/tag`` into ``ckpt_dir/{tag}_universal`` (rank 0; the others wait)."""
    import subprocess
    import sys
    if dist.get_rank() == 0:
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        f"{ckpt_dir}/{tag}", "--output_folder", f"{ckpt_dir}/{tag}_universal", "--num_extract_workers",
                        "1", "--num_merge_workers", "1"], check=True, capture_output=True, timeout=300)
    dist.barrier()


def interop(ckpt_dir: str) -> dict:
    """Checkpoints across modes: DiLoCo (H = 3) saves right after a sync, exact FCDP saves; each rigid load into the
    other mode is refused with the fix; the universal conversion of each loads into the other (weights as saved;
    a DiLoCo engine then trains and syncs from them); zero_to_fp32 reads the DiLoCo tag directory (node 0's files)."""
    setup()
    out: dict = {}
    diloco_cfg, exact_cfg = _config(), toy.ds_config(fcdp_block(), regime="large")
    engine = toy.build_engine(diloco_cfg)
    for s in range(3):
        _step(engine, s, "fp32")
    out["diloco_weights"] = toy.gather_weights(engine)
    engine.save_checkpoint(ckpt_dir, tag="d")
    engine = toy.build_engine(exact_cfg)
    for s in range(2):
        _step(engine, s, "fp32")
    out["exact_weights"] = toy.gather_weights(engine)
    engine.save_checkpoint(ckpt_dir, tag="e")
    out["exact_into_diloco"] = _load_error(diloco_cfg, ckpt_dir, "e")
    out["diloco_into_exact"] = _load_error(exact_cfg, ckpt_dir, "d")
    if dist.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        out["zero_to_fp32"] = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="d")
    for tag in ("d", "e"):
        _universal(ckpt_dir, tag)
    universal = {"checkpoint": {"load_universal": True}}
    engine = toy.build_engine({**exact_cfg, **universal}, seed=123)
    engine.load_checkpoint(ckpt_dir, tag="d_universal")
    out["exact_from_diloco"] = toy.gather_weights(engine)
    engine = toy.build_engine({**diloco_cfg, **universal}, seed=123)
    engine.load_checkpoint(ckpt_dir, tag="e_universal")
    sync = engine.optimizer.fcdp_diloco
    out["diloco_from_exact"] = toy.gather_weights(engine)
    out["outer_is_loaded_master"] = all(torch.equal(o, m.detach().view(-1).float()) for o, m in
                                        zip(sync.outer.params, engine.optimizer.fp32_partitioned_groups_flat))
    losses = [_step(engine, s, "fp32") for s in range(3)]
    out["after_universal"] = {"losses": losses, "syncs": sync.syncs, "weights": toy.gather_weights(engine)}
    return out


def warmup(steps: int = 8, warmup_steps: int = 2, sync_every: int = 3) -> dict:
    """DiLoCo after ``warmup_steps`` exact steps, and plain ZeRO-3 over the world on the same per-rank data for the
    warm-up's steps (the exact job the warm-up must follow)."""
    res = train(steps=steps, sync_every=sync_every, warmup_steps=warmup_steps)
    engine = toy.build_engine(toy.ds_config(None, regime="large"))
    exact = []
    for step in range(warmup_steps):
        _step(engine, step, "fp32")
        exact.append(toy.gather_weights(engine))
    res["exact_weights"] = exact
    return res


def four_nodes_warmup(steps: int = 5, warmup_steps: int = 2, sync_every: int = 3) -> dict:
    """DiLoCo with its exact warm-up on 4 nodes x 1 rank (the two-stage average), and the two averages side by side
    on the same random pieces over the same peers (fp32 and bf16; a padded last slice and none)."""
    from fcdp_deepspeed.diloco.warmup import average_over_peers_
    res = train(steps=steps, sync_every=sync_every, warmup_steps=warmup_steps, ranks_per_node=1)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    pair = {}
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1001, 1024):
            piece = torch.randn(numel, generator=gen).to(dtype)
            two, one = piece.clone(), piece.clone()
            sent = (average_over_peers_([two], None, 4), average_over_peers_([one], None, 4, two_stage=False))
            pair[(str(dtype), numel)] = {"two_stage": two, "all_gather": one, "sent": sent, "piece": piece}
    res["pair"] = pair
    return res


def four_nodes(steps: int = 6, sync_every: int = 3) -> dict:
    """DiLoCo on 4 nodes x 1 rank (the two-stage exchange), and the two exchanges side by side on the same
    random messages over the same peers."""
    from fcdp_deepspeed.diloco.exchange import PseudoGradExchange
    res = train(steps=steps, sync_every=sync_every, ranks_per_node=1)
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    pair = {}
    for numel in (1001, 1024):  # a padded last slice, and none
        delta = torch.randn(numel, generator=gen)
        two, one = PseudoGradExchange(None, None, 4), PseudoGradExchange(None, None, 4, blocking=False)
        pair[numel] = {"two_stage": two.average(delta, None), "all_gather": one.average(delta, None),
                       "flags": (two.two_stage, one.two_stage), "sent": (two.sent_bytes, one.sent_bytes),
                       "delta": delta}
    res["pair"] = pair
    return res


def save_with_dp_two(ckpt_dir: str) -> None:
    """DiLoCo on 2 nodes x 1 rank (data-parallel world 2): one step, then save tag "dp2"."""
    setup(ranks_per_node=1)
    engine = toy.build_engine(_config(ranks_per_node=1))
    _step(engine, 0, "fp32")
    engine.save_checkpoint(ckpt_dir, tag="dp2")


def load_dp_two_into_four(ckpt_dir: str) -> str:
    """DiLoCo on 2 nodes x 2 ranks (data-parallel world 4) loading :func:`save_with_dp_two`'s checkpoint rigidly:
    this rank's error message ("loaded" if it loaded)."""
    setup()
    return _load_error(_config(), ckpt_dir, "dp2")
