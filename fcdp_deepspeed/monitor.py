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

#: Counters written every ``steps_per_print`` optimizer steps, as ``FCDP/<key>``.
MONITORED_KEYS = ("inter_node_allgather_bytes", "intra_node_allgather_bytes", "inter_node_grad_reduce_bytes",
                  "intra_node_grad_reduce_bytes", "cache_hit_rate", "cache_hits", "cache_misses", "host_cache_bytes",
                  "device_cache_bytes")
#: Written too while ``fcdp.param_compression`` is on.
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


def monitor_events(stats: dict, step: int) -> list[tuple[str, float, int]]:
    lookups = stats["cache_hits"] + stats["cache_misses"]
    values = dict(stats, cache_hit_rate=stats["cache_hits"] / lookups if lookups else 0.0)
    keys = MONITORED_KEYS + (COMPRESSION_KEYS if stats.get("param_compression", "off") != "off" else ())
    return [(f"FCDP/{key}", float(values[key]), step) for key in keys]
