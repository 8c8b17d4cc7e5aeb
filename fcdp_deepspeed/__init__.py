"""fcdp-deepspeed: Fully Cached Data Parallel for DeepSpeed ZeRO-3.

Add ``"fcdp": {"enabled": true}`` to a ZeRO-3 DeepSpeed config. Once this package is pip-installed
that is all: its startup hook (``fcdp_deepspeed_autoload``) calls :func:`install` when a process
imports DeepSpeed. Without the hook (``FCDP_AUTOLOAD=0``), call :func:`install` once before building
the model, use :func:`initialize` instead of ``deepspeed.initialize``, or launch with
``python -m fcdp_deepspeed.run``.
"""
from __future__ import annotations

from fcdp_deepspeed._compat import check_deepspeed_version

check_deepspeed_version()

from fcdp_deepspeed.api import enable_comm_counting, get_stats, initialize, install, is_installed, uninstall  # noqa: E402
from fcdp_deepspeed.config import FCDPConfig, FCDPConfigError, parse_fcdp_config  # noqa: E402
from fcdp_deepspeed.runtime import StaleCacheError  # noqa: E402
from fcdp_deepspeed.topology import TopologyError  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "install", "uninstall", "is_installed", "initialize", "get_stats", "enable_comm_counting", "FCDPConfig",
    "FCDPConfigError", "TopologyError", "StaleCacheError", "parse_fcdp_config", "__version__"
]

import fcdp_deepspeed_autoload as _autoload  # noqa: E402

_autoload.package_ready()  # the startup hook saw this import bring in DeepSpeed: install now
