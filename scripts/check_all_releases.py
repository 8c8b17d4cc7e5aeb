#!/usr/bin/env python3
"""Run the release smoke subset on every DeepSpeed release in the declared range (resumable).

Each release: ``scripts/check_deepspeed_release.sh VERSION`` (a venv of its own, the smoke tests), its
result written at once to ``fcdp_deepspeed/activation/deepspeed_releases.json`` and the table in
``docs/deepspeed-releases.md``; releases already recorded are skipped (``--rerun`` runs them again).
Order: the newest patch of each minor first, then the others round-robin across minors, newest first.
The version gate then admits exactly the releases recorded as passed.

    nice -n 19 ionice -c 3 python3 scripts/check_all_releases.py --deadline 18:35 > release-check.log 2>&1 &
    python3 scripts/check_all_releases.py --sync    # then: pyproject.toml and .ci/run admit what passed

Standard library only. Candidates come from ``fcdp_deepspeed/activation/deepspeed_releases.json`` (``candidates``), or
``--versions``. The release venv is deleted after its run unless ``--keep-venvs``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "deepspeed-releases.md"
# Deselected: whether the gate lists the release (it does not yet: this run decides it), and a static CI check.
DESELECT = "not test_release_is_listed and not test_ci_checks"


def _table_module():
    spec = importlib.util.spec_from_file_location("version_gate", ROOT / "fcdp_deepspeed" / "activation" / "version_gate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rt = _table_module()


def order(candidates: list[str]) -> list[str]:
    """Newest patch of each minor (newest minor first), then the rest round-robin across minors."""
    minors: dict[tuple[int, ...], list[str]] = {}
    for v in sorted(candidates, key=rt.release_key, reverse=True):
        minors.setdefault(rt.release_key(v)[:2], []).append(v)
    queues = [minors[m] for m in sorted(minors, reverse=True)]
    out = [q.pop(0) for q in queues]
    while any(queues):
        out += [q.pop(0) for q in queues if q]
    return out


def why_failed(log: str, rc: int) -> str:
    """One line: the failed tests and their first error line, or the last pip/Python error."""
    failed = re.findall(r"^(?:FAILED|ERROR) \S+?::(\S+)(?: - (.*))?$", log, re.M)
    if failed:
        names = ", ".join(n for n, _ in failed[:4]) + (f" (+{len(failed) - 4})" if len(failed) > 4 else "")
        first = next((m for _, m in failed if m), "")
        return f"{names}: {first}"[:240]
    errors = [ln.strip() for ln in log.splitlines() if re.match(r"\s*(ERROR:|\w+Error\b|\w+Exception\b)", ln)]
    if errors:
        return errors[-1][:240]
    return f"exit status {rc}" + (" (timed out)" if rc == 124 else "")


def write(table: dict, path: Path, doc: Path = DOC) -> None:
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    text = doc.read_text()
    start, end = text.index(rt.BEGIN) + len(rt.BEGIN), text.index(rt.END)
    doc.write_text(text[:start] + "\n" + rt.markdown(table) + "\n" + text[end:])


def run_one(version: str, timeout: float, logdir: Path) -> dict:
    env = dict(os.environ, FCDP_ALLOW_UNTESTED_DEEPSPEED="1")
    start = time.monotonic()
    log_path = logdir / f"deepspeed-{version}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "scripts/check_deepspeed_release.sh", version, "-k", DESELECT],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {}  # not recorded: "not run"
    seconds = round(time.monotonic() - start)
    text = log_path.read_text(errors="replace")
    ok = rc == 0 and re.search(r"\d+ passed", text) is not None
    summary = re.findall(r"^=* ?(\d+ passed.*?|\d+ failed.*?)(?: =*)?$", text, re.M)
    return {"result": rt.PASSED if ok else "failed", "seconds": seconds,
            "why": "" if ok else why_failed(text, rc), "pytest": summary[-1].strip() if summary else "",
            "date": datetime.date.today().isoformat()}


def ci_versions(passed: tuple[str, ...], main_suite: str) -> list[str]:
    """CI's compatibility stage: the newest admitted patch of each minor plus the oldest admitted release,
    less the main suite's own release (constraints.txt), oldest first."""
    newest = {rt.release_key(v)[:2]: v for v in sorted(passed, key=rt.release_key)}
    keep = set(newest.values()) | {passed[0]}
    return sorted(keep - {main_suite}, key=rt.release_key)


def sync(table: dict) -> None:
    """Write what the table admits into pyproject.toml's deepspeed requirement and .ci/run's ``versions=(...)``
    (tests/test_packaging.py and tests/test_release_smoke.py check both)."""
    sys.path.insert(0, str(ROOT))
    from fcdp_deepspeed.activation import version_gate  # noqa: E402  (reads the same table)
    pyproject = ROOT / "pyproject.toml"
    text = re.sub(r'^    "deepspeed[^"]*",$', f'    "{version_gate.deepspeed_requirement()}",', pyproject.read_text(),
                  count=1, flags=re.M)
    pyproject.write_text(text)
    main_suite = re.search(r"^deepspeed==([0-9.]+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    ci = ROOT / ".ci" / "run"
    versions = " ".join(ci_versions(rt.passed(table), main_suite))
    ci.write_text(re.sub(r"^versions=\([0-9. ]*\)$", f"versions=({versions})", ci.read_text(), count=1, flags=re.M))
    print(f"pyproject: {version_gate.deepspeed_requirement()}\n.ci/run: versions=({versions})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", nargs="*", help="releases to run (default: every candidate in the table)")
    ap.add_argument("--rerun", action="store_true", help="run releases that already have a result")
    ap.add_argument("--deadline", help="HH:MM local time: start no release after it, stop the running one at it")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per release (default 2400)")
    ap.add_argument("--keep-venvs", action="store_true", help="keep .venv-ds-VERSION after its run")
    ap.add_argument("--sync", action="store_true", help="only write the admitted releases into pyproject.toml "
                    "and .ci/run (after a run)")
    ap.add_argument("--table", type=Path, default=Path(rt.PATH))
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--logdir", type=Path, default=ROOT / "release-logs")
    args = ap.parse_args(argv)
    table = rt.load(str(args.table))
    if args.sync:
        sync(table)
        return 0
    todo = order(args.versions or table["candidates"])
    deadline = None
    if args.deadline:
        h, m = map(int, args.deadline.split(":"))
        deadline = datetime.datetime.now().replace(hour=h, minute=m, second=0, microsecond=0).timestamp()
    args.logdir.mkdir(exist_ok=True)
    for version in todo:
        if version in table["results"] and not args.rerun:
            continue
        left = args.timeout if deadline is None else min(args.timeout, deadline - time.time())
        if left <= 60:
            print(f"deadline reached: {version} and later not run", flush=True)
            break
        print(f"{datetime.datetime.now():%H:%M:%S} deepspeed {version} ...", flush=True)
        result = run_one(version, left, args.logdir)
        if not args.keep_venvs:
            shutil.rmtree(ROOT / f".venv-ds-{version}", ignore_errors=True)
        if not result:
            print(f"deepspeed {version}: stopped (deadline/timeout), not recorded", flush=True)
            continue
        table = rt.load(str(args.table))  # [Note: re-read: another run may have added rows meanwhile]
        table["results"][version] = result
        write(table, args.table, args.doc)
        print(f"deepspeed {version}: {result['result']} in {result['seconds']} s {result['why']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
