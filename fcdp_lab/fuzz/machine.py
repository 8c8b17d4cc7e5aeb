"""The hypothesis state machine over event sequences, and one search (generate, shrink, report).

Hypothesis runs here, in the driving process; every rule sends one event to the rank server
(``driver.RankServer``), which applies it to every engine and checks them (``checks.py``). A failure
raises in the rule, so hypothesis shrinks the program (fewer events, simpler arguments) and replays
the minimal one last; :attr:`EventMachine.program` then holds it. Examples are independent: each
starts with ``begin`` (fresh engines), so a replay is deterministic and shrinking is sound.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hypothesis import HealthCheck, Phase, Verbosity, reject, seed as hypothesis_seed, settings as Settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, get_state_machine_test, initialize, rule

from fcdp_lab.fuzz.driver import RankServer, RankServerDied

#: Every engine kind (``engines.KINDS``): ZeRO-3, FCDP exact, FCDP with the default gradient modes.
ALL_ENGINES = ("zero3", "fcdp", "fcdp_defaults")
#: Enough to see a missed invalidation: ZeRO-3 and FCDP exact (the search for a broken variant).
EXACT_ENGINES = ("zero3", "fcdp")


def placements() -> st.SearchStrategy[dict]:
    """FCDP placement keys; each shrinks to its default (dropped from the dict)."""
    choices = {"cache_device": ("auto", "host", "device"), "host_budget": ("50%", 2048, 512, 0),
               "device_budget": ("auto", 1024), "miss_batch_bytes": (32 * 2**20, 0),
               "param_gather": ("auto", "flat"), "keep_frozen": (True, False),
               # every copy kind: the run-ahead from the first fetch (default, small: rolling; off), the push (opt-in,
               # whole or rolling), parameters below min_numel beside cached ones (biases, adapters: 16-32 elements)
               "param_runahead_bytes": (64 * 2**20, 6000, 0), "param_push_bytes": (0, 64 * 2**20, 6000),
               "min_numel": (0, 100)}
    return st.fixed_dictionaries({k: st.sampled_from(v) for k, v in choices.items()}).map(
        lambda d: {k: v for k, v in d.items() if v != choices[k][0]})


def sequence_configs() -> st.SearchStrategy[dict]:
    """What a sequence fixes at ``begin`` (the engine kinds come from the search)."""
    return st.fixed_dictionaries({
        "mode": st.sampled_from(("lora", "full", "partial")),
        "layers": st.sampled_from((1, 2)),
        "placement": placements(),
        "dtype": st.sampled_from(("fp32", "bf16")),
        "regime": st.sampled_from(("large", "default")),
        "zero_init": st.booleans(),
        "offload": st.sampled_from(("none", "optimizer", "param", "both")),
        "optimizer": st.sampled_from(("adam", "sgd")),
        "probe": st.booleans(),
    })


class EventFailure(AssertionError):
    """An event left an engine different from ZeRO-3, its cache stale, or the ranks out of step."""


#: Module indices address ``model.modules_with_params`` (modulo its length): embed, blocks.i (the adapters),
#: blocks.i.fc, head.
MODULES = st.integers(0, 5)


class EventMachine(RuleBasedStateMachine):
    """One example: ``begin`` (fresh engines), then events. :func:`search` sets the class attributes."""

    server: ClassVar[RankServer]
    engines: ClassVar[tuple[str, ...]] = ALL_ENGINES
    faults: ClassVar[str] = ""
    stats: ClassVar["SearchStats"]
    program: ClassVar[list[str]] = []  # the last example's steps (the minimal one after a failure)

    checkpoints = Bundle("checkpoints")

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[str] = []
        type(self).program = self.steps
        self.begun = False
        self.tags = 0

    def _send(self, cmd: dict, label: str) -> None:
        self.steps.append(label)
        self.stats.events[cmd.get("name", cmd["op"])] += 1
        try:
            reply = self.server.call(cmd)
        except RankServerDied as err:
            self.stats.failed_now()
            raise EventFailure(f"after {label}: the ranks hung or died: {err}") from None
        name = cmd.get("name", cmd["op"])
        self.stats.event_seconds[name] += reply.get("event_seconds", reply["seconds"])
        self.stats.check_seconds[name] += reply.get("check_seconds", 0.0)
        if reply.get("unsupported") and not reply["errors"]:
            self.stats.unsupported[f"{name}: {reply['unsupported']}"] += 1
            reject()  # [Note: unsupported sequences] in events.py: plain ZeRO-3 cannot run it either
        problems = reply["errors"] + reply["failures"]
        if problems:
            self.stats.failing_events[name] += 1
            self.stats.failed_now()
            raise EventFailure(f"after {label}:\n  " + "\n  ".join(problems[:12]))

    def _event(self, name: str, **args: Any) -> None:
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        self._send({"op": "event", "name": name, "args": args}, f"{name}({shown})")

    @initialize(target=checkpoints, config=sequence_configs())
    def begin(self, config: dict) -> str:
        """Fresh engines, and a checkpoint of their initial state (tag ``t0``: loads are possible from the start)."""
        config = {**config, "engines": type(self).engines, "initial_tag": "t0"}
        self.stats.sequences += 1
        self.begun = True
        self.tags = 1
        self._send({"op": "begin", "config": config, "faults": type(self).faults}, f"begin({config!r})")
        return "t0"

    # Four training rules (hypothesis has no rule weights; swarm testing disables each rule in some
    # sequences): training is about a fifth of the events, and a sequence rarely has none.
    @rule(micro=st.integers(1, 3))
    def train(self, micro: int) -> None:
        self._event("train", micro=micro)

    @rule(micro=st.integers(2, 4), eval_between=st.booleans(), inside=st.sampled_from(("", "save", "save16", "load")))
    def train_accumulate(self, micro: int, eval_between: bool, inside: str) -> None:
        """Gradient accumulation, optionally with an eval forward inside the window, and optionally a checkpoint
        event after its first micro-step (a save, the 16-bit consolidation HF's save_model runs, an in-process
        load): the rest of the window adds to the partial sums, as in ZeRO-3."""
        self._event("train", micro=micro, eval_between=eval_between, **({"inside": inside} if inside else {}))

    @rule(micro=st.integers(1, 2))
    def train_recompute(self, micro: int) -> None:
        """Activation checkpointing: the blocks' forward runs again in backward."""
        self._event("train", micro=micro, ckpt=True)

    @rule(micro=st.integers(1, 2))
    def train_bad_batch(self, micro: int) -> None:
        """A window whose first loss is infinite: ZeRO-3 skips the step (nothing changes, nothing is invalidated)."""
        self._event("train", micro=micro, bad_batch=True)

    @rule()
    def eval(self) -> None:
        self._event("eval")

    @rule(module=MODULES, rank=st.integers(0, 3), seed=st.integers(0, 3))
    def gathered_write(self, module: int, rank: int, seed: int) -> None:
        self._event("gathered_write", module=module, rank=rank, seed=seed)

    @rule(module=MODULES)
    def gathered_read(self, module: int) -> None:
        self._event("gathered_read", module=module)

    @rule(seed=st.integers(0, 3), subset=st.sampled_from(("all", "lora", "base")))
    def hf_load(self, seed: int, subset: str) -> None:
        self._event("hf_load", seed=seed, subset=subset)

    @rule(resize=st.sampled_from((0, 3, -2)), style=st.sampled_from(("hf5", "zero_init")),
          placement=st.none() | placements())
    def from_pretrained(self, resize: int, style: str, placement: Optional[dict]) -> None:
        self._event("from_pretrained", resize=resize, style=style, placement=placement)

    @rule(module=MODULES, requires_grad=st.booleans())
    def set_requires_grad(self, module: int, requires_grad: bool) -> None:
        self._event("set_requires_grad", module=module, requires_grad=requires_grad)

    @rule(lr=st.sampled_from((1e-2, 0.0, 1e-3, 5e-2)))
    def set_lr(self, lr: float) -> None:
        self._event("set_lr", lr=lr)

    @rule(target=checkpoints)
    def save(self) -> str:
        tag = f"t{self.tags}"
        self.tags += 1
        self._event("save", tag=tag)
        return tag

    @rule(tag=checkpoints, module_only=st.booleans())
    def load(self, tag: str, module_only: bool) -> None:
        """``load_checkpoint`` into the running engines (fresh ones if the layout changed since the save)."""
        self._event("load", tag=tag, module_only=module_only)

    @rule(tag=checkpoints, micro=st.integers(1, 2))
    def rollback(self, tag: str, micro: int) -> None:
        """A step, then at once ``load_checkpoint`` into the running engines (a job rolling back after a bad step):
        the one point where groups the push issued at the step's end are still in flight at the load."""
        self._event("train", micro=micro)
        self._event("load", tag=tag)

    @rule(tag=checkpoints, module_only=st.booleans(), placement=st.none() | placements())
    def load_fresh(self, tag: str, module_only: bool, placement: Optional[dict]) -> None:
        """``load_checkpoint`` into fresh engines, with another placement (budgets, cache device) or not."""
        self._event("load", tag=tag, fresh=True, module_only=module_only, placement=placement)

    @rule(tag=checkpoints, module_only=st.booleans(), placement=st.none() | placements())
    def resume(self, tag: str, module_only: bool, placement: Optional[dict]) -> None:
        """Fresh engines that evaluate once, then ``load_checkpoint`` (a script that validates before it
        resumes): the cache holds the fresh initialization when the checkpoint overwrites it."""
        self._event("load", tag=tag, fresh=True, warm=True, module_only=module_only, placement=placement)

    @rule()
    def save16(self) -> None:
        self._event("save16")

    @rule(train=st.booleans())
    def second_engine(self, train: bool) -> None:
        """A second engine over the same model: an evaluation engine beside it, or a training engine replacing it."""
        self._event("second_engine", train=train)

    def teardown(self) -> None:
        if self.begun and self.server.sock is not None:
            try:
                self.stats.coverage.update(self.server.call({"op": "end"}).get("coverage", {}))
            except RankServerDied:
                pass


