"""Hardening: faults degrade to plain ZeRO-3 without changing a loss, a crashed rank leaves a
loadable checkpoint, edge parameters, checkpoint interoperability, prefetch concurrency."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import TESTS_DIR, run_ranks
from fcdp_deepspeed.tools.cluster import PREFIX, namespaces_available
from fcdp_deepspeed.tools.launch import RankFailure


# -- faults -----------------------------------------------------------------------------------------
def test_allocation_failure_on_one_rank_degrades_those_parameters_everywhere(monkeypatch):
    # rank 1's 2nd host chunk fails: its parameters go plain ZeRO-3 on all ranks (hit/miss must agree)
    monkeypatch.setenv("FCDP_INJECT_FAULT", "alloc_host@1:2")
    res = run_ranks("degraded_allocation", 4)
    for r in res:
        assert r["fcdp"] == r["plain"]
        stats = r["stats"]
        assert 0 < stats["uncached_params"] < stats["uncached_params"] + stats["cached_params"]
        assert stats["cache_hits"] > 0 and stats["uncached_fetches"] > 0
    warnings = [m for m in res[0]["log"] if "allocation failed" in m]
    assert len(warnings) == 1 and "plain ZeRO-3 path on every rank" in warnings[0]


def test_allocation_failure_everywhere_runs_plain_zero3(monkeypatch):
    monkeypatch.setenv("FCDP_INJECT_FAULT", "alloc_host")
    for r in run_ranks("degraded_allocation", 4):
        assert r["fcdp"] == r["plain"] and r["stats"]["cached_params"] == 0 and r["stats"]["cache_hits"] == 0


def test_rank_killed_mid_step_leaves_a_loadable_checkpoint():
    with tempfile.TemporaryDirectory() as ckpt:
        before = set(glob.glob(os.path.join(tempfile.gettempdir(), "fcdp-run-*")))
        with pytest.raises(RankFailure) as err:
            run_ranks("crash_mid_step", 4, timeout=120, ckpt_dir=ckpt)
        assert "ranks [" in str(err.value)
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "fcdp-run-*"))) == before  # no temp dirs left
        fcdp = run_ranks("resume", 4, ckpt_dir=ckpt, fcdp=True)
        plain = run_ranks("resume", 4, ckpt_dir=ckpt, fcdp=False)
    for f, p in zip(fcdp, plain):
        assert f["losses"] == p["losses"]
    assert all(torch.equal(fcdp[0]["weights"][k], plain[0]["weights"][k]) for k in plain[0]["weights"])


def test_sigterm_during_a_run_leaves_nothing_behind(tmp_path):
    """An interrupted launcher kills its ranks and removes its temp dir (and namespaces, if any)."""
    script = tmp_path / "interrupt.py"
    script.write_text(f"""
import sys; sys.path.insert(0, {TESTS_DIR!r})
from fcdp_deepspeed.tools.launch import run_local
run_local("dist_workers:sleeper", 2, {{}}, timeout=120, pythonpath=[{TESTS_DIR!r}])
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
    assert not subprocess.run(["pgrep", "-f", "dist_workers:sleeper"], capture_output=True).stdout
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


# -- edge parameters --------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold, dtype", [(0, "fp32"), (100, "fp32"), (0, "bf16")])
def test_edge_parameters(threshold, dtype):
    """Tiny (< L elements), not divisible by L, tied, reused, external, persistent, bf16."""
    res = run_ranks("edge_parameters", 4, persistence_threshold=threshold, dtype=dtype)
    for r in res:
        assert r["fcdp"].losses == r["plain"].losses
        stats = r["fcdp"].stats
        assert stats["cache_hits"] > 0
        if threshold:
            assert stats["uncached_reasons"].get("persistent (stage3_param_persistence_threshold)", 0) > 0
    plain, fcdp = res[0]["plain"].weights, res[0]["fcdp"].weights
    assert all(torch.equal(plain[k], fcdp[k]) for k in plain)


def test_zero_size_parameters_work_with_fcdp():
    """Plain ZeRO-3 (0.19.8) crashes gathering a zero-size parameter (torch.cat of no partitions);
    FCDP engines materialise such parameters locally and train."""
    with pytest.raises(RankFailure, match="expected a non-empty list of Tensors"):
        run_ranks("edge_parameters", 4, zero_size=True, modes=("plain", ))
    res = run_ranks("edge_parameters", 4, zero_size=True, modes=("fcdp", ))
    losses = res[0]["fcdp"].losses
    assert len(losses) == 4 and all(l == l for l in losses)  # finite, trained
    reference = run_ranks("edge_parameters", 4, modes=("plain", ))  # the same model without it
    assert losses == reference[0]["plain"].losses  # the empty parameter adds exactly 0


# -- checkpoints ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def interop():
    with tempfile.TemporaryDirectory() as ckpt:
        res = run_ranks("checkpoint_interop", 4, ckpt_dir=ckpt)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        fp32 = {tag: get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=tag) for tag in ("plain", "fcdp")}
        bits16 = {tag: torch.load(os.path.join(ckpt, f"{tag}_16bit.bin"), map_location="cpu") for tag in ("plain", "fcdp")}
        yield res, fp32, bits16


def test_checkpoints_load_across_engines(interop):
    res, _, _ = interop
    for r in res:
        assert r["fcdp_losses_after_save"] == r["plain_losses_after_save"]
        for saved in ("plain", "fcdp"):
            assert torch.equal(r[f"fcdp_loads_{saved}"], r[f"plain_loads_{saved}"])
            assert r[f"fcdp_loads_{saved}_train"] == r[f"plain_loads_{saved}_train"]
        assert torch.equal(r["plain_loads_fcdp"], r["plain_loads_plain"])  # same training, same checkpoint


def test_zero_to_fp32_and_16bit_save_identical(interop):
    _, fp32, bits16 = interop
    assert fp32["plain"].keys() == fp32["fcdp"].keys() and fp32["plain"]
    assert all(torch.equal(fp32["plain"][k], fp32["fcdp"][k]) for k in fp32["plain"])
    assert bits16["plain"].keys() == bits16["fcdp"].keys() and bits16["plain"]
    assert all(torch.equal(bits16["plain"][k], bits16["fcdp"][k]) for k in bits16["plain"])


# -- concurrency ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_prefetch_overlapping_cache_refills_many_steps():
    for r in run_ranks("prefetch_soak", 4, timeout=600, steps=20):
        for name in ("prefetch_release", "deepspeed_defaults_lora"):
            assert r[name]["fcdp"] == r[name]["plain"], name
            assert r[name]["stats"]["cache_hits"] > 0


# -- bad layouts --------------------------------------------------------------------------------------
def test_ranks_per_node_not_dividing_the_world():
    for msg in run_ranks("topology_error", 4, ranks_per_node=3):
        assert msg.startswith("TopologyError") and "fcdp.ranks_per_node = 3 does not divide the world size 4" in msg


def test_non_uniform_nodes(monkeypatch):
    from fcdp_deepspeed.tools.launch import run_local
    from conftest import TESTS_DIR as tests_dir
    rank_env = {r: {"FCDP_NODE_ID": "a" if r < 3 else "b"} for r in range(4)}
    res = run_local("dist_workers:topology_error", 4, {}, timeout=240, pythonpath=[tests_dir], rank_env=rank_env)
    for msg in res:
        assert msg.startswith("TopologyError") and "non-uniform nodes" in msg and "'a': 3" in msg
