"""The compressed inter-node gradient stage (``fcdp.grad_compression``, ``fcdp_deepspeed/grads/compressed.py``) with
error feedback, through ``deepspeed.initialize`` on real gloo groups, 2 nodes x 2, every scenario in one launch.

What is proved: the test-only identity codec makes the compressed path bit-identical to the exact hierarchical
path (node and per-rank accumulation, the flush path included), and a wrong scale, a wrong divide factor, a wrong
row or block order each break that; int8/int4 keep every rank's replica bitwise equal and cut the inter-node
gradient bytes to the wire model's ratio; the residual carries over steps (without it the summed gradient drifts
from the exact sum); an overflow-skipped step leaves the residual bit for bit as it was (a variant that commits
anyway fails); residuals are saved per rank and a resumed run equals the uninterrupted one bit for bit, while a
checkpoint of another setting starts from zero; a residual budget covers a prefix of the parameters (LoRA
adapters) and the rest crosses exact, with one warning; refusals name the key.
"""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed.compress import codec_for
from fcdp_deepspeed.grads.residual import ResidualStore
from fcdp_deepspeed.config import FCDPConfigError, parse_fcdp_config
from fcdp_deepspeed.grads.plan import check_grad_compression, resolve_grad_plan

NODE = {"grad_accumulation": "node"}  # grad_reduce auto: hierarchical on 2 x 2
HIER = {"grad_reduce": "hierarchical", "grad_accumulation": "rank"}
INT8, INT4 = {"grad_compression": "int8"}, {"grad_compression": "int4"}
GATED = dict(grad_accum=2, gate={1}, steps=3, record_grads=True)  # last block idle in the boundary micro-step: flush
BROKEN = {"wrong_scale": dict(codec="wrong_scale"), "divide_by_nodes": dict(codec="identity", **{"break": "divide_by_nodes"}),
          "rows_reversed": dict(codec="identity", **{"break": "rows_reversed"}), "blocks_rolled": dict(codec="blocks_rolled")}
