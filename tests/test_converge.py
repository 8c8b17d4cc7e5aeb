"""The convergence benchmark's pieces (``python -m fcdp_lab converge``): data split, model size, batches, the results writer
and resume logic, and one live few-step run on 4 ranks (simulated nodes) whose ranks must agree bit for bit.
The 500-step sweep itself is run by hand (docs/benchmarks.md)."""
from __future__ import annotations

import json

import pytest
import torch

from fcdp_lab.converge import (converge, reference as converge_reference, report as converge_report,
        textdata, tinylm)
from fcdp_lab.converge.model_hash import all_equal


def test_split_is_deterministic_disjoint_and_covers_the_corpus():
    data = textdata.corpus_bytes()
    a, b = textdata.split_corpus(data), textdata.split_corpus(textdata.corpus_bytes())
    assert (a.train, a.heldout, a.sha256) == (b.train, b.heldout, b.sha256)
    assert len(data) > 400_000 and len(a.train) + len(a.heldout) == len(data)
    assert 0.08 < len(a.heldout) / len(data) < 0.12
    chunks = [data[i:i + 2048] for i in range(0, len(data), 2048)]
    assert a.heldout.startswith(chunks[9]) and a.train.startswith(chunks[0] + chunks[1])
    assert textdata.split_corpus(b"abcdefghij", chunk=2, heldout_every=5).heldout == b"ij"


def test_windows_and_shards():
    tokens = textdata.as_tokens(bytes(range(256)) * 10)
    x1, y1 = textdata.train_batch(tokens, 16, 4, seed=0, step=3, rank=1)
    x2, y2 = textdata.train_batch(tokens, 16, 4, seed=0, step=3, rank=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, textdata.train_batch(tokens, 16, 4, seed=0, step=3, rank=2)[0])
    x, y = textdata.heldout_windows(tokens, 16)
    assert x.shape == (159, 16) and torch.equal(x.reshape(-1)[1:], y.reshape(-1)[:-1])
    shards = [textdata.shard(x, y, r, 4)[0] for r in range(4)]
    assert {s.shape[0] for s in shards} == {39}  # same count on every rank; the remainder is dropped
    assert sorted(int(s[i, 0]) for s in shards for i in range(39)) == sorted(int(v) for v in x[:156, 0])


