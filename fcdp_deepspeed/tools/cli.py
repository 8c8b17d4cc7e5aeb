"""The ``fcdp`` command: ``fcdp bench``, ``fcdp converge``, ``fcdp plan``, ``fcdp demo``."""
from __future__ import annotations

import sys
from typing import Optional

COMMANDS = {
    "bench": ("fcdp_deepspeed.tools.bench", "ZeRO-3 vs hpZ vs FCDP on an emulated bandwidth-limited cluster"),
    "converge": ("fcdp_deepspeed.tools.converge", "exact vs int8/int4 inter-node compression: a tiny LM on real text"),
    "plan": ("fcdp_deepspeed.tools.planner", "predict inter-node bytes, memory and step-time bounds for a cluster"),
    "demo": ("fcdp_deepspeed.tools.demo", "toy model with ZeRO-3 and FCDP on 4 CPU ranks"),
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: fcdp {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<8} {help_}")
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    import importlib
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
