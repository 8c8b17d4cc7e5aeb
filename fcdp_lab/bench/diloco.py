"""DiLoCo's throughput targets (issue 32) from two ``python -m fcdp_lab bench`` runs: the committed summary and its check.

- ``hidden``: the same DiLoCo engine's **mean** step (whole sync intervals: the median would hide the sync steps)
  at a slow rate against an unlimited network, at most :data:`HIDDEN_TARGET` (the slow hop hidden);
- ``speedup``: the exact defaults' (``fcdp_node``) mean step against DiLoCo's at a very slow rate, at least
  :data:`SPEEDUP_TARGET`.

    python -m fcdp_lab.bench.diloco results/A/bench.json results/B/bench.json --out docs/x.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

HIDDEN_TARGET = 1.2
SPEEDUP_TARGET = 10.0
EXACT = "fcdp_node"
#: What a committed row keeps of a bench row.
KEEP = ("engine", "job", "layout", "rate_mbit", "repeats", "step_time_mean_s", "step_time_s",
        "kernel_inter_node_bytes_per_step", "counted_inter_node_bytes_per_step", "trainable_params", "all_step_times")


def _rows(paths: Sequence[Path]) -> list[dict]:
    out = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        out += [{k: r.get(k) for k in KEEP} for r in doc["rows"] if r.get("engine") != "bound"]
    return out


def ratios(rows: list[dict], slow_rate: float = 100, very_slow_rate: float = 10) -> dict:
    """``hidden[engine]`` = mean step at ``slow_rate`` / at rate 0; ``speedup[engine]`` = the exact defaults' mean
    step / the engine's, both at ``very_slow_rate``."""
    by = {(r["engine"], r["rate_mbit"]): r["step_time_mean_s"] for r in rows}
    engines = sorted({r["engine"] for r in rows if r["engine"] != EXACT})
    hidden = {e: by[(e, slow_rate)] / by[(e, 0)] for e in engines if (e, slow_rate) in by and (e, 0) in by}
    exact = by.get((EXACT, very_slow_rate))
    speedup = {e: exact / by[(e, very_slow_rate)] for e in engines if exact and (e, very_slow_rate) in by}
    return {"hidden": hidden, "speedup": speedup, "slow_rate_mbit": slow_rate, "very_slow_rate_mbit": very_slow_rate}


def summary(paths: Sequence[Path], commands: Sequence[str]) -> dict:
    rows = _rows(paths)
    return {"meta": {"commands": list(commands), "targets": {"hidden": HIDDEN_TARGET, "speedup": SPEEDUP_TARGET},
                     "note": "emulated 2x2 (tc tbf uplinks), full fine-tuning of the bench model, mean step over "
                             "whole sync intervals (slowest rank per step), 2-core machine under bench-exclusive"},
            "rows": rows, "ratios": ratios(rows)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fcdp_lab.bench.diloco", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", nargs="+", type=Path)
    ap.add_argument("--command", action="append", default=[], help="the bench command of each file (recorded)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    doc = summary(args.bench_json, args.command)
    args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