@dataclass
class SearchStats:
    """What one search ran (every example, shrinking included)."""

    started: float = field(default_factory=time.monotonic)
    sequences: int = 0
    events: Counter = field(default_factory=Counter)
    failing_events: Counter = field(default_factory=Counter)
    event_seconds: Counter = field(default_factory=Counter)  # the ranks' time per event name (slowest rank)
    check_seconds: Counter = field(default_factory=Counter)
    unsupported: Counter = field(default_factory=Counter)  # discarded sequences: event and ZeRO-3's error
    coverage: Counter = field(default_factory=Counter)  # FCDP paths run (events.Sequence.coverage)
    first_failure: Optional[tuple[int, float]] = None  # (sequences, seconds) when the first failure appeared

    def failed_now(self) -> None:
        if self.first_failure is None:
            self.first_failure = (self.sequences, time.monotonic() - self.started)


@dataclass
class SearchResult:
    """One search: how much ran, and the minimal failing program if anything failed."""

    faults: str
    seed: Optional[int]
    engines: tuple[str, ...]
    sequences: int
    events: int
    seconds: float
    failure: Optional[str] = None
    program: list[str] = field(default_factory=list)
    first_failure_sequences: Optional[int] = None  # sequences run when the first failure appeared
    first_failure_seconds: Optional[float] = None
    event_counts: dict = field(default_factory=dict)
    event_seconds: dict = field(default_factory=dict)
    check_seconds: dict = field(default_factory=dict)
    unsupported: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)

    def report(self) -> str:
        if self.failure is None:
            return f"no failure in {self.sequences} sequences ({self.events} events, {self.seconds:.0f} s)"
        steps = "\n".join(f"  {i}. {s}" for i, s in enumerate(self.program))
        return (f"{self.failure}\nminimal sequence ({len(self.program)} steps, found after "
                f"{self.first_failure_sequences} sequences / {self.first_failure_seconds:.0f} s):\n{steps}")


