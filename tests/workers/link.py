"""Workers of test_link.py: the paths an engine chooses from its links (``fcdp.link``)."""
from __future__ import annotations

from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import LogCapture, setup

#: The defaults: every path key ``auto``, so ``fcdp.link`` decides.
DEFAULTS = {"enabled": True, "ranks_per_node": 2}


def choice_only(ranks_per_node: int = 2, nbytes: int = 1 << 16) -> dict:
    """Build the layout and choose, nothing else: what each rank chose from which times."""
    from fcdp_deepspeed.config import FCDPConfig
    from fcdp_deepspeed.machine.link import choose_paths
    from fcdp_deepspeed.machine.topology import build_topology
    setup(ranks_per_node)
    topo = build_topology(None, ranks_per_node)
    choice = choose_paths(FCDPConfig(enabled=True, ranks_per_node=ranks_per_node), topo, None, nbytes)
    return {"rank": dist.get_rank(), **choice.stats()}


def job_vote(ranks_per_node: int = 2, nbytes: int = 1 << 20) -> dict:
    """Two data-parallel groups of four (tensor parallelism's layout: ranks 0-3 and 4-7), each spanning two nodes:
    each group probes, then the job votes ([Note: one choice per job])."""
    from fcdp_deepspeed.config import FCDPConfig
    from fcdp_deepspeed.machine import link
    from fcdp_deepspeed.machine.topology import build_topology
    setup(ranks_per_node)
    groups = [dist.new_group(list(range(0, 4))), dist.new_group(list(range(4, 8)))]
    mine = groups[dist.get_rank() // 4]
    topo = build_topology(mine, ranks_per_node)
    local = link.choose_paths(FCDPConfig(enabled=True, ranks_per_node=ranks_per_node), topo, mine, nbytes)
    return {"rank": dist.get_rank(), "local": local.paths.value, **link.vote(local, topo).stats()}


def train_defaults(steps: int = 3, link: str | None = None, regime: str = "large") -> dict:
    """Plain ZeRO-3 and FCDP with the defaults (``fcdp.link`` ``link``, or the probe), one after the other."""
    setup()
    out: dict = {}
    for name in ("plain", "fcdp"):
        block = {**DEFAULTS, **({"link": link} if link else {})} if name == "fcdp" else None
        logs = LogCapture()
        engine = toy.build_engine(toy.ds_config(block, regime=regime))
        res = toy.train(engine, steps)
        weights = toy.gather_weights(engine)
        stats = fcdp_deepspeed.get_stats(engine) if name == "fcdp" else {}
        out[name] = {"losses": res.losses, "weights": weights if dist.get_rank() == 0 else {}, "stats": stats,
                     "log": logs.fcdp("fcdp: ON")}
    return out
