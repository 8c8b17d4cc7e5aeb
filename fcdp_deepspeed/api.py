"""Public entry points: install/initialize/get_stats."""
from __future__ import annotations

import functools
from typing import Any, Optional

import deepspeed
import deepspeed.runtime.engine as _engine_module
import deepspeed.runtime.zero.stage3 as _stage3_module

import fcdp_deepspeed_autoload as _autoload
from fcdp_deepspeed.engine_config import FCDPCheckedConfig
from fcdp_deepspeed.grads import uninstall_dispatch
from fcdp_deepspeed.integrations import hf as _hf
from fcdp_deepspeed.monitor import RecordingMonitorMaster
from fcdp_deepspeed.stage3 import CountedStage3, CountedZeROOffload
from fcdp_deepspeed.stats import LEDGER, LayoutKind
from fcdp_deepspeed.topology import discover_node_map

_ORIGINAL_STAGE3 = _stage3_module.DeepSpeedZeroOptimizer_Stage3
_ORIGINAL_OFFLOAD = _engine_module.DeepSpeedZeRoOffload
_ORIGINAL_MONITOR = _engine_module.MonitorMaster
_ORIGINAL_CONFIG = deepspeed.DeepSpeedConfig


def install() -> None:
    """Make ``deepspeed.initialize`` build FCDP's stage-3 classes. Idempotent.

    Safe to call for any job: engines whose config has no enabled ``fcdp`` block run DeepSpeed's
    ZeRO-3 classes, subclassed only to count their collectives (``CountedStage3``,
    ``CountedZeROOffload``); an enabled block gets ``FCDPStage3`` / ``FCDPZeROOffload``. The engine
    looks both classes up in these modules when it builds a ZeRO-3 engine: the optimizer class
    (training) and the offload class (engines without an optimizer).
    ``deepspeed.initialize`` parses its config with :class:`~fcdp_deepspeed.engine_config.FCDPCheckedConfig`,
    which refuses an enabled block under ZeRO stage 0-2. HF Trainers with an enabled block get
    :mod:`fcdp_deepspeed.integrations.hf`'s stats callback.
    """
    _stage3_module.DeepSpeedZeroOptimizer_Stage3 = CountedStage3
    _engine_module.DeepSpeedZeRoOffload = CountedZeROOffload
    _engine_module.MonitorMaster = RecordingMonitorMaster  # lets FCDP write to the engine's monitor
    deepspeed.DeepSpeedConfig = FCDPCheckedConfig  # what deepspeed.initialize parses every config with
    _autoload.when_imported("transformers.trainer", _hf.patch_trainer)


def uninstall() -> None:
    """Undo :func:`install` for engines created afterwards."""
    _stage3_module.DeepSpeedZeroOptimizer_Stage3 = _ORIGINAL_STAGE3
    _engine_module.DeepSpeedZeRoOffload = _ORIGINAL_OFFLOAD
    _engine_module.MonitorMaster = _ORIGINAL_MONITOR
    deepspeed.DeepSpeedConfig = _ORIGINAL_CONFIG
    _autoload.forget("transformers.trainer", _hf.patch_trainer)
    _hf.unpatch_trainer()
    uninstall_dispatch()


def is_installed() -> bool:
    return _stage3_module.DeepSpeedZeroOptimizer_Stage3 is CountedStage3


@functools.wraps(deepspeed.initialize)
def initialize(*args: Any, **kwargs: Any):
    """Drop-in for ``deepspeed.initialize`` (same signature and return value) with FCDP installed."""
    install()
    return deepspeed.initialize(*args, **kwargs)


def enable_comm_counting(ranks_per_node: Optional[int] = None) -> None:
    """Collective: count collectives by link class, with the node layout discovered on every rank.

    Engines built after :func:`install` count their own collectives without this; call it to give
    plain ZeRO-3 engines the measured layout instead of the launcher-derived one (see ``get_stats``),
    or to count engines built before :func:`install`.
    """
    node_of_rank, source, _ = discover_node_map(ranks_per_node)
    LEDGER.install(node_of_rank, source, kind=LayoutKind.EXPLICIT)


def _process_totals() -> dict:
    totals = {**LEDGER.totals.allgather_summary(), **LEDGER.totals.snapshot()}
    return {f"process_{k}": v for k, v in totals.items()}


def stats_of(optimizer: Any) -> dict:
    """:func:`get_stats` given the engine's ``optimizer`` (the ZeRO-3 optimizer or offload object)."""
    runtime = getattr(optimizer, "fcdp", None)
    if runtime is not None:
        out = runtime.stats()
    else:
        # Engines built by FCDP's classes count their own collectives (fcdp_comm); others, built before
        # install(), only have the process's counts since counting began.
        comm = getattr(optimizer, "fcdp_comm", None)
        since = comm.copy() if comm is not None else LEDGER.totals.copy()
        out = {
            **since.allgather_summary(),
            "cache_hits": 0, "cache_misses": 0, "host_cache_bytes": 0, "device_cache_bytes": 0,
            "fcdp_enabled": False,
            **since.snapshot(),
        }
    plan = getattr(optimizer, "fcdp_grad_plan", None)
    if plan is not None:  # the resolved gradient modes (auto resolved), with or without a reducer
        out.update(plan.stats())
    reducer = getattr(optimizer, "fcdp_grads", None)
    if reducer is not None:
        out.update(reducer.stats())
    out.setdefault("fcdp_enabled", True)
    out["engine_counted"] = hasattr(optimizer, "fcdp_comm")
    comm = getattr(optimizer, "fcdp_comm", None)
    out["node_layout_source"] = LEDGER.layout_for(comm)[1] if comm is not None else LEDGER.layout_source
    out.update(_process_totals())
    return out


def get_stats(engine: Any) -> dict:
    """This rank's counters of ``engine``, cumulative since the engine was created (README, Statistics).

    ``inter_node_allgather_bytes`` / ``intra_node_allgather_bytes``: bytes this rank received in the
    engine's all-gathers whose group spans nodes / stays in a node (``*_grad_reduce_bytes`` likewise
    for its gradient reduction); ``cache_hits``, ``cache_misses``, ``host_cache_bytes``,
    ``device_cache_bytes``: the node cache (0 without an enabled block). Engines built after
    :func:`install` count their own collectives only, whether or not FCDP is enabled for them;
    ``process_*`` keys count every collective of the process.
    """
    return stats_of(getattr(engine, "optimizer", None))
