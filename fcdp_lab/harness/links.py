"""Millisecond samples of every emulated node uplink beside a run, and what they say about one step.

[Note: link samples] A step's ratio to ``max(compute, wire)`` says how far it is from its limit, not where the
link sat idle. A :class:`LinkSampler` reads the kernel's byte counters of every node's uplink about once a
millisecond while a run goes on: one ``sleep`` process inside the cluster's switch namespace, whose
``/proc/<pid>/net/dev`` lists the switch end of every uplink (its ``rx`` is the node's egress, its ``tx`` the
node's ingress, both after ``tc``), so one read gives every node at one instant. :func:`link_use` then cuts
one step out of the samples (the bench's last-step trace carries ``origin_unix_s``, [Note: the trace] in
``reporting/timeline.py``): per node and direction the bytes, the share of the step the shaped rate needed for
them, and the spans in which the link carried less than 5% of its rate. The counters move in bursts of a few
milliseconds under ``tbf``, so only such spans longer than ``idle_min_s`` (10 ms) count as idle. The sampler is a thread of the bench's driver
process, not of a rank; it costs that process about 6% of a core (measured beside a bench: ~780 samples a
second), so it is opt-in
(``python -m fcdp_lab bench --sample-links``).
"""
from __future__ import annotations

import bisect
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

#: Gaps shorter than this are ``tbf``'s bursts, not idle (see [Note: link samples]).
IDLE_MIN_S = 0.010
#: Between two samples a link carrying less than this share of its rate is idle.
IDLE_SHARE = 0.05


@dataclass
class LinkSampler:
    """Samples ``(unix time, node egress bytes per node, node ingress bytes per node)`` into :attr:`samples`
    while active (a context manager around one run on ``cluster``)."""

    cluster: Any
    period_s: float = 0.001
    samples: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: Optional[threading.Thread] = field(default=None, repr=False)
    _sleeper: Optional[subprocess.Popen] = field(default=None, repr=False)

    def __enter__(self) -> "LinkSampler":
        self._sleeper = subprocess.Popen(["ip", "netns", "exec", self.cluster.switch, "sleep", "86400"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._thread = threading.Thread(target=self._run, name="fcdp-link-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sleeper is not None:
            self._sleeper.kill()
            self._sleeper.wait(timeout=5)

    def _ends(self) -> list[str]:
        """The switch ends of the node uplinks, in node order (``cluster.py`` names them ``{prefix}b{i}``)."""
        return [f"{self.cluster.prefix}b{i}" for i in range(self.cluster.nodes)]

    def _run(self) -> None:
        ends, path = self._ends(), f"/proc/{self._sleeper.pid}/net/dev"
        deadline = time.time() + 5
        while not self._stop.is_set():
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:  # not yet inside the namespace, or gone
                if time.time() > deadline:
                    return
                time.sleep(0.01)
                continue
            now = time.time()
            rows = parse_net_dev(text)
            if all(end in rows for end in ends):
                self.samples.append((now, [rows[e][0] for e in ends], [rows[e][1] for e in ends]))
            time.sleep(self.period_s)


def parse_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """``/proc/net/dev`` -> ``{interface: (rx_bytes, tx_bytes)}``."""
    out = {}
    for line in text.splitlines()[2:]:
        name, _, rest = line.partition(":")
        values = rest.split()
        if len(values) >= 9:
            out[name.strip()] = (int(values[0]), int(values[8]))
    return out


def _series(samples: Sequence, column: int, node: int) -> tuple[list[float], list[int]]:
    return [s[0] for s in samples], [s[column][node] for s in samples]


def _at(ts: list[float], vs: list[int], t: float) -> float:
    """The counter at ``t``, linearly between the two samples around it (clamped at the ends)."""
    i = bisect.bisect_left(ts, t)
    if i <= 0:
        return float(vs[0])
    if i >= len(ts):
        return float(vs[-1])
    t0, t1 = ts[i - 1], ts[i]
    return vs[i - 1] + (vs[i] - vs[i - 1]) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)


def idle_spans(ts: list[float], vs: list[int], t0: float, t1: float, rate_bytes_s: float,
               idle_min_s: float = IDLE_MIN_S) -> list[list[float]]:
    """Spans inside ``[t0, t1]`` (unix seconds) longer than ``idle_min_s`` in which the link carried less than
    :data:`IDLE_SHARE` of its rate between every two samples (a stray ACK or ARP does not end an idle span)."""
    out: list[list[float]] = []
    for i in range(1, len(ts)):
        dt = ts[i] - ts[i - 1]
        if dt > 0 and vs[i] - vs[i - 1] < IDLE_SHARE * rate_bytes_s * dt:
            if out and out[-1][1] == ts[i - 1]:
                out[-1][1] = ts[i]
            else:
                out.append([ts[i - 1], ts[i]])
    clipped = [[max(a, t0), min(b, t1)] for a, b in out]
    return [[a, b] for a, b in clipped if b - a > idle_min_s]


def link_use(samples: Sequence, t0: float, t1: float, rate_mbit: float,
             idle_min_s: float = IDLE_MIN_S) -> Optional[dict]:
    """What the uplinks did between unix times ``t0`` and ``t1`` (one step): per node and direction the bytes
    (frames, headers included: what ``tbf`` shapes), ``busy`` (the seconds the shaped rate needs for them) and
    ``idle_s`` (the sum of :func:`idle_spans`); ``busiest`` is the node direction with the most bytes,
    and ``floor_s`` its ``busy``: no step that moves these bytes can be shorter. ``None`` unless the samples
    cover the span (within 10 ms)."""
    slack = 0.01  # a sample period or ten: the counters' ends hold within it
    if len(samples) < 2 or samples[0][0] > t0 + slack or samples[-1][0] < t1 - slack or t1 <= t0:
        return None
    rate = rate_mbit * 1e6 / 8
    nodes = []
    for node in range(len(samples[0][1])):
        entry = {}
        for column, way in ((1, "tx"), (2, "rx")):
            ts, vs = _series(samples, column, node)
            moved = _at(ts, vs, t1) - _at(ts, vs, t0)
            spans = idle_spans(ts, vs, t0, t1, rate, idle_min_s)
            entry[way] = {"bytes": round(moved), "busy_s": round(moved / rate, 4),
                          "idle_s": round(sum(b - a for a, b in spans), 4),
                          "idle_spans": [[round(a - t0, 4), round(b - t0, 4)] for a, b in spans]}
        nodes.append(entry)
    node, way = max(((n, w) for n in range(len(nodes)) for w in ("tx", "rx")), key=lambda k: nodes[k[0]][k[1]]["bytes"])
    busiest = nodes[node][way]
    return {"step_s": round(t1 - t0, 4), "rate_mbit": rate_mbit, "nodes": nodes, "busiest": f"node {node} {way}",
            "floor_s": busiest["busy_s"], "busiest_idle_s": busiest["idle_s"],
            "busiest_utilisation": round(busiest["busy_s"] / (t1 - t0), 4)}


def step_window(trace: Sequence[dict]) -> Optional[tuple[float, float]]:
    """The unix times of the last traced step (every rank's ``train_step`` span, earliest start to latest end)
    of a bench record's ``trace_last_step``."""
    spans = [(r["origin_unix_s"] + a, r["origin_unix_s"] + b) for r in trace for n, a, b in r["spans"]
             if n == "train_step"]
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)
