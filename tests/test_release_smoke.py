"""The DeepSpeed release smoke subset (scripts/check_deepspeed_release.sh runs this file on each
supported release; the main suite runs it on the shared venv's release). One 2 nodes x 2 process
group: FCDP vs plain ZeRO-3 bit-identical for full fine-tuning and LoRA with the inter-node gather
bytes counted, the gradient modes within 1e-5, config refusals, and the startup hook."""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks
from fcdp_deepspeed.activation.version_gate import TESTED_DEEPSPEED_VERSIONS
from fcdp_deepspeed.config import ds_compat

pytestmark = pytest.mark.release
RTOL = 1e-5


@pytest.fixture(scope="module")
def smoke():
    return run_ranks("release_smoke:smoke", 4, timeout=600)


def step_deltas(run, key: str) -> list[int]:
    s = run.step_stats
    return [s[0][key]] + [b[key] - a[key] for a, b in zip(s, s[1:])]


def test_release_is_listed(smoke):
    """scripts/check_all_releases.py deselects this one: it runs releases before the gate admits them."""
    assert smoke[0]["deepspeed"].split("+")[0] in TESTED_DEEPSPEED_VERSIONS


def test_release_internals_are_present():
    assert ds_compat.missing_internals() == []


def test_startup_hook_builds_fcdp_from_the_config_key_alone(smoke):
    for r in smoke:
        assert r["hook"] == {"installed": True, "optimizer": "FCDPStage3"}, r["hook"]


@pytest.mark.parametrize("name", ["full", "lora"])
def test_cache_bit_identical_and_inter_node_gathers_cut(smoke, name):
    for r in smoke:
        plain, fcdp = r["cache"][name]["plain"], r["cache"][name]["fcdp"]
        assert fcdp.extra["optimizer_class"] == "FCDPStage3"
        assert fcdp.losses == plain.losses, (plain.losses, fcdp.losses)
        assert fcdp.stats["cache_hits"] > 0 and fcdp.stats["uncached_params"] == 0
        p, f = (step_deltas(run, "inter_node_allgather_bytes") for run in (plain, fcdp))
        bound = 0.55 if name == "full" else 0.05  # LoRA: only the adapters cross nodes after step 1
        assert all(0 < fb <= bound * pb for pb, fb in zip(p[1:], f[1:])), (p, f)
        assert fcdp.stats["param_gather"] == "hierarchical"
        if name == "lora":  # the stale adapters are refilled together at the first miss of each later step
            assert fcdp.stats["batched_refills"] == len(p) - 1, fcdp.stats["batched_refills"]
    plain_w, fcdp_w = smoke[0]["cache"][name]["plain"].weights, smoke[0]["cache"][name]["fcdp"].weights
    assert plain_w and all(torch.equal(plain_w[k], fcdp_w[k]) for k in plain_w)


@pytest.mark.parametrize("name", ["hier_ga2", "node_ga4", "lora_node_ga2"])
def test_gradient_modes_within_1e5(smoke, name):
    for r in smoke:
        plain, fcdp = r["grads"][name]["plain"], r["grads"][name]["fcdp"]
        assert fcdp.extra["optimizer_class"] == "FCDPStage3" and fcdp.stats["grad_delivered"] > 0
        assert len(fcdp.losses) == len(plain.losses) > 0
        for a, b in zip(plain.losses, fcdp.losses):
            assert abs(a - b) <= RTOL * abs(a), (plain.losses, fcdp.losses)
        for key, w in plain.weights.items():
            assert (fcdp.weights[key] - w).norm().item() <= RTOL * max(w.norm().item(), 1e-12), key
    node = smoke[0]["grads"]["node_ga4"]
    # node accumulation: each step's gradients cross nodes once (ZeRO-3: 4 full reductions per step)
    assert node["fcdp"].stats["grad_accumulated"] > 0
    p, f = (step_deltas(node[mode], "inter_node_grad_reduce_bytes") for mode in ("plain", "fcdp"))
    assert all(0 < fb <= 0.1 * pb for pb, fb in zip(p, f)), (p, f)


