"""The GPU check's result types and its human summary (see :mod:`fcdp_lab.gpu.check`)."""
from __future__ import annotations

import os
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

#: The checkout; frames under its plugin or its lab are FCDP's call sites.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN_DIRS = tuple(os.path.join(ROOT, name) + os.sep for name in ("fcdp_deepspeed", "fcdp_lab"))


@dataclass
class Check:
    name: str
    passed: Optional[bool]
    """``None``: not applicable in this mode (the CPU accelerator has no device memory or streams)."""
    detail: str = ""


@dataclass
class CaseResult:
    case: str
    checks: list[Check] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)
    error: Optional[str] = None

    def check(self, name: str, passed: Any, detail: str = "", applicable: bool = True) -> None:
        self.checks.append(Check(name, bool(passed) if applicable else None, detail))

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed is not False for c in self.checks)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def call_site(exc: BaseException) -> str:
    """The exception and the innermost frame of FCDP's code (the plugin or the lab) that led to it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(OWN_DIRS)]
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {os.path.relpath(f.filename, ROOT)}:{f.lineno} ({f.line})"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"


def summary(report: dict) -> str:
    """A short human summary: one line per case, one per failed check."""
    lines = [f"gpu_check ({report['mode']}, {report['gpus']} GPU(s)): {'PASS' if report['passed'] else 'FAIL'}"]
    for name, case in report["cases"].items():
        counts = {k: sum(c["passed"] is v for c in case["checks"])
                  for k, v in (("pass", True), ("fail", False), ("n/a", None))}
        lines.append(f"  {name}: {'PASS' if case['passed'] else 'FAIL'} ({counts['pass']} pass, {counts['fail']} fail, "
                     f"{counts['n/a']} n/a, {case['numbers'].get('seconds')} s)")
        lines += [f"    FAIL {c['name']}: {c['detail']}" for c in case["checks"] if c["passed"] is False]
        if case["error"]:
            lines.append(f"    ERROR {case['error'].splitlines()[0]}")
    return "\n".join(lines)
