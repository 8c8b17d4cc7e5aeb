"""The restart and resize sweep behind docs/reliability.md (``bash scripts/reliability.sh``).

Restarts: jobs of ``examples/train_elastic.py`` (6 steps, a checkpoint every 2) under torchrun's elastic
agent on the emulated cluster (2 nodes x 2), with one or two nodes' ranks SIGKILLed at random kill
points (node, step, phase: :mod:`~fcdp_lab.reliability.killpoint`). Each job must end with the weights of
the uninterrupted run, bit for bit, resume from the checkpoint predicted for its kill points
(:func:`expected_resume`) and redo exactly the steps since it. Resizes: each mode's 2 x 2 checkpoint
converted with DeepSpeed's universal tool and resumed at 1 x 2, 2 x 1 and 4 x 2 against plain ZeRO-3 doing
the same. Results go to ``docs/results/reliability/restarts.json`` and the figures table of docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from fcdp_lab.harness.cluster import EmulatedCluster
from fcdp_lab.reliability import resize
from fcdp_lab.reliability.elastic import run_elastic
from fcdp_lab.reliability.killpoint import PHASES, KillPoint

STEPS, INTERVAL = 6, 2
SIZES = ((1, 2), (2, 1), (4, 2))  # nodes x ranks per node
TABLE_START, TABLE_END = "<!-- reliability-table:start -->", "<!-- reliability-table:end -->"


def checkpoints(steps: int = STEPS, interval: int = INTERVAL) -> list[int]:
    return sorted({s for s in range(interval, steps + 1, interval)} | {steps})


def expected_resume(point: KillPoint, steps: int = STEPS, interval: int = INTERVAL) -> int:
    """The step a job killed at ``point`` resumes at: its last complete checkpoint whose ``latest`` was written.

    A kill in ``save`` (files being written) or in ``latest`` on node 0 (rank 0 about to write it) loses that
    checkpoint; in ``latest`` on another node, rank 0 has written ``latest`` after every file (FCDP waits
    for every rank first), so the job resumes from it."""
    done = [0] + checkpoints(steps, interval)
    if point.phase in ("forward", "backward", "step"):
        return max(c for c in done if c <= point.step)
    if point.phase == "latest" and point.node != 0:
        return point.step
    return max(c for c in done if c < point.step)


def random_point(rng: random.Random, phase: str, after: int = -1, last: int = STEPS) -> KillPoint:
    """A kill point on a random node at a random step in (``after``, ``last``]: a checkpoint step for the save
    phases (a step that runs for the others, and for the save phases when no checkpoint step is in range)."""
    saves = [c for c in checkpoints() if after < c <= last]
    if phase in ("save", "latest") and saves:
        return KillPoint(rng.randrange(2), rng.choice(saves), phase)
    phase = phase if phase not in ("save", "latest") else rng.choice(PHASES[:3])
    return KillPoint(rng.randrange(2), rng.randint(after + 1, min(last, STEPS - 1)), phase)


def random_trials(n: int, seed: int) -> list[tuple[str, list[KillPoint]]]:
    """``n`` jobs, alternately exact and defaults; the first kill point's phase cycles through every phase;
    every third job has a second kill point, in a random phase at a later step (a second restart); in every
    fourth, node 1's agent dies with its ranks and a new one starts (node 0's agent hosts the rendezvous)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        points = [random_point(rng, PHASES[i % len(PHASES)], last=STEPS - 2 if i % 3 == 2 else STEPS)]
        if i % 4 == 3:
            points[0] = KillPoint(1, points[0].step, points[0].phase, agent=True)
        if i % 3 == 2:
            points.append(random_point(rng, rng.choice(PHASES), after=points[0].step))
        out.append((("exact", "defaults")[i % 2], points))
    return out


@dataclass
class Trial:
    kind: str  # "restart" or "resize"
    mode: str
    what: str
    ok: bool
    detail: dict = field(default_factory=dict)
    wall_s: float = 0.0


def _losses(metrics: list[dict]) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics if "step" in m}


def _reference(work: Path, mode: str) -> Path:
    ref = work / f"ref_{mode}"
    ref.mkdir()
    cfg = resize.write_config(ref / "cfg.json", resize.config(mode, ranks_per_node=2))
    resize.run_script(resize.script_argv(cfg, ref / "ckpt", STEPS, INTERVAL, ref / "metrics.jsonl"), 4)
    return ref


