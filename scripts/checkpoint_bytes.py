"""Checkpoint bytes of plain ZeRO-3 and of FCDP's lossy settings (issue 33, docs/compression.md).

    python scripts/checkpoint_bytes.py [--hidden 256] [--layers 4]

Four ranks on this machine (2 nodes x 2 via ``fcdp.ranks_per_node``, gloo), the toy MLP in bf16 with Adam: each
setting trains 2 steps, saves a checkpoint and reports the bytes of its tag directory (every rank's files) and per
trainable parameter. Run it against another checkout by putting that checkout's package first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {
    "zero3": None,
    "fcdp_exact": {},
    "param_int8": {"param_compression": "int8"},
    "param_int8_grad_int8": {"param_compression": "int8", "grad_compression": "int8"},
}


def measure(ckpt_dir: str, hidden: int, layers: int) -> dict:
    """Rank worker: every setting in turn, the tag directory's bytes (rank 0 reads them after a barrier)."""
    from deepspeed import comm as dist

    from fcdp_lab.harness import toy
    from workers.common import fcdp_block, setup
    setup(2)
    out = {}
    for name, extra in SETTINGS.items():
        block = None if extra is None else fcdp_block(2, grad_reduce="hierarchical", grad_accumulation="rank", **extra)
        engine = toy.build_engine(toy.ds_config(block, dtype="bf16"), hidden=hidden, layers=layers)
        toy.train(engine, 2, hidden=hidden, dtype=__import__("torch").bfloat16)
        engine.save_checkpoint(ckpt_dir, tag=name)
        dist.barrier()
        tag = os.path.join(ckpt_dir, name)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tag) for f in fs)
        params = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
        out[name] = {"bytes": size, "bytes_per_param": round(size / params, 2), "params": params}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from fcdp_lab.harness.launch import run_local
    with tempfile.TemporaryDirectory() as ckpt:
        res = run_local("checkpoint_bytes:measure", 4, {"ckpt_dir": ckpt, "hidden": args.hidden, "layers": args.layers},
                        timeout=900, pythonpath=[os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")])
    print(json.dumps(res[0], indent=1))


if __name__ == "__main__":
    main()
