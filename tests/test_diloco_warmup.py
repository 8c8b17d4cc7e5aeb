"""DiLoCo's warm-up (``fcdp.diloco.warmup_steps``, [Note: the warm-up] in diloco/warmup.py) on 2 emulated nodes x 2
ranks through ``deepspeed.initialize``: during the warm-up every rank holds bitwise the same model, and that model
is plain ZeRO-3's over the world up to the gradient's summation order; afterwards the nodes train on their own and
sync every ``sync_every`` steps counted from the warm-up's end, the outer parameters starting from the warm model;
a checkpoint saved inside the warm-up resumes bit for bit; the broken variant (gradients not averaged) fails."""
from __future__ import annotations

import pytest
import torch

from conftest import TESTS_DIR, run_ranks, worker_target
from fcdp_deepspeed.config import FCDPConfigError, check_ds_config_compatible, parse_fcdp_config

H, WARMUP, STEPS = 3, 2, 8
SYNCED = [s for s in range(STEPS) if s >= WARMUP and (s + 1 - WARMUP) % H == 0]  # 0-based steps that end in a sync


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(env: dict | None = None) -> list:
    from fcdp_lab.harness.launch import run_local
    return run_local(worker_target("diloco:warmup"), 4, dict(steps=STEPS, warmup_steps=WARMUP, sync_every=H),
                     timeout=240, env=env, pythonpath=[TESTS_DIR])


@pytest.fixture(scope="module")
def warm():
    return _run()


def _same_everywhere(res: list, step: int) -> bool:
    w = [r["weights"][step] for r in res]
    return all(_equal(w[0], x) for x in w[1:])


def test_every_rank_holds_the_exact_model_during_the_warmup(warm):
    assert SYNCED == [4, 7]
    for s in range(WARMUP):
        assert _same_everywhere(warm, s), f"warm-up step {s}: the nodes differ"
        exact, got = warm[0]["exact_weights"][s], warm[0]["weights"][s]
        assert exact.keys() == got.keys()
        for k in exact:  # ZeRO-3 over the world; the warm-up sums node first, then nodes
            assert torch.allclose(got[k], exact[k], rtol=1e-5, atol=1e-7), k
    for s in range(WARMUP, STEPS):
        assert _same_everywhere(warm, s) == (s in SYNCED), f"step {s}"


def test_the_schedule_counts_from_the_warmups_end_and_the_outer_starts_there(warm):
    for r in warm:
        every = r["every_step"]
        assert [i for i, rec in enumerate(every) if rec["done"]] == SYNCED
        first = r["records"][0]
        warm_masters = every[WARMUP - 1]["master_after"]
        assert all(torch.equal(o, m) for o, m in zip(first["outer"], warm_masters))  # outer := the warm model
        assert all(not m.any() for m in first["momentum"])  # nothing synced before: zero momentum
        s = r["stats"]
        shard = sum(t.numel() for t in first["outer"]) * 4
        assert s["diloco_warmup_steps"] == WARMUP and not s["diloco_in_warmup"] and s["diloco_syncs"] == len(SYNCED)
        assert s["diloco_warmup_grad_bytes"] == WARMUP * shard  # each step: this rank's fp32 gradient partition
        assert s["inter_node_diloco_bytes"] == s["diloco_warmup_grad_bytes"] + s["diloco_pseudo_grad_bytes"]
    assert "after 2 exact data-parallel warm-up steps" in warm[0]["on_lines"][0]  # rank 0's line


def test_the_broken_variant_without_the_average_fails():
    res = _run(env={"FCDP_LAB_BREAK": "diloco.skip_warmup"})
    assert not _same_everywhere(res, 0)


def test_checkpoint_inside_the_warmup_resumes_exactly(tmp_path):
    from fcdp_lab.harness.launch import run_local
    res = run_local(worker_target("diloco:checkpoint"), 4, dict(ckpt_dir=str(tmp_path), save_at=1, steps=7,
                                                                 sync_every=H, warmup_steps=WARMUP),
                    timeout=240, pythonpath=[TESTS_DIR])
    for r in res:
        assert r["loaded_steps"] == 1
        assert r["before"] + r["after"] == r["straight"]
        assert _equal(r["resumed_weights"], r["straight_weights"])


def test_bad_warmup_is_refused_by_key_with_the_fix():
    block = {"zero_optimization": {"stage": 3}, "fcdp": {"enabled": True, "diloco": {"warmup_steps": -1}}}
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config(block)
    assert "fcdp.diloco.warmup_steps" in str(err.value) and "Fix:" in str(err.value)
    assert parse_fcdp_config({"fcdp": {"enabled": True, "diloco": {}}}).diloco.warmup_steps == 0
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
               "fcdp": {"enabled": True, "diloco": {"warmup_steps": 5}}}
    with pytest.raises(FCDPConfigError) as err:
        check_ds_config_compatible(offload)
    assert "fcdp.diloco.warmup_steps" in str(err.value) and "offload_optimizer" in str(err.value)
    offload["fcdp"]["diloco"]["warmup_steps"] = 0
    check_ds_config_compatible(offload)  # no warm-up: offload_optimizer is fine


