"""Node layout from real launcher environments (two torchrun agents = two nodes on one host)."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from conftest import TESTS_DIR
from fcdp_deepspeed.tools.launch import free_port


def test_two_torchrun_agents_give_the_node_layout():
    workdir = Path(tempfile.mkdtemp(prefix="fcdp-torchrun-"))
    (workdir / "kwargs.pkl").write_bytes(pickle.dumps({}))
    port = str(free_port())
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=TESTS_DIR, PYTHONWARNINGS="ignore::FutureWarning")
    agents = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                          "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
                          "-m", "fcdp_deepspeed.tools._worker", "dist_workers:launcher_parity", str(workdir)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        for n in (0, 1)
    ]
    try:
        logs = [a.communicate(timeout=300)[0].decode(errors="replace") for a in agents]
        assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
        results = [pickle.loads((workdir / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
        shutil.rmtree(workdir, ignore_errors=True)
    for r, res in enumerate(results):
        assert res["env"]["GROUP_RANK"] == str(r // 2) and res["env"]["LOCAL_WORLD_SIZE"] == "2"
        stats = res["fcdp"].stats
        assert stats["node_ranks"] == ([0, 1] if r < 2 else [2, 3]) and stats["num_nodes"] == 2
        assert res["fcdp"].losses == res["plain"].losses
        assert stats["cache_hits"] > 0
        assert stats["inter_node_allgather_bytes"] < 0.6 * res["plain"].stats["inter_node_allgather_bytes"]
    plain_w, fcdp_w = results[0]["plain"].weights, results[0]["fcdp"].weights
    assert all(torch.equal(plain_w[k], fcdp_w[k]) for k in plain_w)
