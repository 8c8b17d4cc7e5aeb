"""The GPU check: what the CPU tests cannot see, in one command (``scripts/gpu_check.py``).

Each case runs in its own process (:func:`~fcdp_deepspeed.tools.launch.run_local`) and returns a
:class:`CaseResult`; :func:`run` collects them into one JSON report.

- ``a_grad_flush``: NCCL at world size 1. A :class:`~fcdp_deepspeed.grads.GradReducer` with a
  *host* node buffer accumulates real gradients, delivers one at the boundary and flushes one that
  got no gradient there; every window sum is checked against a reference sum (bit-exact).
- ``b_fake_pg``: a fake process group of world size 4 (2 nodes x 2; this process is rank 0) through
  ``deepspeed.initialize``, prefetch on, a gated block; plain ZeRO-3 vs FCDP host/device/auto:
  peak device memory, profiler counts of synchronizations and synchronous copies per step, the
  fraction of H2D copy time that overlaps compute kernels. Collectives move no data, so values
  are meaningless; memory, copies, synchronizations and overlap are real.
- ``c_multi_gpu`` (4 or more GPUs): real NCCL, 2 emulated nodes x L; losses against ZeRO-3, step
  times against ZeRO-3 and ZeRO++ hpZ.

``dry_run=True`` runs (a) on gloo and (b) on the CPU accelerator: the logic, not the device.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

#: A 5% margin on peak memory, as the issue states it.
MEMORY_TOLERANCE = 0.05


@dataclass
class Check:
    name: str
    passed: Optional[bool]
    """``None``: not applicable in this mode (the CPU accelerator has no device memory or streams)."""
    detail: str = ""


@dataclass
class CaseResult:
    case: str
    checks: list[Check] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)
    error: Optional[str] = None

    def check(self, name: str, passed: Any, detail: str = "", applicable: bool = True) -> None:
        self.checks.append(Check(name, bool(passed) if applicable else None, detail))

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed is not False for c in self.checks)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def call_site(exc: BaseException) -> str:
    """The exception and the innermost frame of this package that led to it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "fcdp_deepspeed" in f.filename]
    where = f" at {frames[-1].filename.split('fcdp_deepspeed')[-1]}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"


