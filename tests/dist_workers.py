"""Functions that run on every rank of a spawned gloo group (see conftest.run_ranks).

Each returns plain data (losses, weights, stats) for the test process to compare.
"""
from __future__ import annotations

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_deepspeed.tools import toy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def setup(ranks_per_node: int = 2) -> None:
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(ranks_per_node=ranks_per_node)


def fcdp_block(ranks_per_node: int = 2, **extra) -> dict:
    return {"enabled": True, "ranks_per_node": ranks_per_node, **extra}


def run_scenario(sc: dict, fcdp: bool, ranks_per_node: int = 2) -> toy.RunResult:
    dtype = sc.get("dtype", "fp32")
    cfg = toy.ds_config(fcdp_block(ranks_per_node, **sc.get("fcdp", {})) if fcdp else None,
                        regime=sc.get("regime", "large"), grad_accum=sc.get("grad_accum", 1), dtype=dtype,
                        loss_scale_power=sc.get("loss_scale_power", 8),
                        **sc.get("zero", {}))
    engine = toy.build_engine(cfg, lora_rank=sc.get("lora_rank", 0), activation_checkpointing=sc.get("ckpt", False),
                              zero_init=sc.get("zero_init", False), layers=sc.get("layers", 4))
    res = toy.train(engine, sc.get("steps", 3), record_step_stats=True, record_phases=True, dtype=DTYPES[dtype])
    weights = toy.gather_weights(engine)  # collective: every rank gathers, rank 0 reports
    res.weights = weights if dist.get_rank() == 0 else {}
    res.extra["optimizer_class"] = type(engine.optimizer).__name__
    return res


def parity(scenarios: list[dict], ranks_per_node: int = 2) -> dict:
    """Every scenario twice, plain ZeRO-3 then FCDP, in one process group."""
    setup(ranks_per_node)
    return {sc["name"]: {mode: run_scenario(sc, mode == "fcdp", ranks_per_node) for mode in ("plain", "fcdp")}
            for sc in scenarios}


def stale_probe(break_invalidation: bool, verify: bool = False, steps: int = 3) -> dict:
    """Train with FCDP, optionally with invalidation switched off, to show a stale cache is caught."""
    from fcdp_deepspeed.runtime import FCDPRuntime, StaleCacheError
    setup()
    if break_invalidation:
        FCDPRuntime.invalidate_params = lambda self, params, reason: 0
        FCDPRuntime.invalidate_changed = lambda self: None
    sc = {"fcdp": {"verify": True}} if verify else {}
    plain = run_scenario({"steps": steps}, fcdp=False)
    try:
        fcdp = run_scenario({"steps": steps, **sc}, fcdp=True)
    except StaleCacheError as err:
        return {"raised": str(err), "plain": plain.losses}
    return {"raised": None, "plain": plain.losses, "fcdp": fcdp.losses, "stats": fcdp.stats}


