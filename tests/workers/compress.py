"""Rank workers of test_compress_params.py: ``fcdp.param_compression`` through ``deepspeed.initialize`` on
2 nodes x 2 (bf16 toy model, large release regime: one two-stage gather per parameter and step).

Every run records, at each forward (a pre-hook after DeepSpeed's fetch), the hash of each parameter's
gathered value (replicas must be bitwise equal across ranks) and this rank's own-partition error against
its exact ``ds_tensor``, checked against the codec's bound for the delta it sent.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import resource
from functools import partial

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_deepspeed import faults
from fcdp_deepspeed.compress import quant
from fcdp_deepspeed.runtime import compressed_gather as cparams
from fcdp_deepspeed.runtime import compression as rcompression
from fcdp_lab.harness import toy
from fcdp_lab.sabotage import applied
from workers.common import LogCapture, fcdp_block, setup
from workers.replicas import ReplicaHashes

HIDDEN = 32


class Recorder:
    """Forward pre-hooks on every module with parameters (registered after DeepSpeed's, so they see the
    gathered values); call :meth:`next_step` before each optimizer step's forward."""

    def __init__(self, engine, qmax: int = 0, block: int = 128) -> None:
        self.qmax, self.block, self.step = qmax, block, 0
        self.hashes: list = []
        self.prev: dict = {}
        self.violations: list = []
        self.max_rel = 0.0
        self.seen: set = set()
        self.replicas = ReplicaHashes(engine.module)  # every call (train, recompute, eval): what each rank computes with
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for module in engine.module.modules():
            own = [(names[id(p)], p) for p in module.parameters(recurse=False)]
            if own:
                module.register_forward_pre_hook(partial(self._hook, own))

    def next_step(self) -> None:
        self.step += 1
        self.replicas.step = self.step
        self.seen.clear()

    def _hook(self, params, module, inputs) -> None:
        if not module.training:
            return
        for name, p in params:
            if name in self.seen:
                continue  # a second forward in the step reads the same (cached) value
            self.seen.add(name)
            data = p.data.reshape(-1).contiguous()
            self.hashes.append((self.step, name, hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()))
            n = p.ds_tensor.ds_numel
            valid = max(0, min(n, p.ds_numel - dist.get_rank() * n))
            own = data.narrow(0, dist.get_rank() * n, valid).float()
            exact = p.ds_tensor.narrow(0, 0, valid).float()
            err = (own - exact).abs()
            if exact.norm() > 0:
                self.max_rel = max(self.max_rel, float((own - exact).norm() / exact.norm()))
            if self.qmax and name in self.prev and valid:
                delta = exact - self.prev[name]
                pad = -valid % self.block
                absmax = torch.nn.functional.pad(delta.abs(), (0, pad)).view(-1, self.block).amax(dim=1)
                bound = (absmax / (2 * self.qmax)).repeat_interleave(self.block)[:valid]
                excess = err - (bound * 1.001 + exact.abs() * 2.0**-8 + 1e-30)
                if float(excess.max()) > 0:
                    self.violations.append((self.step, name, float(excess.max())))
            self.prev[name] = own


def _identity_codec(name: str, block: int) -> quant.Codec:
    return quant.IdentityCodec("identity", block)