# -- (a) the gradient flush path with a host node buffer ------------------------------------------
def grad_flush_case(backend: str, numels: tuple[int, ...] = (4099, 37), micro_steps: int = 3) -> CaseResult:
    """World size 1. Every parameter gets a gradient in the first ``micro_steps - 1`` micro-steps; the
    last one gets none in the boundary micro-step, so its window sum leaves through ``flush``."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    from fcdp_deepspeed.config import parse_fcdp_config
    from fcdp_deepspeed.grads import GradReducer, build_layout

    res = CaseResult("a_grad_flush")
    acc = get_accelerator()
    acc.set_device(0)
    deepspeed.init_distributed(dist_backend=backend)
    device = torch.device(acc.current_device_name())
    group = dist.new_group([0])
    cfg = parse_fcdp_config({"fcdp": {"enabled": True, "ranks_per_node": 1, "grad_accumulation": "node",
                                      "grad_buffer_device": "host"}})
    boundary = [False]
    reducer = GradReducer(cfg, build_layout([0], {0: "node0"}, 0), group, group, group, torch.float32,
                          lambda: boundary[0])
    reducer.use_alltoall = False  # reduce_scatter_tensor, NCCL's path, also on gloo in a dry run
    params = []
    for ds_id, n in enumerate(numels):
        p = torch.nn.Parameter(torch.zeros(n, device=device))
        p.ds_id, p.ds_numel = ds_id, n
        params.append(p)
    reducer.plan_buffer(params)
    flat = reducer.buffer.flat
    res.numbers.update(backend=backend, device=str(device), buffer_bytes=reducer.buffer.nbytes)
    res.check("node buffer allocated on the host", flat is not None and flat.device.type == "cpu")
    res.check("node buffer pinned", flat is not None and flat.is_pinned(), applicable=device.type != "cpu")
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(n, generator=gen).to(device) for n in numels] for _ in range(micro_steps)]
    delivered: dict[int, torch.Tensor] = {}
    try:
        for m in range(micro_steps):
            boundary[0] = m == micro_steps - 1
            step_params = params[:-1] if boundary[0] else params
            out = reducer.reduce(step_params, grads[m][:len(step_params)])
            delivered.update((p.ds_id, o) for p, o in zip(step_params, out) if o.numel())
        for batch_params, parts in reducer.flush(torch.float32, bucket_numel=10**7):
            delivered.update((p.ds_id, o) for p, o in zip(batch_params, parts))
        acc.synchronize()
    except Exception as exc:  # e.g. NCCL refusing a host tensor: report where, keep the JSON
        res.check("boundary delivery and flush ran", False, call_site(exc))
        return res
    res.check("boundary delivery and flush ran", True)
    res.check("every window sum delivered", sorted(delivered) == list(range(len(params))), f"got {sorted(delivered)}")
    errors = []
    for i, n in enumerate(numels):
        got = delivered.get(i)
        window = micro_steps if i < len(numels) - 1 else micro_steps - 1
        ref = torch.zeros(n)
        for m in range(window):  # the reducer's order: zero buffer, + each micro-step
            ref = ref + grads[m][i].cpu()
        exact = sum(grads[m][i].cpu().double() for m in range(window))
        errors.append(None if got is None else float((got.cpu().double() - exact).abs().max()))
        res.check(f"param {i}: on the accelerator", got is not None and got.device == device)
        res.check(f"param {i}: equals the reference sum", got is not None and torch.equal(got.cpu(), ref),
                  "delivered at the boundary" if i < len(numels) - 1 else "delivered by flush")
    res.numbers.update(max_abs_error_vs_float64=errors, **reducer.stats())
    res.check("buffer empty after the window", not reducer.buffer.dirty and flat is not None and not flat.any())
    res.check("one parameter flushed", reducer.counters.flushed == 1, f"flushed {reducer.counters.flushed}")
    return res


# -- (b) fake world of 4 through deepspeed.initialize ---------------------------------------------
def gated_model(hidden: int, layers: int):
    """The toy MLP whose last block runs on even micro-steps only (conditional computation)."""
    from fcdp_deepspeed.tools import toy

    class GatedToy(toy.ToyModel):
        def forward(self, x: torch.Tensor, use_last: bool = True) -> torch.Tensor:
            h = self.inp(x)
            for i, block in enumerate(self.blocks):
                if use_last or i < len(self.blocks) - 1:
                    h = block(h)
            return self.out(h)

    torch.manual_seed(0)
    return GatedToy(hidden, layers)


@contextlib.contextmanager
def fake_node_discovery(ranks_per_node: int) -> Iterator[None]:
    """[Note: a fake group moves no data] FCDP's one object all-gather (node discovery) would return
    garbage; answer it with what the 4 ranks of the layout would send. Everything else is FCDP's."""
    from deepspeed import comm as dist

    from fcdp_deepspeed import topology
    original = topology.discover_node_map

    def discover(ranks_per_node_arg=None, dp_group=None):
        world = dist.get_world_size()
        return (tuple(f"node{r // ranks_per_node}" for r in range(world)), "fcdp.ranks_per_node",
                [tuple(range(world))] * world)

    topology.discover_node_map = discover
    try:
        yield
    finally:
        topology.discover_node_map = original


