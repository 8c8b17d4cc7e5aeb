"""The fcdp block and the DeepSpeed configs FCDP refuses: each error names the key and the fix."""
from __future__ import annotations

import json

import pytest

from fcdp_deepspeed.config import (Budget, FCDPConfigError, check_ds_config_compatible, load_ds_config,
                                   parse_fcdp_config)
from fcdp_lab.harness import toy


def test_absent_or_disabled_block_is_plain():
    assert not parse_fcdp_config({}).enabled
    assert not parse_fcdp_config({"fcdp": {"enabled": False}}).enabled
    assert parse_fcdp_config({"fcdp": {"enabled": True}}).enabled


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config({"fcdp": {"enabled": True, "cache_devcie": "host"}})
    msg = str(err.value)
    assert "fcdp.cache_devcie" in msg and "cache_device" in msg and "Allowed keys" in msg


@pytest.mark.parametrize("block, key", [
    ({"ranks_per_node": "two"}, "ranks_per_node"),
    ({"ranks_per_node": 0}, "ranks_per_node"),
    ({"cache_device": "gpu"}, "cache_device"),
    ({"enabled": "maybe"}, "enabled"),
    ({"host_budget": -1}, "host_budget"),
    ({"host_budget": "lots"}, "host_budget"),
    ({"device_budget": "150%"}, "device_budget"),
    ({"verify": 1.5}, "verify"),
    ({"min_numel": -3}, "min_numel"),
    # [Note: strict] in config.py: a string or a float block skipped int4's power-of-two rule, then failed in the codec
    ({"compression_block": "96", "grad_compression": "int4"}, "compression_block"),
    ({"compression_block": 96.0, "grad_compression": "int4"}, "compression_block"),
    ({"compression_block": "128"}, "compression_block"),
])
def test_bad_values_name_the_key(block, key):
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config({"fcdp": {"enabled": True, **block}})
    assert f"fcdp.{key}" in str(err.value)


@pytest.mark.parametrize("block, keys, fix", [
    # DiLoCo's int4 pseudo-gradients use the gradients' rotated codec (engine/diloco_steps.py): a power-of-two block
    ({"compression_block": 96, "diloco": {"compression": "int4"}}, ["fcdp.compression_block", "fcdp.diloco.compression"],
     "Fix: set compression_block to 64 or 128 (a power of two from 8 to 65536), or fcdp.diloco.compression to "
     "\"int8\" or \"bf16\""),
    ({"compression_block": 10, "diloco": {"sync_every": 4, "compression": "int4"}},
     ["fcdp.compression_block", "fcdp.diloco.compression"], "Fix: set compression_block to 8 or 16"),
    ({"compression_block": 96, "grad_compression": "int4"}, ["fcdp.compression_block", "fcdp.grad_compression"],
     "Fix: set compression_block to 64 or 128."),
    # the fix names blocks the key takes (8 to 65536), not the powers of two next to an out-of-range value
    ({"compression_block": 7, "grad_compression": "int4"}, ["fcdp.compression_block"], "Fix: set compression_block to 8."),
    ({"compression_block": 65538, "diloco": {"compression": "int4"}}, ["fcdp.compression_block"],
     "Fix: set compression_block to 65536 (a power of two"),
])
def test_rotated_int4_refuses_a_block_that_is_not_a_power_of_two_by_key_with_the_fix(block, keys, fix):
    """int4 gradients and int4 DiLoCo pseudo-gradients rotate each block (compress/quant.py, [Note: the rotation]):
    refused at parsing, not by the codec's bare ValueError when the engine is built."""
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config({"fcdp": {"enabled": True, "ranks_per_node": 2, **block}})
    assert all(k in str(err.value) for k in keys) and fix in str(err.value)


@pytest.mark.parametrize("block", [
    {"compression_block": 96, "param_compression": "int4"},  # parameters' int4 does not rotate
    {"compression_block": 96, "param_compression": "int8", "grad_compression": "int8"},
    {"compression_block": 10, "diloco": {"compression": "int8"}},
    {"compression_block": 96, "diloco": {"compression": "bf16"}},
    {"compression_block": 96, "diloco": {"compression": "int4", "enabled": False}},  # DiLoCo off
    {"compression_block": 64, "diloco": {"compression": "int4"}},
])
def test_blocks_every_codec_takes_pass_and_build_their_codec(block):
    from fcdp_deepspeed.compress.quant import codec_for
    cfg = parse_fcdp_config({"fcdp": {"enabled": True, "ranks_per_node": 2, **block}})
    codec_for(cfg.param_compression, cfg.compression_block)
    codec_for(cfg.grad_compression, cfg.compression_block, side="grads")
    if cfg.diloco is not None:  # as engine/diloco_steps.py builds it
        codec_for(cfg.diloco.compression, cfg.compression_block, side="grads")