EF_STEPS = 12
#: Steps of the invariant scenarios, and the checkpoint event after the first micro-step of some windows.
INV_STEPS, MID_WINDOW = 3, {1: "save", 2: "save16"}
#: Residuals of 3 of the 8 LoRA adapters fit: 2 slots x (N - 1) = 1 sent row x P=16 fp32 elements each, per rank
#: (2 per node; the own row has none, [Note: the own row] in grads/compressed.py).
LORA_BUDGET = 2 * 3 * (2 * 1 * 16 * 4)
CLIP = dict(lr=0.0, steps=4, clip=1.0, spike={2: 1000.0}, record_grads=True)  # a 1000x spike at step 2, clipped
SCENARIOS = [
    dict(name="off_node", fcdp=NODE, **GATED),
    dict(name="off_hier", fcdp=HIER, grad_accum=2, steps=3, record_grads=True),
    dict(name="identity_node", fcdp={**NODE, **INT8}, codec="identity", **GATED),
    dict(name="identity_hier", fcdp={**HIER, **INT8}, codec="identity", grad_accum=2, steps=3, record_grads=True),
    *[dict(name=f"broken_{k}", fcdp={**NODE, **INT8}, **v, **{**GATED, "steps": 2}) for k, v in BROKEN.items()],
    dict(name="int8_hier", fcdp={**HIER, **INT8}, grad_accum=2, steps=3),
    dict(name="int4_hier_device", fcdp={**HIER, **INT4, "grad_buffer_device": "device"}, grad_accum=2, steps=3),
    # error feedback at fixed weights (lr 0): each step's exact gradient is the same on every path
    dict(name="ef_off", fcdp=HIER, lr=0.0, steps=EF_STEPS, record_grads=True),
    dict(name="ef_int4", fcdp={**HIER, **INT4}, lr=0.0, steps=EF_STEPS, record_grads=True),
    dict(name="ef_int4_no_feedback", fcdp={**HIER, **INT4}, lr=0.0, steps=EF_STEPS, record_grads=True,
         **{"break": "no_feedback"}),
    # the own row quantized too (before issue 33): the first step's error without it is lower
    dict(name="ef_int4_quantized_own_row", fcdp={**HIER, **INT4}, lr=0.0, steps=1, record_grads=True,
         broken="own_row"),
    dict(name="ef_int8", fcdp={**HIER, **INT8}, lr=0.0, steps=1, record_grads=True),
    dict(name="ef_int8_quantized_own_row", fcdp={**HIER, **INT8}, lr=0.0, steps=1, record_grads=True,
         broken="own_row"),
    # error feedback under gradient_clipping: the residual follows the clip coefficient (and a variant ignoring it)
    dict(name="clip_int4", fcdp={**HIER, **INT4}, **CLIP),
    dict(name="clip_int4_unscaled_residual", fcdp={**HIER, **INT4}, **CLIP, broken="clip"),
    # one rank's parameter reconstruction 1 ulp off: the replica check must catch it
    dict(name="broken_replica", fcdp={**HIER, **INT8, "param_compression": "int8"}, steps=2, broken="reconstruction@1"),
    # other precisions and optimizer offload: identity is bit-identical to the exact path, int8 replicas agree
    dict(name="off_bf16", fcdp=HIER, dtype="bf16", steps=2, record_grads=True),
    dict(name="identity_bf16", fcdp={**HIER, **INT8}, codec="identity", dtype="bf16", steps=2, record_grads=True),
    dict(name="int8_bf16", fcdp={**NODE, **INT8}, dtype="bf16", grad_accum=2, steps=2, record_grads=True),
    dict(name="off_fp16", fcdp=HIER, dtype="fp16", steps=2, record_grads=True),
    dict(name="identity_fp16", fcdp={**HIER, **INT8}, codec="identity", dtype="fp16", steps=2, record_grads=True),
    dict(name="int4_fp16", fcdp={**NODE, **INT4}, dtype="fp16", grad_accum=2, steps=2, record_grads=True),
    dict(name="identity_offload", fcdp={**HIER, **INT8}, codec="identity", grad_accum=2, steps=3, record_grads=True,
         zero={"offload_optimizer": {"device": "cpu"}}),
    dict(name="int8_offload", fcdp={**NODE, **INT8}, grad_accum=2, steps=2, record_grads=True,
         zero={"offload_optimizer": {"device": "cpu"}}),
    # overflow-skipped third step (fp16 loss scaling's path, injected: no fp16 on the CPU accelerator)
    dict(name="overflow", fcdp={**NODE, **INT8}, grad_accum=2, steps=4, overflow_at={2}, record_residual=True),
    dict(name="overflow_commit_on_skip", fcdp={**NODE, **INT8}, grad_accum=2, steps=4, overflow_at={2},
         record_residual=True, **{"break": "commit_on_skip"}),
    # the error-feedback invariant across checkpoint events inside windows (GA 2, at fixed weights): a save and a
    # 16-bit consolidation after the first micro-step, under node accumulation (with the flush) and per-rank;
    # without clipping: with it, each step scales the residual it carries by its clip coefficient (CLIP below),
    # so the sum telescopes only up to the (1 - clip) parts dropped
    *[dict(name=f"inv_{acc}", fcdp=mode, lr=0.0, grad_accum=2, steps=INV_STEPS, record_grads=True, clip=0.0, **gate)
      for acc, mode, gate in (("node", NODE, {"gate": {1}}), ("hier", HIER, {}))],
    *[dict(name=f"inv_{acc}_int4", fcdp={**mode, **INT4}, lr=0.0, grad_accum=2, steps=INV_STEPS, record_grads=True,
           clip=0.0,
           mid_window=MID_WINDOW, record_invariant=True, **gate, **brk)
      for acc, mode, gate, brk in (("node", NODE, {"gate": {1}}, {}), ("hier", HIER, {}, {}),
                                   ("hier_discard", HIER, {}, {"break": "discard_at_checkpoint"}))],
    dict(name="lora_budget", fcdp={**HIER, **INT8, "grad_buffer_budget": LORA_BUDGET}, lora_rank=2, steps=2),
    # the residuals cannot be allocated on rank 1: every rank crosses exact
    dict(name="alloc_fault", fcdp={**HIER, **INT8}, steps=1, fault="alloc_residual_host@1"),
    # both hops int4 (rotated gradient blocks, plain parameter blocks), through the fused CPU codec and the torch ops
    *[dict(name=f"both_int4_{kernel}", fcdp={**NODE, **INT4, "param_compression": "int4"}, grad_accum=2, steps=3,
           codec_kernel=kernel) for kernel in ("native", "torch")],
]
REFUSALS = [
    dict(fcdp={**INT8, "grad_reduce": "flat"}),
    dict(fcdp={**INT8, "ranks_per_node": 4}),  # one node: the plan is flat
    dict(fcdp=INT4, zero={"zero_quantized_gradients": True}),
]
#: gradient_clipping binds (the saved residuals carry their clip coefficient: [Note: residuals and clipping])
CHECKPOINT = dict(name="ckpt", fcdp={**NODE, **INT8}, grad_accum=2, clip=0.01)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks("compress_grads:compression_runs", 4, timeout=900, scenarios=SCENARIOS,
                     ckpt_dir=str(tmp_path_factory.mktemp("ckpt")), checkpoint_scenario=CHECKPOINT,
                     exact_for_checkpoint="off_hier", refusals=REFUSALS)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("exact, identity", [("off_node", "identity_node"), ("off_hier", "identity_hier")])
