"""DeepSpeed version gate: FCDP runs only on DeepSpeed releases it was tested against.

FCDP hooks private DeepSpeed internals (the stage-3 secondary-tensor path, the optimizer's
invalidation events). Those move between releases, so the plugin only runs on tested releases unless
the user explicitly opts out. Standard library only: the startup hook decides with it before
anything imports torch or DeepSpeed.
"""
from __future__ import annotations

import json
import os
# [Note: no runtime ``typing`` import: the startup hook imports this module at every interpreter start.]
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Mapping, Optional

# The release table: which releases in the declared range passed the release smoke subset.
# ``deepspeed_releases.json`` (next to this module, shipped in the wheel) is written by
# ``scripts/check_all_releases.py``, which runs ``scripts/check_deepspeed_release.sh`` on every release in the
# range; the gate admits exactly the releases it records as passed, and ``docs/deepspeed-releases.md`` shows
# the same table (``tests/test_packaging.py`` keeps them in step).
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_releases.json")
PASSED = "passed"
#: The markers around the generated table in docs/deepspeed-releases.md.
BEGIN, END = "<!-- release-table:begin (scripts/check_all_releases.py writes it) -->", "<!-- release-table:end -->"


def release_key(version: str) -> tuple[int, ...]:
    """``"0.17.6+abc"`` -> ``(0, 17, 6)`` (non-numeric parts end the tuple)."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def load(path: str = PATH) -> dict[str, Any]:
    """``{"candidates": [every release in the declared range], "results": {version: {result, seconds, why}}}``."""
    with open(path) as f:
        return json.load(f)


def passed(table: dict[str, Any]) -> tuple[str, ...]:
    """The releases that passed, oldest first."""
    return tuple(sorted((v for v, r in table["results"].items() if r["result"] == PASSED), key=release_key))


def markdown(table: dict[str, Any]) -> str:
    """The table for docs/deepspeed-releases.md, newest release first; releases never run say so."""
    rows = ["| DeepSpeed | admitted | result | seconds | why it failed |", "| --- | --- | --- | --- | --- |"]
    for v in sorted(table["candidates"], key=release_key, reverse=True):
        r = table["results"].get(v)
        if r is None:
            rows.append(f"| {v} | no | not run | - | not run yet (`python scripts/check_all_releases.py` resumes) |")
        else:
            ok = r["result"] == PASSED
            why = r.get("why", "").replace("|", "\\|") or "-"
            rows.append(f"| {v} | {'yes' if ok else 'no'} | {r['result']} | {r['seconds']} | {why if not ok else '-'} |")
    return "\n".join(rows)


#: DeepSpeed releases that passed the release smoke subset (parity and traffic tests), oldest first: read from
#: the release table (``deepspeed_releases.json``, written by ``scripts/check_all_releases.py``).
TESTED_DEEPSPEED_VERSIONS = passed(load())
#: The torch release CI runs with (constraints.txt pins it); the package declares ``torch>=2.0``.
TESTED_TORCH_VERSION = "2.13.0"
#: Set to 1 to run on an untested DeepSpeed release anyway (at your own risk).
ALLOW_UNTESTED_ENV = "FCDP_ALLOW_UNTESTED_DEEPSPEED"


class UnsupportedDeepSpeedVersion(ImportError):
    """The installed DeepSpeed release was never tested with FCDP."""


def version_is_tested(version: str, env: Optional[Mapping[str, str]] = None) -> bool:
    allow = (env if env is not None else os.environ).get(ALLOW_UNTESTED_ENV, "") == "1"
    return version.split("+")[0] in TESTED_DEEPSPEED_VERSIONS or allow


_release = release_key


def deepspeed_requirement() -> str:
    """What ``pyproject.toml`` declares: exactly the tested releases, as the range from the oldest to the
    newest with ``!=`` for every release between them that did not pass (or was not run), so pip installs
    or keeps only releases the gate admits."""
    table = load()
    low, high = _release(TESTED_DEEPSPEED_VERSIONS[0]), _release(TESTED_DEEPSPEED_VERSIONS[-1])
    gaps = sorted((v for v in table["candidates"] if low < _release(v) < high and v not in TESTED_DEEPSPEED_VERSIONS),
                  key=_release)
    return ",".join([f"deepspeed>={TESTED_DEEPSPEED_VERSIONS[0]}", f"<={TESTED_DEEPSPEED_VERSIONS[-1]}",
                     *(f"!={v}" for v in gaps)])


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