@pytest.mark.parametrize("block, fix", [
    ({"enabled": "yes"}, "Fix: write true (a JSON boolean, no quotes)"),
    ({"enabled": 1}, "Fix: write true (a JSON boolean, no quotes)"),
    ({"enabled": "false"}, "Fix: write false (a JSON boolean, no quotes)"),
    ({"min_numel": "1000"}, "Fix: write 1000 (a JSON number, no quotes)"),
    ({"ranks_per_node": 2.0}, "Fix: write 2 (a JSON number)"),
    ({"log_interval": True}, "expected a whole number >= 0"),
    ({"miss_batch_bytes": "50%"}, "of bytes or a size such as \"32MiB\""),
])
def test_strict_types_refuse_what_json_would_spell_differently(block, fix):
    """Strict types (FCDPConfig's [Note: strict types]): no coercion of strings, 1 or floats; the fix spells it."""
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config({"fcdp": {"enabled": True, **block}} if "enabled" not in block else {"fcdp": block})
    assert f"fcdp.{next(iter(block))} = {next(iter(block.values()))!r}" in str(err.value) and fix in str(err.value)


def test_byte_counts_take_a_size_string_the_one_documented_exception():
    assert parse_fcdp_config({"fcdp": {"miss_batch_bytes": "32MiB"}}).miss_batch_bytes == 32 * 2**20
    assert parse_fcdp_config({"fcdp": {"miss_batch_bytes": 1000}}).miss_batch_bytes == 1000


def test_block_must_be_an_object():
    with pytest.raises(FCDPConfigError):
        parse_fcdp_config({"fcdp": "yes"})


@pytest.mark.parametrize("value, available, expected", [
    (1000, 10**9, 1000),
    ("20%", 1000, 200),
    ("1KiB", 0, 1024),
    ("2GB", 0, 2 * 10**9),
    ("auto", 1000, 500),
])
def test_budget_resolution(value, available, expected):
    assert Budget.parse("host_budget", value).resolve(available, auto_fraction=0.5) == expected


def test_hjson_file_with_comments(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("""{
      // DeepSpeed reads configs with hjson, so comments are allowed
      "zero_optimization": {"stage": 3},
      "fcdp": {"enabled": true, "ranks_per_node": 2}  # trailing comment
    }""")
    cfg = parse_fcdp_config(str(path))
    assert cfg.enabled and cfg.ranks_per_node == 2
    assert load_ds_config(path)["zero_optimization"]["stage"] == 3


def test_deepspeed_accepts_the_top_level_block():
    from deepspeed.runtime.config import DeepSpeedConfig
    cfg = toy.ds_config({"enabled": True})
    DeepSpeedConfig(json.loads(json.dumps(cfg)))  # no error: DeepSpeed ignores unknown top-level keys


@pytest.mark.parametrize("zero, extra, needle", [
    ({"stage": 2}, {}, "stage 3"),
    ({"stage": 3, "zero_hpz_partition_size": 2}, {}, "zero_hpz_partition_size"),
    ({"stage": 3, "zero_quantized_weights": True}, {}, "zero_quantized_weights"),
    ({"stage": 3, "zero_quantized_nontrainable_weights": True}, {}, "zero_quantized"),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, {}, "nvme"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}, {}, "super_offload"),
    ({"stage": 3}, {"compile": {"deepcompile": True}}, "deepcompile"),
    # the run-ahead on streams copies partitions on its own stream: pageable ones would hold the host (staged.py)
    ({"stage": 3, "offload_param": {"device": "cpu"}}, {"fcdp": {"enabled": True, "param_runahead_streams": True}},
     "offload_param.pin_memory true"),
])
def test_incompatible_deepspeed_configs_are_refused(zero, extra, needle):
    with pytest.raises(FCDPConfigError) as err:
        check_ds_config_compatible({"zero_optimization": zero, **extra})
    assert needle in str(err.value) and "Fix" in str(err.value)


