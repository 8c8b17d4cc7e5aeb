"""Which data paths a job's links call for: FCDP's (the node cache, the two-stage gather and gradient reduce,
node accumulation) or ZeRO-3's (every gather and reduce over the whole data-parallel group, nothing cached).

Standard library only: the engine feeds :func:`choose` the times it measured on its own groups at build
(``machine/link.py``), ``fcdp plan`` the times :func:`modeled_times` derives from the cluster a user describes,
so both make the same choice from the same arithmetic.

[Note: why a choice at all]
FCDP trades inter-node bytes for collectives: a miss is two collectives (among node peers, then inside the
node) where ZeRO-3 issues one, a hit is one collective inside the node plus the cache's host bookkeeping, and
each gradient bucket is reduced in two stages. Where the inter-node link is the bottleneck the bytes win by far
(a 100 Mbit/s link: 3x the step of the bound under ZeRO-3); where it is about as fast as the links inside a node
there are no bytes worth saving, and the extra collectives and bookkeeping are all that is left (a 20 Gbit/s
emulated link: 1.42x ZeRO-3's step in DeepSpeed's default settings, ``docs/benchmarks.md``). So with every path
key left ``auto``, the engine times one fetch of the model's mean module size each way on its real groups and
runs the paths whose step costs less, agreeing on every rank. Two conditions, both measured: FCDP's collectives per
fetch must win by :data:`MARGIN` (its host work is not in them), and a fetch across nodes must take :data:`SLOWER` times
one inside a node (the probe's noise cannot flip a fast link's choice).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

#: FCDP's paths must win by this factor on the measured collectives: their host work (cache bookkeeping, the
#: second stage's issue) is not in the probe's times. On the emulated 2 x 2 (``docs/benchmarks.md``) the probe's
#: collectives favoured FCDP's paths by 0.6-1.5x at 20 Gbit/s, where its step is slower than ZeRO-3's, and by
#: 1.65-2.3x at 100 Mbit/s; on a link that is all bandwidth the factor is 3(W-1)/W against 2(N-1)/N, which stays above 1.5 for
#: any number of nodes.
MARGIN = 1.4
#: And a fetch across nodes must take this many times a fetch inside one: the rule's ratio alone moves with the
#: probe's noise where the two are close (on the emulated 2 x 2 at 20 Gbit/s it read 0.6-1.5 between runs of one
#: job), while a link worth FCDP's paths is slower by far (100 Mbit/s: 25-35x; a fast one: 1.4-2.8x).
SLOWER = 4.0
#: Largest message the probe sends (the times at a larger fetch are extrapolated from two sizes): bounds the
#: probe's six rounds at about 7 s on a 10 Mbit/s link, 0.7 s at 100 Mbit/s.
PROBE_MAX_BYTES = 1 << 20


#: The block's keys that choose FCDP's paths when set away from these defaults (``fcdp.link`` then decides nothing).
PATH_KEYS = {"param_gather": "auto", "grad_reduce": "auto", "grad_accumulation": "auto", "param_compression": "off",
             "grad_compression": "off"}


def paths_asked(block: Mapping[str, Any]) -> bool:
    """Whether ``block`` (an ``fcdp`` block, or its parsed fields) sets a key that chooses FCDP's paths."""
    return any(block.get(key, default) != default for key, default in PATH_KEYS.items())


class Paths(str, enum.Enum):
    FCDP = "fcdp"
    ZERO3 = "zero3"


@dataclass(frozen=True)
class FetchTimes:
    """Seconds one fetch of ``nbytes`` (full parameter bytes) takes each way on a job's groups."""

    nbytes: int
    flat_s: float
    """ZeRO-3's all-gather over the data-parallel group."""
    two_stage_s: float
    """FCDP's miss: an all-gather among node peers, then one inside the node."""
    node_s: float
    """FCDP's hit: an all-gather inside the node only."""
    source: str = "measured"

    @property
    def zero3_s(self) -> float:
        """A step's collectives per fetch under ZeRO-3: a gather in forward and in backward, a reduce."""
        return 3 * self.flat_s

    @property
    def fcdp_s(self) -> float:
        """The same under FCDP: a miss in forward, a hit in backward, a two-stage reduce."""
        return 2 * self.two_stage_s + self.node_s

    def describe(self) -> str:
        return (f"a {_size(self.nbytes)} fetch takes {_ms(self.flat_s)} flat, {_ms(self.two_stage_s)} in two stages, "
                f"{_ms(self.node_s)} inside the node ({self.source})")


