"""Workers of test_checkpoints.py: save/load across engine kinds, a rank killed mid-step, resume, when
``latest`` is written."""
from __future__ import annotations

from deepspeed import comm as dist

from fcdp_deepspeed.tools import toy
from workers.common import fcdp_block, forward, setup


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
            out[f"{loader}_loads_{saved}"] = forward(engine, 32)
            out[f"{loader}_loads_{saved}_train"] = toy.train(engine, 2, seed=9).losses
    return out



def latest_after_every_file(ckpt_dir: str, slow: tuple = (1,), delay: float = 1.0) -> dict:
    """2 nodes x 1, plain ZeRO-3 then FCDP: node 1's rank writes its optimizer states ``delay`` s late; rank 0
    records whether every rank's file existed when it was about to write ``latest`` (``checkpoint_engine.commit``)."""
    import os
    import time
    setup(ranks_per_node=1)
    out = {}
    for mode in ("plain", "fcdp"):
        engine = toy.build_engine(toy.ds_config(fcdp_block(1) if mode == "fcdp" else None, regime="large"))
        toy.train(engine, 1)
        tag, world = f"{mode}_step1", dist.get_world_size()
        if dist.get_rank() in slow:
            save_zero = engine._save_zero_checkpoint
            engine._save_zero_checkpoint = lambda *a, **k: (time.sleep(delay), save_zero(*a, **k))
        if dist.get_rank() == 0:
            commit = engine.checkpoint_engine.commit

            def check_then_commit(info):
                out[mode] = all(os.path.exists(os.path.join(ckpt_dir, tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
                                for r in range(world))
                return commit(info)
            engine.checkpoint_engine.commit = check_then_commit
        engine.save_checkpoint(ckpt_dir, tag=tag)
    return out
