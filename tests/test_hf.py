"""Hugging Face Trainer and accelerate with the fcdp block: tiny config-built Llama, 4 CPU ranks
(2 simulated nodes x 2), full fine-tune and PEFT LoRA, against plain ZeRO-3."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from conftest import run_ranks  # noqa: E402
from workers.common import ZERO3_GRADS  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
LORA_CFG = os.path.join(CONFIGS, "hf_lora_fcdp.json")
FULL_CFG = os.path.join(CONFIGS, "hf_full_fcdp.json")


def _pair(runner: str, use_peft: bool, cfg: str, steps: int = 4):
    kw = dict(steps=steps, ranks_per_node=2, runner=runner, use_peft=use_peft, ds_config=cfg)
    return (run_ranks("hf:hf_run", 4, timeout=600, fcdp=False, **kw),
            run_ranks("hf:hf_run", 4, timeout=600, fcdp=True, fcdp_extra=ZERO3_GRADS, **kw))


def _per_step(rec):
    s = rec["step_stats"]
    return [b["inter_node_allgather_bytes"] - a["inter_node_allgather_bytes"] for a, b in zip(s, s[1:])]


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["trainer", "accelerate"])
def test_peft_lora_matches_zero3_with_99pct_less_inter_node_traffic(runner):
    plain, fcdp = _pair(runner, True, LORA_CFG)
    for p, f in zip(plain, fcdp):
        assert f["optimizer_class"] == "FCDPStage3" and f["stats"]["cache_hits"] > 0
        assert f["losses"] == p["losses"]
        saved = 1 - sum(_per_step(f)) / sum(_per_step(p))
        assert saved > 0.99, (_per_step(p), _per_step(f))


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["trainer", "accelerate"])
def test_full_finetune_matches_zero3_with_half_the_inter_node_traffic(runner):
    plain, fcdp = _pair(runner, False, FULL_CFG)
    for p, f in zip(plain, fcdp):
        assert f["losses"] == p["losses"]
        assert f["stats"]["uncached_params"] == 0
        for pb, fb in zip(_per_step(p), _per_step(f)):
            assert fb <= 0.55 * pb


@pytest.mark.slow
def test_trainer_with_node_gradient_accumulation_matches_zero3():
    """HF Trainer, full fine-tune, GA 2, ``grad_accumulation: node``: the gradient plan is active, losses
    match ZeRO-3 within the gradient modes' tolerance, and each optimizer step crosses nodes with
    gradients once instead of twice."""
    kw = dict(steps=3, ranks_per_node=2, runner="trainer", use_peft=False, ds_config=FULL_CFG, grad_accum=2)
    plain = run_ranks("hf:hf_run", 4, timeout=600, fcdp=False, **kw)
    node = run_ranks("hf:hf_run", 4, timeout=600, fcdp=True, fcdp_extra={"grad_accumulation": "node"}, **kw)
    for p, n in zip(plain, node):
        assert n["optimizer_class"] == "FCDPStage3" and n["stats"]["grad_accumulated"] > 0
        assert len(n["losses"]) == len(p["losses"]) == 6
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(n["losses"], p["losses"])), (n["losses"], p["losses"])
        assert n["stats"]["inter_node_grad_reduce_bytes"] < 0.2 * p["stats"]["inter_node_grad_reduce_bytes"]


def test_trainer_logs_fcdp_counters_and_refuses_stage2():
    """With only the block in the Trainer's DeepSpeed config (no install(), no launch change): the stats
    callback is added first, so reporters see fcdp/* in every log; FCDP's own log line (shown with the
    Trainer's log_level="info") and csv monitor rows follow fcdp.log_interval although accelerate sets
    steps_per_print to infinity; no block or
    FCDP_HF_CALLBACK=0: no callback; ZeRO stage 2: refused when the Trainer builds the engine."""
    for rank, r in enumerate(run_ranks("hf:trainer_stats_runs", 4, timeout=600, ds_config=FULL_CFG)):
        assert r["installed"]
        on = r["enabled"]
        assert on["callbacks"][0] == "FCDPStatsCallback", on["callbacks"]
        train_logs = [s for s in on["seen"] if "loss" in s]
        assert len(train_logs) == 4 and all("fcdp/inter_node_allgather_bytes" in s for s in on["seen"])
        inter = [s["fcdp/inter_node_allgather_bytes"] for s in train_logs]
        assert inter == sorted(inter) and inter[0] > 0 and inter[-1] == on["stats"]["inter_node_allgather_bytes"]
        assert all(0 < s["fcdp/cache_hit_rate"] <= 1 for s in train_logs)
        # a full fine-tune's step invalidates every slice: nothing is valid when the Trainer logs, but the
        # slots stay allocated (fcdp/*_slot_bytes, what the cache takes; cache_device auto moves them after step 2)
        assert all(s["fcdp/host_cache_bytes"] == s["fcdp/device_cache_bytes"] == 0 for s in train_logs)
        assert all(s["fcdp/host_slot_bytes"] + s["fcdp/device_slot_bytes"] > 0 for s in train_logs)
        assert all(s["fcdp/inter_node_grad_reduce_bytes"] > 0 for s in train_logs)
        assert [h["fcdp/inter_node_allgather_bytes"] for h in on["history"] if "loss" in h] == inter
        assert on["steps_per_print"] == float("inf")  # accelerate's setting
        if rank == 0:
            assert [line.split(":")[0] for line in on["fcdp_lines"]] == ["[fcdp] step 2", "[fcdp] step 4"], on["fcdp_lines"]
            assert [row.split(",")[0] for row in on["monitor_csv"]] == ["step", "2", "4"], on["monitor_csv"]
        for name in ("plain", "opt_out"):
            assert "FCDPStatsCallback" not in r[name]["callbacks"]
            assert not any(k.startswith("fcdp/") for s in r[name]["seen"] for k in s)
        assert r["opt_out"]["stats"]["cache_hits"] > 0  # opting out of the callback keeps FCDP
        assert r["stage2"]["error"].startswith("FCDPConfigError: fcdp requires ZeRO stage 3"), r["stage2"]
        assert "got stage 2" in r["stage2"]["error"]
