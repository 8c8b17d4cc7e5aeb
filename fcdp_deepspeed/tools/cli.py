"""The ``fcdp`` command: ``fcdp doctor``, ``fcdp plan``, ``fcdp configs``, ``fcdp --version``.

The demo, the bench, the convergence runs and the event sequences belong to the repository's lab
(``python -m fcdp_lab COMMAND`` from a checkout), not to the installed package."""
from __future__ import annotations

import difflib
import sys
from typing import Callable, Optional

COMMANDS = {
    "doctor": ("fcdp_deepspeed.tools.doctor", "is FCDP installed and on here, and what would this config do"),
    "plan": ("fcdp_deepspeed.tools.plan.planner", "predict inter-node bytes, memory and step-time bounds for a cluster"),
    "configs": ("fcdp_deepspeed.tools.configs", "the shipped configs and examples: their paths, or a copy of one"),
}
#: The repository's lab commands (``python -m fcdp_lab``): named here only to point a user to them.
LAB_COMMANDS = ("demo", "bench", "converge", "soak")


def usage() -> str:
    lines = ["usage: fcdp {doctor,plan,configs} [options]   (fcdp COMMAND --help for its options)",
             "       fcdp --version", ""]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    from fcdp_deepspeed.tools.args import project_url
    url = project_url()
    if url:
        lines += ["", f"documentation: {url}"]
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
    if argv[0] in LAB_COMMANDS:
        print(f"fcdp: '{argv[0]}' is a lab command of the repository, not of the installed package: from a "
              f"checkout, run `python -m fcdp_lab {argv[0]}` (after `source scripts/setup_env.sh test,hf,bench`)",
              file=sys.stderr)
        return 2
    return dispatch("fcdp", COMMANDS, argv, usage)


def dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str], usage: Callable[[], str]) -> int:
    """Run ``argv[0]``'s module's ``main(argv[1:])``, or name the nearest command (exit 2). The lab's commands
    (``python -m fcdp_lab``) dispatch the same way."""
    if argv[0] not in commands:
        close = difflib.get_close_matches(argv[0], list(commands), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"{prog}: unknown command '{argv[0]}'{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(commands[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
