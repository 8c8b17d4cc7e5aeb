"""The ``"fcdp"`` block of a DeepSpeed config, validated strictly.

The block sits at the top level of the DeepSpeed JSON (DeepSpeed ignores unknown top-level keys
but rejects unknown keys inside ``zero_optimization``). It is a ``DeepSpeedConfigModel`` so a
typo fails with the same strictness as DeepSpeed's own blocks, but errors are re-raised as
:class:`FCDPConfigError` naming the key and the fix.

The folder holds what reads configs, below every other room: this module (the block), ``diloco.py`` (its
``diloco`` block), ``errors.py`` (bad input into one message per key, with the fix), ``model.py`` (the strict
base model) and ``ds_compat.py`` (the DeepSpeed internals that differ between the supported releases).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping, Optional, Union

import hjson
from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from fcdp_deepspeed import paths
from fcdp_deepspeed.config import ds_compat
from fcdp_deepspeed.config.diloco import DiLoCoConfig, DiLoCoField, ds_problems as diloco_problems
from fcdp_deepspeed.config.layered import LayeredConfig, LayeredField, ds_problems as layered_problems
from fcdp_deepspeed.config.errors import FCDP_KEY, FCDPConfigError, placement_problems, validation_problems

#: Default elements per scale block of the compression codec (``fcdp.compression_block``; ``compress/quant.py``).
DEFAULT_BLOCK = 128
#: The range of ``fcdp.compression_block``.
MIN_BLOCK, MAX_BLOCK = 8, 2**16

__all__ = ["Budget", "FCDPConfig", "FCDPConfigError", "FCDP_KEY", "allowed_keys", "check_block_placement",
           "check_ds_config_compatible", "load_ds_config", "parse_fcdp_config"]
#: ``fcdp.log_interval`` when neither it nor a ``steps_per_print`` of at most MAX_FOLLOWED_STEPS_PER_PRINT is set.
DEFAULT_LOG_INTERVAL = 10
#: A larger ``steps_per_print`` is a way to silence DeepSpeed's own prints (the shipped configs set 1000000),
#: not an interval anyone reads a report at: FCDP's line then keeps its own default.
MAX_FOLLOWED_STEPS_PER_PRINT = 1000


def parse_verify(value: Any) -> Any:
    """``fcdp.verify``: ``true``/``false`` or a sampling rate in (0, 1] (numbers and their strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        rate = float(value) if isinstance(value, (int, float, str)) else math.nan
    except (ValueError, OverflowError):
        rate = math.nan
    if not 0.0 < rate <= 1.0:
        raise FCDPConfigError(f"fcdp.verify = {value!r}: expected true, false or a sampling rate in (0, 1] such as "
                              f"0.01. Fix: set fcdp.verify to one of them, or leave it out (off).")
    return rate


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[kmgt]i?b|b)?\s*$", re.IGNORECASE)


