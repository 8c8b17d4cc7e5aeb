"""The core's entry points: patch DeepSpeed (install/uninstall), get_stats, comm counting.

The public ``fcdp_deepspeed.install()`` / ``initialize()`` (package ``__init__``) call these and
also install the integrations, which the core never imports.
"""
from __future__ import annotations

from typing import Any, Optional

from fcdp_deepspeed.activation.version_gate import check_deepspeed_version

check_deepspeed_version()  # before anything below patches or subclasses DeepSpeed's internals

import deepspeed  # noqa: E402
import deepspeed.runtime.engine as _engine_module  # noqa: E402
import deepspeed.runtime.zero.stage3 as _stage3_module  # noqa: E402

from fcdp_deepspeed.activation import excepthook, shm_hint  # noqa: E402
from fcdp_deepspeed.diloco import files as diloco_files  # noqa: E402
from fcdp_deepspeed.engine.config_check import FCDPCheckedConfig, check_zero_init  # noqa: E402
from fcdp_deepspeed.engine.stage3 import CountedStage3, CountedZeROOffload  # noqa: E402
from fcdp_deepspeed.grads import uninstall_dispatch  # noqa: E402
from fcdp_deepspeed.machine.topology import discover_node_map  # noqa: E402
from fcdp_deepspeed.reporting.engine_stats import stats_of  # noqa: E402
from fcdp_deepspeed.reporting.monitor import RecordingMonitorMaster  # noqa: E402
from fcdp_deepspeed.reporting.stats import LEDGER, LayoutKind  # noqa: E402

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
    ``deepspeed.initialize`` parses its config with :class:`~fcdp_deepspeed.engine.config_check.FCDPCheckedConfig`,
    which refuses an enabled block under ZeRO stage 0-2; it and ``zero.Init`` refuse a block inside
    ``zero_optimization`` or under a near-miss key (``config_check.check_zero_init``). This is the core half of the public
    ``fcdp_deepspeed.install()``, which also installs the integrations (HF Trainer stats callback).
    """
    _stage3_module.DeepSpeedZeroOptimizer_Stage3 = CountedStage3
    _engine_module.DeepSpeedZeRoOffload = CountedZeROOffload
    _engine_module.MonitorMaster = RecordingMonitorMaster  # lets FCDP write to the engine's monitor
    deepspeed.DeepSpeedConfig = FCDPCheckedConfig  # what deepspeed.initialize parses every config with
    diloco_files.install()  # fcdp.diloco: every node's checkpoint files (inert for other engines)
    check_zero_init(True)  # zero.Init(config_dict_or_path=...): a misplaced or misspelled block, with the fix
    excepthook.install()  # an uncaught config error: one line per rank, not a traceback each
    shm_hint.hint_first_build()  # the CPU accelerator's first comm-op build: say why the job is quiet


def uninstall() -> None:
    """Undo :func:`install` for engines created afterwards."""
    _stage3_module.DeepSpeedZeroOptimizer_Stage3 = _ORIGINAL_STAGE3
    _engine_module.DeepSpeedZeRoOffload = _ORIGINAL_OFFLOAD
    _engine_module.MonitorMaster = _ORIGINAL_MONITOR
    deepspeed.DeepSpeedConfig = _ORIGINAL_CONFIG
    excepthook.uninstall()
    check_zero_init(False)
    diloco_files.uninstall()
    uninstall_dispatch()


def is_installed() -> bool:
    return _stage3_module.DeepSpeedZeroOptimizer_Stage3 is CountedStage3


def enable_comm_counting(ranks_per_node: Optional[int] = None) -> None:
    """Collective: count collectives by link class, with the node layout discovered on every rank.

    Engines built after :func:`install` count their own collectives without this; call it to give
    plain ZeRO-3 engines the measured layout instead of the launcher-derived one (see ``get_stats``),
    or to count engines built before :func:`install`.
    """
    node_of_rank, source, _ = discover_node_map(ranks_per_node)
    LEDGER.install(node_of_rank, source, kind=LayoutKind.EXPLICIT)


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
