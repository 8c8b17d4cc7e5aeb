"""Helpers for scripts/megatron_deepspeed_check.sh: patch a Megatron-DeepSpeed checkout for CPU and
DeepSpeed 0.19.8, make a tiny synthetic dataset with Megatron's own preprocessing tool, write the
DeepSpeed configs, and compare the runs.

    python scripts/megatron_deepspeed_check.py patch MEGATRON_DIR [--check]
    python scripts/megatron_deepspeed_check.py data MEGATRON_DIR OUT_DIR
    python scripts/megatron_deepspeed_check.py configs OUT_DIR --global-batch N --micro-batch N
    python scripts/megatron_deepspeed_check.py compare RESULTS_DIR

Nothing of Megatron-DeepSpeed lives in this repository: ``patch`` edits the given checkout in
place (three small, idempotent text edits; see ``FIXES``), everything else only runs its code.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

# (file, what it fixes, old text, new text). Each edit is applied only where the old text is found
# verbatim, so re-running is a no-op and an upstream fix of one problem leaves the others working.
FIXES = [
    (
        "megatron/training.py",
        "torchvision imported unconditionally (knn_monitor is only used by the vision models)",
        "from megatron.model.vision.knn_monitor import compute_feature_bank\n",
        "try:  # [fcdp cpu-compat] knn_monitor imports torchvision; only vision pretraining needs it\n"
        "    from megatron.model.vision.knn_monitor import compute_feature_bank\n"
        "except ImportError:\n"
        "    compute_feature_bank = None\n",
    ),
    (
        "megatron/training.py",
        "deepspeed.compression.compress was removed in DeepSpeed 0.19 (only compression training uses it)",
        "from deepspeed.compression.compress import init_compression, redundancy_clean\n",
        "try:  # [fcdp cpu-compat] removed in DeepSpeed 0.19; only --deepspeed compression_training uses it\n"
        "    from deepspeed.compression.compress import init_compression, redundancy_clean\n"
        "except ImportError:\n"
        "    init_compression = redundancy_clean = None\n",
    ),
    (
        "megatron/model/transformer.py",
        "CoreAttention .view() on non-contiguous q/k/v slices (Megatron-DeepSpeed PR #469 fixes it upstream)",
        "        query_layer = query_layer.view(output_size[2],\n"
        "                                       output_size[0] * output_size[1], -1)\n"
        "        # [sk, b, np, hn] -> [sk, b * np, hn]\n"
        "        key_layer = key_layer.view(output_size[3],\n"
        "                                   output_size[0] * output_size[1], -1)\n",
        "        query_layer = query_layer.reshape(output_size[2],  # [fcdp cpu-compat] q/k/v are strided slices\n"
        "                                       output_size[0] * output_size[1], -1)\n"
        "        # [sk, b, np, hn] -> [sk, b * np, hn]\n"
        "        key_layer = key_layer.reshape(output_size[3],\n"
        "                                   output_size[0] * output_size[1], -1)\n",
    ),
    (
        "megatron/model/transformer.py",
        "CoreAttention .view() on the non-contiguous value slice (same problem as above)",
        "        value_layer = value_layer.view(value_layer.size(0),\n"
        "                                       output_size[0] * output_size[1], -1)\n",
        "        value_layer = value_layer.reshape(value_layer.size(0),  # [fcdp cpu-compat]\n"
        "                                       output_size[0] * output_size[1], -1)\n",
    ),
]


def cmd_patch(args: argparse.Namespace) -> int:
    root = Path(args.megatron_dir)
    if not (root / "pretrain_gpt.py").is_file() or not (root / "megatron").is_dir():
        print(f"patch: {root} is not a Megatron-DeepSpeed checkout (no pretrain_gpt.py / megatron/)", file=sys.stderr)
        return 2
    texts: dict[str, str] = {}
    originals: dict[str, str] = {}
    missing = 0
    for rel, what, old, new in FIXES:
        if rel not in texts:
            texts[rel] = originals[rel] = (root / rel).read_text()
        text = texts[rel]
        if new in text:
            state = "already applied"
        elif text.count(old) == 1:
            texts[rel] = text.replace(old, new)
            state = "would apply" if args.check else "applied"
        else:
            # Not found: fixed upstream in another way, or the code moved. The run will tell.
            state = "NOT FOUND (checkout differs; skipped)"
            missing += 1
        print(f"  {rel}: {what}: {state}")
    for rel, text in texts.items():
        if text != originals[rel]:
            if not args.check:
                (root / rel).write_text(text)
            diff = difflib.unified_diff(originals[rel].splitlines(True), text.splitlines(True),
                                        f"a/{rel}", f"b/{rel}", n=1)
            sys.stdout.writelines("    " + line for line in diff)
    if missing:
        print(f"patch: {missing} edit(s) not found in {root}; continuing (they may be fixed upstream)")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """Random token-id documents -> jsonl -> Megatron's tools/preprocess_data.py (NullTokenizer)."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / "synthetic"
    done = Path(f"{prefix}_text_document.idx")
    if done.exists():
        print(f"data: {done} exists, reusing")
        return 0
    rng = random.Random(1234)
    jsonl = out / "synthetic.jsonl"
    with jsonl.open("w") as f:
        for _ in range(args.docs):
            # Mostly a fixed successor per token (a learnable bigram chain), so the loss falls quickly.
            ids = [rng.randrange(args.vocab_size)]
            for _ in range(rng.randrange(40, 200)):
                ids.append((7 * ids[-1] + 3) % args.vocab_size if rng.random() < 0.8 else rng.randrange(args.vocab_size))
            f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
    cmd = [sys.executable, str(Path(args.megatron_dir) / "tools" / "preprocess_data.py"),
           "--input", str(jsonl), "--output-prefix", str(prefix),
           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size),
           "--dataset-impl", "mmap", "--append-eod", "--workers", "1"]
    print("data: " + " ".join(cmd))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.megatron_dir, os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, check=True, env=env, cwd=args.megatron_dir)
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "steps_per_print": args.steps_per_print,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            # The tiny model's tensors are all under DeepSpeed's default 1e5-element threshold,
            # which would keep every parameter resident and leave nothing to gather or cache.
            "stage3_param_persistence_threshold": 0,
        },
        "wall_clock_breakdown": False,
    }
    if args.release == "large":
        # What a model larger than device memory does: release every parameter after use and
        # gather it again in backward. With DeepSpeed's defaults (--release default) a model
        # this small stays gathered from forward to backward, and there is no second gather to save.
        base["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    node = {"grad_accumulation": "node"}  # implies grad_reduce: hierarchical
    zero3_grads = {"grad_reduce": "flat", "grad_accumulation": "rank"}  # "fcdp" is compared bit for bit
    for name, enabled, extra in (("zero3", False, {}), ("fcdp", True, zero3_grads), ("fcdp_node", True, node)):
        # ZeRO-3 keeps the (disabled) block only so the probe counts bytes with the same node layout.
        cfg = dict(base, fcdp={"enabled": enabled, "ranks_per_node": args.ranks_per_node, **extra})
        (out / f"ds_{name}.json").write_text(json.dumps(cfg, indent=2) + "\n")
        print(f"configs: {out / f'ds_{name}.json'}")
    return 0


def _load_run(run_dir: Path) -> list[dict] | None:
    files = sorted(run_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        return None
    return [json.loads(p.read_text()) for p in files]


def _per_step_bytes(ranks: list[dict], key: str = "inter_node_allgather_bytes") -> list[float]:
    """``key`` (a cumulative get_stats counter) received per step, averaged over ranks; the zero point
    is the value read after deepspeed.initialize where the probe recorded it (``<key>_at_init``)."""
    per_rank = []
    for r in ranks:
        cumulative = [s.get(key) or 0 for s in r["steps"]]
        start = r.get(f"{key}_at_init", 0)
        per_rank.append([b - a for a, b in zip([start, *cumulative], cumulative)])
    return [sum(col) / len(col) for col in zip(*per_rank)]


#: Runs with gradient modes (``fcdp_node-*``) change the summation order: tolerances as in tests/test_grads.py.
RTOL = 1e-5


def _close_problems(r: int, b: dict, f: dict, base_dir: Path, run_dir: Path) -> list[str]:
    """Losses, grad norms and final weights of a gradient-mode run within RTOL of ZeRO-3's."""
    import torch

    problems = []
    for key in ("loss_hex", "grad_norm_hex"):
        a = [float.fromhex(s[key]) for s in b["steps"]]
        c = [float.fromhex(s[key]) for s in f["steps"]]
        if len(a) != len(c) or any(abs(x - y) > RTOL * abs(x) for x, y in zip(a, c)):
            problems.append(f"rank {r}: {key[:-4]} beyond {RTOL} relative: {a} vs {c}")
    wb = torch.load(base_dir / f"weights{r}.pt")
    wf = torch.load(run_dir / f"weights{r}.pt")
    for name, w in wb.items():
        a, c = w.double(), wf[name].double()
        if name.endswith("query_key_value.bias") and a.numel() % 3 == 0:
            # [Note: the key bias] The fused bias is [q | k | v]. Softmax is invariant to the key bias
            # (it adds the same q.b_k to every score of a query), so its exact gradient is 0 and the
            # computed one is rounding noise (~1e-10); Adam with eps 1e-8 turns that noise into updates of
            # about lr * noise / eps, so any other summation order, ZeRO-3's included, moves it
            # differently (measured: ~1e-4 of a 0.25-norm tensor after 10 steps). The exact result leaves
            # it at its initial value; neither run is closer to that. Only q and v are compared.
            a, c = torch.cat([a.view(3, -1)[0], a.view(3, -1)[2]]), torch.cat([c.view(3, -1)[0], c.view(3, -1)[2]])
        diff = (c - a).norm().item()
        if diff > RTOL * max(a.norm().item(), 1e-12):
            problems.append(f"rank {r}: weight {name} off by {diff:.3g} (norm {a.norm().item():.3g})")
    return problems


def cmd_compare(args: argparse.Namespace) -> int:
    """Every FCDP run against the ZeRO-3 run of the same TP: losses, grad norms, weights, bytes."""
    results = Path(args.results_dir)
    ok = True
    summary = []
    for tp_dir in sorted(p for p in results.iterdir() if p.is_dir()):
        base = _load_run(tp_dir / "zero3")
        if base is None:
            print(f"{tp_dir.name}: no ZeRO-3 results")
            ok = False
            continue
        for run_dir in sorted(p for p in tp_dir.iterdir() if p.is_dir() and p.name != "zero3"):
            run = _load_run(run_dir)
            label = f"{tp_dir.name} {run_dir.name}"
            if run is None or len(run) != len(base):
                print(f"{label}: incomplete results ({0 if run is None else len(run)} of {len(base)} ranks)")
                ok = False
                continue
            problems = []
            tolerant = run_dir.name.startswith("fcdp_node")
            for r, (b, f) in enumerate(zip(base, run)):
                if not f["fcdp_enabled"]:
                    problems.append(f"rank {r}: FCDP not enabled in this run")
                if b["fcdp_enabled"]:
                    problems.append(f"rank {r}: baseline ran with FCDP enabled")
                if tolerant:
                    problems += _close_problems(r, b, f, tp_dir / "zero3", run_dir)
                    continue
                if [s["loss_hex"] for s in b["steps"]] != [s["loss_hex"] for s in f["steps"]]:
                    problems.append(f"rank {r}: losses differ")
                if [s["grad_norm_hex"] for s in b["steps"]] != [s["grad_norm_hex"] for s in f["steps"]]:
                    problems.append(f"rank {r}: grad norms differ")
                if b["weights_sha256"] != f["weights_sha256"]:
                    bad = [k for k in b["param_sha256"] if b["param_sha256"][k] != f["param_sha256"].get(k)]
                    problems.append(f"rank {r}: final weights differ ({len(bad)} tensors, e.g. {bad[:3]})")
            steps = len(base[0]["steps"])
            # Bytes per step per rank, averaged over ranks, from the cumulative counter read after
            # deepspeed.initialize and after each step. The ratio is over steps 2..N (steady state;
            # step 1 is shown too).
            zsteps, fsteps = _per_step_bytes(base), _per_step_bytes(run)
            zb = sum(zsteps[1:]) / max(1, steps - 1)
            fb = sum(fsteps[1:]) / max(1, steps - 1)
            ratio = fb / zb if zb else float("nan")
            hits = sum(r["stats"].get("cache_hits", 0) for r in run)
            misses = sum(r["stats"].get("cache_misses", 0) for r in run)
            losses = [float.fromhex(s["loss_hex"]) for s in base[0]["steps"]]
            same = (f"within {RTOL} relative (gradient modes)" if tolerant else "bit-identical") if not problems else "DIFFER"
            zg, fg = (_per_step_bytes(x, "inter_node_grad_reduce_bytes") for x in (base, run))
            zgb, fgb = sum(zg[1:]) / max(1, steps - 1), sum(fg[1:]) / max(1, steps - 1)
            print(f"{label}: {steps} steps, lm loss {losses[0]:.6f} -> {losses[-1]:.6f}; "
                  f"losses/grad norms/weights {same} on all {len(run)} ranks")
            print(f"    inter-node gradient-reduction bytes per step per rank (steps 2-{steps}): ZeRO-3 {zgb:,.0f}, "
                  f"FCDP {fgb:,.0f} ({fgb / zgb if zgb else float('nan'):.2f}x)")
            print(f"    inter-node all-gather bytes per step per rank (steps 2-{steps}): ZeRO-3 {zb:,.0f}, "
                  f"FCDP {fb:,.0f} ({ratio:.2f}x); step 1: ZeRO-3 {zsteps[0]:,.0f}, FCDP {fsteps[0]:,.0f}")
            print(f"    FCDP cache hits {hits}, misses {misses} (all ranks); training loop "
                  f"ZeRO-3 {base[0]['train_seconds']:.0f}s, FCDP {run[0]['train_seconds']:.0f}s")
            for p in problems:
                print(f"    MISMATCH {p}")
            ok = ok and not problems
            if fb >= zb:
                if args.expect_saving:
                    ok = False
                    print("    MISMATCH FCDP did not reduce inter-node all-gather bytes")
                else:
                    print("    (no saving: ZeRO-3 keeps this model gathered from forward to backward)")
            summary.append({"tp": tp_dir.name, "run": run_dir.name, "steps": steps, "identical": not problems,
                            "losses": losses, "zero3_inter_node_allgather_bytes_per_step": zb,
                            "fcdp_inter_node_allgather_bytes_per_step": fb, "ratio": ratio,
                            "zero3_bytes_by_step": zsteps, "fcdp_bytes_by_step": fsteps,
                            "fcdp_cache_hits": hits, "fcdp_cache_misses": misses,
                            "zero3_inter_node_grad_reduce_bytes_per_step": zgb,
                            "fcdp_inter_node_grad_reduce_bytes_per_step": fgb})
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"compare: {'PASS' if ok and summary else 'FAIL'} (summary in {results / 'summary.json'})")
    return 0 if ok and summary else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("patch", help="apply the CPU/DeepSpeed-0.19.8 compatibility edits (idempotent)")
    p.add_argument("megatron_dir")
    p.add_argument("--check", action="store_true", help="only report what would change")
    p.set_defaults(func=cmd_patch)
    p = sub.add_parser("data", help="make a tiny indexed dataset with tools/preprocess_data.py")
    p.add_argument("megatron_dir")
    p.add_argument("out_dir")
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--vocab-size", type=int, default=255)
    p.set_defaults(func=cmd_data)
    p = sub.add_parser("configs", help="write ds_zero3.json and ds_fcdp.json")
    p.add_argument("out_dir")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps-per-print", type=int, default=1000)
    p.add_argument("--release", choices=["large", "default"], default="large",
                   help="ZeRO-3 release regime: large (stage3_max_reuse_distance=0, prefetch 0) or DeepSpeed's defaults")
    p.set_defaults(func=cmd_configs)
    p = sub.add_parser("compare", help="compare results/<tp>/<run>/rank*.json against results/<tp>/zero3")
    p.add_argument("results_dir")
    p.add_argument("--expect-saving", action="store_true",
                   help="fail unless FCDP cut the inter-node all-gather bytes (large release regime)")
    p.set_defaults(func=cmd_compare)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
