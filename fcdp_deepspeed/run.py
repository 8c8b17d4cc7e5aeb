"""Zero-code-change entry: install FCDP, then run a training script exactly as Python would.

    python -m fcdp_deepspeed.run train.py --deepspeed_config ds.json ...
    deepspeed --module fcdp_deepspeed.run train.py ...
    torchrun --nproc_per_node 8 -m fcdp_deepspeed.run train.py ...
    python -m fcdp_deepspeed.run -m my_package.train ...      # a module instead of a script

The script runs as ``__main__`` with ``sys.argv`` = [script, args...]. Jobs whose DeepSpeed config
has no enabled ``fcdp`` block run as plain ZeRO-3.
"""
from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m fcdp_deepspeed.run (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or ""))
        raise SystemExit(0 if argv else 2)
    # `deepspeed --module fcdp_deepspeed.run script.py` puts its --local_rank=N before the script:
    # hand it to the script, where the launcher would have put it without us.
    launcher_args = []
    while argv and argv[0].startswith(("--local_rank", "--local-rank")):
        launcher_args.append(argv.pop(0))
    if not argv:
        raise SystemExit(USAGE)
    argv = [argv[0], *launcher_args, *argv[1:]] if argv[0] != "-m" else ["-m", argv[1], *launcher_args, *argv[2:]]
    import fcdp_deepspeed
    fcdp_deepspeed.install()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.exists(script):
        raise SystemExit(f"fcdp_deepspeed.run: no such script: {script}\n{USAGE}")
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
