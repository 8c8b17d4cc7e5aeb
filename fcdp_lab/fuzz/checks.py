"""What is compared after every event (rank side; collective: every rank runs it with the same engines).

- **observations**: what the event produced per engine (this rank's losses, outputs, gathered values)
  against the reference engine (plain ZeRO-3), bit for bit (``exact``) or within ``RTOL`` (``close``);
- **state**: each parameter's partition on this rank (``ds_tensor``), the optimizer's fp32 partitions
  and every full parameter, gathered from the partitions with one raw all-gather that bypasses any
  cache (so checking never fills or reads a cache slot);
- **cache coherence**: every FILLED entry of an FCDP engine holds exactly this rank's slice of its
  parameter's current value, its padding is zero, and DeepSpeed gathers from a secondary only for
  FILLED entries (no engine, plain or FCDP, may have a secondary FCDP does not own). This catches a
  missed invalidation at the event that missed it, before any forward reads the stale slice;
- **rank lockstep**: outputs of the same input are identical on every rank (every engine kind; the
  server compares the digests of :func:`digests` across ranks).

[Note: why not a probe forward after every event by default] A forward refills every stale entry, so
the next event would always start from a full cache and never run the miss paths (two-stage gather,
batched refill) itself. Sequences draw ``probe``: with it, a probe forward follows every event too.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from deepspeed import comm as dist

from fcdp_deepspeed.storage import freshness
from fcdp_deepspeed.storage.cache import EntryState
from fcdp_lab.fuzz import engines as eng
from fcdp_lab.fuzz.events import Obs, Sequence, eval_


def full_params(built: list[eng.Built]) -> list[dict[str, torch.Tensor]]:
    """Every engine's parameters, full and flat, from their partitions: one all-gather per dtype for all
    engines together (every engine partitions over the same data-parallel group), no cache involved."""
    items: dict[torch.dtype, list] = {}
    for i, b in enumerate(built):
        for name, p in sorted(b.engine.module.named_parameters()):
            items.setdefault(p.ds_tensor.dtype, []).append((i, name, p))
    out: list[dict[str, torch.Tensor]] = [{} for _ in built]
    for dtype, group_items in items.items():
        group = group_items[0][2].ds_process_group
        world = dist.get_world_size(group=group)
        local = torch.cat([p.ds_tensor.detach().reshape(-1) for _, _, p in group_items])
        gathered = torch.empty(world * local.numel(), dtype=dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local, group=group)
        rows = gathered.view(world, -1)
        offset = 0
        for i, name, p in group_items:
            n = p.ds_tensor.numel()
            out[i][name] = rows[:, offset:offset + n].reshape(-1)[:p.ds_numel].clone()
            offset += n
    return out


def _same_float(a: float, b: float, compare: str, rtol: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b if compare == "exact" else abs(a - b) <= rtol * abs(a)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


class Report:
    """This rank's failures for one event."""

    def __init__(self, event: str) -> None:
        self.event = event
        self.failures: list[str] = []

    def fail(self, engine: str, what: str) -> None:
        self.failures.append(f"[rank {dist.get_rank()}] {engine}: {what}")

    def same(self, engine: str, what: str, ref: Any, got: Any, compare: str, rtol: float) -> None:
        """``got`` against the reference's ``ref`` (tensors or lists of floats)."""
        if isinstance(ref, torch.Tensor):
            if ref.shape != got.shape:
                return self.fail(engine, f"{what}: shape {tuple(got.shape)} vs ZeRO-3's {tuple(ref.shape)}")
            # NaN where ZeRO-3 has NaN is ZeRO-3's value (DeepSpeed 0.19.8 with both offloads writes NaN into a
            # parameter frozen after a skipped step, FCDP or not): the same positions, the rest compared as usual
            nan = ref.isnan() if ref.is_floating_point() else None
            if nan is not None and bool(nan.any()):
                if not torch.equal(nan, got.isnan()):
                    return self.fail(engine, f"{what}: NaN at other positions than ZeRO-3's")
                ref, got = ref.masked_fill(nan, 0), got.masked_fill(nan, 0)
            ok = torch.equal(ref, got) if compare == "exact" else \
                (ref.float() - got.float()).norm().item() <= rtol * max(ref.float().norm().item(), 1e-12)
            if not ok:
                self.fail(engine, f"{what} differs from ZeRO-3 (max abs diff {_diff(ref, got):.3g}, {compare})")
        else:  # losses: lists of floats, a non-finite one (a bad batch) equal to the same non-finite value
            ok = len(ref) == len(got) and all(_same_float(a, b, compare, rtol) for a, b in zip(ref, got))
            if not ok:
                self.fail(engine, f"{what} {got} vs ZeRO-3's {ref} ({compare})")


