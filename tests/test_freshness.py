"""Freshness: FCDP computes with current values wherever a parameter's value changes behind the cache or the
run-ahead, bit for bit what plain ZeRO-3 computes doing exactly the same (``fcdp_block`` pins ZeRO-3's gradient
path):

1. the run-ahead (from the window's first fetch, the default; off; the push from the step's end) with parameters that
   have no cache slot (a LayerNorm below ``fcdp.min_numel``; Linears over ``fcdp.host_budget``), through checkpoint
   save/load, an eval forward and a ``GatheredParameters`` edit, then a load right after a step (the one point where
   a group pushed at the step's end is still in flight), in the large-model and DeepSpeed's default regime;
2. two engines over one module (an optimizer-less one beside a training one; a training one destroyed, then a second
   training one): equal to plain ZeRO-3's two engines. (Two training
   engines live at once over one module fail in plain ZeRO-3 itself: both engines' gradient hooks fill one bucket,
   ``assert len(set(p.ds_id ...)) == len(params_in_bucket)`` in DeepSpeed 0.19.8's ``__reduce_and_partition_ipg_grads``;
   there is no reference to compare with.)
3. an optimizer-less engine's run-ahead: its trace does not grow with every forward (it is planned only at a step's
   end, which such an engine never reaches).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from conftest import run_ranks

ROOT = str(Path(__file__).resolve().parent.parent)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)} {v.flatten()[:4].tolist()}..."
    return repr(v)


def first_difference(reference: dict, run: dict, keys) -> str | None:
    """The first record of ``keys`` (in order; inside it the first element or weight) where ``run`` differs from
    ``reference``, described with both values; ``None`` when all are equal."""
    for key in keys:
        a, b = reference[key], run[key]
        if _same(a, b):
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for name in a:
                if name not in b or not _same(a[name], b.get(name)):
                    diff = (a[name] - b[name]).abs().max().item() if name in b else "missing"
                    return (f"{key}[{name!r}]: plain {_describe(a[name])} vs fcdp {_describe(b.get(name))} "
                            f"(max |diff| {diff})")
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y))
            return f"{key}[{i}]: plain {_describe(a[i])} vs fcdp {_describe(b[i])}"
        diff = (a - b).abs().max().item() if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.shape == b.shape else "n/a"
        return f"{key}: plain {_describe(a)} vs fcdp {_describe(b)} (max |diff| {diff})"
    return None


# -- 1. the run-ahead and parameters without a cache slot ----------------------------------------------------------
RECORDS = ("train_a", "train_b", "eval_fwd", "after_load_fwd", "after_edit_fwd", "train_c", "final_fwd", "train_d",
           "after_step_load_fwd", "train_e", "weights")


@pytest.fixture(scope="module")
def uncached():
    with tempfile.TemporaryDirectory() as ckpt_dir:
        return run_ranks("freshness:uncached", 4, ckpt_dir=ckpt_dir)


def test_ranks_import_this_tree(uncached):
    assert all(r["package"] == ROOT for r in uncached), (ROOT, {r["package"] for r in uncached})


@pytest.mark.parametrize("name, reference", [
    ("runahead", "plain"), ("runahead_off", "plain"), ("push", "plain"),
    ("runahead_default_regime", "plain_default_regime"), ("push_default_regime", "plain_default_regime"),
    ("over_budget", "plain"), ("over_budget_push", "plain")])
def test_uncached_parameters_match_zero3_bit_for_bit(uncached, name, reference):
    """Every loss, output and final weight of the sequence equals plain ZeRO-3's (``first_difference`` names the
    first that does not)."""
    for rank, r in enumerate(uncached):
        diff = first_difference(r[reference], r[name], RECORDS)
        assert diff is None, f"rank {rank}, {name} vs {reference}: first difference at {diff}; stats {r[name]['stats']}"


def test_the_scenarios_are_what_they_claim(uncached):
    """The LayerNorm (two parameters) is the only one below ``min_numel``; over the budget some Linear weight has no
    slot while the LayerNorm has one; the run-ahead variants issued groups ahead and the one turned off did not."""
    for r in uncached:
        for name in ("runahead", "runahead_off", "push", "runahead_default_regime", "push_default_regime"):
            s = r[name]["stats"]
            assert s["uncached_reasons"] == {"smaller than fcdp.min_numel": 2} and s["cached_params"] == 6, (name, s)
        for name in ("runahead", "push", "push_default_regime"):
            assert r[name]["stats"].get("param_push_groups", 0) > 0, (name, r[name]["stats"])
        assert r["runahead_off"]["stats"].get("param_push_groups", 0) == 0, r["runahead_off"]["stats"]
        for name in ("over_budget", "over_budget_push"):
            s, cached = r[name]["stats"], r[name]["cached_names"]
            assert s["uncached_params"] >= 1 and s["cached_params"] >= 3, (name, s)
            if cached is not None:  # FCDP's internals: which ones got a slot
                assert {"ln.weight", "ln.bias"} <= set(cached) and "fc3.weight" not in cached, (name, cached)


def test_the_edit_and_the_load_changed_the_outputs(uncached):
    """The sequence exercises what it should: the load and the LayerNorm edit change plain ZeRO-3's outputs, and both
    loads restore the same weights."""
    for r in uncached:
        for reference in ("plain", "plain_default_regime"):
            p = r[reference]
            assert not torch.equal(p["eval_fwd"], p["after_load_fwd"])
            assert not torch.equal(p["after_load_fwd"], p["after_edit_fwd"])
            assert torch.equal(p["after_step_load_fwd"], p["after_load_fwd"])  # the same checkpoint, the same input


def _has_freshness_module() -> bool:
    import importlib.util
    return importlib.util.find_spec("fcdp_deepspeed.storage.freshness") is not None


@pytest.mark.skipif(not _has_freshness_module(), reason="no fcdp_deepspeed/storage/freshness.py (no check at use)")
def test_without_the_check_at_use_a_pushed_group_is_read_stale():
    """The broken variant: ``freshness.is_current`` always true. A load right after a step writes the LayerNorm's
    partitions while the group pushed at the step's end holds them (no invalidation names a parameter without a cache
    slot), and only the check at its use keeps it from being read: everything before that load is still ZeRO-3's, the
    forward after it is not."""
    with tempfile.TemporaryDirectory() as ckpt_dir:
        res = run_ranks("freshness:uncached", 4, ckpt_dir=ckpt_dir, variants=("plain", "push"), break_check=True)
    for rank, r in enumerate(res):
        assert r["package"] == ROOT and r["check_broken"]
        diff = first_difference(r["plain"], r["push"], RECORDS)
        assert diff is not None and diff.startswith("after_step_load_fwd:"), f"rank {rank}: first difference at {diff}"


# -- 2. two engines over one module --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_engines():
    return run_ranks("freshness:two_engines", 4)


@pytest.mark.parametrize("kind", ["inference_and_training", "two_training_destroyed"])
def test_two_engines_over_one_module_match_zero3(two_engines, kind):
    """Equal losses, outputs and weights to plain ZeRO-3's two engines doing the same: the later engine shares the
    first one's slots ([Note: two engines over one model] in ``runtime/attach.py``), which the check at use keeps
    current against the later engine's writes."""
    assert all(r["package"] == ROOT for r in two_engines)
    for rank, r in enumerate(two_engines):
        plain, fcdp = r[kind]["plain"], r[kind]["fcdp"]
        assert fcdp["raised"] is None, f"rank {rank}: {fcdp['raised']}"
        diff = first_difference(plain, fcdp, ("losses", "outputs", "weights"))
        assert diff is None, f"rank {rank}, {kind}: first difference at {diff}"


