"""Public entry points: install/initialize/get_stats."""
from __future__ import annotations

import functools
from typing import Any, Optional

import deepspeed
import deepspeed.runtime.engine as _engine_module
import deepspeed.runtime.zero.stage3 as _stage3_module

from fcdp_deepspeed.grads import uninstall_dispatch
from fcdp_deepspeed.monitor import RecordingMonitorMaster
from fcdp_deepspeed.stage3 import FCDPStage3, FCDPZeROOffload
from fcdp_deepspeed.stats import LEDGER
from fcdp_deepspeed.topology import discover_node_map

_ORIGINAL_STAGE3 = _stage3_module.DeepSpeedZeroOptimizer_Stage3
_ORIGINAL_OFFLOAD = _engine_module.DeepSpeedZeRoOffload
_ORIGINAL_MONITOR = _engine_module.MonitorMaster


def install() -> None:
    """Make ``deepspeed.initialize`` build FCDP's stage-3 classes. Idempotent.

    Safe to call for any job: engines whose config has no enabled ``fcdp`` block run plain ZeRO-3.
    The engine looks both classes up in these modules when it builds a ZeRO-3 engine: the
    optimizer class (training) and the offload class (engines without an optimizer).
    """
    _stage3_module.DeepSpeedZeroOptimizer_Stage3 = FCDPStage3
    _engine_module.DeepSpeedZeRoOffload = FCDPZeROOffload
    _engine_module.MonitorMaster = RecordingMonitorMaster  # lets FCDP write to the engine's monitor


def uninstall() -> None:
    """Undo :func:`install` for engines created afterwards."""
    _stage3_module.DeepSpeedZeroOptimizer_Stage3 = _ORIGINAL_STAGE3
    _engine_module.DeepSpeedZeRoOffload = _ORIGINAL_OFFLOAD
    _engine_module.MonitorMaster = _ORIGINAL_MONITOR
    uninstall_dispatch()


def is_installed() -> bool:
    return _stage3_module.DeepSpeedZeroOptimizer_Stage3 is FCDPStage3


@functools.wraps(deepspeed.initialize)
def initialize(*args: Any, **kwargs: Any):
    """Drop-in for ``deepspeed.initialize`` (same signature and return value) with FCDP installed."""
    install()
    return deepspeed.initialize(*args, **kwargs)


def enable_comm_counting(ranks_per_node: Optional[int] = None) -> None:
    """Collective: count collectives by link class in this process, also for plain ZeRO-3 engines.

    FCDP engines do this themselves; call it to compare a plain ZeRO-3 or hpZ run.
    """
    node_of_rank, _, _ = discover_node_map(ranks_per_node)
    LEDGER.install(node_of_rank)


def _process_totals() -> dict:
    totals = {**LEDGER.totals.allgather_summary(), **LEDGER.totals.snapshot()}
    return {f"process_{k}": v for k, v in totals.items()}


def get_stats(engine: Any) -> dict:
    """FCDP counters of ``engine`` on this rank, cumulative since engine creation.

    Keys include ``inter_node_allgather_bytes``, ``intra_node_allgather_bytes``, ``cache_hits``,
    ``cache_misses``, ``host_cache_bytes``, ``device_cache_bytes`` (bytes each rank received in
    all-gathers whose group spans nodes / stays in a node). For an engine without an enabled block,
    the cache keys are 0 and the byte keys count this process's collectives since the engine was
    created (built after ``install()``; otherwise since counting began, see :func:`enable_comm_counting`).
    """
    optimizer = getattr(engine, "optimizer", None)
    runtime = getattr(optimizer, "fcdp", None)
    if runtime is not None:
        out = runtime.stats()
    else:
        since = LEDGER.totals.minus(getattr(optimizer, "fcdp_baseline", None))
        out = {
            **since.allgather_summary(),
            "cache_hits": 0, "cache_misses": 0, "host_cache_bytes": 0, "device_cache_bytes": 0,
            "fcdp_enabled": False,
            **since.snapshot(),
        }
    reducer = getattr(optimizer, "fcdp_grads", None)
    if reducer is not None:
        out.update(reducer.stats())
    out.setdefault("fcdp_enabled", True)
    out.update(_process_totals())
    return out
