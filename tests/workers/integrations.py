"""Workers of test_integrations.py: a trained policy beside a frozen reference, DeepSpeed's monitor."""
from __future__ import annotations

import torch

import deepspeed

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import fcdp_block, setup


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


def two_engines_attribution(policy_fcdp: tuple = (False, True), steps: int = 2) -> dict:
    """A trained policy and an optimizer-less reference in one process, no ``enable_comm_counting``:
    per window (reference forward, policy step), each engine's and the process's counter deltas.
    One run per entry of ``policy_fcdp`` (the policy with or without FCDP)."""
    import os

    from deepspeed import comm as dist

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # what torchrun sets on 2 nodes x 2: the plain engines' layout
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    installed = fcdp_deepspeed.is_installed()  # by the startup hook: nothing here calls install()
    return {"installed": installed, "runs": [_policy_and_reference_windows(f, steps) for f in policy_fcdp]}


def _policy_and_reference_windows(policy_fcdp, steps: int) -> dict:
    """``policy_fcdp``: False (plain), True (FCDP, ZeRO-3's gradient path) or "auto" (FCDP, default gradient modes)."""
    block = fcdp_block(ranks_per_node=2, grad_reduce="auto") if policy_fcdp == "auto" else fcdp_block()
    cfg = toy.ds_config(block if policy_fcdp else None, regime="large")
    ref_cfg = {k: v for k, v in toy.ds_config(None, regime="large").items() if k != "optimizer"}
    torch.manual_seed(0)
    policy = toy.ToyModel(32, 4)
    torch.manual_seed(1)
    reference = toy.ToyModel(32, 4)
    for p in reference.parameters():
        p.requires_grad = False
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=cfg)
    ref_engine, *_ = deepspeed.initialize(model=reference, config=ref_cfg)

    def snap() -> dict:
        return {"policy": fcdp_deepspeed.get_stats(engine), "reference": fcdp_deepspeed.get_stats(ref_engine)}

    windows = []
    for step in range(steps):
        x, y = toy.batch(step, 4, 32)
        s0 = snap()
        ref_out = toy.evaluate(ref_engine, x)
        s1 = snap()
        loss = torch.nn.functional.mse_loss(engine(x), y) + 0.1 * torch.nn.functional.mse_loss(engine(x), ref_out)
        engine.backward(loss)
        engine.step()
        s2 = snap()
        windows.append({"reference_forward": _deltas(s0, s1), "policy_step": _deltas(s1, s2)})
    return {"windows": windows, "final": snap(),
            "classes": [type(engine.optimizer).__name__, type(ref_engine.optimizer).__name__]}


def _deltas(before: dict, after: dict) -> dict:
    """Per engine: the byte and call counters that changed; ``process``: the process-wide ones."""
    out = {}
    for name in ("policy", "reference"):
        b, a = before[name], after[name]
        out[name] = {k: a[k] - b.get(k, 0) for k in a
                     if k.endswith(("_bytes", "_calls")) and not k.startswith("process_") and isinstance(a[k], int)
                     and k not in ("host_cache_bytes", "device_cache_bytes", "host_pool_bytes", "device_pool_bytes",
                                   "pinned_pool_bytes", "uncached_bytes", "peak_device_memory_bytes", "h2d_async_bytes",
                                   "host_slot_bytes", "device_slot_bytes", "grad_workspace_bytes")}  # memory, not traffic
    b, a = before["policy"], after["policy"]
    out["process"] = {k[len("process_"):]: a[k] - b.get(k, 0) for k in a if k.startswith("process_")}
    out["layout"] = after["policy"]["node_layout_source"]
    return out


def plain_around_fcdp(steps: int = 2) -> dict:
    """One machine of 4 ranks (torchrun's LOCAL_WORLD_SIZE=4) with an FCDP engine that simulates 2 nodes x 2
    (``fcdp.ranks_per_node``) and default gradient modes, and two plain ZeRO-3 engines of the same model,
    built before and after it; each trained in turn. Per engine: its gradient and gather bytes by link."""
    import os

    from deepspeed import comm as dist

    os.environ["LOCAL_WORLD_SIZE"] = "4"
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.install()
    before = toy.build_engine(toy.ds_config(None, regime="large", grad_accum=2))
    fcdp = toy.build_engine(toy.ds_config({"enabled": True, "ranks_per_node": 2}, regime="large", grad_accum=2))
    after = toy.build_engine(toy.ds_config(None, regime="large", grad_accum=2))
    keys = ("inter_node_grad_reduce_bytes", "intra_node_grad_reduce_bytes", "inter_node_allgather_bytes",
            "intra_node_allgather_bytes", "node_layout_source", "grad_reduce")
    out = {}
    for name, engine in (("before", before), ("fcdp", fcdp), ("after", after)):
        toy.train(engine, steps)
        stats = fcdp_deepspeed.get_stats(engine)
        out[name] = {k: stats.get(k) for k in keys}
    return out
