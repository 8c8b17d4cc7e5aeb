"""The ``fcdp`` command as a user meets it: every subcommand refuses bad input with one line naming the
option (exit 2, no traceback), shows its defaults in ``--help`` under its own name, and ``fcdp plan``
labels its units and echoes its assumptions; ``fcdp doctor`` lists every problem it finds."""
from __future__ import annotations

import json
import math
import os

import pytest

import fcdp_lab.__main__ as lab_cli
from fcdp_deepspeed.tools import cli, doctor
from fcdp_deepspeed.tools.plan import planner
from fcdp_deepspeed.tools.plan.compression import compressed_step

PLAN = ["--params", "7B", "--nodes", "4", "--ranks-per-node", "8"]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = (lab_cli.main if argv[0] in cli.LAB_COMMANDS else cli.main)(argv)
    except SystemExit as exc:  # argparse's exit
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, needle", [
    (["plan", *PLAN, "--nodes", "0"], "argument --nodes: expected a whole number >= 1, got '0'"),
    (["plan", *PLAN, "--inter-gbps", "0"], "argument --inter-gbps: expected a number > 0, got '0'"),
    (["plan", *PLAN, "--ranks-per-node", "-1"], "argument --ranks-per-node: expected a whole number >= 1"),
    (["plan", *PLAN, "--trainable-fraction", "2"], "argument --trainable-fraction: expected a fraction in (0, 1]"),
    (["plan", *PLAN, "--config", "/no/such/ds.json"], "argument --config: cannot read /no/such/ds.json"),
    (["plan", *PLAN, "--trainable-fraction", "0.5", "--no-backward-fraction", "0.6"], "no_backward_fraction = 0.6"),
    (["plan", "--params", "lots", "--nodes", "2", "--ranks-per-node", "2"], "argument --params: expected a parameter count"),
    (["plan", *PLAN, "--device-used-gib", "90"], "device_used_bytes"),
    (["demo", "--steps", "1"], "argument --steps: expected a whole number >= 2"),
    (["bench", "--engines", "zero3,zero4"], "argument --engines: expected a comma-separated list of"),
    (["bench", "--rates", "100,fast"], "argument --rates: expected a number >= 0, got 'fast'"),
    (["doctor", "--nodes", "0"], "argument --nodes: expected a whole number >= 1"),
])
def test_bad_input_is_one_line_naming_the_option(argv, needle, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2 and needle in err and "Traceback" not in err + out, err


def test_unknown_command_is_named_with_the_nearest(capsys):
    code, _, err = run(["plna"], capsys)
    assert code == 2 and "unknown command 'plna' (did you mean 'plan'?)" in err and "usage: fcdp" in err
    code, err = cli.main(["bench"]), capsys.readouterr().err
    assert code == 2 and "python -m fcdp_lab bench" in err  # a lab command, named with where it lives
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.startswith("fcdp-deepspeed ")


@pytest.mark.parametrize("command", ["plan", "demo", "bench", "doctor"])
def test_help_names_the_subcommand_and_its_defaults(command, capsys):
    code, out, _ = run([command, "--help"], capsys)
    prog = f"python -m fcdp_lab {command}" if command in cli.LAB_COMMANDS else f"fcdp {command}"
    assert code == 0 and out.startswith(f"usage: {prog} ")
    if command != "doctor":
        assert "(default: " in out
    if command == "plan":
        for default in ("(default: 10.0)", "(default: 1024.0)", "(default: 80.0)", "(default: 1.0)"):
            assert default in out, default


def test_plan_labels_units_and_echoes_assumptions(capsys):
    """7B, 4 x 8, 10 Gbit/s: the cluster total is N x the per-uplink bytes, and the step bound is the per-uplink
    bytes over the uplink speed (the numbers the issue found unlabelled: 162.75 GB next to 32.55 s)."""
    code, out, _ = run(["plan", *PLAN, "--inter-gbps", "10", "--json"], capsys)
    result = json.loads(out)
    z3 = result["engines"]["zero3"]
    assert z3["inter_node_bytes_per_step"] == pytest.approx(162.75e9)
    assert z3["inter_node_bytes_per_uplink_per_step"] == pytest.approx(162.75e9 / 4)
    assert z3["step_time_lower_bound_s"] == pytest.approx(162.75e9 / 4 / (10e9 / 8)) == pytest.approx(32.55)
    assert any("10 Gbit/s per node uplink" in a and "1200 Gbit/s per accelerator inside a node*" in a
               for a in result["assumptions"])
    code, out, _ = run(["plan", *PLAN], capsys)
    assert "'cluster' = summed over all node uplinks" in out and "per uplink" in out and "GiB/node" in out
    assert "assumptions (* = default" in out and "1024 GiB host RAM per node*" in out
    assert " GB" not in out.replace("GiB", "")  # one unit: GiB
    assert "151.57" in out and "37.89" in out  # 162.75e9 B and a quarter of it, in GiB
    assert "compressed (LOSSY)" in out


def test_compressed_model_is_the_codec_wire_size():
    """Per message the codec's wire size (``compress.wire_bytes``); ``off`` is fcdp_node's exact trainable traffic;
    references 1/L of the trainable parameters per rank in the parameter dtype, residuals two fp32 slots of the
    N - 1 rows a rank sends (the own row has none), whatever the precision."""
    n_nodes, L, numel, block = 4, 8, 10_000_000, 128
    w, per_owner = n_nodes * L, math.ceil(10_000_000 / 32)
    exact = compressed_step(n_nodes, L, numel, dtype_bytes=2)
    assert exact["param_stage_bytes"] == exact["grad_stage_bytes"] == (n_nodes - 1) * numel * 2  # (N-1) x t
    int8 = compressed_step(n_nodes, L, numel, 2, "int8", "int8", block)
    assert int8["param_stage_bytes"] == (n_nodes - 1) * w * math.ceil(per_owner / block) * (4 + block)
    int4 = compressed_step(n_nodes, L, numel, 2, "off", "int4", block)
    assert int4["grad_stage_bytes"] == (n_nodes - 1) * w * math.ceil(per_owner / block) * (4 + block // 2)
    assert int4["param_stage_bytes"] == exact["param_stage_bytes"] and int4["reference_bytes_per_rank"] == 0
    # residuals: two fp32 slots (committed, pending) of the N - 1 sent rows of ceil(numel / W), in every precision
    assert int8["reference_bytes_per_rank"] == numel / L * 2
    assert int8["residual_bytes_per_rank"] == 2 * 4 * (n_nodes - 1) * math.ceil(numel / w)
    assert not compressed_step(1, 8, numel, 2, "int8", "int8")["applies"]  # one node: no inter-node stage
    # in the plan: rows on top of fcdp_node, fewer bytes than it, none for one node
    result = planner.plan(planner.ClusterSpec(params=7e9, nodes=4, ranks_per_node=8))
    node = result["engines"]["fcdp_node"]["inter_node_bytes_per_step"]
    rows = {(r["param_compression"], r["grad_compression"]): r for r in result["compressed"]}
    assert len(rows) == 6 and all(r["inter_node_bytes_per_step"] < node for r in rows.values())
    assert rows[("int4", "int4")]["inter_node_bytes_per_step"] < rows[("int8", "int8")]["inter_node_bytes_per_step"]
    assert planner.plan(planner.ClusterSpec(params=7e9, nodes=1, ranks_per_node=8))["compressed"] == []


def test_doctor_lists_every_problem_of_a_block_at_once(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 2, "fcdp": {"enabled": true, "host_budget": 0.5, '
                   '"cache_devcie": "host"}}}')
    checks, plan = doctor.run(str(cfg), 2, 8)
    fails = [c.message for c in checks if c.status == "FAIL" and c.area == "block"]
    assert len(fails) == 4 and plan == {}, fails
    assert "belongs at the top level" in fails[0] and "fcdp.host_budget = 0.5" in fails[1]
    assert "did you mean cache_device" in fails[2] and "got stage 2" in fails[3]
    assert any('"50%"' in c.fix for c in checks)


@pytest.mark.parametrize("zero, fcdp, needles", [
    ('{"stage": 3, "stagee": 1}', '{"enabled": true}', ["FAIL  deepspeed zero_optimization.stagee = 1"]),
    ('{"stage": "three"}', '{"enabled": true}', ["FAIL  deepspeed zero_optimization.stage = 'three'"]),
    ('{"stage": 2}', None, ['adding an "fcdp" block would be refused', "got stage 2", "before adding the block"]),
    ('{"stage": 3}', '{"enabled": true, "grad_reduce": "tree"}', ["FAIL  block    fcdp.grad_reduce = 'tree'"]),
])
def test_doctor_reports_each_config_error_once_as_a_fail_line(tmp_path, capsys, zero, fcdp, needles):
    """DeepSpeed's own refusals are FAIL lines (no traceback); a block error is listed once; a stage-2 config
    without a block is not told that FCDP can run there."""
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_batch_size": 8, "zero_optimization": %s%s}' % (zero, f', "fcdp": {fcdp}' if fcdp else ""))
    code, out, err = run(["doctor", str(cfg)], capsys)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert code == 1 and "Traceback" not in out + err and len(fails) == 1, out
    assert all(n in out for n in needles) and "FCDP can run here" not in out, out


def test_doctor_command_prints_no_traceback_for_a_deepspeed_error(tmp_path):
    """The installed ``fcdp`` script, as a user runs it."""
    import shutil
    import subprocess
    import sys
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": "three"}, "fcdp": {"enabled": true}}')
    exe = shutil.which("fcdp", path=os.path.dirname(sys.executable)) or "fcdp"
    proc = subprocess.run([exe, "doctor", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "FAIL  deepspeed zero_optimization.stage = 'three'" in proc.stdout


def test_doctor_resolves_the_plan_for_a_layout(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4, '
                   '"fcdp": {"enabled": true, "param_compression": "int8"}}')
    checks, plan = doctor.run(str(cfg), 2, 8)
    assert not [c for c in checks if c.area in ("config", "block") and c.status != "ok"], checks
    assert plan["param_gather"] == "hierarchical" and plan["grad_reduce"].startswith("hierarchical")
    assert "LOSSY int8" in plan["compression"] and "per rank" in plan["cache"]
    _, one_node = doctor.run(str(cfg), 1, 8)
    assert one_node["cache"].startswith("none: one node") and one_node["param_gather"] == "flat"


def test_doctor_says_when_the_startup_file_installs_nothing(monkeypatch):
    monkeypatch.setenv("FCDP_AUTOLOAD", "0")
    warn = [c for c in doctor.startup_checks() if c.status != "ok"]
    assert warn and "FCDP_AUTOLOAD=0" in warn[0].message and "fcdp_deepspeed.install()" in warn[0].fix


DILOCO_BLOCK = {"enabled": True, "diloco": {"enabled": True, "sync_every": 10, "compression": "int4"}}


@pytest.mark.parametrize("zero, needles", [
    ({"stage": 3, "stage3_prefetch_bucket_sise": 1000},
     ["FAIL  deepspeed zero_optimization.stage3_prefetch_bucket_sise = 1000: DeepSpeed knows no such key (did you mean "
      "'stage3_prefetch_bucket_size'?)", "fix: rename it to zero_optimization.stage3_prefetch_bucket_size"]),
    ({"stage": "three"}, ["FAIL  deepspeed zero_optimization.stage = 'three'",
                          "fix: set zero_optimization.stage to 3, a JSON number"]),
])
def test_doctor_with_a_layout_turns_deepspeed_errors_into_fail_lines(tmp_path, capsys, zero, needles):
    """``fcdp doctor --config ds.json --nodes 2 --ranks-per-node 2``: a DeepSpeed-side error is a FAIL line naming
    the key and the fix, exit 1, and no plan is resolved from a config DeepSpeed refuses (no traceback)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": zero, "fcdp": {"enabled": True}}))
    code, out, err = run(["doctor", "--config", str(cfg), "--nodes", "2", "--ranks-per-node", "2"], capsys)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert code == 1 and "Traceback" not in out + err and len(fails) == 1, out + err
    assert all(n in out for n in needles) and "plan for" not in out, out


def test_doctor_describes_a_diloco_config_as_the_engine_runs_it(tmp_path, capsys):
    """A DiLoCo block: lossy, no FCDP cache, nothing exchanged across nodes but the pseudo-gradients, in the words
    of the engine's on line (``announce.diloco_words``), not the exact cache path's."""
    from fcdp_deepspeed.config import parse_fcdp_config
    from fcdp_deepspeed.engine.announce import DILOCO_NO_CACHE, diloco_words
    ds = {"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "fcdp": DILOCO_BLOCK}
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds))
    code, out, err = run(["doctor", "--config", str(cfg), "--nodes", "2", "--ranks-per-node", "2"], capsys)
    assert code == 0 and "Traceback" not in out + err, out + err
    assert f"LOSSY DiLoCo across 2 nodes: {diloco_words(parse_fcdp_config(ds).diloco)}" in out, out
    assert DILOCO_NO_CACHE in out and "outer_lr 1.0, outer_momentum 0.0" in out, out
    assert "cache_device" not in out and "exact (param_compression" not in out, out


def test_help_and_plan_import_neither_deepspeed_nor_torch_and_plan_json_is_pure(tmp_path):
    """``fcdp --help``, ``fcdp plan --help``, ``fcdp doctor --help`` and ``fcdp plan --json`` (with a DiLoCo config)
    import neither DeepSpeed nor torch; without DS_ACCELERATOR (no GPU here) stdout is JSON alone; ``fcdp --help``
    names the project's URL (an installed user has no docs/ folder)."""
    import subprocess
    import sys
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "fcdp": DILOCO_BLOCK}))
    probe = ("import sys, contextlib, io\nfrom fcdp_deepspeed.tools import cli\nfor argv in (['--help'], ['plan', "
             "'--help'], ['doctor', '--help']):\n    with contextlib.redirect_stdout(io.StringIO()):\n        try: "
             "cli.main(argv)\n        except SystemExit: pass\nprint(sorted(m for m in ('deepspeed', 'torch') if m in "
             "sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fcdp_deepspeed.tools.cli", "plan", "--params", "7B", "--nodes", "2",
                           "--ranks-per-node", "2", "--config", str(cfg), "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["diloco"]["sync_every"] == 10 and result["compressed"]
    from fcdp_deepspeed.tools.args import project_url
    usage = cli.usage()
    assert "docs/" not in usage and (not project_url() or f"documentation: {project_url()}" in usage)
