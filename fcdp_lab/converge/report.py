"""Results of ``python -m fcdp_lab converge``: the JSON file (one record per setting), the summary table and the plot.

The summary compares every setting with ``exact`` of the same dtype: final held-out loss (ratio; the
target of issue 23 is at most 1.01x), inter-node bytes per step (ratio), wall time, and whether every
rank ended with the bitwise same model.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable, Optional

RESULTS = "converge.json"
PLOT = "converge.png"
SUMMARY = "converge-table.txt"  # the markdown table, to paste into docs/benchmarks.md
#: Issue 23: a compressed setting's final held-out loss at most this multiple of exact FCDP's.
LOSS_RATIO_TARGET = 1.01


def load(path: Path) -> dict[str, dict]:
    """Recorded settings by key (``{setting}-{dtype}``); empty if the file is missing or unreadable."""
    try:
        return {r["key"]: r for r in json.loads(Path(path).read_text())["records"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def summary_rows(records: Iterable[dict]) -> list[dict]:
    """One row per record: final loss and bytes, and their ratios to ``exact`` of the same dtype."""
    records = list(records)
    exact = {r["dtype"]: r for r in records if r["setting"] == "exact"}
    rows = []
    for r in records:
        ref = exact.get(r["dtype"])
        loss_ratio = r["final_heldout_loss"] / ref["final_heldout_loss"] if ref else None
        ref_bytes = ref["inter_node_bytes_per_step"] if ref else 0
        rows.append({
            "key": r["key"], "setting": r["setting"], "dtype": r["dtype"], "param_compression": r["param_compression"],
            "grad_compression": r["grad_compression"], "steps": r["steps"],
            "final_heldout_loss": r["final_heldout_loss"], "loss_vs_exact": loss_ratio,
            "loss_target_met": None if loss_ratio is None or r["setting"] == "exact" else loss_ratio <= LOSS_RATIO_TARGET,
            "inter_node_bytes_per_step": r["inter_node_bytes_per_step"],
            "bytes_vs_exact": r["inter_node_bytes_per_step"] / ref_bytes if ref_bytes else None,
            "bytes_source": r.get("bytes_source", "kernel"),
            "step_time_median_s": r["step_time_median_s"], "wall_s": r.get("launch_wall_s", r["wall_s"]),
            "bitwise_equal_across_ranks": r["bitwise_equal_across_ranks"],
        })
    return rows


def markdown(records: Iterable[dict]) -> str:
    """The summary table (Markdown)."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["| setting | dtype | param / grad compression | steps | final held-out loss (nats/byte) | vs exact | "
             "inter-node MB/step | bytes vs exact | step (s, median) | wall (s) | bitwise equal on every rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary_rows(records):
        lines.append(f"| {r['setting']} | {r['dtype']} | {r['param_compression']} / {r['grad_compression']} | "
                     f"{r['steps']} | {r['final_heldout_loss']:.4f} | {fmt(r['loss_vs_exact'], '.4f')}x | "
                     f"{r['inter_node_bytes_per_step'] / 1e6:.3f} | {fmt(r['bytes_vs_exact'], '.3f')}x | "
                     f"{r['step_time_median_s']:.3f} | {r['wall_s']:.0f} | "
                     f"{'yes' if r['bitwise_equal_across_ranks'] else '**NO**'} |")
    return "\n".join(lines) + "\n"