def _decode_with_next_scale(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Broken: each block of each message decoded with the scale of the next block."""
    head = self.blocks(numel) * quant.SCALE_BYTES
    fixed = packed.clone()
    scales = fixed[:, :head].clone().view(torch.float32)
    fixed[:, :head].copy_(scales.roll(-1, dims=1).view(torch.uint8))
    return _ORIGINAL_DECODE(self, fixed, numel)


_ORIGINAL_DECODE = quant.BlockCodec.decode_rows


@contextlib.contextmanager
def patched(kind: str):
    """Test-only codecs and deliberately broken variants, for one run."""
    saved = []

    def put(owner, attr, value):
        saved.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, value)

    if kind in ("identity", "identity_peer_order"):
        put(rcompression, "codec_for", _identity_codec)
        put(rcompression, "pays", lambda codec, numel, dtype: True)
    if kind == "identity_peer_order":  # messages decoded in the wrong peer order
        put(cparams.ParamCompression, "messages", staticmethod(
            lambda packed, nodes, stride, wire: packed.view(nodes, stride).flip(0).narrow(1, 0, wire)))
    if kind == "wrong_scale":
        put(quant.BlockCodec, "decode_rows", _decode_with_next_scale)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _engine(compression: str = "off", lora_rank: int = 0, seed: int = 0, zero: dict | None = None, hidden: int = HIDDEN,
            dtype: str = "bf16", activation_checkpointing: bool = False, **extra):
    # the drift stats are per report interval ([fcdp] line, every 10 steps by default): no report, so they cover the run
    block = fcdp_block(2, param_compression=compression, **{"log_interval": 0, **extra})
    cfg = toy.ds_config(block, regime="large", dtype=dtype, **(zero or {}))
    if dtype == "fp16":  # [Note: fp16 on the CPU accelerator] in workers/grads.py
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    return toy.build_engine(cfg, hidden=hidden, lora_rank=lora_rank, seed=seed,
                            activation_checkpointing=activation_checkpointing)


def _train(engine, rec: Recorder, steps: int, seed: int = 0, per_step=None, evaluate: bool = False) -> dict:
    """``steps`` optimizer steps (GA 1), stats after each; ``per_step(engine, step)`` runs before a step;
    ``evaluate``: an eval forward after each step."""
    losses, stats = [], []
    hidden = engine.module.inp.in_features
    dtype = next(engine.module.parameters()).dtype
    for i in range(steps):
        if per_step is not None:
            per_step(engine, i)
        rec.next_step()
        res = toy.train(engine, 1, hidden=hidden, seed=seed * 1000 + i, dtype=dtype)
        losses += res.losses
        if evaluate:
            toy.evaluate(engine, toy.batch(99, 4, hidden)[0].to(dtype))
        stats.append(fcdp_deepspeed.get_stats(engine))
    return {"losses": losses, "stats": stats}


def _result(engine, rec: Recorder, run: dict, weights: bool = True) -> dict:
    run.update(hashes=rec.hashes, violations=rec.violations, max_rel=rec.max_rel, replicas=rec.replicas.hashes)
    if weights:
        gathered = toy.gather_weights(engine)  # collective; exact (DeepSpeed's flat gather of ds_tensor)
        run["weights"] = gathered if dist.get_rank() == 0 else {}
    return run


def run(name: str, compression: str = "off", steps: int = 4, kind: str = "", qmax: int = 0, lora_rank: int = 0,
        per_step=None, weights: bool = True, evaluate: bool = False, broken: str = "", **extra) -> dict:
    """One engine's run; ``broken``: a variant of ``fcdp_lab/sabotage/compression.py`` while it runs
    (``reconstruction@1``: on rank 1 only)."""
    with applied(f"compression.{broken}" if broken else ""), patched(kind):
        engine = _engine(compression, lora_rank=lora_rank, **extra)
        rec = Recorder(engine, qmax=qmax, block=extra.get("compression_block", 128))
        out = _train(engine, rec, steps, per_step=per_step, evaluate=evaluate)
        return _result(engine, rec, out, weights)


def _freeze_after_build(engine, step: int) -> None:
    """Before step index 1: a slotted weight is frozen (the optimizer still owns it: gathered exactly every step)."""
    if step == 1:
        engine.module.blocks[0].fc.weight.requires_grad = False


def _events(engine, step: int) -> None:
    """Before step index 2: ``refresh_fp32_params`` (the master weights from the 16-bit ones); before 4:
    ``GatheredParameters(modifier_rank=0)`` rewrites a weight with its own value; before 5: a weight is frozen.
    (``param_refresh_interval`` 3 refreshes after step index 2.)"""
    if step == 2:
        engine.optimizer.refresh_fp32_params()
    if step == 4:
        param = engine.module.blocks[1].fc.weight
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                param.data.mul_(1.0)
    if step == 5:
        engine.module.blocks[2].fc.weight.requires_grad = False


def _no_room(logs: LogCapture) -> dict:
    """The reference pool's allocation fails on rank 1 only (the cache's pool is the first host allocation):
    every rank leaves those references out and crosses exactly, one warning."""
    os.environ[faults.FAULT_ENV] = "alloc_host@1:2"
    faults._calls.clear()
    try:
        engine = _engine("int8")
    finally:
        del os.environ[faults.FAULT_ENV]
    rec = Recorder(engine)
    out = _result(engine, rec, _train(engine, rec, 2), weights=False)
    out["logs"] = logs.fcdp("get no reference")
    return out


def checkpoints(ckpt_dir: str, steps: int = 2) -> dict:
    """int8: save after 2 steps and train on; a fresh engine loads and trains the same steps; loads of a
    checkpoint written without compression, and with another block size, start from exact references."""
    out = {}
    engine = _engine("int8")
    rec = Recorder(engine)
    _train(engine, rec, steps)
    engine.save_checkpoint(ckpt_dir, tag="int8")
    engine.save_16bit_model(ckpt_dir, "int8_16bit.bin")  # consolidation keeps the references (the resume compares)
    out["uninterrupted"] = _result(engine, rec, _train(engine, rec, steps, seed=5))
    out["saved_shares"] = _saved_shares(engine, os.path.join(ckpt_dir, "int8"))
    plain = _engine("off")
    _train(plain, Recorder(plain), 1)
    plain.save_checkpoint(ckpt_dir, tag="off")
    for name, tag, extra in (("resumed", "int8", {}), ("from_off", "off", {}), ("other_block", "int8", {"compression_block": 64}),
                             ("resumed_wrong_share", "int8", {})):
        # the broken variant: bundles rebuilt from the wrong peers' rows
        with applied("compression.share" if name == "resumed_wrong_share" else ""):
            fresh = _engine("int8", seed=77, **extra)
            fresh.load_checkpoint(ckpt_dir, tag=tag)
        rec = Recorder(fresh)
        out[name] = _result(fresh, rec, _train(fresh, rec, steps if name.startswith("resumed") else 1, seed=5),
                            weights=name.startswith("resumed"))
    return out


@contextlib.contextmanager
def _seeding_inside_exact_gathers():
    """Broken: exact gathers inside ``exact_gathers`` seed the references (training's next deltas change)."""
    original = cparams.ParamCompression.seed

    def seed(self, params, bundle, part):
        saved, self.exact_only = self.exact_only, False
        try:
            original(self, params, bundle, part)
        finally:
            self.exact_only = saved
    cparams.ParamCompression.seed = seed
    try:
        yield
    finally:
        cparams.ParamCompression.seed = original


def exact_eval(ckpt_dir: str) -> dict:
    """int8: 2 steps, a save, an eval inside ``fcdp_deepspeed.exact_gathers``, 2 more steps (``with``); the same run
    without the eval (``without``) and with a variant that seeds references inside (``broken``); plain ZeRO-3 loads
    the checkpoints saved right before each exact eval and evaluates the same input."""
    x = toy.batch(4242, 4, HIDDEN)[0].to(torch.bfloat16)
    out: dict = {}
    for name in ("with", "without", "broken"):
        engine = _engine("int8")
        rec = Recorder(engine)
        run = _train(engine, rec, 2)
        engine.save_checkpoint(ckpt_dir, tag=f"exact_{name}")
        if name != "without":
            with _seeding_inside_exact_gathers() if name == "broken" else contextlib.nullcontext():
                with fcdp_deepspeed.exact_gathers(engine):
                    run["exact_eval"] = toy.evaluate(engine, x)
            run["exact_gathers"] = fcdp_deepspeed.get_stats(engine)["param_exact_gathers"]
        run["losses"] += _train(engine, rec, 2, seed=3)["losses"]
        out[name] = _result(engine, rec, run)
        if name == "with":  # after a step: exact inside, the reconstructions outside
            with fcdp_deepspeed.exact_gathers(engine):
                out[name]["exact_eval_end"] = toy.evaluate(engine, x)
            engine.save_checkpoint(ckpt_dir, tag="exact_end")
            out[name]["default_eval_end"] = toy.evaluate(engine, x)
    for tag in ("exact_with", "exact_end"):
        plain = toy.build_engine(toy.ds_config(None, regime="large", dtype="bf16"), hidden=HIDDEN, seed=5)
        plain.load_checkpoint(ckpt_dir, tag=tag)
        out[f"zero3_{tag}"] = toy.evaluate(plain, x)
    return out


def _saved_shares(engine, tag_dir: str) -> dict:
    """Per saved reference of this rank's optimizer state file: ``(saved elements, partition elements)``."""
    import glob
    rank = dist.get_rank()
    path, = glob.glob(os.path.join(tag_dir, f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    state = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    part = state["fcdp_compression"]["params"]
    return {name: (ref["values"].numel(), ref["partition_numel"], ref["nodes"]) for name, ref in part["references"].items()}


def suite(ckpt_dir: str) -> dict:
    """Every scenario of test_compress_params.py in one launch (the runs are sequential, each a fresh engine)."""
    setup(2)
    fcdp_deepspeed.install()
    logs = LogCapture()
    out = {
        "off": run("off", steps=4),
        "identity": run("identity", "int8", steps=4, kind="identity"),
        "int8": run("int8", "int8", steps=10, qmax=127),
        "int4": run("int4", "int4", steps=4, qmax=7),
        "identity_peer_order": run("identity_peer_order", "int8", steps=2, kind="identity_peer_order", weights=False),
        # 8-element blocks: Adam's second update varies enough across them for the scales to differ
        "wrong_scale": run("wrong_scale", "int8", steps=2, qmax=127, kind="wrong_scale", weights=False,
                           compression_block=8),
        "lora": run("lora", "int8", steps=3, lora_rank=2, compression_block=16, weights=False),
        # verify: exact values are still compared with ZeRO-3's, compressed reconstructions are not
        "events": run("events", "int8", steps=6, per_step=_events, param_refresh_interval=3, weights=False,
                      verify=True),
        # the owner's partition is on the host: copied to the accelerator on the issuing stream, as for exact gathers
        "offload": run("offload", "int8", steps=3, qmax=127, weights=False,
                       zero={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
        # issue 33: one rank's reconstruction 1 ulp off (the replica check must catch it)
        "broken_replica": run("broken_replica", "int8", steps=2, weights=False, broken="reconstruction@1"),
        "frozen": run("frozen", "int8", steps=3, per_step=_freeze_after_build, weights=False),
        # 33 x 33 weights: 1089 elements, not a multiple of the 4 ranks (padded partition tails), 33-element biases
        "padded": run("padded", "int8", steps=3, qmax=127, weights=False, hidden=33),
        "fp32": run("fp32", "int8", steps=3, qmax=127, weights=False, dtype="fp32"),
        "fp16": run("fp16", "int4", steps=3, qmax=7, weights=False, dtype="fp16"),
        # eval forwards and activation-checkpointing recomputes gather under compression too
        "recompute_eval": run("recompute_eval", "int8", steps=3, qmax=127, weights=False, evaluate=True,
                              activation_checkpointing=True),
        # nothing cached (min_numel above every parameter): forward, backward and eval each gather every step
        "uncached": run("uncached", "int8", steps=3, weights=False, evaluate=True, min_numel=4096),
    }
    out["no_room"] = _no_room(logs)
    out.update(checkpoints(ckpt_dir))
    out["exact_eval"] = exact_eval(ckpt_dir)
    one_node = toy.build_engine(toy.ds_config(fcdp_block(4, param_compression="int8"), regime="large", dtype="bf16"),
                                hidden=HIDDEN)
    out["one_node"] = {"stats": fcdp_deepspeed.get_stats(one_node), "logs": logs.fcdp("has no effect")}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = usage.ru_utime + usage.ru_stime  # this rank's CPU seconds (the suite's cost on an idle machine)
    return out

