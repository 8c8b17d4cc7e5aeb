"""Every file in configs/ and examples/ is loaded the way its documentation says it is used, unmodified.

A config given to ``TrainingArguments(deepspeed=path)`` or accelerate's ``DeepSpeedPlugin(hf_ds_config=path)``
is read with ``json.load`` (a ``//`` comment there is a JSONDecodeError), one given to ``deepspeed.initialize``
or ``--deepspeed_config`` with hjson. The table below says which file is used how (docs/integrations.md,
"Shipped configs and examples"); a new file without a row fails. Examples are launched by the tests the
table names; here they only have to compile and name configs that exist.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: file -> how its documentation says it is used: "hf" (TrainingArguments(deepspeed=path)),
#: "accelerate" (DeepSpeedPlugin(hf_ds_config=path)), "deepspeed" (deepspeed.initialize(config=path) /
#: --deepspeed_config), or for examples the tests that launch them.
USES = {
    "configs/hf_lora_fcdp.json": ("hf", "accelerate"),  # docs/integrations.md; examples/hf_lora.py (both runners)
    "configs/hf_full_fcdp.json": ("hf",),  # examples/hf_gpt2_trainer.py --deepspeed_config -> TrainingArguments
    "configs/toy_fcdp.json": ("deepspeed",),  # examples/train_toy.py --deepspeed_config -> deepspeed.initialize
    "configs/zero3_fcdp.json": ("deepspeed",),  # a plain ZeRO-3 config plus the block
    "examples/train_toy.py": ("tests/test_autoload_install.py", "tests/test_integrations.py"),
    "examples/hf_gpt2_trainer.py": ("tests/test_integrations.py",),
    "examples/train_elastic.py": ("tests/test_elastic.py",),  # docs/reliability.md: a resumable script, killed
    "examples/hf_lora.py": ("tests/workers/hf.py",),  # what tests/test_hf.py runs on every rank
}


def shipped() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for d in ("configs", "examples") for p in (ROOT / d).iterdir() if p.is_file())


def test_every_shipped_file_has_a_documented_use():
    assert shipped() == sorted(USES), "add the new file to USES (and to docs/integrations.md) or remove it"
    doc = (ROOT / "docs" / "integrations.md").read_text()
    assert all(f"`{name}`" in doc for name in USES), [n for n in USES if f"`{n}`" not in doc]


@pytest.mark.parametrize("name", [n for n in USES if n.startswith("configs/")])
def test_config_is_strict_json_with_an_enabled_block(name):
    """Strict JSON loads wherever a config goes (json.load for HF and accelerate, hjson for DeepSpeed)."""
    from fcdp_deepspeed.config import check_block_placement, parse_fcdp_config
    with open(ROOT / name) as f:
        cfg = json.load(f)  # what HF and accelerate do
    check_block_placement(cfg)
    assert parse_fcdp_config(str(ROOT / name)).enabled  # read with hjson, as DeepSpeed reads it


def test_configs_load_through_hf_accelerate_and_deepspeed(tmp_path):
    """One fresh interpreter: each config through the entry its documentation names, as given (a path)."""
    code = f"""
import json, sys
uses = json.loads(sys.argv[1]); out = {{}}
for name, kinds in uses.items():
    path = {str(ROOT)!r} + "/" + name
    for kind in kinds:
        if kind == "hf":
            from transformers import TrainingArguments
            args = TrainingArguments(output_dir={str(tmp_path)!r}, deepspeed=path, use_cpu=True, report_to=[])
            block = args.hf_deepspeed_config.config.get("fcdp")
        elif kind == "accelerate":
            from accelerate.utils import DeepSpeedPlugin
            block = DeepSpeedPlugin(hf_ds_config=path).hf_ds_config.config.get("fcdp")
        else:  # the class deepspeed.initialize parses --deepspeed_config / config= with (FCDP's checks included)
            import deepspeed
            block = deepspeed.DeepSpeedConfig(path)._param_dict.get("fcdp")
        out[name + " " + kind] = block
print("RESULT " + json.dumps(out))
"""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    configs = {n: k for n, k in USES.items() if n.startswith("configs/")}
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(configs)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert set(result) == {f"{n} {k}" for n, kinds in configs.items() for k in kinds}
    assert all(block and block["enabled"] is True for block in result.values()), result


@pytest.mark.parametrize("name", [n for n in USES if n.startswith("examples/")])
def test_example_compiles_names_existing_configs_and_is_launched(name):
    text = (ROOT / name).read_text()
    compile(text, name, "exec")
    for config in re.findall(r"configs/[\w.]+\.json", text):
        assert (ROOT / config).exists(), (name, config)
    for test in USES[name]:  # the launch that runs it lives there
        assert Path(name).name in (ROOT / test).read_text(), (name, test)
