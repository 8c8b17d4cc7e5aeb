"""The events of a sequence, applied to every engine in turn (rank side; every rank runs each one).

Each event is what a training script, DeepSpeed or Hugging Face does to a running ZeRO-3 job, through
the entry points users touch; it returns what each engine produced (losses, outputs) for ``checks.py``.
Data depends only on the sequence (a micro-step counter and the rank), never on the engine.

[Note: GA per step] ``train(micro=k)`` sets the accumulation steps to ``k`` with
``engine.set_train_batch_size`` (what Megatron-DeepSpeed does between steps) and marks the last of the
``k`` micro-steps as the boundary with ``set_gradient_accumulation_boundary``: a window is exactly the
event, whatever the micro-steps before it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

import deepspeed
from deepspeed import comm as dist

from fcdp_deepspeed.storage.cache import Placement
from fcdp_lab.fuzz import engines as eng
from fcdp_lab.fuzz.model import (HIDDEN, SEQ, VOCAB, hf_load_state_dict, modules_with_params,
                                             resize_token_embeddings, set_trainable)

#: ``get_stats`` counters summed into :attr:`Sequence.coverage`.
COVERAGE_KEYS = ("cache_hits", "cache_misses", "uncached_fetches", "cache_fills", "cache_refreshes",
                 "hierarchical_gathers", "batched_refills", "optimizer_steps")

#: What one engine produced in one event: losses (this rank's micro-steps), outputs, gathered values.
Obs = dict[str, Any]


class Unsupported(Exception):
    """Plain ZeRO-3 itself raised in this event: DeepSpeed does not support the sequence (it is discarded).

    [Note: unsupported sequences] Each event runs on the reference engine first; what it cannot do
    (e.g. DeepSpeed 0.19.8's ``load_checkpoint`` looks frozen parameters up by their *current*
    ``requires_grad``, so a parameter frozen after the save raises ``KeyError``) is no test of FCDP. The
    driver discards the sequence and counts the reason; an FCDP engine raising where ZeRO-3 did not is a
    failure.
    """


@dataclass
class Sequence:
    """A sequence's engines and the state its events share (rank side)."""

    kinds: tuple[eng.EngineKind, ...]
    layout: eng.Layout
    placement: dict
    dtype: str
    regime: str
    zero_init: bool
    workdir: str
    offload: str = "none"  # engines.OFFLOADS
    optimizer: str = "adam"  # or "sgd" (engines.ds_config)
    built: list[eng.Built] = field(default_factory=list)
    micro: int = 0  # micro-steps so far: the data of the next one
    builds: int = 0  # engines built so far: the init seed of the next model
    tags: dict[str, eng.Layout] = field(default_factory=dict)  # saved checkpoint tag -> its layout
    #: FCDP paths the sequence ran (summed ``get_stats`` counters of every FCDP engine it built).
    coverage: Counter = field(default_factory=Counter)

    @classmethod
    def begin(cls, config: dict) -> "Sequence":
        obj = [tempfile.mkdtemp(prefix="fcdp-events-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        seq = cls(kinds=tuple(eng.KINDS[k] for k in config["engines"]),
                  layout=eng.Layout(VOCAB, config["mode"], config.get("layers", 2)),
                  placement=dict(config["placement"]), dtype=config["dtype"], regime=config["regime"],
                  zero_init=config["zero_init"], workdir=obj[0],
                  offload=config.get("offload", "none"), optimizer=config.get("optimizer", "adam"))
        seq.rebuild(seq.layout, seq.placement, seq.zero_init)
        if config.get("initial_tag"):
            save(seq, config["initial_tag"])
        return seq

    def end(self) -> None:
        self._count(self.built)
        self.built = []
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def rebuild(self, layout: eng.Layout, placement: dict, zero_init: bool,
                prepare: Optional[Callable[[Optional[eng.Built], torch.nn.Module, dict], None]] = None) -> None:
        """Fresh engines (same init on every kind); ``prepare(old, model, config)`` runs before ``initialize``."""
        seed = 1000 * self.builds
        self.builds += 1
        old = self.built or [None] * len(self.kinds)
        fresh = []
        for kind, before in zip(self.kinds, old):
            with _reference_guard(kind):
                cfg = eng.ds_config(kind, placement, dtype=self.dtype, regime=self.regime, offload=self.offload,
                                    optimizer=self.optimizer)
                model = eng.build_model(layout, cfg if zero_init else None, seed)
                if prepare is not None:
                    prepare(before, model, cfg)
                fresh.append(eng.initialize(kind, model, cfg))
        self._count(self.built)
        self.built, self.layout, self.placement = fresh, layout, dict(placement)

    def _count(self, built: list[eng.Built]) -> None:
        for b in built:
            rt = b.fcdp
            if rt is None or rt.cache is None:
                continue
            stats = rt.stats()
            self.coverage.update({k: stats[k] for k in COVERAGE_KEYS})
            self.coverage.update({f"invalidations.{k}": v for k, v in stats["invalidations"].items()})
            self.coverage["engines"] += 1
            self.coverage["engines promoted to device"] += int(rt.promotion.promoted)
            self.coverage["slots on device"] += sum(e.placement is Placement.DEVICE for e in rt.cache.entries.values())
            self.coverage["uncached params"] += stats["uncached_params"]

    def dir_of(self, b: eng.Built) -> str:
        return os.path.join(self.workdir, b.kind.name)

    def each(self, fn: Callable[[eng.Built], Obs]) -> dict[str, Obs]:
        """``fn`` on every engine, the reference first ([Note: unsupported sequences])."""
        out = {}
        for b in self.built:
            with _reference_guard(b.kind):
                out[b.kind.name] = fn(b) or {}
        return out


@contextlib.contextmanager
def _reference_guard(kind: eng.EngineKind) -> Iterator[None]:
    """Turn an exception of the reference engine into :class:`Unsupported`."""
    try:
        yield
    except Exception as err:
        if kind.compare != "reference":
            raise
        raise Unsupported(f"{type(err).__name__}: {str(err)[:200]}") from err


# -- data --------------------------------------------------------------------------------------------
def batch(micro: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * dist.get_rank() + micro)
    ids = torch.randint(0, vocab, (eng.MICRO_BATCH, SEQ), generator=g)
    return ids, torch.randn(eng.MICRO_BATCH, SEQ, HIDDEN, generator=g)


def probe_input(vocab: int) -> torch.Tensor:
    """The same on every rank (rank lockstep compares the outputs)."""
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(12345))


