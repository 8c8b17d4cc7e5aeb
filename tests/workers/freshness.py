"""Workers of test_freshness.py: what FCDP computes with must be current wherever a parameter's value can change
behind the cache or the run-ahead: parameters below ``min_numel`` or over the host budget (no cache slot, gathered
in two stages, possibly ahead), two engines over one module, and the run-ahead's trace in an engine that never steps.
Every run is compared with plain ZeRO-3 doing exactly the same sequence (``fcdp_block`` pins ZeRO-3's gradient path,
so the comparison is bit for bit)."""
from __future__ import annotations

import copy
import os

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_lab.harness import toy
from workers.common import fcdp_block, forward, setup

HIDDEN = 32
#: LayerNorm over groups of this many features: its weight and bias (8 elements each) are the only parameters below
#: :data:`MIN_NUMEL`; every Linear parameter (32 x 32 weights, 32-element biases) is above it.
LN_WIDTH = 8
MIN_NUMEL = 16
#: The push from the step's end (opt-in), at the issue's 64 MiB.
PUSH_BYTES = 64 * 2**20
#: ``host_budget`` per node (split across its 2 ranks) that fits the first Linear and the LayerNorm (placement
#: order: ``ds_id``) but not the later Linears' weights; the run checks which got a slot (``cached_names``).
SMALL_HOST_BUDGET = 6000
#: ``get_stats`` keys kept in the results (what the tests check and print).
STATS_KEYS = ("cached_params", "uncached_params", "uncached_reasons", "cache_hits", "cache_misses",
              "hierarchical_gathers", "param_push_groups", "param_push_used", "param_push_cancelled",
              "param_push_unused", "param_push_rolled", "param_push_stale", "stale_refetched")


class LNModel(torch.nn.Module):
    """Three Linears and a LayerNorm over groups of :data:`LN_WIDTH` features (small enough to be uncached)."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, hidden)
        self.ln = torch.nn.LayerNorm(LN_WIDTH)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = self.ln(h.reshape(*h.shape[:-1], -1, LN_WIDTH)).reshape(h.shape)
        return self.fc3(torch.tanh(self.fc2(h)) + h)


def _package() -> str:
    """The directory of the ``fcdp_deepspeed`` the ranks imported (a pristine copy on ``PYTHONPATH`` or the tree)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(fcdp_deepspeed.__file__)))


def _stats(engine) -> dict:
    stats = fcdp_deepspeed.get_stats(engine)
    return {k: copy.deepcopy(stats[k]) for k in STATS_KEYS if k in stats}


def _cached_names(engine) -> list:
    """Names of the parameters with a cache slot (FCDP's internals; ``None`` where they moved)."""
    try:
        from fcdp_deepspeed.storage.cache import EntryState
        entries = engine.optimizer.fcdp.cache.entries.values()
        return sorted(e.name for e in entries if e.state is not EntryState.DISABLED)
    except Exception:  # noqa: BLE001 - diagnostics only
        return None


def _weights(engine) -> dict:
    """Every parameter, gathered one at a time (collective), on every rank."""
    return toy.gather_weights(engine)


def _break_check() -> bool:
    """The broken variant: the product's check at use always passes (``storage/freshness.py``, when it exists)."""
    try:
        import fcdp_deepspeed.storage.freshness as fr
    except ImportError:
        return False
    fr.is_current = lambda *a, **k: True
    return True


def _build_ln(cfg: dict, seed: int = 0, optimizer: bool = True):
    fcdp_deepspeed.install()
    torch.manual_seed(seed)
    model = LNModel(HIDDEN)
    if not optimizer:
        cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
        engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(cfg))
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=copy.deepcopy(cfg))
    return engine


# -- 1. the run-ahead and parameters without a cache slot ----------------------------------------------------------
#: name -> (regime, fcdp block extras or None for plain ZeRO-3)
UNCACHED_VARIANTS = {
    "plain": ("large", None),
    "runahead": ("large", {"min_numel": MIN_NUMEL}),
    "runahead_off": ("large", {"min_numel": MIN_NUMEL, "param_runahead_bytes": 0}),
    "push": ("large", {"min_numel": MIN_NUMEL, "param_push_bytes": PUSH_BYTES}),
    "plain_default_regime": ("default", None),
    "runahead_default_regime": ("default", {"min_numel": MIN_NUMEL}),
    "push_default_regime": ("default", {"min_numel": MIN_NUMEL, "param_push_bytes": PUSH_BYTES}),
    "over_budget": ("large", {"host_budget": SMALL_HOST_BUDGET, "cache_device": "host"}),
    "over_budget_push": ("large", {"host_budget": SMALL_HOST_BUDGET, "cache_device": "host",
                                   "param_push_bytes": PUSH_BYTES}),
}
#: Every record of :func:`_uncached_sequence`, in the order it is made.
RECORDS = ("train_a", "train_b", "eval_fwd", "after_load_fwd", "after_edit_fwd", "train_c", "final_fwd", "train_d",
           "after_step_load_fwd", "train_e", "weights")


