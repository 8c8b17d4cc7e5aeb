"""Run a training script under torchrun's elastic agent on the emulated cluster, killing nodes' ranks.

One ``torchrun`` agent per network-namespace node (c10d rendezvous hosted by node 0's agent,
``--max-restarts``), each running the script through :mod:`fcdp_lab.reliability.killpoint`. When a
node's ranks hold at a kill point, every rank of that node is SIGKILLed from here (a real kill
mid-step, not an exit; with ``:agent`` the node's agent too, and a new agent is started on the node,
except on node 0, whose agent hosts the rendezvous: the job then ends); the agents then restart the
workers, and the script resumes from its last checkpoint. :func:`run_elastic` returns what happened: each kill, every metrics line the script's
rank 0 wrote, the agents' exit codes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from fcdp_lab.harness.cluster import EmulatedCluster
from fcdp_lab.reliability.killpoint import DIR_ENV, ENV, KillPoint

RDZV_PORT = 29400


@dataclass
class ElasticRun:
    """The outcome of one job: agents' exit codes, the kills made, rank 0's metrics lines."""

    returncodes: list[Optional[int]]
    kills: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    timed_out: bool = False
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    @property
    def steps(self) -> list[dict]:
        """Rank 0's step lines (``step``, ``loss``, ``world``), in the order they ran."""
        return [m for m in self.metrics if "step" in m]

    def resumed_at(self) -> list[int]:
        """The step each restarted attempt began at (what its checkpoint restored)."""
        return [m["start"] for m in self.metrics if "start" in m][1:]

    def redone_steps(self) -> int:
        """Steps that completed more than once: the work the kills cost."""
        seen: set[int] = set()
        redone = 0
        for m in self.steps:
            redone += m["step"] in seen
            seen.add(m["step"])
        return redone


def _workers_of(agent_pid: int) -> list[int]:
    """The rank processes under an agent: its descendants that carry a ``RANK`` variable."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [agent_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if any(v.startswith(b"RANK=") for v in f.read().split(b"\0")):
                        found.append(pid)
            except OSError:
                pass
    return found


def _kill_leftovers(cluster: EmulatedCluster) -> None:
    """Every process still in a node namespace once the agents are gone (ranks a dead agent left behind)."""
    for node in range(cluster.nodes):
        res = subprocess.run(["ip", "netns", "pids", cluster.ns(node)], capture_output=True, text=True, check=False)
        for pid in res.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _worker_log_tails(log_dir: Path, chars: int = 1500) -> str:
    out = []
    for p in sorted(log_dir.rglob("*.log")):
        text = _tail(p, chars)
        if text.strip():
            out.append(f"--- {p.relative_to(log_dir)} ---\n{text}")
    return "\n".join(out[-8:])


def run_elastic(cluster: EmulatedCluster, script_argv: Sequence[str], workdir: Path, *, nproc: int = 2,
                kills: Sequence[KillPoint] = (), max_restarts: int = 3, timeout: float = 600,
                metrics: Optional[Path] = None, env: Optional[Mapping[str, str]] = None) -> ElasticRun:
    """Run ``script_argv`` (script and arguments) with one torchrun agent per node of ``cluster``.

    ``metrics`` is the file the script's ``--metrics`` writes (read back into the result). Every
    process gets ``TMPDIR=workdir/tmp``; ``workdir`` is the caller's to remove."""
    killdir, tmp, logs = workdir / "killpoints", workdir / "tmp", workdir / "logs"
    for d in (killdir, tmp, logs):
        d.mkdir(parents=True, exist_ok=True)
    e = dict(os.environ)
    e.update({"DS_ACCELERATOR": e.get("DS_ACCELERATOR", "cpu"), "GLOO_SOCKET_IFNAME": "eth0", "TMPDIR": str(tmp),
              "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning", "PYTHONUNBUFFERED": "1",
              ENV: ";".join(str(k) for k in kills), DIR_ENV: str(killdir),
              # [Note: torch 2.13's shared rendezvous store outlives a restart] the c10d handler builds the
              # workers' store once (dynamic_rendezvous.py, `_bootstrap_store_info is None`) and no longer
              # prefixes keys per attempt, so restarted ranks read the dead ranks' gloo addresses and fail to
              # connect (pytorch#135712). Opting out gives each rendezvous round a fresh store on rank 0.
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    e.update(env or {})
    agents: list[subprocess.Popen] = []
    agent_logs: list[Path] = []
    start = time.monotonic()
    result = ElasticRun(returncodes=[])

    def launch(node: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes),
                "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.address(0)}:{RDZV_PORT}",
                "--rdzv-id", "fcdp-elastic", "--rdzv-conf", f"is_host={int(node == 0)}",
                "--local-addr", cluster.address(node), "--monitor-interval", "0.2",
                "--log-dir", str(logs / f"node{node}" / str(len(agent_logs))), "--redirects", "3",
                "-m", "fcdp_lab.reliability.killpoint", *script_argv]
        agent_logs.append(workdir / f"agent{node}.{len(agent_logs)}.log")
        with open(agent_logs[-1], "wb") as log:
            return cluster.popen(node, argv, env=e, stdout=log, stderr=subprocess.STDOUT)

    try:
        for node in range(cluster.nodes):
            agents.append(launch(node))
        fired: set[int] = set()
        deadline = start + timeout
        while any(a.poll() is None for a in agents):
            if time.monotonic() > deadline:
                result.timed_out = True
                break
            for i, point in enumerate(kills):
                if i in fired or not (killdir / f"request.{i}").exists():
                    continue
                (killdir / f"fired.{i}").write_text("")  # before the kill: restarted ranks pass the point
                agent = agents[point.node]
                victims = _workers_of(agent.pid) + ([agent.pid] if point.agent else [])
                for pid in victims:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if point.agent and point.node != 0:  # the node comes back: a new agent joins the next round
                    agent.wait()
                    agents[point.node] = launch(point.node)
                # [Note: node 0's agent hosts the c10d rendezvous] with it gone the other agents fail
                # (RendezvousConnectionError) and the job ends: it is relaunched whole, as a scheduler would.
                fired.add(i)
                result.kills.append({"point": str(point), "pids": victims, "t": round(time.monotonic() - start, 2)})
            time.sleep(0.05)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
        _kill_leftovers(cluster)
        result.returncodes = [a.returncode for a in agents]
        result.wall_s = round(time.monotonic() - start, 1)
        if metrics is not None and metrics.exists():
            result.metrics = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if not result.ok:
            result.log_tail = "\n".join(f"--- {p.name} ---\n{_tail(p)}" for p in agent_logs) + "\n" + _worker_log_tails(logs)
    return result
