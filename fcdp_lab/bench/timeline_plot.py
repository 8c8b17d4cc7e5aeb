"""The step's timeline from a ``python -m fcdp_lab bench`` result: host seconds per phase of inter-node work vs the rest.

    python -m fcdp_lab.bench.timeline_plot results/bench/bench.json docs/bench_overlap.png [--rate 100]

One horizontal bar per measured row at ``--rate`` (engine, GA, regime): rank 0's host seconds per step waiting in
each phase (``timeline_s``, ``fcdp_deepspeed/reporting/timeline.py``), and the rest of the step (compute and framework
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


#: The calls of the training loop drawn under each rank's waits (``toy.train``'s spans), light.
CALLS = (("forward", "tab:green"), ("backward", "tab:olive"), ("step", "tab:orange"))


def gantt_rows(row: dict) -> list[dict]:
    """Per rank of ``row``'s ``trace_last_step``: the calls (forward/backward/step), the waits by phase and the
    asynchronous inter-node transfers in flight ([Note: the trace] in ``fcdp_deepspeed/reporting/timeline.py``)."""
    phases = {k for k, _, _ in PHASES}
    out = []
    for t in row.get("trace_last_step") or []:
        out.append({"rank": t["rank"],
                    "step": next(((a, b) for n, a, b in t["spans"] if n == "train_step"), None),
                    "calls": [(n, a, b) for n, a, b in t["spans"] if n != "train_step"],
                    # outer phases first, so that a nested wait (push wait in a fetch) is drawn over its parent
                    "waits": sorted(((n, a, b) for n, a, b in t["events"] if n in phases), key=lambda e: (e[1], -e[2])),
                    "in_flight": [(n, a, b) for n, a, b in t["events"] if n.startswith("in_flight")]})
    return out


def plot_gantt(rows: list[dict], path: Path, titles: Optional[list[str]] = None) -> None:
    """One panel per row (e.g. before and after): per rank, the last timed step's calls (light), its waits on
    inter-node work by phase (dark) and its asynchronous transfers in flight (thin line), on one wall clock."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {k: c for k, _, c in PHASES}
    labels = {k: label for k, label, _ in PHASES}
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.0 + 1.3 * sum(max(1, len(gantt_rows(r))) for r in rows) / 2
                                                     + 0.9 * len(rows)), squeeze=False, sharex=True)
    seen: set = set()

    def label(key: str, text: str) -> Optional[str]:
        if key in seen:
            return None
        seen.add(key)
        return text

    for ax, row, title in zip(axes[:, 0], rows, titles or [None] * len(rows)):
        for y, lane in enumerate(gantt_rows(row)):
            for name, colour in CALLS:
                for n, a, b in lane["calls"]:
                    if n == name:
                        ax.barh(y, b - a, left=a, height=0.8, color=colour, alpha=0.25,
                                label=label(f"call {n}", f"{n} (compute unless a wait is drawn)"))
            for n, a, b in lane["waits"]:
                ax.barh(y, b - a, left=a, height=0.5, color=colours[n], label=label(n, f"waits: {labels[n]}"))
            for n, a, b in lane["in_flight"]:
                ax.plot([a, b], [y + 0.33] * 2, "k-", lw=1.5, label=label(n, "stage 1 in flight (async)"))
            if lane["step"]:
                ax.plot([lane["step"][1]] * 2, [y - 0.45, y + 0.45], "k:", lw=1)
        limit = max(row["compute_s"], row["wire_s"]) if row.get("compute_s") is not None else None
        if limit:
            ax.axvline(limit, color="red", lw=1.2, label=label("limit", "max(compute, wire) from the step start"))
        n = len(gantt_rows(row))
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"rank {i}" for i in range(n)], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title or f"{row['engine']}, GA {row.get('grad_accum', 1)}, {row.get('regime', 'large')}: "
                     f"step {row['step_time_s']:.2f} s (median)", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel("seconds from the start of the last timed step (one wall clock for every rank)")
    fig.legend(fontsize=7, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fcdp_lab.bench.timeline_plot", description=__doc__)
    ap.add_argument("results", nargs="+", help="bench.json files (their rows together)")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s of the rows to draw (default 100)")
    ap.add_argument("--gantt", default="", help="draw each rank's last timed step instead, for these engines "
                    "(comma-separated, in panel order; rows at --rate with a trace)")
    args = ap.parse_args(argv)
    rows = [r for f in args.results for r in json.loads(Path(f).read_text())["rows"]]
    if args.gantt:
        found = [r for e in args.gantt.split(",") for r in rows
                 if r["engine"] == e and r["rate_mbit"] == args.rate and r.get("trace_last_step")]
        plot_gantt(found, Path(args.out))
        return 0
    plot(rows, Path(args.out), args.rate)
    print(markdown(rows, args.rate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
