"""GPU check: what the CPU tests cannot see, in one command (at most ~5 minutes), with a JSON report.

    python scripts/gpu_check.py --json gpu_check.json            # on a machine with an NVIDIA GPU
    python scripts/gpu_check.py --json out.json --dry-run-cpu     # same logic on the CPU accelerator

One GPU: (a) the node-gradient flush path with a host buffer on NCCL (world size 1, real values), and the
memory FCDP's communicator warm-up takes; (b) a fake world of 4 (2 nodes x 2) through deepspeed.initialize:
FCDP host/device/auto vs ZeRO-3 peak memory, synchronizations and synchronous copies per step, H2D/compute
overlap; (d) the same under TORCH_CUDA_SANITIZER=1 (stream races); (e) pinning time and pinned bytes vs the
cgroup, H2D GB/s with every local GPU copying at once; (f) the inter-node codec on the device (deterministic,
within its error, time per call); (g) DiLoCo (2 workers, H = 30, outer Nesterov) against data parallelism at the same
tokens on a ~11M-parameter byte-level model of the standard library's source, plain PyTorch: the gap against the
scaling-law anchor. 4 or more GPUs also: (c) real NCCL, 2 emulated nodes:
losses vs ZeRO-3, step times vs ZeRO-3 and ZeRO++ hpZ, the two-stage gather's stage timeline.
Exits 0 when every check passes, 1 when one fails, 2 when there is no GPU. See docs/gpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def gpu_count() -> int:
    """Visible CUDA devices, probed before DeepSpeed is imported (so a machine without one gets one line)."""
    try:
        with warnings.catch_warnings():  # a broken driver warns: keep the refusal to one line
            warnings.simplefilter("ignore")
            import torch
            return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken torch install: no usable GPU
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="OUT", default=None, help="write the report here")
    ap.add_argument("--dry-run-cpu", action="store_true", help="development: run the logic on the CPU accelerator")
    ap.add_argument("--hidden", type=int, default=None, help="toy model width (default 1024 on a GPU, 32 dry)")
    ap.add_argument("--layers", type=int, default=None, help="toy model depth (default 32 on a GPU, 3 dry)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per variant (>= 3 for auto at step 3)")
    ap.add_argument("--cases", default="", help="case letters to run, e.g. bd (default: every case that fits)")
    args = ap.parse_args(argv)
    gpus = gpu_count()
    if not gpus and not args.dry_run_cpu:
        print("gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or add --dry-run-cpu to exercise the logic on the CPU", file=sys.stderr)
        return 2
    from fcdp_lab.gpu import check as gpu_check
    dry = args.dry_run_cpu
    report = gpu_check.run(dry_run=dry, gpus=0 if dry else gpus, hidden=args.hidden or (32 if dry else 1024),
                           layers=args.layers or (3 if dry else 32), steps=args.steps, only=args.cases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(gpu_check.summary(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
