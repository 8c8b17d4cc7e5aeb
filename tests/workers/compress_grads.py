"""Rank workers of test_compress_grads.py: the compressed inter-node gradient stage (``fcdp.grad_compression``)
through ``deepspeed.initialize`` on 2 nodes x 2, every scenario in one launch.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from deepspeed import comm as dist
from deepspeed.utils import safe_get_local_grad

import fcdp_deepspeed
from fcdp_deepspeed.compress import IdentityCodec, quant
from fcdp_deepspeed.grads import compressed as compress_grads, own_chunk_numel
from fcdp_deepspeed.grads.inflight import Inflight
from fcdp_deepspeed.grads.residual import ResidualStore
from fcdp_lab.harness import toy
from fcdp_lab.sabotage import applied
from workers import grads as grad_workers
from workers.common import LogCapture, setup
from workers.replicas import ReplicaHashes

BLOCK = 128


class WrongScale(IdentityCodec):
    """Decodes 1 + 2^-6 times what was encoded (a scale that does not match the sender's; since issue 33 the own
    row is not decoded, so it reaches half the sum at 2 nodes: 2^-6 rather than 2^-7 keeps it as far off)."""

    def decode_rows(self, packed, numel):
        return super().decode_rows(packed, numel) * (1 + 2**-6)


class BlocksRolled(IdentityCodec):
    """Decodes each row's blocks in the wrong order (rolled by one block)."""

    def decode_rows(self, packed, numel):
        return super().decode_rows(packed, numel).roll(self.block, dims=1)


CODECS = {"identity": IdentityCodec, "wrong_scale": WrongScale, "blocks_rolled": BlocksRolled}


def _divided(issued: Inflight, factor: int) -> Inflight:
    """An issued exchange whose partitions come out divided by ``factor`` (decoded at completion)."""
    return Inflight(issued.works, lambda: [t / factor for t in issued.finish()], issued.buffers)


@contextlib.contextmanager
def sabotaged(kind: str) -> Iterator[None]:
    """Deliberately broken variants of the compressed stage (undone afterwards)."""
    cls, name = compress_grads.GradCompressor, None
    saved = {}
    if kind == "divide_by_nodes":  # the decoded sum divided by the node count (qgZ's wrong factor)
        name, original = "exchange", cls.exchange
        saved = {name: original}
        cls.exchange = lambda self, sums, ids: _divided(original(self, sums, ids), self.layout.nodes)
    elif kind == "rows_reversed":  # row q sent to peer N-1-q (the wrong row order; the codec encodes the sent rows only)
        name, original = "encode_sent", compress_grads.encode_sent
        saved = {name: original}

        def reversed_rows(codec, x, me, exact_own):
            packed, sent = original(codec, x, me, exact_own)
            return packed.flip(0), sent
        compress_grads.encode_sent = reversed_rows
    elif kind == "no_feedback":  # no error feedback: the residual is never added
        saved = {"read_many": ResidualStore.read_many}
        ResidualStore.read_many = lambda self, ds_ids, shapes, loss_scale: [None] * len(ds_ids)
    elif kind == "commit_on_skip":  # an overflow-skipped step commits its residual anyway
        name, original = "discard", cls.discard
        saved = {name: original}
        cls.discard = lambda self, skipped: self.commit() if skipped else original(self, skipped)
    elif kind == "discard_at_checkpoint":  # the old epilogue: a checkpoint event drops the window's pending residual
        from fcdp_deepspeed.engine.stage3 import FCDPStage3
        original_epilogue = FCDPStage3.checkpoint_event_epilogue

        def epilogue(self):
            self._fcdp_compressor().discard(skipped=False)
            original_epilogue(self)
        FCDPStage3.checkpoint_event_epilogue = epilogue
    elif kind:
        raise ValueError(kind)
    try:
        yield
    finally:
        for attr, fn in saved.items():
            setattr(ResidualStore if attr == "read_many" else compress_grads if attr == "encode_sent" else cls, attr, fn)
        if kind == "discard_at_checkpoint":
            FCDPStage3.checkpoint_event_epilogue = original_epilogue


