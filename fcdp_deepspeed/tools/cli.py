"""The ``fcdp`` command: ``fcdp doctor``, ``fcdp plan``, ``fcdp demo``, ``fcdp bench``, ``fcdp converge``, ``fcdp soak``, ``fcdp configs``, ``fcdp --version``."""
from __future__ import annotations

import difflib
import sys
from typing import Optional

COMMANDS = {
    "doctor": ("fcdp_deepspeed.tools.doctor", "is FCDP installed and on here, and what would this config do"),
    "plan": ("fcdp_deepspeed.tools.plan.planner", "predict inter-node bytes, memory and step-time bounds for a cluster"),
    "demo": ("fcdp_deepspeed.tools.demo", "toy model with ZeRO-3 and FCDP on 4 CPU ranks"),
    "bench": ("fcdp_deepspeed.tools.bench.bench", "ZeRO-3 vs hpZ vs FCDP on an emulated bandwidth-limited cluster"),
    "converge": ("fcdp_deepspeed.tools.converge.converge", "exact vs int8/int4 inter-node compression: a tiny LM on real text"),
    "soak": ("fcdp_deepspeed.tools.fuzz.soak", "random event sequences against ZeRO-3 (docs/reliability.md)"),
    "configs": ("fcdp_deepspeed.tools.configs", "the shipped configs and examples: their paths, or a copy of one"),
}


def usage() -> str:
    lines = ["usage: fcdp {doctor,plan,demo,bench,converge,soak,configs} [options]   (fcdp COMMAND --help for its options)",
             "       fcdp --version", ""]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from fcdp_deepspeed.version import __version__
        print(f"fcdp-deepspeed {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"fcdp: unknown command '{argv[0]}'{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
