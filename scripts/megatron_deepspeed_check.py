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

from fcdp_lab.megatron_compare import compare_results

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
    # fcdp.layered splits a layer's first dimension; Megatron's GPT is sequence-first: the run must be refused.
    layered = {"layered": 2}
    for name, enabled, extra in (("zero3", False, {}), ("fcdp", True, zero3_grads), ("fcdp_node", True, node),
                                 ("fcdp_layered", True, layered)):
        # ZeRO-3 keeps the (disabled) block only so the probe counts bytes with the same node layout.
        cfg = dict(base, fcdp={"enabled": enabled, "ranks_per_node": args.ranks_per_node, **extra})
        (out / f"ds_{name}.json").write_text(json.dumps(cfg, indent=2) + "\n")
        print(f"configs: {out / f'ds_{name}.json'}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Every FCDP run against the ZeRO-3 run of the same TP (fcdp_lab.megatron_compare)."""
    results = Path(args.results_dir)
    ok, summary, lines = compare_results(results, expect_saving=args.expect_saving)
    print("\n".join(lines))
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"compare: {'PASS' if ok else 'FAIL'} (summary in {results / 'summary.json'})")
    return 0 if ok else 1


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
