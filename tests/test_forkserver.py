"""The fork server behind ``run_local`` (``fcdp_lab/harness/forkserver.py``): forked ranks see
their own environment, modules imported by the server saw that environment too (one server per
environment), failures and exit codes reach the launcher as from spawned ranks."""
from __future__ import annotations

import os

import pytest

from conftest import TESTS_DIR, worker_target
from fcdp_lab.harness import forkserver
from fcdp_lab.harness.launch import RankFailure, run_local

MODES = {"forked": "1", "spawned": "0"}


def _run(worker: str, mode: str, world: int = 2, **env: str) -> list:
    return run_local(worker_target(worker), world, {}, timeout=240, pythonpath=[TESTS_DIR],
                     env={forkserver.FORKSERVER_ENV: MODES[mode], forkserver.PRELOAD_ENV: "workers.launch", **env})


def check_probe_runs(mode: str) -> None:
    """Two runs that differ only in a variable read at import time: each rank saw its own run's value."""
    for value in ("first", "second"):
        for rank, r in enumerate(_run("launch:environment", mode, FCDP_TEST_PROBE=value)):
            assert (r["rank"], r["probe"], r["at_import"]) == (str(rank), value, value), r


@pytest.mark.parametrize("mode", MODES)
def test_ranks_see_their_environment_at_import_and_at_run(mode):
    check_probe_runs(mode)
    ranks = _run("launch:environment", mode)
    parents = {r["ppid"] for r in ranks}
    if mode == "forked":  # siblings of one server, not children of the launcher
        assert len(parents) == 1 and parents != {os.getpid()}
    else:
        assert parents == {os.getpid()}
    assert all(r["cwd"] == os.getcwd() == r["path0"] for r in ranks)


def test_a_server_shared_across_environments_fails_the_check(monkeypatch):
    """Broken variant: a server picked without the import-time variable hands the second run modules that
    saw the first run's value."""
    monkeypatch.setattr(forkserver, "PER_RANK", (*forkserver.PER_RANK, "FCDP_TEST_PROBE"))
    with pytest.raises(AssertionError, match="first"):
        check_probe_runs("forked")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how, code, text", [("exit", 3, "exit 3"), ("raise", 1, "deliberate failure on this rank")])
def test_a_failing_rank_is_reported_with_its_exit_code_and_log(mode, how, code, text):
    with pytest.raises(RankFailure) as err:
        run_local(worker_target("launch:fail_on_rank"), 2, {"rank": 1, "how": how}, timeout=240,
                  pythonpath=[TESTS_DIR], env={forkserver.FORKSERVER_ENV: MODES[mode]})
    assert "ranks [1] failed" in str(err.value) and f"exit {code}" in str(err.value) and text in str(err.value)


def test_a_broken_variant_named_for_one_run_does_not_reach_the_next():
    """``FCDP_LAB_BREAK`` goes to each forked rank, never to its server (``fcdp_lab/startup.py`` would patch the
    server, and every rank it forks later would inherit the patch): one server serves a run with a variant and the
    next run without one, and only the first run's ranks are patched."""
    assert "FCDP_LAB_BREAK" in forkserver.PER_RANK
    broken = _run("common:lab_variants", "forked", FCDP_LAB_BREAK="push.skip_invalidation")
    clean = _run("common:lab_variants", "forked")
    assert all(r["patched"] and r["named"] == "push.skip_invalidation" for r in broken), broken
    assert not any(r["patched"] or r["named"] for r in clean), clean
    assert len({r["ppid"] for r in broken + clean}) == 1, (broken, clean)  # the same server forked both runs


def test_a_misspelt_variant_ends_a_process_started_without_the_harness():
    """A process the venv starts (torchrun's, the launcher's, a test's own) installs ``FCDP_LAB_BREAK`` from
    ``fcdp_lab.pth``; a name it does not know ends it, rather than running the working code under a broken name."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bad = subprocess.run([sys.executable, "-c", "print('RAN')"], env={**env, "FCDP_LAB_BREAK": "push.bogus"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "RAN" not in bad.stdout and "push.bogus" in bad.stderr, bad
    good = subprocess.run([sys.executable, "-c", "print('RAN')"], env=env, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and good.stdout.strip() == "RAN", good
