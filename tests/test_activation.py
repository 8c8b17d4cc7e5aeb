"""Nothing silently ignored: an enabled ``fcdp`` block that cannot take effect fails or warns, in real
runs through ``deepspeed.initialize`` (HF Trainer: tests/test_hf.py), with FCDP installed by the
startup hook alone. The fresh-venv installs of that hook: tests/test_autoload_install.py."""
from __future__ import annotations

import re

import pytest

from conftest import run_ranks
from fcdp_deepspeed.activation.version_gate import TESTED_DEEPSPEED_VERSIONS


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
                                           ("budget", "fcdp.host_budget"), ("min_numel", "fcdp.min_numel")])
def test_cache_holding_nothing_warns_once_naming_the_setting(case, setting):
    res = run_ranks("activation:nothing_cached", 4, case=case)
    on = [w for w in res[0]["warnings"] if w.startswith("fcdp: ON for this engine")]
    warnings = [w for w in res[0]["warnings"] if w not in on]
    assert len(warnings) == 1, warnings
    assert "the cache holds no parameter" in warnings[0] and setting in warnings[0], warnings[0]
    assert len(on) == 1 and re.search(r"; 0 of \d+ parameters cached", on[0]), on  # the engine's one line says so too
    assert "the cache holds no parameter" in on[0] and "plain ZeRO-3" not in on[0], on
    if case == "min_numel":  # nothing cached, yet the gradients take FCDP's hierarchical path
        assert "grad_reduce hierarchical" in on[0] and "(gradients reduced in two stages" in on[0], on[0]
    for r in res:
        assert r["optimizer"] == "FCDPStage3" and r["stats"]["cached_params"] == 0 and r["stats"]["cache_hits"] == 0
        assert not r["warnings"] or r is res[0]


UNTESTED_RELEASE = r'''
import json, sys, types, warnings
import deepspeed
from fcdp_deepspeed.activation import autoload

calls = []
deepspeed.initialize = lambda *args, **kwargs: calls.append(kwargs) or "engine"   # stands for DeepSpeed's
deepspeed.__version__ = "0.99.0"                                                    # a release FCDP never saw
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    autoload.on_deepspeed_imported(deepspeed)
out = {"warnings": [str(w.message) for w in caught], "core_imported": "fcdp_deepspeed.activation.api" in sys.modules}
with open(sys.argv[1], "w") as f:
    json.dump({"fcdp": {"enabled": True}}, f)
errors = {}
for name, kwargs in (("dict", {"config": {"fcdp": {"enabled": True}}}), ("path", {"config": sys.argv[1]}),
                     ("args", {"args": types.SimpleNamespace(deepspeed_config=sys.argv[1])}),
                     ("config_params", {"config_params": {"fcdp": True}})):
    try:
        deepspeed.initialize(model=None, **kwargs)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
out["errors"] = errors
out["plain"] = [deepspeed.initialize(model=None, config=c) for c in ({}, {"fcdp": {"enabled": False}})]
out["calls"] = len(calls)

# a tested release whose install() fails: the same warning-and-refusal, never a failed `import deepspeed`
deepspeed.initialize = lambda *args, **kwargs: "engine"
deepspeed.__version__ = "0.19.8"
from fcdp_deepspeed.activation import api
def install():
    raise OSError("no space left on device")
api.install = install
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    autoload.on_deepspeed_imported(deepspeed)
out["failed_install_warnings"] = [str(w.message) for w in caught]
try:
    deepspeed.initialize(model=None, config={"fcdp": {"enabled": True}})
except Exception as exc:
    out["failed_install_error"] = f"{type(exc).__name__}: {exc}"
out["failed_install_plain"] = deepspeed.initialize(model=None, config={})
print("RESULT", json.dumps(out))
'''


