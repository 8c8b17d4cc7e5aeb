"""``fcdp.layered``: layered (breadth-first) gradient accumulation, through ``deepspeed.initialize`` on 2 x 2."""
from __future__ import annotations

import pytest
import torch

from fcdp_deepspeed.config import FCDPConfigError, check_ds_config_compatible, parse_fcdp_config
from fcdp_deepspeed.config.layered import LayeredConfig
from fcdp_deepspeed.layered import LayeredCallError, LayeredStack, find_layers, split
from fcdp_lab.harness import toy


def _close(a, b, tol):
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def test_the_backward_passes_each_layer_for_every_chunk_before_the_layer_below_and_sums_each_gradient_once():
    """The installed torch's autograd order ([Note: the hold is ZeRO-3's leaf module] rests on it)."""
    torch.manual_seed(0)
    model = toy.ToyModel(hidden=8, layers=3)
    stack = LayeredStack(model, LayeredConfig(chunks=3))
    order, accumulated = [], {}
    for i, block in enumerate(model.blocks):
        block.fc.register_forward_pre_hook(lambda m, a, i=i: order.append((i, torch.is_grad_enabled())))
        block.fc.weight.register_post_accumulate_grad_hook(lambda p, i=i: accumulated.__setitem__(i, accumulated.get(i, 0) + 1))
    x = torch.randn(6, 8)
    loss = model(x).pow(2).mean()
    forward, order[:] = list(order), []
    loss.backward()
    assert forward == [(i, True) for i in range(3) for _ in range(3)]  # every chunk through a layer, then the next
    assert [i for i, _ in order] == [2, 2, 2, 1, 1, 1, 0, 0, 0]  # the recomputations, layer by layer from the top
    assert accumulated == {0: 1, 1: 1, 2: 1}  # one gradient per parameter per step: reduced once
    assert stack.counters.recomputes == 9 and stack.counters.chunk_calls == 9
    reference = toy.ToyModel(hidden=8, layers=3)
    reference.load_state_dict(model.state_dict())
    reference(x).pow(2).mean().backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=n)


def test_a_call_splits_per_example_tensors_and_passes_shared_ones_whole():
    h, mask, rope, pos = torch.randn(4, 3, 2), torch.ones(4, 1, 3, 3), torch.randn(1, 3, 2), torch.arange(4)
    parts = split.split_call((h,), {"mask": mask, "rope": (rope, rope), "cache_position": pos, "flag": True}, 2)
    assert [a[0].shape[0] for a, _ in parts] == [2, 2]
    assert all(k["rope"][0] is rope and k["cache_position"] is pos and k["flag"] is True for _, k in parts)
    assert torch.equal(split.merge([a[0] for a, _ in parts]), h)
    with pytest.raises(LayeredCallError, match="use_cache"):
        split.split_call((h,), {"past_key_values": object()}, 2)
    with pytest.raises(LayeredCallError, match="chunks = 8"):
        split.split_call((h,), {}, 8)


def test_the_layer_list_is_found_or_named():
    assert find_layers(toy.ToyModel(8, 3), "auto")[0] == "blocks"
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), *[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(3)])
    assert find_layers(torch.nn.ModuleDict({"body": seq}), "body")[0] == "body"
    with pytest.raises(LayeredCallError, match="fcdp.layered.layers = 'nope'"):
        find_layers(toy.ToyModel(8, 3), "nope")


def test_a_config_that_still_accumulates_is_refused_with_the_rewrite():
    assert parse_fcdp_config({"fcdp": {"enabled": True, "layered": 4}}).layered.chunks == 4
    assert parse_fcdp_config({"fcdp": {"enabled": True, "layered": 1}}).layered is None
    with pytest.raises(FCDPConfigError, match="unknown key"):
        parse_fcdp_config({"fcdp": {"enabled": True, "layered": {"chunk": 4}}})
    cfg = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2,
           "fcdp": {"enabled": True, "layered": 4}}
    with pytest.raises(FCDPConfigError, match=r"gradient_accumulation_steps to 1 and train_micro_batch_size_per_gpu to 4 x 2 = 8"):
        check_ds_config_compatible(cfg)


@pytest.mark.parametrize("regime", ["large", "default"])
def test_layered_gives_zero3_accumulations_losses_and_weights_within_its_float64_error(ranks, regime):
    r0 = ranks("layered:compare", regime=regime)[0]
    zero3, lay = r0["zero3"], r0["layered"]
    assert _close(lay["losses"], zero3["losses"], 1e-5)
    # the gradient of each step against the float64 window mean: within ZeRO-3's own accumulation error
    assert max(lay["grad_errors"]) <= max(2 * max(zero3["grad_errors"]), 1e-7), (lay["grad_errors"], zero3["grad_errors"])
    for name, w in zero3["weights"].items():
        torch.testing.assert_close(lay["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert lay["stats"]["layered_chunks"] == 4 and lay["stats"]["layered_batches"] == 3
    assert lay["stats"]["layered_recomputes"] == lay["stats"]["layered_chunk_calls"] == 3 * 4 * 4


def test_layered_composes_with_lora_and_the_models_own_checkpointing(ranks):
    r0 = ranks("layered:compare", regime="large", lora=4, ckpt=True)[0]
    zero3, lay = r0["zero3"], r0["layered"]
    assert _close(lay["losses"], zero3["losses"], 1e-5)
    assert max(lay["grad_errors"]) <= max(2 * max(zero3["grad_errors"]), 1e-7)


@pytest.mark.parametrize("link", ["slow", "fast"])
def test_each_layer_is_gathered_once_in_forward_and_once_in_backward_whatever_the_chunks(ranks, link):
    """The window in 4 layered chunks gathers what the window as one batch gathers (calls and bytes, ``get_stats``),
    on FCDP's paths and on ZeRO-3's."""
    r0 = ranks("layered:gathers", link=link)[0]
    assert r0["layered"] == r0["whole"], r0


def test_the_depth_first_variant_fails_the_gather_count(ranks):
    r0 = ranks("layered:gathers", link="fast", env={"FCDP_LAB_BREAK": "layered.depth_first"})[0]
    assert r0["layered"] != r0["whole"]  # the check above fails
    assert r0["layered"]["inter_node_allgather_calls"] >= 2 * r0["whole"]["inter_node_allgather_calls"], r0