def launcher_parity(steps: int = 3) -> dict:
    """Under a real launcher: the node layout comes from its environment, not from an override."""
    setup(ranks_per_node=None)
    out = {mode: run_scenario({"steps": steps}, mode == "fcdp", ranks_per_node=None) for mode in ("plain", "fcdp")}
    import os
    out["env"] = {k: os.environ.get(k) for k in ("GROUP_RANK", "CROSS_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "RANK")}
    return out


def _inter(engine) -> int:
    return fcdp_deepspeed.get_stats(engine)["inter_node_allgather_bytes"]


def peft_traffic(steps: int = 4, hidden: int = 256, lora_rank: int = 1, grad_accum: int = 1) -> dict:
    """LoRA-style model (frozen base), plain vs FCDP: per-step traffic, then two evals after training."""
    setup()
    out = {}
    for mode in ("plain", "fcdp"):
        cfg = toy.ds_config(fcdp_block() if mode == "fcdp" else None, regime="large", grad_accum=grad_accum)
        engine = toy.build_engine(cfg, hidden=hidden, lora_rank=lora_rank)
        res = toy.train(engine, steps, hidden=hidden, record_step_stats=True, record_phases=True)
        x_eval = torch.randn(2, hidden, generator=torch.Generator().manual_seed(123))
        evals = []
        for _ in range(2):
            before = _inter(engine)
            output = toy.evaluate(engine, x_eval)
            evals.append({"inter": _inter(engine) - before, "output": output})
        res.stats = fcdp_deepspeed.get_stats(engine)
        weights = toy.gather_weights(engine)
        res.weights = {k: v for k, v in weights.items() if "lora_" in k} if dist.get_rank() == 0 else {}
        res.extra["evals"] = evals
        res.extra["trainable_numel"] = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
        out[mode] = res
    return out


def _forward(engine, hidden: int) -> torch.Tensor:
    return toy.evaluate(engine, torch.randn(2, hidden, generator=torch.Generator().manual_seed(7)))


def _edit_frozen(engine, delta: float) -> None:
    """``GatheredParameters(modifier_rank=0)``: rank 0 edits a frozen weight, DeepSpeed broadcasts it."""
    param = engine.module.blocks[1].fc.weight
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if dist.get_rank() == 0:
            param.data.add_(delta)


def invalidation_events(ckpt_dir: str, hidden: int = 64, lora_rank: int = 2) -> dict:
    """Every value-changing event, plain vs FCDP: outputs and losses after each must be identical."""
    setup()
    out: dict = {}
    for mode in ("plain", "fcdp"):
        rec: dict = {}
        cfg = toy.ds_config(fcdp_block() if mode == "fcdp" else None, regime="large")
        engine = toy.build_engine(cfg, hidden=hidden, lora_rank=lora_rank)
        train = lambda n, seed: toy.train(engine, n, hidden=hidden, seed=seed).losses  # noqa: E731
        rec["warm"] = train(2, 0)
        engine.save_checkpoint(ckpt_dir, tag=f"{mode}-s2")
        rec["warm_fwd"] = _forward(engine, hidden)  # re-fills the cache the save flushed
        # 1. GatheredParameters edit of a frozen (cached) weight on rank 0 only.
        _edit_frozen(engine, 0.5)
        rec["after_edit_fwd"] = _forward(engine, hidden)
        rec["after_edit_train"] = train(2, 1)
        # 2. load_checkpoint restores frozen + trainable values written before the edit.
        engine.load_checkpoint(ckpt_dir, tag=f"{mode}-s2")
        rec["after_load_fwd"] = _forward(engine, hidden)
        rec["after_load_train"] = train(1, 2)
        # 3. 16-bit consolidation in the middle of training.
        engine.save_16bit_model(ckpt_dir, f"{mode}-model.bin")
        rec["after_16bit_train"] = train(2, 3)
        # 4. Unfreeze a frozen (cached) layer between steps, then freeze a trainable one.
        unfrozen = engine.module.blocks[0].fc.weight
        before = toy.gather_weights(engine)["blocks.0.fc.weight"]
        unfrozen.requires_grad = True
        rec["after_unfreeze_train"] = train(2, 4)
        rec["unfrozen_changed"] = not torch.equal(before, toy.gather_weights(engine)["blocks.0.fc.weight"])
        engine.module.blocks[2].lora_a.requires_grad = False
        rec["after_freeze_train"] = train(2, 5)
        rec["stats"] = fcdp_deepspeed.get_stats(engine)
        weights = toy.gather_weights(engine)
        rec["weights"] = weights if dist.get_rank() == 0 else {}
        # A fresh plain engine (different init) loading the checkpoint is the reference for the load.
        fresh = toy.build_engine(toy.ds_config(None, regime="large"), hidden=hidden, lora_rank=lora_rank, seed=99)
        fresh.load_checkpoint(ckpt_dir, tag=f"{mode}-s2")
        rec["fresh_load_fwd"] = _forward(fresh, hidden)
        out[mode] = rec
    return out


def hf_run(**kwargs) -> dict:
    """examples/hf_lora.py's ``run`` on this rank (HF Trainer or accelerate)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "hf_lora.py")
    spec = importlib.util.spec_from_file_location("hf_lora_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(**kwargs)


class _Capture:
    """Collect FCDP's log records (warnings about budgets, degraded parameters)."""

    def __init__(self) -> None:
        import logging
        from deepspeed.utils import logger
        self.messages: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: self.messages.append(record.getMessage())  # type: ignore[assignment]
        handler.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.setLevel(min(logger.level or logging.INFO, logging.INFO))

    def fcdp(self, needle: str = "") -> list[str]:
        return [m for m in self.messages if m.startswith("fcdp:") and needle in m]


def placement_modes(steps: int = 5, host_budget_bytes: int = 0) -> dict:
    """Plain ZeRO-3 vs each cache_device mode and a host budget smaller than the model."""
    setup()
    capture = _Capture()
    variants = {
        "plain": None,
        "host": {"cache_device": "host"},
        "device": {"cache_device": "device"},
        "auto": {"cache_device": "auto"},
        "small_budget": {"cache_device": "host", "host_budget": host_budget_bytes},
    }
    out = {}
    for name, extra in variants.items():
        before = len(capture.messages)
        sc = {"steps": steps, "fcdp": extra or {}}
        res = run_scenario(sc, fcdp=extra is not None)
        res.extra["log"] = [m for m in capture.messages[before:] if m.startswith("fcdp:")]
        out[name] = res
    return out


def policy_and_reference(steps: int = 3, fcdp: bool = True) -> dict:
    """RLHF-style: a trained policy and a frozen reference model, each built under its own
    zero.Init context in one process; the reference engine has no optimizer."""
    setup()
    cfg = toy.ds_config(fcdp_block() if fcdp else None, regime="large")
    ref_cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
    import fcdp_deepspeed as fd
    fd.install()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        policy = toy.ToyModel(32, 4, lora_rank=2)
    torch.manual_seed(1)
    with deepspeed.zero.Init(config_dict_or_path=ref_cfg):
        reference = toy.ToyModel(32, 4)
    for p in reference.parameters():
        p.requires_grad = False
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=[p for p in policy.parameters() if p.requires_grad],
                                      config=cfg)
    ref_engine, *_ = deepspeed.initialize(model=reference, config=ref_cfg)
    out = {"losses": [], "ref_outputs": [], "ref_inter": [], "classes": [type(engine.optimizer).__name__,
                                                                         type(ref_engine.optimizer).__name__]}
    for step in range(steps):
        x, y = toy.batch(step, 4, 32)
        before = fd.get_stats(ref_engine)["inter_node_allgather_bytes"]
        ref_out = toy.evaluate(ref_engine, x)
        out["ref_inter"].append(fd.get_stats(ref_engine)["inter_node_allgather_bytes"] - before)
        out["ref_outputs"].append(ref_out)
        loss = torch.nn.functional.mse_loss(engine(x), y) + 0.1 * torch.nn.functional.mse_loss(engine(x), ref_out)
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    out["ref_stats"] = fd.get_stats(ref_engine)
    out["policy_stats"] = fd.get_stats(engine)
    return out


def monitor_csv(out_dir: str, steps: int = 3) -> dict:
    """DeepSpeed's csv monitor enabled: FCDP's counters land next to the engine's own."""
    setup()
    cfg = toy.ds_config(fcdp_block(), regime="large")
    cfg.update(steps_per_print=1, csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "fcdp"})
    engine = toy.build_engine(cfg)
    toy.train(engine, steps)
    return fcdp_deepspeed.get_stats(engine)