@contextlib.contextmanager
def test_codec(name: Optional[str], block: int = BLOCK) -> Iterator[None]:
    compress_grads.TEST_CODEC = CODECS[name]("identity", block) if name else None
    try:
        yield
    finally:
        compress_grads.TEST_CODEC = None


@contextlib.contextmanager
def codec_kernel(kind: Optional[str]) -> Iterator[None]:
    """``"torch"``: the codec's torch ops only, as ``FCDP_CODEC_KERNEL=torch`` gives ([Note: the fused CPU codec])."""
    saved = quant.cpu_kernel
    if kind == "torch":
        quant.cpu_kernel = lambda: None
    try:
        yield
    finally:
        quant.cpu_kernel = saved


def rank0(weights: dict) -> dict:
    """What rank 0 reports of a collective's result (the others return nothing)."""
    return weights if dist.get_rank() == 0 else {}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config(sc: dict) -> dict:
    block = {"enabled": True, "ranks_per_node": 2, **sc.get("fcdp", {})}
    dtype = sc.get("dtype", "fp32")
    if dtype == "fp16":  # [Note: fp16 on the CPU accelerator] in workers/grads.py
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    cfg = toy.ds_config(block, grad_accum=sc.get("grad_accum", 1), lr=sc.get("lr", 1e-2), dtype=dtype,
                        **sc.get("zero", {}))
    if "clip" in sc:  # 0.0: no clipping (DeepSpeed's default clips at 1.0)
        cfg["gradient_clipping"] = sc["clip"]
    return cfg


def residual(engine) -> torch.Tensor:
    """This rank's committed residuals as the next window reads them (times their clip coefficient, as a checkpoint
    saves them), flat (zeros before any was written)."""
    compressor = engine.optimizer.fcdp_grads.comm.compressor
    store, flat = compressor.store, compressor.save()["residual"]
    total = sum(n for _, n in store.offsets.values())
    return torch.zeros(total) if flat is None else flat.float().clone()


def partitions(engine) -> torch.Tensor:
    """This rank's gradient partitions of every trainable parameter, float64, flat (at a boundary)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for _, p in engine.module.named_parameters():
        if p.requires_grad:
            own = own_chunk_numel(p.ds_numel, world, rank)
            out.append(safe_get_local_grad(p).reshape(-1)[:own].double().clone())
    return torch.cat(out)


def peer_residuals(engine) -> torch.Tensor:
    """The committed residual rows the senders of this rank's peer group hold for this rank's partitions, summed,
    laid out as :func:`partitions` (float64; zero for parameters without a residual slot). Collective.

    [Note: the error-feedback invariant] Sender q's row for peer p telescopes over its exchanges: what it sent
    (decoded) adds up to its exact node sums minus its last residual. So the sum of this rank's gradient partitions
    over every window equals the exact sum minus these rows, whatever the windows, events and flushes were."""
    compressor = engine.optimizer.fcdp_grads.comm.compressor
    store, layout = compressor.store, compressor.layout
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, residual(engine))
    world, rank = dist.get_world_size(), dist.get_rank()
    row = list(layout.peer_ranks).index(rank)
    out = []
    for _, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        own = own_chunk_numel(p.ds_numel, world, rank)
        total = torch.zeros(own, dtype=torch.float64)
        if store.covers(p.ds_id):
            offset, numel = store.offsets[p.ds_id]
            for index, sender in enumerate(layout.peer_ranks):
                if index == row:  # a rank's own row crosses nothing and has no residual ([Note: the own row])
                    continue
                rows = every[sender].narrow(0, offset, numel).view(layout.nodes - 1, numel // (layout.nodes - 1))
                total += rows[row if row < index else row - 1, :own].double()
        out.append(total)
    return torch.cat(out)


def checkpoint_event(engine, event: str, ckpt_dir: str) -> None:
    """A checkpoint event between micro-steps (``mid_window``): a save, or HF save_model's 16-bit consolidation."""
    if event == "save":
        engine.save_checkpoint(ckpt_dir, tag="mid_window")
    elif event == "save16":
        engine._zero3_consolidated_16bit_state_dict()
    else:
        raise ValueError(event)