def test_fcdp_plan_prints_the_warmups_bytes(tmp_path, capsys):
    """Each warm-up step on 4 x 8: every rank's bf16 gradient partition (7e9 / 8 elements) averaged with its 3 peers
    in two stages, 2 x 3 / 4 of a partition per rank (the all-gather would send 3)."""
    import json
    from fcdp_deepspeed.tools.plan import planner
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                               "fcdp": {"enabled": True, "diloco": {"sync_every": 100, "warmup_steps": 500}}}))
    assert planner.main(["--params", "7B", "--nodes", "4", "--ranks-per-node", "8", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"first 500 exact warm-up steps at {4 * 8 * (2 * 3 / 4) * 2 * 7e9 / 8 / 2**30:.4f} GiB per step" in out


def test_committed_warmup_runs_and_the_docs_quote_each_other():
    """docs/results/diloco/warmup-reference.json (the reference, 500 steps): diloco.md quotes every run's loss and
    ratio; the warm-up narrows the gap at each batch, and none reaches the issue's 2% (the README says so); the
    engine's own W = 100 run (docs/results/diloco/converge.json) ends where the reference does."""
    import json
    from pathlib import Path
    from fcdp_lab.converge import converge
    root = Path(__file__).resolve().parent.parent
    data = json.loads((root / "docs/results/diloco/warmup-reference.json").read_text())
    doc, readme = (root / "docs" / "diloco.md").read_text(), (root / "README.md").read_text()
    exact = data["meta"]["exact_final_heldout_loss"]
    ratios = {}
    for rec in data["records"]:
        assert rec["steps"] == 500 and len(rec["train_losses"]) == 500
        assert rec["diloco"] == converge.diloco_block(rec["setting"])
        w, mb, loss = rec["diloco"]["warmup_steps"], rec["micro_batch"], rec["final_heldout_loss"]
        ratios[(mb, w)] = ratio = loss / exact[str(mb)]
        assert f"| {mb} | {w} | {loss:.4f} | {ratio:.4f}x |" in doc, (mb, w)
        assert ratio > 1.02
    assert ratios[(8, 250)] < ratios[(8, 100)] < 1.1401 and ratios[(32, 250)] < ratios[(32, 100)] < 1.0448
    assert f"1.{round(ratios[(32, 250)] * 1000) % 1000:03d}x" in readme
    engine = {r["setting"]: r for r in json.loads((root / "docs/results/diloco/converge.json").read_text())["records"]}
    ref = next(r for r in data["records"] if (r["micro_batch"], r["diloco"]["warmup_steps"]) == (8, 100))
    assert abs(engine["diloco10_lr1_mom0_wu100"]["final_heldout_loss"] - ref["final_heldout_loss"]) < 1e-5


def test_bf16_with_accumulation_and_int4_stays_bitwise_equal_through_the_warmup():
    """bf16 (stage 3 accumulates bf16 gradients: averaged in fp32, rounded back), two micro-steps per step, int4
    pseudo-gradients after the warm-up: every rank equal after each warm-up step and after the sync, not between."""
    res = run_ranks("diloco:train", 4, steps=WARMUP + H, dtype="bf16", grad_accum=2, sync_every=H,
                    compression="int4", warmup_steps=WARMUP)
    for s in range(WARMUP + H):
        assert _same_everywhere(res, s) == (s < WARMUP or s == WARMUP + H - 1), s
    assert all(r["stats"]["diloco_syncs"] == 1 and r["stats"]["diloco_warmup_grad_bytes"] > 0 for r in res)


def test_fp16_loss_scalers_agree_through_the_warmup():
    """fp16 with a loss scale that overflows the first steps: during the warm-up every node sees the same averaged
    gradients, so every node's scaler skips the same steps and the model stays bitwise equal everywhere."""
    res = run_ranks("diloco:train", 4, steps=WARMUP + 2, dtype="fp16", sync_every=H, loss_scale_power=18,
                    warmup_steps=WARMUP + 2)
    assert len({r["skipped_steps"] for r in res}) == 1 and res[0]["skipped_steps"] > 0
    assert all(_same_everywhere(res, s) for s in range(WARMUP + 2))


def test_the_warmup_averages_in_two_stages_at_the_bound_on_four_nodes():
    """[Note: the warm-up in two stages]: on 4 nodes x 1 rank the warm-up's average is an all-to-all of slices and an
    all-gather of their means: bitwise the all-gather path's mean on the same pieces (fp32 and bf16, with and without
    a padded slice), the same on every rank, at 2 (N - 1) / N of a piece per rank instead of N - 1; through
    ``deepspeed.initialize`` every rank is equal during the warm-up, ``diloco_warmup_grad_bytes`` counts the two
    stages and the ledger's ``inter_node_diloco_bytes`` agrees with the two DiLoCo counters together."""
    res = run_ranks("diloco:four_nodes_warmup", 4, steps=WARMUP + H, warmup_steps=WARMUP, sync_every=H)
    for key in res[0]["pair"]:
        runs = [r["pair"][key] for r in res]
        mean = sum(r["piece"].double() for r in runs) / 4
        for r in runs:
            assert torch.equal(r["two_stage"], r["all_gather"]) and torch.equal(r["two_stage"], runs[0]["two_stage"])
            tol = 1e-6 if "float32" in key[0] else 1e-2
            assert torch.allclose(r["two_stage"].double(), mean, atol=tol), key
            size = runs[0]["piece"].element_size()
            assert r["sent"] == (2 * 3 * -(-key[1] // 4) * size, 3 * key[1] * size), key
    for step in range(WARMUP):
        assert _same_everywhere(res, step), step
    for r in res:
        s = r["stats"]
        numel = sum(t.numel() for t in r["records"][0]["outer"])  # 1 rank per node: the whole fp32 partition
        assert s["diloco_warmup_grad_bytes"] == WARMUP * 2 * 3 * -(-numel // 4) * 4, (s["diloco_warmup_grad_bytes"], numel)
        assert s["inter_node_diloco_bytes"] == s["diloco_warmup_grad_bytes"] + s["diloco_pseudo_grad_bytes"]