class MiniMPU:
    """The part of Megatron's ``mpu`` that DeepSpeed uses, built the way Megatron builds groups:
    tensor-parallel peers are adjacent ranks, data-parallel groups stride over them."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp = tp
        self.tp_groups = [list(range(i, i + tp)) for i in range(0, world, tp)]
        self.dp_groups = [list(range(j, world, tp)) for j in range(tp)]
        self._tp = self._dp = None
        for ranks in self.tp_groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks)
            if rank in ranks:
                self._tp, self._tp_ranks = g, ranks
        for ranks in self.dp_groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                self._dp, self._dp_ranks = g, ranks

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self):
        return self._dp_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self):
        return len(self._dp_ranks)

    def get_model_parallel_group(self):
        return self._tp

    def get_model_parallel_rank(self):
        return self._tp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self):
        return self.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self._tp_ranks[0]


def megatron_layout(steps: int = 3, tp: int = 2, ranks_per_node: int = 4) -> dict:
    """TP=tp on the world: ZeRO's DP group is a strict subgroup; TP peers hold different weights and
    data. Plain ZeRO-3, FCDP (node ∩ DP groups) and ZeRO++ hpZ (contiguous blocks) side by side."""
    setup(ranks_per_node)
    mpu = MiniMPU(tp)
    tp_rank = mpu.get_model_parallel_rank()
    import fcdp_deepspeed as fd
    fd.install()
    out = {}
    for name in ("plain", "fcdp", "hpz"):
        cfg = toy.ds_config(fcdp_block(ranks_per_node) if name == "fcdp" else None, regime="large",
                            hpz=ranks_per_node // tp if name == "hpz" else 0)
        torch.manual_seed(100 + tp_rank)  # TP peers hold different values
        with deepspeed.zero.Init(config_dict_or_path=cfg, mpu=mpu, data_parallel_group=mpu.get_data_parallel_group()):
            model = toy.ToyModel(32, 4)
        try:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
            res = toy.train(engine, steps, seed=tp_rank)  # different data per TP rank too
            out[name] = {"losses": res.losses, "stats": res.stats}
        except Exception as err:  # noqa: BLE001 - hpZ may refuse this layout outright
            out[name] = {"error": f"{type(err).__name__}: {err}"}
            if name != "hpz":
                raise
    out["dp_ranks"] = mpu._dp_ranks
    return out


class EdgeModel(torch.nn.Module):
    """Parameters FCDP must survive: tiny (< L elements), sizes not divisible by L, zero-size, tied
    weights used by two modules, a module reused twice, and an external parameter."""

    def __init__(self, hidden: int = 30, zero_size: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(hidden, hidden)  # 30x30 + 30: not divisible by 4
        self.tiny = torch.nn.Linear(hidden, 1)  # bias of 1 element (< L)
        self.back = torch.nn.Linear(1, hidden, bias=False)
        self.shared = torch.nn.Linear(hidden, hidden)  # called twice per forward
        self.head = torch.nn.Linear(hidden, hidden, bias=False)
        self.head.weight = self.emb.weight  # tied with emb
        self.empty = torch.nn.Parameter(torch.empty(0)) if zero_size else None  # zero-size
        self.ext = torch.nn.Linear(hidden, hidden)
        self.gate = torch.nn.Linear(hidden, hidden, bias=False)  # never called: its weight is used by
        # the parent's forward, i.e. external to its owner (registered after partitioning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        h = h + self.back(torch.tanh(self.tiny(h)))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h)) + 0.1 * torch.nn.functional.linear(h, self.gate.weight)
        out = self.head(h + self.ext(h))
        return out + self.empty.sum() if self.empty is not None else out


def edge_parameters(steps: int = 4, persistence_threshold: int = 0, dtype: str = "fp32", zero_size: bool = False,
                    modes: tuple = ("plain", "fcdp")) -> dict:
    setup()
    out = {}
    import fcdp_deepspeed as fd
    fd.install()
    for mode in modes:
        cfg = toy.ds_config(fcdp_block() if mode == "fcdp" else None, regime="large", dtype=dtype,
                            stage3_param_persistence_threshold=persistence_threshold)
        torch.manual_seed(0)
        model = EdgeModel(zero_size=zero_size)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        deepspeed.zero.register_external_parameter(engine.module, engine.module.gate.weight)
        res = toy.train(engine, steps, hidden=30, dtype=DTYPES[dtype])
        res.weights = toy.gather_weights(engine)
        if dist.get_rank() != 0:
            res.weights = {}
        out[mode] = res
    return out


def degraded_allocation(steps: int = 4, chunk_bytes: int = 4096) -> dict:
    """Pool chunks fail to allocate on one rank (FCDP_INJECT_FAULT): the parameters in them must
    take the plain ZeRO-3 path on every rank, with a warning, and training must stay identical."""
    from fcdp_deepspeed import cache
    cache.CHUNK_BYTES = chunk_bytes  # several chunks, so only some parameters are affected
    setup()
    capture = _Capture()
    plain = run_scenario({"steps": steps}, fcdp=False)
    fcdp = run_scenario({"steps": steps}, fcdp=True)
    return {"plain": plain.losses, "fcdp": fcdp.losses, "stats": fcdp.stats, "log": capture.fcdp()}


def crash_mid_step(ckpt_dir: str, victim: int = 3) -> None:
    """Save a checkpoint after 2 steps, then one rank dies in the middle of step 4."""
    import os
    import signal
    setup()
    cfg = toy.ds_config(fcdp_block(), regime="large")
    engine = toy.build_engine(cfg, lora_rank=2)
    toy.train(engine, 2)
    engine.save_checkpoint(ckpt_dir, tag="step2")
    toy.train(engine, 1, seed=1)
    x, _ = toy.batch(99, 4, 32)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after the forward gathers of the others began
    engine(x)
    dist.barrier()


def resume(ckpt_dir: str, fcdp: bool, tag: str = "step2", steps: int = 3) -> dict:
    """A fresh job loads the checkpoint and trains on."""
    setup()
    cfg = toy.ds_config(fcdp_block() if fcdp else None, regime="large")
    engine = toy.build_engine(cfg, lora_rank=2, seed=42)  # different init: the load must overwrite it
    engine.load_checkpoint(ckpt_dir, tag=tag)
    res = toy.train(engine, steps, seed=7)
    weights = toy.gather_weights(engine)
    return {"losses": res.losses, "weights": weights if dist.get_rank() == 0 else {}}


def checkpoint_interop(ckpt_dir: str, steps: int = 2) -> dict:
    """Save with each engine; load each checkpoint into the other kind; 16-bit model save."""
    setup()
    out = {}
    for mode in ("plain", "fcdp"):
        cfg = toy.ds_config(fcdp_block() if mode == "fcdp" else None, regime="large")
        engine = toy.build_engine(cfg, lora_rank=2)
        toy.train(engine, steps)
        engine.save_checkpoint(ckpt_dir, tag=mode)
        engine.save_16bit_model(ckpt_dir, f"{mode}_16bit.bin")
        out[f"{mode}_losses_after_save"] = toy.train(engine, 1, seed=5).losses
    for loader in ("plain", "fcdp"):
        for saved in ("plain", "fcdp"):
            cfg = toy.ds_config(fcdp_block() if loader == "fcdp" else None, regime="large")
            engine = toy.build_engine(cfg, lora_rank=2, seed=123)
            engine.load_checkpoint(ckpt_dir, tag=saved)
            out[f"{loader}_loads_{saved}"] = _forward(engine, 32)
            out[f"{loader}_loads_{saved}_train"] = toy.train(engine, 2, seed=9).losses
    return out


def prefetch_soak(steps: int = 20) -> dict:
    """DeepSpeed's prefetching on (buckets of several params), params released after use, many
    steps and GA 2: cache fills, prefetched hits and invalidations interleave; FCDP must stay
    identical to ZeRO-3 throughout."""
    setup()
    out = {}
    for name, zero, lora in (("prefetch_release", {"stage3_prefetch_bucket_size": 3000, "stage3_max_reuse_distance": 0}, 0),
                             ("deepspeed_defaults_lora", {}, 2)):
        sc = {"steps": steps, "regime": "default", "zero": zero, "lora_rank": lora, "grad_accum": 2}
        runs = {mode: run_scenario(sc, mode == "fcdp") for mode in ("plain", "fcdp")}
        out[name] = {"plain": runs["plain"].losses, "fcdp": runs["fcdp"].losses, "stats": runs["fcdp"].stats}
    return out


def sleeper(seconds: float = 120) -> None:
    import time
    setup()
    time.sleep(seconds)


def topology_error(ranks_per_node=None) -> str:
    """Build an FCDP engine with a bad layout; return the error every rank raised."""
    setup(ranks_per_node=None)
    try:
        toy.build_engine(toy.ds_config(fcdp_block(ranks_per_node), regime="large"))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"
