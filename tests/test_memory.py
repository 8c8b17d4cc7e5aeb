"""Memory limits and costs (``fcdp_deepspeed.storage.memory``): cgroup v1/v2 and SLURM limits read from real
files in temporary directories, pinned rounding, margins, the ``auto`` headroom, and the pool and
budget accounting built on them."""
from __future__ import annotations

from pathlib import Path

import pytest

from fcdp_deepspeed.storage import memory
from fcdp_deepspeed.storage.memory import GiB

MiB = 2**20


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def v2_tree(tmp_path: Path, leaf_max: str, leaf_current: int, parent_max: str = "max", parent_current: int = 0):
    """A cgroup v2 mount with the process in /job/step (parent /job), and its /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory")
    write(root / "job" / "memory.max", parent_max)
    write(root / "job" / "memory.current", str(parent_current))
    write(root / "job" / "step" / "memory.max", leaf_max)
    write(root / "job" / "step" / "memory.current", str(leaf_current))
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/job/step")
    return root, proc


def test_cgroup_v2_limit_minus_usage_is_named(tmp_path):
    root, proc = v2_tree(tmp_path, str(16 * GiB), 4 * GiB)
    limit = memory.host_limit(100 * GiB, cgroup_root=root, proc_cgroup=proc, environ={}, used_bytes=0)
    assert limit.bytes == 12 * GiB
    assert limit.source.startswith("cgroup v2") and "job/step/memory.max" in limit.source
    assert "12 GiB" in limit.describe()


def test_cgroup_v2_tightest_ancestor_counts(tmp_path):
    root, proc = v2_tree(tmp_path, "max", 1 * GiB, parent_max=str(8 * GiB), parent_current=6 * GiB)
    limit = memory.host_limit(100 * GiB, cgroup_root=root, proc_cgroup=proc, environ={}, used_bytes=0)
    assert limit.bytes == 2 * GiB and "/job/memory.max" in limit.source


def test_cgroup_v2_unlimited_leaves_psutil(tmp_path):
    root, proc = v2_tree(tmp_path, "max", 1 * GiB)
    limit = memory.host_limit(5 * GiB, cgroup_root=root, proc_cgroup=proc, environ={}, used_bytes=0)
    assert (limit.bytes, limit.source) == (5 * GiB, "psutil available")


def test_cgroup_v1_limit_and_hidden_path(tmp_path):
    """v1: memory.limit_in_bytes - usage; a container mount where the listed path does not exist is
    the process's own cgroup; the v1 'unlimited' value is no limit."""
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", str(10 * GiB))
    write(root / "memory" / "memory.usage_in_bytes", str(3 * GiB))
    proc = tmp_path / "proc_cgroup"
    write(proc, "4:memory:/process_api/abc\n0::/")
    limit = memory.host_limit(100 * GiB, cgroup_root=root, proc_cgroup=proc, environ={}, used_bytes=0)
    assert limit.bytes == 7 * GiB and limit.source.startswith("cgroup v1")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")
    limit = memory.host_limit(100 * GiB, cgroup_root=root, proc_cgroup=proc, environ={}, used_bytes=0)
    assert limit.source == "psutil available"


def test_slurm_limits(tmp_path):
    none = tmp_path / "missing"
    env = {"SLURM_MEM_PER_NODE": "4096"}
    limit = memory.host_limit(100 * GiB, cgroup_root=none, proc_cgroup=none, environ=env, used_bytes=1 * GiB)
    assert limit.bytes == 3 * GiB and limit.source == "SLURM_MEM_PER_NODE=4096M"
    env = {"SLURM_MEM_PER_CPU": "1024", "SLURM_CPUS_ON_NODE": "8"}
    limit = memory.host_limit(100 * GiB, cgroup_root=none, proc_cgroup=none, environ=env, used_bytes=0)
    assert limit.bytes == 8 * GiB and "SLURM_MEM_PER_CPU" in limit.source
    assert memory.slurm_limit({"SLURM_MEM_PER_NODE": "0"}, 0) is None  # 0 = the whole node