def model_hash(engine) -> str:
    """sha256 of the full model as this rank gathers it (every rank gathers)."""
    h = hashlib.sha256()
    for name, w in sorted(toy.gather_weights(engine).items()):
        h.update(name.encode())
        h.update(w.numpy().tobytes())
    return h.hexdigest()


def train(engine, sc: dict, seed: int = 0, steps: Optional[int] = None,
          replicas: Optional[ReplicaHashes] = None) -> dict:
    """Optimizer steps with per-step stats; optionally the partitions at each boundary and the residual after each
    step. ``sc["spike"] = {step: factor}`` multiplies that step's loss (a gradient spike)."""
    ga, hidden = engine.gradient_accumulation_steps(), 32
    dtype = DTYPES[sc.get("dtype", "fp32")]
    out: dict = {"losses": [], "stats": [], "grads": [], "residuals": []}
    micro = 0
    for step in range(sc.get("steps", 3) if steps is None else steps):
        if replicas is not None:
            replicas.step = step
        for k in range(ga):
            if k == 1 and step in sc.get("mid_window", {}):  # after the window's first micro-step
                checkpoint_event(engine, sc["mid_window"][step], sc["ckpt_dir"])
            x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), hidden, seed)
            loss = F.mse_loss(engine(x.to(dtype), **grad_workers.gate(sc, micro)).float(), y)
            engine.backward(loss * sc.get("spike", {}).get(step, 1.0))
            if sc.get("record_grads") and engine.is_gradient_accumulation_boundary():
                out["grads"].append(partitions(engine))
            engine.step()
            out["losses"].append(loss.item())
            micro += 1
        if sc.get("record_residual"):
            out["residuals"].append(residual(engine))
        out["stats"].append(fcdp_deepspeed.get_stats(engine))
    return out


def run(sc: dict) -> dict:
    if sc.get("fault"):
        os.environ["FCDP_INJECT_FAULT"] = sc["fault"]  # read at the fault site, at engine creation
    broken = contextlib.ExitStack()  # a variant of fcdp_lab/sabotage/compression.py, from the build to the last step
    broken.enter_context(applied(f"compression.{sc['broken']}" if sc.get("broken") else ""))
    with sabotaged(sc.get("break", "")), test_codec(sc.get("codec")), codec_kernel(sc.get("codec_kernel")):
        try:
            engine = grad_workers.build(sc, config(sc))
        finally:
            os.environ.pop("FCDP_INJECT_FAULT", None)
        if sc.get("overflow_at"):
            grad_workers.inject_overflow(engine, sc["overflow_at"])
        replicas = ReplicaHashes(engine.module)
        try:
            res = train(engine, sc, replicas=replicas)
        finally:
            broken.close()
        res["codec_kernel"] = quant.cpu_kernel() is not None
        res["replicas"] = replicas.hashes
        res["skipped_steps"] = engine.skipped_steps
        if sc.get("record_invariant"):
            res["peer_residuals"] = peer_residuals(engine)
        res["hash"] = model_hash(engine)
        res["weights"] = rank0(toy.gather_weights(engine))
    res["engine"] = engine
    return res


