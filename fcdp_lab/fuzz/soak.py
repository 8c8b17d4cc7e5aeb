"""``python -m fcdp_lab soak``: hundreds of random event sequences against ZeRO-3, and every broken invalidation.

Runs on one rank server (4 CPU ranks, 2 nodes x 2): chunks of clean sequences (every engine kind), each
chunk one seeded hypothesis search, then searches with each ``invalidation.*`` broken variant. Every
search is appended to the results file (JSON lines) and the figures table of ``docs/reliability.md`` is
rewritten from the whole file. A failing chunk prints its seed, the minimal sequence and the command that
reruns exactly that chunk::

    python -m fcdp_lab soak --sequences 300 --minutes 20            # clean chunks, then the fault searches
    python -m fcdp_lab soak --seeds 1234 --chunk 20 --faults none   # rerun one chunk (what a failure prints)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

from fcdp_lab import sabotage

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs/results/reliability/soak.jsonl"
TABLE = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- soak-table:begin -->", "<!-- soak-table:end -->"
#: The dropped accumulation window at a checkpoint event: shows under the default gradient modes only.
WINDOW = "invalidation.checkpoint_window"
#: Every single ``invalidation.*`` variant (``fcdp_lab/sabotage/params.py``), and the pair that leaves the optimizer
#: step without any invalidation.
FAULT_VARIANTS = (*(name for name in sabotage.known() if name.startswith("invalidation.")),
                  "invalidation.optimizer_write,invalidation.step_end")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _record(path: Path, result, kind: str, chunk: int, steps: int, run_id: str) -> dict:
    rec = {"run": run_id, "kind": kind, "faults": result.faults, "engines": ",".join(result.engines), "seed": result.seed, "chunk": chunk,
           "steps": steps, "sequences": result.sequences, "events": result.events,
           "seconds": round(result.seconds, 1), "failed": result.failure is not None,
           "first_failure_sequences": result.first_failure_sequences,
           "first_failure_seconds": (None if result.first_failure_seconds is None
                                     else round(result.first_failure_seconds, 1)),
           "program": result.program, "failure": (result.failure or "")[:2000], "event_counts": result.event_counts,
           "unsupported": result.unsupported, "coverage": result.coverage}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def rerun_command(seed: int, chunk: int, steps: int, faults: str, engines: str = "") -> str:
    return (f"python -m fcdp_lab soak --seeds {seed} --chunk {chunk} --steps {steps} --faults {faults or 'none'} --no-table"
            + (f" --engines {engines}" if engines else ""))


def _print_failure(rec: dict) -> None:
    print(f"\nFAILURE (seed {rec['seed']}, faults {rec['faults'] or 'none'}):\n{rec['failure']}\n"
          f"minimal sequence ({len(rec['program'])} steps):", flush=True)
    for i, step in enumerate(rec["program"]):
        print(f"  {i}. {step}")
    from fcdp_lab.fuzz.machine import ALL_ENGINES
    engines = "" if rec["engines"] == ",".join(ALL_ENGINES) else rec["engines"]
    print(f"rerun: {rerun_command(rec['seed'], rec['chunk'], rec['steps'], rec['faults'], engines)}\n", flush=True)


# -- the table -----------------------------------------------------------------------------------------
def _median(values: Iterable[Optional[float]]) -> str:
    got = [v for v in values if v is not None]
    return f"{statistics.median(got):g}" if got else "-"


def table(records: list[dict]) -> str:
    """The figures table (markdown) from every record of the results file."""
    clean = [r for r in records if r["kind"] == "clean"]
    runs = sorted({r["run"] for r in records})
    events = Counter()
    for r in clean:
        events.update(r["event_counts"])
    lines = [f"Results file: `docs/results/reliability/soak.jsonl` ({len(records)} searches from {len(runs)} soak runs).", "",
             "| searches | faults | sequences run (shrinking included) | events | searches that failed | "
             "sequences to the "
             "first failure (median) | seconds to it (median) | minimal sequence, steps (median) |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["faults"] or "none", []).append(r)
    order = ["none", *[f for f in FAULT_VARIANTS if f in groups], *sorted(set(groups) - {"none", *FAULT_VARIANTS})]
    for faults in (f for f in order if f in groups):
        rs = groups[faults]
        failed = [r for r in rs if r["failed"]]
        lines.append(f"| {len(rs)} | `{faults}` | {sum(r['sequences'] for r in rs)} | {sum(r['events'] for r in rs)} | "
                     f"{len(failed)} of {len(rs)} | {_median(r['first_failure_sequences'] for r in failed)} | "
                     f"{_median(r['first_failure_seconds'] for r in failed)} | "
                     f"{_median(len(r['program']) for r in failed)} |")
    coverage, unsupported = Counter(), Counter()
    for r in clean:
        coverage.update(r.get("coverage", {}))
        unsupported.update(r.get("unsupported", {}))
    lines += ["", "Events in the clean sequences: " + ", ".join(f"{k} {v}" for k, v in sorted(events.items())) + ".",
              "", "FCDP paths they ran (summed `get_stats` of every FCDP engine built): " +
              ", ".join(f"{k} {v}" for k, v in sorted(coverage.items())) + ".",
              "", f"Discarded because plain ZeRO-3 raised: {sum(unsupported.values())}" +
              ("" if not unsupported else " (" + "; ".join(f"{k}: {v}" for k, v in sorted(unsupported.items())) + ")")
              + "."]
    return "\n".join(lines)


def rewrite_table(results: Path = RESULTS, doc: Path = TABLE) -> None:
    lines = results.read_text().splitlines() if results.exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table(records)}\n{END}{tail}")


# -- the command ---------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fcdp_lab soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=300, help="clean sequences in all (default 300)")
    ap.add_argument("--chunk", type=int, default=20, help="sequences per seeded search (default 20)")
    ap.add_argument("--steps", type=int, default=10, help="events per sequence (default 10)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds of the clean chunks (default: random)")
    ap.add_argument("--faults", default="all",
                    help="fault variants to search after the clean chunks: all, none, or a ;-separated list "
                         f"of FCDP_LAB_BREAK values (default all: {'; '.join(FAULT_VARIANTS)})")
    ap.add_argument("--fault-searches", type=int, default=3, help="seeded searches per fault variant (default 3)")
    ap.add_argument("--fault-chunk", type=int, default=40, help="sequences per fault search at most (default 40)")
    ap.add_argument("--shrink-seconds", type=float, default=60.0, help="shrinking budget per failure (default 60)")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop the clean chunks after this long (0: no limit)")
    ap.add_argument("--engines", default="", help="engine kinds of the clean chunks, comma-separated "
                                                  "(engines.KINDS; default: every ZeRO-3 and FCDP kind)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--no-table", action="store_true", help="do not rewrite docs/reliability.md")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from fcdp_lab.fuzz.driver import RankServer
    from fcdp_lab.fuzz.machine import ALL_ENGINES, EXACT_ENGINES, search
    from fcdp_lab.fuzz.server import UNCHECKED

    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip()) or ALL_ENGINES
    run_id = datetime.datetime.now().strftime("%Y-%m-%d %H:%M") + f" ({_commit()})"
    rng = random.Random()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    faults = [] if args.faults == "none" else list(FAULT_VARIANTS) if args.faults == "all" else \
        [f.strip() for f in args.faults.split(";") if f.strip()]
    failures = 0
    t0 = time.monotonic()
    with RankServer() as server:
        done = 0
        while (seeds or done < args.sequences) and not (args.minutes and time.monotonic() - t0 > 60 * args.minutes):
            seed = seeds.pop(0) if seeds else rng.randrange(2**31)
            result = search(server, engines=engines, max_examples=args.chunk, steps=args.steps, seed=seed,
                            shrink_seconds=args.shrink_seconds)
            rec = _record(args.results, result, "clean", args.chunk, args.steps, run_id)
            done += result.sequences
            print(f"[{time.monotonic() - t0:6.0f} s] clean seed {seed}: {result.report().splitlines()[0]}", flush=True)
            if result.failure is not None:
                failures += 1
                _print_failure(rec)
            if args.seeds and not seeds:
                break
        for fault in faults:
            for _ in range(args.fault_searches):
                seed = rng.randrange(2**31)
                # the dropped window shows under the default gradient modes (node accumulation), not the exact path
                kinds = ("zero3", "fcdp_defaults") if fault == WINDOW else EXACT_ENGINES
                # a deleted listener alone costs a refetch (the check at use): the broken variant skips that check too
                named = fault if fault == WINDOW else f"{fault},{UNCHECKED}"
                result = search(server, engines=kinds, faults=named, max_examples=args.fault_chunk,
                                steps=args.steps, seed=seed, shrink_seconds=args.shrink_seconds)
                rec = _record(args.results, result, "fault", args.fault_chunk, args.steps, run_id)
                found = (f"found after {result.first_failure_sequences} sequences, minimal {len(result.program)} "
                         f"steps: {' -> '.join(s.partition('(')[0] for s in result.program)}" if result.failure else
                         f"not found in {result.sequences} sequences")
                print(f"[{time.monotonic() - t0:6.0f} s] {fault} seed {seed}: {found}", flush=True)
    if not args.no_table:
        rewrite_table(args.results)
        print(f"rewrote the table in {TABLE.relative_to(ROOT)}")
    print(f"{failures} failing clean chunk(s); {time.monotonic() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
