"""PEFT (frozen base + trainable adapters): frozen slices stay cached across optimizer steps, so
after the first step only the adapters cross nodes."""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks


def per_step(run, key="inter_node_allgather_bytes"):
    s = run.step_stats
    return [s[0][key]] + [b[key] - a[key] for a, b in zip(s, s[1:])]


def forward_phase_bytes(run, key="inter_node_allgather_bytes"):
    """Bytes added by each micro-step's forward (the stats before it are the previous backward's,
    or the previous step's after its optimizer step; the first forward has no baseline)."""
    phases = run.extra["phases"]
    out = []
    for i, (_, name, stats) in enumerate(phases):
        if name == "forward" and i >= 2:
            out.append(stats[key] - phases[i - 1][2][key])
    return out


@pytest.fixture(scope="module")
def lora():
    return run_ranks("peft:peft_traffic", 4, steps=4, grad_accum=1)


@pytest.fixture(scope="module")
def lora_ga4():
    return run_ranks("peft:peft_traffic", 4, steps=3, grad_accum=4)


def test_lora_losses_and_adapters_identical(lora, lora_ga4):
    for res in (lora, lora_ga4):
        for r in res:
            assert r["fcdp"].losses == r["plain"].losses
        plain_w, fcdp_w = res[0]["plain"].weights, res[0]["fcdp"].weights
        assert plain_w and all(torch.equal(plain_w[k], fcdp_w[k]) for k in plain_w)


def test_lora_inter_node_traffic_below_one_percent_after_step_one(lora):
    for r in lora:
        plain, fcdp = per_step(r["plain"]), per_step(r["fcdp"])
        for p, f in zip(plain[1:], fcdp[1:]):
            assert 0 < f < 0.01 * p, (plain, fcdp)


def test_only_trainable_gradients_are_reduce_scattered(lora):
    for r in lora:
        plain = r["plain"].stats["inter_node_reduce_scatter_bytes"]
        fcdp = r["fcdp"].stats["inter_node_reduce_scatter_bytes"]
        trainable_bytes = r["fcdp"].extra["trainable_numel"] * 4
        assert plain == fcdp and 0 < fcdp <= 4 * trainable_bytes  # 4 steps, ring: (W-1)/W of the grads


def test_grad_accumulation_forward_crosses_nodes_once_per_step(lora_ga4):
    for r in lora_ga4:
        fcdp = forward_phase_bytes(r["fcdp"])  # micro-steps 1..11
        crossing = [i + 1 for i, b in enumerate(fcdp) if b > 0]
        assert crossing == [4, 8], fcdp  # first micro-step of optimizer steps 2 and 3
        plain = forward_phase_bytes(r["plain"])
        assert all(b > 0 for b in plain)
        assert max(fcdp) < 0.01 * min(plain)


def test_eval_between_steps_hits_the_cache(lora):
    for r in lora:
        plain, fcdp = r["plain"].extra["evals"], r["fcdp"].extra["evals"]
        assert torch.equal(plain[0]["output"], fcdp[0]["output"])
        # first eval after a step: only the adapters changed, so only they cross nodes
        assert 0 < fcdp[0]["inter"] < 0.01 * plain[0]["inter"]
        assert fcdp[1]["inter"] == 0 and plain[1]["inter"] == plain[0]["inter"] > 0
