"""A link declared instead of probed: ``FCDP_LAB_LINK=slow`` (or ``fast``; ``slow,fast@3`` declares rank 3's
differently) replaces what each rank measures in ``fcdp_deepspeed.machine.link`` with the times a described link
would give (``paths.modeled_times``). The agreement over the ranks and the choice still run.

[Note: why the suite declares its link] The suite runs every "node" on one host's loopback, where the inter-node
link is as fast as the node's own: a probe there rightly chooses ZeRO-3's paths, and the suite's subject is FCDP's.
So ``tests/conftest.py`` declares a 100 Mbit/s link for every process it starts; the tests of the probe itself
(``tests/test_link.py``) clear it, on loopback and on the emulated cluster's shaped links.
"""
from __future__ import annotations

import os

ENV = "FCDP_LAB_LINK"
#: Bytes per second across nodes and inside a node, and one ring step's latency, of each declared link: the emulated
#: cluster's rates at 100 Mbit/s and 20 Gbit/s (gloo moves about 4 Gbit/s per rank inside a node there), with a
#: latency small enough that the suite's tiny models see the link's rate, not its latency.
LINKS = {"slow": (100e6 / 8, 4e9 / 8, 1e-5), "fast": (20e9 / 8, 4e9 / 8, 1e-5)}


def declared_for(value: str, rank: int) -> str:
    """The link ``value`` declares for ``rank``: its first word, unless a ``link@rank`` names this rank."""
    words = [w.strip() for w in value.split(",") if w.strip()]
    chosen = words[0] if words else ""
    for word in words[1:]:
        name, _, at = word.partition("@")
        if at and int(at) == rank:
            chosen = name
    if chosen not in LINKS:
        raise ValueError(f"{ENV}={value!r}: {chosen!r} is not one of {sorted(LINKS)}")
    return chosen


def install() -> None:
    """Replace each rank's measurement when ``FCDP_LAB_LINK`` is set; nothing otherwise."""
    value = os.environ.get(ENV, "")
    if not value:
        return
    from deepspeed import comm as dist
    from fcdp_deepspeed import paths
    from fcdp_deepspeed.machine import link

    def time_locally(topo, dp_group, nbytes):
        name = declared_for(value, dist.get_rank())
        inter, intra, latency = LINKS[name]
        times = paths.modeled_times(nbytes, topo.num_nodes, topo.ranks_per_node, inter, intra, latency)
        return paths.FetchTimes(nbytes, times.flat_s, times.two_stage_s, times.node_s,
                                source=f"declared by the lab, {ENV}={value}")
    declared_for(value, 0)  # a bad value fails here, at start
    link.time_locally = time_locally