def _edit_ln(engine, delta: float) -> None:
    """``GatheredParameters(modifier_rank=0)`` of the LayerNorm: rank 0 adds ``delta``, DeepSpeed broadcasts it."""
    ln = engine.module.ln
    with deepspeed.zero.GatheredParameters([ln.weight, ln.bias], modifier_rank=0):
        if dist.get_rank() == 0:
            ln.weight.data.add_(delta)
            ln.bias.data.add_(delta)


def _uncached_sequence(engine, ckpt_dir: str, tag: str) -> dict:
    """The issue's sequence (``train_a`` .. ``final_fwd``), then a load right after a step (``train_d``,
    ``after_step_load_fwd``, ``train_e``): in the issue's sequence the eval forward after the step takes every group
    the step's end pushed, so nothing is in flight at its load; here the load meets every pushed group in flight."""
    train = lambda n, seed: toy.train(engine, n, hidden=HIDDEN, seed=seed).losses  # noqa: E731
    rec: dict = {"train_a": train(2, 0)}
    engine.save_checkpoint(ckpt_dir, tag=tag)
    rec["train_b"] = train(1, 1)
    rec["eval_fwd"] = forward(engine, HIDDEN)
    engine.load_checkpoint(ckpt_dir, tag=tag)  # back to the weights after train_a (LayerNorm included)
    rec["after_load_fwd"] = forward(engine, HIDDEN)
    _edit_ln(engine, 0.5)
    rec["after_edit_fwd"] = forward(engine, HIDDEN)
    rec["train_c"] = train(2, 2)
    rec["final_fwd"] = forward(engine, HIDDEN)
    rec["train_d"] = train(1, 3)
    engine.load_checkpoint(ckpt_dir, tag=tag)  # right after a step
    rec["after_step_load_fwd"] = forward(engine, HIDDEN)
    rec["train_e"] = train(1, 4)
    rec["weights"] = _weights(engine)
    return rec


def uncached(ckpt_dir: str, variants: tuple = tuple(UNCACHED_VARIANTS), break_check: bool = False) -> dict:
    """Scenario 1: plain ZeRO-3 and FCDP variants of one sequence (train, save, train, eval, load, forward, a
    ``GatheredParameters`` edit of the LayerNorm, forward, train, forward), the LayerNorm below ``min_numel`` (or, in
    ``over_budget*``, some Linears over ``host_budget``), then a load right after a step. ``break_check``: the check
    at use switched off."""
    setup()
    out: dict = {"package": _package(), "check_broken": _break_check() if break_check else False}
    for name in variants:
        regime, extra = UNCACHED_VARIANTS[name]
        cfg = toy.ds_config(fcdp_block(**extra) if extra is not None else None, regime=regime)
        engine = _build_ln(cfg)
        rec = _uncached_sequence(engine, ckpt_dir, tag=name)
        if extra is not None:
            rec["stats"] = _stats(engine)
            rec["cached_names"] = _cached_names(engine)
        out[name] = rec
    return out


# -- 2. two engines over one module --------------------------------------------------------------------------------
def _two_engines(fcdp: bool, kind: str) -> dict:
    """Two engines over one module, ``kind``:

    - ``inference_and_training``: engine A without an optimizer, then B training the same module; B trains 4 steps
      with A's forward before the first and after each;
    - ``two_training``: A and B both with optimizers, built one after the other; A trains 2 steps, then B 3 (not
      in the tests: plain ZeRO-3 itself fails it, both engines' gradient hooks fill one bucket: DeepSpeed 0.19.8's
      ``assert len(set(p.ds_id ...)) == len(params_in_bucket)`` in ``__reduce_and_partition_ipg_grads``);
    - ``two_training_destroyed``: A (with an optimizer) trains 2 steps and is destroyed (``engine.destroy()``, which
      removes its DeepSpeed hooks), then B is built over the same module and trains 3.

    Any exception from building or running the FCDP pair is returned (the tests accept one that names the fix)."""
    cfg = toy.ds_config(fcdp_block() if fcdp else None, regime="large")
    inference_cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
    fcdp_deepspeed.install()
    torch.manual_seed(0)
    model = toy.ToyModel(HIDDEN, 2)

    def build(c: dict):
        params = {"model_parameters": list(model.parameters())} if "optimizer" in c else {}
        return deepspeed.initialize(model=model, config=copy.deepcopy(c), **params)[0]

    rec: dict = {"raised": None, "losses": [], "outputs": []}
    stage = "build A"
    try:
        a = build(inference_cfg if kind == "inference_and_training" else cfg)
        if kind == "inference_and_training":
            stage = "build B"
            b = build(cfg)
            stage = "run"
            rec["outputs"].append(forward(a, HIDDEN))
            for step in range(4):
                rec["losses"] += toy.train(b, 1, hidden=HIDDEN, seed=step).losses
                rec["outputs"].append(forward(a, HIDDEN))
        else:
            if kind == "two_training":
                stage = "build B"
                b = build(cfg)
            stage = "run"
            rec["losses"] += toy.train(a, 2, hidden=HIDDEN, seed=0).losses
            rec["outputs"].append(forward(a, HIDDEN))
            if kind == "two_training_destroyed":
                a.destroy()
                stage = "build B"
                b = build(cfg)
                stage = "run"
            rec["losses"] += toy.train(b, 3, hidden=HIDDEN, seed=1).losses
            rec["outputs"].append(forward(b, HIDDEN))
        rec["weights"] = _weights(b)
    except Exception as err:  # noqa: BLE001 - the product may refuse the second engine (with a "Fix:")
        if not fcdp:
            raise
        rec["raised"] = f"{stage}: {type(err).__name__}: {err}"
    return rec


