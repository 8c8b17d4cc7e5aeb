"""Convergence on real text with lossy inter-node compression: exact FCDP vs int8 vs int4.

    python -m fcdp_lab converge [--settings exact,int8,int4] [--dtypes fp32,bf16] [--steps 500] [--out docs]
    python -m fcdp_lab.converge ...      # same

Trains a tiny byte-level GPT (``tools/converge/tinylm.py``, 1.33M parameters by default) on Python's own help
texts (``tools/converge/textdata.py``: ``pydoc_data.topics``, split into train and held-out text
deterministically) on an emulated cluster (``EmulatedCluster``: 2 nodes x 2 ranks, uplinks shaped to
``--rate`` Mbit/s; inter-node bytes from the kernel's interface counters), through
``deepspeed.initialize`` with an ``fcdp`` block, once per setting: ``exact`` (today's defaults),
``int8`` and ``int4`` (``param_compression`` and ``grad_compression`` together), ``pint8``/``pint4``
(parameters alone), ``gint8``/``gint4`` (gradients alone), each in fp32 and bf16.

Every setting sees the same initial weights, the same training batches and the same held-out windows;
the held-out loss is evaluated every ``--eval-every`` steps under ``no_grad`` through the engine (so it
measures the weights the compressed replicas compute with), on all held-out text at the end. At the
end every rank hashes the full model two ways (``tools/converge/model_hash.py``); the run fails the check unless
all ranks agree bit for bit.

Results: ``converge.json`` (one record per setting, rewritten as each setting finishes: an
interrupted sweep resumes where it stopped, and a setting whose spec changed is rerun),
``converge.png`` (held-out loss against steps and against cumulative inter-node bytes) and
``converge-table.txt`` (the summary table, markdown) in ``--out``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, Sequence

#: Setting name -> (param_compression, grad_compression).
SETTINGS = {"exact": ("off", "off"), "int8": ("int8", "int8"), "int4": ("int4", "int4"),
            "pint8": ("int8", "off"), "pint4": ("int4", "off"), "gint8": ("off", "int8"), "gint4": ("off", "int4")}
#: Lossy DiLoCo across nodes (issue 32, docs/diloco.md): the swept setting names. Each is ``diloco{H}`` with
#: optional suffixes (:func:`diloco_block`), so probes name their own outer settings (``diloco10_lr1_mom0``).
DILOCO_SETTINGS = ("diloco10", "diloco10_int4", "diloco50", "diloco50_int4")
SETTINGS |= {name: ("off", "off") for name in DILOCO_SETTINGS}
_DILOCO_NAME = re.compile(r"^diloco(\d+)((?:_(?:int4|int8|bf16|lr[\d.]+|mom[\d.]+|hb|f\d+|ov\d+|ilr[\d.]+|wu\d+))*)$")


def diloco_block(setting: str) -> Optional[dict]:
    """The ``fcdp.diloco`` block of a setting name, ``None`` for the exact-DP settings. ``diloco{H}`` then any of
    ``_int4``/``_int8``/``_bf16`` (pseudo-gradient codec), ``_lr{x}`` (outer_lr), ``_mom{x}`` (outer_momentum), ``_hb``
    (heavy-ball instead of Nesterov), ``_f{F}`` (streaming fragments), ``_ov{n}`` (overlap_steps), ``_wu{W}`` (warmup_steps); the rest are
    the block's defaults. ``_ilr{x}`` scales the inner (the job's own) learning rate: :func:`inner_lr_scale`."""
    m = _DILOCO_NAME.match(setting)
    if m is None:
        return None
    block: dict = {"sync_every": int(m.group(1))}
    for tok in filter(None, m.group(2).split("_")):
        if tok in ("int4", "int8", "bf16"):
            block["compression"] = tok
        elif tok == "hb":
            block["nesterov"] = False
        elif tok.startswith("ilr"):
            continue  # not a key of the block: inner_lr_scale
        elif tok.startswith("wu"):
            block["warmup_steps"] = int(tok[2:])
        elif tok[0] == "f" or tok.startswith("ov"):
            block["fragments" if tok[0] == "f" else "overlap_steps"] = int(tok.lstrip("fov"))
        else:
            key, value = ("outer_lr", tok[2:]) if tok.startswith("lr") else ("outer_momentum", tok[3:])
            block[key] = float(value)
    return block


def inner_lr_scale(setting: str) -> float:
    """The factor a DiLoCo setting (``_ilr{x}``) puts on ``--lr`` (1 for every other setting): each node's batch is
    1/N of the global one, and Adam's step shrinks with the gradient noise it normalizes by (a probe knob; no
    value of it is measured to help)."""
    m = re.search(r"_ilr([\d.]+)", setting) if diloco_block(setting) is not None else None
    return float(m.group(1)) if m else 1.0


def known_setting(setting: str) -> bool:
    return setting in SETTINGS or diloco_block(setting) is not None


def compressions(setting: str) -> tuple[str, str]:
    """(param_compression, grad_compression) of a setting (DiLoCo's: off/off, its codec is its own)."""
    return SETTINGS.get(setting, ("off", "off"))
DTYPES = ("fp32", "bf16")
#: Seconds per optimizer step and per setting's launch, evaluations and hashes, at the default sizes on the
#: project's quiet 2-core machine. [Note: estimate] Not measured quietly: on the shared machine a step cost
#: 3.1-3.9x (fp32) and 2.1x (bf16) the CPU time of the bench's MLP step in the same processes, and that step
#: took about 0.18 s on the quiet machine (docs/benchmarks.md). Only the first estimate of a sweep uses
#: these; each finished setting's measured time replaces them.
EST_STEP_S = {"fp32": 0.65, "bf16": 0.4}
EST_LAUNCH_S = 35.0


@dataclass
class ConvergeSpec:
    nodes: int = 2
    ranks_per_node: int = 2
    rate_mbit: float = 1000
    """Per node uplink; 0 = unlimited. Only bytes and losses matter here, so a modest, not a slow, link."""
    settings: Sequence[str] = ("exact", "int8", "int4")
    dtypes: Sequence[str] = DTYPES
    steps: int = 500
    eval_every: int = 25
    eval_windows: int = 64
    """Held-out windows per intermediate evaluation (the first ones, the same for every setting)."""
    eval_batch: int = 16
    micro_batch: int = 8
    grad_accum: int = 1
    context: int = 128
    width: int = 160
    layers: int = 4
    heads: int = 4
    lr: float = 2e-3
    warmup_steps: int = 25
    grad_clip: float = 1.0
    seed: int = 0
    regime: str = "large"
    compression_block: int = 128
    timeout_s: float = 3600

    def fingerprint(self) -> str:
        """What a setting's record depends on (everything except which settings and dtypes to sweep)."""
        keep = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("settings", "dtypes", "timeout_s")}
        return hashlib.sha256(json.dumps(keep, sort_keys=True, default=list).encode()).hexdigest()[:16]


