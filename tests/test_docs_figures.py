"""The figures the README and docs/how-it-works.md (FCDP vs hpZ vs MiCS) quote are the committed runs' figures.

README's first table is ``bash scripts/demo.sh`` (``python -m fcdp_lab demo --json docs/results/demo/demo.json`` with
the demo's defaults); docs/how-it-works.md quotes the committed emulated-cluster runs. A rerun that changes a
figure must change the committed JSON and the sentence together.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = {"full fine-tune": "full fine-tune", "LoRA (frozen base, rank-4 adapters)": "LoRA (frozen base)",
        "full fine-tune, GA 4": "full, GA 4"}


def short(x: float) -> str:
    """``6.12e-08`` -> ``6.1e-8`` (the README's notation)."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def demo_defaults() -> dict:
    """``fcdp_lab.demo.DEFAULTS``, read from the source (importing the demo imports torch)."""
    tree = ast.parse((ROOT / "fcdp_lab" / "demo.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "DEFAULTS")
    return ast.literal_eval(node.value)


def readme_rows() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in JOBS:
            rows[cells[0]] = cells
    return rows


def test_readme_table_is_the_committed_demo_run():
    run = json.loads((ROOT / "docs" / "results" / "demo" / "demo.json").read_text())
    assert {k: run[k] for k in demo_defaults()} == demo_defaults()  # what scripts/demo.sh runs
    by = {(r["job"], r["engine"]): r for r in run["rows"]}
    rows = readme_rows()
    assert set(rows) == set(JOBS)
    for readme_job, job in JOBS.items():
        _, gather, defaults_cell, exact = rows[readme_job]
        fcdp, fcdp_exact = by[(job, "FCDP")], by[(job, "FCDP exact")]
        assert gather.startswith(f"{fcdp['allgather_vs_zero3']:.3f}x"), (readme_job, gather)
        assert defaults_cell.startswith(f"**{fcdp['total_vs_zero3']:.3f}x**"), (readme_job, defaults_cell)
        assert exact == f"{fcdp_exact['total_vs_zero3']:.3f}x" and fcdp_exact["bit_identical"], (readme_job, exact)
        numbers = re.findall(r"\d\.\de-\d+", defaults_cell)
        assert numbers == [short(fcdp["max_rel_loss_diff"]), short(fcdp["max_rel_weight_diff"])], (readme_job, numbers)


def test_comparison_page_quotes_the_committed_benchmarks():
    page = (ROOT / "docs" / "how-it-works.md").read_text()
    rows = json.loads((ROOT / "docs" / "results" / "bench" / "rates.json").read_text())["rows"]
    at200 = {(r["job"], r["engine"]): r["kernel_inter_node_bytes_per_step"] / 1e6 for r in rows if r["rate_mbit"] == 200}
    full = next(line for line in page.splitlines() if line.startswith("| inter-node bytes per step, full fine-tune"))
    lora = next(line for line in page.splitlines() if line.startswith("| the same, LoRA"))
    assert f"{at200[('full', 'fcdp')]:.2f} MB | {at200[('full', 'hpz')]:.2f} MB" in full
    assert f"{at200[('lora', 'fcdp')]:.2f} MB | {at200[('lora', 'hpz')]:.2f} MB" in lora
    grad = {(r["job"], r["grad_accum"], r["engine"]): r
            for r in json.loads((ROOT / "docs" / "results" / "bench" / "grad-modes.json").read_text())["rows"]}
    node, hpz = grad[("full", 4, "fcdp_node")], grad[("full", 4, "hpz")]
    ga4 = next(line for line in page.splitlines() if line.startswith("| full fine-tune, GA 4"))
    b, h = node["kernel_inter_node_bytes_per_step"], hpz["kernel_inter_node_bytes_per_step"]
    assert f"{b / 1e6:.2f} MB (**{b / h:.3f}x** hpZ's)" in ga4, ga4
    assert f"{node['samples_per_s']:.1f} samples/s (**{node['samples_per_s'] / hpz['samples_per_s']:.2f}x** hpZ's)" in ga4
    assert f"{h / 1e6:.2f} MB, {hpz['samples_per_s']:.1f} samples/s" in ga4