def evaluate(engine: Any, ids: torch.Tensor) -> torch.Tensor:
    engine.eval()
    with torch.no_grad():
        out = engine(ids.to(engine.device)).detach().float().clone()
    engine.train()
    return out


def _delta(shape: torch.Size, seed: int) -> torch.Tensor:
    return 0.05 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# -- events ------------------------------------------------------------------------------------------
def _inside_window(seq: Sequence, b: eng.Built, event: str) -> None:
    """A checkpoint event between two micro-steps of a window: ``save_checkpoint``, the 16-bit consolidation
    (``_zero3_consolidated_16bit_state_dict``, what HF's ``save_model`` runs) or an in-process ``load_checkpoint``
    of ``t0`` (skipped after a resize: that load needs fresh engines). ZeRO-3 keeps the window's partial sums."""
    e = b.engine
    if event == "save":
        e.save_checkpoint(seq.dir_of(b), tag="mid_window")
    elif event == "save16":
        e._zero3_consolidated_16bit_state_dict()
    elif event == "load" and seq.tags.get("t0") == seq.layout:
        e.load_checkpoint(seq.dir_of(b), tag="t0")


def train(seq: Sequence, micro: int, ckpt: bool = False, eval_between: bool = False,
          bad_batch: bool = False, inside: str = "") -> dict[str, Obs]:
    """One optimizer step of ``micro`` micro-steps ([Note: GA per step]); activation checkpointing
    recomputes the blocks in backward when ``ckpt``; ``eval_between`` evaluates after the first micro-step;
    ``bad_batch``: the first micro-step's loss is infinite (a bad batch), so the gradient norm is not
    finite and ZeRO-3 skips the step (``is_invalid_grad_norm``, any dtype) and discards the window;
    ``inside``: a checkpoint event after the first micro-step (:func:`_inside_window`)."""
    def step(b: eng.Built) -> Obs:
        e = b.engine
        e.set_train_batch_size(eng.MICRO_BATCH * e.dp_world_size * micro)
        e.module.activation_checkpointing = ckpt
        obs: Obs = {"losses": []}
        for i in range(micro):
            e.set_gradient_accumulation_boundary(i == micro - 1)
            ids, y = batch(seq.micro + i, seq.layout.vocab)
            loss = F.mse_loss(e(ids.to(e.device)).float(), y.to(e.device))
            if bad_batch and i == 0:
                loss = loss * float("inf")
            e.backward(loss)
            e.step()
            obs["losses"].append(loss.item())
            if eval_between and i == 0 and micro > 1:
                obs["outputs"] = evaluate(e, probe_input(seq.layout.vocab))
            if inside and i == 0 and micro > 1:
                _inside_window(seq, b, inside)
        e.module.activation_checkpointing = False
        return obs

    out = seq.each(step)
    seq.micro += micro
    return out