def compare_observations(report: Report, seq: Sequence, obs: dict[str, Obs]) -> None:
    ref = obs.get("zero3", {})
    for b in seq.built:
        compare = b.kind.compare_in(seq.optimizer)
        if compare not in ("exact", "close") or b.kind.name not in obs:
            continue
        for key, got in obs[b.kind.name].items():
            if key in ref:
                report.same(b.kind.name, key, ref[key], got, compare, eng.RTOL[seq.dtype])


def compare_state(report: Report, seq: Sequence) -> dict[str, dict[str, torch.Tensor]]:
    """Partitions, fp32 partitions and full parameters against ZeRO-3; returns every engine's full values."""
    full = {b.kind.name: values for b, values in zip(seq.built, full_params(seq.built))}
    ref = next((b for b in seq.built if b.kind.compare == "reference"), None)
    if ref is None:
        return full
    ref_parts = dict(ref.engine.module.named_parameters())
    rtol = eng.RTOL[seq.dtype]
    for b in seq.built:
        compare = b.kind.compare_in(seq.optimizer)
        if compare not in ("exact", "close"):
            continue
        name = b.kind.name
        for pname, p in b.engine.module.named_parameters():
            if pname not in ref_parts:
                report.fail(name, f"parameter {pname} has no ZeRO-3 counterpart")
                continue
            report.same(name, f"partition of {pname}", ref_parts[pname].ds_tensor, p.ds_tensor, compare, rtol)
            report.same(name, f"full {pname}", full[ref.kind.name][pname], full[name][pname], compare, rtol)
        ref_fp32 = ref.engine.optimizer.fp32_partitioned_groups_flat
        got_fp32 = b.engine.optimizer.fp32_partitioned_groups_flat
        if len(ref_fp32) != len(got_fp32):
            report.fail(name, f"{len(got_fp32)} fp32 partition groups vs ZeRO-3's {len(ref_fp32)}")
        for i, (r, g) in enumerate(zip(ref_fp32, got_fp32)):
            report.same(name, f"fp32 partition group {i}", r.detach(), g.detach(), compare, rtol)
    return full


def check_coherence(report: Report, b: eng.Built, full: dict[str, torch.Tensor]) -> None:
    """Every FILLED slot is this rank's slice of the current value; only FILLED entries are gathered from."""
    entries, runtimes = {}, {}  # every engine over the model: a later one shares the first one's slots
    for engine in [*b.others, b.engine]:
        rt = getattr(engine.optimizer, "fcdp", None)
        if rt is not None and rt.cache is not None:
            entries.update({e.param.ds_id: e for e in rt.cache.entries.values()})
            runtimes.update({e.param.ds_id: rt for e in rt.cache.entries.values()})
    for pname, p in b.engine.module.named_parameters():
        entry = entries.get(p.ds_id)
        secondary = p.ds_secondary_tensor
        if entry is None or entry.state is not EntryState.FILLED:
            if secondary is not None:
                state = "no cache entry" if entry is None else entry.state.value
                report.fail(b.kind.name, f"{pname} ({state}) has a secondary tensor: DeepSpeed would gather it "
                                         f"from memory FCDP does not keep current")
            continue
        if secondary is not entry.slot:
            report.fail(b.kind.name, f"{pname} is FILLED but DeepSpeed's secondary is not its slot")
        if not freshness.is_current(p, entry.taken):
            continue  # older than its partition: the next read drops it ([Note: freshness by construction])
        compression = runtimes[p.ds_id].compression
        if compression is not None and compression.lossy(p):
            continue  # filled from the compressed reconstruction: every rank's, not ZeRO-3's (lockstep compares it)
        n = entry.valid_numel
        want = full[pname][entry.start:entry.start + n]
        have = entry.slot[:n]
        if not (torch.equal(have.isnan(), want.isnan()) and torch.equal(have.nan_to_num(), want.nan_to_num())):
            report.fail(b.kind.name, f"STALE cache entry {pname}: the slot differs from the current value "
                                     f"(max abs diff {_diff(entry.slot[:n], want):.3g})")
        if n < entry.slot_numel and bool(entry.slot[n:].ne(0).any()):
            report.fail(b.kind.name, f"cache entry {pname}: padding past the parameter is not zero")


def digests(obs: dict[str, Obs]) -> dict[str, str]:
    """Digests of the outputs of inputs that are the same on every rank (the server compares them across
    ranks: ``server.lockstep_failures``)."""
    return {f"{name}.{key}": hashlib.sha1(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, o in sorted(obs.items()) for key, v in sorted(o.items())
            if key != "losses" and isinstance(v, torch.Tensor)}


def check(seq: Sequence, event: str, obs: dict[str, Obs], probe: bool) -> tuple[list[str], dict[str, str]]:
    """Everything above after one event; returns this rank's failures and its output digests."""
    report = Report(event)
    if probe:
        for name, o in eval_(seq).items():
            obs.setdefault(name, {})["probe"] = o["outputs"]
    compare_observations(report, seq, obs)
    full = compare_state(report, seq)
    for b in seq.built:
        check_coherence(report, b, full[b.kind.name])
    return report.failures, digests(obs)
