"""Shared test helpers: run a worker function on N gloo ranks.

Workers live next to what they test: ``tests/test_<concern>.py`` runs functions of
``tests/workers/<concern>.py`` (shared helpers in ``workers/common.py``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# [Note: one JIT build dir per venv] DeepSpeed JIT-builds its CPU comm op under TORCH_EXTENSIONS_DIR; the
# shared default (~/.cache/torch_extensions) is rebuilt by every venv whose paths differ, and a killed build
# leaves a lock that makes every later rank wait forever at init_distributed. scripts/test.sh sets it; a
# plain `pytest` gets the same per-venv directory.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# [Note: why the suite declares its link] (fcdp_lab/link_declaration.py): loopback "nodes" get FCDP's paths.
os.environ.setdefault("FCDP_LAB_LINK", "slow")

TESTS_DIR = str(Path(__file__).parent)

# [Note: the fast tier] CI (``bash scripts/test.sh``) runs every test: its hard limit is 90 minutes and the whole
# suite stays within 50 minutes on 2 cores. For local iteration, ``bash scripts/test.sh --fast`` (or
# ``FCDP_TESTS=fast``) runs only the allow-list below, a few minutes on 2 cores, crossing every layer once: the
# config and the commands (pure), one 2 nodes x 2 parity run of each path (the parameter cache, the gradient path,
# gradient compression, DiLoCo) and the refusals through ``deepspeed.initialize``. Every other test is deselected
# (``-ra`` shows the count). Node-id prefixes -> the layer each crosses. A module fixture that runs several
# scenarios still runs all of them (one launch): pick tests whose fixtures are one cheap launch.
FAST_TIER = {
    # config, the fcdp command, the planner and the lines FCDP prints (pure, seconds)
    "tests/test_config.py": "config",
    "tests/test_cli.py": "the fcdp command",
    "tests/test_reporting.py": "the on line and the [fcdp] line",
    "tests/test_planner.py::test_ring_arithmetic": "planner",
    "tests/test_planner.py::test_gradient_modes_and_the_bound": "planner",
    "tests/test_planner.py::test_plan_": "planner",
    "tests/test_planner.py::test_planner_reads_config": "planner",
    "tests/test_planner.py::test_the_planners_wire_bytes_are_the_codecs": "planner",
    "tests/test_planner.py::test_residual_bytes_are_two_fp32_slots_of_the_sent_rows": "planner",
    "tests/test_grad_plan.py::test_defaults_are_auto": "gradient plan",
    "tests/test_grad_plan.py::test_auto_": "gradient plan",
    "tests/test_grad_plan.py::test_explicit_": "gradient plan",
    "tests/test_compress_codec.py::test_roundtrip_error_is_half_a_step_per_block": "codec",
    "tests/test_compress_codec.py::test_identity_codec_is_exact_and_wire_bytes_model": "codec",
    "tests/test_architecture.py::test_no_import_runs_up_or_across_a_floor": "architecture",
    "tests/test_architecture.py::test_the_core_never_imports_tooling": "architecture",
    # one 2 x 2 parity run per path
    "tests/test_parity.py::test_edge_parameters[0-fp32]": "the parameter cache, bit-identical to ZeRO-3",
    "tests/test_grads.py::test_bf16_partitions_within_zero3_bf16_error_2x2": "the hierarchical gradient path",
    "tests/test_compress_grads.py::test_identity_codec_is_bit_identical_to_the_exact_path": "gradient compression",
    "tests/test_compress_grads.py::test_inter_node_gradient_bytes_drop_by_the_wire_ratio": "gradient compression",
    "tests/test_compress_grads.py::test_error_feedback_tracks_the_exact_sum_over_steps": "gradient compression",
    "tests/test_diloco.py::test_every_rank_holds_the_same_model_after_each_sync_and_only_then[fp32]": "DiLoCo",
    "tests/test_diloco.py::test_outer_step_matches_a_float64_reference": "DiLoCo",
    "tests/test_diloco.py::test_stats_and_the_on_line": "DiLoCo",
    "tests/test_layered.py::test_the_backward_passes": "layered accumulation: the installed torch's order",
    "tests/test_layered.py::test_layered_gives_zero3_accumulations_losses_and_weights_within_its_float64_error[large]":
        "layered accumulation through deepspeed.initialize",
    # the refusals, through deepspeed.initialize and the parsers
    "tests/test_activation.py::test_enabled_block_with_zero_stage_below_3_is_refused_at_initialize": "refusals",
    "tests/test_grads.py::test_gradient_mode_refusals_through_deepspeed_initialize": "refusals",
    "tests/test_diloco.py::test_bad_values_are_refused_by_key_with_the_fix": "refusals",
    "tests/test_diloco.py::test_incompatible_settings_are_refused": "refusals",
    "tests/test_diloco.py::test_one_node_is_refused_with_the_fix": "refusals",
}


def fast_tier() -> bool:
    """Whether this run is the fast tier (``FCDP_TESTS=fast``, ``scripts/test.sh --fast``); any other value runs
    everything (``FCDP_TESTS=full`` too, as ``scripts/check_deepspeed_release.sh`` sets it)."""
    value = os.environ.get("FCDP_TESTS", "full").strip().lower()
    if value not in ("fast", "full", ""):
        raise pytest.UsageError(f"FCDP_TESTS={value!r}: use 'fast' (the allow-list) or 'full' (everything, the default)")
    return value == "fast"


def in_fast_tier(nodeid: str) -> bool:
    """Whether ``nodeid`` is on the fast tier's allow-list."""
    return any(nodeid.startswith(prefix) for prefix in FAST_TIER)


def runs_in_this_tier(nodeid: str) -> bool:
    """Whether ``nodeid`` runs in this run (a fixture builds only the scenarios its running tests read)."""
    return not fast_tier() or in_fast_tier(nodeid)


def pytest_collection_modifyitems(config, items) -> None:
    if not fast_tier():
        return
    kept = [item for item in items if in_fast_tier(item.nodeid)]
    dropped = [item for item in items if not in_fast_tier(item.nodeid)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def worker_target(worker: str) -> str:
    """``"<concern>:<function>"`` -> the ``module:function`` a rank imports (``tests/`` on its path)."""
    return f"workers.{worker}"


def run_ranks(worker: str, world_size: int = 4, timeout: float = 240, env=None, **kwargs):
    """Run ``tests/workers/<concern>.py:<function>(**kwargs)`` on ``world_size`` ranks, given as
    ``"<concern>:<function>"``, with ``env`` added to their environment (e.g. ``FCDP_LAB_BREAK``, the broken variants
    of ``fcdp_lab/sabotage``); return per-rank results."""
    from fcdp_lab.harness.launch import run_local
    return run_local(worker_target(worker), world_size, kwargs, timeout=timeout, env=env, pythonpath=[TESTS_DIR])


@pytest.fixture
def ranks():
    return run_ranks


@pytest.fixture(scope="session")
def dists(tmp_path_factory):
    """The sdist and the wheel built from it (``python -m build``, PEP 517 with build isolation, as pip and a
    release do), once per session: ``{"sdist": Path, "wheel": Path, "seconds": float}``."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(root)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"python -m build failed (pip install build?):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return {"sdist": next(out.glob("fcdp_deepspeed-*.tar.gz")), "wheel": next(out.glob("fcdp_deepspeed-*.whl")),
            "seconds": round(time.monotonic() - t0, 1)}
