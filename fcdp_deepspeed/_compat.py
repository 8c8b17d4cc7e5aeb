"""DeepSpeed version gate.

FCDP hooks private DeepSpeed internals (the stage-3 secondary-tensor path, the optimizer's
invalidation events). Those move between releases, so the plugin only runs on releases it was
tested against unless the user explicitly opts out.
"""
from __future__ import annotations

import os

#: DeepSpeed releases the hooks were verified against (parity and traffic tests).
TESTED_DEEPSPEED_VERSIONS = ("0.19.8", )
#: Set to 1 to run on an untested DeepSpeed release anyway (at your own risk).
ALLOW_UNTESTED_ENV = "FCDP_ALLOW_UNTESTED_DEEPSPEED"


class UnsupportedDeepSpeedVersion(ImportError):
    """Raised at import when the installed DeepSpeed release was never tested with FCDP."""


def check_deepspeed_version(version: str | None = None) -> str:
    """Return the DeepSpeed version, or raise if it is not a tested release.

    Why: a silently changed internal (e.g. the secondary-partition call in ``Init._partition``)
    would turn the cache into stale or garbled weights instead of an error.
    """
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    base = version.split("+")[0]
    if base in TESTED_DEEPSPEED_VERSIONS or os.environ.get(ALLOW_UNTESTED_ENV, "") == "1":
        return version
    raise UnsupportedDeepSpeedVersion(
        f"fcdp-deepspeed was tested with deepspeed=={', '.join(TESTED_DEEPSPEED_VERSIONS)} but "
        f"deepspeed=={version} is installed. Fix: `pip install deepspeed=={TESTED_DEEPSPEED_VERSIONS[-1]}`, "
        f"or set {ALLOW_UNTESTED_ENV}=1 to run untested (verify parity with `\"verify\": true`).")