def setting_key(setting: str, dtype: str) -> str:
    return f"{setting}-{dtype}"


def codecs(setting: str, block: int) -> dict:
    """What each side's codec is (``"int4/b128/hadamard"``, ``"off"``): a record is kept on resume only if it was
    trained with the codecs this code builds (records from before the field: unrotated, as that code was)."""
    from fcdp_deepspeed.compress.quant import codec_for

    def describe(name: str, side: str) -> str:
        codec = codec_for(name, block, side=side)
        return "off" if codec is None else f"{codec.name}/b{codec.block}" + ("/hadamard" if codec.rotate else "")
    pc, gc = compressions(setting)
    return {"params": describe(pc, "params"), "grads": describe(gc, "grads")}


def _recorded_codecs(record: dict) -> dict:
    from fcdp_deepspeed.compress.quant import DEFAULT_BLOCK
    if "codecs" in record:
        return record["codecs"]
    block = record.get("compression_block", DEFAULT_BLOCK)
    return {side: "off" if name == "off" else f"{name}/b{block}"
            for side, name in (("params", record.get("param_compression")), ("grads", record.get("grad_compression")))}


def ds_config(spec: ConvergeSpec, setting: str, dtype: str) -> dict:
    """The DeepSpeed config of one setting: ZeRO-3 (toy's release regime), Adam with linear warmup and decay,
    and the fcdp block: the defaults plus this setting's compression."""
    from fcdp_lab.harness import toy
    pc, gc = compressions(setting)
    block = {"enabled": True, "ranks_per_node": spec.ranks_per_node, "cache_device": "host"}
    if (pc, gc) != ("off", "off"):  # exact = today's defaults, the keys left out
        block.update(param_compression=pc, grad_compression=gc, compression_block=spec.compression_block)
    if diloco_block(setting) is not None:  # the held-out loss between syncs is the mean of the nodes' own models
        block.update(diloco=diloco_block(setting), compression_block=spec.compression_block)
    cfg = toy.ds_config(block, regime=spec.regime, grad_accum=spec.grad_accum, micro_batch=spec.micro_batch,
                        lr=spec.lr * inner_lr_scale(setting), dtype=dtype)
    cfg["gradient_clipping"] = spec.grad_clip
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": spec.lr * inner_lr_scale(setting), "warmup_num_steps": spec.warmup_steps,
        "total_num_steps": spec.steps, "warmup_type": "linear"}}
    return cfg


