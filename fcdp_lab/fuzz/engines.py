"""The engines a sequence drives side by side, how each is built, and how each is compared.

Every sequence runs the same events on plain ZeRO-3 (the reference) and on one or more FCDP configs.
Each config names its comparison:

- ``exact``: bit for bit equal to ZeRO-3 (FCDP with ZeRO-3's gradient path, ``flat``/``rank``);
- ``close``: within the documented tolerance of ZeRO-3 (the default gradient modes reorder sums,
  docs/how-it-works.md; ``RTOL`` as in tests/test_grads.py) in sequences that train with SGD, and
  like ``lockstep`` in those that train with Adam ([Note: Adam and the tolerance]);
- ``lockstep``: only consistent across ranks (every rank sees the same weights and outputs) and with
  its own cache; for lossy configs (compression) that are not meant to equal ZeRO-3.

Whatever the comparison, an FCDP engine's cache must hold exactly its own current weights
(``checks.py``), so a missed invalidation fails in every mode.

[Note: Adam and the tolerance] Adam divides each gradient component by its own running magnitude, so
its first steps move every component by about ``lr`` whatever the component's size. A component that
cancels to exactly zero in one summation order and to a rounding residue in the other (bf16 reductions
do this routinely) then moves by ``lr`` in one engine and not at all in the other: the soak found
weights of the default modes ``lr`` apart after one Adam step (seeds 552779738, 1068027891, 805605804;
docs/reliability.md), with both gradients within ZeRO-3's own rounding error. Under SGD a weight moves
by ``lr`` times its gradient, so a rounding-level gradient difference stays one in the weights and a
real one (a stale accumulation window, a lost micro-step) does not: the ``close`` comparison is made
there. Sequences draw the optimizer; the exact engine is compared bit for bit under both.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

import deepspeed

from fcdp_lab.fuzz.model import EventModel, set_trainable
from fcdp_lab.harness import toy

#: Relative tolerance of the ``close`` comparison (tests/test_grads.py ``RTOL``, ``BF16_RTOL``).
RTOL = {"fp32": 1e-5, "bf16": 2e-2}
#: ZeRO-3's own gradient path inside FCDP (bit-identical to plain ZeRO-3).
EXACT_GRADS = {"grad_reduce": "flat", "grad_accumulation": "rank"}
MICRO_BATCH = 2
RANKS_PER_NODE = 2


@dataclass(frozen=True)
class EngineKind:
    """One engine of a sequence: its ``fcdp`` block (``None``: plain ZeRO-3) and its comparison."""

    name: str
    compare: str  # "reference" | "exact" | "close" | "lockstep"

    def compare_in(self, optimizer: str) -> str:
        """The comparison a sequence training with ``optimizer`` makes ([Note: Adam and the tolerance])."""
        return "lockstep" if self.compare == "close" and optimizer != "sgd" else self.compare
    block: Optional[Callable[[dict], dict]] = None  # placement keys -> the fcdp block


def _fcdp(**fixed: Any) -> Callable[[dict], dict]:
    return lambda placement: {"enabled": True, "ranks_per_node": RANKS_PER_NODE, **placement, **fixed}


#: Engine kinds by name. ``fcdp_int8`` (``python -m fcdp_lab soak --engines zero3,fcdp_int8``) compares in lockstep: its
#: compressed stage 1 is every rank's reconstruction, not ZeRO-3's value.
KINDS: dict[str, EngineKind] = {k.name: k for k in (
    EngineKind("zero3", "reference"),
    EngineKind("fcdp", "exact", _fcdp(**EXACT_GRADS)),
    EngineKind("fcdp_defaults", "close", _fcdp()),
    # compressed stage 1 (references, compressed run-ahead groups): replicas in lockstep, not ZeRO-3's values
    EngineKind("fcdp_int8", "lockstep", _fcdp(**EXACT_GRADS, param_compression="int8", param_gather="auto")),
)}


@dataclass(frozen=True)
class Layout:
    """What a checkpoint's optimizer state depends on: the model's shape and the trainable set at build."""

    vocab: int
    mode: str  # "full" | "lora" | "partial" (model.set_trainable)
    layers: int = 2


@dataclass
class Built:
    """One live engine of a sequence."""

    kind: EngineKind
    engine: Any
    config: dict
    names: dict = field(default_factory=dict)  # parameter -> name
    #: Other engines over the same model, kept alive (``events.second_engine``).
    others: list = field(default_factory=list)

    @property
    def fcdp(self):
        """The engine's ``FCDPRuntime`` (``None`` for plain ZeRO-3)."""
        return getattr(self.engine.optimizer, "fcdp", None)


#: ZeRO-Offload settings a sequence may draw (every engine of the sequence gets the same).
OFFLOADS = {"none": {}, "optimizer": {"offload_optimizer": {"device": "cpu"}},
            "param": {"offload_param": {"device": "cpu"}},
            "both": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


def ds_config(kind: EngineKind, placement: dict, *, dtype: str, regime: str, offload: str = "none",
              optimizer: str = "adam", lr: float = 1e-2) -> dict:
    """The engine's DeepSpeed config; ``optimizer="sgd"`` drops the config's optimizer (``initialize`` passes
    ``torch.optim.SGD``, a client optimizer, which ZeRO-3 and ZeRO-Offload have to be told to accept)."""
    block = kind.block(dict(placement)) if kind.block is not None else None
    cfg = toy.ds_config(block, regime=regime, micro_batch=MICRO_BATCH, lr=lr, dtype=dtype, **OFFLOADS[offload])
    if optimizer == "sgd":
        cfg.pop("optimizer")
        cfg["zero_force_ds_cpu_optimizer"] = False
        cfg["zero_allow_untested_optimizer"] = True
        cfg["fuzz_sgd_lr"] = lr  # read by initialize, ignored by DeepSpeed (an unknown top-level key)
    return cfg


def build_model(layout: Layout, cfg: Optional[dict], seed: int) -> EventModel:
    """A fresh model; under ``zero.Init(config_dict_or_path=cfg)`` when ``cfg`` is given (as HF does)."""
    torch.manual_seed(seed)
    if cfg is not None:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = EventModel(vocab=layout.vocab, layers=layout.layers)
    else:
        model = EventModel(vocab=layout.vocab, layers=layout.layers)
    set_trainable(model, layout.mode)
    return model


def initialize(kind: EngineKind, model: torch.nn.Module, cfg: dict) -> Built:
    """``deepspeed.initialize`` with the model's trainable parameters, as a training script does."""
    import fcdp_deepspeed
    fcdp_deepspeed.install()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=cfg["fuzz_sgd_lr"]) if "fuzz_sgd_lr" in cfg else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer,
                                      config=copy.deepcopy(cfg))
    return Built(kind, engine, cfg, {p: n for n, p in engine.module.named_parameters()})


