"""The local launcher and the emulated cluster (``fcdp_deepspeed.tools``): an interrupted run leaves
no ranks, temporary directories or network namespaces behind."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import TESTS_DIR, worker_target
from fcdp_lab.harness.cluster import PREFIX, namespaces_available

SLEEPER = worker_target("launch:sleeper")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait a moment for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("forkserver", ["1", "0"], ids=["forked", "spawned"])
def test_sigterm_during_a_run_leaves_nothing_behind(tmp_path, forkserver):
    """An interrupted launcher kills its ranks (and its fork server) and removes its temp dir (and namespaces, if any)."""
    script = tmp_path / "interrupt.py"
    pids = tmp_path / "pids"
    pids.mkdir()
    script.write_text(f"""
import sys; sys.path.insert(0, {TESTS_DIR!r})
from fcdp_lab.harness.launch import run_local
run_local({SLEEPER!r}, 2, {{"pid_dir": {str(pids)!r}}}, timeout=120, pythonpath=[{TESTS_DIR!r}])
""")
    tmp = tmp_path / "tmp"  # its own temp dir: other test runs on the machine come and go in /tmp
    tmp.mkdir()
    before_shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True,
                            env=dict(os.environ, FCDP_FORKSERVER=forkserver, TMPDIR=str(tmp)))
    deadline = time.time() + 90
    while time.time() < deadline and len(list(pids.glob("rank?"))) < 2:
        time.sleep(0.2)
    ranks = [tuple(map(int, p.read_text().split())) for p in sorted(pids.glob("rank?"))]
    assert len(ranks) == 2, "the ranks did not start"
    assert all(_running(pid) for pid, _ in ranks) and len(glob.glob(str(tmp / "fcdp-run-*"))) == 1
    parents = {ppid for _, ppid in ranks}
    assert parents == ({proc.pid} if forkserver == "0" else parents - {proc.pid})  # forked: by the server
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    time.sleep(1)
    assert glob.glob(str(tmp / "fcdp-run-*")) == []
    assert not subprocess.run(["pgrep", "-f", SLEEPER], capture_output=True).stdout
    assert not [pid for pid, _ in ranks if _running(pid)] and not [p for p in parents if _running(p)]
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) - before_shm == set()


@pytest.mark.skipif(not namespaces_available()[0], reason="network namespaces unavailable")
def test_sigterm_removes_emulated_cluster(tmp_path):
    script = tmp_path / "cluster.py"
    script.write_text("""
import time
from fcdp_lab.harness.cluster import EmulatedCluster
with EmulatedCluster(2, rate_mbit=100, tag="s"):
    print("up", flush=True)
    time.sleep(120)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    ours = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(f"{PREFIX}{proc.pid}x")]
    assert len(ours) == 3
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    left = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(f"{PREFIX}{proc.pid}x")]
    assert left == []
