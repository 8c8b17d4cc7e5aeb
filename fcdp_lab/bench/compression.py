"""``python -m fcdp_lab bench`` with lossy inter-node compression (issue 23): the compressed engines, the LoRA step-time
floor, the issue's targets checked on a run, and the one-command preset that measures them.

Engines: ``fcdp_int8``/``fcdp_int4`` are the exact defaults (``fcdp_node``) plus ``param_compression`` and
``grad_compression`` at that width; ``fcdp_pint*`` compress the parameters alone, ``fcdp_gint*`` the
gradients alone. The ``bound`` rows stay the *exact* bound (fp32 changed parameters in once, gradient out
once per node and optimizer step), so ``bytes_vs_bound`` of a compressed row is its ratio to the exact
bound, scales and framing included (the kernel counts every payload byte).

[Note: the step-time floor] ``step_vs_floor`` is a row's step time over ``max(compute_s, wire_s)``:
``compute_s`` is the same engine's step time on the unlimited network (rate 0) in the same run, ``wire_s``
the time the busiest node uplink needs for the bytes it carried per step at the shaped rate (the larger of
its tx and rx payload, headers excluded; ``wire_frames_s`` includes headers and ACKs, what ``tc`` shapes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

#: Engine name -> (param_compression, grad_compression), each on top of ``fcdp_node`` (the exact defaults).
COMPRESSED_ENGINES = {"fcdp_int8": ("int8", "int8"), "fcdp_int4": ("int4", "int4"),
                      "fcdp_pint8": ("int8", "off"), "fcdp_pint4": ("int4", "off"),
                      "fcdp_gint8": ("off", "int8"), "fcdp_gint4": ("off", "int4")}
#: The exact engine the compressed ones are compared with ("vs exact"): what the defaults resolve to.
EXACT_ENGINE = "fcdp_node"


def compressed_blocks(exact_block: dict) -> dict[str, dict]:
    """The fcdp block of every compressed engine: ``exact_block`` plus its two compression keys."""
    return {name: {**exact_block, "param_compression": p, "grad_compression": g}
            for name, (p, g) in COMPRESSED_ENGINES.items()}


#: ``get_stats`` keys of the compressed paths contain one of these.
_STAT_WORDS = ("compress", "residual", "drift", "param_exact", "param_refresh", "param_reference")


def compression_stats(before: dict, after: dict, steps: int) -> dict:
    """The compressed paths' ``get_stats`` keys, whatever the engine reports: each value after the timed steps,
    and for counters (``*_bytes``, ``*_calls``, ``*_gathers``) also ``<key>_per_step`` over them."""
    out: dict[str, Any] = {}
    for k, v in after.items():
        if not any(w in k for w in _STAT_WORDS):
            continue
        out[k] = v
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k.endswith(("_bytes", "_calls", "_gathers")):
            out[f"{k}_per_step"] = (v - before.get(k, 0)) / steps
    return out


def add_step_floor(rows: list[dict], key) -> list[dict]:
    """``compute_s``, ``wire_s``, ``wire_frames_s`` and ``step_vs_floor`` on every measured row at a shaped
    rate whose engine also ran at rate 0 (see [Note: the step-time floor]); ``None`` otherwise."""
    unlimited = {(key(r), r["engine"]): r for r in rows if r["rate_mbit"] == 0 and not r.get("computed")}
    for r in rows:
        r.update(compute_s=None, wire_s=None, wire_frames_s=None, step_vs_floor=None)
        if r.get("computed") or not r["rate_mbit"]:
            continue
        link = r["rate_mbit"] * 1e6 / 8
        if r.get("uplink_max_payload_bytes_per_step") is not None:
            r["wire_s"] = r["uplink_max_payload_bytes_per_step"] / link
            r["wire_frames_s"] = r["uplink_max_frame_bytes_per_step"] / link
        ref = unlimited.get((key(r), r["engine"]))
        if ref is not None and r["wire_s"] is not None:
            r["compute_s"] = ref["step_time_s"]
            r["step_vs_floor"] = r["step_time_s"] / max(r["compute_s"], r["wire_s"])
    return rows


@dataclass(frozen=True)
class Target:
    """One of issue 23's targets: ``metric`` of ``engine``'s rows (``job``, ``rate``; ``grad_accum`` and
    ``layout`` when given) compared with ``limit``."""

    job: str
    rate_mbit: float
    engine: str
    metric: str
    limit: float
    op: str  # "<=" or ">="
    grad_accum: Optional[int] = None
    layout: Optional[str] = None

    def decides(self, r: dict) -> bool:
        return ((r["job"], r["rate_mbit"], r["engine"]) == (self.job, self.rate_mbit, self.engine)
                and self.grad_accum in (None, r.get("grad_accum", 1)) and self.layout in (None, _layout(r)))


def _layout(r: dict) -> str:
    """``"2x2"``: a row's layout (rows of runs before layouts were swept carry nodes and world only)."""
    return r.get("layout") or f"{r.get('nodes', 2)}x{r.get('world', 4) // r.get('nodes', 2)}"


