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
    assert torch.equal(split.merge([a[0] for a, _ in parts], [2, 2]), h)
    with pytest.raises(LayeredCallError, match="use_cache=False"):
        split.split_call((h,), {"past_key_values": object()}, 2)
    assert len(split.split_call((h,), {}, 8)) == 4  # a short last batch: one example per chunk
    with pytest.raises(LayeredCallError, match="first dimension"):  # a shared output cannot be joined silently
        split.merge([torch.ones(1, 3), torch.ones(1, 3)], [2, 2])


def test_the_layer_list_is_found_or_named():
    assert find_layers(toy.ToyModel(8, 3), "auto")[0] == "blocks"
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), *[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(3)])
    assert find_layers(torch.nn.ModuleDict({"body": seq}), "body")[0] == "body"
    with pytest.raises(LayeredCallError, match="fcdp.layered.layers = 'nope'"):
        find_layers(toy.ToyModel(8, 3), "nope")


def test_a_layer_holding_zero3_leaves_or_reentrant_checkpointing_is_refused_by_name():
    model = toy.ToyModel(8, 3)
    model.blocks[1].fc._z3_leaf = True  # what DeepSpeed's default does to a mixture-of-experts block
    with pytest.raises(LayeredCallError, match="leaf modules"):
        LayeredStack(model, LayeredConfig(chunks=2))
    model = toy.ToyModel(8, 3)
    LayeredStack(model, LayeredConfig(chunks=2))
    import functools
    for block in model.blocks:  # a Hugging Face layer checkpointed reentrantly
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    with pytest.raises(LayeredCallError, match="use_reentrant"):
        model(torch.randn(4, 8))


def test_an_input_that_is_not_batch_first_is_refused_by_name():
    """[Note: batch first] (layered/stack.py): a training input whose first dimension exceeds DeepSpeed's micro-batch
    is a sequence-first layer (Megatron-DeepSpeed's GPT: ``(S, B, H)``); split there, the values would change."""
    model = toy.ToyModel(8, 3)
    LayeredStack(model, LayeredConfig(chunks=2), micro_batch=4)
    model(torch.randn(4, 8)).sum().backward()  # the micro-batch, or a short last one, runs
    model(torch.randn(3, 8)).sum().backward()
    with pytest.raises(LayeredCallError, match="Megatron-DeepSpeed's GPT does"):
        model(torch.randn(16, 8))
    with torch.no_grad():  # evaluation is not chunked: any first dimension
        model.eval()
        model(torch.randn(16, 8))


