"""Entry paths: the zero-code-change module under torchrun and the deepspeed launcher, engines
without an optimizer next to a trained one (two zero.Init contexts), DeepSpeed's monitor."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import run_ranks
from workers.common import ZERO3_GRADS
from fcdp_lab.harness.launch import free_port


ROOT = Path(__file__).resolve().parent.parent


SCRIPT = str(ROOT / "examples" / "train_toy.py")


KNOWN_EXIT_ABORT = "terminate called without an active exception"


def _config(tmp: Path, fcdp_block) -> str:
    cfg = json.loads((ROOT / "configs" / "toy_fcdp.json").read_text())
    if fcdp_block is None:
        cfg.pop("fcdp")
    else:
        cfg["fcdp"] = fcdp_block
    path = tmp / f"cfg{len(list(tmp.iterdir()))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _launch(cmd: list[str], out: Path, **env_extra: str) -> list[dict]:
    _run_launcher(cmd, out, **env_extra)
    return json.loads(out.read_text())


def _run_launcher(cmd: list[str], out: Path, **env_extra: str) -> None:
    """Run a launcher until it exits; ``out`` (written once every rank is done) must then exist."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore::FutureWarning", **env_extra)
    # own session: on a timeout the launcher *and* its ranks are killed (a launcher killed alone
    # leaves its ranks running)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    # gloo ranks sometimes abort in interpreter teardown after a complete, successful run; the
    # results file is written only after every rank finished training, so that case is accepted.
    assert proc.returncode == 0 or (KNOWN_EXIT_ABORT in log and out.exists()), log[-4000:]


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
            *args]


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


def test_run_module_under_torchrun_matches_plain(tmp):
    """With the startup hook off (FCDP_AUTOLOAD=0), ``-m fcdp_deepspeed.run`` alone turns FCDP on, and the
    same script and config without it is DeepSpeed's own ZeRO-3."""
    cfg = _config(tmp, {"enabled": True, "ranks_per_node": 2, **ZERO3_GRADS})
    fcdp = _launch(_torchrun(["-m", "fcdp_deepspeed.run", SCRIPT, "--deepspeed_config", cfg, "--out", str(tmp / "a.json")]),
                   tmp / "a.json", FCDP_AUTOLOAD="0")
    plain = _launch(_torchrun([SCRIPT, "--deepspeed_config", cfg, "--out", str(tmp / "b.json")]), tmp / "b.json",
                    FCDP_AUTOLOAD="0")
    for f, p in zip(fcdp, plain):
        assert f["optimizer"] == "FCDPStage3" and p["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert f["losses"] == p["losses"] and f["cache_hits"] > 0 and f["num_nodes"] == 2


def test_run_module_under_deepspeed_launcher(tmp):
    cfg = _config(tmp, {"enabled": True, "ranks_per_node": 2, **ZERO3_GRADS})
    out = tmp / "c.json"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port()),
           "--module", "fcdp_deepspeed.run", SCRIPT, "--deepspeed_config", cfg, "--out", str(out)]
    res = _launch(cmd, out)
    assert all(r["optimizer"] == "FCDPStage3" and r["cache_hits"] > 0 for r in res)


def test_diloco_with_the_config_key_alone_under_torchrun_and_the_deepspeed_launcher(tmp):
    """``fcdp.diloco`` in the config of an unmodified script: 2 nodes x 2 ranks, H = 2, 4 steps, through torchrun
    (``-m fcdp_deepspeed.run``) and the deepspeed launcher (``--module``)."""
    cfg = _config(tmp, {"enabled": True, "ranks_per_node": 2, "diloco": {"sync_every": 2, "compression": "int4"}})
    script = [SCRIPT, "--deepspeed_config", cfg]
    runs = {"torchrun": _launch(_torchrun(["-m", "fcdp_deepspeed.run", *script, "--out", str(tmp / "t.json")]),
                                tmp / "t.json", FCDP_AUTOLOAD="0"),
            "deepspeed": _launch([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port",
                                  str(free_port()), "--module", "fcdp_deepspeed.run", *script, "--out",
                                  str(tmp / "d.json")], tmp / "d.json")}
    for name, res in runs.items():
        for r in res:
            assert r["optimizer"] == "FCDPStage3" and r["diloco_syncs"] == 2 and r["diloco_steps"] == 4, (name, r)
            assert r["inter_node_grad_reduce_bytes"] == 0 and r["inter_node_diloco_bytes"] > 0, (name, r)
        assert res[0]["losses"] != res[2]["losses"], name  # each node trains on its own samples
    assert runs["torchrun"][0]["losses"] == runs["deepspeed"][0]["losses"]


