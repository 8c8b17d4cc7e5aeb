"""``python -m fcdp_lab bench`` with compression (issue 23): the compressed engines' blocks, layouts, ratios against the exact
bound and the exact defaults, the LoRA step-time floor, the targets and the preset. Arithmetic on made-up
rows; the runs themselves are the lead's (docs/benchmarks.md)."""
from __future__ import annotations

from dataclasses import fields

import pytest

from fcdp_lab.bench import bench
from fcdp_lab.bench.compression import (COMPRESSED_ENGINES, PRESETS, TARGETS, compression_stats,
                                                    parse_layouts, targets, targets_markdown)


def test_compressed_engines_are_the_exact_defaults_plus_compression():
    for name, (p, g) in COMPRESSED_ENGINES.items():
        block = bench.FCDP_BLOCKS[name]
        assert name in bench.ALL_ENGINES and name not in bench.ENGINES  # opt-in, never in the default sweep
        assert {k: v for k, v in block.items() if "compression" not in k} == bench.FCDP_BLOCKS["fcdp_node"]
        assert (block["param_compression"], block["grad_compression"]) == (p, g)
    assert bench.ENGINES == ("zero3", "hpz", "fcdp", "fcdp_node")


def test_compression_stats_whatever_the_engine_reports():
    before = {"inter_node_param_compressed_bytes": 100, "cache_hits": 5, "grad_residual_rel_norm": 0.1}
    after = {"inter_node_param_compressed_bytes": 500, "cache_hits": 9, "grad_residual_rel_norm": 0.2,
             "param_compression": "int4"}
    got = compression_stats(before, after, steps=4)
    assert got == {"inter_node_param_compressed_bytes": 500, "inter_node_param_compressed_bytes_per_step": 100.0,
                   "grad_residual_rel_norm": 0.2, "param_compression": "int4"}


def test_layouts():
    assert parse_layouts("2x2, 2X4,4x2") == ["2x2", "2x4", "4x2"] and parse_layouts("") == []
    with pytest.raises(ValueError):
        parse_layouts("2by2")
    assert bench.BenchSpec(layouts=["2x4", "4x2"]).layout_list() == [(2, 4), (4, 2)]
    assert bench.BenchSpec(nodes=3, ranks_per_node=2).layout_list() == [(3, 2)]


def _row(engine: str, rate: float, step: float, nbytes: float, job: str = "full", nodes: int = 2, world: int = 4,
         ga: int = 1, uplink: float = 0.0) -> dict:
    return {"engine": engine, "rate_mbit": rate, "job": job, "grad_accum": ga, "nodes": nodes, "world": world,
            "layout": f"{nodes}x{world // nodes}", "regime": "large", "samples_per_step": 32, "step_time_s": step,
            "samples_per_s": 32 / step, "kernel_inter_node_bytes_per_step": nbytes,
            "counted_inter_node_bytes_per_step": nbytes, "trainable_params": 1_000_000, "params": 1_000_000,
            "no_backward_params": 0, "uplink_max_payload_bytes_per_step": uplink,
            "uplink_max_frame_bytes_per_step": uplink * 1.05, "host_cache_bytes_per_rank": 0,
            "device_cache_bytes_per_rank": 0, "peak_memory_bytes": 0}