def test_config_refusals(smoke):
    tree, no_reduce_scatter = (row["error"] for row in smoke[0]["refusals"])
    assert tree.startswith("FCDPConfigError") and "fcdp.grad_reduce = 'tree'" in tree, tree
    assert no_reduce_scatter.startswith("FCDPConfigError") and "reduce_scatter = false" in no_reduce_scatter, \
        no_reduce_scatter


class _Boundary:
    """The two shapes of DeepSpeed's boundary flag: a method (0.19) or a plain attribute (0.16-0.18)."""

    def __init__(self, as_method: bool, value: bool) -> None:
        self.value = value
        if not as_method:
            self.is_gradient_accumulation_boundary = value

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.value


@pytest.mark.parametrize("as_method", [True, False], ids=["method", "attribute"])
def test_boundary_is_read_at_call_time(as_method):
    opt = _Boundary(as_method, True)
    read = ds_compat.boundary_reader(opt)
    assert read() is True
    if as_method:
        opt.value = False
    else:
        opt.is_gradient_accumulation_boundary = False  # what the 0.16-0.18 engine does before a backward
    assert read() is False and ds_compat.is_boundary(opt) is False


def test_param_names_from_the_optimizer_or_the_module():
    module = torch.nn.Linear(2, 2)
    names = {p: n for n, p in module.named_parameters()}
    assert ds_compat.param_names(object(), module) == names  # 0.16-0.17: no optimizer.param_names
    opt = type("Opt", (), {"param_names": {module.weight: "given"}})()
    assert ds_compat.param_names(opt, module) == {module.weight: "given"}


