"""Nothing silently ignored: an enabled ``fcdp`` block that cannot take effect fails or warns, in real
runs through ``deepspeed.initialize`` (HF Trainer: tests/test_hf.py), with FCDP installed by the
startup hook alone. The fresh-venv installs of that hook: tests/test_autoload_install.py."""
from __future__ import annotations

import pytest

from conftest import run_ranks


def test_enabled_block_with_zero_stage_below_3_is_refused_at_initialize():
    for r in run_ranks("activation:low_stage_refused", 2):
        assert r["installed"], "the startup hook did not install FCDP (reinstall: pip install -e .)"
        for entry, stages in (("initialize", (0, 1, 2)), ("pipeline", (0, 1))):
            for stage in stages:
                error = r[entry][stage]
                assert error is not None, (entry, stage)
                assert error.startswith("FCDPConfigError: fcdp requires ZeRO stage 3"), error
                assert f"got stage {stage}" in error and '"fcdp": {"enabled": false}' in error, error


@pytest.mark.parametrize("case, setting", [("persistent", "zero_optimization.stage3_param_persistence_threshold"),
                                           ("budget", "fcdp.host_budget")])
def test_cache_holding_nothing_warns_once_naming_the_setting(case, setting):
    res = run_ranks("activation:nothing_cached", 4, case=case)
    warnings = res[0]["warnings"]
    assert len(warnings) == 1, warnings
    assert "the cache holds no parameter" in warnings[0] and setting in warnings[0], warnings[0]
    for r in res:
        assert r["optimizer"] == "FCDPStage3" and r["stats"]["cached_params"] == 0 and r["stats"]["cache_hits"] == 0
        assert not r["warnings"] or r is res[0]