def _grad_bucket_size(value: Any) -> Any:
    """``fcdp.grad_bucket_size``: ``"auto"`` or a whole number of elements >= 0."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise FCDPConfigError(f"fcdp.grad_bucket_size = {value!r}: expected \"auto\" or a whole number of elements >= 0 "
                          f"(0: DeepSpeed's reduce_bucket_size). Fix: set it to one of them, or leave it out (auto).")


def _to_float(key: str, number: Any) -> float:
    """``number`` as a finite float; a budget too large for one (a 400-digit count) is refused."""
    # [Note: float() of a huge int raises OverflowError and of a huge digit string gives inf; both
    # used to escape as OverflowError from int() instead of an error naming the key.]
    try:
        value = float(number)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        shown = str(number) if len(str(number)) <= 40 else f"{str(number)[:40]}..."
        raise FCDPConfigError(f"fcdp.{key}: budget {shown} is not a finite number of bytes. "
                              f"Fix: give a byte count such as 8589934592, a size like \"8GiB\" or a percentage.")
    return value


def _byte_count(key: str, number: Any, unit: int) -> float:
    """Whole bytes of ``number`` x ``unit``, refused (naming ``key``) when not finite."""
    return float(int(_to_float(key, _to_float(key, number) * unit)))


@dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, a fraction of what is available, or ``auto``."""

    kind: Literal["bytes", "fraction", "auto"]
    value: float = 0.0

    def resolve(self, available_bytes: int, auto_fraction: float) -> int:
        """Bytes this budget allows, given the memory available when it is applied."""
        if self.kind == "bytes":
            return int(self.value)
        fraction = auto_fraction if self.kind == "auto" else self.value
        return int(max(0, available_bytes) * fraction)

    @classmethod
    def parse(cls, key: str, value: Any) -> "Budget":
        """Parse ``123``, ``"20%"``, ``"8GiB"`` or ``"auto"``; raise naming ``key`` otherwise."""
        if isinstance(value, bool):
            raise FCDPConfigError(f"fcdp.{key}: expected bytes (int), a percentage string like \"20%\", "
                                  f"a size like \"8GiB\" or \"auto\", got {value!r}.")
        if isinstance(value, (int, float)):
            if value < 0:
                raise FCDPConfigError(f"fcdp.{key}: budget must be >= 0 bytes, got {value}. "
                                      f"Fix: give a non-negative byte count or a percentage like \"20%\".")
            if 0 < value < 1:  # [Note: a number is bytes; 0.5 is almost surely meant as a share of memory]
                raise FCDPConfigError(f"fcdp.{key} = {value!r}: a number is a count of bytes, and {value!r} bytes "
                                      f"is no budget. Fix: for a share of the memory write a percentage string, "
                                      f"did you mean \"{value * 100:g}%\"? For bytes give a whole number such as "
                                      f"8589934592 or a size like \"8GiB\".")
            return cls("bytes", _byte_count(key, value, 1))
        if isinstance(value, str):
            if value.strip().lower() == "auto":
                return cls("auto")
            m = _BUDGET_RE.match(value)
            if m:
                number, unit = _to_float(key, m.group(1)), (m.group(2) or "").lower()
                if unit == "%":
                    if number > 100:
                        raise FCDPConfigError(f"fcdp.{key}: percentage must be in 0..100, got {value!r}.")
                    return cls("fraction", number / 100.0)
                return cls("bytes", _byte_count(key, number, _UNITS[unit]))
        raise FCDPConfigError(f"fcdp.{key}: cannot parse budget {value!r}. Fix: use bytes (e.g. 8589934592), "
                              f"a percentage string (e.g. \"20%\"), a size (e.g. \"8GiB\") or \"auto\".")


def _refuse_flat_compression(data: Any) -> None:
    """``grad_compression`` compresses the hierarchical reduce's inter-node stage: refuse it with ``grad_reduce: flat``."""
    if isinstance(data, Mapping) and data.get("grad_compression", "off") != "off" and data.get("grad_reduce") == "flat":
        raise FCDPConfigError(f"fcdp.grad_compression = {data['grad_compression']!r} compresses the inter-node stage "
                              "of the hierarchical gradient reduce-scatter, which fcdp.grad_reduce = \"flat\" does "
                              "not run. Fix: set grad_reduce to \"hierarchical\" (or leave it out), or "
                              "grad_compression to \"off\".")


def _size_string_to_bytes(value: Any, info: Any) -> Any:
    """A size string ("32MiB", "1GB") as whole bytes; anything else goes to the strict ``int`` check."""
    if isinstance(value, str) and _BUDGET_RE.match(value) and not value.strip().endswith("%"):
        return int(Budget.parse(info.field_name, value).value)
    return value