def _uplink(kernel: bool) -> tuple[int, int, int, int]:
    """This node's uplink counters (tx bytes, tx packets, rx bytes, rx packets); zeros outside a cluster."""
    if not kernel:
        return 0, 0, 0, 0
    base = "/sys/class/net/eth0/statistics/"
    return tuple(int(open(base + k).read()) for k in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets"))


class _Meter:
    """Inter-node bytes between two readings: kernel payload of this node's uplink (one rank per node
    reads it) and this rank's own counted wire bytes (the ledger's model of gloo)."""

    def __init__(self, kernel: bool) -> None:
        from fcdp_deepspeed.reporting.stats import LEDGER
        self.ledger = LEDGER
        self.kernel = kernel
        self._c, self._l = _uplink(kernel), LEDGER.totals.copy()

    def take(self) -> tuple[int, int]:
        from fcdp_lab.harness.cluster import HEADER_BYTES
        c, l = _uplink(self.kernel), self.ledger.totals.copy()
        payload = (c[0] - self._c[0]) - HEADER_BYTES * (c[1] - self._c[1])
        counted = sum(l.minus(self._l).wire.values())
        self._c, self._l = c, l
        return payload, counted


def _evaluate(engine, x, y, batch: int) -> tuple[float, int]:
    """Summed next-token loss (nats) and token count of this rank's held-out share, under ``no_grad``."""
    import torch
    import torch.nn.functional as F
    total, tokens = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for i in range(0, x.shape[0], batch):
            logits = engine(x[i:i + batch])
            tgt = y[i:i + batch]
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                     reduction="sum").item()
            tokens += tgt.numel()
    engine.train()
    return total, tokens


