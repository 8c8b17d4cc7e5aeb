"""Workers of test_grad_overlap.py: the gradient's inter-node stage issued per bucket and delivered later
(``grads/inflight.py``), against the synchronous path and plain ZeRO-3, correct and broken."""
from __future__ import annotations

import time

from deepspeed import comm as dist

from fcdp_deepspeed.grads import collectives
from fcdp_lab.sabotage import applied
from workers import grads as grad_workers
from workers.common import setup

#: The synchronous path (before issue 31's backward overlap): every stage completes where it is issued, DeepSpeed's
#: bucket size.
SYNC = {"grad_inflight_buckets": 0, "grad_bucket_size": 0}
#: Small buckets (the toy has ~4.3K trainable elements: about 17 buckets) and two in flight: later buckets complete
#: the oldest, the epilogue the rest.
OVERLAP = {"grad_inflight_buckets": 2, "grad_bucket_size": 256}
NODE = {"grad_accumulation": "node"}
RANK = {"grad_reduce": "hierarchical", "grad_accumulation": "rank"}
FLAT = {"grad_reduce": "flat", "grad_accumulation": "rank"}
INT8 = {"grad_accumulation": "node", "grad_compression": "int8"}


def _issue_timer() -> list[float]:
    """Seconds each ``issue_inter_node`` call (the exact inter-node collective's issue) held this rank's host."""
    seconds: list[float] = []
    original = collectives.StageCollectives.issue_inter_node

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    collectives.StageCollectives.issue_inter_node = timed
    return seconds


def _run(sc: dict, block: dict | None, broken: str = "") -> dict:
    """One engine's run; ``broken``: a variant of ``fcdp_lab/sabotage/grads.py`` (``read_early``) while it runs."""
    with applied(f"grads.{broken}" if broken else ""):
        full = {"enabled": True, "ranks_per_node": 2, **block} if block is not None else None
        engine = grad_workers.build(sc, grad_workers._config(sc, full))
        res = grad_workers.train(engine, sc)
    weights = {n: p.ds_tensor.detach().clone() for n, p in engine.module.named_parameters()}
    workspace = [{k: v for k, v in step.items() if k.startswith("grad_workspace")} for step in res.step_stats]
    return {"losses": res.losses, "weights": weights, "stats": res.stats, "workspace": workspace,
            "bucket": int(engine.optimizer.reduce_bucket_size)}


def variants(scenarios: list[dict], delay_s: float = 0.05) -> dict:
    """Per scenario: plain ZeRO-3, FCDP's synchronous path and the overlapped one for each gradient mode, and the
    broken variants; rank 2 issues every inter-node stage ``delay_s`` late (skew: a read before completion shows)."""
    setup()
    with applied(f"grads.delay@2={delay_s}"):
        return _variants(scenarios)


def _variants(scenarios: list[dict]) -> dict:
    out: dict = {}
    for sc in scenarios:
        runs = {"plain": _run(sc, None), "flat": _run(sc, {**FLAT, **OVERLAP})}
        for mode, block in (("node", NODE), ("rank", RANK), ("int8", INT8)):
            if mode in sc.get("modes", ("node", "rank")):
                runs[f"{mode}_sync"] = _run(sc, {**block, **SYNC})
                runs[f"{mode}_overlap"] = _run(sc, {**block, **OVERLAP})
        for broken in sc.get("breaks", ()):
            runs[f"broken_{broken}"] = _run(sc, {**NODE, **OVERLAP}, broken)
        out[sc["name"]] = runs
    return out


def issue_does_not_wait(delay_s: float = 0.3) -> dict:
    """GA 1 under node accumulation: rank 2 issues ``delay_s`` late; how long each inter-node issue held the host
    (gloo ``async_op=True``: not the transfer), and how long the completions waited for it."""
    setup()
    seconds = _issue_timer()
    sc = {"name": "ga1", "steps": 2}
    with applied(f"grads.delay@2={delay_s}"):
        run = _run(sc, {**NODE, **OVERLAP, "grad_bucket_size": 1024})  # about 5 buckets
    return {"issue_s": seconds, "inter_node_s": run["stats"]["timeline_grad_inter_node_s"],
            "inflight_max": run["stats"]["grad_inflight_max"], "rank": dist.get_rank()}
