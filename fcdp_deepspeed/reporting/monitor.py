"""FCDP counters in DeepSpeed's monitor (csv / TensorBoard / wandb / comet).

The stage-3 optimizer never sees its engine, but the engine builds its ``MonitorMaster`` just
before it builds the optimizer. ``install()`` swaps in :class:`RecordingMonitorMaster`, which
remembers the latest monitor of this process, so the FCDP runtime writes to the *engine's* monitor
instead of opening a second wandb run or event file.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

from deepspeed.monitor.monitor import MonitorMaster

_LAST: Optional[weakref.ReferenceType] = None

#: ``get_stats`` keys reported as ``fcdp/<key>``, the same names in DeepSpeed's monitor (every
#: ``fcdp.log_interval`` steps) and in the HF Trainer's logs (every logging step): running totals since the
#: engine was created, except the memory keys (now) and ``cache_hit_rate`` (hits / lookups, since creation).
REPORTED_KEYS = ("inter_node_allgather_bytes", "intra_node_allgather_bytes", "inter_node_grad_reduce_bytes",
                 "intra_node_grad_reduce_bytes", "cache_hit_rate", "cache_hits", "cache_misses", "host_slot_bytes",
                 "device_slot_bytes", "host_cache_bytes", "device_cache_bytes")
PREFIX = "fcdp/"
#: Reported too while ``fcdp.param_compression`` is on.
COMPRESSION_KEYS = ("inter_node_param_compressed_bytes", "inter_node_param_exact_bytes", "param_drift_max_all_ranks",
                    "param_drift_mean_all_ranks")


class RecordingMonitorMaster(MonitorMaster):
    """DeepSpeed's MonitorMaster that registers itself as this process's latest monitor."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)
        global _LAST
        _LAST = weakref.ref(self)


def latest_monitor() -> Optional[MonitorMaster]:
    return _LAST() if _LAST is not None else None


def reported_values(stats: dict) -> dict[str, float]:
    """``fcdp/<key>`` -> value for the keys of :data:`REPORTED_KEYS` that ``stats`` has (hit rate derived)."""
    lookups = stats.get("cache_hits", 0) + stats.get("cache_misses", 0)
    values = dict(stats, cache_hit_rate=stats.get("cache_hits", 0) / lookups if lookups else 0.0)
    keys = REPORTED_KEYS + (COMPRESSION_KEYS if stats.get("param_compression", "off") != "off" else ())
    return {PREFIX + key: values[key] for key in keys if key in values}


def monitor_events(stats: dict, step: int) -> list[tuple[str, float, int]]:
    return [(name, float(value), step) for name, value in reported_values(stats).items()]