def rank_main(spec: dict, setting: str, dtype: str, kernel: bool = True) -> dict:
    """One setting on this rank; returns the setting's record (complete on rank 0)."""
    import deepspeed
    from deepspeed import comm as dist

    import fcdp_deepspeed
    from fcdp_deepspeed.config import ds_compat
    from fcdp_lab.converge import model_hash, textdata, tinylm

    s = ConvergeSpec(**spec)
    t_start = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(s.ranks_per_node)
    fcdp_deepspeed.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    reads_uplink = kernel and int(os.environ.get("LOCAL_RANK", "0")) == 0
    split = textdata.split_corpus(textdata.corpus_bytes())
    train_tokens, held_tokens = textdata.as_tokens(split.train), textdata.as_tokens(split.heldout)
    all_x, all_y = textdata.heldout_windows(held_tokens, s.context)
    part_x, part_y = textdata.shard(*textdata.heldout_windows(held_tokens, s.context, s.eval_windows), rank, world)
    full_x, full_y = textdata.shard(all_x, all_y, rank, world)
    cfg = tinylm.LMConfig(context=s.context, width=s.width, layers=s.layers, heads=s.heads)
    model = tinylm.build(cfg, seed=s.seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(s, setting, dtype))
    setup_s = time.perf_counter() - t_start
    meter = _Meter(reads_uplink)
    evals, train_losses, step_bytes, step_counted, step_times, step_cpu = [], [], [], [], [], []
    eval_bytes = eval_counted = 0

    def run_eval(step: int, final: bool) -> None:
        nonlocal eval_bytes, eval_counted
        meter.take()
        total, tokens = _evaluate(engine, *(full_x, full_y) if final else (part_x, part_y), s.eval_batch)
        payload, counted = meter.take()
        eval_bytes += payload
        eval_counted += counted
        evals.append({"step": step, "final": final, "loss_sum": total, "tokens": tokens,
                      "train_payload_before": sum(step_bytes), "train_counted_before": sum(step_counted),
                      "eval_payload_before": eval_bytes - payload, "eval_counted_before": eval_counted - counted})

    started = time.perf_counter()
    run_eval(0, False)
    for step in range(s.steps):
        meter.take()
        t0, c0 = time.perf_counter(), time.process_time()
        for micro in range(s.grad_accum):
            x, y = textdata.train_batch(train_tokens, s.context, s.micro_batch, seed=s.seed,
                                        step=step * s.grad_accum + micro, rank=rank)
            loss = tinylm.loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            train_losses.append(loss.item())
        step_times.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
        payload, counted = meter.take()
        step_bytes.append(payload)
        step_counted.append(counted)
        if (step + 1) % s.eval_every == 0 and step + 1 < s.steps:
            run_eval(step + 1, False)
    run_eval(s.steps, False)  # the same windows as every intermediate point, for the curve
    run_eval(s.steps, True)
    wall = time.perf_counter() - started
    probe = all_x[:2]
    hashes = {"gathered": model_hash.gathered_hash(engine), "forward": model_hash.forward_hash(engine, probe)}
    stats = fcdp_deepspeed.get_stats(engine)
    mine = {"rank": rank, "evals": evals, "train_losses": train_losses, "step_bytes": step_bytes,
            "step_counted": step_counted, "step_times": step_times, "step_cpu": step_cpu, "hashes": hashes,
            "eval_bytes": eval_bytes, "eval_counted": eval_counted, "wall_s": wall, "setup_s": setup_s,
            "hash_s": time.perf_counter() - started - wall}
    everyone: list = [None] * world
    ds_compat.all_gather_object(everyone, mine)
    if rank != 0:
        return {}
    return combine(s, setting, dtype, everyone, stats, split.sha256, tinylm.num_params(cfg), kernel)