def test_tightest_of_all_sources_wins(tmp_path):
    root, proc = v2_tree(tmp_path, str(16 * GiB), 4 * GiB)
    limit = memory.host_limit(100 * GiB, cgroup_root=root, proc_cgroup=proc,
                              environ={"SLURM_MEM_PER_NODE": str(2 * 1024)}, used_bytes=0)
    assert limit.bytes == 2 * GiB and limit.source.startswith("SLURM")
    assert [c[1] for c in limit.candidates] == sorted(c[1] for c in limit.candidates)


@pytest.mark.parametrize("nbytes, cost", [(0, 0), (1, 1), (3, 4), (4, 4), (5, 8), (257 * MiB, 512 * MiB),
                                          (256 * MiB, 256 * MiB)])
def test_pinned_cost_rounds_to_a_power_of_two(nbytes, cost):
    assert memory.pinned_cost(nbytes) == cost
    assert memory.pinned_cost(nbytes, pinned=False) == nbytes


def test_pinned_capacity_is_the_largest_request_that_fits():
    for budget in (1, 5, 8, 1000, 3 * GiB):
        cap = memory.pinned_capacity(budget)
        assert memory.pinned_cost(cap) <= budget < memory.pinned_cost(cap + 1)
    assert memory.pinned_capacity(1000, pinned=False) == 1000


def test_margins():
    assert memory.host_margin(4 * GiB) == GiB and memory.host_margin(100 * GiB) == 10 * GiB
    assert memory.usable_host(memory.MemoryLimit(512 * MiB, "x")) == 0
    assert memory.device_margin(16 * GiB) == 2 * GiB and memory.device_margin(141 * GiB) == 141 * GiB // 10


def test_auto_headroom_counts_reserved_memory_and_the_margin():
    # an 80 GiB accelerator whose steps reserved 60 GiB: 80 - 60 - 8 (10%) = 12 GiB
    assert memory.auto_device_headroom(80 * GiB, 60 * GiB) == 12 * GiB
    assert memory.auto_device_headroom(16 * GiB, 15 * GiB) == 0  # inside the 2 GiB margin: nothing
    assert memory.auto_device_headroom(16 * GiB, 20 * GiB) == 0


def test_host_budget_is_capped_by_the_limit():
    from fcdp_deepspeed.config import Budget
    from fcdp_deepspeed.runtime.allocation import host_budget_per_node
    limit = memory.MemoryLimit(20 * GiB, "cgroup v2 test")  # usable: 18 GiB
    assert host_budget_per_node(Budget.parse("host_budget", "50%"), limit) == (9 * GiB, False)
    assert host_budget_per_node(Budget.parse("host_budget", 64 * GiB), limit) == (18 * GiB, True)
    assert host_budget_per_node(Budget.parse("host_budget", 4 * GiB), limit) == (4 * GiB, False)


def test_pool_cost_counts_chunking_and_pinned_rounding():
    from fcdp_deepspeed.runtime.allocation import fit_prefix
    from fcdp_deepspeed.storage.cache import chunk_groups, chunks_cost
    assert chunk_groups([3, 3, 3, 9], 8) == [[0, 1], [2], [3]]
    sizes = [24, 24, 24]  # chunks of at most 64 bytes: 48 (pinned: 64) + 24 (pinned: 32)
    assert chunks_cost(sizes, 64, pinned=True) == 96 and chunks_cost(sizes, 64, pinned=False) == 72
    cost = lambda prefix: chunks_cost(prefix, 64, pinned=True)  # noqa: E731
    assert [fit_prefix(cost, sizes, b) for b in (31, 32, 63, 64, 95, 96)] == [0, 1, 1, 2, 2, 3]
    # a budget that counted slot bytes only (72) would let the pool take 96 pinned bytes
    assert fit_prefix(cost, sizes, 72) == 2


def test_a_large_slot_shares_its_rounded_chunk():
    """A slot over the chunk size gets a chunk of its own, rounded up to a power of two when pinned; the slots
    after it fill that rounding instead of opening chunks of their own (broken variant: the old grouping)."""
    from fcdp_deepspeed.storage.cache import chunk_groups, chunks_cost
    assert chunk_groups([9, 3, 3, 3], 8, pinned=True) == [[0, 1, 2], [3]]  # 9 -> a 16-byte chunk holds 15
    assert chunks_cost([9, 3, 3, 3], 8, pinned=True) == 16 + 4
    assert chunk_groups([9, 3, 3, 3], 8, pinned=False) == [[0], [1, 2], [3]]  # pageable: no rounding to fill
    old = sum(memory.pinned_cost(sum([9, 3, 3, 3][i] for i in g)) for g in ([0], [1, 2], [3]))
    assert old == 16 + 8 + 4 > chunks_cost([9, 3, 3, 3], 8, pinned=True)