def restart_trial(cluster: EmulatedCluster, work: Path, mode: str, points: list[KillPoint], ref: Path,
                  env: Optional[dict] = None, expect_ok: bool = True) -> Trial:
    job = Path(tempfile.mkdtemp(prefix="job-", dir=work))
    cfg = resize.write_config(job / "cfg.json", resize.config(mode))
    t0 = time.monotonic()
    run = run_elastic(cluster, resize.script_argv(cfg, job / "ckpt", STEPS, INTERVAL, job / "metrics.jsonl"), job,
                      kills=points, metrics=job / "metrics.jsonl", timeout=600 if expect_ok else 240,
                      max_restarts=3 if expect_ok else 1, env=env)
    what = " then ".join(str(p) for p in points) or "no kill"
    detail = {"kills": len(run.kills), "resumed_at": run.resumed_at(), "redone_steps": run.redone_steps(),
              "agents": run.returncodes, "timed_out": run.timed_out}
    if not expect_ok:
        detail["log_tail"] = run.log_tail[-1500:]
        return Trial("restart", mode, what, not run.ok, detail, round(time.monotonic() - t0, 1))
    expected = [expected_resume(p) for p in points]
    ref_losses = _losses(resize.read_metrics(ref / "metrics.jsonl"))
    checks = {"finished": run.ok, "every kill made": len(run.kills) == len(points),
              "resumed where predicted": run.resumed_at() == expected,
              "redid only the steps since the checkpoint": run.redone_steps() == sum(
                  p.step - r for p, r in zip(points, expected)),
              "every loss as uninterrupted": all(ref_losses.get(m["step"]) == m["loss"] for m in run.steps)}
    if run.ok:
        checks["weights bitwise"] = resize.bitwise_equal(resize.fp32_weights(job / "ckpt"),
                                                         resize.fp32_weights(ref / "ckpt"))
    detail.update(expected_resume=expected, checks=checks)
    if not all(checks.values()):
        detail["log_tail"] = run.log_tail[-3000:]
    shutil.rmtree(job, ignore_errors=True)
    return Trial("restart", mode, what, all(checks.values()), detail, round(time.monotonic() - t0, 1))


def relaunch_trial(cluster: EmulatedCluster, work: Path, mode: str, point: KillPoint, ref: Path) -> Trial:
    """Node 0 dies with its agent (the c10d rendezvous host): the job ends; relaunched whole with the same
    arguments, as a scheduler requeues it, it resumes from ``latest`` and ends as the uninterrupted run."""
    job = Path(tempfile.mkdtemp(prefix="job-", dir=work))
    cfg = resize.write_config(job / "cfg.json", resize.config(mode))
    argv = resize.script_argv(cfg, job / "ckpt", STEPS, INTERVAL, job / "metrics.jsonl")
    t0 = time.monotonic()
    first = run_elastic(cluster, argv, job / "first", kills=[point], metrics=job / "metrics.jsonl", timeout=300)
    second = run_elastic(cluster, argv, job / "second", metrics=job / "metrics.jsonl", timeout=600)
    expected = expected_resume(point)
    ref_losses = _losses(resize.read_metrics(ref / "metrics.jsonl"))
    checks = {"the killed job ended": not first.ok and not first.timed_out, "the relaunch finished": second.ok,
              "resumed where predicted": second.resumed_at() == [expected],
              "redid only the steps since the checkpoint": second.redone_steps() == point.step - expected,
              "every loss as uninterrupted": all(ref_losses.get(m["step"]) == m["loss"] for m in second.steps)}
    if second.ok:
        checks["weights bitwise"] = resize.bitwise_equal(resize.fp32_weights(job / "ckpt"), resize.fp32_weights(ref / "ckpt"))
    detail = {"kills": len(first.kills), "resumed_at": second.resumed_at(), "redone_steps": second.redone_steps(),
              "expected_resume": [expected], "checks": checks, "group": f"node 0 with its agent, {mode}, relaunched",
              "expect": "the job ends (the rendezvous lived in node 0's agent); the relaunched job resumed at the "
                        "predicted checkpoint and ended bitwise as the uninterrupted run"}
    if not all(checks.values()):
        detail["log_tail"] = (first.log_tail + second.log_tail)[-3000:]
    shutil.rmtree(job, ignore_errors=True)
    return Trial("restart", mode, f"{point}, relaunched", all(checks.values()), detail, round(time.monotonic() - t0, 1))


