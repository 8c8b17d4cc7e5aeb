"""The committed runs of issue 31 (docs/bench_overlap_*_results.json: ``python -m fcdp_lab bench`` with ``fcdp_node@before`` = the
last landed commit, 10fb96a, and ``fcdp_node`` = this tree, interleaved in one run each): every shaped row has its
limit and timeline, the overlap changed no value and no byte, docs/BENCHMARKS.md quotes exactly these numbers (its
tables are regenerated from the JSON here) and says, per target, what the numbers say."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fcdp_lab.bench import timeline_plot

DOCS = Path(__file__).resolve().parent.parent / "docs"
RUNS = ("bench_overlap_ga1_results.json", "bench_overlap_prefetch_results.json", "bench_overlap_ga4_results.json")
BEFORE, AFTER = "fcdp_node@before", "fcdp_node"


def _rows(name: str) -> list[dict]:
    return [r for r in json.loads((DOCS / name).read_text())["rows"] if not r.get("computed")]


def _by(name: str) -> dict:
    return {(r["rate_mbit"], r["engine"]): r for r in _rows(name)}


@pytest.mark.parametrize("name", RUNS)
def test_every_shaped_row_has_its_limit_and_timeline(name):
    shaped = [r for r in _rows(name) if r["rate_mbit"] == 100]
    assert {BEFORE, AFTER} <= {r["engine"] for r in shaped}
    for r in shaped:
        assert r["step_vs_floor"] == pytest.approx(r["step_time_s"] / max(r["compute_s"], r["wire_s"]))
        if r["engine"] != "zero3":  # plain ZeRO-3's fetches are not FCDP's: not timed
            waits = sum(r["timeline_s"].values())
            assert 0 < waits <= r["step_time_s"] * 1.1, (r["engine"], waits, r["step_time_s"])  # rank 0's mean vs median


@pytest.mark.parametrize("name", RUNS)
def test_the_overlap_changes_no_value_and_no_byte(name):
    by = _by(name)
    for rate in (100, 0):
        before, after = by[(rate, BEFORE)], by[(rate, AFTER)]
        assert after["losses"] == before["losses"]  # bit for bit, every micro-step
        assert after["counted_inter_node_bytes_per_step"] == pytest.approx(before["counted_inter_node_bytes_per_step"],
                                                                           rel=0.01)
    # the kernel's counters are read between barriers (the bench's own counted/kernel bound: 5%)
    assert by[(100, AFTER)]["kernel_inter_node_bytes_per_step"] == pytest.approx(
        by[(100, BEFORE)]["kernel_inter_node_bytes_per_step"], rel=0.05)


def test_benchmarks_md_quotes_the_committed_runs():
    text = (DOCS / "BENCHMARKS.md").read_text()
    for name in RUNS:
        assert timeline_plot.markdown(_rows(name), 100) in text, name
    assert (DOCS / "bench_overlap_timeline.png").stat().st_size > 10_000
    assert (DOCS / "bench_overlap_gantt.png").stat().st_size > 10_000


def test_benchmarks_md_says_met_or_missed_per_target():
    """Issue 31's step targets (<= 1.15x max(compute, wire)) and the codec's (int4 compute <= 1.25x the exact
    engine's), each quoted with the verdict its numbers give."""
    text = (DOCS / "BENCHMARKS.md").read_text()
    for name, label in zip(RUNS, ("exact defaults, GA 1", "exact defaults, GA 1, prefetch 5e7", "exact defaults, GA 4")):
        ratio = _by(name)[(100, AFTER)]["step_vs_floor"]
        assert f"| {label} | {ratio:.2f}x | {'met' if ratio <= 1.15 else 'missed'} |" in text, (label, ratio)
    by = _by(RUNS[0])
    codec = by[(0, "fcdp_int4")]["step_time_s"] / by[(0, AFTER)]["step_time_s"]
    assert f"| int4/int4 compute vs exact, GA 1 | {codec:.2f}x | {'met' if codec <= 1.25 else 'missed'} |" in text


PUSH_RUNS = ("bench_overlap_push_ga1_results.json", "bench_overlap_push_prefetch_results.json",
             "bench_overlap_push_ga4_results.json", "bench_overlap_push_ga1_quiet_results.json")


@pytest.mark.parametrize("name", PUSH_RUNS)
def test_the_rolling_push_changes_no_value_and_is_quoted(name):
    """The rolling push runs (``fcdp_node`` vs ``fcdp_node_push8m``, one run each): the same losses bit for bit on
    both networks, the pushed groups were waited for (push wait > 0) and BENCHMARKS.md quotes the shaped table."""
    by = _by(name)
    for rate in (100, 0):
        assert by[(rate, "fcdp_node_push8m")]["losses"] == by[(rate, "fcdp_node")]["losses"]
    assert by[(100, "fcdp_node_push8m")]["timeline_s"]["push_wait"] > 0
    assert by[(100, "fcdp_node")]["timeline_s"].get("push_wait", 0) == 0
    assert timeline_plot.markdown(_rows(name), 100) in (DOCS / "BENCHMARKS.md").read_text()


@pytest.mark.parametrize("name", ("bench_overlap_layouts_results.json", "bench_overlap_lora10_results.json"))
def test_the_layout_and_lora_runs_change_no_value_and_are_quoted(name):
    """2 x 4, 4 x 2 and LoRA at 10 Mbit/s: the push changed no loss (per layout and network), and BENCHMARKS.md quotes
    every shaped row's step, compute, wire and ratio; LoRA's defaults stay within 1.1x of their limit."""
    rows = _rows(name)
    text = (DOCS / "BENCHMARKS.md").read_text()
    by = {(r["layout"], r["rate_mbit"], r["engine"]): r for r in rows}
    for (layout, rate, engine), r in by.items():
        assert r["losses"] == by[(layout, rate, "fcdp_node")]["losses"], (layout, rate, engine)
        if r.get("step_vs_floor"):
            assert (f"| {layout} | {r['job']} | {engine} | {r['step_time_s']:.3f} | {r['compute_s']:.3f} | "
                    f"{r['wire_s']:.3f} | {r['step_vs_floor']:.2f}x |") in text
    if "lora" in name:
        assert by[("2x2", 10, "fcdp_node")]["step_vs_floor"] <= 1.1


RUNAHEAD_RUNS = ("bench_overlap_runahead_ga1_results.json", "bench_overlap_runahead_prefetch_results.json",
                 "bench_overlap_runahead_ga4_results.json")


@pytest.mark.parametrize("name", RUNAHEAD_RUNS)
def test_the_runahead_changes_no_value_and_no_byte_and_is_quoted(name):
    """The run-ahead from the window's first fetch (session 2026-12-04e, ``fcdp_node`` = the new defaults vs the last
    landed commit and, where run, the same tree without it): the same losses bit for bit and counted bytes on both
    networks, its groups waited for in the push-wait phase, and BENCHMARKS.md quotes the shaped table."""
    by = _by(name)
    for (rate, engine), r in by.items():
        if engine.startswith("fcdp_int"):  # lossy: its own losses and bytes (test_every_shaped_row... covers it)
            continue
        assert r["losses"] == by[(rate, BEFORE)]["losses"], (rate, engine)
        assert r["counted_inter_node_bytes_per_step"] == pytest.approx(
            by[(rate, BEFORE)]["counted_inter_node_bytes_per_step"], rel=0.01), (rate, engine)
    assert by[(100, AFTER)]["timeline_s"]["push_wait"] > 0 and by[(100, BEFORE)]["timeline_s"]["push_wait"] == 0
    if (100, "fcdp_node_noahead") in by:
        assert by[(100, "fcdp_node_noahead")]["timeline_s"]["push_wait"] == 0
    assert timeline_plot.markdown(_rows(name), 100) in (DOCS / "BENCHMARKS.md").read_text()


def _verdict_lines(g1: dict, pf: dict, g4: dict, lora: dict, run: str) -> list[str]:
    """Issue 31's verdict lines for one set of runs (GA 1, GA 1 with prefetch, GA 4, LoRA at 10 Mbit/s), as
    BENCHMARKS.md writes them: ``| target (run) | ratio | met/missed |``."""
    codec = g1[(0, "fcdp_int4")]["step_time_s"] / g1[(0, AFTER)]["step_time_s"]
    targets = (("exact defaults, GA 1", g1[(100, AFTER)]["step_vs_floor"], 1.15),
               ("exact defaults, GA 1, prefetch 5e7", pf[(100, AFTER)]["step_vs_floor"], 1.15),
               ("exact defaults, GA 4", g4[(100, AFTER)]["step_vs_floor"], 1.15),
               ("int4/int4 compute vs exact, GA 1", codec, 1.25),
               ("int4/int4 step vs its limit, GA 1", g1[(100, "fcdp_int4")]["step_vs_floor"], 1.2),
               ("LoRA at 10 Mbit/s, defaults", lora[(10, AFTER)]["step_vs_floor"], 1.1))
    return [_verdict(label, ratio, target, run) for label, ratio, target in targets]


def _verdict(label: str, ratio: float, target: float, run: str) -> str:
    """One verdict line as BENCHMARKS.md writes it: ``| target (run) | ratio | met/missed |``."""
    return f"| {label} ({run}) | {ratio:.2f}x | {'met' if ratio <= target else 'missed'} |"


def test_the_runahead_verdicts_follow_from_their_numbers():
    text = (DOCS / "BENCHMARKS.md").read_text()
    g1, pf, g4 = (_by(n) for n in RUNAHEAD_RUNS)
    lora = {(r["rate_mbit"], r["engine"]): r for r in _rows("bench_overlap_runahead_lora10_results.json")}
    for line in _verdict_lines(g1, pf, g4, lora, "run-ahead run"):
        assert line in text, line
    for r in lora.values():  # the defaults' run-ahead, without it and the push: the same losses
        assert r["losses"] == lora[(r["rate_mbit"], AFTER)]["losses"]
    assert (DOCS / "bench_overlap_runahead_gantt.png").stat().st_size > 10_000


RERUNS = ("bench_overlap_rerun_ga1_results.json", "bench_overlap_rerun_prefetch_results.json",
          "bench_overlap_rerun_ga4_results.json")


#: Session 2026-12-04f's runs and their repeats.
SESSION_F_RUNS = {**dict.fromkeys(RERUNS, 3), "bench_overlap_rerun_lora10_results.json": 3,
                  "bench_overlap_rerun_layouts_results.json": 1, "bench_overlap_links_ga1_results.json": 2,
                  "bench_overlap_links_ga4_results.json": 2, "bench_overlap_links_lora10_results.json": 5,
                  "bench_overlap_onegroup_lora10_results.json": 3}


@pytest.mark.parametrize("name", SESSION_F_RUNS)
def test_the_reruns_change_no_value_and_no_byte(name):
    """The quiet-machine reruns (session 2026-12-04f, 3 repeats) and the sampled run: every exact engine of a run has
    the same losses bit for bit and the same counted bytes as ``fcdp_node`` (per layout and network)."""
    by = {(r["layout"], r["rate_mbit"], r["engine"]): r for r in _rows(name)}
    for (layout, rate, engine), r in by.items():
        if engine.startswith("fcdp_int"):
            continue
        ref = by[(layout, rate, "fcdp_node")]
        if engine != "zero3":  # ZeRO-3 moves three times the bytes (and its own losses: summation order)
            assert r["counted_inter_node_bytes_per_step"] == pytest.approx(
                ref["counted_inter_node_bytes_per_step"], rel=0.01), (layout, rate, engine)
            assert r["losses"] == ref["losses"], (layout, rate, engine)
        assert r["repeats"] == SESSION_F_RUNS[name]


def test_the_reruns_are_quoted_and_their_verdicts_follow_from_their_numbers():
    text = (DOCS / "BENCHMARKS.md").read_text()
    for name in (*RERUNS, "bench_overlap_links_ga1_results.json"):
        assert timeline_plot.markdown(_rows(name), 100) in text, name
    g1, pf, g4 = (_by(n) for n in RERUNS)
    for line in _verdict_lines(g1, pf, g4, _by("bench_overlap_rerun_lora10_results.json"), "rerun"):
        assert line in text, line
    fcdp, zero3 = pf[(100, AFTER)]["step_vs_floor"], pf[(100, "zero3")]["step_vs_floor"]
    assert (f"| prefetch 5e7: FCDP's ratio not above plain ZeRO-3's (rerun) | {fcdp:.2f}x vs {zero3:.2f}x | "
            f"{'met' if fcdp <= zero3 else 'missed'} |") in text
    for name in ("bench_overlap_rerun_layouts_results.json", "bench_overlap_rerun_lora10_results.json"):
        for r in _rows(name):
            if r.get("step_vs_floor"):
                assert (f"| {r['layout']} | {r['job']} | {r['engine']} | {r['step_time_s']:.3f} | {r['compute_s']:.3f} | "
                        f"{r['wire_s']:.3f} | {r['step_vs_floor']:.2f}x |") in text


def test_the_sampled_links_agree_with_the_kernel_counts_and_are_quoted():
    """``--sample-links`` ([Note: link samples]): every shaped row of the sampled run has the traced step's link use;
    its busiest uplink's frames at the rate are the bench's own per-step frame count within 1% (exact GA 1: every
    step moves the same bytes), the idle never exceeds the step minus that floor, and BENCHMARKS.md quotes the
    table ``bench.md`` printed."""
    from fcdp_lab.bench.bench import links_markdown
    rows = [r for r in _rows("bench_overlap_links_ga1_results.json") if r["rate_mbit"] == 100]
    assert len(rows) == 5
    for r in rows:
        use = r["links_last_step"]
        assert use["floor_s"] == pytest.approx(r["wire_frames_s"], rel=0.01), r["engine"]
        assert use["busiest_idle_s"] <= use["step_s"] - use["floor_s"] + 0.005, r["engine"]
    assert links_markdown(_rows("bench_overlap_links_ga1_results.json")) in (DOCS / "BENCHMARKS.md").read_text()


def test_one_group_runs_nothing_ahead_in_the_committed_lora_run_and_is_quoted():
    """[Note: one group runs nothing ahead]: in the committed LoRA run the new tree waits on no run-ahead (push wait
    0) where the tree before it did, with the same losses; BENCHMARKS.md quotes the sampled GA 4 and LoRA runs."""
    by = _by("bench_overlap_onegroup_lora10_results.json")
    assert by[(10, AFTER)]["timeline_s"]["push_wait"] == 0 < by[(10, BEFORE)]["timeline_s"]["push_wait"]
    from fcdp_lab.bench.bench import links_markdown
    text = (DOCS / "BENCHMARKS.md").read_text()
    for name, rate in (("bench_overlap_links_ga4_results.json", 100), ("bench_overlap_links_lora10_results.json", 10),
                       ("bench_overlap_onegroup_lora10_results.json", 10)):
        assert timeline_plot.markdown(_rows(name), rate) in text, name
        assert links_markdown(_rows(name)) in text, name


INFLIGHT_RUN = "bench_overlap_int4_inflight_results.json"


def _inflight_verdicts(by: dict) -> list[str]:
    """Session 2026-12-05's verdict lines: the compressed stage 1 in flight and run ahead."""
    codec = by[(0, "fcdp_int4")]["step_time_s"] / by[(0, AFTER)]["step_time_s"]
    return [_verdict(label, ratio, target, "in-flight run") for label, ratio, target in (
        ("exact defaults, GA 1", by[(100, AFTER)]["step_vs_floor"], 1.15),
        ("int4/int4 compute vs exact, GA 1", codec, 1.25),
        ("int4/int4 step vs its limit, GA 1", by[(100, "fcdp_int4")]["step_vs_floor"], 1.2))]


def test_the_compressed_stage1_in_flight_changes_no_value_and_is_quoted():
    """[Note: the compressed stage 1 in flight] and [Note: compressed groups run ahead], measured side by side with the
    tree before them: the int4 engines' losses bit for bit and counted bytes equal at both rates (the same bits on the
    wire and in every reconstruction), 3 repeats; BENCHMARKS.md quotes the table and verdicts that follow from them."""
    by = _by(INFLIGHT_RUN)
    for rate in (100, 0):
        now, before = by[(rate, "fcdp_int4")], by[(rate, "fcdp_int4@before")]
        assert now["losses"] == before["losses"] and now["repeats"] == before["repeats"] == 3
        assert now["counted_inter_node_bytes_per_step"] == before["counted_inter_node_bytes_per_step"]
    text = (DOCS / "BENCHMARKS.md").read_text()
    assert timeline_plot.markdown(_rows(INFLIGHT_RUN), 100) in text
    for line in _inflight_verdicts(by):
        assert line in text, line


def test_the_lora_levers_change_no_value_and_are_quoted():
    """Session 2026-12-05: LoRA at 10 Mbit/s with a small gradient bucket, without the batched refill, and both
    (temporary engine variants): the same losses as the defaults; BENCHMARKS.md quotes every step and ratio."""
    rows = [r for r in _rows("bench_overlap_lora_levers_results.json") if r["engine"] != "bound"]
    text = (DOCS / "BENCHMARKS.md").read_text()
    ref = {r["rate_mbit"]: r["losses"] for r in rows if r["engine"] == AFTER}
    for r in rows:
        assert r["losses"] == ref[r["rate_mbit"]] and r["repeats"] == 3, r["engine"]
    by = {(r["rate_mbit"], r["engine"]): r for r in rows}
    for engine in (AFTER, "x_b8k", "x_nobatch", "x_b8k_nobatch"):
        shaped, free = by[(10, engine)], by[(0, engine)]
        assert (f"| {shaped['step_time_s']:.3f} | {free['step_time_s']:.3f} | {shaped['step_vs_floor']:.2f}x |") in text


def test_the_exact_engine_side_by_side_on_this_machine_is_quoted():
    """Session 2026-12-05: the exact defaults with and without this session's change, 3 repeats: the same losses and
    bytes; BENCHMARKS.md quotes both steps and ratios."""
    by = _by("bench_overlap_exact_0512_results.json")
    now, before = by[(100, AFTER)], by[(100, BEFORE)]
    assert now["losses"] == before["losses"] and now["repeats"] == before["repeats"] == 3
    assert now["counted_inter_node_bytes_per_step"] == pytest.approx(before["counted_inter_node_bytes_per_step"], rel=0.001)
    text = (DOCS / "BENCHMARKS.md").read_text()
    assert (f"{now['step_time_s']:.3f} s / {now['step_vs_floor']:.2f}x now, {before['step_time_s']:.3f} s / "
            f"{before['step_vs_floor']:.2f}x before") in text


NATIVE_RUN = "bench_overlap_int4_native_results.json"


def test_the_fused_cpu_codec_changes_no_value_and_its_verdicts_follow_from_their_numbers():
    """Session 2026-12-05c: the int4 engine with the fused CPU codec ([Note: the fused CPU codec]) side by side with the
    tree before it (torch ops), 3 repeats: losses bit for bit and counted bytes equal at both rates; BENCHMARKS.md
    quotes the table, the codec phase before and after, and the verdicts that follow from the numbers."""
    by, second = _by(NATIVE_RUN), _by(NATIVE_RUN.replace("native", "native_b"))
    for run in (by, second):
        for rate in (100, 0):
            now, before = run[(rate, "fcdp_int4")], run[(rate, "fcdp_int4@before")]
            assert now["losses"] == before["losses"] and now["repeats"] == before["repeats"] == 3
            assert now["counted_inter_node_bytes_per_step"] == before["counted_inter_node_bytes_per_step"]
    text = (DOCS / "BENCHMARKS.md").read_text()
    ratios = [second[(0, e)]["step_time_s"] / second[(0, AFTER)]["step_time_s"] for e in ("fcdp_int4", "fcdp_int4@before")]
    assert "gave {:.2f}x against\n  {:.2f}x with the torch ops".format(*ratios) in text
    assert timeline_plot.markdown(_rows(NATIVE_RUN), 100) in text
    assert timeline_plot.markdown(_rows(NATIVE_RUN), 0) in text
    exact = by[(0, AFTER)]["step_time_s"]
    for engine, run in (("fcdp_int4", "fused-codec run"), ("fcdp_int4@before", "fused-codec run, before")):
        for line in (_verdict("int4/int4 compute vs exact, GA 1", by[(0, engine)]["step_time_s"] / exact, 1.25, run),
                     _verdict("int4/int4 step vs its limit, GA 1", by[(100, engine)]["step_vs_floor"], 1.2, run)):
            assert line in text, line


#: Session 2026-12-05d's closing run: every target of issue 31 on one tree (26355db), and the repeats of each run.
CLOSING = {"bench_overlap_closing_ga1_results.json": 3, "bench_overlap_closing_prefetch_results.json": 3,
           "bench_overlap_closing_lora10_results.json": 5, "bench_overlap_closing_ga4_results.json": 3,
           "bench_overlap_closing_layouts_results.json": 1}


@pytest.mark.parametrize("name", CLOSING)
def test_the_closing_runs_move_the_exact_bytes_and_are_quoted(name):
    """The closing run: every exact FCDP row moves its bound's bytes (the kernel's count, within 5%: gloo's protocol
    bytes), every shaped row's ratio is its step over max(compute, wire), and BENCHMARKS.md quotes each table."""
    text = (DOCS / "BENCHMARKS.md").read_text()
    for r in _rows(name):
        assert r["repeats"] == CLOSING[name], r["engine"]
        if r["engine"] == AFTER:
            assert 0.99 <= r["bytes_vs_bound"] <= 1.05, (r["layout"], r["rate_mbit"], r["bytes_vs_bound"])
        if r["rate_mbit"]:
            assert r["step_vs_floor"] == pytest.approx(r["step_time_s"] / max(r["compute_s"], r["wire_s"]))
            assert (f"| {r['layout']} | {r['job']} | GA {r['grad_accum']} | {r['regime']} | {r['engine']} | "
                    f"{r['step_time_s']:.3f} | "
                    f"{_spread(r)} | {r['compute_s']:.3f} | {r['wire_s']:.3f} | {r['step_vs_floor']:.2f}x |") in text, r


def _spread(row: dict) -> str:
    """The repeats' median steps as BENCHMARKS.md's closing table writes them (``-`` for one repeat)."""
    times = sorted(row["repeat_step_times_s"])
    return f"{times[0]:.3f}-{times[-1]:.3f}" if len(times) > 1 else "-"


def test_the_closing_verdicts_follow_from_their_numbers():
    """Issue 31's targets on the closing run, each with the verdict its numbers give, plus item 5 (prefetch never
    hurts: FCDP's step with prefetch not above its step without, and its ratio not above plain ZeRO-3's) and the GA 4
    step against its exact-semantics bound (wire + 3/4 of compute)."""
    text = (DOCS / "BENCHMARKS.md").read_text()
    g1, pf, lora, g4 = (_by(f"bench_overlap_closing_{n}_results.json") for n in ("ga1", "prefetch", "lora10", "ga4"))
    for line in _verdict_lines(g1, pf, g4, lora, "closing run"):
        assert line in text, line
    fcdp, zero3 = pf[(100, AFTER)]["step_vs_floor"], pf[(100, "zero3")]["step_vs_floor"]
    assert (f"| prefetch 5e7: FCDP's ratio not above plain ZeRO-3's (closing run) | {fcdp:.2f}x vs {zero3:.2f}x | "
            f"{'met' if fcdp <= zero3 else 'missed'} |") in text
    on, off = pf[(100, AFTER)]["step_time_s"], g1[(100, AFTER)]["step_time_s"]
    assert (f"| prefetch 5e7: FCDP's step not above its step without it (closing run) | {on:.3f} s vs {off:.3f} s | "
            f"{'met' if on <= off else 'missed'} |") in text
    r = g4[(100, AFTER)]
    bound = r["wire_s"] + 0.75 * r["compute_s"]
    assert f"| exact defaults, GA 4, against wire + 3/4 of compute (closing run) | {r['step_time_s'] / bound:.2f}x |" in text


def test_the_closing_link_samples_are_quoted():
    """The closing run's sampled pair (prefetch 5e7 on and off): the sampled uplink agrees with the kernel's frames and
    BENCHMARKS.md quotes both traced steps."""
    from fcdp_lab.bench.bench import links_markdown
    text = (DOCS / "BENCHMARKS.md").read_text()
    for regime in ("default", "large"):
        rows = _rows(f"bench_overlap_closing_links_{regime}_results.json")
        assert [(r["regime"], r["repeats"]) for r in rows] == [(regime, 2)]
        assert rows[0]["links_last_step"]["floor_s"] == pytest.approx(rows[0]["wire_frames_s"], rel=0.01)
        assert links_markdown(rows) in text, regime


def test_the_readme_quotes_the_closing_run():
    """README's table of the step at its limit is the closing run's numbers."""
    readme = (DOCS.parent / "README.md").read_text()
    g1, pf, g4, lora = (_by(f"bench_overlap_closing_{n}_results.json") for n in ("ga1", "prefetch", "ga4", "lora10"))
    for label, r in (("exact defaults, GA 1", g1[(100, AFTER)]), ("the same with DeepSpeed's prefetch (5e7)", pf[(100, AFTER)]),
                     ("exact defaults, GA 4", g4[(100, AFTER)]), ("int4/int4, GA 1", g1[(100, "fcdp_int4")]),
                     ("LoRA at 10 Mbit/s", lora[(10, AFTER)])):
        assert f"| {label} | {r['step_time_s']:.3f} s | {r['step_vs_floor']:.2f}x" in readme, label
    codec = g1[(0, "fcdp_int4")]["step_time_s"] / g1[(0, AFTER)]["step_time_s"]
    assert f"its compute {codec:.2f}x the exact engine's" in readme
