"""Restarts and resizes of an ordinary resumable script (``examples/train_elastic.py``).

A node's ranks SIGKILLed mid-step under torchrun's elastic agent on the emulated cluster (2 network-
namespace nodes x 2, c10d rendezvous): the job resumes from its last checkpoint with a cold cache and
ends with the weights and optimizer states of the uninterrupted run, bit for bit. A 2 x 2 checkpoint
converted with DeepSpeed's universal checkpoint tool resumes at 1 x 2 exactly as plain ZeRO-3 does.
The other kill points, sizes and modes: ``scripts/reliability.sh`` (docs/reliability.md).
"""
from __future__ import annotations

import glob
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from fcdp_lab.harness.cluster import EmulatedCluster, namespaces_available
from fcdp_lab.reliability import resize
from fcdp_lab.reliability.elastic import run_elastic
from fcdp_lab.reliability.killpoint import KillPoint

OK, WHY = namespaces_available()
STEPS, INTERVAL = 4, 2  # checkpoints global_step2 and global_step4


def _losses(metrics: list[dict]) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics if "step" in m}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted job: 2 x 2 (``ranks_per_node`` 2), FCDP with ZeRO-3's gradient path."""
    work = tmp_path_factory.mktemp("reference")
    cfg = resize.write_config(work / "exact.json", resize.config("exact", ranks_per_node=2))
    resize.run_script(resize.script_argv(cfg, work / "ckpt", STEPS, INTERVAL, work / "metrics.jsonl"), 4)
    return work


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_node_killed_mid_step_resumes_to_the_uninterrupted_weights(reference, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    point = KillPoint(node=1, step=3, phase="forward")  # step 3 of 4: global_step2 is the last checkpoint
    with tempfile.TemporaryDirectory(prefix="fcdp-elastic-") as tmp, EmulatedCluster(2, tag="el") as cluster:
        work = Path(tmp)
        cfg = resize.write_config(work / "exact.json", resize.config("exact"))  # node layout from torchrun
        run = run_elastic(cluster, resize.script_argv(cfg, work / "ckpt", STEPS, INTERVAL, work / "metrics.jsonl"),
                          work, kills=[point], metrics=work / "metrics.jsonl", timeout=480)
        assert run.ok, run.log_tail
        assert [k["point"] for k in run.kills] == [str(point)] and len(run.kills[0]["pids"]) == 2
        assert run.resumed_at() == [2] and run.redone_steps() == 1  # lost: step 2 (and step 3 in progress)
        assert _losses(run.metrics) == _losses(resize.read_metrics(reference / "metrics.jsonl"))
        tag = (work / "ckpt" / "latest").read_text()
        assert tag == f"global_step{STEPS}"
        assert resize.bitwise_equal(resize.fp32_weights(work / "ckpt"), resize.fp32_weights(reference / "ckpt"))
        for ours, ref in zip(resize.optimizer_states(work / "ckpt", tag), resize.optimizer_states(reference / "ckpt", tag),
                             strict=True):
            assert all(a.equal(b) for a, b in zip(ours["fp32"], ref["fp32"], strict=True))
            assert all(ours["state"][i][k].equal(ref["state"][i][k]) for i in ref["state"] for k in ("exp_avg", "exp_avg_sq"))
    assert not Path(tmp).exists() and glob.glob(str(tmp_path / "fcdp-run-*")) == []
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith(cluster.prefix)]


