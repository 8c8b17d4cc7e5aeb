"""DeepSpeed version gate: FCDP runs only on DeepSpeed releases it was tested against.

FCDP hooks private DeepSpeed internals (the stage-3 secondary-tensor path, the optimizer's
invalidation events). Those move between releases, so the plugin only runs on tested releases unless
the user explicitly opts out. Standard library only: the startup hook decides with it before
anything imports torch or DeepSpeed.
"""
from __future__ import annotations

import os
# [Note: no runtime ``typing`` import: the startup hook imports this module at every interpreter start.]
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Mapping, Optional


#: DeepSpeed releases the hooks were verified against (parity and traffic tests).
TESTED_DEEPSPEED_VERSIONS = ("0.16.9", "0.17.6", "0.18.9", "0.19.8")
#: The torch release CI runs with (constraints.txt pins it); the package declares ``torch>=2.0``.
TESTED_TORCH_VERSION = "2.13.0"
#: Set to 1 to run on an untested DeepSpeed release anyway (at your own risk).
ALLOW_UNTESTED_ENV = "FCDP_ALLOW_UNTESTED_DEEPSPEED"


class UnsupportedDeepSpeedVersion(ImportError):
    """The installed DeepSpeed release was never tested with FCDP."""


def version_is_tested(version: str, env: Optional[Mapping[str, str]] = None) -> bool:
    allow = (env if env is not None else os.environ).get(ALLOW_UNTESTED_ENV, "") == "1"
    return version.split("+")[0] in TESTED_DEEPSPEED_VERSIONS or allow


def _release(version: str) -> tuple[int, ...]:
    """``"0.17.6+abc"`` -> ``(0, 17, 6)`` (non-numeric parts end the tuple)."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def deepspeed_requirement() -> str:
    """The range ``pyproject.toml`` declares: from the oldest tested release to the next minor after the
    newest. pip keeps any installed release in it; the gate then admits only the tested ones."""
    newest = _release(TESTED_DEEPSPEED_VERSIONS[-1])
    return f"deepspeed>={TESTED_DEEPSPEED_VERSIONS[0]},<{newest[0]}.{newest[1] + 1}"


def suggested_release(version: str) -> str:
    """The tested release to install instead of ``version``: the same minor's if there is one, else the newest."""
    minor = _release(version)[:2]
    same = [v for v in TESTED_DEEPSPEED_VERSIONS if _release(v)[:2] == minor]
    return same[-1] if same else TESTED_DEEPSPEED_VERSIONS[-1]


def untested_message(version: str) -> str:
    return (f"fcdp-deepspeed was tested with deepspeed=={', '.join(TESTED_DEEPSPEED_VERSIONS)} but "
            f"deepspeed=={version} is installed. Fix: `pip install deepspeed=={suggested_release(version)}`, "
            f"or set {ALLOW_UNTESTED_ENV}=1 to run untested (verify parity with `\"verify\": true`).")


def check_deepspeed_version(version: Optional[str] = None) -> str:
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