@pytest.mark.slow
def test_plain_hf_script_logs_fcdp_counters_under_both_launchers(tmp):
    """A Trainer script that imports neither DeepSpeed nor fcdp_deepspeed (accelerate imports DeepSpeed
    inside ``Trainer(...)``): the startup hook patches the Trainer when transformers is imported, so
    full fine-tuning of a tiny GPT-2 with the block in its config logs ``fcdp/*`` entries, in fresh
    ranks of torchrun and of the deepspeed launcher (2 ranks as 2 nodes: ``ranks_per_node`` 1)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf_config = json.loads((ROOT / "configs" / "hf_full_fcdp.json").read_text())
    hf_config["fcdp"] = {"enabled": True, "ranks_per_node": 1}
    (tmp / "hf.json").write_text(json.dumps(hf_config))
    script = [str(ROOT / "examples" / "hf_gpt2_trainer.py"), "--deepspeed_config", str(tmp / "hf.json")]
    launchers = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
                 "deepspeed": [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]}
    for name, launcher in launchers.items():
        out = tmp / name
        out.mkdir()
        _run_launcher([*launcher, "--master_port", str(free_port()), *script, "--out", str(out)], out / "rank1.json")
        for rank in (0, 1):
            r = json.loads((out / f"rank{rank}.json").read_text())
            assert not r["deepspeed_before_trainer"] and r["optimizer"] == "FCDPStage3", (name, r)
            assert r["callbacks"][0] == "FCDPStatsCallback", (name, r["callbacks"])
            assert len(r["fcdp_logs"]) == 2 and all(s["fcdp/inter_node_allgather_bytes"] > 0 for s in r["fcdp_logs"])


def test_grad_modes_under_deepspeed_launcher(tmp):
    """Node accumulation through the deepspeed launcher (GA 2): FCDP's gradient plan is active on every
    rank and the losses match plain ZeRO-3 launched by torchrun within the gradient modes' tolerance."""
    block = {"enabled": True, "ranks_per_node": 2, "grad_accumulation": "node"}
    cfg = json.loads(Path(_config(tmp, block)).read_text())
    cfg["gradient_accumulation_steps"] = 2
    (tmp / "ga2.json").write_text(json.dumps(cfg))
    cfg.pop("fcdp")
    (tmp / "ga2_plain.json").write_text(json.dumps(cfg))
    out = tmp / "g.json"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port()),
           "--module", "fcdp_deepspeed.run", SCRIPT, "--deepspeed_config", str(tmp / "ga2.json"), "--out", str(out)]
    res = _launch(cmd, out)
    plain = _launch(_torchrun([SCRIPT, "--deepspeed_config", str(tmp / "ga2_plain.json"), "--out", str(tmp / "h.json")]),
                    tmp / "h.json")
    for r, p in zip(res, plain):
        assert r["optimizer"] == "FCDPStage3" and r["grad_accumulated"] > 0 and r["grad_delivered"] > 0
        assert len(r["losses"]) == len(p["losses"]) == 4
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], p["losses"])), (r["losses"], p["losses"])


def test_run_module_without_block_is_plain_zero3(tmp):
    cfg = _config(tmp, None)
    res = _launch(_torchrun(["-m", "fcdp_deepspeed.run", SCRIPT, "--deepspeed_config", cfg, "--out", str(tmp / "d.json")]),
                  tmp / "d.json")
    plain = _launch(_torchrun([SCRIPT, "--deepspeed_config", cfg, "--out", str(tmp / "e.json")]), tmp / "e.json")
    for r, p in zip(res, plain):
        assert r["cache_hits"] == 0 and r["losses"] == p["losses"]


def test_run_module_usage_errors():
    proc = subprocess.run([sys.executable, "-m", "fcdp_deepspeed.run", "no_such_script.py"], capture_output=True, text=True)
    assert proc.returncode != 0 and "no such script" in proc.stderr


def test_policy_and_reference_models_in_one_process():
    plain = run_ranks("integrations:policy_and_reference", 4, fcdp=False)
    fcdp = run_ranks("integrations:policy_and_reference", 4, fcdp=True)
    for p, f in zip(plain, fcdp):
        assert f["classes"] == ["FCDPStage3", "FCDPZeROOffload"]
        assert f["losses"] == p["losses"]
        assert all(a.equal(b) for a, b in zip(f["ref_outputs"], p["ref_outputs"]))
        # the frozen reference crosses nodes once, then is served from the node cache
        assert f["ref_inter"][0] > 0 and f["ref_inter"][1:] == [0, 0] and all(b > 0 for b in p["ref_inter"])


def test_counters_written_to_deepspeed_monitor():
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks("integrations:monitor_csv", 4, out_dir=out_dir)
        csv = Path(out_dir) / "fcdp" / "fcdp_inter_node_allgather_bytes.csv"  # the names HF logs get: fcdp/<key>
        rows = csv.read_text().strip().splitlines()
        assert rows[0] == "step,inter_node_allgather_bytes" and len(rows) == 4  # header + 3 steps
        for key in ("cache_hit_rate", "inter_node_grad_reduce_bytes", "host_slot_bytes"):
            assert (Path(out_dir) / "fcdp" / f"fcdp_{key}.csv").exists(), key
        host, device = ([float(row.split(",")[1]) for row in
                         (Path(out_dir) / "fcdp" / f"fcdp_{p}_slot_bytes.csv").read_text().strip().splitlines()[1:]]
                        for p in ("host", "device"))
        # the slots stay allocated across steps (cache_device auto moves them to the device after step 2)
        assert len(host) == 3 and all(h + d > 0 for h, d in zip(host, device)), (host, device)