def test_identity_codec_is_bit_identical_to_the_exact_path(runs, exact, identity):
    for per_rank in runs:
        off, ident = per_rank[exact], per_rank[identity]
        assert ident["losses"] == off["losses"]
        assert all(torch.equal(a, b) for a, b in zip(ident["grads"], off["grads"])) and len(off["grads"]) == 3
        assert ident["stats"][-1]["grad_compressed_exchanges"] > 0 and ident["stats"][-1]["grad_exact_inter_node_bytes"] == 0
    assert runs[0][exact]["weights"].keys() == runs[0][identity]["weights"].keys()
    assert all(torch.equal(w, runs[0][identity]["weights"][k]) for k, w in runs[0][exact]["weights"].items())
    if exact == "off_node":
        assert runs[0][identity]["stats"][-1]["grad_flushed"] > 0  # the flush path crossed compressed too


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_exchange_fails_the_identity_guard(runs, kind):
    """Each deliberately broken variant (wrong decode scale, the sum divided by the node count, rows sent to the
    wrong peers, blocks decoded in the wrong order) is off by far more than rounding at the first boundary."""
    errors = [rel(per_rank[f"broken_{kind}"]["grads"][0], per_rank["off_node"]["grads"][0]) for per_rank in runs]
    assert max(errors) > 5e-3, errors


def test_the_fused_cpu_codec_trains_bit_for_bit_like_the_torch_ops(runs):
    """[Note: the fused CPU codec]: the same int4/int4 job with the C kernel and with the torch ops has the same losses,
    gradients' replicas and final weights on every rank, bit for bit; the kernel ran (a rank that could not build
    it would have fallen back to the torch ops and proven nothing)."""
    for per_rank in runs:
        native, ops = per_rank["both_int4_native"], per_rank["both_int4_torch"]
        assert native["codec_kernel"] and not ops["codec_kernel"]
        assert native["losses"] == ops["losses"] and native["hash"] == ops["hash"]
        assert native["replicas"] == ops["replicas"]
        stats = native["stats"][-1]
        assert stats["grad_compressed_exchanges"] > 0 and stats["inter_node_param_compressed_bytes"] > 0
    weights = runs[0]["both_int4_native"]["weights"]
    assert weights and all(torch.equal(w, runs[0]["both_int4_torch"]["weights"][k]) for k, w in weights.items())


REPLICA_RUNS = ("int8_hier", "int4_hier_device", "lora_budget", "overflow", "clip_int4", "int8_bf16", "int4_fp16",
                "int8_offload")