def one_line(record: dict, records: dict[str, dict]) -> str:
    """A finished setting, for the progress log."""
    row = next(r for r in summary_rows(records.values()) if r["key"] == record["key"])
    ratio = "" if row["loss_vs_exact"] is None else f" ({row['loss_vs_exact']:.4f}x exact)"
    nbytes = "" if row["bytes_vs_exact"] is None else f" ({row['bytes_vs_exact']:.3f}x exact)"
    return (f"  {record['key']}: held-out loss {record['final_heldout_loss']:.4f}{ratio}, "
            f"{record['inter_node_bytes_per_step'] / 1e6:.3f} MB/step{nbytes}, "
            f"{row['wall_s']:.0f} s, bitwise equal on every rank: {record['bitwise_equal_across_ranks']}")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_results(records: dict[str, dict], out_dir: Path, order: Optional[list[str]] = None) -> None:
    """JSON (every record, the summary), the Markdown summary and the plot; the JSON atomically, so a sweep
    killed while writing keeps the previous file."""
    keys = [k for k in (order or []) if k in records] + sorted(k for k in records if k not in (order or []))
    ordered = [records[k] for k in keys]
    meta = {"written": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
            "loss_ratio_target": LOSS_RATIO_TARGET}
    doc = {"meta": meta, "summary": summary_rows(ordered), "records": ordered}
    _atomic_write(out_dir / RESULTS, json.dumps(doc, indent=1))
    _atomic_write(out_dir / SUMMARY, markdown(ordered))
    plot(ordered, out_dir / PLOT)


#: Line style per setting (colour by compression level, dashes for one-sided compression).
_STYLE = {"exact": ("black", "-"), "int8": ("tab:blue", "-"), "int4": ("tab:red", "-"),
          "pint8": ("tab:blue", "--"), "pint4": ("tab:red", "--"), "gint8": ("tab:blue", ":"), "gint4": ("tab:red", ":")}


def _style(setting: str) -> tuple[str, str]:
    """Colour and dashes of a setting's line: DiLoCo (issue 32) by its H, dashed with a codec, dotted with a warm-up."""
    if setting.startswith("diloco"):
        h = setting.split("_")[0]
        color = {"diloco10": "tab:green", "diloco50": "tab:purple", "diloco100": "tab:brown"}.get(h, "tab:olive")
        return color, "--" if "_int" in setting else (":" if "_wu" in setting else "-")
    return _STYLE.get(setting, ("tab:gray", "-."))


def plot(records: list[dict], path: Path) -> bool:
    """Held-out loss against steps (left) and against cumulative inter-node bytes (right), one row per dtype.
    Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dtypes = [d for d in ("fp32", "bf16") if any(r["dtype"] == d for r in records)] or ["fp32"]
    log_bytes = any(r["setting"].startswith("diloco") for r in records)  # DiLoCo's bytes are 1/10 to 1/500 of exact's
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 4.2 * len(dtypes)), squeeze=False)
    for row, dtype in enumerate(dtypes):
        for r in (r for r in records if r["dtype"] == dtype):
            pts = [p for p in r["curve"] if not p["final"]]
            end = r["curve"][-1]  # all held-out windows (x); the line: the same first windows at every point
            color, dash = _style(r["setting"])
            label = f"{r['setting']} (x: all held-out, {r['final_heldout_loss']:.3f})"
            axes[row][0].plot([p["step"] for p in pts], [p["heldout_loss"] for p in pts], dash, color=color, label=label)
            on_bytes = [p for p in pts if not log_bytes or p["cumulative_inter_node_bytes"] > 0]
            axes[row][1].plot([p["cumulative_inter_node_bytes"] / 1e6 for p in on_bytes],
                              [p["heldout_loss"] for p in on_bytes], dash, color=color, label=label)
            axes[row][0].plot([end["step"]], [end["heldout_loss"]], "x", color=color)
            axes[row][1].plot([end["cumulative_inter_node_bytes"] / 1e6], [end["heldout_loss"]], "x", color=color)
        source = "kernel-counted" if all(r.get("bytes_source") == "kernel" for r in records) else "FCDP-counted"
        for col, xlabel in ((0, "optimizer step"), (1, f"cumulative inter-node MB ({source}, train + eval)")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel + (", log scale" if col == 1 and log_bytes else ""))
            if col == 1 and log_bytes:
                ax.set_xscale("log")
            ax.set_ylabel("held-out loss (nats/byte)")
            ax.set_title(f"{dtype}: held-out loss vs {'steps' if col == 0 else 'inter-node bytes'}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    if records:
        r0 = records[0]
        fig.suptitle(f"tiny byte-level GPT ({r0['params'] / 1e6:.2f}M params) on pydoc_data.topics, "
                     f"{r0['nodes']} nodes x {r0['world'] // r0['nodes']} ranks, {r0['rate_mbit']:g} Mbit/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
