"""The local launcher and the emulated cluster (``fcdp_deepspeed.tools``): an interrupted run leaves
no ranks, temporary directories or network namespaces behind."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import TESTS_DIR, worker_target
from fcdp_deepspeed.tools.cluster import PREFIX, namespaces_available

SLEEPER = worker_target("launch:sleeper")


def test_sigterm_during_a_run_leaves_nothing_behind(tmp_path):
    """An interrupted launcher kills its ranks and removes its temp dir (and namespaces, if any)."""
    script = tmp_path / "interrupt.py"
    script.write_text(f"""
import sys; sys.path.insert(0, {TESTS_DIR!r})
from fcdp_deepspeed.tools.launch import run_local
run_local({SLEEPER!r}, 2, {{}}, timeout=120, pythonpath=[{TESTS_DIR!r}])
""")
    before_tmp = set(glob.glob(os.path.join(tempfile.gettempdir(), "fcdp-run-*")))
    before_shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (set(glob.glob(os.path.join(tempfile.gettempdir(), "fcdp-run-*"))) - before_tmp):
        time.sleep(0.2)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    time.sleep(1)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "fcdp-run-*"))) == before_tmp
    assert not subprocess.run(["pgrep", "-f", SLEEPER], capture_output=True).stdout
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) - before_shm == set()


@pytest.mark.skipif(not namespaces_available()[0], reason="network namespaces unavailable")
def test_sigterm_removes_emulated_cluster(tmp_path):
    script = tmp_path / "cluster.py"
    script.write_text("""
import time
from fcdp_deepspeed.tools.cluster import EmulatedCluster
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