def resize_trials(work: Path, refs: dict[str, Path]) -> list[Trial]:
    """Each mode's 2 x 2 checkpoint at step 4, converted and resumed at :data:`SIZES` for the last 2 steps."""
    tag, out = "global_step4", []
    universal, finals = {}, {}
    for mode, ref in refs.items():
        src = work / f"uc_{mode}"
        shutil.copytree(ref / "ckpt" / tag, src / tag)
        universal[mode] = resize.convert(src, tag)
        written = {k: v.reshape(-1) for k, v in resize.fp32_weights(ref / "ckpt", tag).items()}
        checks = {"universal fp32 == 2x2 fp32": resize.bitwise_equal(resize.universal_fp32(src, universal[mode]), written),
                  "optimizer-state keys == plain's": resize.optimizer_keys(ref / "ckpt", tag)
                  == resize.optimizer_keys(refs["plain"] / "ckpt", tag)}
        out.append(Trial("convert", mode, "2x2 -> universal", all(checks.values()),
                         {"group": "universal conversions (exact, defaults, plain)", "checks": checks}))
        for nodes, rpn in SIZES:
            t0 = time.monotonic()
            save_dir = resize.universal_copy(src, universal[mode], work / f"rs_{mode}_{nodes}x{rpn}")
            cfg = resize.write_config(save_dir / "cfg.json", resize.config(mode, ranks_per_node=rpn, universal=True))
            resize.run_script(resize.script_argv(cfg, save_dir, STEPS, INTERVAL, save_dir / "metrics.jsonl"), nodes * rpn)
            metrics = resize.read_metrics(save_dir / "metrics.jsonl")
            finals[(mode, nodes, rpn)] = (_losses(metrics), resize.fp32_weights(save_dir), round(time.monotonic() - t0, 1),
                                          metrics[0].get("start"), _losses(resize.read_metrics(ref / "metrics.jsonl")))
    for (mode, nodes, rpn), (losses, weights, wall, start, ref_losses) in finals.items():
        if mode == "plain":
            continue
        p_losses, p_weights = finals[("plain", nodes, rpn)][:2]
        checks = {"resumed at step 4": start == 4,
                  "first loss as the 2x2 run's": losses.get(4) == ref_losses.get(4)}
        if mode == "exact":
            checks["losses == plain"] = losses == p_losses
            checks["weights bitwise == plain"] = resize.bitwise_equal(weights, p_weights)
        else:
            checks["losses within 1e-5 of plain"] = all(abs(losses[s] - p_losses[s]) <= resize.DEFAULTS_RTOL * abs(p_losses[s])
                                                        for s in p_losses) and losses.keys() == p_losses.keys()
            checks["weights within 1e-5 of plain"] = resize.max_rel_diff(weights, p_weights) <= resize.DEFAULTS_RTOL
        detail = {"checks": checks, "max_rel_weight_diff_vs_plain": resize.max_rel_diff(weights, p_weights)}
        out.append(Trial("resize", mode, f"2x2 -> {nodes}x{rpn}", all(checks.values()), detail, wall))
    return out


CHECKS = {"restart": "finished within `--max-restarts`; resumed at the predicted checkpoint; redid only the steps "
                     "since it; every loss and the final fp32 weights bitwise equal to the uninterrupted run's",
          "convert": "the universal checkpoint's fp32 weights bitwise equal to the 2x2 checkpoint's; the checkpoint "
                     "holds the same optimizer-state keys as plain ZeRO-3's (nothing of FCDP's)",
          "resize exact": "resumed at step 4 with the 2x2 run's loss; losses and final weights bitwise equal to plain "
                          "ZeRO-3 resumed from its own conversion at the same size",
          "resize defaults": "resumed at step 4 with the 2x2 run's loss; losses and final weights within 1e-5 of plain "
                             "ZeRO-3 resumed at the same size"}