def test_default_model_has_over_a_million_parameters_and_a_seeded_init():
    assert tinylm.num_params() >= 1_000_000
    a, b, c = tinylm.build(seed=0), tinylm.build(seed=0), tinylm.build(seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.fc.weight"], sc["blocks.0.fc.weight"])
    small = tinylm.build(tinylm.LMConfig(context=8, width=16, layers=1, heads=2))
    loss = tinylm.loss_fn(small(torch.zeros(2, 8, dtype=torch.long)), torch.zeros(2, 8, dtype=torch.long))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3  # near-uniform at init


def test_config_of_a_setting():
    spec = converge.ConvergeSpec(steps=40, warmup_steps=4)
    exact, int4 = converge.ds_config(spec, "exact", "fp32"), converge.ds_config(spec, "int4", "bf16")
    assert "param_compression" not in exact["fcdp"]  # exact = today's defaults
    assert (int4["fcdp"]["param_compression"], int4["fcdp"]["grad_compression"]) == ("int4", "int4")
    assert int4["bf16"] == {"enabled": True} and int4["scheduler"]["params"]["total_num_steps"] == 40
    assert converge.ds_config(spec, "gint8", "fp32")["fcdp"]["param_compression"] == "off"
    assert spec.fingerprint() == converge.ConvergeSpec(steps=40, warmup_steps=4, settings=["int4"]).fingerprint()
    assert spec.fingerprint() != converge.ConvergeSpec(steps=41, warmup_steps=4).fingerprint()



def test_diloco_setting_names():
    """``diloco{H}`` and its suffixes name the ``fcdp.diloco`` block; ``_ilr{x}`` scales only the job's own lr."""
    assert converge.diloco_block("exact") is None and not converge.known_setting("diloco10_bogus")
    assert converge.diloco_block("diloco10_lr1_mom0_ilr1.41") == {"sync_every": 10, "outer_lr": 1.0,
                                                                 "outer_momentum": 0.0}
    assert converge.diloco_block("diloco20_int4_hb_f4_ov2") == {"sync_every": 20, "compression": "int4",
                                                               "nesterov": False, "fragments": 4, "overlap_steps": 2}
    spec = converge.ConvergeSpec(steps=40, warmup_steps=4, lr=1e-3)
    assert converge.inner_lr_scale("exact") == converge.inner_lr_scale("diloco10") == 1.0
    cfg = converge.ds_config(spec, "diloco10_ilr2", "fp32")
    assert cfg["optimizer"]["params"]["lr"] == cfg["scheduler"]["params"]["warmup_max_lr"] == 2e-3
    assert cfg["fcdp"]["diloco"] == {"sync_every": 10}

def _record(setting: str, dtype: str, loss: float, nbytes: float, spec: converge.ConvergeSpec) -> dict:
    p, g = converge.SETTINGS[setting]
    curve = [{"step": s, "final": False, "heldout_loss": loss + 1 - s / 10, "tokens": 64,
              "cumulative_inter_node_bytes": s * nbytes} for s in range(0, 11, 5)]
    curve.append({**curve[-1], "final": True, "heldout_loss": loss})
    return {"key": converge.setting_key(setting, dtype), "setting": setting, "dtype": dtype, "param_compression": p,
            "grad_compression": g, "fingerprint": spec.fingerprint(), "curve": curve, "final_heldout_loss": loss,
            "inter_node_bytes_per_step": nbytes, "step_time_median_s": 0.5, "wall_s": 10.0, "launch_wall_s": 12.0,
            "bitwise_equal_across_ranks": True, "steps": 10, "params": 1_332_640, "nodes": 2, "world": 4,
            "rate_mbit": 1000, "bytes_source": "kernel", "codecs": converge.codecs(setting, spec.compression_block)}


def test_results_writer_summary_and_resume(tmp_path, monkeypatch):
    spec = converge.ConvergeSpec(steps=10, settings=["exact", "int4"], dtypes=["fp32"])
    records = {r["key"]: r for r in (_record("exact", "fp32", 2.0, 8e6, spec), _record("int4", "fp32", 2.01, 2e6, spec))}
    converge_report.write_results(records, tmp_path, order=["exact-fp32", "int4-fp32"])
    doc = json.loads((tmp_path / converge_report.RESULTS).read_text())
    row = next(r for r in doc["summary"] if r["setting"] == "int4")
    assert row["loss_vs_exact"] == pytest.approx(1.005) and row["bytes_vs_exact"] == pytest.approx(0.25)
    assert row["loss_target_met"] is True
    assert (tmp_path / converge_report.PLOT).stat().st_size > 10_000
    assert "| int4 | fp32 | int4 / int4 |" in (tmp_path / converge_report.SUMMARY).read_text()
    assert set(converge_report.load(tmp_path / converge_report.RESULTS)) == {"exact-fp32", "int4-fp32"}

    def no_launch(*args, **kwargs):
        raise AssertionError("a recorded setting with the same spec was run again")
    monkeypatch.setattr("fcdp_lab.harness.launch.run_local", no_launch)
    got = converge.run_converge(spec, tmp_path, netns=False, log=lambda *_: None)
    assert [r["key"] for r in got] == ["exact-fp32", "int4-fp32"]
    # a record of the same spec trained by the unrotated int4 codec (written before records named their codecs) is
    # not what this code runs: it is run again
    del records["int4-fp32"]["codecs"]
    converge_report.write_results(records, tmp_path, order=["exact-fp32", "int4-fp32"])
    with pytest.raises(AssertionError, match="was run again"):
        converge.run_converge(spec, tmp_path, netns=False, log=lambda *_: None)
    assert not all_equal(["a", "b"]) and all_equal(["a", "a"]) and not all_equal([])


def test_a_few_steps_on_four_ranks_agree_bit_for_bit(tmp_path):
    """Live: 2 simulated nodes x 2 ranks, a small model, 3 steps; held-out loss falls, bytes are counted, and
    every rank hashes the same model (gathered and as its forward sees it). One setting: the compressed ones
    differ only in the fcdp block (test_config_of_a_setting)."""
    spec = converge.ConvergeSpec(settings=["exact"], dtypes=["fp32"], steps=3, eval_every=2, eval_windows=8,
                                 context=32, width=32, layers=1, heads=2, warmup_steps=1, lr=1e-2, timeout_s=240)
    (rec,) = converge.run_converge(spec, tmp_path, netns=False, log=lambda *_: None)
    assert rec["bitwise_equal_across_ranks"] and len(set(rec["hashes"]["forward"])) == 1
    assert [p["step"] for p in rec["curve"]] == [0, 2, 3, 3] and rec["curve"][-1]["final"]
    assert rec["curve"][2]["heldout_loss"] < rec["curve"][0]["heldout_loss"]
    assert rec["inter_node_bytes_per_step"] > 0 and rec["bytes_source"] == "counted"
    assert (tmp_path / converge_report.PLOT).exists()



def test_diloco_trains_as_its_plain_pytorch_reference(tmp_path, monkeypatch):
    """Live: DiLoCo (H = 2, outer Nesterov lr 0.7, momentum 0.9) on 2 simulated nodes x 2 ranks follows
    ``converge_reference`` (one process, per-node AdamW replicas, DeepSpeed's schedule, ZeRO-3's clipping, the outer
    step on the mean pseudo-gradient) step for step: the per-node data, inner optimizer, clipping, schedule and
    sync are DiLoCo's, not only the outer step. The broken variant whose sync skips the 16-bit partitions
    (``FCDP_LAB_BREAK=diloco.skip_reassign``) departs from it."""
    spec = converge.ConvergeSpec(settings=["diloco2_lr0.7_mom0.9"], dtypes=["fp32"], steps=6, eval_every=3,
                                 eval_windows=8, context=32, width=32, layers=1, heads=2, warmup_steps=1, lr=1e-2,
                                 timeout_s=240)
    ref = converge_reference.train(spec, "diloco2_lr0.7_mom0.9")
    far = lambda rec: max(abs(a - b) for a, b in zip(rec["train_losses"], ref["train_losses"], strict=True))  # noqa: E731
    (rec,) = converge.run_converge(spec, tmp_path / "ok", netns=False, log=lambda *_: None)
    assert rec["bitwise_equal_across_ranks"] and rec["fcdp_stats"]["diloco_syncs"] == 3
    assert far(rec) < 1e-5 and abs(rec["final_heldout_loss"] - ref["final_heldout_loss"]) < 1e-5, (rec, ref)
    assert ref["train_losses"][-1] < ref["train_losses"][0]
    monkeypatch.setenv("FCDP_LAB_BREAK", "diloco.skip_reassign")
    (broken,) = converge.run_converge(spec, tmp_path / "broken", netns=False, log=lambda *_: None)
    assert far(broken) > 1e-3


def test_diloco_warmup_trains_as_its_plain_pytorch_reference(tmp_path):
    """Live: two exact warm-up steps (``fcdp.diloco.warmup_steps``: the nodes' gradients averaged, [Note: the
    warm-up]), then DiLoCo with H = 2 counted from there, follows the reference's warm-up (one mean gradient for
    every replica) and its syncs: the warm-up's summation order (node, then nodes) is the only difference."""
    spec = converge.ConvergeSpec(settings=["diloco2_wu2"], dtypes=["fp32"], steps=6, eval_every=3, eval_windows=8,
                                 context=32, width=32, layers=1, heads=2, warmup_steps=1, lr=1e-2, timeout_s=240)
    ref = converge_reference.train(spec, "diloco2_wu2")
    (rec,) = converge.run_converge(spec, tmp_path, netns=False, log=lambda *_: None)
    assert rec["bitwise_equal_across_ranks"] and rec["fcdp_stats"]["diloco_syncs"] == 2
    assert rec["fcdp_stats"]["diloco_warmup_grad_bytes"] > 0
    far = max(abs(a - b) for a, b in zip(rec["train_losses"], ref["train_losses"], strict=True))
    assert far < 1e-5 and abs(rec["final_heldout_loss"] - ref["final_heldout_loss"]) < 1e-5, (rec, ref)
    plain = converge_reference.train(spec, "diloco2")  # without the warm-up the run differs
    assert max(abs(a - b) for a, b in zip(plain["train_losses"], ref["train_losses"])) > 1e-3

def test_committed_convergence_run_meets_its_claims():
    """docs/results/compression/converge.json (the lead's quiet-machine sweep, once committed): >= 500 steps of a >= 1M-parameter
    model on 2 x 2 with kernel-counted bytes, trained with the codecs this code builds, every compressed setting
    within 1% of exact's held-out loss and the model bitwise equal on every rank."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "docs" / "results" / "compression" / converge_report.RESULTS
    assert path.exists(), "the committed run (python -m fcdp_lab converge, default --out)"
    doc = json.loads(path.read_text())
    for r in doc["records"]:
        assert r["steps"] >= 500 and r["params"] >= 1_000_000 and (r["nodes"], r["world"]) == (2, 4), r["key"]
        assert r["bytes_source"] == "kernel" and r["bitwise_equal_across_ranks"], r["key"]
        assert converge._recorded_codecs(r) == converge.codecs(r["setting"], r["compression_block"]), r["key"]
    for row in doc["summary"]:
        if row["setting"] == "exact":
            continue
        assert row["loss_vs_exact"] is not None, row
        assert row["loss_vs_exact"] <= converge_report.LOSS_RATIO_TARGET, row  # issue 23's 1% target
