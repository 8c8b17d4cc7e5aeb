"""Two emulated nodes (network namespaces) each running the deepspeed launcher with
``--no_ssh --node_rank i``: the node layout comes from the launcher's environment, FCDP matches
plain ZeRO-3, and the kernel's interface counters show the inter-node bytes it saves."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fcdp_lab.harness.cluster import EmulatedCluster, namespaces_available
from workers.common import ZERO3_GRADS
from fcdp_lab.harness.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
OK, WHY = namespaces_available()
pytestmark = [pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")]
STEPS, HIDDEN = 4, 512


def _launch_both_nodes(cluster: EmulatedCluster, tmp: Path, cfg: dict, use_fcdp_entry: bool, out: Path) -> tuple:
    cfg_path = tmp / f"{out.stem}.json"
    cfg_path.write_text(json.dumps(cfg))
    (tmp / "hostfile").write_text("node0 slots=2\nnode1 slots=2\n")
    port = str(free_port())
    entry = ["--module", "fcdp_deepspeed.run"] if use_fcdp_entry else []
    # FCDP_AUTOLOAD=0: the plain run is DeepSpeed's own ZeRO-3, and FCDP comes from the launch entry alone
    # (the startup hook is tested in test_autoload_install.py).
    env = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="eth0", PYTHONWARNINGS="ignore::FutureWarning",
               FCDP_AUTOLOAD="0")
    before = cluster.counters()
    procs = [cluster.popen(i, [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(tmp / "hostfile"),
                               "--no_ssh", "--node_rank", str(i), "--master_addr", cluster.address(0), "--master_port",
                               port, *entry, str(ROOT / "examples" / "train_toy.py"), "--deepspeed_config",
                               str(cfg_path), "--steps", str(STEPS), "--hidden", str(HIDDEN), "--out", str(out)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=str(ROOT))
             for i in range(cluster.nodes)]
    try:
        logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert out.exists(), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text()), cluster.inter_node_payload_bytes(before, cluster.counters())


def test_deepspeed_launcher_on_two_namespace_nodes(tmp_path):
    base = json.loads((ROOT / "configs" / "toy_fcdp.json").read_text())
    plain_cfg = {k: v for k, v in base.items() if k != "fcdp"}
    base["fcdp"] = {**base["fcdp"], **ZERO3_GRADS}  # bit-identical losses: DeepSpeed's gradient path
    with EmulatedCluster(2, rate_mbit=None, tag="t") as cluster:
        plain, plain_bytes = _launch_both_nodes(cluster, tmp_path, plain_cfg, False, tmp_path / "plain_out.json")
        fcdp, fcdp_bytes = _launch_both_nodes(cluster, tmp_path, base, True, tmp_path / "fcdp_out.json")
    for rank, (p, f) in enumerate(zip(plain, fcdp)):
        assert f["launcher_env"]["CROSS_RANK"] == str(rank // 2) and f["launcher_env"]["LOCAL_SIZE"] == "2"
        assert f["optimizer"] == "FCDPStage3" and p["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert f["node_ranks"] == ([0, 1] if rank < 2 else [2, 3]) and f["num_nodes"] == 2  # from CROSS_RANK
        assert f["losses"] == p["losses"]
    # FCDP skips every backward all-gather across nodes: a ring over 2 nodes x 2 puts 1.5x the
    # model on the inter-node links per all-gather.
    expected_saving = STEPS * 1.5 * fcdp[0]["model_bytes"]
    saved = plain_bytes - fcdp_bytes
    print(f"kernel inter-node payload: plain {plain_bytes} B, fcdp {fcdp_bytes} B, saved {saved} B "
          f"(expected backward all-gathers {expected_saving:.0f} B)")
    assert saved >= 0.8 * expected_saving, (plain_bytes, fcdp_bytes, expected_saving)
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith(cluster.prefix)]