def search(server: RankServer, *, engines: tuple[str, ...] = ALL_ENGINES, faults: str = "", max_examples: int = 20,
           steps: int = 8, seed: Optional[int] = None, shrink_seconds: Optional[float] = None) -> SearchResult:
    """Run the state machine: ``max_examples`` sequences of ``steps`` events (derandomized unless ``seed``
    is given); on a failure, shrink for at most ``shrink_seconds`` and replay the minimal sequence."""
    from hypothesis.internal.conjecture import engine as conjecture_engine

    stats = SearchStats()

    class Machine(EventMachine):
        pass

    Machine.server, Machine.engines, Machine.faults, Machine.stats = server, tuple(engines), faults, stats
    cfg = Settings(max_examples=max_examples, stateful_step_count=steps, deadline=None, database=None,
                   derandomize=seed is None, suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                   phases=(Phase.generate, Phase.shrink), report_multiple_bugs=False, print_blob=False)
    test = get_state_machine_test(Machine, settings=cfg)
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    saved = conjecture_engine.MAX_SHRINKING_SECONDS
    if shrink_seconds is not None:
        conjecture_engine.MAX_SHRINKING_SECONDS = shrink_seconds  # hypothesis allows patching it
    failure = None
    try:
        test()
    except EventFailure as err:
        failure = str(err)
    finally:
        conjecture_engine.MAX_SHRINKING_SECONDS = saved
    first_sequences, first_seconds = stats.first_failure or (None, None)
    return SearchResult(faults=faults, seed=seed, engines=tuple(engines), sequences=stats.sequences, events=sum(stats.events.values()),
                        seconds=time.monotonic() - stats.started, failure=failure,
                        program=list(Machine.program) if failure else [],
                        first_failure_sequences=first_sequences, first_failure_seconds=first_seconds,
                        event_counts=dict(stats.events), event_seconds=dict(stats.event_seconds),
                        check_seconds=dict(stats.check_seconds), unsupported=dict(stats.unsupported),
                        coverage=dict(stats.coverage))
