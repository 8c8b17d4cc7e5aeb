"""The DeepSpeed release table: which releases in the declared range passed the release smoke subset.

``deepspeed_releases.json`` (next to this module, shipped in the wheel) is written by
``scripts/check_all_releases.py``, which runs ``scripts/check_deepspeed_release.sh`` on every release in
the range; the version gate admits exactly the releases it records as passed, and
``docs/deepspeed-releases.md`` shows the same table (``tests/test_packaging.py`` keeps them in step).
Standard library only: the startup hook reads it through the gate at every interpreter start.
"""
from __future__ import annotations

import json
import os
# [Note: no runtime ``typing`` import: the startup hook imports this module at every interpreter start.]
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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