class FCDPConfig(DiLoCoField, LayeredField):
    """User-facing options of the ``"fcdp"`` block. Every field is optional."""

    enabled: bool = False
    """Turn FCDP on. Absent block or ``false``: the job runs as plain ZeRO-3, even after ``install()``."""

    ranks_per_node: Optional[int] = Field(None, ge=1)
    """Ranks per node (L). Default: detected from the launcher (torchrun ``GROUP_RANK``, deepspeed
    ``CROSS_RANK``, ``SLURM_NODEID``, hostname). Setting it treats consecutive blocks of L global ranks
    as one node, which is how several "nodes" are simulated on one machine."""

    cache_device: Literal["host", "device", "auto"] = "auto"
    """Where cached slices live. ``host``: pinned host memory only (zero accelerator overhead).
    ``device``: accelerator memory within ``device_budget``, the rest on the host. ``auto``: host
    first, promoted to the accelerator at step boundaries when measured headroom allows."""

    host_budget: Any = "50%"
    """Host memory the cache may use per node: bytes, a size like ``"64GiB"`` or a percentage of
    available host RAM measured at engine creation. Split evenly across the node's ranks. Slices that
    do not fit stay uncached (plain ZeRO-3) with one warning."""

    device_budget: Any = "auto"
    """Accelerator memory the cache may use per rank: bytes, a size, or a percentage of free
    accelerator memory measured after the model and optimizer are built. ``auto``: in ``device``
    mode 50% of that free memory; in ``auto`` mode half of the headroom left at the peak of the
    first step, so the cache never takes memory a step needed."""

    pin_memory: bool = True
    """Pin the host pool (when the accelerator supports pinning) for fast, asynchronous H2D copies."""

    keep_frozen: bool = True
    """Frozen parameters (``requires_grad=False``) stay cached across optimizer steps (PEFT)."""

    verify: Any = False
    """Check cache hits against a plain ZeRO-3 gather of the same parameter and raise on any
    difference. ``true`` checks every hit, a float in (0, 1] checks that fraction of hits. Costs one
    extra full-group all-gather per checked hit; for debugging."""

    min_numel: int = Field(0, ge=0)
    """Parameters with fewer elements than this are not cached (their gather cost is latency-bound)."""

    grad_reduce: Literal["auto", "flat", "hierarchical"] = "auto"
    """``flat``: DeepSpeed's reduce-scatter over the whole data-parallel group (bit-identical to
    ZeRO-3). ``hierarchical``: reduce inside the node, then across nodes among node peers only, so
    each node uplink carries (N-1)/N of the gradient once; the summation order differs from ZeRO-3.
    ``auto``: ``hierarchical`` wherever there are N > 1 nodes of L > 1 ranks and ``link`` chose FCDP's paths, else
    ``flat`` (docs/how-it-works.md)."""

    grad_accumulation: Literal["auto", "rank", "node"] = "auto"
    """``rank``: DeepSpeed's per-rank accumulation (every micro-step crosses nodes). ``node``: micro-steps
    before the accumulation boundary reduce inside the node into a node-shard buffer; the inter-node
    stage runs once per optimizer step. Implies ``grad_reduce: hierarchical``. ``auto``: ``node``
    wherever the reduction is hierarchical and the whole buffer fits ``grad_buffer_budget``, else ``rank``."""

    grad_bucket_size: Annotated[Any, BeforeValidator(_grad_bucket_size)] = "auto"
    """Cap (elements) on DeepSpeed's ``reduce_bucket_size`` with the hierarchical reduce; ``auto``: ~8 buckets, ``0``:
    DeepSpeed's ([Note: bucket-sized work] in ``engine/grad_steps.py``)."""
    grad_inflight_buckets: int = Field(4, ge=0, strict=True)
    """Gradient stages left in flight behind the backward; ``0``: synchronous ([Note: the inter-node stage runs
    behind the backward] in ``grads/inflight.py``)."""

    grad_buffer_device: Literal["host", "device"] = "host"
    """Where the ``node`` accumulation buffer (1/L of the trainable parameters per rank, fp32) lives:
    pinned host memory (no accelerator memory beyond ZeRO-3's) or accelerator memory (it starts on the host and
    moves what fits after a measured step, ``grads/buffer.py``)."""

    grad_buffer_budget: Any = "25%"
    """Memory the accumulation buffer may use: on the host per node (bytes, a size or a percentage of
    available RAM, split across the node's ranks), on the accelerator per rank (of the headroom the
    first complete step left, measured as the cache's). Parameters that do not fit accumulate per rank (one warning)."""

    param_gather: Literal["flat", "hierarchical", "auto"] = "auto"
    """How a parameter the node cache does not serve (a miss) is gathered. ``flat``: DeepSpeed's ring
    all-gather over the whole data-parallel group ((W-1)/W of the parameter over each node uplink).
    ``hierarchical``: all-gather among node peers, then inside the node ((N-1)/N per uplink); the
    result is bit-identical. ``auto``: hierarchical with several nodes of several ranks where ``link`` chose FCDP's paths,
    flat otherwise (one node, or one rank per node, where both stages would be one; ``hierarchical`` resolves the
    same)."""

    link: Literal["probe", "slow", "fast"] = "probe"
    """Whose data paths the ``auto`` keys resolve to, with several nodes of several ranks. ``probe``: time one fetch
    of the model's mean module size each way on the job's own groups at build (about a second) and run FCDP's paths
    (the cache, the two-stage gather and reduce, node accumulation) where the inter-node link is the bottleneck,
    ZeRO-3's (nothing cached, every path flat) where it is not; every rank makes the same choice. ``slow``: FCDP's
    paths without a probe. ``fast``: ZeRO-3's. Setting ``param_gather``, ``grad_reduce``, ``grad_accumulation`` or a
    compression key chooses FCDP's paths and skips the probe ([Note: why a choice at all] in ``paths.py``)."""

    param_runahead_bytes: Annotated[int, BeforeValidator(_size_string_to_bytes)] = Field(64 * 2**20, ge=0, json_schema_extra={"sizes": True})
    """With the hierarchical gather on a host-communication backend (gloo): from the window's first two-stage gather,
    stage 1 of the next ones is issued ahead, at most this many bytes of full parameters in flight (rolling);
    ``0`` turns it off (runtime/runahead.py, [Note: from the window's first fetch])."""
    param_push_bytes: int = Field(0, ge=0)  # opt-in (0: off); docs/configuration.md; runtime/runahead.py
    param_runahead_streams: bool = False
    """On an accelerator with streams (NCCL): run ahead too, stage 1 into pinned host memory, every stage 1 on FCDP's
    stage-1 stream (runtime/staged.py, [Note: the run-ahead on streams]); opt-in: not yet measured on a GPU."""

    miss_batch_bytes: Annotated[int, BeforeValidator(_size_string_to_bytes)] = Field(32 * 2**20, ge=0, json_schema_extra={"sizes": True})
    """With the hierarchical gather: when every stale cached parameter together is at most this many
    bytes (full size; after an optimizer step, e.g. LoRA adapters), the first miss gathers all of them
    in one collective instead of one per module, and later fetches are hits. Costs that many bytes of
    accelerator memory for the time of the gather. ``0`` turns it off (docs/how-it-works.md)."""

    param_compression: Literal["off", "int8", "int4"] = "off"
    """**Lossy.** Changed parameters cross nodes as quantized deltas against a node-held reference (docs/compression.md)."""
    param_refresh_interval: int = Field(100, ge=0)
    """With ``param_compression``: optimizer steps between exact refreshes of every reference (``0``: never)."""
    grad_compression: Literal["off", "int8", "int4"] = "off"
    """**Lossy.** Inter-node gradient sums cross quantized, with error feedback (docs/compression.md)."""
    compression_block: int = Field(DEFAULT_BLOCK, ge=MIN_BLOCK, le=MAX_BLOCK, multiple_of=2, strict=True)
    """Elements per fp32 scale of a compressed inter-node message (even, for int4's packing; a power of two with
    ``grad_compression: int4`` or ``diloco.compression: int4``, whose blocks are rotated). [Note: strict] A JSON
    integer only: ``"96"`` or ``96.0`` would skip the power-of-two rule below (it reads the raw value) and fail
    inside the codec without the key."""

    log_interval: Optional[int] = Field(None, ge=0)
    """Optimizer steps between rank 0's ``[fcdp]`` log line and the ``fcdp/*`` monitor events. Default:
    DeepSpeed's ``steps_per_print`` when that is a whole number from 1 to 1000, else 10 (accelerate, hence the
    HF Trainer, sets ``steps_per_print`` to infinity; configs silence DeepSpeed with 1000000). ``0`` turns both off."""

    @model_validator(mode="before")
    @classmethod
    def _node_accumulation_is_hierarchical(cls, data: Any) -> Any:
        _refuse_flat_compression(data)
        _compression_needs_the_two_stage_gather(data)
        _rotated_int4_needs_a_power_of_two_block(data)
        _streams_runahead_is_exact(data)
        if isinstance(data, Mapping) and data.get("grad_accumulation") == "node":
            if data.get("grad_reduce", "hierarchical") == "flat":
                raise FCDPConfigError("fcdp.grad_accumulation = \"node\" accumulates a node shard that only node peers "
                                      "can complete, so it needs fcdp.grad_reduce = \"hierarchical\". Fix: set "
                                      "grad_reduce to \"hierarchical\" (or leave it out), or grad_accumulation to \"rank\".")
            data = {**data, "grad_reduce": "hierarchical"}
        return data

    @field_validator("host_budget", "device_budget", "grad_buffer_budget")
    @classmethod
    def _check_budget(cls, value: Any, info) -> Any:
        Budget.parse(info.field_name, value)
        return value

    @field_validator("verify")
    @classmethod
    def _check_verify(cls, value: Any) -> Any:
        return parse_verify(value)

    @property
    def host_budget_spec(self) -> Budget:
        return Budget.parse("host_budget", self.host_budget)

    @property
    def device_budget_spec(self) -> Budget:
        return Budget.parse("device_budget", self.device_budget)

    @property
    def grad_buffer_budget_spec(self) -> Budget:
        return Budget.parse("grad_buffer_budget", self.grad_buffer_budget)

    def paths_asked(self) -> bool:
        """Whether a key says which paths to run (FCDP's): ``fcdp.link`` then decides nothing."""
        return paths.paths_asked({key: getattr(self, key) for key in paths.PATH_KEYS})

    def resolved_param_gather(self, num_nodes: int, ranks_per_node: int) -> str:
        """``param_gather`` for a layout: ``auto`` and degenerate layouts (one node, one rank per node,
        where both stages would be one) resolve to ``flat``."""
        return "hierarchical" if num_nodes > 1 and ranks_per_node > 1 and self.param_gather != "flat" else "flat"

    def resolved_log_interval(self, steps_per_print: Any) -> int:
        """``log_interval``, or its default given DeepSpeed's ``steps_per_print`` (see the field)."""
        if self.log_interval is not None:
            return self.log_interval
        finite = isinstance(steps_per_print, (int, float)) and not isinstance(steps_per_print, bool) and \
            math.isfinite(steps_per_print) and float(steps_per_print).is_integer()
        return int(steps_per_print) if finite and 1 <= steps_per_print <= MAX_FOLLOWED_STEPS_PER_PRINT else DEFAULT_LOG_INTERVAL

    @property
    def verify_rate(self) -> float:
        """Fraction of cache hits that are checked (0 when verification is off)."""
        if isinstance(self.verify, bool):
            return 1.0 if self.verify else 0.0
        return float(self.verify)


