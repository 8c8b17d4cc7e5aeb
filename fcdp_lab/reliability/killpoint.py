"""Hold a training script's ranks at a chosen point of a chosen step, so that a supervisor kills them there.

    FCDP_KILLPOINTS="1:3:backward;0:6:save" FCDP_KILLPOINT_DIR=DIR \\
        torchrun ... -m fcdp_lab.reliability.killpoint train.py ARGS...

runs ``train.py`` unchanged as ``__main__`` (as ``fcdp_deepspeed.run`` does). Each point is
``NODE:STEP:PHASE``: every rank of node ``NODE`` (the launcher's ``GROUP_RANK``) that reaches
``PHASE`` while ``engine.global_steps == STEP`` (optimizer steps done) writes ``DIR/request.<i>``
and waits there; the supervisor (:mod:`fcdp_lab.reliability.elastic`) writes ``DIR/fired.<i>``
and SIGKILLs the node's ranks (with ``:agent``, its torchrun agent too). A point whose ``fired`` file exists is passed through, so the
restarted ranks run on. Phases:

- ``forward``: after the middle parameterized module's forward pre-hooks (its parameters are
  gathered; the other nodes wait in the next gather);
- ``backward``: when the gradient of that module's output arrives (mid-backward: reduce-scatters and
  backward gathers are under way);
- ``step``: in ``engine.step`` before the optimizer (the other nodes wait in its collectives);
- ``save``: in ``save_checkpoint`` before this rank's optimizer-state file is written;
- ``latest``: in ``save_checkpoint`` after this rank's files, before rank 0 writes ``latest``.

Test tooling: nothing in the package imports it.
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ENV, DIR_ENV = "FCDP_KILLPOINTS", "FCDP_KILLPOINT_DIR"
PHASES = ("forward", "backward", "step", "save", "latest")


@dataclass(frozen=True)
class KillPoint:
    """``NODE:STEP:PHASE``, or ``NODE:STEP:PHASE:agent`` when the node's agent dies too (the supervisor then
    starts a new one there, as a rebooted node would)."""

    node: int
    step: int
    phase: str
    agent: bool = False

    def __str__(self) -> str:
        return f"{self.node}:{self.step}:{self.phase}" + (":agent" if self.agent else "")

    @classmethod
    def parse(cls, text: str) -> "KillPoint":
        node, step, phase, *scope = text.strip().split(":")
        if phase not in PHASES or scope not in ([], ["agent"]):
            raise ValueError(f"{ENV}: bad kill point {text!r} (NODE:STEP:PHASE[:agent], PHASE one of {', '.join(PHASES)})")
        return cls(int(node), int(step), phase, bool(scope))


def parse_points(text: str) -> list[KillPoint]:
    return [KillPoint.parse(item) for item in text.split(";") if item.strip()]


def _node() -> int:
    return int(os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", "0")))


class _Points:
    """The points of this rank's node; :meth:`hold` blocks at an armed one until the rank is killed."""

    def __init__(self, points: list[KillPoint], directory: Path) -> None:
        self.directory = directory
        self.mine = [(i, p) for i, p in enumerate(points) if p.node == _node()]

    def armed(self, step: int, phase: str) -> Optional[int]:
        for i, p in self.mine:
            if p.step == step and p.phase == phase and not (self.directory / f"fired.{i}").exists():
                return i
        return None

    def hold(self, step: int, phase: str) -> None:
        i = self.armed(step, phase)
        if i is None:
            return
        try:
            fd = os.open(self.directory / f"request.{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, f"{os.environ.get('RANK')} {os.getpid()}\n".encode())
            os.close(fd)
        except FileExistsError:
            pass  # the node's other rank asked first
        print(f"fcdp killpoint: rank {os.environ.get('RANK')} holds at step {step} {phase}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # [Note: the supervisor kills us here; a missing one fails the job]
            time.sleep(0.05)
        raise SystemExit(f"fcdp killpoint: nobody killed rank {os.environ.get('RANK')} at {step}:{phase}")


def _middle_module(engine):
    mods = [m for m in engine.module.modules() if any(True for _ in m.parameters(recurse=False))]
    return mods[len(mods) // 2]


def install(points: _Points) -> None:
    """Wrap the engine's methods at the points' phases."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    saving: list = []
    forward, step, save, save_zero = (DeepSpeedEngine.forward, DeepSpeedEngine.step, DeepSpeedEngine.save_checkpoint,
                                      DeepSpeedEngine._save_zero_checkpoint)
    commit = TorchCheckpointEngine.commit

    def forward_at(self, *args, **kwargs):
        at = self.global_steps
        handles = []
        if points.armed(at, "forward") is not None:
            handles.append(_middle_module(self).register_forward_pre_hook(lambda m, i: points.hold(at, "forward")))
        if points.armed(at, "backward") is not None:
            def on_output(m, i, out):
                out.register_hook(lambda g: points.hold(at, "backward"))
            handles.append(_middle_module(self).register_forward_hook(on_output))
        try:
            return forward(self, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()

    def step_at(self, *args, **kwargs):
        points.hold(self.global_steps, "step")
        return step(self, *args, **kwargs)

    def save_at(self, *args, **kwargs):
        saving.append(self)
        try:
            return save(self, *args, **kwargs)
        finally:
            saving.pop()

    def save_zero_at(self, *args, **kwargs):
        points.hold(self.global_steps, "save")
        return save_zero(self, *args, **kwargs)

    def commit_at(self, info):
        if saving:
            points.hold(saving[-1].global_steps, "latest")
        return commit(self, info)

    DeepSpeedEngine.forward, DeepSpeedEngine.step = forward_at, step_at
    DeepSpeedEngine.save_checkpoint, DeepSpeedEngine._save_zero_checkpoint = save_at, save_zero_at
    TorchCheckpointEngine.commit = commit_at


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m fcdp_lab.reliability.killpoint SCRIPT [ARGS...]")
    points = parse_points(os.environ.get(ENV, ""))
    if points:
        install(_Points(points, Path(os.environ[DIR_ENV])))
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