def train_step(engine, micro: int, hidden: int) -> tuple[list[torch.Tensor], int]:
    """One optimizer step of the gated model, inputs on the engine's device; losses stay on the device."""
    from fcdp_deepspeed.tools import toy
    losses = []
    for _ in range(engine.gradient_accumulation_steps()):
        x, y = toy.batch(micro, engine.train_micro_batch_size_per_gpu(), hidden)
        loss = F.mse_loss(engine(x.to(engine.device), use_last=micro % 2 == 0), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        micro += 1
    return losses, micro


def measure_variant(fcdp: Optional[dict], hidden: int, layers: int, steps: int, on_gpu: bool) -> dict:
    """Build, train ``steps`` traced steps and release one engine; memory relative to before it."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import fcdp_deepspeed
    from fcdp_deepspeed.tools import gpu_trace, toy

    acc = get_accelerator()
    gc.collect()
    acc.empty_cache()
    base, base_reserved = acc.memory_allocated(), acc.memory_reserved()
    acc.reset_peak_memory_stats()
    block = {"enabled": True, "ranks_per_node": 2, **fcdp} if fcdp is not None else None
    # prefetch on, parameters released after use (the regime where backward re-gathers)
    cfg = toy.ds_config(block, regime="default", grad_accum=2, stage3_max_reuse_distance=0,
                        stage3_prefetch_bucket_size=2 * hidden * hidden)
    fcdp_deepspeed.install()
    model = gated_model(hidden, layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    out: dict[str, Any] = {"peak_allocated": [], "peak_reserved": [], "seconds": [], "trace": []}
    micro, losses = 0, []
    for _ in range(steps):
        acc.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with gpu_trace.traced(on_gpu) as holder:
            step_losses, micro = train_step(engine, micro, hidden)
        losses += step_losses
        acc.synchronize()
        out["seconds"].append(time.perf_counter() - t0)
        out["peak_allocated"].append(acc.max_memory_allocated() - base)
        out["peak_reserved"].append(acc.max_memory_reserved() - base_reserved)
        out["trace"].append({**asdict(holder[0]), "overlap_fraction": holder[0].overlap_fraction})
    out["losses"] = [float(v) for v in losses]
    stats = fcdp_deepspeed.get_stats(engine)
    out["stats"] = {k: stats.get(k) for k in ("cache_hits", "host_pool_bytes", "device_pool_bytes",
                                              "pinned_pool_bytes", "h2d_async_copies", "h2d_async_bytes")}
    del engine, model
    return out


def within(value: float, reference: float, tolerance: float = MEMORY_TOLERANCE) -> bool:
    return abs(value - reference) <= tolerance * max(reference, 1)


def fake_pg_case(dry_run: bool, hidden: int, layers: int, steps: int) -> CaseResult:
    """(b) This process is rank 0 of a fake world of 4 (2 nodes x 2)."""
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    res = CaseResult("b_fake_pg")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    get_accelerator().set_device(0)
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    deepspeed.init_distributed()
    res.check("deepspeed.init_distributed adopts the fake group",
              dist.get_world_size() == 4 and tdist.get_backend() == "fake",
              f"world {dist.get_world_size()}, backend {tdist.get_backend()}")
    on_gpu = not dry_run
    variants = {"zero3": None, "host": {"cache_device": "host"},
                "device": {"cache_device": "device", "device_budget": "50%"}, "auto": {"cache_device": "auto"}}
    with fake_node_discovery(ranks_per_node=2):
        runs = {name: measure_variant(extra, hidden, layers, steps, on_gpu) for name, extra in variants.items()}
    res.numbers.update(hidden=hidden, layers=layers, steps=steps, runs=runs)
    z, host, auto = runs["zero3"], runs["host"], runs["auto"]
    why = "" if on_gpu else "CPU accelerator: no device memory or streams"
    for kind in ("allocated", "reserved"):
        a, b = max(host[f"peak_{kind}"]), max(z[f"peak_{kind}"])
        res.check(f"host: peak {kind} within 5% of ZeRO-3", within(a, b), f"{a} vs {b} bytes {why}", on_gpu)
    for name in ("host", "device", "auto"):
        res.check(f"{name}: cache served hits", (runs[name]["stats"]["cache_hits"] or 0) > 0,
                  f"{runs[name]['stats']['cache_hits']} hits")
    res.check("host: pool pinned", (host["stats"]["pinned_pool_bytes"] or 0) > 0, why, on_gpu)
    a1, z1 = auto["peak_allocated"][0], z["peak_allocated"][0]
    res.check("auto: step-1 peak within 5% of ZeRO-3's", within(a1, z1), f"{a1} vs {z1} bytes {why}", on_gpu)
    grown, pool = auto["peak_allocated"][-1] - a1, auto["stats"]["device_pool_bytes"] or 0
    res.check(f"auto: step-{steps} growth over step 1 at most its device pool (+5% of ZeRO-3)",
              grown <= pool + MEMORY_TOLERANCE * z1, f"grew {grown}, pool {pool} bytes {why}", on_gpu)
    for name in ("host", "device", "auto"):  # steady state: steps after the first (which builds the trace)
        for key in ("syncs", "sync_memcpys", "pageable_copies"):
            extra = [r[key] - q[key] for r, q in zip(runs[name]["trace"][1:], z["trace"][1:])]
            res.check(f"{name}: {key} per step <= ZeRO-3's", max(extra, default=0) <= 0,
                      f"per-step excess {extra} {why}", on_gpu)
    res.numbers["h2d_overlap_fraction"] = {n: [t["overlap_fraction"] for t in r["trace"]] for n, r in runs.items()}
    return res


# -- (c) 4 or more GPUs: real NCCL, 2 emulated nodes x L ------------------------------------------
def multi_gpu_rank(hidden: int, layers: int, steps: int, per_node: int) -> dict:
    """One rank of the multi-GPU case: losses and step times per variant."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from fcdp_deepspeed.tools import toy

    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")
    node = lambda **kw: {"enabled": True, "ranks_per_node": per_node, **kw}  # noqa: E731
    variants = {"zero3": (None, {}), "host": (node(cache_device="host"), {}),
                "device": (node(cache_device="device"), {}), "hpz": (None, {"hpz": per_node}),
                "zero3_ga2": (None, {"grad_accum": 2}),
                "hierarchical_ga2": (node(cache_device="host", grad_reduce="hierarchical"), {"grad_accum": 2}),
                "node_ga2": (node(cache_device="host", grad_accumulation="node"), {"grad_accum": 2}),
                "zero3_bf16": (None, {"dtype": "bf16"}), "host_bf16": (node(cache_device="host"), {"dtype": "bf16"})}
    out = {}
    for name, (block, kw) in variants.items():
        engine = toy.build_engine(toy.ds_config(block, regime="large", micro_batch=8, **kw), hidden=hidden, layers=layers)
        run = toy.train(engine, steps, hidden=hidden, dtype=torch.bfloat16 if kw.get("dtype") == "bf16" else torch.float32)
        get_accelerator().synchronize()
        out[name] = {"losses": run.losses, "step_times": run.step_times}
        del engine
    return out


def multi_gpu_case(results: list[dict], per_node: int) -> CaseResult:
    """Compare the ranks' runs: flat FCDP bit-identical, gradient modes within 1e-5, bf16 and times measured."""
    res = CaseResult("c_multi_gpu")
    res.numbers.update(world=len(results), per_node=per_node)

    def rel(a: list, b: list) -> float:
        return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)

    for r, run in enumerate(results):
        for name in ("host", "device"):
            res.check(f"rank {r} {name}: losses bit-identical to ZeRO-3", run[name]["losses"] == run["zero3"]["losses"])
        for name in ("hierarchical_ga2", "node_ga2"):
            err = rel(run[name]["losses"], run["zero3_ga2"]["losses"])
            res.check(f"rank {r} {name}: losses within 1e-5 of ZeRO-3 (fp32)", err <= 1e-5, f"max rel {err:.2e}")
        res.numbers[f"rank{r}_bf16_max_rel_loss_diff"] = rel(run["host_bf16"]["losses"], run["zero3_bf16"]["losses"])
    median = {n: statistics.median(results[0][n]["step_times"][1:] or results[0][n]["step_times"])
              for n in ("zero3", "host", "device", "hpz")}
    res.numbers["rank0_median_step_seconds"] = median
    res.numbers["rank0_step_time_vs_zero3"] = {n: t / median["zero3"] for n, t in median.items()}
    return res


