"""Bad input into messages: one message per bad key of the ``"fcdp"`` block, each with the fix, and the
blocks DeepSpeed would otherwise ignore or reject without a hint (misplaced, misspelled top-level key).

Standard library and pydantic's error dicts only: :mod:`fcdp_deepspeed.config` hands in its fields, so
this module imports nothing of the package (no import circle).

[Note: why not pydantic's messages] A union-typed key gets one line per member of the union ("valid
integer ... valid string") and none names the fix; an unknown key gets the allowed list but not the
nearest one. Here every key gets one line: what it expects, the nearest allowed value or key
(:mod:`difflib`), and the fix.
"""
from __future__ import annotations

import difflib
import json
import typing
from typing import Any, Iterable, Mapping

FCDP_KEY = "fcdp"


class FCDPConfigError(ValueError):
    """A bad ``fcdp`` block or a DeepSpeed config FCDP cannot run with. The message names the fix;
    ``problems`` holds one message per problem (``fcdp doctor`` lists them all)."""

    def __init__(self, message: str, problems: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems) or (message,)


def sub_block_error(block_key: str, first: Mapping[str, Any], fixes: Mapping[str, str]) -> ValueError:
    """The error of a sub-block's (``fcdp.diloco``, ``fcdp.layered``) first pydantic error ``first``, naming
    ``block_key.<key>`` and the fix (``fixes``: key -> what it takes); a message of the block's own validators, which
    already starts with ``block_key``, passes through."""
    loc = first.get("loc") or ()
    key = str(loc[0]) if loc else ""
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    if msg.startswith(block_key):
        return ValueError(msg)
    if first.get("type") == "extra_forbidden":
        return ValueError(f"{block_key}.{key}: unknown key{did_you_mean(key, fixes)}. Fix: use one of "
                          f"{', '.join(sorted(fixes))}.")
    return ValueError(f"{block_key}.{key} = {first.get('input')!r}: expected {fixes.get(key, msg)}. Fix: set "
                      f"{block_key}.{key} to {fixes.get(key, 'a valid value')}, or leave it out for the default.")


def did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the nearest of ``candidates``, or ``""``."""
    if not isinstance(word, str) or not word.strip():
        return ""
    candidates = list(candidates)
    low = word.strip().lower()
    close = [c for c in candidates if c.startswith(low)] or difflib.get_close_matches(low, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def expected(field: Any) -> str:
    """What a pydantic field accepts, in words (from its annotation and ``Field`` constraints)."""
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Union:  # Optional[X]: X (null means the default)
        annotation = [a for a in typing.get_args(annotation) if a is not type(None)][0]
    if typing.get_origin(annotation) is typing.Literal:
        text = "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    elif annotation is bool:
        text = "true or false"
    elif annotation is int:
        bounds = {type(m).__name__: m for m in field.metadata}
        low = getattr(bounds.get("Ge"), "ge", None)
        high = getattr(bounds.get("Le"), "le", None)
        text = "a whole number" + (f" >= {low}" if low is not None else "") + (f" and <= {high}" if high is not None else "")
        if "MultipleOf" in bounds:
            text += f", a multiple of {bounds['MultipleOf'].multiple_of}"
        if (field.json_schema_extra or {}).get("sizes"):
            text += " of bytes or a size such as \"32MiB\""
    else:
        text = "a valid value"
    return text


def _choices(field: Any) -> tuple[str, ...]:
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(v) for v in typing.get_args(annotation))
    return ()


def unknown_key(key: str, allowed: Iterable[str]) -> str:
    allowed = sorted(allowed)
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    fix = f"rename it to {close[0]}" if close else "remove it or use one of the allowed keys"
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key {FCDP_KEY}.{key}{hint}. Fix: {fix}. Allowed keys: {', '.join(allowed)}."


def validation_problems(errors: list[dict], fields: Mapping[str, Any]) -> list[str]:
    """One message per key from pydantic's ``ValidationError.errors()`` (see the module note)."""
    by_key: dict[str, list[dict]] = {}
    for e in errors:
        loc = e.get("loc") or ()
        by_key.setdefault(str(loc[0]) if loc else "", []).append(e)
    out = []
    for key, errs in by_key.items():
        first = errs[0]
        msg = str(first.get("msg", "")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            out.append(unknown_key(key, fields))
        elif msg.startswith(f"{FCDP_KEY}.") or key not in fields:  # our validators' own messages name the fix
            out.append(msg)
        else:
            field, value = fields[key], first.get("input")
            want = expected(field)
            default = "" if field.default is None else f" ({json.dumps(field.default)})"
            out.append(f"{FCDP_KEY}.{key} = {value!r}: expected {want}{did_you_mean(value, _choices(field))}. "
                       f"Fix: {_how_to_write(value, want) or f'set {FCDP_KEY}.{key} to {want}'}, or leave it out "
                       f"for the default{default}.")
    return out


def _how_to_write(value: Any, want: str) -> str:
    """The JSON spelling of a value given in the wrong type (strict types: see FCDPConfig's note), or ``""``."""
    if want == "true or false":
        truthy = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
        meant = truthy.get(str(value).strip().lower()) if isinstance(value, (str, int)) else None
        if meant is not None:
            return f"write {json.dumps(meant)} (a JSON boolean, no quotes)"
    if want.startswith("a whole number") and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            return ""
        if number.is_integer():
            return f"write {int(number)} (a JSON number" + (", no quotes)" if isinstance(value, str) else ")")
    return ""


def near_fcdp(key: Any) -> bool:
    """Whether a config key looks like a misspelled ``fcdp`` (``FCDP``, ``fcpd``, ``fcdp_config``)."""
    k = str(key).lower()
    return k.startswith(FCDP_KEY) or bool(difflib.get_close_matches(k, [FCDP_KEY], n=1, cutoff=0.7))


def placement_problems(ds_config: Mapping[str, Any]) -> list[str]:
    """A block DeepSpeed would reject without a hint (inside ``zero_optimization``) or ignore (a top-level
    key that is almost ``fcdp``), each with the fix."""
    out = []
    zero = ds_config.get("zero_optimization")
    if isinstance(zero, Mapping):
        out += [f"\"zero_optimization.{key}\": the \"fcdp\" block belongs at the top level of the DeepSpeed config, "
                f"not inside zero_optimization (DeepSpeed rejects unknown keys there). Fix: move it up, next to "
                f"\"zero_optimization\": {{\"zero_optimization\": {{\"stage\": 3, ...}}, \"fcdp\": {{\"enabled\": true}}}}."
                for key in zero if near_fcdp(key)]
    out += [f"top-level key {key!r} is not \"fcdp\": keys are case-sensitive and DeepSpeed ignores unknown top-level "
            f"keys, so this block would do nothing. Fix: rename it to \"fcdp\"."
            for key in ds_config if key != FCDP_KEY and near_fcdp(key)]
    return out