def test_a_failed_build_leaves_nothing_on_the_partition_hooks():
    """A build that fails after attaching removes its cache and listeners from the model's ``zero.Init`` hooks, so a
    later engine over the model is not handed the failed engine's entries (which have no slots)."""
    for rank, r in enumerate(run_ranks("freshness:failed_start", 4)):
        assert "injected" in r["first"] and r["hooks"] >= 1, (rank, r)
        assert r["caches"] == 0 and r["listeners"] == 0, (rank, r)


# -- 3. the run-ahead's trace in an optimizer-less engine ----------------------------------------------------------
@pytest.fixture(scope="module")
def inference():
    return run_ranks("freshness:inference_trace", 4, forwards=50, probe_at=10)


@pytest.mark.parametrize("name", ["small_uncached", "all_uncached"])
def test_optimizer_less_runahead_trace_stays_bounded(inference, name):
    """No run-ahead in an engine that never steps, or a trace no longer after 50 forwards than after 10."""
    assert all(r["package"] == ROOT for r in inference)
    for rank, r in enumerate(inference):
        rec = r[name]
        assert rec["class"] == "FCDPZeROOffload"
        if rec["has_runahead"]:
            assert rec["trace_at_end"] <= rec["trace_at_probe"], \
                f"rank {rank}, {name}: trace {rec['trace_at_probe']} after 10 forwards, {rec['trace_at_end']} after 50"


@pytest.mark.parametrize("name", ["small_uncached", "all_uncached"])
def test_optimizer_less_outputs_match_zero3(inference, name):
    for r in inference:
        assert torch.equal(r[name]["out"][0], r["plain_out"][0]) and torch.equal(r[name]["out"][-1], r["plain_out"][1])