def _replicas_agree(runs, name: str) -> bool:
    """Every rank computed with the same full parameters at every forward (``workers/replicas.py``). An exact flat
    gather of each rank's partitions, what this compared before issue 33, agrees whatever the ranks computed with."""
    first = runs[0][name]["replicas"]
    return bool(first) and all(per_rank[name]["replicas"] == first for per_rank in runs[1:])


def test_compressed_replicas_stay_bitwise_equal_on_every_rank(runs):
    for name in REPLICA_RUNS:
        assert _replicas_agree(runs, name), name


def test_one_ranks_reconstruction_off_by_one_ulp_fails_the_replica_check(runs):
    assert not _replicas_agree(runs, "broken_replica")
    assert len({per_rank["broken_replica"]["hash"] for per_rank in runs}) == 1  # the old check: blind to it


def test_the_own_row_crosses_exact(runs):
    """[Note: the own row] in grads/compressed.py: the first step's (no residual yet) relative error of each rank's
    partition against the exact sum is lower than with the own row quantized too (the broken variant), by about the
    1/N share the own row had; the residual holds N - 1 rows."""
    for codec in ("int4", "int8"):
        exact = [per_rank["ef_off"]["grads"][0] for per_rank in runs]
        mine = [per_rank[f"ef_{codec}"]["grads"][0] for per_rank in runs]
        old = [per_rank[f"ef_{codec}_quantized_own_row"]["grads"][0] for per_rank in runs]
        err = lambda gs: (torch.cat(gs) - torch.cat(exact)).norm().item() / torch.cat(exact).norm().item()  # noqa: E731
        print(f"{codec}: first-step relative error {err(mine):.4f} (own row exact) vs {err(old):.4f} (quantized)")
        assert err(mine) < 0.85 * err(old), (codec, err(mine), err(old))


def test_the_residual_follows_the_clip_coefficient_after_a_spike(runs):
    """[Note: residuals and clipping]: at fixed weights (lr 0) a 1000x loss spike at step 2 under gradient_clipping
    1.0; step 3's compressed gradient points along the exact one (cosine near 1); with the residual left in pre-clip
    units (the broken variant) the spike's quantization error dominates it."""
    def cosine(name):
        a = torch.cat([per_rank[name]["grads"][3] for per_rank in runs])
        b = torch.cat([per_rank["ef_off"]["grads"][3] for per_rank in runs])
        return (a @ b / (a.norm() * b.norm())).item()
    fixed, broken = cosine("clip_int4"), cosine("clip_int4_unscaled_residual")
    print(f"cosine(update, exact) on the step after a 1000x spike: {fixed:.4f} (scaled residual) vs {broken:.4f}")
    assert fixed > 0.95 and broken < 0.5, (fixed, broken)
    for per_rank in runs:  # the first step has no residual yet: the variants agree there
        assert torch.equal(per_rank["clip_int4"]["grads"][0], per_rank["clip_int4_unscaled_residual"]["grads"][0])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_bf16_and_fp16_gradients_compress(runs, dtype):
    """The identity codec is bit-identical to the exact path in each precision; the lossy codec stays close."""
    for per_rank in runs:
        off, ident = per_rank[f"off_{dtype}"], per_rank[f"identity_{dtype}"]
        assert ident["losses"] == off["losses"] and all(torch.equal(a, b) for a, b in zip(ident["grads"], off["grads"]))
        assert ident["stats"][-1]["grad_compressed_exchanges"] > 0
        lossy = per_rank["int8_bf16" if dtype == "bf16" else "int4_fp16"]
        assert lossy["stats"][-1]["grad_compressed_exchanges"] > 0 and lossy["skipped_steps"] == 0
        from fcdp_deepspeed.tools.plan.compression import residual_bytes_per_rank  # the same in every precision
        assert lossy["stats"][-1]["grad_residual_host_bytes"] == residual_bytes_per_rank(2, 2, (1024, 32) * 6)
        assert all(torch.isfinite(torch.tensor(lossy["losses"])))


