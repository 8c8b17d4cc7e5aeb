"""DeepSpeed version gate.

FCDP hooks private DeepSpeed internals (the stage-3 secondary-tensor path, the optimizer's
invalidation events). Those move between releases, so the plugin only runs on releases it was
tested against unless the user explicitly opts out. The list lives in the startup hook module,
which must decide before importing this package (see ``fcdp_deepspeed_autoload``).
"""
from __future__ import annotations

from fcdp_deepspeed_autoload import (ALLOW_UNTESTED_ENV, TESTED_DEEPSPEED_VERSIONS, UnsupportedDeepSpeedVersion,
                                     untested_message, version_is_tested)

__all__ = ["ALLOW_UNTESTED_ENV", "TESTED_DEEPSPEED_VERSIONS", "UnsupportedDeepSpeedVersion", "check_deepspeed_version"]


def check_deepspeed_version(version: str | None = None) -> str:
    """Return the DeepSpeed version, or raise if it is not a tested release.

    Why: a silently changed internal (e.g. the secondary-partition call in ``Init._partition``)
    would turn the cache into stale or garbled weights instead of an error.
    """
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    if version_is_tested(version):
        return version
    raise UnsupportedDeepSpeedVersion(untested_message(version))