def _rotated_int4_needs_a_power_of_two_block(data: Any) -> None:
    """Rotated int4 (``codec_for(..., side="grads")``) rotates each block by a Walsh-Hadamard matrix
    (``compress/quant.py``, [Note: the rotation]), which exists for power-of-two sizes only: ``grad_compression: int4``
    and ``diloco.compression: int4`` (pseudo-gradients, the gradients' codec: ``engine/diloco_steps.py``) use it.
    ``param_compression: int4`` and every ``int8`` do not rotate (any even block)."""
    if not isinstance(data, Mapping):
        return
    block = data.get("compression_block", DEFAULT_BLOCK)
    if not (isinstance(block, int) and not isinstance(block, bool) and block > 0 and block & (block - 1)):
        return
    fix = " or ".join(str(b) for b in _powers_of_two_around(block))
    if data.get("grad_compression") == "int4":
        raise FCDPConfigError(f"fcdp.compression_block = {block} with fcdp.grad_compression = \"int4\": int4 gradients "
                              f"are rotated blockwise by a Walsh-Hadamard transform, which needs a power-of-two block. "
                              f"Fix: set compression_block to {fix}.")
    if _diloco_compression(data.get("diloco")) == "int4":
        raise FCDPConfigError(f"fcdp.compression_block = {block} with fcdp.diloco.compression = \"int4\": DiLoCo's int4 "
                              f"pseudo-gradients are rotated blockwise by a Walsh-Hadamard transform, which needs a "
                              f"power-of-two block. Fix: set compression_block to {fix} (a power of two from "
                              f"{MIN_BLOCK} to {MAX_BLOCK}), or fcdp.diloco.compression to \"int8\" or \"bf16\".")


