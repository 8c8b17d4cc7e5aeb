"""Entry point of one rank started by :func:`fcdp_lab.harness.launch.run_local`."""
from __future__ import annotations

import importlib
import os
import pickle
import sys
from pathlib import Path


def main() -> None:
    target, workdir = sys.argv[1], Path(sys.argv[2])
    module_name, func_name = target.split(":")
    from fcdp_lab import link_declaration, sabotage, strict
    # the test's broken variants and strict device mode, in this rank (a forked rank took its environment just now;
    # its server never had FCDP_LAB_BREAK: harness/forkserver.py)
    sabotage.install()
    link_declaration.install()
    strict.install_if_requested()
    with open(workdir / "kwargs.pkl", "rb") as f:
        kwargs = pickle.load(f)
    result = getattr(importlib.import_module(module_name), func_name)(**kwargs)
    rank = os.environ.get("RANK", "0")
    with open(workdir / f"rank{rank}.pkl.tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(workdir / f"rank{rank}.pkl.tmp", workdir / f"rank{rank}.pkl")
    # gloo ranks can abort in interpreter teardown after a good run: end cleanly, then exit hard.
    from deepspeed import comm as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
