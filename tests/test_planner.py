"""The planner's byte model against the emulated cluster's kernel counters, and its arithmetic."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fcdp_deepspeed.tools.cluster import namespaces_available
from fcdp_deepspeed.tools.planner import ClusterSpec, inter_node_bytes_per_step, main, parse_count, plan

ROOT = Path(__file__).resolve().parent.parent
OK, WHY = namespaces_available()


def predicted(row: dict) -> float:
    spec = ClusterSpec(params=row["params"], nodes=row["nodes"], ranks_per_node=row["world"] // row["nodes"],
                       trainable_fraction=row["trainable_params"] / row["params"], grad_accum=row["grad_accum"],
                       dtype_bytes=4, no_backward_fraction=row["no_backward_params"] / row["params"],
                       regime=row["regime"], backend="gloo")
    return inter_node_bytes_per_step(spec, row["engine"])["total"]


def check_rows(rows: list[dict]) -> None:
    for row in rows:
        measured = row["kernel_inter_node_bytes_per_step"]
        assert abs(predicted(row) - measured) <= 0.10 * measured, (row["rate_mbit"], row["job"], row["engine"],
                                                                  predicted(row), measured)
        assert abs(row["counted_vs_kernel"] - 1) <= 0.05, row  # our own counters agree with the kernel's


def test_ring_arithmetic():
    spec = ClusterSpec(params=1e9, nodes=2, ranks_per_node=2, dtype_bytes=2, backend="nccl")
    z3 = inter_node_bytes_per_step(spec, "zero3")
    assert z3["allgather"] == pytest.approx(2 * 1.5 * 2e9)  # fwd + bwd, ring crosses 2 links x 3 chunks of 1/4
    assert z3["reduce_scatter"] == pytest.approx(1.5 * 2e9)
    assert inter_node_bytes_per_step(spec, "fcdp")["allgather"] == pytest.approx(1.5 * 2e9)
    lora = ClusterSpec(params=1e9, nodes=4, ranks_per_node=8, trainable_fraction=0.001)
    assert inter_node_bytes_per_step(lora, "fcdp")["total"] < 0.01 * inter_node_bytes_per_step(lora, "zero3")["total"]


def test_plan_recommends_a_block_and_reports_memory(capsys):
    result = plan(ClusterSpec(params=30e9, nodes=4, ranks_per_node=8, inter_gbps=1, trainable_fraction=0.001))
    assert result["recommended_fcdp_block"]["enabled"] is True
    assert result["engines"]["fcdp"]["cache_host_bytes_per_node"] == pytest.approx(60e9)
    assert result["engines"]["hpz"]["cache_device_bytes_per_rank"] == pytest.approx(60e9 / 8)
    assert main(["--params", "30B", "--nodes", "4", "--ranks-per-node", "8", "--inter-gbps", "1",
                 "--trainable-fraction", "0.001"]) == 0
    assert "recommended block" in capsys.readouterr().out
    assert parse_count("1.3b") == 1.3e9 and parse_count("125M") == 125e6


def test_planner_reads_config(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{ // hjson comments allowed\n "bf16": {"enabled": true}, "gradient_accumulation_steps": 4 }')
    main(["--params", "7B", "--config", str(cfg), "--nodes", "2", "--ranks-per-node", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["grad_accum"] == 4 and out["spec"]["dtype_bytes"] == 2


def test_committed_benchmark_run_matches_planner():
    path = ROOT / "docs" / "bench_results.json"
    if not path.exists():
        pytest.skip("no committed benchmark run yet")
    check_rows(json.loads(path.read_text())["rows"])


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_planner_within_10_percent_of_emulated_cluster(tmp_path):
    from fcdp_deepspeed.tools.bench import BenchSpec, run_bench
    # adapters large enough that payload, not gloo's per-message protocol bytes, dominates (as in real LoRA)
    spec = BenchSpec(rates_mbit=[0], hidden=512, layers=4, lora_rank=8, warmup=2, steps=2, repeats=1, timeout_s=400)
    rows = run_bench(spec, tmp_path, progress=False)
    assert {(r["job"], r["engine"]) for r in rows} == {(j, e) for j in ("full", "lora") for e in ("zero3", "hpz", "fcdp")}
    check_rows(rows)
    for job in ("full", "lora"):
        losses = {r["engine"]: r["losses"] for r in rows if r["job"] == job}
        assert losses["fcdp"] == losses["zero3"]
    assert (tmp_path / "bench.png").exists() and (tmp_path / "bench.csv").exists()