def _powers_of_two_around(block: int) -> list[int]:
    """The powers of two next to ``block`` that ``compression_block`` takes (``[MIN_BLOCK, MAX_BLOCK]``)."""
    low = 1 << (block.bit_length() - 1)
    return [b for b in (low, low * 2) if MIN_BLOCK <= b <= MAX_BLOCK] or [min(max(low, MIN_BLOCK), MAX_BLOCK)]


def _diloco_compression(diloco: Any) -> Optional[str]:
    """``fcdp.diloco.compression`` of the raw (unparsed) ``diloco`` value when the block is on, else ``None``."""
    if isinstance(diloco, Mapping):
        return diloco.get("compression", "off") if diloco.get("enabled", True) is not False else None
    if isinstance(diloco, DiLoCoConfig):
        return diloco.compression if diloco.enabled else None
    return None


def _streams_runahead_is_exact(data: Any) -> None:
    """The run-ahead on streams issues exact stage 1s only (``runtime/staged.py``)."""
    if isinstance(data, Mapping) and data.get("param_runahead_streams") is True and \
            data.get("param_compression", "off") != "off":
        raise FCDPConfigError(f"fcdp.param_runahead_streams = true with fcdp.param_compression = "
                              f"\"{data['param_compression']}\": the run-ahead on streams gathers exact parameters only "
                              f"(a compressed stage 1 decodes into its references on the gather stream). Fix: set "
                              f"param_runahead_streams to false, or param_compression to \"off\".")