def test_compatible_config_passes():
    check_ds_config_compatible({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})


def test_version_gate(monkeypatch):
    from fcdp_deepspeed.activation.version_gate import ALLOW_UNTESTED_ENV, UnsupportedDeepSpeedVersion, check_deepspeed_version
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    assert check_deepspeed_version("0.19.8") == "0.19.8"
    with pytest.raises(UnsupportedDeepSpeedVersion, match="deepspeed==0.19.8"):
        check_deepspeed_version("0.20.1")
    with pytest.raises(UnsupportedDeepSpeedVersion, match=r"Fix: `pip install deepspeed==0.17.6`"):
        check_deepspeed_version("0.17.9")  # untested (every release 0.16.9-0.19.8 passed): the same minor's newest
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    assert check_deepspeed_version("0.20.1") == "0.20.1"


def test_log_interval_defaults_to_a_readable_steps_per_print_else_10():
    """steps_per_print up to 1000 is followed; 1000000 (the shipped configs' way to silence DeepSpeed) is not."""
    from fcdp_deepspeed.config import DEFAULT_LOG_INTERVAL, FCDPConfig
    plain = FCDPConfig()
    assert DEFAULT_LOG_INTERVAL == 10
    assert [plain.resolved_log_interval(v) for v in (5, 5.0, 1000, None, float("inf"), 1000000, 0, -1, 2.5, True,
                                                     "10")] == [5, 5, 1000, 10, 10, 10, 10, 10, 10, 10, 10]
    assert FCDPConfig(log_interval=3).resolved_log_interval(float("inf")) == 3
    assert FCDPConfig(log_interval=0).resolved_log_interval(7) == 0  # off
    with pytest.raises(FCDPConfigError, match="log_interval"):
        parse_fcdp_config({"fcdp": {"enabled": True, "log_interval": -1}})


def test_hf_log_entries_from_stats():
    from fcdp_deepspeed.integrations.hf import find_stage3, stats_for_logs
    stats = {"inter_node_allgather_bytes": 10, "intra_node_allgather_bytes": 20, "host_cache_bytes": 3,
             "device_cache_bytes": 0, "cache_hits": 3, "cache_misses": 1, "other": 5}
    assert stats_for_logs(stats) == {"fcdp/inter_node_allgather_bytes": 10, "fcdp/intra_node_allgather_bytes": 20,
                                     "fcdp/host_cache_bytes": 3, "fcdp/device_cache_bytes": 0, "fcdp/cache_hit_rate": 0.75,
                                     "fcdp/cache_hits": 3, "fcdp/cache_misses": 1}
    from fcdp_deepspeed.reporting.monitor import monitor_events
    assert {name for name, _, _ in monitor_events(stats, 1)} == set(stats_for_logs(stats))  # one set of names
    assert stats_for_logs({})["fcdp/cache_hit_rate"] == 0.0

    class Z3:
        fcdp_comm = object()

    class Wrapper:  # accelerate's DeepSpeedOptimizerWrapper holds the engine's optimizer as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    z3 = Z3()
    assert find_stage3(None, Wrapper(z3)) is z3 and find_stage3(Wrapper(Wrapper(z3))) is z3
    assert find_stage3(None, Wrapper(object())) is None


@pytest.mark.parametrize("block, expected", [
    # a union-typed key: one line with the fix, not pydantic's "valid integer ... valid string"
    ({"host_budget": 0.5}, 'fcdp.host_budget = 0.5: a number is a count of bytes'),
    ({"cache_devcie": "host"}, "unknown key fcdp.cache_devcie (did you mean cache_device?). Fix: rename it to cache_device."),
    ({"cache_device": "hots"}, "fcdp.cache_device = 'hots': expected one of 'host', 'device', 'auto' (did you mean 'host'?)"),
    ({"grad_reduce": "hier"}, "(did you mean 'hierarchical'?)"),
    ({"verify": "yes"}, "fcdp.verify = 'yes': expected true, false or a sampling rate in (0, 1]"),
    ({"ranks_per_node": "two"}, "fcdp.ranks_per_node = 'two': expected a whole number >= 1. Fix: set"),
    # the run-ahead on streams gathers exact parameters only (runtime/staged.py)
    ({"param_runahead_streams": True, "param_compression": "int8"},
     'fcdp.param_runahead_streams = true with fcdp.param_compression = "int8"'),
])
def test_one_message_per_bad_key_with_the_fix(block, expected):
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config({"fcdp": {"enabled": True, **block}})
    msg = str(err.value)
    assert expected in msg and "Fix:" in msg and "\n" not in msg, msg
    assert "valid integer" not in msg and "valid string" not in msg and len(err.value.problems) == 1
    if "host_budget" in block:
        assert 'did you mean "50%"?' in msg


