"""Workers of test_checkpoints.py: save/load across engine kinds, a rank killed mid-step, resume."""
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


def killed_while_saving(ckpt_dir: str, fcdp: bool, victims: tuple = (2, 3)) -> None:
    """A checkpoint after 2 steps; in the save after 4, node 1's ranks die before writing their optimizer states."""
    import os
    import signal
    setup()
    engine = toy.build_engine(toy.ds_config(fcdp_block() if fcdp else None, regime="large"))
    toy.train(engine, 2)
    engine.save_checkpoint(ckpt_dir)  # global_step2, complete
    toy.train(engine, 2, seed=1)
    if dist.get_rank() in victims:
        engine._save_zero_checkpoint = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    engine.save_checkpoint(ckpt_dir)  # global_step4: ranks 0 and 1 write theirs, 2 and 3 die