def test_gradient_compression_with_offload_optimizer(runs):
    for per_rank in runs:
        ident, exact = per_rank["identity_offload"], per_rank["off_hier"]
        # the first boundary (same weights): bit-identical; later ones follow DeepSpeed's CPU optimizer step, whose
        # rounding differs from the on-device one
        assert torch.equal(ident["grads"][0], exact["grads"][0]) and ident["losses"][:2] == exact["losses"][:2]
        assert all(rel(a, b) < 1e-2 for a, b in zip(ident["grads"], exact["grads"])) and len(ident["grads"]) == 3
        assert per_rank["int8_offload"]["stats"][-1]["grad_compressed_exchanges"] > 0


@pytest.mark.parametrize("name, codec, low, high", [("int8_hier", "int8", 0.255, 0.285), ("int4_hier_device", "int4", 0.127, 0.15)])
def test_inter_node_gradient_bytes_drop_by_the_wire_ratio(runs, name, codec, low, high):
    for per_rank in runs:
        off, comp = per_rank["off_hier"]["stats"], per_rank[name]["stats"]
        exact_bytes, calls = off[-1]["inter_node_grad_reduce_bytes"], off[-1]["inter_node_grad_reduce_calls"]
        s = comp[-1]
        assert low <= s["inter_node_grad_reduce_bytes"] / exact_bytes <= high
        # the ledger's bytes are the compressed rows' (the codec's wire model; one bucket row per micro-step)
        row_numel = exact_bytes // (calls * 4)  # (N - 1) = 1 peer on another node: one fp32 row per call
        assert s["grad_compressed_inter_node_bytes"] == s["inter_node_grad_reduce_bytes"] == \
            calls * codec_for(codec, 128).wire_numel(row_numel)
        assert s["grad_compression"] == codec and s["grad_residual_params"] == 12
        placed = "grad_residual_device_bytes" if "device" in name else "grad_residual_host_bytes"
        # 2 slots x 4 bytes x (N - 1) = 1 sent row ([Note: the own row]) x P per parameter: what `fcdp plan` prints
        from fcdp_deepspeed.tools.plan.compression import residual_bytes_per_rank
        assert s[placed] == 2 * 4 * 1 * sum(-(-n // 4) for n in (1024, 32) * 6) and s["grad_residual_rel_norm"] > 0
        assert s[placed] == residual_bytes_per_rank(2, 2, (1024, 32) * 6)


def test_error_feedback_tracks_the_exact_sum_over_steps(runs):
    """At fixed weights (lr 0: every step's exact gradient is the same on each path) the K-step sum of the
    compressed gradients stays within about one step's rounding of the exact K-step sum with error feedback
    (it differs by the last residual); without feedback the rounding errors add up (~sqrt(K) here)."""
    for per_rank in runs:
        exact, ef, raw = (per_rank[n]["grads"] for n in ("ef_off", "ef_int4", "ef_int4_no_feedback"))
        total = lambda gs: torch.stack(gs).sum(0)  # noqa: E731
        err_ef = [(total(ef[:k]) - total(exact[:k])).norm().item() for k in range(1, EF_STEPS + 1)]
        err_raw = [(total(raw[:k]) - total(exact[:k])).norm().item() for k in range(1, EF_STEPS + 1)]
        assert err_ef[0] == err_raw[0] > 0  # the first step: no residual yet
        assert max(err_ef) < 2.0 * err_ef[0], err_ef  # bounded, not growing with K
        assert err_raw[-1] > 2.0 * err_raw[0], err_raw  # the variant without feedback drifts
        assert err_ef[-1] < 0.6 * err_raw[-1], (err_ef, err_raw)


@pytest.mark.parametrize("acc", ["node", "hier"])
def test_error_feedback_invariant_holds_across_checkpoint_events_inside_windows(runs, acc):
    """[Note: the error-feedback invariant] in tests/workers/compress_grads.py: at fixed weights, the sum of every
    step's compressed gradient partitions equals the exact sum minus the senders' last residuals, bit for bit up
    to fp32 rounding, with a save and a 16-bit consolidation after the first micro-step of two of the three GA-2
    windows (node accumulation with its flush; per-rank accumulation). The old epilogue, which dropped the
    window's pending residual (its next exchange re-added the committed one), is off by about one residual."""
    for per_rank in runs:
        exact, comp, broken = (per_rank[n] for n in (f"inv_{acc}", f"inv_{acc}_int4", "inv_hier_discard_int4"))
        total = lambda gs: torch.stack(gs).sum(0)  # noqa: E731
        assert len(comp["grads"]) == len(exact["grads"]) == INV_STEPS
        residual = comp["peer_residuals"]
        gap = (total(comp["grads"]) - total(exact["grads"]) + residual).norm().item()
        assert residual.norm().item() > 0 and gap <= 1e-4 * residual.norm().item(), (gap, residual.norm().item())
        if acc == "hier":
            off = (total(broken["grads"]) - total(exact["grads"]) + broken["peer_residuals"]).norm().item()
            assert off > 0.2 * broken["peer_residuals"].norm().item(), off


def test_an_overflow_skipped_step_leaves_the_residual_untouched(runs):
    for per_rank in runs:
        run, broken = per_rank["overflow"], per_rank["overflow_commit_on_skip"]
        assert run["skipped_steps"] == 1 and run["stats"][-1]["grad_residual_restores"] == 1
        r = run["residuals"]
        assert r[1].abs().sum() > 0 and torch.equal(r[1], r[2]) and not torch.equal(r[2], r[3])
        assert not torch.equal(broken["residuals"][1], broken["residuals"][2])  # the broken variant changes it


def test_checkpoint_resume_is_bit_identical_and_other_settings_start_from_zero(runs):
    for per_rank in runs:
        ck = per_rank["checkpoint"]
        assert ck["saved_residual"].abs().sum() > 0 and torch.equal(ck["loaded_residual"], ck["saved_residual"])
        assert ck["saved_clips"] and max(ck["saved_clips"]) < 1.0  # clipping bound: the resume covers the scaling
        assert ck["resumed"]["losses"] == ck["continued"]["losses"]
        assert not ck["other_block_residual"].any() and not ck["off_residual"].any()
        assert ck["zeroed_loads"] == [0, 1, 1]
    weights = runs[0]["checkpoint"]["resumed"]["weights"]
    assert weights and all(torch.equal(w, runs[0]["checkpoint"]["continued"]["weights"][k]) for k, w in weights.items())


@pytest.mark.parametrize("load", ["no_optimizer", "module_only", "universal"])
def test_a_load_without_the_optimizer_state_resets_the_compression_state(runs, load):
    """load_checkpoint(load_optimizer_states=False) and load_module_only=True never call the optimizer's
    load_state_dict (DeepSpeed restores the master weights from the 16-bit ones), and a universal checkpoint holds
    no envelope: each starts the residuals from zero, every reference empty and the refresh counter at 0, as
    docs/compression.md says (before: residuals and counter kept across the first two)."""
    for per_rank in runs:
        r = per_rank["reloads"][load]
        before, after = r["before"], r["after"]
        assert before["residual_norm"] > 0 and before["steps"] >= 2 and before["valid_refs"] == before["refs"] > 0
        assert after["residual_norm"] == 0 and after["steps"] == 0 and after["valid_refs"] == 0
        assert after["zeroed_loads"] == before["zeroed_loads"] + 1
        if load != "universal":
            assert r["exact_gathers"].get("weights restored", 0) >= after["refs"]  # the next gathers crossed exactly


def test_a_residual_budget_covers_a_prefix_and_the_rest_crosses_exact(runs):
    for rank, per_rank in enumerate(runs):
        s = per_rank["lora_budget"]["stats"][-1]
        assert s["grad_residual_params"] == 3 and s["grad_residual_host_bytes"] == LORA_BUDGET // 2
        # per step, one row to the peer on the other node: 3 adapters' P = 16 elements compressed together, and
        # the other 5 adapters' rows exact (fp32)
        assert s["grad_compressed_inter_node_bytes"] == 2 * codec_for("int8", 128).wire_numel(3 * 16)
        assert s["grad_exact_inter_node_bytes"] == 2 * 5 * 16 * 4
        assert len(per_rank["lora_budget"]["warnings"]) == (1 if rank == 0 else 0)


def test_a_failed_residual_allocation_on_one_rank_is_agreed(runs):
    for rank, per_rank in enumerate(runs):
        s = per_rank["alloc_fault"]["stats"][-1]
        assert s["grad_residual_params"] == 0 and s["grad_residual_host_bytes"] == 0
        assert s["grad_compressed_inter_node_bytes"] == 0 and s["grad_exact_inter_node_bytes"] == s["inter_node_grad_reduce_bytes"] > 0
        assert len(per_rank["alloc_fault"]["warnings"]) == (1 if rank == 0 else 0)


@pytest.mark.parametrize("i, needle", [(0, "fcdp.grad_compression = 'int8' compresses the inter-node stage"),
                                       (1, "fcdp.grad_compression = 'int8' compresses the inter-node stage of grad_reduce"),
                                       (2, "zero_quantized_gradients (ZeRO++ qgZ)")])
def test_refusals_name_the_key(runs, i, needle):
    err = runs[0]["refusals"][i]["error"]
    assert "FCDPConfigError" in err and needle in err and "Fix:" in err, err


# -- in-process: the residual store, the dtype refusal -------------------------------------------------------------
def test_residual_store_commits_by_flipping_slots_and_rescales_for_the_loss_scale():
    store = ResidualStore(flats=(torch.zeros(8), torch.zeros(8)), offsets={7: (0, 4), 9: (4, 4)}, device="device")
    assert store.read(7, (2, 2), 1.0) is None  # nothing written: zero
    store.write(7, torch.full((2, 2), 1.0), 1024.0)
    assert store.read(7, (2, 2), 1024.0).eq(1.0).all()  # a later exchange of the window reads the pending slot
    assert store.discard() and store.read(7, (2, 2), 1024.0) is None  # dropped: still zero
    store.write(7, torch.full((2, 2), 3.0), 1024.0)
    assert store.commit() == 1 and store.committed[7] == 1
    store.write(7, torch.full((2, 2), 5.0), 512.0)  # the next window, written at a halved loss scale
    store.discard()  # skipped: the committed residual stays, in the scale it was written at
    assert store.read(7, (2, 2), 512.0).eq(1.5).all()  # 3.0 at scale 1024, read at scale 512
    flat, scales = store.snapshot()
    assert flat.tolist() == [3.0] * 4 + [0.0] * 4 and scales == [1024.0, None]
    store.restore(flat, scales)
    assert store.committed == {7: 1} and store.read(7, (2, 2), 1024.0).eq(3.0).all()
    assert store.read(9, (2, 2), 1.0) is None
    # a load inside a window replaces the committed residual only: the window's pending one stays its next input
    store.write(7, torch.full((2, 2), 7.0), 1024.0)
    store.restore(None, [])
    assert store.read(7, (2, 2), 1024.0).eq(7.0).all()  # the window's next exchange reads its own pending residual
    assert store.commit() == 1 and store.read(7, (2, 2), 1024.0).eq(7.0).all()
    assert store.discard() is False and store.snapshot()[0].tolist() == [7.0] * 4 + [0.0] * 4


def test_unsupported_dtypes_and_flat_plans_are_refused_by_name():
    plan = resolve_grad_plan("auto", "auto", 2, 2, 1)
    check_grad_compression("int8", plan, torch.bfloat16, torch.float32)
    with pytest.raises(FCDPConfigError, match=r"grad_compression = 'int8' supports fp32, bf16 and fp16 .*torch.float64"):
        check_grad_compression("int8", plan, torch.float32, torch.float64)
    with pytest.raises(FCDPConfigError, match=r"this job runs grad_reduce = \"flat\" \(auto, one node"):
        check_grad_compression("int4", resolve_grad_plan("auto", "auto", 1, 4, 1), torch.float32, torch.float32)
    with pytest.raises(FCDPConfigError, match="grad_compression = 'int4' compresses the inter-node stage"):
        parse_fcdp_config({"fcdp": {"enabled": True, "grad_compression": "int4", "grad_reduce": "flat"}})


# -- in-process: the vectorised exchange against the per-parameter one it replaced -------------------------------
def _store(nodes: int, sizes: dict, values: torch.Tensor) -> ResidualStore:
    """A device store with a history: ds 3 committed (its step's clip applies), ds 20 committed at loss scale 4,
    ds 7 pending (a later exchange of the window), ds 11 never written."""
    offsets, offset = {}, 0
    for ds_id in sorted(sizes):
        offsets[ds_id] = (offset, (nodes - 1) * sizes[ds_id])
        offset += (nodes - 1) * sizes[ds_id]
    store = ResidualStore(flats=(values[0, :offset].clone(), values[1, :offset].clone()), offsets=offsets, device="device")
    store.scales, store.committed, store.pending = {3: 2.0, 20: 4.0}, {3: 1}, {7: 2.0}
    return store


@pytest.mark.parametrize("nodes,me", [(2, 0), (2, 1), (3, 1), (4, 0), (4, 3)])
@pytest.mark.parametrize("name,dtype", [("int8", torch.float32), ("int4", torch.float32), ("int4", torch.bfloat16)])
def test_the_vectorised_exchange_sends_keeps_and_sums_the_per_parameter_exchange_s_bits(monkeypatch, nodes, me, name, dtype):
    """[Note: the vectorised exchange] in grads/compressed.py: one residual read, one encode and one decode per side for a
    bucket give every byte sent to another node, every residual kept and the summed partition of the per-parameter
    exchange before it (``tests/codec_reference.py``), bit for bit: committed, clipped, rescaled, pending and absent
    residuals, padded rows, signed zeros and a NaN, fp32 and bf16 node sums."""
    from types import SimpleNamespace
    from codec_reference import reference_exchange
    from fcdp_deepspeed.grads import compressed as compress_grads
    gen = torch.Generator().manual_seed(nodes * 10 + me)
    codec = codec_for(name, 16, side="grads")
    ds_ids, sizes = [11, 3, 7, 20], [37, 64, 5, 100]  # bucket order, not ds_id order
    history = torch.randn(2, 4096, generator=gen)
    history[:, 7] = -0.0
    sums = [torch.randn(nodes, p, generator=gen).to(dtype) for p in sizes]
    sums[0][:, :9] = sums[1][:, :9] = -0.0
    sums[3][:, 50] = float("nan")
    recv = codec.encode_rows(torch.randn(nodes, sum(sizes), generator=gen) * 3)
    clips = {3: torch.tensor(0.25), 20: torch.tensor(0.5)}  # 20's committed residual is first read: clipped too
    old_store = _store(nodes, dict(zip(ds_ids, sizes)), history)
    packed_old, sent_old, total_old = reference_exchange(codec, old_store, clips, me, nodes, sums, ds_ids, 2.0, recv)

    comp = compress_grads.GradCompressor.__new__(compress_grads.GradCompressor)
    comp.codec, comp.layout, comp.me, comp.clips = codec, SimpleNamespace(nodes=nodes), me, clips
    comp.store, comp.loss_scale, comp.accumulation_dtype = _store(nodes, dict(zip(ds_ids, sizes)), history), lambda: 2.0, torch.float32
    comp.counters, comp._window_sq, comp.peer_group = compress_grads.CompressionCounters(), None, None
    sent_rows = {}

    def all_to_all(out, packed, group=None, async_op=False):
        sent_rows["packed"] = packed.clone()
        out.copy_(recv)
        return SimpleNamespace(wait=lambda: None) if async_op else None
    monkeypatch.setattr(compress_grads.dist, "all_to_all_single", all_to_all)
    total = torch.cat(comp._exchange(sums, ds_ids).complete())
    others = [q for q in range(nodes) if q != me]
    assert torch.equal(sent_rows["packed"][others], packed_old[others])  # the own row never crosses a link
    assert torch.equal(total.view(torch.int32), total_old.view(torch.int32))
    for new, old in zip(comp.store.flats, old_store.flats):
        assert torch.equal(new.view(torch.int32), old.view(torch.int32))
    assert comp.store.pending == old_store.pending and torch.isnan(total).any()