TARGETS = (
    Target("full", 100, "fcdp_int4", "bytes_vs_bound", 0.25, "<="),
    Target("full", 100, "fcdp_int8", "bytes_vs_bound", 0.35, "<="),
    Target("full", 100, "fcdp_int4", "speedup_vs_exact", 2.0, ">=", grad_accum=1, layout="2x2"),
    Target("lora", 10, "fcdp_int4", "bytes_vs_bound", 0.25, "<=", layout="2x2"),
    Target("lora", 10, "fcdp_int4", "step_vs_floor", 1.15, "<=", layout="2x2"),
)


def targets(rows: list[dict], metrics: Optional[Sequence[str]] = None) -> list[dict]:
    """Every target of :data:`TARGETS` (of ``metrics`` only, if given) that ``rows`` can decide, one entry per
    matching row (layout, GA)."""
    out = []
    for t in TARGETS:
        if metrics is not None and t.metric not in metrics:
            continue
        for r in (r for r in rows if t.decides(r)):
            value = r.get(t.metric)
            met = None if value is None else (value <= t.limit if t.op == "<=" else value >= t.limit)
            out.append({"job": t.job, "layout": _layout(r), "grad_accum": r.get("grad_accum", 1),
                        "rate_mbit": t.rate_mbit, "engine": t.engine, "metric": t.metric,
                        "target": f"{t.op} {t.limit:g}", "value": value, "met": met})
    return out


def targets_markdown(found: list[dict]) -> str:
    if not found:
        return ""
    lines = ["| job | layout | GA | rate (Mbit/s) | engine | metric | target | measured | |", "|---|---|---|---|---|---|---|---|---|"]
    for t in found:
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['job']} | {t['layout']} | {t['grad_accum']} | {t['rate_mbit']:g} | {t['engine']} | "
                     f"{t['metric']} | {t['target']} | {value} | {verdict} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class PresetPart:
    """One sweep of a preset: ``BenchSpec`` overrides, and the target metrics its rows decide (a part with one
    repeat and two timed steps decides bytes, never a throughput)."""

    overrides: dict[str, Any]
    decides: tuple[str, ...]


#: ``python -m fcdp_lab bench --preset compression``: the three sweeps that decide :data:`TARGETS` (engines interleaved
#: within each, in fresh processes).
PRESETS: dict[str, dict[str, PresetPart]] = {
    "compression": {
        # bytes are kernel-counted and timing-independent: one repeat, two timed steps (as docs/benchmarks.md's
        # parameter-gather runs)
        "bytes": PresetPart({"layouts": ["2x2", "2x4", "4x2"], "rates_mbit": [100], "jobs": ["full"],
                             "grad_accums": [1, 4], "engines": ["fcdp_node", "fcdp_int8", "fcdp_int4"], "warmup": 1,
                             "steps": 2, "repeats": 1}, decides=("bytes_vs_bound",)),
        "full100": PresetPart({"rates_mbit": [100], "jobs": ["full"], "grad_accums": [1],
                               "engines": ["fcdp_node", "fcdp_int4"], "warmup": 1, "steps": 4, "repeats": 3},
                              decides=("speedup_vs_exact",)),
        "lora10": PresetPart({"rates_mbit": [10, 0], "jobs": ["lora"], "grad_accums": [1],
                              "engines": ["fcdp_node", "fcdp_int4"], "warmup": 2, "steps": 5, "repeats": 2},
                             decides=("bytes_vs_bound", "step_vs_floor")),
    },
}


def parse_layouts(text: Optional[str]) -> list[str]:
    """``"2x2,2x4"`` -> ``["2x2", "2x4"]``, each checked to be NODESxRANKS with both >= 1."""
    if not text:
        return []
    out = []
    for item in text.split(","):
        nodes, _, ranks = item.strip().lower().partition("x")
        if not (nodes.isdigit() and ranks.isdigit() and int(nodes) >= 1 and int(ranks) >= 1):
            raise ValueError(f"layout {item!r} is not NODESxRANKS (e.g. 2x4)")
        out.append(f"{int(nodes)}x{int(ranks)}")
    return out