def test_untested_deepspeed_release_warns_and_refuses_only_an_enabled_block(tmp_path):
    """The startup hook on a DeepSpeed release FCDP was not tested with: one warning, nothing installed
    (the core is not even imported), jobs without an enabled block untouched, and an enabled block
    refused at deepspeed.initialize (dict, path, args.deepspeed_config, config_params) with the fix.
    Then the same for an install() that raises."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, FCDP_AUTOLOAD="0")  # the hook is called by hand below, on a patched deepspeed
    env.pop("FCDP_ALLOW_UNTESTED_DEEPSPEED", None)
    proc = subprocess.run([sys.executable, "-c", UNTESTED_RELEASE, str(tmp_path / "ds.json")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(out["warnings"]) == 1 and "deepspeed==0.99.0" in out["warnings"][0], out["warnings"]
    assert "FCDP_AUTOLOAD=0" in out["warnings"][0] and not out["core_imported"]
    assert set(out["errors"]) == {"dict", "path", "args", "config_params"}, out["errors"]
    for error in out["errors"].values():
        assert error.startswith("UnsupportedDeepSpeedVersion: this DeepSpeed config enables \"fcdp\" but FCDP is "
                                "not active: fcdp-deepspeed was tested with deepspeed=="
                                + ", ".join(TESTED_DEEPSPEED_VERSIONS)), error
        assert "pip install deepspeed==0.19.8" in error and '"fcdp": {"enabled": false}' in error
    assert out["plain"] == ["engine", "engine"] and out["calls"] == 2
    # a failing install(): warned, and the same refusal naming what failed
    assert len(out["failed_install_warnings"]) == 1
    assert "installing FCDP failed: OSError: no space left on device" in out["failed_install_warnings"][0]
    assert "installing FCDP failed: OSError" in out["failed_install_error"] and out["failed_install_plain"] == "engine"


ENTRY_ORDER = r"""
import sys
{first}
api = sys.modules.get("fcdp_deepspeed.activation.api")
print("INSTALLED", bool(api and api.is_installed()))
"""


@pytest.mark.parametrize("first", ["import deepspeed", "import fcdp_deepspeed.engine.stage3",
                                   "from fcdp_deepspeed.config import parse_fcdp_config",
                                   "import fcdp_deepspeed; fcdp_deepspeed.get_stats"])
def test_startup_hook_installs_whichever_module_imports_deepspeed_first(first):
    """The package's own modules import DeepSpeed too: the startup hook must then install once the
    last of them has finished importing (installing inside their import would import half-run modules)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "FCDP_AUTOLOAD"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", ENTRY_ORDER.format(first=first)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "INSTALLED True" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_a_first_cpu_run_says_deepspeed_builds_its_comm_op(tmp_path):
    """``import deepspeed`` (FCDP installed by the startup hook) on the CPU accelerator, the shm comm op not built in
    TORCH_EXTENSIONS_DIR: one line on rank 0 says why the first init_distributed is quiet for minutes; none once the
    op is built (this venv's, scripts/test.sh builds it), none on other ranks."""
    import os
    import subprocess
    import sys
    from fcdp_deepspeed.activation import shm_hint

    def stderr(ext_dir: str, **env: str) -> str:
        full = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ext_dir, **env}
        full.pop("RANK", None) if "RANK" not in env else None
        proc = subprocess.run([sys.executable, "-c", "import deepspeed, fcdp_deepspeed; assert fcdp_deepspeed.is_installed()"],
                              capture_output=True, text=True, timeout=300, env=full)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    first = stderr(str(tmp_path))
    assert first.count("fcdp: DeepSpeed builds its CPU communication op (deepspeed_shm_comm) once") == 1, first
    assert "build_shm_op()" in first and not os.listdir(tmp_path)  # nothing built or created by the check
    assert "fcdp: DeepSpeed builds" not in stderr(str(tmp_path), RANK="1")
    built = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if not os.path.exists(os.path.join(built, shm_hint.OP_NAME, f"{shm_hint.OP_NAME}.so")):
        pytest.skip(f"the shm op is not built in {built} (scripts/test.sh builds it)")
    assert "fcdp: DeepSpeed builds" not in stderr(built)