def second_engine(seq: Sequence, train: bool = False) -> dict[str, Obs]:
    """A second engine over each engine's model ([Note: two engines over one model] in ``runtime/attach.py``):
    ``train`` false, an optimizer-less engine (an evaluation or reference model) that evaluates once and stays alive
    beside the first; ``train`` true, a training engine that replaces the first (a re-initialization after a config
    change, a policy rebuilt over the same modules): from now on its optimizer writes the partitions that the first
    engine's fetch path serves. Plain ZeRO-3 does the same."""
    ids = probe_input(seq.layout.vocab)

    def build(b: eng.Built) -> Obs:
        module = b.engine.module
        if not train:
            cfg = {k: v for k, v in b.config.items() if k not in ("optimizer", "fuzz_sgd_lr")}
            cfg = {**cfg, "zero_allow_untested_optimizer": True}
            other, *_ = deepspeed.initialize(model=module, config=cfg)
            b.others.append(other)
            return {"outputs": evaluate(other, ids)}
        other = eng.initialize(b.kind, module, b.config)
        b.others.append(b.engine)  # alive: its fetch path still serves the model
        b.engine, b.names = other.engine, other.names
        return {"outputs": evaluate(b.engine, ids)}
    return seq.each(build)


def eval_(seq: Sequence) -> dict[str, Obs]:
    """A ``no_grad`` forward in eval mode (an evaluation loop between steps)."""
    ids = probe_input(seq.layout.vocab)
    return seq.each(lambda b: {"outputs": evaluate(b.engine, ids)})


def gathered_write(seq: Sequence, module: int, rank: int, seed: int = 0) -> dict[str, Obs]:
    """``GatheredParameters(module params, modifier_rank=rank)``: that rank edits, DeepSpeed broadcasts."""
    def write(b: eng.Built) -> Obs:
        params = list(_module(b, module)[1].parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=rank):
            if dist.get_rank() == rank:
                with torch.no_grad():
                    for i, p in enumerate(params):
                        p.data.add_(_delta(p.shape, seed * 31 + i).to(p.dtype))
        return {}
    return seq.each(write)


def gathered_read(seq: Sequence, module: int) -> dict[str, Obs]:
    """``GatheredParameters(module params)`` read only (``modifier_rank=None``): the gathered values."""
    def read(b: eng.Built) -> Obs:
        params = list(_module(b, module)[1].parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params):
            return {"outputs": torch.cat([p.detach().float().reshape(-1) for p in params])}
    return seq.each(read)


def _state_dict_values(b: eng.Built, seed: int, subset: str) -> dict[str, torch.Tensor]:
    """New values for the named parameters (``subset``: all, the adapters only, or the base only)."""
    values = {}
    for i, (name, p) in enumerate(sorted(b.engine.module.named_parameters())):
        if subset == "all" or (subset == "lora") == ("lora_" in name):
            values[name] = (0.2 * torch.randn(p.ds_shape, generator=torch.Generator().manual_seed(seed * 101 + i))
                            ).to(p.dtype)
    return values


