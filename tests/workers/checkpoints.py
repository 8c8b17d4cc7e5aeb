"""Workers of test_checkpoints.py: save/load across engine kinds, a rank killed mid-step, resume, when
``latest`` is written."""
from __future__ import annotations

from deepspeed import comm as dist

from fcdp_lab.harness import toy
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


#: Engines of :func:`mid_window`: plain ZeRO-3, FCDP on ZeRO-3's gradient path, node accumulation (the ``auto``
#: default on 2 x 2), and node accumulation with a budget that leaves some parameters unbuffered (the delivery
#: ledger adds their per-micro-step deliveries).
MID_WINDOW_ENGINES = {"zero3": None, "exact": {}, "node": {"grad_accumulation": "node"},
                      "node_budget": {"grad_accumulation": "node", "grad_buffer_budget": 8192}}
#: Per optimizer step: the checkpoint event after micro-step ``at`` of the window (none in step 0 and the last).
MID_WINDOW_EVENTS = ("", "save", "save16", "load", "")


def _mid_window_event(engine, event: str, ckpt_dir: str, name: str) -> None:
    if event == "save":
        engine.save_checkpoint(ckpt_dir, tag=f"{name}_mid")
    elif event == "save16":  # what HF's save_model runs under stage3_gather_16bit_weights_on_model_save
        engine._zero3_consolidated_16bit_state_dict()
    elif event == "load":  # in-process, the checkpoint of step 0's boundary
        engine.load_checkpoint(ckpt_dir, tag=f"{name}_s0")


def mid_window(ckpt_dir: str, grad_accum: int, at: int, events: tuple = MID_WINDOW_EVENTS,
               engines: tuple = tuple(MID_WINDOW_ENGINES)) -> dict:
    """Each engine trains ``len(events)`` optimizer steps of ``grad_accum`` micro-steps; step 0 ends with a save
    (tag ``<engine>_s0``); in step i the checkpoint event ``events[i]`` runs after micro-step ``at`` of the window.
    Records the losses and, after every step, the full weights (rank 0)."""
    import torch.nn.functional as F
    setup()
    out = {}
    for name in engines:
        extra = MID_WINDOW_ENGINES[name]
        engine = toy.build_engine(toy.ds_config(None if extra is None else fcdp_block(**extra), regime="large",
                                                grad_accum=grad_accum))
        losses, weights, micro = [], [], 0
        for event in events:
            for k in range(grad_accum):
                if k == at and event:
                    _mid_window_event(engine, event, ckpt_dir, name)
                x, y = toy.batch(micro, 4, 32)
                loss = F.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                micro += 1
            if micro == grad_accum:
                engine.save_checkpoint(ckpt_dir, tag=f"{name}_s0")
            full = toy.gather_weights(engine)  # collective
            weights.append(full if dist.get_rank() == 0 else {})
        stats = {} if extra is None else __import__("fcdp_deepspeed").get_stats(engine)
        out[name] = {"losses": losses, "weights": weights, "grad_accumulated": stats.get("grad_accumulated", 0)}
    return out