# -- orchestration ----------------------------------------------------------------------------------
def _in_process(target: str, world: int, kwargs: dict, timeout: float, accelerator: str) -> list:
    from fcdp_deepspeed.tools.launch import run_local
    return run_local(f"fcdp_deepspeed.tools.gpu_check:{target}", world, kwargs, timeout=timeout,
                     env={"DS_ACCELERATOR": accelerator, "PYTHONWARNINGS": "ignore"})


def _case(name: str, fn) -> CaseResult:
    """Run one case; a crashed or timed-out process becomes a failed case with its log tail."""
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # RankFailure carries the rank's log tail
        text = str(exc)
        res = CaseResult(name, error=f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}\n{text[-3000:]}")
    res.numbers["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def run(dry_run: bool, gpus: int, hidden: int, layers: int, steps: int) -> dict:
    """Every case that fits this machine; the JSON report as a dict (``passed`` over all checks).
    Deadlines: 60 + 120 + 120 s on a GPU machine (the 5-minute bound), doubled for a dry run."""
    accel = "cpu" if dry_run else "cuda"
    slow = 2 if dry_run else 1
    cases = [
        _case("a_grad_flush", lambda: _in_process("grad_flush_case", 1, {"backend": "gloo" if dry_run else "nccl"},
                                                  60 * slow, accel)[0]),
        _case("b_fake_pg", lambda: _in_process("fake_pg_case", 1, dict(dry_run=dry_run, hidden=hidden, layers=layers,
                                                                       steps=steps), 120 * slow, accel)[0]),
    ]
    if not dry_run and gpus >= 4:
        per_node = gpus // 2
        kwargs = dict(hidden=hidden, layers=layers, steps=steps, per_node=per_node)
        cases.append(_case("c_multi_gpu", lambda: multi_gpu_case(
            _in_process("multi_gpu_rank", 2 * per_node, kwargs, 120, accel), per_node)))
    return {"mode": "dry-run-cpu" if dry_run else "gpu", "gpus": gpus, "passed": all(c.passed for c in cases),
            "cases": {c.case: c.to_json() for c in cases}}


def summary(report: dict) -> str:
    """A short human summary: one line per case, one per failed check."""
    lines = [f"gpu_check ({report['mode']}, {report['gpus']} GPU(s)): {'PASS' if report['passed'] else 'FAIL'}"]
    for name, case in report["cases"].items():
        counts = {k: sum(c["passed"] is v for c in case["checks"]) for k, v in (("pass", True), ("fail", False), ("n/a", None))}
        lines.append(f"  {name}: {'PASS' if case['passed'] else 'FAIL'} ({counts['pass']} pass, {counts['fail']} fail, "
                     f"{counts['n/a']} n/a, {case['numbers'].get('seconds')} s)")
        lines += [f"    FAIL {c['name']}: {c['detail']}" for c in case["checks"] if c["passed"] is False]
        if case["error"]:
            lines.append(f"    ERROR {case['error'].splitlines()[0]}")
    return "\n".join(lines)
