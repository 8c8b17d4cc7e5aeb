"""Argument checking shared by the ``fcdp`` subcommands: one clear error per bad value, defaults in ``--help``.

Every subcommand builds its parser with :func:`parser` and its numbers with the type checkers below, so
bad input ends in ``fcdp <cmd>: error: argument --nodes: expected a whole number >= 1, got '0'`` (exit 2)
rather than a traceback, and ``--help`` shows each default.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and ``(default: X)`` after every option that has a default and
    does not say it already (options whose default is filled in later write it into their help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def parser(prog: str, description: Optional[str]) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` named ``prog`` (``fcdp plan``, ...), whatever ``sys.argv[0]`` is."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def _number(kind: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    check.__name__ = what  # argparse names the type in some messages
    return check


def whole(minimum: int = 1) -> Callable[[str], int]:
    """A whole number >= ``minimum``."""
    return _number(int, f"a whole number >= {minimum}", lambda v: v >= minimum)


def positive() -> Callable[[str], float]:
    """A finite number > 0."""
    return _number(float, "a number > 0", lambda v: v > 0)


def non_negative() -> Callable[[str], float]:
    """A finite number >= 0."""
    return _number(float, "a number >= 0", lambda v: v >= 0)


def fraction(low_open: bool = True) -> Callable[[str], float]:
    """A fraction in (0, 1] (``low_open``) or [0, 1]."""
    if low_open:
        return _number(float, "a fraction in (0, 1]", lambda v: 0 < v <= 1)
    return _number(float, "a fraction in [0, 1]", lambda v: 0 <= v <= 1)


def choice_list(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A comma-separated list whose items are all in ``allowed``."""
    def check(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return items
    return check


def number_list(item: Callable[[str], Any]) -> Callable[[str], list]:
    """A comma-separated list of values, each checked by ``item``."""
    def check(text: str) -> list:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return [item(x) for x in parts]
    return check


def plural(n: int, word: str) -> str:
    """``"1 node"``, ``"2 nodes"`` (the same as ``fcdp_deepspeed.reporting.stats.plural``, without torch)."""
    return f"{n} {word}" + ("" if n == 1 else "s")


#: ``[project.urls]`` labels, in the order a user looking for the documentation wants them.
_URL_ORDER = ("documentation", "docs", "homepage", "home", "repository", "source")


def project_url() -> str:
    """The project's URL from the installed package's metadata (``[project.urls]`` in ``pyproject.toml``): where an
    installed user finds the documentation, which a wheel does not ship (``docs/`` is the checkout's)."""
    from importlib import metadata
    try:
        entries = metadata.metadata("fcdp-deepspeed").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        entries = []
    urls = {label.strip().lower(): url.strip() for label, _, url in (e.partition(",") for e in entries) if url.strip()}
    return next((urls[k] for k in _URL_ORDER if k in urls), next(iter(urls.values()), ""))