def checkpoint(ckpt_dir: str, sc: dict, off_engine) -> dict:
    """Save mid-run and resume into a fresh engine; load into another block size; load an uncompressed checkpoint."""
    engine = grad_workers.build(sc, config(sc))
    train(engine, sc, steps=2)
    engine.save_checkpoint(ckpt_dir, tag="int8")
    saved = residual(engine)
    clips = engine.optimizer.fcdp_grads.comm.compressor.clips
    out = {"saved_residual": saved, "saved_clips": [float(c) for c in clips.values()],
           "continued": train(engine, sc, seed=5, steps=2)}
    out["continued"]["weights"] = rank0(toy.gather_weights(engine))  # collective: every rank gathers
    fresh = toy.build_engine(config(sc), seed=99)  # another init: the load must overwrite everything
    fresh.load_checkpoint(ckpt_dir, tag="int8")
    out["loaded_residual"] = residual(fresh)
    out["resumed"] = train(fresh, sc, seed=5, steps=2)
    out["resumed"]["weights"] = rank0(toy.gather_weights(fresh))
    other = toy.build_engine(config({**sc, "fcdp": {**sc["fcdp"], "compression_block": 64}}), seed=99)
    other.load_checkpoint(ckpt_dir, tag="int8")
    out["other_block_residual"] = residual(other)
    off_engine.save_checkpoint(ckpt_dir, tag="off")
    trained = grad_workers.build(sc, config(sc))
    train(trained, sc, steps=1)  # nonzero residuals, then a checkpoint without any
    trained.load_checkpoint(ckpt_dir, tag="off")
    out["off_residual"] = residual(trained)
    out["zeroed_loads"] = [fcdp_deepspeed.get_stats(e)["grad_residual_zeroed_loads"] for e in (fresh, other, trained)]
    return out


def _compression_state(engine) -> dict:
    """What a load without the optimizer state must reset: committed residuals, references, the refresh counter."""
    from fcdp_deepspeed.runtime.compression_reference import RefState
    store = engine.optimizer.fcdp.compression.store
    return {"residual_norm": residual(engine).norm().item(), "steps": store.steps,
            "valid_refs": sum(r.state is RefState.VALID for r in store.refs.values()),
            "refs": len(store.refs), "zeroed_loads": fcdp_deepspeed.get_stats(engine)["grad_residual_zeroed_loads"]}


def reloads(ckpt_dir: str, sc: dict) -> dict:
    """Both compressions on (``param_compression`` int8 and the scenario's ``grad_compression``): save after 2
    steps, train on, then load into the running engine without the optimizer states, module only, and from a
    universal checkpoint (converted with DeepSpeed's tool) into an engine trained since; each load's state after
    it, and ``param_exact_gathers`` after one more step."""
    from pathlib import Path
    from fcdp_lab.reliability import resize
    both = {**sc, "fcdp": {**sc["fcdp"], "param_compression": "int8", "param_refresh_interval": 7}}
    engine = grad_workers.build(both, config(both))
    train(engine, both, steps=2)
    engine.save_checkpoint(ckpt_dir, tag="both")
    out = {}
    loads = (("no_optimizer", {"load_optimizer_states": False}), ("module_only", {"load_module_only": True}))
    for name, kwargs in loads:
        train(engine, both, steps=1)
        before = _compression_state(engine)
        engine.load_checkpoint(ckpt_dir, tag="both", **kwargs)
        out[name] = {"before": before, "after": _compression_state(engine)}
        train(engine, both, steps=1)
        out[name]["exact_gathers"] = fcdp_deepspeed.get_stats(engine)["param_exact_gathers"]
    tag = [resize.convert(Path(ckpt_dir), "both") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tag, src=0)
    universal = toy.build_engine({**config(both), "checkpoint": {"load_universal": True}})
    train(universal, both, steps=2)
    before = _compression_state(universal)
    universal.load_checkpoint(ckpt_dir, tag=tag[0])
    out["universal"] = {"before": before, "after": _compression_state(universal)}
    return out


def compression_runs(scenarios: list[dict], ckpt_dir: str, checkpoint_scenario: dict, exact_for_checkpoint: str,
                     refusals: list[dict]) -> dict:
    """Every scenario (one engine each), then the checkpoint flow and the refusals, in one launch."""
    setup(2)
    log = LogCapture()
    out: dict = {}
    engines = {}
    for sc in scenarios:
        first = len(log.messages)
        res = run({**sc, "ckpt_dir": ckpt_dir})
        engines[sc["name"]] = res.pop("engine")
        res["warnings"] = [m for m in log.messages[first:] if m.startswith("fcdp:") and "residuals need" in m]
        out[sc["name"]] = res
    out["checkpoint"] = checkpoint(ckpt_dir, checkpoint_scenario, engines[exact_for_checkpoint])
    out["reloads"] = reloads(ckpt_dir, checkpoint_scenario)
    out["refusals"] = grad_workers.refusals(refusals)
    return out