def combine(s: ConvergeSpec, setting: str, dtype: str, everyone: list[dict], stats: dict, corpus_sha256: str,
            params: int, kernel: bool) -> dict:
    """One setting's record from every rank's measurements (sums over nodes and ranks, slowest rank per step)."""
    world = len(everyone)
    payload_key, evals0 = ("step_bytes" if kernel else "step_counted"), everyone[0]["evals"]
    step_bytes = [sum(r[payload_key][i] for r in everyone) for i in range(s.steps)]
    eval_bytes = sum(r["eval_bytes" if kernel else "eval_counted"] for r in everyone)
    kernel_total = sum(sum(r["step_bytes"]) + r["eval_bytes"] for r in everyone)
    counted_total = sum(sum(r["step_counted"]) + r["eval_counted"] for r in everyone)
    eval_key = "eval_payload_before" if kernel else "eval_counted_before"
    train_key = "train_payload_before" if kernel else "train_counted_before"
    curve = []
    for i, e in enumerate(evals0):
        loss_sum = sum(r["evals"][i]["loss_sum"] for r in everyone)
        tokens = sum(r["evals"][i]["tokens"] for r in everyone)
        before = sum(r["evals"][i][train_key] + r["evals"][i][eval_key] for r in everyone)
        curve.append({"step": e["step"], "final": e["final"], "heldout_loss": loss_sum / tokens, "tokens": tokens,
                      "cumulative_inter_node_bytes": before})
    ga = s.grad_accum
    train_losses = [statistics.fmean(r["train_losses"][i] for r in everyone) for i in range(s.steps * ga)]
    step_times = [max(r["step_times"][i] for r in everyone) for i in range(s.steps)]
    cpu = [sum(r["step_cpu"][i] for r in everyone) for i in range(s.steps)]
    pc, gc = compressions(setting)
    hashes = {view: [r["hashes"][view] for r in everyone] for view in ("gathered", "forward")}
    from fcdp_lab.converge.model_hash import all_equal
    return {
        "key": setting_key(setting, dtype), "setting": setting, "dtype": dtype, "param_compression": pc,
        "grad_compression": gc, "compression_block": s.compression_block, "fingerprint": s.fingerprint(),
        "codecs": codecs(setting, s.compression_block), "diloco": diloco_block(setting),
        "inner_lr": s.lr * inner_lr_scale(setting),
        "spec": asdict(s) | {"settings": None, "dtypes": None}, "corpus_sha256": corpus_sha256, "params": params,
        "nodes": s.nodes, "world": world, "rate_mbit": s.rate_mbit, "steps": s.steps,
        "bytes_source": "kernel" if kernel else "counted",
        "curve": curve, "final_heldout_loss": curve[-1]["heldout_loss"],
        "final_heldout_tokens": curve[-1]["tokens"],
        "train_losses": train_losses,
        "train_inter_node_bytes_by_step": step_bytes,
        "train_inter_node_bytes": sum(step_bytes),
        "eval_inter_node_bytes": eval_bytes,
        # [Note: bytes per step] train + eval over steps: an evaluation gathers the changed parameters the
        # next training forward then finds cached, so the sum is what training alone moves plus about one
        # gather (the last evaluation's), within 1/steps of it; training bytes alone would undercount.
        "inter_node_bytes_per_step": (sum(step_bytes) + eval_bytes) / s.steps,
        "counted_inter_node_bytes": counted_total,
        "kernel_inter_node_bytes": kernel_total,
        "counted_vs_kernel": counted_total / kernel_total if kernel and kernel_total else None,
        "step_time_median_s": statistics.median(step_times),
        "cpu_s_per_step_all_ranks": statistics.median(cpu),
        "wall_s": max(r["wall_s"] for r in everyone),
        "setup_s": max(r["setup_s"] for r in everyone), "hash_s": max(r["hash_s"] for r in everyone),
        "hashes": hashes, "bitwise_equal_across_ranks": all(all_equal(h) for h in hashes.values()),
        "fcdp_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _estimate(spec: ConvergeSpec, pending: list[tuple[str, str]], done: list[dict]) -> float:
    """Seconds the pending settings should take: this sweep's own launches once there are any (per dtype
    where measured), else the calibration constants above."""
    def one(dtype: str) -> float:
        mine = [r["launch_wall_s"] for r in done if r["dtype"] == dtype] or [r["launch_wall_s"] for r in done]
        return statistics.fmean(mine) if mine else EST_LAUNCH_S + spec.steps * EST_STEP_S.get(dtype, 0.6)
    return sum(one(d) for _, d in pending)


def run_converge(spec: ConvergeSpec, out_dir: Path, *, fresh: bool = False, netns: bool = True,
                 log=print) -> list[dict]:
    """Every (dtype, setting) of ``spec`` not already in ``out_dir/converge.json`` with the same spec."""
    from fcdp_lab.converge import report as converge_report
    from fcdp_lab.harness.launch import run_local

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / converge_report.RESULTS
    records = {} if fresh else converge_report.load(path)
    fp = spec.fingerprint()
    wanted = [(st, d) for d in spec.dtypes for st in sorted(spec.settings, key=lambda x: x != "exact")]
    pending = [(st, d) for st, d in wanted if records.get(setting_key(st, d), {}).get("fingerprint") != fp
               or _recorded_codecs(records[setting_key(st, d)]) != codecs(st, spec.compression_block)
               or records[setting_key(st, d)].get("diloco") != diloco_block(st)]
    kept = len(wanted) - len(pending)
    log(f"python -m fcdp_lab converge: {len(wanted)} settings, {kept} already done (same spec), {len(pending)} to run; "
        f"estimated {_estimate(spec, pending, []) / 60:.0f} min")
    done_now: list[dict] = []
    for i, (setting, dtype) in enumerate(pending):
        log(f"[converge {i + 1}/{len(pending)}] {setting} {dtype}: {spec.steps} steps"
            + (f" (about {_estimate(spec, pending[i:], done_now) / 60:.0f} min left)" if done_now else ""))
        t0 = time.time()
        world = spec.nodes * spec.ranks_per_node
        kwargs = {"spec": asdict(spec), "setting": setting, "dtype": dtype, "kernel": netns}
        if netns:
            from fcdp_lab.harness.cluster import EmulatedCluster
            with EmulatedCluster(spec.nodes, rate_mbit=spec.rate_mbit or None, tag="c") as cluster:
                record = run_local("fcdp_lab.converge.converge:rank_main", world, kwargs,
                                   timeout=spec.timeout_s, cluster=cluster)[0]
        else:  # simulated nodes (ranks_per_node), counted bytes only: for tests without root
            record = run_local("fcdp_lab.converge.converge:rank_main", world, kwargs, timeout=spec.timeout_s)[0]
        record["launch_wall_s"] = time.time() - t0
        records[record["key"]] = record
        done_now.append(record)
        converge_report.write_results(records, out_dir, order=[setting_key(st, d) for st, d in wanted])
        log(converge_report.one_line(record, records))
    if not pending:
        converge_report.write_results(records, out_dir, order=[setting_key(st, d) for st, d in wanted])
    return [records[setting_key(st, d)] for st, d in wanted if setting_key(st, d) in records]


def main(argv: Optional[list[str]] = None) -> int:
    from fcdp_lab.converge import report as converge_report
    ap = argparse.ArgumentParser(prog="python -m fcdp_lab converge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ConvergeSpec()
    ap.add_argument("--settings", default=",".join(d.settings), help=f"comma-separated, of {', '.join(SETTINGS)} "
                    "or diloco{H} with suffixes _int4, _int8, _lr{outer_lr}, _mom{outer_momentum}, _hb (heavy-ball), "
                         "_f{fragments}, _ov{overlap_steps}, _ilr{inner lr factor}")
    ap.add_argument("--dtypes", default=",".join(d.dtypes), help="comma-separated, of fp32, bf16")
    ap.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per setting")
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-windows", type=int, default=d.eval_windows,
                    help="held-out windows of --context bytes per intermediate evaluation (the last one uses all)")
    ap.add_argument("--rate", type=float, default=d.rate_mbit, help="Mbit/s per node uplink, 0 = unlimited")
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node)
    ap.add_argument("--micro-batch", type=int, default=d.micro_batch)
    ap.add_argument("--grad-accum", type=int, default=d.grad_accum)
    ap.add_argument("--context", type=int, default=d.context)
    ap.add_argument("--width", type=int, default=d.width)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--regime", choices=["large", "default"], default=d.regime)
    ap.add_argument("--compression-block", type=int, default=d.compression_block)
    ap.add_argument("--out", default="docs/results/compression", help="directory of converge.json, converge.png, converge-table.txt")
    ap.add_argument("--fresh", action="store_true", help="rerun every setting, ignoring recorded ones")
    ap.add_argument("--no-netns", action="store_true",
                    help="simulate the nodes with ranks_per_node instead of network namespaces (no root; "
                         "bytes from FCDP's own counters, not the kernel)")
    args = ap.parse_args(argv)
    # [Note: one JIT build dir per venv] as tests/conftest.py: the shared ~/.cache/torch_extensions is rebuilt by
    # every venv whose paths differ, and a killed build's lock makes every rank wait at init_distributed.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    unknown = sorted(x for x in set(args.settings.split(",")) if not known_setting(x)) + sorted(set(args.dtypes.split(",")) - set(DTYPES))
    if unknown:
        ap.error(f"unknown setting or dtype: {', '.join(unknown)}")
    spec = ConvergeSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate_mbit=args.rate,
                        settings=args.settings.split(","), dtypes=args.dtypes.split(","), steps=args.steps,
                        eval_every=args.eval_every, eval_windows=args.eval_windows, micro_batch=args.micro_batch,
                        grad_accum=args.grad_accum, context=args.context, width=args.width, layers=args.layers,
                        heads=args.heads, lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed,
                        regime=args.regime, compression_block=args.compression_block)
    from fcdp_lab.harness.cluster import ClusterUnavailable
    try:
        records = run_converge(spec, Path(args.out), fresh=args.fresh, netns=not args.no_netns)
    except ClusterUnavailable as err:
        print(f"python -m fcdp_lab converge needs network namespaces ({err}); --no-netns simulates the nodes instead")
        return 2
    print(converge_report.markdown(records))
    print(f"results: {args.out}/{converge_report.RESULTS}, {converge_report.PLOT}, {converge_report.SUMMARY}")
    return 0 if all(r["bitwise_equal_across_ranks"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