@dataclass(frozen=True)
class PathChoice:
    """The paths an engine runs and why; the "on" line and ``get_stats`` say both."""

    paths: Paths
    why: str
    times: FetchTimes | None = None

    def stats(self) -> dict:
        out: dict = {"paths": self.paths.value, "paths_why": self.why}
        if self.paths is Paths.ZERO3:  # DeepSpeed's own engine: its gather and gradient path
            out.update(param_gather="flat", grad_reduce="flat", grad_accumulation="rank")
        if self.times is not None:
            out.update(link_fetch_bytes=self.times.nbytes, link_flat_s=self.times.flat_s,
                       link_two_stage_s=self.times.two_stage_s, link_node_s=self.times.node_s,
                       link_source=self.times.source)
        return out


def choose(times: FetchTimes) -> PathChoice:
    """FCDP's paths where their collectives per fetch cost less than ZeRO-3's by :data:`MARGIN` and a fetch across
    nodes takes :data:`SLOWER` times one inside a node, else ZeRO-3's."""
    zero3, fcdp = times.zero3_s, times.fcdp_s
    if fcdp * MARGIN < zero3 and times.flat_s >= SLOWER * times.node_s:
        return PathChoice(Paths.FCDP, f"the inter-node link is the bottleneck: {times.describe()}, so a step's "
                                      f"collectives take {_ms(fcdp)} per fetch on FCDP's paths against {_ms(zero3)}",
                          times)
    return PathChoice(Paths.ZERO3, f"the inter-node link is fast: {times.describe()}, so FCDP's paths would save "
                                   f"nothing worth their extra collectives ({_ms(fcdp)} per fetch against "
                                   f"{_ms(zero3)} on ZeRO-3's); set fcdp.link to \"slow\" to run them anyway", times)


def declared(link: str) -> PathChoice:
    """The choice a config declares with ``fcdp.link`` ``slow`` or ``fast`` (no probe)."""
    if link == "fast":
        return PathChoice(Paths.ZERO3, "fcdp.link is \"fast\": ZeRO-3's paths, nothing cached")
    return PathChoice(Paths.FCDP, "fcdp.link is \"slow\"")


def fit(small: tuple[int, float], large: tuple[int, float], nbytes: int) -> float:
    """Seconds at ``nbytes`` from two timed sizes ``(bytes, seconds)``: latency plus bytes over rate, both >= 0."""
    (b0, t0), (b1, t1) = small, large
    per_byte = max(0.0, (t1 - t0) / (b1 - b0)) if b1 > b0 else 0.0
    latency = max(0.0, t1 - per_byte * b1)
    return latency + per_byte * nbytes


def modeled_times(nbytes: int, nodes: int, ranks_per_node: int, inter_bytes_per_s: float,
                  intra_bytes_per_s: float, latency_s: float) -> FetchTimes:
    """What a probe would measure on a described cluster (``inter_bytes_per_s`` per node uplink), with ring
    all-gathers: a ring over G ranks takes G-1 steps of ``latency_s`` each. ZeRO-3's ring carries (W-1)/W of the fetch
    over every node uplink, stage 1 (N-1)/N of it (the node's L ranks share the uplink, each sending its shard to N-1
    peers), a node's all-gather (L-1)/L per rank inside the node."""
    world = nodes * ranks_per_node
    flat = (world - 1) * latency_s + (world - 1) / world * nbytes / inter_bytes_per_s
    stage1 = (nodes - 1) * latency_s + (nodes - 1) / nodes * nbytes / inter_bytes_per_s
    node = (ranks_per_node - 1) * latency_s + (ranks_per_node - 1) / ranks_per_node * nbytes / intra_bytes_per_s
    return FetchTimes(nbytes, flat, stage1 + node, node, source="modeled")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"