def _compression_needs_the_two_stage_gather(data: Any) -> None:
    if isinstance(data, Mapping) and data.get("param_compression", "off") != "off" and data.get("param_gather") == "flat":
        raise FCDPConfigError(f"fcdp.param_compression = \"{data['param_compression']}\" compresses the inter-node stage "
                              f"of the two-stage gather, which fcdp.param_gather = \"flat\" does not run. Fix: set "
                              f"param_gather to \"auto\" or \"hierarchical\", or param_compression to \"off\".")


def resolved_param_compression(config: FCDPConfig, num_nodes: int, ranks_per_node: int) -> str:
    """``fcdp.param_compression`` for a layout: ``off`` wherever the two-stage gather does not run (one node,
    one rank per node)."""
    return config.param_compression if config.resolved_param_gather(num_nodes, ranks_per_node) != "flat" else "off"


def allowed_keys() -> list[str]:
    return sorted(FCDPConfig.model_fields)


def block_error(problems: list[str]) -> FCDPConfigError:
    """One error for every problem of a block: on one line for one, one per line for several."""
    if len(problems) == 1:
        return FCDPConfigError("invalid \"fcdp\" config block: " + problems[0], problems)
    lines = "".join(f"\n  - {p}" for p in problems)
    return FCDPConfigError(f"invalid \"fcdp\" config block, {len(problems)} problems:{lines}", problems)


def check_block_placement(ds_config: Mapping[str, Any]) -> None:
    """Refuse a block inside ``zero_optimization`` or under a near-miss top-level key (``FCDP``, ``fcpd``)."""
    problems = placement_problems(ds_config)
    if problems:
        raise block_error(problems)