def test_ratios_floor_and_targets_on_made_up_rows():
    rows = [_row("fcdp_node", 100, 1.0, 8.0e6), _row("fcdp_int4", 100, 0.4, 1.9e6),
            _row("fcdp_int8", 100, 0.5, 3.0e6),
            _row("fcdp_node", 100, 2.0, 16e6, nodes=4, world=8),  # another layout: its own bound and exact
            _row("fcdp_int4", 100, 0.5, 4.2e6, nodes=4, world=8),
            _row("fcdp_int4", 10, 0.30, 30e3, job="lora", uplink=250e3), _row("fcdp_int4", 0, 0.15, 30e3, job="lora"),
            _row("fcdp_node", 10, 0.31, 130e3, job="lora", uplink=70e3)]
    rows += bench.bound_rows(rows)
    bench.add_ratios(rows)
    get = {(r["engine"], r["rate_mbit"], r["job"], r["nodes"]): r for r in rows}
    assert get[("bound", 100, "full", 2)]["kernel_inter_node_bytes_per_step"] == 8e6  # exact: 2 (N-1) t 4 B
    assert get[("bound", 100, "full", 4)]["kernel_inter_node_bytes_per_step"] == 24e6
    int4 = get[("fcdp_int4", 100, "full", 2)]
    assert int4["bytes_vs_bound"] == pytest.approx(0.2375) and int4["bytes_vs_exact"] == pytest.approx(0.2375)
    assert int4["speedup_vs_exact"] == pytest.approx(2.5)
    assert get[("fcdp_int4", 100, "full", 4)]["bytes_vs_exact"] == pytest.approx(4.2 / 16)
    lora = get[("fcdp_int4", 10, "lora", 2)]
    assert lora["compute_s"] == 0.15 and lora["wire_s"] == pytest.approx(0.2)  # 250 kB at 1.25 MB/s
    assert lora["step_vs_floor"] == pytest.approx(1.5)
    assert get[("fcdp_node", 10, "lora", 2)]["step_vs_floor"] is None  # no rate-0 run of that engine
    found = {(t["engine"], t["metric"], t["layout"]): t for t in targets(rows)}
    assert found[("fcdp_int4", "bytes_vs_bound", "2x2")]["met"] is True
    assert found[("fcdp_int4", "bytes_vs_bound", "4x2")]["met"] is True  # 4.2 / 24
    assert found[("fcdp_int8", "bytes_vs_bound", "2x2")]["met"] is False  # 3.0 / 8 > 0.35
    assert found[("fcdp_int4", "speedup_vs_exact", "2x2")]["met"] is True
    assert found[("fcdp_int4", "step_vs_floor", "2x2")]["met"] is False
    assert "**not met**" in targets_markdown(list(found.values()))
    md = bench.markdown_table(rows)
    assert "| 100 Mbit/s | 4x2 | full | 1 | fcdp_int4 |" in md and "1.50 |" in md


def test_preset_parts_are_valid_specs_and_decide_every_target():
    names = {f.name for f in fields(bench.BenchSpec)}
    decided = set()
    for part in PRESETS["compression"].values():
        o = part.overrides
        assert set(o) <= names and set(o["engines"]) <= set(bench.ALL_ENGINES)
        bench.BenchSpec(**o).layout_list()
        for t in TARGETS:
            if t.metric in part.decides and t.job in o["jobs"] and t.rate_mbit in o["rates_mbit"] and t.engine in o["engines"]:
                decided.add(t)
    assert decided == set(TARGETS)
    assert PRESETS["compression"]["bytes"].decides == ("bytes_vs_bound",)  # one repeat: never a throughput verdict


def test_committed_rows_keep_their_ratios():
    """Rows of runs made before layouts and compression (no layout or compression keys) still combine."""
    rows = [_row("zero3", 100, 2.0, 60e6), _row("fcdp_node", 100, 1.0, 20e6)]
    for r in rows:
        del r["layout"], r["uplink_max_payload_bytes_per_step"], r["uplink_max_frame_bytes_per_step"]
    rows += bench.bound_rows(rows)
    bench.add_ratios(rows)
    node = next(r for r in rows if r["engine"] == "fcdp_node")
    assert node["speedup_vs_zero3"] == pytest.approx(2.0) and node["wire_s"] is None
    assert "| 100 Mbit/s | 2x2 | full |" in bench.markdown_table(rows)


def test_committed_compression_run_meets_every_target():
    """docs/results/compression/*.json (``python -m fcdp_lab bench --preset compression``, the lead's quiet-machine run): every
    target of :data:`TARGETS` is decided by the part that decides it, met, and recomputes from the committed rows."""
    import json
    from pathlib import Path
    results = Path(__file__).resolve().parent.parent / "docs" / "results" / "compression"
    found = json.loads((results / "targets.json").read_text())
    assert found and all(t["met"] is True for t in found), [t for t in found if not t["met"]]
    assert {(t.job, t.engine, t.metric) for t in TARGETS} == {(t["job"], t["engine"], t["metric"]) for t in found}
    layouts = {t["layout"] for t in found if t["metric"] == "bytes_vs_bound" and t["job"] == "full"}
    assert layouts == {"2x2", "2x4", "4x2"}
    for name, part in PRESETS["compression"].items():
        file = {"full100": "full-100mbit", "lora10": "lora-10mbit"}.get(name, name)
        rows = json.loads((results / f"{file}.json").read_text())["rows"]
        mine = [t for t in found if t["part"] == name]
        assert [{k: v for k, v in t.items() if k != "part"} for t in mine] == targets(rows, part.decides)