def test_ci_checks_the_newest_patch_of_each_minor_and_the_oldest_release():
    """CI's compatibility stage (.ci/run) runs the newest admitted patch of each minor plus the oldest admitted
    release, less the main suite's (constraints.txt); every one of them is admitted by the gate."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    stage = re.search(r"^versions=\(([0-9. ]+)\)$", (root / ".ci" / "run").read_text(), re.M).group(1).split()
    main = re.search(r"^deepspeed==([0-9.]+)$", (root / "constraints.txt").read_text(), re.M).group(1)  # the main suite's
    minors = {tuple(map(int, v.split(".")[:2])): v for v in TESTED_DEEPSPEED_VERSIONS}  # oldest first: newest wins
    assert sorted(stage + [main]) == sorted(set(minors.values()) | {TESTED_DEEPSPEED_VERSIONS[0]}), (stage, main)


def test_autocast_comm_dtype_where_the_release_marks_it():
    """0.17-0.19 mark autocast parameters (``torch_autocast``); 0.16 has no such module: never marked."""
    param = torch.nn.Parameter(torch.zeros(2))
    assert ds_compat.autocast_comm_dtype(param) is None
    try:
        from deepspeed.runtime.torch_autocast import PARAM_COMM_DTYPE_ATTR_NAME
    except ImportError:
        return
    setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, torch.bfloat16)
    assert ds_compat.autocast_comm_dtype(param) is torch.bfloat16


class _CanPinDoor:
    """The door as on CUDA: the accelerator answers "can pin" (``pins_host_memory``). torch's own pinned
    allocator, which a CPU-only torch lacks (``torch.empty(pin_memory=True)`` raises ``RuntimeError``), is
    stood in for by plain host memory, and each use is recorded: what is tested is which allocator the door
    picks on this release, and that what it hands out serves the pools."""

    @staticmethod
    def make(stand_in: bool):
        from fcdp_deepspeed.machine import device

        class Door(device.Door):
            def __init__(self) -> None:
                self.torch_pins: list[int] = []

            def pins_host_memory(self) -> bool:
                return True

            def torch_pinned_empty(self, numel, dtype):
                self.torch_pins.append(numel)
                if not stand_in:
                    return super().torch_pinned_empty(numel, dtype)
                return torch.empty(numel, dtype=dtype)

        return Door()


def _host_entry(numel: int = 40):
    from fcdp_deepspeed.storage.cache import CacheEntry
    param = torch.nn.Parameter(torch.zeros(numel))
    param.ds_numel = numel
    return CacheEntry(param=param, name="w", slot_numel=numel, start=0, dtype=torch.float32)


def test_pinning_takes_the_release_allocator():
    """Every host pool allocates pinned memory with the allocator this release has: DeepSpeed 0.19.7's
    ``accelerator.pin_empty``, else torch's pinned ``torch.empty`` (0.16-0.19.6's accelerators lack
    ``pin_empty``: before the fallback, every default config died at build on CUDA with AttributeError)."""
    from deepspeed.accelerator import get_accelerator
    from fcdp_deepspeed.grads import residual
    from fcdp_deepspeed.machine import device
    from fcdp_deepspeed.storage.cache import Placement, SlotPool
    has = callable(getattr(get_accelerator(), "pin_empty", None))
    import deepspeed
    release = tuple(int(x) for x in deepspeed.__version__.split("+")[0].split(".")[:3])
    assert has == (release >= (0, 19, 7)), (release, has)  # pin_empty arrived in 0.19.7 (0.19.5/0.19.6 lack it)
    door = _CanPinDoor.make(stand_in=True)
    with device.use(door):
        assert device.pin_path() == ("accelerator" if has else "torch")
        pool = SlotPool(Placement.HOST, pin=True)
        entry = _host_entry()
        assert pool.reserve([entry]) == [] and entry.slot is not None and entry.placement is Placement.HOST
        assert entry.slot.eq(0).all()  # zeroed once at allocation
        buf = residual._allocate(16, on_device=False, pin=True)
        assert buf is not None and buf.numel() == 16
    # the pooled chunk is rounded to a power of two (what a pinned allocation costs), through the torch path
    assert door.torch_pins == ([] if has else [64, 16]), door.torch_pins


def test_pinning_failure_degrades_to_plain_zero3():
    """Where torch cannot pin (here a CPU-only torch, on CUDA an exhausted or locked-memory-limited host), the
    pools' fallback catches the allocator's error: the entries are left unplaced (plain ZeRO-3), no crash."""
    from deepspeed.accelerator import get_accelerator
    from fcdp_deepspeed.machine import device
    from fcdp_deepspeed.storage.cache import SlotPool, Placement
    if callable(getattr(get_accelerator(), "pin_empty", None)):
        pytest.skip("this release pins through its accelerator (which is a no-op on the CPU)")
    door = _CanPinDoor.make(stand_in=False)
    with device.use(door):
        entry = _host_entry()
        assert SlotPool(Placement.HOST, pin=True).reserve([entry]) == [entry] and entry.slot is None
    assert door.torch_pins == [64]


def test_fcdp_line_shows_with_deepspeeds_documented_switch():
    """``set_log_level_from_string("info")`` shows the ``[fcdp]`` line on every release this file runs on (0.17
    left DeepSpeed's handler at WARNING, see report.log_info's note); at WARNING it stays hidden."""
    import io

    import logging

    import deepspeed.utils.logging as ds_logging
    from deepspeed.utils import logger

    def set_log_level_from_string(level: str) -> None:
        """DeepSpeed's switch; 0.16.9 has none, there ``deepspeed.utils.logger.setLevel`` is the way."""
        switch = getattr(ds_logging, "set_log_level_from_string", None)
        switch(level) if switch is not None else logger.setLevel(getattr(logging, level.upper()))

    from fcdp_deepspeed.runtime.report import log_info
    level, handlers = logger.level, [(h, h.level, getattr(h, "stream", None)) for h in logger.handlers]
    out = io.StringIO()
    try:
        for h in logger.handlers:
            h.setStream(out) if hasattr(h, "setStream") else None
        set_log_level_from_string("warning")
        log_info("[fcdp] hidden at warning")
        set_log_level_from_string("info")
        log_info("[fcdp] step 2: shown")
    finally:
        logger.setLevel(level)
        for h, lvl, stream in handlers:
            h.setLevel(lvl)
            if stream is not None:
                h.setStream(stream)
    assert "[fcdp] step 2: shown" in out.getvalue() and "hidden" not in out.getvalue(), out.getvalue()
