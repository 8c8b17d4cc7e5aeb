"""The link sampler ([Note: link samples] in ``fcdp_lab/harness/links.py``): what it computes from counter samples, and
that on a real emulated cluster it sees which node sends, at the shaped rate, and a pause in the middle."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from fcdp_lab.bench.bench import BenchSpec, links_markdown
from fcdp_lab.harness.cluster import EmulatedCluster, namespaces_available
from fcdp_lab.harness.links import LinkSampler, idle_spans, link_use, parse_net_dev, step_window

OK, WHY = namespaces_available()
RATE = 10.0  # Mbit/s: 1.25 MB/s, so 0.3 s of sending is ~375 kB


def _samples(period: float, tx0: list[int], rx0: list[int]) -> list:
    return [(100.0 + i * period, [tx0[i]], [rx0[i]]) for i in range(len(tx0))]


def test_parse_net_dev():
    text = ("Inter-|   Receive |  Transmit\n face |bytes packets|bytes\n"
            "    lo:  10 1 0 0 0 0 0 0  20 2 0 0 0 0 0 0\n"
            "fcdp1xbb0: 1234 5 0 0 0 0 0 0 5678 9 0 0 0 0 0 0\n")
    assert parse_net_dev(text) == {"lo": (10, 20), "fcdp1xbb0": (1234, 5678)}


def test_idle_spans_need_more_than_the_shapers_bursts():
    ts = [i * 0.001 for i in range(100)]
    rate = 1000.0  # bytes per second: one byte per ms at full rate
    vs = [i if i < 30 else 30 if i < 60 else i - 30 for i in range(100)]  # flat from sample 30 to 60: 30 ms
    assert idle_spans(ts, vs, 0.0, 0.099, rate) == [[pytest.approx(0.030), pytest.approx(0.060)]]
    short = [i if i < 30 else 30 if i < 35 else i - 5 for i in range(100)]  # 5 ms: a burst, not idle
    assert idle_spans(ts, short, 0.0, 0.099, rate) == []
    assert idle_spans(ts, vs, 0.040, 0.099, rate) == [[0.040, pytest.approx(0.060)]]  # clipped to the window
    trickle = [v * 100 + (i if 30 <= i < 60 else 0) for i, v in enumerate(vs)]  # ACKs: 1% of the rate
    assert idle_spans(ts, trickle, 0.0, 0.099, rate * 100) == [[pytest.approx(0.030), pytest.approx(0.060)]]


def test_link_use_of_one_step():
    period = 0.001
    # node 0 sends 12500 bytes per ms (100 Mbit/s) except a 20 ms pause; it receives a tenth of that
    tx, rx, v, w = [], [], 0, 0
    for i in range(200):
        if not 50 <= i < 70:
            v += 12500
        w += 1250
        tx.append(v)
        rx.append(w)
    samples = _samples(period, tx, rx)
    use = link_use(samples, 100.0, 100.0 + 0.199, 100.0)
    assert use["busiest"] == "node 0 tx"
    assert use["nodes"][0]["tx"]["idle_spans"] == [[0.049, 0.069]]
    assert use["busiest_idle_s"] == pytest.approx(0.020, abs=1e-3)
    assert use["floor_s"] == pytest.approx(0.179, abs=2e-3)
    assert use["busiest_utilisation"] == pytest.approx(0.179 / 0.199, abs=0.01)
    assert use["nodes"][0]["rx"]["idle_s"] == 0
    assert link_use(samples, 99.0, 100.1, 100.0) is None  # the samples must cover the step


def test_step_window_and_the_table():
    trace = [{"rank": 0, "origin_unix_s": 50.0, "spans": [["forward", 0.0, 0.5], ["train_step", 0.0, 0.9]]},
             {"rank": 1, "origin_unix_s": 50.0, "spans": [["train_step", 0.01, 0.95]]}]
    assert step_window(trace) == (50.0, 50.95)
    assert step_window([]) is None
    row = {"rate_mbit": 100.0, "job": "full", "grad_accum": 1, "engine": "fcdp_node", "nodes": 2, "world": 4,
           "links_last_step": {"step_s": 0.95, "busiest": "node 1 tx", "floor_s": 0.843, "busiest_utilisation": 0.887,
                               "busiest_idle_s": 0.011, "nodes": [{}, {"tx": {"idle_spans": [[0.45, 0.461]]}}]}}
    table = links_markdown([row, {"rate_mbit": 0.0, "links_last_step": None}])
    assert "| node 1 tx | 0.843 | 0.89 | 0.011 | 0.450-0.461 |" in table
    assert links_markdown([{"rate_mbit": 0.0}]) == ""
    assert "sample_links" in BenchSpec.DRIVER_ONLY  # an older checkout's BenchSpec does not know it


PHASE_BYTES = 375_000  # 0.3 s at RATE
SENDER = f"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], 29611))
for i in range(2):
    if i:
        time.sleep(0.3)
    s.sendall(b"x" * {PHASE_BYTES})
    assert s.recv(1) == b"k"  # the receiver has it all: nothing of this phase is left in a queue
s.close()
"""
RECEIVER = f"""
import socket
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 29611)); srv.listen(1); print("ready", flush=True)
c, _ = srv.accept()
for _ in range(2):
    left = {PHASE_BYTES}
    while left:
        left -= len(c.recv(min(left, 1 << 20)))
    c.sendall(b"k")
"""


@pytest.mark.netns
@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
@pytest.mark.timeout(60)
def test_the_sampler_sees_the_sender_its_rate_and_its_pause():
    """Node 0 sends node 1 0.3 s of bytes, waits until they arrived, pauses 0.3 s, sends 0.3 s more, on 10 Mbit/s uplinks: the busiest
    direction is node 0's egress (node 1's ingress carries the same bytes), it ran at about the shaped rate
    while busy, and the pause is one idle span of about 0.3 s. Swapping the counters' columns, or reading the
    wrong interfaces, fails this."""
    with EmulatedCluster(2, rate_mbit=RATE, tag="l") as cluster:
        receiver = cluster.popen(1, [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "ready"
            with LinkSampler(cluster) as sampler:
                time.sleep(0.2)
                t0 = time.time()
                sender = cluster.popen(0, [sys.executable, "-c", SENDER, cluster.address(1)])
                sender.wait(timeout=20)
                time.sleep(0.3)  # the shaper's queue drains
                t1 = time.time()
        finally:
            receiver.kill()
            receiver.wait(timeout=10)
    use = link_use(sampler.samples, t0, t1, RATE)
    assert use is not None and len(sampler.samples) > 200
    node0, node1 = use["nodes"]
    assert use["busiest"] in ("node 0 tx", "node 1 rx")
    assert node0["tx"]["bytes"] > 20 * node0["rx"]["bytes"]  # the other way: ACKs only
    assert node1["rx"]["bytes"] == pytest.approx(node0["tx"]["bytes"], rel=0.02)
    assert 0.55 < use["floor_s"] < 0.75  # 2 x 375 kB at 1.25 MB/s, plus the frames' headers
    pauses = [b - a for a, b in node0["tx"]["idle_spans"] if b - a > 0.1]
    assert len(pauses) >= 1 and any(0.15 < p < 0.45 for p in pauses), node0["tx"]["idle_spans"]