def test_layout_each_engine_is_counted_by():
    """Pure: which layout classifies an engine's collectives as the process's layout changes."""
    from fcdp_deepspeed.reporting.stats import INTER, INTRA, CommCounters, CommLedger, LayoutKind, classify
    ledger = CommLedger()  # never installed on a backend: only the layout bookkeeping is used
    one_machine, simulated = ("n0",) * 4, ("a", "a", "b", "b")
    plain = CommCounters(node_of_rank=one_machine, layout_source="LOCAL_WORLD_SIZE", follows_process=True)
    fcdp = CommCounters(node_of_rank=simulated, layout_source="fcdp.ranks_per_node")
    ledger._node_of_rank, ledger._kind = simulated, LayoutKind.ENGINE_SETTING  # what attach() installs
    assert ledger.layout_for(plain)[0] == one_machine and ledger.layout_for(fcdp)[0] == simulated
    ledger._node_of_rank, ledger._kind = ("x", "x", "y", "y"), LayoutKind.EXPLICIT  # enable_comm_counting
    assert ledger.layout_for(plain)[0] == ("x", "x", "y", "y") and ledger.layout_for(fcdp)[0] == simulated
    assert classify("all_reduce", {}, (0, 1, 2, 3), 0, one_machine)[0] == INTRA
    assert classify("all_reduce", {}, (0, 1, 2, 3), 0, simulated)[0] == INTER


def test_plain_engines_count_by_their_own_layout_whatever_the_build_order():
    """A plain ZeRO-3 engine built after an FCDP engine that simulates 2 nodes on one machine counted its
    reduce-scatter as inter-node (the FCDP engine's layout had become the process's); one built before did
    not. Each engine now classifies its collectives by its own layout: plain engines by the launcher's
    (one machine here: nothing inter-node), the FCDP engine by its topology."""
    for rank in run_ranks("integrations:plain_around_fcdp", 4):
        before, fcdp, after = rank["before"], rank["fcdp"], rank["after"]
        assert after == before, (before, after)
        assert before["inter_node_grad_reduce_bytes"] == before["inter_node_allgather_bytes"] == 0
        assert before["intra_node_grad_reduce_bytes"] > 0 and before["node_layout_source"].startswith("LOCAL_WORLD_SIZE")
        assert fcdp["grad_reduce"] == "hierarchical" and fcdp["inter_node_grad_reduce_bytes"] > 0


def test_each_engine_counts_its_own_collectives():
    """Two engines in one process (a trained policy and an optimizer-less ZeRO-3 reference), counted
    without enable_comm_counting, first both plain ZeRO-3, then with an FCDP policy: in each window only
    the engine that ran gains bytes, and its gains are all the process's data collectives in that window."""
    for rank in run_ranks("integrations:two_engines_attribution", 4, policy_fcdp=(False, True, "auto")):
        assert rank["installed"], "the startup hook did not install FCDP (reinstall: pip install -e .)"
        for policy_fcdp, r in zip((False, True, "auto"), rank["runs"]):
            assert r["classes"] == ["FCDPStage3" if policy_fcdp else "CountedStage3", "CountedZeROOffload"]
            for w in r["windows"]:
                ref, pol = w["reference_forward"], w["policy_step"]
                # plain engines: the layout torchrun's LOCAL_WORLD_SIZE implies; then the one FCDP discovered
                assert ref["layout"].startswith("fcdp.ranks_per_node" if policy_fcdp else "LOCAL_WORLD_SIZE")
                assert not any(ref["policy"].values()) and not any(pol["reference"].values()), w
                assert ref["reference"]["inter_node_allgather_bytes"] > 0 and pol["policy"]["inter_node_allgather_bytes"] > 0
                assert pol["policy"]["inter_node_grad_reduce_bytes"] > 0
                for window, engine in ((ref, "reference"), (pol, "policy")):
                    # all of the process's data collectives in the window; DeepSpeed's trace-check broadcasts
                    # (a few ints, first steps only) run in module hooks outside the engine's counters; the
                    # engine's timeline (seconds and calls of host waits, timeline.py) and its run-ahead's tally
                    # (param_push_*: bytes it issued ahead, counted again as the all-gathers they are) count no
                    # collective
                    counted = {k: v for k, v in window[engine].items() if v and "broadcast" not in k
                               and not k.startswith(("timeline_", "param_push_"))}
                    process = {k: v for k, v in window["process"].items() if v and "broadcast" not in k}
                    wire = "wire_sent_inter_node_bytes"
                    process[wire] = process.get(wire, 0) - window["process"].get("wire_sent_inter_node_broadcast_bytes", 0)
                    assert counted == {k: v for k, v in process.items() if v}, (policy_fcdp, engine, window)
