"""The step's timeline (``timeline.py``): exclusive nested phases, the ``[fcdp]`` line's part, the bench picture's
bars. Arithmetic and one thread: the engine-level numbers come from test_runahead.py and the committed bench run."""
from __future__ import annotations

import threading
import time

from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import format_stats_line
from fcdp_deepspeed.reporting.timeline import Phase, PhaseClock
from fcdp_lab.bench import timeline_plot


def test_nested_phases_are_exclusive_and_untimed_without_a_clock():
    clock = PhaseClock()
    with timeline.waiting(Phase.CODEC):  # no clock on this thread: not timed
        time.sleep(0.01)
    with timeline.waiting(Phase.GRAD_INTER_NODE, clock):
        time.sleep(0.02)
        with timeline.waiting(Phase.CODEC):  # the enclosing block's clock
            time.sleep(0.03)
    s = clock.stats()
    assert 0.03 <= s["timeline_codec_s"] < 0.2 and s["timeline_codec_calls"] == 1
    assert 0.02 <= s["timeline_grad_inter_node_s"] < s["timeline_codec_s"]  # the codec's time is not in it
    assert s["timeline_view"] == "host" and s["timeline_forward_gather_calls"] == 0


def test_threads_keep_their_own_stacks():
    clock = PhaseClock()

    def backward_thread():
        with timeline.waiting(Phase.BACKWARD_REFILL, clock):
            time.sleep(0.02)

    with timeline.waiting(Phase.FORWARD_GATHER, clock):
        t = threading.Thread(target=backward_thread)
        t.start()
        t.join()
    s = clock.stats()
    assert s["timeline_backward_refill_s"] >= 0.02 and s["timeline_forward_gather_s"] >= 0.02  # not subtracted
    assert timeline.fetch_phase() is Phase.FORWARD_GATHER  # outside autograd's backward


def test_log_line_reports_host_seconds_per_step_over_the_interval():
    base = {k: 0 for k in ("inter_node_allgather_bytes", "inter_node_grad_reduce_bytes", "intra_node_allgather_bytes",
                           "intra_node_grad_reduce_bytes", "cache_hits", "cache_misses")}
    prev = {**base, "optimizer_steps": 2, "timeline_view": "host", "timeline_forward_gather_s": 1.0}
    now = {**base, "optimizer_steps": 4, "timeline_view": "host", "timeline_forward_gather_s": 2.0,
           "timeline_grad_inter_node_s": 0.5}
    line = format_stats_line(now, prev)
    assert "host s/step (host view): forward gather 0.500" in line and "grad inter-node 0.250" in line
    assert "host s/step" not in format_stats_line({**base, "optimizer_steps": 1})


def test_per_step_and_bars():
    before, after = {"timeline_codec_s": 1.0}, {"timeline_codec_s": 3.0, "timeline_push_wait_s": 0.5}
    got = timeline.per_step(before, after, 4)
    assert got["codec"] == 0.5 and got["push_wait"] == 0.125 and set(got) == {p.value for p in Phase}
    row = {"engine": "fcdp_node", "rate_mbit": 100, "grad_accum": 1, "regime": "large", "step_time_s": 1.0,
           "compute_s": 0.3, "wire_s": 0.7, "timeline_s": {**dict.fromkeys(got, 0.0), "forward_gather": 0.4}}
    (bar, ) = timeline_plot.bars([row, {**row, "rate_mbit": 0}], 100)
    assert bar["limit"] == 0.7 and abs(bar["segments"]["other"] - 0.6) < 1e-12
