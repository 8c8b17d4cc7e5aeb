"""DiLoCo across nodes (``fcdp.diloco``, lossy, opt-in) on 2 emulated nodes x 2 ranks through ``deepspeed.initialize``:
the replica is bitwise equal on every rank after each sync (and only then), the outer step matches a float64
reference computed from the pseudo-gradients, every rank draws its own samples, a checkpoint saved mid-interval
resumes exactly, bad input is refused by key with the fix."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed.config import FCDPConfigError, check_ds_config_compatible, parse_fcdp_config

H, STEPS, LR, MU = 3, 7, 0.7, 0.9
SYNC_STEPS = [s for s in range(STEPS) if (s + 1) % H == 0]  # 0-based indices of the steps that sync


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def fp32():
    return run_ranks("diloco:core", 4, steps=STEPS, sync_every=H)


@pytest.fixture(scope="module")
def bf16_int4():
    """Composes: bf16, int4 pseudo-gradients, gradient accumulation, LoRA (frozen base weights never cross)."""
    return run_ranks("diloco:train", 4, steps=2 * H, dtype="bf16", sync_every=H, compression="int4", grad_accum=2,
                     lora_rank=2)


@pytest.fixture(scope="module")
def bf16_wire():
    """The fp32 job with bf16 pseudo-gradients on the wire ([Note: bf16 pseudo-gradients] in compress/quant.py)."""
    return run_ranks("diloco:train", 4, steps=STEPS, sync_every=H, compression="bf16")


@pytest.fixture(scope="module")
def fp16_skipping():
    """fp16 with a loss scale that overflows the first steps: each node's scaler skips on its own. Every parameter
    persistent (stays gathered between steps): the sync must refresh the gathered copies too."""
    return run_ranks("diloco:train", 4, steps=2 * H, dtype="fp16", sync_every=H, loss_scale_power=18, persist=True)


@pytest.mark.parametrize("run", ["fp32", "bf16_int4", "fp16_skipping", "bf16_wire"])
def test_every_rank_holds_the_same_model_after_each_sync_and_only_then(run, request):
    res = request.getfixturevalue(run)
    steps = len(res[0]["weights"])
    skipped = max(r["skipped_steps"] for r in res)  # fp16: a skipped step leaves the node model as it was
    for s in range(steps):
        w = [r["weights"][s] for r in res]  # each rank's node model (a node-local gather)
        assert _equal(w[0], w[1]) and _equal(w[2], w[3])  # exact ZeRO-3 inside a node
        if (s + 1) % H == 0:
            assert all(_equal(w[0], x) for x in w[1:]), f"step {s}: the nodes differ after a sync"
        elif s >= skipped:
            assert not _equal(w[0], w[2]), f"step {s}: the nodes trained on the same data or synced between syncs"
    assert all(r["node_group_size"] == 2 and r["partition_world"] == [2] for r in res)  # ZeRO-3 over the node


def test_activation_checkpointing_changes_nothing(fp32):
    """The same run with activation checkpointing (forward recomputed in backward): the same losses and models."""
    res = run_ranks("diloco:train", 4, steps=STEPS, sync_every=H, activation_checkpointing=True)
    for r, plain in zip(res, fp32):
        assert r["losses"] == plain["losses"]
        assert all(_equal(a, b) for a, b in zip(r["weights"], plain["weights"]))


def test_outer_step_matches_a_float64_reference(fp32):
    """From the recorded pseudo-gradients: mean over the node peers, Nesterov momentum, outer -= lr * update."""
    recs = [r["records"] for r in fp32]
    assert all(len(x) == len(SYNC_STEPS) for x in recs)
    momentum = {r: None for r in range(4)}
    for k in range(len(SYNC_STEPS)):
        for peers in ((0, 2), (1, 3)):  # the ranks at the same node position
            for i in range(len(recs[0][k]["outer"])):
                outer = recs[peers[0]][k]["outer"][i].double()
                assert all(torch.equal(recs[p][k]["outer"][i], recs[peers[0]][k]["outer"][i]) for p in peers)
                g = sum(outer - recs[p][k]["local"][i].double() for p in peers) / len(peers)
                m = g if k == 0 else MU * momentum[(peers, i)] + g
                momentum[(peers, i)] = m
                expected = outer - LR * (g + MU * m)
                for p in peers:
                    got = recs[p][k]
                    assert torch.allclose(got["outer_after"][i].double(), expected, rtol=1e-5, atol=1e-6)
                    assert torch.allclose(got["momentum_after"][i].double(), m, rtol=1e-5, atol=1e-6)
                    assert torch.equal(got["master_after"][i], got["outer_after"][i])  # partitions set from outer
                    assert torch.equal(got["outer_after"][i], recs[peers[0]][k]["outer_after"][i])
                    if k + 1 < len(SYNC_STEPS):
                        assert torch.equal(recs[p][k + 1]["outer"][i], got["outer_after"][i])
                assert not torch.equal(recs[peers[0]][k]["local"][i], recs[peers[1]][k]["local"][i])


def test_stats_and_the_on_line(fp32):
    r = fp32[0]
    s = r["stats"]
    shard = sum(t.numel() for t in r["records"][0]["outer"]) * 4
    assert s["diloco_syncs"] == len(SYNC_STEPS) and s["diloco_steps"] == STEPS and s["diloco_sync_every"] == H
    assert s["diloco_pseudo_grad_bytes"] == len(SYNC_STEPS) * shard
    # across nodes nothing but the sync: no inter-node gradient bytes, every inter-node gather is the sync's
    assert s["inter_node_grad_reduce_bytes"] == 0
    assert s["inter_node_allgather_bytes"] == s["inter_node_diloco_bytes"] == s["diloco_pseudo_grad_bytes"]
    assert len(s["diloco_drift_norms"]) == len(SYNC_STEPS) and all(d > 0 for d in s["diloco_drift_norms"])
    assert s["diloco_outer_step_norm"] > 0 and s["fcdp_enabled"]
    assert len(r["on_lines"]) == 1 and "LOSSY DiLoCo" in r["on_lines"][0] and f"H = {H}" in r["on_lines"][0]


def test_fp16_nodes_sync_at_the_same_step_whatever_their_scaler_skipped(fp16_skipping):
    assert all(r["persistent"] > 0 for r in fp16_skipping)
    # the forward after the last sync (through the persistent, gathered copies) is bitwise the same everywhere
    assert all(torch.equal(r["forward"], fp16_skipping[0]["forward"]) for r in fp16_skipping)
    skipped = [r["skipped_steps"] for r in fp16_skipping]
    assert skipped[0] == skipped[1] and skipped[2] == skipped[3]  # one loss scaler per node
    assert skipped[0] != skipped[2] and max(skipped) > 0  # the nodes skipped different steps; no hang
    assert all(r["stats"]["diloco_syncs"] == 2 and r["stats"]["diloco_steps"] == 2 * H for r in fp16_skipping)


def test_compressed_pseudo_gradients_cross_at_a_fraction_of_the_bytes(fp32, bf16_int4):
    exact, int4 = fp32[0]["stats"], bf16_int4[0]["stats"]
    per_sync = lambda s: s["diloco_pseudo_grad_bytes"] / s["diloco_syncs"]  # noqa: E731
    assert int4["diloco_compression"] == "int4" and int4["diloco_syncs"] == 2
    assert per_sync(int4) < 0.2 * per_sync(exact)


def test_bf16_pseudo_gradients_cross_at_half_the_bytes_and_stay_close(fp32, bf16_wire):
    """``compression: bf16``: exactly half of the fp32 exchange's bytes per sync; with error feedback the model stays
    within bf16's rounding of the uncompressed run's (and not bitwise equal to it: the codec ran)."""
    exact, half = fp32[0]["stats"], bf16_wire[0]["stats"]
    per_sync = lambda s: s["diloco_pseudo_grad_bytes"] / s["diloco_syncs"]  # noqa: E731
    assert half["diloco_compression"] == "bf16" and half["diloco_syncs"] == exact["diloco_syncs"] == STEPS // H
    assert per_sync(half) * 2 == per_sync(exact)
    last = SYNC_STEPS[-1]
    a, b = fp32[0]["weights"][last], bf16_wire[0]["weights"][last]
    assert not _equal(a, b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=2e-2, atol=1e-3), k


def _disjoint(seen: list[list[int]]) -> bool:
    flat = [i for s in seen for i in s]
    return len(flat) == len(set(flat))


def test_every_rank_draws_its_own_samples_and_the_batch_stays_global(fp32):
    data = [r["data"] for r in fp32]
    seen = [d["seen"] for d in data]
    assert _disjoint(seen) and sorted(i for s in seen for i in s) == list(range(64))
    assert all(d["train_batch_size"] == d["micro"] * d["ga"] * 4 for d in data)
    # the broken variant (a sampler over the node's ranks only, as an mpu whose DP group is the node gives):
    # every node sees the same data, and the check above catches it
    from torch.utils.data import DistributedSampler
    same = [sorted(DistributedSampler(range(64), num_replicas=2, rank=r % 2, shuffle=False)) for r in range(4)]
    assert not _disjoint(same)


def _checkpoint_run(ckpt_dir: str, env: dict | None = None, compression: str = "int8") -> list:
    from conftest import TESTS_DIR, worker_target
    from fcdp_lab.harness.launch import run_local
    return run_local(worker_target("diloco:checkpoint"), 4, dict(ckpt_dir=ckpt_dir, save_at=4, steps=8, sync_every=H,
                                                                 compression=compression),
                     timeout=240, env=env, pythonpath=[TESTS_DIR])


def test_checkpoint_mid_interval_resumes_exactly(tmp_path):
    res = _checkpoint_run(str(tmp_path))
    for r in res:
        assert r["loaded_steps"] == 4
        assert r["before"] + r["after"] == r["straight"]  # bit for bit: outer, momentum, residuals, counter
        assert _equal(r["resumed_weights"], r["straight_weights"])
        assert r["resumed_stats"]["diloco_drift_norms"][-1] == r["straight_stats"]["diloco_drift_norms"][-1]
    files, node1 = sorted(os.listdir(tmp_path / "mid")), sorted(os.listdir(tmp_path / "mid" / "fcdp_diloco_node1"))
    assert sum(f.startswith("zero_pp_rank_") and f.endswith("optim_states.pt") for f in node1) == 2
    # the tag directory itself: node 0's files alone, a plain ZeRO-3 checkpoint of 2 partitions
    assert sum(f.endswith("optim_states.pt") for f in files) == 2
    assert sum(f.endswith("model_states.pt") for f in files) == 2


def test_checkpoint_mid_interval_resumes_exactly_with_bf16_pseudo_gradients(tmp_path):
    """``compression: bf16`` keeps a residual as int8 does: saved and restored bit for bit mid-interval."""
    for r in _checkpoint_run(str(tmp_path), compression="bf16"):
        assert r["loaded_steps"] == 4 and r["before"] + r["after"] == r["straight"]
        assert _equal(r["resumed_weights"], r["straight_weights"])


def test_checkpoint_with_deepspeeds_file_ownership_does_not_resume_exactly(tmp_path):
    """The broken variant: only node 0's files, read by every node (DeepSpeed's naming over the node group). Node 1
    then finds node 0's DiLoCo part (another node's layout), restarts its outer state from node 0's mid-interval
    weights, and the load's agreement check refuses the nodes' different outer parameters."""
    from fcdp_lab.harness.launch import RankFailure
    with pytest.raises(RankFailure, match="different outer parameters after the checkpoint load"):
        _checkpoint_run(str(tmp_path), env={"FCDP_LAB_BREAK": "diloco.node_files"})


def test_one_node_is_refused_with_the_fix():
    msgs = run_ranks("diloco:one_node", 4)
    assert all("fcdp.diloco needs at least two nodes" in m and "Fix:" in m for m in msgs)


def _block(**diloco) -> dict:
    return {"zero_optimization": {"stage": 3}, "fcdp": {"enabled": True, "diloco": diloco}}


@pytest.mark.parametrize("diloco, key", [
    ({"sync_every": 0}, "fcdp.diloco.sync_every"),
    ({"sync_every": 10, "fragments": 3}, "fcdp.diloco.fragments"),
    ({"sync_every": 10, "fragments": 2, "overlap_steps": 6}, "fcdp.diloco.overlap_steps"),
    ({"overlap_steps": -1}, "fcdp.diloco.overlap_steps"),
    ({"outer_lr": 0}, "fcdp.diloco.outer_lr"),
    ({"outer_lr": -0.5}, "fcdp.diloco.outer_lr"),
    ({"outer_momentum": 1.0}, "fcdp.diloco.outer_momentum"),
    ({"compression": "int2"}, "fcdp.diloco.compression"),
    ({"compression": "fp16"}, "\"bf16\""),  # the fix lists the wire formats, bf16 among them
    ({"sync_evry": 5}, "fcdp.diloco.sync_evry"),
])
def test_bad_values_are_refused_by_key_with_the_fix(diloco, key):
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config(_block(**diloco))
    assert key in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize("ds, needle", [
    ({"zero_optimization": {"stage": 2}}, "fcdp.diloco needs ZeRO stage 3"),
    ({"fcdp": {"grad_compression": "int4"}}, "fcdp.grad_compression"),
    ({"fcdp": {"grad_reduce": "hierarchical"}}, "fcdp.grad_reduce"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}, "nvme"),
])
def test_incompatible_settings_are_refused(ds, needle):
    cfg = _block(sync_every=4)
    cfg["zero_optimization"] = ds.get("zero_optimization", cfg["zero_optimization"])
    cfg["fcdp"] = {**cfg["fcdp"], **ds.get("fcdp", {})}
    with pytest.raises(FCDPConfigError) as err:
        check_ds_config_compatible(cfg)
    assert needle in str(err.value) and "Fix:" in str(err.value)


def test_off_by_default():
    assert parse_fcdp_config({"fcdp": {"enabled": True}}).diloco is None
    streaming = parse_fcdp_config(_block(sync_every=10, fragments=5)).diloco
    assert (streaming.interval, streaming.overlap) == (2, 1)  # streaming overlaps one step unless told
    assert parse_fcdp_config(_block(sync_every=10)).diloco.overlap == 0  # one fragment: the sync blocks
    assert parse_fcdp_config(_block(enabled=False)).diloco is None
    assert parse_fcdp_config(_block()).diloco.sync_every == 50


def test_committed_byte_measurements_meet_the_targets_and_the_doc_quotes_them():
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    data = json.loads((root / "docs/results/diloco/bytes.json").read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    doc = (root / "docs" / "diloco.md").read_text()
    for engine, target in data["meta"]["targets"].items():
        ratio = rows[engine]["bytes_vs_bound"]
        assert ratio <= target and 0.95 <= rows[engine]["counted_vs_kernel"] <= 1.05
        assert f"{ratio:#.3g}x" in doc, (engine, f"{ratio:#.3g}x")


def test_committed_throughput_meets_the_targets_and_the_doc_quotes_it():
    """Issue 32's throughput targets on the committed run (docs/results/diloco/throughput.json): the slow hop
    hidden at 100 Mbit/s (<= 1.2x the unlimited network's mean step) and >= 10x the exact defaults at 10 Mbit/s."""
    import json
    from pathlib import Path

    from fcdp_lab.bench import diloco as bench_diloco
    root = Path(__file__).resolve().parent.parent
    data = json.loads((root / "docs/results/diloco/throughput.json").read_text())
    again = bench_diloco.ratios(data["rows"])  # the ratios follow from the committed rows
    assert again == data["ratios"]
    hidden, speedup = again["hidden"]["diloco10_int4"], again["speedup"]["diloco10_int4"]
    assert hidden <= bench_diloco.HIDDEN_TARGET and speedup >= bench_diloco.SPEEDUP_TARGET
    doc = (root / "docs" / "diloco.md").read_text()
    assert f"**{hidden:.3f}x**" in doc and f"**{speedup:.1f}x**" in doc
    for row in data["rows"]:  # whole sync intervals: every 10th timed step is a sync
        assert len(row["all_step_times"]) % 10 == 0


def test_fcdp_plan_prints_the_per_rank_memory_of_zero3_over_the_node(tmp_path, capsys):
    import json
    from fcdp_deepspeed.tools.plan import planner
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                               "fcdp": {"enabled": True, "diloco": {"sync_every": 100, "compression": "int4"}}}))
    assert planner.main(["--params", "7B", "--nodes", "4", "--ranks-per-node", "8", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    # (2 B params + 2 B grads) x 7e9 + 12 B x 7e9, over the node's 8 ranks (not the world's 32)
    assert "DiLoCo (LOSSY" in out and "H = 100" in out and f"{16 * 7e9 / 8 / 2**30:.2f} GiB per rank" in out
    assert f"exact ZeRO-3 over the world: {16 * 7e9 / 32 / 2**30:.2f}" in out


@pytest.mark.slow
def test_hf_trainer_with_peft_runs_diloco_with_the_config_key_alone():
    """The HF Trainer example (a Llama built under zero.Init, world-partitioned, then re-partitioned over the node;
    LoRA: only the adapters are pseudo-gradients) with ``fcdp.diloco`` added to its config."""
    res = run_ranks("hf:hf_run", 4, timeout=600, fcdp=True, ranks_per_node=2, runner="trainer", use_peft=True,
                    steps=4, ds_config=os.path.join(os.path.dirname(__file__), "..", "configs", "hf_lora_fcdp.json"),
                    fcdp_extra={"grad_reduce": "flat", "grad_accumulation": "rank", "diloco": {"sync_every": 2}})
    for r in res:
        s = r["stats"]
        assert r["optimizer_class"] == "FCDPStage3" and s["diloco_syncs"] == 2 and s["diloco_steps"] == 4
        assert s["inter_node_grad_reduce_bytes"] == 0 and s["inter_node_allgather_bytes"] == s["inter_node_diloco_bytes"]
    assert res[0]["losses"] != res[2]["losses"]  # the nodes train on their own samples


def test_a_checkpoint_of_another_data_parallel_size_is_refused_on_every_rank_with_the_universal_fix(tmp_path):
    """Saved on 2 nodes x 1 rank (DP world 2), loaded rigidly on 2 x 2 (DP world 4): DeepSpeed refuses it only on the
    ranks that find their model-states file (the others fail with a bare AssertionError); FCDP refuses it on every
    rank first, naming the universal checkpoint ([Note: loading another data-parallel size] in diloco/files.py)."""
    run_ranks("diloco:save_with_dp_two", 2, ckpt_dir=str(tmp_path))
    for msg in run_ranks("diloco:load_dp_two_into_four", 4, ckpt_dir=str(tmp_path)):
        assert msg.startswith("RuntimeError: fcdp.diloco: cannot load the checkpoint") and "world size of 2" in msg
        assert "this job has 4" in msg and "Fix:" in msg and "ds_to_universal" in msg and "load_universal" in msg


def test_checkpoints_across_modes_refuse_rigid_loads_and_convert_through_universal(tmp_path):
    """An exact checkpoint into DiLoCo and a DiLoCo one into exact: refused by DeepSpeed's rigid load (with the fix)
    on every rank alike; through DeepSpeed's universal conversion each loads, weights as saved; a DiLoCo engine
    restarts its outer state from the loaded weights and syncs on; zero_to_fp32 reads a DiLoCo tag directory."""
    res = run_ranks("diloco:interop", 4, timeout=600, ckpt_dir=str(tmp_path))
    for r in res:
        assert "cannot load an exact ZeRO-3 checkpoint" in r["exact_into_diloco"] and "Fix:" in r["exact_into_diloco"]
        assert "cannot load a DiLoCo checkpoint" in r["diloco_into_exact"] and "ds_to_universal" in r["diloco_into_exact"]
        assert _equal(r["exact_from_diloco"], r["diloco_weights"])
        assert _equal(r["diloco_from_exact"], r["exact_weights"]) and r["outer_is_loaded_master"]
        assert r["after_universal"]["syncs"] == 1
        assert _equal(r["after_universal"]["weights"], res[0]["after_universal"]["weights"])  # every rank, after the sync
    assert res[0]["after_universal"]["losses"] != res[2]["after_universal"]["losses"]
    fp32 = res[0]["zero_to_fp32"]
    assert fp32.keys() == res[0]["diloco_weights"].keys()
    assert all(torch.equal(fp32[k].float(), res[0]["diloco_weights"][k]) for k in fp32)


def test_the_outer_optimizer_sweep_and_the_doc_quote_each_other():
    """docs/results/diloco/outer-sweep.json (the plain-PyTorch reference, H = 10, 500 steps): docs/diloco.md quotes
    every setting's held-out loss and its ratio to exact; plain averaging is the best of them."""
    import json
    from pathlib import Path
    from fcdp_lab.converge import converge
    root = Path(__file__).resolve().parent.parent
    data = json.loads((root / "docs/results/diloco/outer-sweep.json").read_text())
    doc = (root / "docs" / "diloco.md").read_text()
    exact = data["meta"]["exact_final_heldout_loss"]
    for rec in data["records"]:
        assert rec["steps"] == 500 and len(rec["train_losses"]) == 500
        assert rec["diloco"] == converge.diloco_block(rec["setting"])
        loss = rec["final_heldout_loss"]
        assert f"| `{rec['setting']}` |" in doc and f"| {loss:.4f} | {loss / exact:.4f}x |" in doc, rec["setting"]
    best = min(data["records"], key=lambda r: r["final_heldout_loss"])
    assert best["diloco"]["outer_lr"] == 1.0 and best["diloco"]["outer_momentum"] == 0.0
    # the block's defaults are the best record's own stored outer settings
    from fcdp_deepspeed.config.diloco import DiLoCoConfig
    assert (DiLoCoConfig().outer_lr, DiLoCoConfig().outer_momentum) == (best["diloco"]["outer_lr"],
                                                                        best["diloco"]["outer_momentum"])


def test_committed_convergence_sweep_and_the_doc_quote_each_other():
    """docs/results/diloco/converge.json (`python -m fcdp_lab converge`, 500 steps, the 1.33M-parameter byte GPT): every rank bitwise
    equal at the end; docs/diloco.md quotes every DiLoCo row's held-out loss against exact's, and whether it is
    within the issue's 2%."""
    import json
    from pathlib import Path
    from fcdp_lab.converge import converge, report as converge_report
    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "diloco.md").read_text()
    for name, dtype in (("results/diloco/converge.json", "fp32"), ("results/diloco/converge-bf16.json", "bf16")):
        data = json.loads((root / "docs" / name).read_text())
        rows = converge_report.summary_rows(data["records"])
        assert {r["setting"] for r in rows} >= {"exact", "diloco10_lr1_mom0"}
        assert {r["dtype"] for r in rows} == {dtype}
        _quoted(data, rows, doc, converge)


def _quoted(data: dict, rows: list, doc: str, converge) -> None:
    for rec, row in zip(data["records"], rows):
        assert rec["steps"] == 500 and rec["params"] >= 1_000_000 and rec["bitwise_equal_across_ranks"], rec["key"]
        if converge.diloco_block(rec["setting"]) is not None:
            ratio = row["loss_vs_exact"]
            assert f"{ratio:.4f}x ({'met' if ratio <= 1.02 else 'missed'})" in doc, (rec["key"], ratio)


def test_committed_batch32_reference_and_the_doc_quote_each_other():
    """docs/results/diloco/batch32-reference.json: exact and DiLoCo H = 10 at 4x the micro-batch (the reference);
    docs/diloco.md quotes the ratio, which is below micro-batch 8's (the gap is batch-limited)."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    data = json.loads((root / "docs/results/diloco/batch32-reference.json").read_text())
    loss = {r["setting"]: r["final_heldout_loss"] for r in data["records"]}
    assert all(r["steps"] == 500 and len(r["train_losses"]) == 500 for r in data["records"])
    ratio = loss["diloco10_lr1_mom0"] / loss["exact"]
    assert 1.0 < ratio < 1.1401
    assert f"**{ratio:.4f}x**" in (root / "docs" / "diloco.md").read_text()


@pytest.fixture(scope="module")
def four_nodes():
    return run_ranks("diloco:four_nodes", 4, steps=2 * H, sync_every=H)


def test_four_nodes_average_in_two_stages_bitwise_as_the_all_gather(four_nodes):
    """[Note: two stages on more than two nodes]: on 4 nodes the uncompressed average is an all-to-all of slices
    and an all-gather of their means: bitwise the all-gather path's mean on the same messages (with and without a
    padded slice), the same on every rank, at 2 (N - 1) / N of a message per rank instead of N - 1."""
    for numel in (1001, 1024):
        runs = [r["pair"][numel] for r in four_nodes]
        mean = sum(r["delta"].double() for r in runs) / 4
        for r in runs:
            assert r["flags"] == (True, False)
            assert torch.equal(r["two_stage"], r["all_gather"]) and torch.equal(r["two_stage"], runs[0]["two_stage"])
            assert torch.allclose(r["two_stage"].double(), mean, atol=1e-6)
            width = -(-numel // 4)
            assert r["sent"] == (2 * 3 * width * 4, 3 * numel * 4)


def test_four_nodes_sync_to_bitwise_the_same_model(four_nodes):
    """DiLoCo through ``deepspeed.initialize`` on 4 nodes x 1 rank: every rank equal after each sync and only then;
    the outer step follows the float64 mean of the 4 pseudo-gradients."""
    for s in range(2 * H):
        w = [r["weights"][s] for r in four_nodes]
        assert all(_equal(w[0], x) for x in w[1:]) == ((s + 1) % H == 0), s
    for k in range(2):
        recs = [r["records"][k] for r in four_nodes]
        for i in range(len(recs[0]["outer"])):
            outer = recs[0]["outer"][i].double()
            g = sum(outer - rec["local"][i].double() for rec in recs) / 4
            if k == 0:
                expected = outer - LR * (g + MU * g)  # m = g on the first sync
                assert torch.allclose(recs[0]["outer_after"][i].double(), expected, rtol=1e-5, atol=1e-6)
            assert all(torch.equal(rec["outer_after"][i], recs[0]["outer_after"][i]) for rec in recs)
    s = four_nodes[0]["stats"]
    shard = sum(t.numel() for t in four_nodes[0]["records"][0]["outer"])
    assert s["diloco_pseudo_grad_bytes"] == 2 * 2 * 3 * (-(-shard // 4)) * 4  # 2 syncs x 2 (N - 1) slices


def test_fcdp_plan_counts_two_stages_on_more_than_two_nodes():
    from fcdp_deepspeed.tools.plan.diloco import diloco_plan
    from fcdp_deepspeed.tools.plan.planner import ClusterSpec
    spec = ClusterSpec(params=7e9, nodes=4, ranks_per_node=8)
    per_step = lambda **b: diloco_plan(spec, {"sync_every": 10, **b})["inter_node_bytes_per_step"]  # noqa: E731
    assert per_step() == pytest.approx(per_step(fragments=2, overlap_steps=1) / 2)  # 2 (N - 1) / N vs N - 1
    assert per_step(fragments=2, overlap_steps=0) == pytest.approx(per_step())  # blocking: two stages again
    two = ClusterSpec(params=7e9, nodes=2, ranks_per_node=8)
    assert diloco_plan(two, {"sync_every": 10})["inter_node_bytes_per_step"] == pytest.approx(
        diloco_plan(two, {"sync_every": 10, "fragments": 2})["inter_node_bytes_per_step"])  # 2 nodes: the same


def test_the_ledger_counts_the_two_stage_all_to_all_as_the_kernel_does():
    """docs/results/diloco/4x1.json: DiLoCo's two-stage exchange on 4 nodes x 1 rank (an all-to-all of slices and
    an all-gather) counted by the ledger within 1% of the kernel's uplink counters, at 2 (N - 1) / N of a shard per
    rank per sync; diloco.md quotes it."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    rows = {r["engine"]: r for r in json.loads((root / "docs/results/diloco/4x1.json").read_text())["rows"]}
    r = rows["diloco10"]
    assert r["layout"] == "4x1" and 0.99 <= r["counted_vs_kernel"] <= 1.01
    per_sync = 4 * 2 * 3 / 4 * r["trainable_params"] * 4  # every rank: 2 (N - 1) / N of its fp32 shard (the model)
    assert r["counted_inter_node_bytes_per_step"] == pytest.approx(per_sync / 10, rel=0.01)
    text = (root / "docs" / "diloco.md").read_text()
    assert f"{r['kernel_inter_node_bytes_per_step'] / 1e6:.2f} MB per step, counted/kernel {r['counted_vs_kernel']:.3f}" in text
    assert f"the exact defaults moved {rows['fcdp_node']['bytes_vs_bound']:.2f}x the bound" in text