def test_several_bad_keys_are_listed_one_per_line():
    with pytest.raises(FCDPConfigError) as err:
        parse_fcdp_config({"fcdp": {"host_budget": 0.5, "grad_reduce": "hier", "foo": 1}})
    assert len(err.value.problems) == 3 and str(err.value).count("\n  - fcdp.") + str(err.value).count("\n  - unknown") == 3


@pytest.mark.parametrize("cfg, needle", [
    ({"zero_optimization": {"stage": 3, "fcdp": {"enabled": True}}}, "belongs at the top level"),
    ({"zero_optimization": {"stage": 3}, "FCDP": {"enabled": True}}, "top-level key 'FCDP' is not \"fcdp\""),
    ({"zero_optimization": {"stage": 2}, "fcpd": {"enabled": True}}, "Fix: rename it to \"fcdp\""),
])
def test_misplaced_or_misspelled_block_is_refused_where_deepspeed_parses_configs(cfg, needle, tmp_path):
    """Through the classes deepspeed.initialize and zero.Init(config_dict_or_path=...) parse configs with
    (installed by the startup hook): FCDP's message instead of DeepSpeed's pydantic error or silence."""
    import deepspeed

    import fcdp_deepspeed
    fcdp_deepspeed.install()
    with pytest.raises(FCDPConfigError, match="Fix") as err:
        deepspeed.DeepSpeedConfig(cfg)
    assert needle in str(err.value)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(FCDPConfigError, match="Fix"):
        deepspeed.zero.Init(config_dict_or_path=str(path))


def test_an_uncaught_config_error_is_one_line_per_rank(monkeypatch, capsys):
    """What each rank prints when the block is refused (fcdp_deepspeed/activation/excepthook.py): one line naming the key
    and the fix, no traceback; FCDP_TRACEBACK=1 (the broken variant, as before) hands it to the previous hook."""
    import os
    import subprocess
    import sys

    from fcdp_deepspeed.activation import excepthook
    code = ("import deepspeed, fcdp_deepspeed; fcdp_deepspeed.install(); "
            "from fcdp_deepspeed.config import parse_fcdp_config; parse_fcdp_config({'fcdp': {'enabled': 'yes'}})")
    short = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RANK="3", DS_ACCELERATOR="cpu"),
                           capture_output=True, text=True, timeout=600)
    lines = [ln for ln in short.stderr.splitlines() if not ln.startswith("[20")]  # DeepSpeed's own log lines
    assert short.returncode == 1 and "Traceback" not in short.stderr, short.stderr[-3000:]
    assert lines[0].startswith("[rank 3] FCDPConfigError: invalid \"fcdp\" config block: fcdp.enabled = 'yes'") and \
        "Fix: write true" in lines[0] and len(lines) == 2, lines
    seen = []
    monkeypatch.setattr(excepthook, "_PREVIOUS", [lambda *exc: seen.append(exc[0])])
    monkeypatch.setenv("FCDP_TRACEBACK", "1")
    excepthook._hook(FCDPConfigError, FCDPConfigError("x"), None)
    monkeypatch.setenv("FCDP_TRACEBACK", "0")
    excepthook._hook(KeyError, KeyError("other errors keep their traceback"), None)
    assert seen == [FCDPConfigError, KeyError] and capsys.readouterr().err == ""


def test_diloco_outer_defaults_are_plain_averaging():
    """``fcdp.diloco`` without outer settings: outer_lr 1, momentum 0 (plain averaging, the measured best at H = 10,
    docs/diloco.md); Nesterov stays DiLoCo's choice for a momentum the user sets."""
    block = parse_fcdp_config({"fcdp": {"enabled": True, "diloco": {"sync_every": 10}}}).diloco
    assert (block.outer_lr, block.outer_momentum, block.nesterov) == (1.0, 0.0, True)
