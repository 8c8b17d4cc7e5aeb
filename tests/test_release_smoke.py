"""The DeepSpeed release smoke subset (scripts/check_deepspeed_release.sh runs this file on each
supported release; the main suite runs it on the shared venv's release). One 2 nodes x 2 process
group: FCDP vs plain ZeRO-3 bit-identical for full fine-tuning and LoRA with the inter-node gather
bytes counted, the gradient modes within 1e-5, config refusals, and the startup hook."""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed import ds_compat
from fcdp_deepspeed_autoload import TESTED_DEEPSPEED_VERSIONS

RTOL = 1e-5


@pytest.fixture(scope="module")
def smoke():
    return run_ranks("release_smoke:smoke", 4, timeout=600)


def step_deltas(run, key: str) -> list[int]:
    s = run.step_stats
    return [s[0][key]] + [b[key] - a[key] for a, b in zip(s, s[1:])]


def test_release_is_listed_and_its_internals_are_present(smoke):
    assert smoke[0]["deepspeed"].split("+")[0] in TESTED_DEEPSPEED_VERSIONS
    assert ds_compat.missing_internals() == []


def test_startup_hook_builds_fcdp_from_the_config_key_alone(smoke):
    for r in smoke:
        assert r["hook"] == {"installed": True, "optimizer": "FCDPStage3"}, r["hook"]


@pytest.mark.parametrize("name", ["full", "lora"])
def test_cache_bit_identical_and_inter_node_gathers_cut(smoke, name):
    for r in smoke:
        plain, fcdp = r["cache"][name]["plain"], r["cache"][name]["fcdp"]
        assert fcdp.extra["optimizer_class"] == "FCDPStage3"
        assert fcdp.losses == plain.losses, (plain.losses, fcdp.losses)
        assert fcdp.stats["cache_hits"] > 0 and fcdp.stats["uncached_params"] == 0
        p, f = (step_deltas(run, "inter_node_allgather_bytes") for run in (plain, fcdp))
        bound = 0.55 if name == "full" else 0.05  # LoRA: only the adapters cross nodes after step 1
        assert all(0 < fb <= bound * pb for pb, fb in zip(p[1:], f[1:])), (p, f)
    plain_w, fcdp_w = smoke[0]["cache"][name]["plain"].weights, smoke[0]["cache"][name]["fcdp"].weights
    assert plain_w and all(torch.equal(plain_w[k], fcdp_w[k]) for k in plain_w)


@pytest.mark.parametrize("name", ["hier_ga2", "node_ga4", "lora_node_ga2"])
def test_gradient_modes_within_1e5(smoke, name):
    for r in smoke:
        plain, fcdp = r["grads"][name]["plain"], r["grads"][name]["fcdp"]
        assert fcdp.extra["optimizer_class"] == "FCDPStage3" and fcdp.stats["grad_delivered"] > 0
        assert len(fcdp.losses) == len(plain.losses) > 0
        for a, b in zip(plain.losses, fcdp.losses):
            assert abs(a - b) <= RTOL * abs(a), (plain.losses, fcdp.losses)
        for key, w in plain.weights.items():
            assert (fcdp.weights[key] - w).norm().item() <= RTOL * max(w.norm().item(), 1e-12), key
    node = smoke[0]["grads"]["node_ga4"]
    # node accumulation: each step's gradients cross nodes once (ZeRO-3: 4 full reductions per step)
    assert node["fcdp"].stats["grad_accumulated"] > 0
    p, f = (step_deltas(node[mode], "inter_node_grad_reduce_bytes") for mode in ("plain", "fcdp"))
    assert all(0 < fb <= 0.1 * pb for pb, fb in zip(p, f)), (p, f)


def test_config_refusals(smoke):
    tree, no_reduce_scatter = smoke[0]["refusals"]
    assert tree.startswith("FCDPConfigError") and "fcdp.grad_reduce = 'tree'" in tree, tree
    assert no_reduce_scatter.startswith("FCDPConfigError") and "reduce_scatter = false" in no_reduce_scatter, \
        no_reduce_scatter