def failed_start() -> dict:
    """A training engine whose FCDP build fails after attaching (injected here: ``FCDPRuntime._build`` raises once):
    what it leaves on the model's partition hooks (a ``zero.Init`` hook with caches and listeners). A later engine
    over the model finds them there ([Note: two engines over one model]); a failed one must leave none. (A retry
    through DeepSpeed itself is not possible here: the half-built DeepSpeed engine keeps its module hooks, which fail
    on the next forward, ZeRO-3 alike.)"""
    from fcdp_deepspeed.runtime import FCDPRuntime
    from fcdp_deepspeed.runtime.attach import init_owner
    setup()
    cfg = toy.ds_config(fcdp_block(), regime="large")
    fcdp_deepspeed.install()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = toy.ToyModel(HIDDEN, 2)
    real, out = FCDPRuntime._build, {"package": _package()}

    def fail_once(self, params):
        FCDPRuntime._build = real
        raise RuntimeError("injected: the build fails after attach")
    FCDPRuntime._build = fail_once
    try:
        deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=copy.deepcopy(cfg))
    except RuntimeError as err:
        out["first"] = str(err)
    finally:
        FCDPRuntime._build = real
    hooks = {id(h): h for h in (init_owner(p).__dict__.get("_partition_param_sec") for p in model.parameters())
             if h is not None}
    out["hooks"] = len(hooks)
    out["caches"] = sum(len(h.caches) for h in hooks.values())
    out["listeners"] = sum(len(h.listeners) for h in hooks.values())
    return out


def two_engines(kinds: tuple = ("inference_and_training", "two_training_destroyed"),
                modes: tuple = ("plain", "fcdp")) -> dict:
    """Scenario 2: each kind with plain ZeRO-3 engines, then with FCDP engines, on fresh modules."""
    setup()
    out: dict = {"package": _package()}
    for kind in kinds:
        out[kind] = {mode: _two_engines(mode == "fcdp", kind) for mode in modes}
    return out


# -- 3. the run-ahead's trace in an optimizer-less engine ----------------------------------------------------------
def _runahead_of(engine):
    """The engine's run-ahead (``None``: none), wherever the runtime keeps it."""
    runtime = getattr(engine.optimizer, "fcdp", None)
    runahead = getattr(runtime, "runahead", None)
    if runahead is None:
        runahead = getattr(getattr(runtime, "gather", None), "runahead", None)
    return runahead


def inference_trace(forwards: int = 50, probe_at: int = 10) -> dict:
    """Scenario 3: an FCDP engine without an optimizer runs ``forwards`` forwards; the run-ahead's trace length after
    ``probe_at`` and after all of them. ``small_uncached``: the biases and the LayerNorm below ``min_numel`` (four
    two-stage gathers per forward, in alternating modules: the trace, which merges only a repeat of the last group,
    would grow by four per forward); ``all_uncached``: every parameter. Outputs compared with a plain optimizer-less
    engine's."""
    setup()
    out: dict = {"package": _package()}
    plain = _build_ln(toy.ds_config(None, regime="large"), optimizer=False)
    out["plain_out"] = [forward(plain, HIDDEN) for _ in range(2)]
    for name, extra in (("small_uncached", {"min_numel": HIDDEN + 1}), ("all_uncached", {"min_numel": 10**6})):
        engine = _build_ln(toy.ds_config(fcdp_block(**extra), regime="large"), optimizer=False)
        runahead = _runahead_of(engine)
        rec: dict = {"has_runahead": runahead is not None, "class": type(engine.optimizer).__name__, "out": []}
        for i in range(1, forwards + 1):
            y = forward(engine, HIDDEN)
            if i in (1, forwards):
                rec["out"].append(y)
            if i == probe_at and runahead is not None:
                rec["trace_at_probe"] = len(runahead.trace)
        rec["trace_at_end"] = len(runahead.trace) if runahead is not None else None
        rec["stats"] = _stats(engine)
        out[name] = rec
    return out