def table(trials: list[Trial], meta: dict) -> str:
    """The figures table of docs/reliability.md: one row per kind and mode, one per failure mode."""
    rows = ["| tried | jobs | kills | passed | what passing means |", "|---|---|---|---|---|"]
    groups: dict[str, list[Trial]] = {}
    for t in trials:
        label = t.detail.get("group") or (f"restarts, {t.mode}" if t.kind == "restart" else f"resizes, {t.mode} (1x2, 2x1, 4x2)")
        groups.setdefault(label, []).append(t)
    for label, ts in groups.items():
        kind = ts[0].kind if ts[0].kind != "resize" else f"resize {ts[0].mode}"
        kills: object = sum(t.detail.get("kills", 0) for t in ts) if kind == "restart" else "-"
        whole = sum(t.what.count(":agent") for t in ts)
        if whole:
            kills = f"{kills} ({whole} with the node's agent)"
        what = ts[0].detail.get("expect") or CHECKS[kind]
        diffs = [t.detail["max_rel_weight_diff_vs_plain"] for t in ts if "max_rel_weight_diff_vs_plain" in t.detail]
        if kind == "resize defaults" and diffs:
            what += f" (largest: {max(diffs):.1e})"
        rows.append(f"| {label} | {len(ts)} | {kills} | {sum(t.ok for t in ts)} | {what} |")
    restarts = [t for t in trials if t.kind == "restart"]
    rows.append(f"\nIn all: {len(restarts)} jobs with {sum(t.detail.get('kills', 0) for t in restarts)} kills and "
                f"{len(trials) - len(restarts)} conversions and resizes; {sum(t.ok for t in trials)} of {len(trials)} as "
                f"expected; {'no' if not meta.get('namespaces_left') and not meta.get('temp_dir_left') else 'SOME'} "
                f"network namespace or temporary directory left behind.")
    return "\n".join(rows) + (f"\n\n(`bash scripts/reliability.sh`, seed {meta['seed']}, {meta['date']}: "
                              f"{meta['wall_s'] / 60:.0f} minutes on the 2-core machine shared with other jobs; every "
                              f"job: docs/results/reliability/restarts.json.)")


def update_doc(doc: Path, text: str) -> None:
    content = doc.read_text()
    start, end = content.index(TABLE_START) + len(TABLE_START), content.index(TABLE_END)
    doc.write_text(content[:start] + "\n" + text + "\n" + content[end:])


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10, help="random restart jobs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-resizes", action="store_true")
    ap.add_argument("--failure-modes", action="store_true",
                    help="also the two jobs that must fail: plain ZeRO-3 killed in save on node 1, torch's shared store")
    ap.add_argument("--json", default=str(resize.ROOT / "docs/results/reliability/restarts.json"))
    ap.add_argument("--doc", default=str(resize.ROOT / "docs" / "reliability.md"))
    ap.add_argument("--table-only", action="store_true", help="rewrite the doc's table from --json, run nothing")
    args = ap.parse_args(argv)
    if args.table_only:
        saved = json.loads(Path(args.json).read_text())
        update_doc(Path(args.doc), table([Trial(**t) for t in saved["trials"]], saved["meta"]))
        return
    t0 = time.monotonic()
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="fcdp-reliability-") as tmp:
        work = Path(tmp)
        refs = {mode: _reference(work, mode) for mode in resize.MODES}
        with EmulatedCluster(2, tag="rel") as cluster:
            jobs = [("exact", [])] + random_trials(args.kills, args.seed)
            for mode, points in jobs:
                trials.append(restart_trial(cluster, work, mode, points, refs[mode]))
                print(json.dumps(asdict(trials[-1]))[:400], flush=True)
            trials.append(relaunch_trial(cluster, work, "exact", KillPoint(0, 3, "backward", agent=True), refs["exact"]))
            print(json.dumps(asdict(trials[-1]))[:400], flush=True)
            if args.failure_modes:
                for mode, point, env, expect in (
                        ("plain", KillPoint(1, 4, "save"), None,
                         "must fail: DeepSpeed's `latest` names the checkpoint node 1 never finished"),
                        ("exact", KillPoint(1, 3, "forward"), {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
                         "must fail: torch's shared store hands restarted ranks stale addresses")):
                    trial = restart_trial(cluster, work, mode, [point], refs[mode], env=env, expect_ok=False)
                    trial.detail.update(group=f"failure mode: {mode}, {point}", expect=expect)
                    trials.append(trial)
                    print(json.dumps(asdict(trial))[:400], flush=True)
        if not args.no_resizes:
            for trial in resize_trials(work, refs):
                trials.append(trial)
                print(json.dumps(asdict(trial))[:400], flush=True)
    left = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(cluster.prefix)]
    meta = {"seed": args.seed, "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.monotonic() - t0),
            "namespaces_left": left, "temp_dir_left": work.exists()}
    Path(args.json).write_text(json.dumps({"meta": meta, "trials": [asdict(t) for t in trials]}, indent=1) + "\n")
    update_doc(Path(args.doc), table(trials, meta))
    failed = [t for t in trials if not t.ok] + ([Trial("cleanup", "-", "leftovers", False, meta)] if left or work.exists() else [])
    print(f"{len(trials) - len(failed)}/{len(trials)} passed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
