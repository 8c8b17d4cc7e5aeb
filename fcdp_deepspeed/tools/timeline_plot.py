"""The step's timeline from a ``fcdp bench`` result: host seconds per phase of inter-node work vs the rest.

    python -m fcdp_deepspeed.tools.timeline_plot results/bench/bench.json docs/bench_overlap.png [--rate 100]

One horizontal bar per measured row at ``--rate`` (engine, GA, regime): rank 0's host seconds per step waiting in
each phase (``timeline_s``, ``fcdp_deepspeed/timeline.py``), and the rest of the step (compute and framework
overhead, ``step - sum(phases)``), with the row's limit ``max(compute, wire)`` as a tick. On gloo these waits are
the host's view of communication ([Note: the host's view]); a GPU run would add a CUDA-event view.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

#: Phases in bar order and their colours.
PHASES = (("forward_gather", "forward gather", "tab:blue"), ("push_wait", "push wait", "tab:cyan"),
          ("backward_refill", "backward refill", "tab:purple"), ("grad_node_stage", "grad node stage", "tab:olive"),
          ("grad_inter_node", "grad inter-node", "tab:red"), ("grad_bucket", "grad other", "tab:pink"),
          ("codec", "codec", "tab:brown"), ("optimizer_step", "optimizer step", "tab:orange"))


def bars(rows: list[dict], rate: float) -> list[dict]:
    """One bar per measured row at ``rate``: its label, segments (name -> seconds) and limit."""
    out = []
    for r in rows:
        if r.get("computed") or r["rate_mbit"] != rate or "timeline_s" not in r:
            continue
        tl = r["timeline_s"]
        waits = {k: tl.get(k, 0.0) for k, _, _ in PHASES}
        rest = max(0.0, r["step_time_s"] - sum(waits.values()))
        limit = max(r["compute_s"], r["wire_s"]) if r.get("compute_s") is not None else None
        label = f"{r['engine']}, GA {r.get('grad_accum', 1)}, {r.get('regime', 'large')}"
        out.append({"key": (r["engine"], r.get("grad_accum", 1), r.get("regime", "large")), "label": label, "segments": {**waits, "other": rest}, "step": r["step_time_s"], "limit": limit})
    return sorted(out, key=lambda b: b["label"])


def markdown(rows: list[dict], rate: float) -> str:
    """The bars of :func:`bars` as a table: step, its limit's parts, step / limit, and each phase's seconds."""
    by = {(r["engine"], r.get("grad_accum", 1), r.get("regime", "large")): r for r in rows
          if not r.get("computed") and r["rate_mbit"] == rate}
    head = "| engine, GA, regime | step (s) | compute (s) | wire (s) | step / max(compute, wire) | " + \
        " | ".join(label for _, label, _ in PHASES) + " | rest (s) |"
    lines = [head, "|" + "---|" * (6 + len(PHASES))]
    for b in bars(rows, rate):
        r = by[b["key"]]
        ratio = "-" if r.get("step_vs_floor") is None else f"{r['step_vs_floor']:.2f}x"
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {b['label']} | {b['step']:.3f} | {fmt(r.get('compute_s'))} | {fmt(r.get('wire_s'))} | {ratio} | "
                     + " | ".join(f"{b['segments'][k]:.3f}" for k, _, _ in PHASES) + f" | {b['segments']['other']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, rate: float, title: Optional[str] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    found = bars(rows, rate)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(found) + 2.6))
    for y, b in enumerate(found):
        left = 0.0
        for key, label, colour in (*PHASES, ("other", "compute + framework (no wait)", "lightgray")):
            width = b["segments"][key]
            ax.barh(y, width, left=left, color=colour, label=label if y == 0 else None)
            left += width
        if b["limit"]:
            ax.plot([b["limit"]] * 2, [y - 0.4, y + 0.4], "k-", lw=2, label="max(compute, wire)" if y == 0 else None)
    ax.set_yticks(range(len(found)))
    ax.set_yticklabels([b["label"] for b in found], fontsize=8)
    ax.set_xlabel("seconds per optimizer step (rank 0's host view)")
    ax.set_title(title or f"where the step goes, {rate:g} Mbit/s")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=5)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fcdp_deepspeed.tools.timeline_plot", description=__doc__)
    ap.add_argument("results", nargs="+", help="bench.json files (their rows together)")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s of the rows to draw (default 100)")
    args = ap.parse_args(argv)
    rows = [r for f in args.results for r in json.loads(Path(f).read_text())["rows"]]
    plot(rows, Path(args.out), args.rate)
    print(markdown(rows, args.rate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
