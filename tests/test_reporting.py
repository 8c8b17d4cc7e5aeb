"""What FCDP tells a user without being asked: the WARNING line of an FCDP engine (``announce.py``) and the
``[fcdp]`` line at INFO (``stats.format_stats_line``), on made-up engine state (pure, no ranks). The real
engines' lines are checked where they run: the WARNING line in ``tests/test_autoload_install.py``'s launches,
the ``[fcdp]`` line under the HF Trainer in ``tests/test_hf.py``."""
from __future__ import annotations

from types import SimpleNamespace

from fcdp_deepspeed.config import FCDPConfig
from fcdp_deepspeed.engine.announce import compression_words, engine_line
from fcdp_deepspeed.reporting.stats import format_stats_line
from fcdp_deepspeed.storage.cache import EntryState, Placement


def stats(step: int, scale: int, valid: int = 0) -> dict:
    return {"optimizer_steps": step, "inter_node_allgather_bytes": 1024 * scale, "inter_node_grad_reduce_bytes": 2048 * scale,
            "intra_node_allgather_bytes": 4096 * scale, "intra_node_grad_reduce_bytes": 0, "cache_hits": 10 * scale,
            "cache_misses": 10 * scale, "host_slot_bytes": 5 * 2**20, "device_slot_bytes": 0,
            "host_cache_bytes": valid, "device_cache_bytes": 0}


def test_stats_line_reports_the_interval_per_step_not_running_totals():
    first = format_stats_line(stats(10, 10))  # steps 1-10, running totals 10x one step's
    assert first.startswith("[fcdp] step 10: per optimizer step over steps 1-10: inter-node all-gather 1.0 KiB")
    again = format_stats_line(stats(20, 30), previous=stats(10, 10))  # steps 11-20 moved 20 steps' worth
    assert "over steps 11-20: inter-node all-gather 2.0 KiB, grad reduce 4.0 KiB" in again
    assert "cache hit rate 50.0% (20 hits, 20 misses per step)" in again
    # full fine-tuning after a step: nothing valid, the slots still held (the "cache host 0 B")
    assert "cache slots 5.0 MiB per rank (host 5.0 MiB, device 0 B), valid now 0 B" in again
    assert "n/a (no lookups)" in format_stats_line(stats(11, 0), previous=stats(10, 0))


def _runtime(config: FCDPConfig, nodes: int = 2, ranks: int = 2) -> SimpleNamespace:
    param = SimpleNamespace(ds_numel=1000)
    entries = {i: SimpleNamespace(state=EntryState.FILLED if i < 3 else EntryState.DISABLED, placement=Placement.HOST,
                                  nbytes=2**20, param=param) for i in range(4)}
    return SimpleNamespace(config=config, cache=SimpleNamespace(entries=entries), param_gather="hierarchical",
                           allocation=SimpleNamespace(host_budget=3 * 2**30, device_budget=0), log_interval=10,
                           topology=SimpleNamespace(num_nodes=nodes, ranks_per_node=ranks, source="fcdp.ranks_per_node"))


def test_engine_line_names_layout_cache_gather_gradients_and_compression():
    plan = SimpleNamespace(grad_reduce="hierarchical", grad_accumulation="node")
    line = engine_line(_runtime(FCDPConfig(enabled=True)), plan)
    assert line.startswith("fcdp: ON for this engine: 2 nodes x 2 ranks per node (from fcdp.ranks_per_node)")
    assert "cache_device auto, host budget 6.0 GiB per node (fcdp.host_budget '50%')" in line
    assert "3 of 4 parameters cached, slots per rank: 3.0 MiB host;" in line
    assert "param_gather hierarchical; grad_reduce hierarchical, grad_accumulation node" in line
    assert "exact (param_compression and grad_compression off)" in line
    assert "no optimizer, no gradients" in engine_line(_runtime(FCDPConfig(enabled=True)), None)
    assert "no cache (one node" in engine_line(_runtime(FCDPConfig(enabled=True), nodes=1, ranks=4), plan)
    lossy = compression_words(FCDPConfig(param_compression="int8", grad_compression="int4"))
    assert lossy == "LOSSY int8/int4: param_compression int8, grad_compression int4, block 128"
    assert compression_words(FCDPConfig(grad_compression="int8")).startswith("LOSSY int8: ")
    one = engine_line(_runtime(FCDPConfig(enabled=True), nodes=1, ranks=1), plan)
    assert one.startswith("fcdp: ON for this engine: 1 node x 1 rank per node"), one


def test_engine_line_counts_the_parameters_that_never_entered_the_cache():
    """Persistent parameters get no cache entry: the line says so instead of "0 of 0 parameters cached"."""
    runtime = _runtime(FCDPConfig(enabled=True))
    runtime.cache.entries.clear()
    runtime.attachment = SimpleNamespace(uncached={"persistent (stage3_param_persistence_threshold)": 8})
    line = engine_line(runtime, None)
    assert "0 of 8 parameters cached (not cached: 8 persistent (stage3_param_persistence_threshold))" in line, line


def test_one_set_of_names_for_the_monitor_and_hf_logs():
    from fcdp_deepspeed.integrations.hf import stats_for_logs
    from fcdp_deepspeed.reporting.monitor import REPORTED_KEYS, monitor_events
    s = stats(3, 1)
    names = [name for name, _, _ in monitor_events(s, 3)]
    assert names == [f"fcdp/{k}" for k in REPORTED_KEYS] and set(names) == set(stats_for_logs(s))
    assert dict(stats_for_logs(s))["fcdp/host_slot_bytes"] == 5 * 2**20


def test_a_zero_hit_rate_names_the_deepspeed_settings_that_caused_it():
    """Every lookup a miss (DeepSpeed kept the parameters gathered from forward to backward): the line says why and
    names stage3_max_reuse_distance / stage3_prefetch_bucket_size; any hit, or no lookup, says nothing more."""
    none_served = {**stats(10, 10), "cache_hits": 0}
    line = format_stats_line(none_served)
    assert "cache hit rate 0.0% (the cache served nothing" in line
    assert "stage3_max_reuse_distance" in line and "stage3_prefetch_bucket_size" in line
    assert "stage3_max_reuse_distance" not in format_stats_line(stats(10, 10))
    assert "stage3_max_reuse_distance" not in format_stats_line(stats(11, 0), previous=stats(10, 0))


def test_engine_line_with_nothing_cached_says_the_gradients_still_take_fcdps_path():
    """Every parameter below fcdp.min_numel: the cache holds nothing, but the gradient modes still run; the line
    must not read as plain ZeRO-3."""
    runtime = _runtime(FCDPConfig(enabled=True, min_numel=10**9))
    for e in runtime.cache.entries.values():
        e.state = EntryState.DISABLED
    line = engine_line(runtime, SimpleNamespace(grad_reduce="hierarchical", grad_accumulation="node"))
    assert "the cache holds no parameter" in line and "plain ZeRO-3" not in line
    assert "grad_reduce hierarchical, grad_accumulation node (gradients reduced in two stages" in line
    assert "accumulated in the node buffer" in line
    flat = engine_line(runtime, SimpleNamespace(grad_reduce="flat", grad_accumulation="rank"))
    assert "grad_reduce flat, grad_accumulation rank (DeepSpeed's gradient path)" in flat