def load_ds_config(config: Union[str, os.PathLike, Mapping[str, Any], Any, None]) -> dict:
    """Return a DeepSpeed config as a dict: from a dict, a path (read with hjson, as DeepSpeed does),
    or an object with ``_param_dict``/``config`` (DeepSpeedConfig, HF's HfDeepSpeedConfig)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        with open(config, "r") as f:
            return dict(hjson.load(f))
    for attr in ("_param_dict", "config"):
        inner = getattr(config, attr, None)
        if isinstance(inner, Mapping):
            return dict(inner)
    raise FCDPConfigError(f"cannot read a DeepSpeed config from {type(config).__name__}; "
                          f"pass a dict or a path to a JSON/HJSON file.")


def parse_fcdp_config(ds_config: Union[str, os.PathLike, Mapping[str, Any], Any, None]) -> FCDPConfig:
    """Parse the ``fcdp`` block of a DeepSpeed config (absent block: disabled)."""
    block = load_ds_config(ds_config).get(FCDP_KEY)
    if block is None:
        return FCDPConfig()
    if isinstance(block, bool):
        return FCDPConfig(enabled=block)
    if not isinstance(block, Mapping):
        raise FCDPConfigError(f"\"fcdp\" must be an object like {{\"enabled\": true}}, got {block!r}.")
    try:
        return FCDPConfig(**dict(block))
    except ValidationError as err:
        raise block_error(validation_problems(err.errors(), FCDPConfig.model_fields)) from None


def check_ds_config_compatible(ds_config: Mapping[str, Any]) -> None:
    """Refuse DeepSpeed features FCDP cannot run correctly, before anything is built.

    Why: each of these bypasses or reshapes the stage-3 fetch path the cache hooks (quantized
    secondaries, NVMe swap-in on every fetch, compiled graphs without module hooks), so running
    them would be wrong rather than slow.
    """
    from deepspeed.runtime.zero.config import get_zero_config

    zero = get_zero_config(dict(ds_config))
    stage = int(zero.stage)
    if stage != 3 and _asks_for_diloco(ds_config):
        raise FCDPConfigError(f"fcdp.diloco needs ZeRO stage 3 (zero_optimization.stage = 3), got stage {stage}: each "
                              f"node is one replica partitioned by ZeRO-3 over its ranks. Fix: set \"zero_optimization\": "
                              f"{{\"stage\": 3}}, or remove fcdp.diloco.")
    if stage != 3:
        raise FCDPConfigError(f"fcdp requires ZeRO stage 3 (zero_optimization.stage = 3), got stage {stage}. "
                              f"Fix: set \"zero_optimization\": {{\"stage\": 3}} or set \"fcdp\": {{\"enabled\": false}}.")
    problems = []
    if zero.zero_hpz_partition_size > 1:
        problems.append("zero_optimization.zero_hpz_partition_size > 1 (ZeRO++ hpZ): FCDP replaces hpZ with a "
                        "topology-derived node cache. Fix: remove zero_hpz_partition_size")
    fcdp = parse_fcdp_config(ds_config)
    if fcdp.diloco is not None:
        problems += diloco_problems(fcdp, zero, ds_config)
    if fcdp.layered is not None:
        problems += layered_problems(fcdp.layered, ds_config)
    if fcdp.grad_compression != "off" and zero.zero_quantized_gradients:
        problems.append(f"fcdp.grad_compression = \"{fcdp.grad_compression}\" with zero_optimization.zero_quantized_gradients "
                        "(ZeRO++ qgZ): both quantize the gradient reduction, and qgZ bypasses the reduce-scatter FCDP "
                        "compresses (and has no error feedback). Fix: set zero_quantized_gradients false, or "
                        "grad_compression \"off\"")
    if zero.zero_quantized_weights or zero.zero_quantized_nontrainable_weights:
        problems.append("zero_optimization.zero_quantized_weights / zero_quantized_nontrainable_weights (ZeRO++ qwZ) "
                        "are not supported with fcdp. Fix: set them to false")
    offload = (dict(ds_config).get("zero_optimization") or {}).get("offload_param") or {}
    if fcdp.param_runahead_streams and str(offload.get("device", "none")) == "cpu" and not offload.get("pin_memory"):
        problems.append("fcdp.param_runahead_streams with zero_optimization.offload_param on pageable host memory "
                        "(pin_memory false, DeepSpeed's default): each run-ahead copy of a partition would hold the host "
                        "until the stage-1 stream's queued inter-node transfers ran (runtime/staged.py). Fix: set "
                        "offload_param.pin_memory true, or param_runahead_streams false")
    if ds_compat.offload_device(zero, "offload_param") == "nvme":
        problems.append("zero_optimization.offload_param.device = nvme is not supported with fcdp. "
                        "Fix: use \"cpu\" or \"none\"")
    if ds_compat.zenflow_config(zero) is not None:
        problems.append("zero_optimization.zenflow is not supported with fcdp (it installs its own stage-3 hooks). "
                        "Fix: remove the zenflow block")
    if zero.offload_optimizer is not None and getattr(zero.offload_optimizer, "super_offload", False):
        problems.append("zero_optimization.offload_optimizer.super_offload is not supported with fcdp "
                        "(it uses a different stage-3 optimizer class). Fix: set super_offload false")
    compile_cfg = ds_config.get("compile") or {}
    if isinstance(compile_cfg, Mapping) and compile_cfg.get("deepcompile"):
        problems.append("compile.deepcompile removes the stage-3 module hooks FCDP relies on. "
                        "Fix: set compile.deepcompile false")
    if problems:
        raise FCDPConfigError("fcdp cannot run with this DeepSpeed config: " + "; ".join(problems) + ".")


def _asks_for_diloco(ds_config: Mapping[str, Any]) -> bool:
    """Whether the raw block has an enabled ``diloco`` object (read before the block is parsed: a malformed block
    under the wrong stage reports the stage first)."""
    block = ds_config.get(FCDP_KEY)
    diloco = block.get("diloco") if isinstance(block, Mapping) else None
    return diloco is True or (isinstance(diloco, Mapping) and diloco.get("enabled", True) is not False)


def grad_path_blockers(ds_config: Mapping[str, Any]) -> tuple[str, ...]:
    """DeepSpeed settings under which stage 3 does not reduce through the bucketed reduce-scatter the
    gradient modes replace, each as "setting ... Fix: ..." (empty: the modes can run)."""
    from deepspeed.runtime.zero.config import get_zero_config

    zero = get_zero_config(dict(ds_config))
    problems = []
    if zero.zero_quantized_gradients:
        problems.append("zero_optimization.zero_quantized_gradients (ZeRO++ qgZ) reduces with its own quantized "
                        "all-to-all. Fix: set it to false")
    # [Note: DeepSpeed 0.19.8 takes the all-reduce path (__avg_scatter_contiguous_grads) only when
    # contiguous_gradients is true AND reduce_scatter is false; otherwise it reduces through
    # __avg_scatter_grads -> reduce_scatter_coalesced, which FCDP hooks, whatever reduce_scatter says.]
    if not zero.reduce_scatter and zero.contiguous_gradients:
        problems.append("zero_optimization.reduce_scatter = false with contiguous_gradients = true reduces with an "
                        "all-reduce of the whole bucket. Fix: set reduce_scatter true (the default) or "
                        "contiguous_gradients false")
    return tuple(problems)


def grad_accumulation_blockers(ds_config: Mapping[str, Any]) -> tuple[str, ...]:
    """DeepSpeed settings under which node accumulation cannot run (see :func:`grad_path_blockers`)."""
    problems = []
    if ds_config.get("managed_gradient_accumulation") is False:
        problems.append("managed_gradient_accumulation = false leaves the accumulation boundary to step(), so no "
                        "backward knows it is the last of the window. Fix: remove it, or set "
                        "fcdp.grad_accumulation to \"rank\"")
    factor = ds_config.get("gradient_predivide_factor", 1.0)
    if factor not in (None, 1, 1.0):  # DeepSpeed allows it only with reduce_scatter false
        problems.append(f"gradient_predivide_factor = {factor} rescales each reduced bucket after the reduce-scatter, "
                        "which window sums flushed at the end of backward would miss. Fix: remove it, or set "
                        "fcdp.grad_accumulation to \"rank\"")
    return tuple(problems)
