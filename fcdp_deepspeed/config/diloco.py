"""The ``fcdp.diloco`` block: DiLoCo across nodes (**lossy**, opt-in), parsed strictly, and what it refuses.

A present block turns DiLoCo on (``"enabled": false`` turns it off again). Every message names the key
(``fcdp.diloco.<key>``) and the fix; ``config_errors.validation_problems`` passes messages that start with
``fcdp.`` through unchanged, so a bad value inside the block reads the same as one of the outer block.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import BeforeValidator, Field, ValidationError, model_validator

from fcdp_deepspeed.config.ds_compat import offload_device
from fcdp_deepspeed.config.errors import FCDP_KEY, sub_block_error
from fcdp_deepspeed.config.model import StrictConfigModel

KEY = f"{FCDP_KEY}.diloco"


class DiLoCoConfig(StrictConfigModel):
    """``fcdp.diloco``: each node is one DiLoCo replica (exact ZeRO-3 over the node's ranks); every ``sync_every``
    optimizer steps the nodes average their pseudo-gradients (outer - local) and take one outer SGD step (by
    default plain averaging: ``outer_lr`` 1, no momentum)."""

    enabled: bool = True
    """A present block turns DiLoCo on; ``false`` leaves the job exact."""
    sync_every: int = Field(50, ge=1)
    """H: optimizer steps (the engine's ``step()`` calls, overflow-skipped ones included) between outer syncs."""
    outer_lr: float = Field(1.0, gt=0)
    """The outer SGD learning rate. 1 with ``outer_momentum`` 0 is plain averaging of the replicas: the best of
    the seven outer settings measured on the byte-level model at H = 10 (docs/diloco.md), where DiLoCo's own
    setting (lr 0.7, Nesterov momentum 0.9, arXiv 2311.08105) was the worst; that setting is tuned for far larger
    models and awaits a run at their scale."""
    outer_momentum: float = Field(0.0, ge=0, lt=1)
    """The outer momentum. 0 (the default, measured best with ``outer_lr`` 1, see ``outer_lr``) is plain averaging
    of the replicas scaled by ``outer_lr``; DiLoCo's paper uses 0.9 with Nesterov."""
    nesterov: bool = True
    """Nesterov momentum for the outer step (DiLoCo's choice; no effect with ``outer_momentum`` 0); ``false``:
    heavy-ball momentum."""
    compression: Literal["off", "bf16", "int8", "int4"] = "off"
    """Codec of the pseudo-gradient exchange (``compress/quant.py``) with error feedback across syncs; ``off``
    sends fp32, ``bf16`` half of that ([Note: bf16 pseudo-gradients])."""
    fragments: int = Field(1, ge=1)
    """Streaming DiLoCo: the model's outer state in this many fragments, one synced every ``sync_every /
    fragments`` steps (each fragment every ``sync_every``); must divide ``sync_every``."""
    warmup_steps: int = Field(0, ge=0)
    """Exact data-parallel optimizer steps before the first inner step: the nodes' reduced gradients averaged
    every step, so every node takes bitwise the same step; the outer parameters start from the model at the end
    of the warm-up (DiLoCo starts from a model pretrained with data parallelism). Costs about the exact bound's
    bytes per warm-up step ([Note: the warm-up] in ``diloco/warmup.py``)."""
    overlap_steps: Optional[int] = Field(None, ge=0)
    """Inner steps a fragment's exchange runs behind (issued after one step, completed after this many more);
    0: the sync blocks. Default: 1 with ``fragments`` > 1, else 0. At most ``sync_every / fragments``."""

    @model_validator(mode="before")
    @classmethod
    def _fragments_divide_sync_every(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            h, f = data.get("sync_every", 50), data.get("fragments", 1)
            if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (h, f)) and h % f:
                raise ValueError(f"{KEY}.fragments = {f} does not divide {KEY}.sync_every = {h}: each fragment syncs "
                                 f"every sync_every / fragments steps. Fix: set fragments to a divisor of {h} "
                                 f"(1 syncs the whole model at once) or sync_every to a multiple of {f}.")
            tau = data.get("overlap_steps")
            if isinstance(tau, int) and not isinstance(tau, bool) and isinstance(h, int) and isinstance(f, int) \
                    and f >= 1 and h % f == 0 and tau > h // f:
                raise ValueError(f"{KEY}.overlap_steps = {tau} is more than sync_every / fragments = {h // f}: a "
                                 f"fragment's exchange must complete before the next one is issued. Fix: set "
                                 f"overlap_steps to at most {h // f}.")
        return data

    @property
    def overlap(self) -> int:
        """The resolved ``overlap_steps``."""
        return self.overlap_steps if self.overlap_steps is not None else (1 if self.fragments > 1 else 0)

    @property
    def interval(self) -> int:
        """Steps between two fragment syncs."""
        return self.sync_every // self.fragments


_FIXES = {
    "sync_every": "a whole number of optimizer steps >= 1 such as 50",
    "outer_lr": "a positive number such as 1.0",
    "outer_momentum": "a number in [0, 1) such as 0.0",
    "nesterov": "true or false",
    "compression": "\"off\", \"bf16\", \"int8\" or \"int4\"",
    "fragments": "a whole number >= 1 that divides sync_every (1: the whole model at once)",
    "overlap_steps": "a whole number of steps in [0, sync_every / fragments] (0: the sync blocks)",
    "warmup_steps": "a whole number of exact data-parallel steps >= 0 (0: DiLoCo from the first step)",
    "enabled": "true or false",
}


def parse_diloco(value: Any) -> DiLoCoConfig | None:
    """``fcdp.diloco`` as given (a mapping, ``true``/``false`` or absent) -> the parsed block, ``None`` when off.

    Raises ``ValueError`` whose message names ``fcdp.diloco.<key>`` and the fix (inside pydantic's validator of
    the outer block, which turns it into an ``FCDPConfigError``)."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if isinstance(value, DiLoCoConfig):
        return value if value.enabled else None
    if not isinstance(value, Mapping):
        raise ValueError(f"{KEY} must be an object like {{\"sync_every\": 50}}, got {value!r}. Fix: give the block "
                         f"as an object, or leave it out (exact data parallelism).")
    try:
        parsed = DiLoCoConfig(**dict(value))
    except ValidationError as err:
        raise sub_block_error(KEY, err.errors()[0], _FIXES) from None
    return parsed if parsed.enabled else None


#: The type of ``FCDPConfig.diloco``: parsed by :func:`parse_diloco` (``None``: DiLoCo off).
DiLoCoBlock = Annotated[Optional[DiLoCoConfig], BeforeValidator(parse_diloco)]


class DiLoCoField(StrictConfigModel):
    """The base of ``FCDPConfig`` that holds its ``diloco`` key (kept here, with the block it parses)."""

    diloco: DiLoCoBlock = None
    """**Lossy.** DiLoCo across nodes: exact ZeRO-3 inside each node, an outer step over the nodes'
    averaged pseudo-gradients every ``sync_every`` steps (docs/diloco.md). Absent: exact data parallelism."""

#: Settings of the outer ``fcdp`` block for the cross-node paths DiLoCo replaces: key -> (refused values, why).
_CROSS_NODE_KEYS = {
    "grad_reduce": (("hierarchical",), "DiLoCo reduces gradients inside each node only"),
    "grad_accumulation": (("node",), "DiLoCo reduces gradients inside each node only"),
    "param_gather": (("hierarchical",), "DiLoCo gathers parameters inside each node only"),
    "param_compression": (("int8", "int4"), "no parameter crosses nodes between syncs"),
    "grad_compression": (("int8", "int4"), "no gradient crosses nodes; compress the sync with fcdp.diloco.compression"),
}


def ds_problems(fcdp: Any, zero: Any, ds_config: Mapping[str, Any]) -> list[str]:
    """What an enabled ``fcdp.diloco`` cannot run with (``zero`` DeepSpeed's parsed ZeRO config), each with the fix."""
    out = [f"fcdp.{key} = {getattr(fcdp, key)!r} with fcdp.diloco: {why}. Fix: remove fcdp.{key}"
           for key, (refused, why) in _CROSS_NODE_KEYS.items() if getattr(fcdp, key) in refused]
    if offload_device(zero, "offload_param") != "none":
        out.append("zero_optimization.offload_param with fcdp.diloco is not supported in this version. "
                   "Fix: remove offload_param")
    if offload_device(zero, "offload_optimizer") == "nvme":
        out.append("zero_optimization.offload_optimizer.device = nvme with fcdp.diloco (the fp32 master weights the "
                   "outer step rewrites live on disk). Fix: use \"cpu\" or \"none\"")
    if fcdp.diloco is not None and fcdp.diloco.warmup_steps and offload_device(zero, "offload_optimizer") != "none":
        out.append(f"{KEY}.warmup_steps = {fcdp.diloco.warmup_steps} with zero_optimization.offload_optimizer: the "
                   "offloaded step takes each node's gradient norm during the backward, before the warm-up averages "
                   "the gradients over the nodes. Fix: set warmup_steps to 0, or remove offload_optimizer")
    if zero.zero_quantized_gradients:
        out.append("zero_optimization.zero_quantized_gradients (qgZ) reduces over a world-wide all-to-all, which "
                   "DiLoCo keeps inside the node. Fix: set it to false")
    if ds_config.get("moe") or ds_config.get("expert_parallel"):
        out.append("MoE / expert parallelism with fcdp.diloco: experts are partitioned over their own groups. "
                   "Fix: remove fcdp.diloco")
    return out