def test_measured_headroom_counts_memory_outside_the_allocator():
    """[Note: device budgets come from a measured step]: an 80 GiB GPU whose step reserved 60 GiB at its peak and
    holds 50 GiB now, with 25 GiB free: 5 GiB are outside the allocator (NCCL, the context): 80 - 60 - 8 - 5."""
    assert memory.measured_device_headroom(80 * GiB, 60 * GiB, 50 * GiB, 25 * GiB) == 7 * GiB
    assert memory.measured_device_headroom(80 * GiB, 60 * GiB, 50 * GiB, 30 * GiB) == 12 * GiB  # nothing outside
    assert memory.measured_device_headroom(80 * GiB, 60 * GiB, 50 * GiB, 10 * GiB) == 0


def test_slurm_headroom_subtracts_every_rank_of_the_node():
    """SLURM reports no usage: the headroom subtracts the resident memory of all ranks on this node."""
    rss = [3 * GiB, 2 * GiB, 5 * GiB, 1 * GiB]
    used = memory.node_resident_bytes(rss, ["node0", "node0", "node1", "node1"], "node0")
    assert used == 5 * GiB
    limit = memory.slurm_limit({"SLURM_MEM_PER_NODE": str(16 * 1024)}, used)
    assert limit == ("SLURM_MEM_PER_NODE=16384M", 11 * GiB)


def test_node_buffer_chunks_hold_what_the_host_budget_allows():
    """[Note: buffer chunks] One flat pinned gradient buffer costs its power-of-two rounding, so it could hold only
    the largest power of two under the budget (1 GiB of 1.5 here); power-of-two chunks hold the whole budget."""
    from fcdp_deepspeed.grads.buffer import CHUNK_BYTES, fit_prefix_cost
    MiB = 2**20
    sizes = [64 * MiB] * 24  # 1.5 GiB of slots
    budget = 3 * GiB // 2
    assert memory.pinned_capacity(budget) // (64 * MiB) == 16  # what the single rounded buffer held
    assert fit_prefix_cost(sizes, budget, rounds=True) == 24
    assert memory.chunks_cost(sizes, CHUNK_BYTES, pinned=True) == budget
    # a chunk's rounding is counted: 3 slots of 100 MiB take a 256 MiB chunk and a 128 MiB one
    assert fit_prefix_cost([100 * MiB] * 3, 383 * MiB, rounds=True) == 2
    assert fit_prefix_cost([100 * MiB] * 3, 384 * MiB, rounds=True) == 3
    assert fit_prefix_cost([100 * MiB] * 3, 300 * MiB, rounds=False) == 3


# -- the node gradient buffer's placement (grads/buffer.py) ---------------------------------------------------------
KiB = 2**10