def test_fcdp_doctor_gives_an_accumulating_config_the_rewrite(tmp_path):
    from fcdp_deepspeed.tools import doctor
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, '
                   '"zero_optimization": {"stage": 3}, "fcdp": {"enabled": true, "layered": 4}}')
    checks, _ = doctor.run(str(cfg), 2, 2)
    fails = [c for c in checks if c.status == "FAIL"]
    assert len(fails) == 1 and "fcdp.layered.chunks = 4 with gradient_accumulation_steps = 4" in fails[0].message
    assert "train_micro_batch_size_per_gpu to 4 x 2 = 8" in fails[0].fix


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
    # the weights against the run in float64 (the engine's optimizer on the exact window means): within twice
    # ZeRO-3's own error per tensor. [Note: not against ZeRO-3's weights] Adam's first steps divide by |g|, so
    # where a gradient is near zero two float32 sums that both meet the bound above can move a weight apart by
    # 1e-6; which way depends on the CPU's kernels. Against float64 each error is its own (the norm of a
    # tensor's error: one element with a near-zero gradient does not decide it).
    reference = zero3["reference_weights"]
    for name, exact in reference.items():
        assert torch.equal(lay["reference_weights"][name], exact), name  # one float64 run, whatever the engine
        own = (zero3["weights"][name].double() - exact).norm().item()
        assert (lay["weights"][name].double() - exact).norm().item() <= 2 * own + 1e-7, (name, own)
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


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_hf_trainer_layered_matches_its_zero3_accumulation(ranks, kind):
    """An unmodified HF Trainer: ``per_device_train_batch_size=4, gradient_accumulation_steps=1`` and the block's
    ``"layered": 4`` against ZeRO-3 with ``1`` and ``4`` (a tiny Llama; a tiny GPT-2 with tied embeddings)."""
    r0 = ranks("layered:hf_trainer", kind=kind, timeout=400)[0]
    zero3, lay = r0["zero3"], r0["layered"]
    assert lay["stats"]["layered_chunks"] == 4 and lay["stats"]["layered_batches"] == 3
    assert lay["stats"]["layered_layers"] == 3
    assert _close(lay["losses"], zero3["losses"], 1e-4), (lay["losses"], zero3["losses"])
    for name, w in zero3["weights"].items():
        torch.testing.assert_close(lay["weights"][name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_the_planners_boundary_figure_is_what_a_layer_keeps_measured_on_a_llama():
    """``fcdp plan``'s activation rows against the live bytes each layer leaves for the backward (CPU, at dispatch):
    layered over the window, and the window accumulated with per-layer checkpointing, within 10%."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fcdp_deepspeed.tools.plan.layered import activation_plan
    from fcdp_lab.activation_memory import measure

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    batch, seq, chunks = 8, 32, 4
    ids = torch.randint(0, 256, (batch, seq))
    planned = activation_plan(6, 64, seq, batch, chunks, dtype_bytes=4)

    layered = LlamaForCausalLM(cfg).train()
    LayeredStack(layered, LayeredConfig(chunks=chunks))
    got = measure(layered, layered.model.layers, lambda: layered(input_ids=ids, labels=ids).loss.backward())
    assert got["per_layer_bytes"] == pytest.approx(planned["boundary_bytes_per_layer_layered"], rel=0.1)

    accumulated = LlamaForCausalLM(cfg).train()
    accumulated.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    micro = ids[:batch // chunks]
    got_ga = measure(accumulated, accumulated.model.layers,
                     lambda: accumulated(input_ids=micro, labels=micro).loss.backward())
    assert got_ga["per_layer_bytes"] * 6 == pytest.approx(planned["boundary_bytes_accumulated"], rel=0.1)
    assert got["peak_bytes"] > got_ga["peak_bytes"]  # the window's boundaries cost memory: the price of layering


@pytest.mark.parametrize("case", [
    {"dtype": "bf16"},
    {"fcdp_extra": {"param_compression": "int8", "grad_compression": "int8"}},
    {"zero": {"offload_optimizer": {"device": "cpu"}}},
    {"layered_extra": {"boundary_budget": 0}},
], ids=["bf16", "int8-compression", "offload-optimizer", "host-boundaries"])
def test_layered_composes_with_the_blocks_other_keys(ranks, case):
    """The engine sees an ordinary one-micro-step window, so every other key applies: bf16, the lossy inter-node
    codecs (against exact ZeRO-3 GA 4, loosely), the optimizer on the host."""
    r0 = ranks("layered:compare", with_whole=False, **case)[0]
    zero3, lay = r0["zero3"], r0["layered"]
    tol = 1e-5 if set(case) & {"zero", "layered_extra"} else 3e-2
    assert _close(lay["losses"], zero3["losses"], tol), (lay["losses"], zero3["losses"])
    assert lay["stats"]["layered_batches"] == 3
    if "layered_extra" in case:  # every layer's inputs waited in host memory, the gradients within the float64 bound
        assert lay["stats"]["layered_host_boundary_bytes"] == lay["stats"]["layered_boundary_bytes"] > 0
        assert max(lay["grad_errors"]) <= max(2 * max(zero3["grad_errors"]), 1e-7)


def test_the_committed_runs_back_the_docs():
    """``docs/results/bench/layered-*.json`` (``python -m fcdp_lab bench``, the commands in docs/layered.md): the
    layered step at least 1.2x faster than the GA 4 defaults, the bound's bytes, and the table quotes the rows."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "layered.md").read_text()
    for name, rate in (("layered-ga4.json", 100.0), ("layered-lora-10mbit.json", 10.0), ("layered-2x4.json", 100.0)):
        rows = {r["engine"]: r for r in json.loads((root / "docs/results/bench" / name).read_text())["rows"]
                if r["rate_mbit"] == rate}
        layered, defaults = rows["fcdp_layered"], rows["fcdp_defaults"]
        assert defaults["step_time_s"] / layered["step_time_s"] >= 1.2, name
        assert layered["bytes_vs_bound"] == pytest.approx(1.0, abs=0.03), name  # LoRA: 1.02x, as the defaults
        for row in (layered, defaults):
            assert f"| {row['step_time_s']:.3f} | {row['compute_s']:.3f} | {row['wire_s']:.3f} | " \
                   f"{row['step_vs_floor']:.2f}x |" in doc, (name, row["engine"])


def test_boundaries_past_the_budget_wait_in_host_memory_and_come_back_for_the_recomputation():
    """[Note: host boundaries]: under the strict door (host memory told from accelerator memory; an op mixing them
    raises), layers past ``boundary_budget`` keep their inputs on the host, the recomputation reads accelerator copies,
    and the gradients are those of the run without a budget, bit for bit."""
    from fcdp_deepspeed.machine import device
    from fcdp_lab.strict import strict_device as sd

    torch.manual_seed(0)
    reference, budgeted = toy.ToyModel(8, 4), toy.ToyModel(8, 4)
    budgeted.load_state_dict(reference.state_dict())
    LayeredStack(reference, LayeredConfig(chunks=2))
    x = torch.randn(6, 8)
    reference(x).pow(2).mean().backward()
    door = sd.StrictDoor()
    packed = []
    with device.use(door):
        stack = LayeredStack(budgeted, LayeredConfig(chunks=2, boundary_budget=2 * 6 * 8 * 4))  # two layers' inputs
        from fcdp_deepspeed.layered import boundary
        original = boundary._pack
        boundary._pack = lambda t: packed.append(original(t)) or packed[-1]
        try:
            budgeted(x).pow(2).mean().backward()
        finally:
            boundary._pack = original
    assert all(door.is_host(host) for host, _, _ in packed) and len(packed) == 2 * 2  # layers 3 and 4, two chunks
    assert stack.counters.host_boundary_bytes == 2 * 6 * 8 * 4
    for (name, p), q in zip(budgeted.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_second_stack_over_the_same_model_runs_with_its_own_chunks_and_counters():
    """[Note: the newest stack]: a second engine over the same model layers it with its own chunk count and counters
    (the chunk loop is installed once; the first stack's counters stop); one over a different layer list is refused."""
    torch.manual_seed(0)
    model = toy.ToyModel(8, 4)
    first = LayeredStack(model, LayeredConfig(chunks=2))
    model(torch.randn(6, 8)).pow(2).mean().backward()
    second = LayeredStack(model, LayeredConfig(chunks=3))
    model(torch.randn(6, 8)).pow(2).mean().backward()
    layers = len(second.layers)
    assert (first.counters.batches, first.counters.chunk_calls, first.counters.recomputes) == (1, 2 * layers, 2 * layers)
    assert (second.counters.batches, second.counters.chunk_calls, second.counters.recomputes) == \
        (1, 3 * layers, 3 * layers)
    assert all(not hasattr(layer.forward.__wrapped__, "__wrapped__") for layer in second.layers)  # one loop each
    model.fewer = torch.nn.ModuleList(list(model.blocks)[:2])  # a different list over the same layers
    with pytest.raises(LayeredCallError, match="layered already by another engine over a different layer list"):
        LayeredStack(model, LayeredConfig(chunks=2, layers="fewer"))


def test_a_host_boundary_is_dropped_only_after_its_copy_back_ran():
    """[Note: deferred release] under the stream-order model: every layer's boundaries on the host for two steps;
    the first step's pinned copies are dropped (at the second step's packs), each only once its copy back is known
    done. The broken variants that drop a copy when its copy back is queued, or never retire it (its memory then
    freed with no event as its last reference dies), fail."""
    from fcdp_deepspeed.layered import boundary
    from fcdp_deepspeed.machine import device
    from fcdp_lab import sabotage
    from fcdp_lab.strict import strict_device as sd
    from fcdp_lab.strict import strict_streams as ss

    def two_steps() -> tuple[LayeredStack, int]:
        torch.manual_seed(0)
        model = toy.ToyModel(8, 4)
        boundary._RETIRED.clear()
        door = sd.StrictDoor()
        dropped = []
        door.drop_host = lambda t, drop=door.drop_host: dropped.append(t) or drop(t)
        with device.use(door), ss.tracking():
            stack = LayeredStack(model, LayeredConfig(chunks=2, boundary_budget=0))
            for _ in range(2):
                model(torch.randn(6, 8)).pow(2).mean().backward()
        return stack, len(dropped)

    stack, dropped = two_steps()
    assert stack.counters.host_boundary_bytes == 4 * 6 * 8 * 4  # four layers' inputs
    assert dropped == 4 * 2  # the first step's copies (four layers, two chunks), each after its event
    with sabotage.applied("layered.boundary_early_drop"), \
            pytest.raises(ss.StreamOrderError, match="dropped at .* may still run"):
        two_steps()
    with sabotage.applied("layered.boundary_no_retire"):
        assert two_steps()[1] == 0