def hf_load(seq: Sequence, seed: int = 0, subset: str = "all") -> dict[str, Obs]:
    """transformers' ZeRO-3 state-dict load into the running model (``model.hf_load_state_dict``)."""
    return seq.each(lambda b: hf_load_state_dict(b.engine.module, _state_dict_values(b, seed, subset)) or {})


def from_pretrained(seq: Sequence, resize: int = 0, style: str = "hf5", placement: Optional[dict] = None
                    ) -> dict[str, Obs]:
    """``save_pretrained`` + ``from_pretrained`` under ZeRO-3: each engine's 16-bit consolidated weights,
    loaded HF-style into a model built under ``zero.Init``, optionally resized, then a new engine."""
    seq.each(lambda b: b.engine.save_16bit_model(seq.dir_of(b), "pretrained.bin") and {})
    dist.barrier()
    old_layout = seq.layout
    layout = eng.Layout(max(4, old_layout.vocab + resize), old_layout.mode, old_layout.layers)

    def prepare(before: Optional[eng.Built], model: torch.nn.Module, cfg: dict) -> None:
        state = torch.load(os.path.join(seq.dir_of(before), "pretrained.bin"), map_location="cpu")
        hf_load_state_dict(model, state)
        if layout.vocab != old_layout.vocab:
            resize_token_embeddings(model, layout.vocab, style, cfg, seed=seq.builds)
            set_trainable(model, layout.mode)  # a new nn.Embedding requires grad: adapters go on after a resize

    seq.rebuild(old_layout, placement if placement is not None else seq.placement, zero_init=True, prepare=prepare)
    seq.layout = layout
    return {}


def set_requires_grad(seq: Sequence, module: int, requires_grad: bool) -> dict[str, Obs]:
    """Freeze or unfreeze one module's parameters between steps."""
    def flip(b: eng.Built) -> Obs:
        for p in _module(b, module)[1].parameters(recurse=False):
            p.requires_grad = requires_grad
        return {}
    return seq.each(flip)


def set_lr(seq: Sequence, lr: float) -> dict[str, Obs]:
    def set_(b: eng.Built) -> Obs:
        for group in b.engine.optimizer.param_groups:
            group["lr"] = lr
        return {}
    return seq.each(set_)


def save(seq: Sequence, tag: str) -> dict[str, Obs]:
    out = seq.each(lambda b: b.engine.save_checkpoint(seq.dir_of(b), tag=tag) and {})
    seq.tags[tag] = seq.layout
    return out


def load(seq: Sequence, tag: str, fresh: bool = False, warm: bool = False, module_only: bool = False,
         placement: Optional[dict] = None) -> dict[str, Obs]:
    """``load_checkpoint`` into the running engines, or into fresh ones (the same layout, any placement;
    ``warm``: after one eval forward, as a script that evaluates before it resumes). A checkpoint of another
    layout (a resize since) always loads into fresh engines."""
    layout = seq.tags[tag]
    if fresh or layout != seq.layout:
        seq.rebuild(layout, placement if placement is not None else seq.placement, seq.zero_init)
        if warm:
            eval_(seq)
    return seq.each(lambda b: b.engine.load_checkpoint(seq.dir_of(b), tag=tag, load_module_only=module_only) and {})


def save16(seq: Sequence) -> dict[str, Obs]:
    """``save_16bit_model``: the 16-bit consolidation (``GatheredParameters`` per module, rank 0 writes)."""
    return seq.each(lambda b: b.engine.save_16bit_model(seq.dir_of(b), "model16.bin") and {})


def _module(b: eng.Built, index: int) -> tuple[str, torch.nn.Module]:
    mods = modules_with_params(b.engine.module)
    return mods[index % len(mods)]


#: Event name -> function (the driver sends names and keyword arguments).
EVENTS: dict[str, Callable[..., dict[str, Obs]]] = {
    "train": train, "eval": eval_, "gathered_write": gathered_write, "gathered_read": gathered_read,
    "hf_load": hf_load, "from_pretrained": from_pretrained, "set_requires_grad": set_requires_grad,
    "set_lr": set_lr, "save": save, "load": load, "save16": save16, "second_engine": second_engine,
}