def _planner(monkeypatch, budget, device_mode: bool, slots: int, slot_bytes: int, chunk_bytes: int):
    """A node-buffer planner of ``slots`` parameters of ``slot_bytes`` each (1 node peer, 1 rank per node, so a slot
    is a parameter's whole gradient), chunks of ``chunk_bytes``, no process group (agreement is the identity)."""
    from types import SimpleNamespace

    import torch

    from fcdp_deepspeed.config import parse_fcdp_config
    from fcdp_deepspeed.grads import buffer as gbuf
    monkeypatch.setattr(gbuf, "CHUNK_BYTES", chunk_bytes)
    config = parse_fcdp_config({"fcdp": {"enabled": True, "grad_buffer_budget": budget,
                                         "grad_buffer_device": "device" if device_mode else "host"}})
    layout = SimpleNamespace(nodes=1, dp_size=1, per_node=1)
    planner = gbuf.BufferPlanner(config, layout, None, torch.float32, gbuf.NodeGradBuffer())
    monkeypatch.setattr(planner, "agree_min", lambda value: value)
    params = [SimpleNamespace(ds_id=i, ds_numel=slot_bytes // 4) for i in range(slots)]
    return planner, params


def test_a_pinned_host_buffer_holds_its_whole_budget(monkeypatch):
    """[Note: buffer chunks], through the planner's allocation (pinned for real: an accelerator that pins, faked):
    a 96 KiB budget holds all 24 slots of 4 KiB in power-of-two chunks, where one rounded flat buffer held 16."""
    import torch

    from fcdp_deepspeed.machine import device
    requested = []
    monkeypatch.setattr(device, "pins_host_memory", lambda: True)
    monkeypatch.setattr(device, "pin_empty", lambda numel, dtype: requested.append(numel * dtype.itemsize) or
                        torch.empty(numel, dtype=dtype))
    planner, params = _planner(monkeypatch, 96 * KiB, False, slots=24, slot_bytes=4 * KiB, chunk_bytes=16 * KiB)
    assert memory.pinned_capacity(96 * KiB) // (4 * KiB) == 16  # what the single rounded flat buffer held
    planner.plan(params)
    assert len(planner.buffer.offsets) == 24 and planner.unbuffered_bytes == 0
    assert requested == [16 * KiB] * 6 and planner.buffer.nbytes == sum(requested) == 96 * KiB
    assert planner.buffer.placed_bytes("host") == 96 * KiB and planner.buffer.placed_bytes("device") == 0


def test_a_device_buffer_starts_on_the_host_and_takes_only_what_the_measured_step_left(monkeypatch):
    """[Note: the device buffer comes from a measured step] in grads/buffer.py: ``grad_buffer_device: device`` takes no
    accelerator memory at build (it took 25% of free memory, before any step existed: batch size ZeRO-3 could have
    used); at the measured step it moves the chunks that fit 25% of the headroom that step left, before the cache takes
    the rest of it, and the sums it accumulates are the same in both places."""
    import torch

    from fcdp_deepspeed.config import parse_fcdp_config
    from fcdp_deepspeed.runtime import promotion
    free_at_build = 3 * GiB  # the old build-time rule took 25% of it: 768 MiB
    fake = type("Accel", (), {"total_memory": lambda s: 4 * GiB, "max_memory_reserved": lambda s: 2 * GiB - 64 * KiB,
                              "memory_reserved": lambda s: GiB, "available_memory": lambda s: free_at_build})()
    monkeypatch.setattr(promotion, "get_accelerator", lambda: fake)
    planner, params = _planner(monkeypatch, "25%", True, slots=8, slot_bytes=4 * KiB, chunk_bytes=4 * KiB)
    planner.plan(params)
    buf = planner.buffer
    assert buf.placed_bytes("device") == 0 and buf.placed_bytes("host") == 32 * KiB  # build: host only
    cache_config = parse_fcdp_config({"fcdp": {"enabled": True, "cache_device": "device"}})
    steps = promotion.Promotion(cache_config, type("Cache", (), {"entries": {}, "pools": {}})(),
                                claims=[planner.promote], reapers=[buf.reap])
    headroom = memory.measured_device_headroom(4 * GiB, 2 * GiB - 64 * KiB, GiB, free_at_build)
    assert headroom == 64 * KiB  # 4 GiB - a 2 GiB peak (+64 KiB) - the 2 GiB margin, nothing outside the allocator
    steps.on_step_end()
    assert buf.placed_bytes("device") == 0  # step 1 is not measured (no prefetch trace yet)
    steps.on_step_end()
    assert planner.device_budget == 16 * KiB and buf.placed_bytes("device") == 16 * KiB  # 25% of 64 KiB: 4 chunks
    assert buf.placements == ["device"] * 4 + ["host"] * 4 and buf.placed_bytes("host") == 16 * KiB and not buf.retired
    assert steps.headroom == 48 * KiB  # what the cache may still take
    cols = {p.ds_id: torch.full((1, 1024), float(p.ds_id)) for p in params}
    buf.accumulate(list(cols.items()))
    buf.accumulate(list(cols.items()))
    assert all(torch.equal(buf.take(i, (1, 1024)), 2 * c) for i, c in cols.items())  # both placements add alike
    planner2, params2 = _planner(monkeypatch, 64 * GiB, True, slots=8, slot_bytes=4 * KiB, chunk_bytes=4 * KiB)
    planner2.plan(params2)
    assert planner2.promote(64 * KiB) == 32 * KiB and planner2.device_budget == 64 * KiB  # a size: capped by headroom