def test_universal_checkpoint_resumes_at_1x2_like_plain_zero3(reference, tmp_path, monkeypatch):
    """The FCDP job's 2 x 2 checkpoint (plain ZeRO-3 writes the same bits: test_checkpoints.py) converted once
    holds the 2 x 2 weights exactly; resumed by FCDP and by plain ZeRO-3 on 1 node x 2, the same losses and
    weights. Each engine converting its own checkpoint, and 2 x 1, 4 x 2: scripts/reliability.sh."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    source = tmp_path / "source"
    shutil.copytree(reference / "ckpt", source)
    universal = resize.convert(source, f"global_step{STEPS}")
    written = {k: v.reshape(-1) for k, v in resize.fp32_weights(source).items()}
    assert resize.bitwise_equal(resize.universal_fp32(source, universal), written)
    runs = {}
    for mode in ("exact", "plain"):
        save_dir = resize.universal_copy(source, universal, tmp_path / mode)
        cfg = resize.write_config(tmp_path / f"{mode}.json", resize.config(mode, ranks_per_node=2, universal=True))
        resize.run_script(resize.script_argv(cfg, save_dir, STEPS + 2, INTERVAL, save_dir / "metrics.jsonl"), 2)
        runs[mode] = (resize.read_metrics(save_dir / "metrics.jsonl"), resize.fp32_weights(save_dir))
    (fcdp, fcdp_w), (plain, plain_w) = runs["exact"], runs["plain"]
    assert [m for m in fcdp if "start" in m][0]["start"] == STEPS
    assert _losses(fcdp) == _losses(plain) and sorted(_losses(fcdp)) == [STEPS, STEPS + 1]
    assert resize.bitwise_equal(fcdp_w, plain_w)
    assert {m["world"] for m in fcdp} == {2}
    assert glob.glob(str(tmp_path / "fcdp-run-*")) == []


def test_kill_points_and_the_checkpoint_each_resumes_from():
    """What the sweep predicts (scripts/reliability.sh: 6 steps, a checkpoint every 2): a kill while files are
    written, or on node 0 before rank 0 writes ``latest``, loses that checkpoint; one on another node after it
    does not; a whole node is ``:agent``."""
    from fcdp_lab.reliability.killpoint import parse_points
    from fcdp_lab.reliability.reliability import expected_resume
    points = parse_points("1:3:forward; 0:4:backward; 1:5:step; 0:4:save; 1:4:save; 0:4:latest; 1:4:latest:agent")
    assert [expected_resume(p) for p in points] == [2, 4, 4, 2, 2, 2, 4]
    assert points[-1].agent and str(points[-1]) == "1:4:latest:agent"
    with pytest.raises(ValueError):
        parse_points("1:3:sideways")


DILOCO = {"sync_every": 3, "compression": "int8"}  # step 3 syncs: the kill falls mid-interval


def _diloco_config(path: Path, **kwargs) -> Path:
    cfg = resize.config("exact", **kwargs)
    cfg["fcdp"] = {**cfg["fcdp"], "diloco": DILOCO}
    return resize.write_config(path, cfg)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_diloco_node_killed_between_syncs_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch):
    """DiLoCo (H = 3, int8 residuals): node 1 killed in step 3 (global_step2, mid-interval, is the last checkpoint);
    the job resumes there (every node's inner state, the outer state and residuals from its own files) and ends
    with the uninterrupted run's losses, node 0's weights and every rank's optimizer state, bit for bit."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ref = tmp_path / "reference"
    ref.mkdir()
    cfg = _diloco_config(ref / "diloco.json", ranks_per_node=2)
    resize.run_script(resize.script_argv(cfg, ref / "ckpt", STEPS, INTERVAL, ref / "metrics.jsonl"), 4)
    point = KillPoint(node=1, step=3, phase="forward")
    with tempfile.TemporaryDirectory(prefix="fcdp-elastic-") as tmp, EmulatedCluster(2, tag="ed") as cluster:
        work = Path(tmp)
        cfg = _diloco_config(work / "diloco.json")  # node layout from torchrun
        run = run_elastic(cluster, resize.script_argv(cfg, work / "ckpt", STEPS, INTERVAL, work / "metrics.jsonl"),
                          work, kills=[point], metrics=work / "metrics.jsonl", timeout=480)
        assert run.ok, run.log_tail
        # redone: step 2, and step 3 when node 0 finished it before its agent restarted it (a DiLoCo step between
        # syncs crosses no node, so node 0 does not wait for the killed node there)
        assert run.resumed_at() == [2] and run.redone_steps() in (1, 2)
        assert _losses(run.metrics) == _losses(resize.read_metrics(ref / "metrics.jsonl"))
        tag = f"global_step{STEPS}"
        assert resize.bitwise_equal(resize.fp32_weights(work / "ckpt"), resize.fp32_weights(ref / "ckpt"))
        for sub in ("", "fcdp_diloco_node1"):  # node 0's files in the tag directory, node 1's in its sub-directory
            ours, theirs = (resize.optimizer_states(d / "ckpt", f"{tag}/{sub}" if sub else tag) for d in (work, ref))
            assert len(ours) == len(theirs) == 2
            for a, b in zip(ours, theirs):
                assert all(x.equal(y) for x, y in zip(a["fp32"], b["fp32"], strict=True))
