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

TESTS_DIR = str(Path(__file__).parent)

# [Note: the fast tier] CI (``bash scripts/test.sh``) runs every test: its hard limit is 90 minutes and the whole
# suite stays within 50 minutes on 2 cores. For local iteration, ``bash scripts/test.sh --fast`` (or
# ``FCDP_TESTS=fast``) skips the tests below: each repeats at a larger layout, under a second launcher or through a
# second front end what a fast-tier test already checks on 2 nodes x 2 (docs/testing.md, "Tiers"); each is reported
# as skipped with the fast-tier test that covers it. Node-id prefixes -> what the fast tier runs instead.
FAST_TIER_SKIPS = {
    "tests/test_grads.py::test_partitions_within_zero3_error_2x4": "the 2x2 float64-reference bound",
    "tests/test_gather.py::test_four_nodes_x_two_and_megatron_tp2": "the 2x2 two-stage gather and test_topology",
    "tests/test_gather.py::test_bit_identical_to_flat_2x4": "test_bit_identical_to_flat_2x2",
    "tests/test_gather.py::test_inter_node_bytes_per_miss_are_the_bound[8-4]": "the [4-2] case",
    "tests/test_planner.py::test_planner_within_10_percent_of_emulated_cluster": "the committed emulator runs",
    "tests/test_integrations.py::test_grad_modes_under_deepspeed_launcher":
        "test_grads' gradient modes and test_autoload_install's deepspeed launcher",
    "tests/test_integrations.py::test_run_module_without_block_is_plain_zero3": "test_autoload_install (block off)",
    "tests/test_integrations.py::test_run_module_under_deepspeed_launcher": "test_autoload_install (deepspeed launcher)",
    "tests/test_integrations.py::test_plain_hf_script_logs_fcdp_counters_under_both_launchers":
        "test_hf's Trainer counters and the startup-hook tests",
    "tests/test_hf.py::test_full_finetune_matches_zero3_with_half_the_inter_node_traffic[accelerate]": "[trainer]",
    "tests/test_hf.py::test_peft_lora_matches_zero3_with_99pct_less_inter_node_traffic[accelerate]": "[trainer]",
    "tests/test_hf.py::test_trainer_with_node_gradient_accumulation_matches_zero3": "test_grads' node accumulation",
    "tests/test_hf.py::test_full_finetune_matches_zero3_with_half_the_inter_node_traffic[trainer]":
        "test_peft_lora_matches_zero3_with_99pct_less_inter_node_traffic[trainer] and test_grads' full fine-tuning",
    "tests/test_integrations.py::test_run_module_under_torchrun_matches_plain":
        "test_autoload_install's unmodified script under torchrun (wheel and editable)",
    "tests/test_topology.py::test_megatron_layout_tp2_on_2_nodes_x_4": "the Megatron TP layout on 2x2",
    "tests/test_checkpoints.py::test_rank_killed_mid_step_leaves_a_loadable_checkpoint": "test_elastic's node kill",
    "tests/test_parity.py::test_edge_parameters[100-fp32]": "the [0-fp32] and [0-bf16] cases",
    "tests/test_netns.py::test_deepspeed_launcher_on_two_namespace_nodes":
        "test_elastic's torchrun agents on the namespace nodes and test_autoload_install's deepspeed launcher",
    "tests/test_grads.py::test_losses_and_weights_match_zero3_within_1e5[node_ga8]": "[node_ga4]",
    "tests/test_grads.py::test_losses_and_weights_match_zero3_within_1e5[lora_ckpt_node_ga4]":
        "[lora_node_ga4] and [ckpt_node_ga4]",
    "tests/test_grads.py::test_losses_and_weights_match_zero3_within_1e5[reentrant_node_ga4]": "[ckpt_node_ga4]",
    "tests/test_grads.py::test_losses_and_weights_match_zero3_within_1e5[offload_both_node_ga2]":
        "[offload_node_ga2] and test_offload",
    "tests/test_forkserver.py::test_ranks_see_their_environment_at_import_and_at_run[spawned]": "[forked]",
    "tests/test_autoload_install.py::test_unmodified_script_under_launcher[editable-":
        "[wheel-torchrun] and [wheel-deepspeed] (the same script and launchers) and "
        "test_startup_hook_is_installed_and_cheap[editable] (the editable install's startup hook)",
    "tests/test_grads.py::test_bf16_bound_fails_for_a_broken_plan":
        "test_broken_plans_fail_the_bound[wrong_peers-hier] (the same broken plan against the fp32 bound)",
    "tests/test_placement.py::test_allocation_failure_everywhere_runs_plain_zero3":
        "test_allocation_failure_on_one_rank_degrades_those_parameters_everywhere",
    "tests/test_parity.py::test_plain_zero3_crashes_on_a_zero_size_parameter":
        "test_zero_size_parameters_work_with_fcdp (what FCDP does with them; this one only documents DeepSpeed)",
    "tests/test_release_smoke.py": "the whole suite on 0.19.8",
}


def fast_tier() -> bool:
    """Whether this run is the fast tier (``FCDP_TESTS=fast``, ``scripts/test.sh --fast``); any other value runs
    everything (``FCDP_TESTS=full`` too, as ``scripts/check_deepspeed_release.sh`` sets it)."""
    value = os.environ.get("FCDP_TESTS", "full").strip().lower()
    if value not in ("fast", "full", ""):
        raise pytest.UsageError(f"FCDP_TESTS={value!r}: use 'fast' (skip the repeats) or 'full' (everything, the default)")
    return value == "fast"


def _fast_tier_cover(nodeid: str) -> str | None:
    """What the fast tier runs instead of ``nodeid`` (``None``: a fast-tier test)."""
    return next((why for prefix, why in FAST_TIER_SKIPS.items() if nodeid.startswith(prefix)), None)


def runs_in_this_tier(nodeid: str) -> bool:
    """Whether ``nodeid`` runs in this run (a fixture builds only the scenarios its running tests read)."""
    return not fast_tier() or _fast_tier_cover(nodeid) is None


def pytest_collection_modifyitems(config, items) -> None:
    if not fast_tier():
        return
    for item in items:
        reason = _fast_tier_cover(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not in the fast tier (FCDP_TESTS=fast); it covers this by {reason}"))


def worker_target(worker: str) -> str:
    """``"<concern>:<function>"`` -> the ``module:function`` a rank imports (``tests/`` on its path)."""
    return f"workers.{worker}"


def run_ranks(worker: str, world_size: int = 4, timeout: float = 240, **kwargs):
    """Run ``tests/workers/<concern>.py:<function>(**kwargs)`` on ``world_size`` ranks, given as
    ``"<concern>:<function>"``; return per-rank results."""
    from fcdp_lab.harness.launch import run_local
    return run_local(worker_target(worker), world_size, kwargs, timeout=timeout, pythonpath=[TESTS_DIR])


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
