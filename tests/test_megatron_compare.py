"""The Megatron-DeepSpeed check's comparison (fcdp_lab.megatron_compare) on small synthetic
records: what it must pass, and the differences (one bit, one rank, one tensor) it must catch."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from fcdp_lab import megatron_compare as mc


def _rank(losses, enabled: bool, allgather, grads=(0, 0, 0), sha: str = "w") -> dict:
    return {"fcdp_enabled": enabled, "weights_sha256": sha, "param_sha256": {"w": sha}, "train_seconds": 1.0,
            "inter_node_allgather_bytes_at_init": 10, "stats": {"cache_hits": 5 if enabled else 0, "cache_misses": 1},
            "steps": [{"loss_hex": float(v).hex(), "grad_norm_hex": float(v / 2).hex(), "inter_node_allgather_bytes": a,
                       "inter_node_grad_reduce_bytes": g} for v, a, g in zip(losses, allgather, grads)]}


LOSSES = [5.5, 5.0, 4.5]
BASE = [_rank(LOSSES, False, [110, 210, 310]), _rank(LOSSES, False, [110, 210, 310])]
FCDP = [_rank(LOSSES, True, [110, 140, 170]), _rank(LOSSES, True, [110, 140, 170])]


def _write(root: Path, runs: dict[str, list[dict]]) -> Path:
    for name, ranks in runs.items():
        d = root / "tp1" / name
        d.mkdir(parents=True)
        for r, rec in enumerate(ranks):
            (d / f"rank{r}.json").write_text(json.dumps(rec))
    return root


def test_per_step_bytes_start_at_the_value_read_after_initialize():
    assert mc.per_step_bytes(BASE) == [100, 100, 100] and mc.per_step_bytes(FCDP) == [100, 30, 30]
    assert mc.steady_mean([100, 30, 50]) == 40


def test_identical_runs_pass_with_the_ratio(tmp_path):
    ok, summary, lines = mc.compare_results(_write(tmp_path, {"zero3": BASE, "fcdp-run": FCDP}), expect_saving=True)
    assert ok and len(summary) == 1 and summary[0]["identical"] and summary[0]["ratio"] == 0.3
    assert "bit-identical on all 2 ranks" in lines[0]


def test_one_bit_of_one_rank_differs_fails(tmp_path):
    """Broken variants the check must not pass: the last bit of one loss on rank 1 only, one weight."""
    run = copy.deepcopy(FCDP)
    run[1]["steps"][2]["loss_hex"] = float.fromhex(run[1]["steps"][2]["loss_hex"]).__add__(1e-15).hex()
    run[0]["weights_sha256"] = run[0]["param_sha256"]["w"] = "other"
    ok, summary, lines = mc.compare_results(_write(tmp_path, {"zero3": BASE, "fcdp-run": run}))
    assert not ok and not summary[0]["identical"]
    assert "    MISMATCH rank 1: losses differ" in lines and any("rank 0: final weights differ" in x for x in lines)


def test_no_saving_fails_only_when_expected(tmp_path):
    root = _write(tmp_path, {"zero3": BASE, "fcdp-run": [_rank(LOSSES, True, [110, 210, 310])] * 2})
    assert mc.compare_results(root)[0]
    ok, summary, lines = mc.compare_results(root, expect_saving=True)
    assert not ok and summary[0]["identical"] and lines[-1].endswith("did not reduce inter-node all-gather bytes")


def test_missing_or_incomplete_runs_fail(tmp_path):
    assert not mc.compare_results(_write(tmp_path / "a", {"fcdp-run": FCDP}))[0]
    assert not mc.compare_results(_write(tmp_path / "b", {"zero3": BASE, "fcdp-run": FCDP[:1]}))[0]


def test_gradient_mode_runs_within_rtol_except_the_key_bias():
    qkv = "layers.0.attention.query_key_value.bias"
    base = {"w": torch.ones(4, dtype=torch.float64), qkv: torch.ones(6, dtype=torch.float64)}
    near = [_rank([x * (1 + 1e-7) for x in LOSSES], True, [0, 0, 0])] * 2
    key_bias_moved = {"w": base["w"].clone(), qkv: torch.tensor([1, 1, 1.5, 1.5, 1, 1], dtype=torch.float64)}
    assert mc.close_problems(0, BASE[0], near[0], base, key_bias_moved) == []
    query_moved = {"w": base["w"].clone(), qkv: torch.tensor([1.5, 1, 1, 1, 1, 1], dtype=torch.float64)}
    assert "weight layers.0.attention" in mc.close_problems(0, BASE[0], near[0], base, query_moved)[0]
    far = _rank([x * (1 + 1e-4) for x in LOSSES], True, [0, 0, 0])
    assert "loss beyond" in mc.close_problems(0, BASE[0], far, base, base)[0]


def test_gradient_mode_runs_are_compared_with_tolerance(tmp_path):
    near = [_rank([x * (1 + 1e-7) for x in LOSSES], True, [110, 140, 170], sha="x")] * 2
    root = _write(tmp_path, {"zero3": BASE, "fcdp_node-run": near})
    weights = {"w": torch.ones(3)}
    ok, summary, lines = mc.compare_results(root, weights_of=lambda run_dir, rank: weights)
    assert ok and "within 1e-05 relative (gradient modes)" in lines[0]
