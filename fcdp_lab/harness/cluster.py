"""An emulated commodity cluster on one machine: N nodes as network namespaces.

Each node is a namespace with one uplink (``eth0``, a veth pair) into a bridge that lives in its own
"switch" namespace, so nothing touches the host's network. With ``rate_mbit`` each uplink is
shaped with ``tc tbf`` in both directions (node egress and switch egress towards the node), like a
node NIC on a slow Ethernet. Ranks of one node reach each other through the node's own address,
which the kernel routes over loopback: intra-node traffic is fast and never counted, and the
uplinks' kernel counters are exactly the inter-node traffic.

Needs root, ``ip`` (iproute2) and ``tc``. Always removes what it created (context manager, and a
SIGTERM handler while active); :func:`cleanup_stale` removes leftovers of killed runs.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

PREFIX = "fcdp"
#: Bytes of Ethernet + IPv4 + TCP (with timestamps) headers per packet, used to get payload bytes
#: from the kernel's byte and packet counters. ACK-only packets are exactly this size.
HEADER_BYTES = 66


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, no CAP_NET_ADMIN...)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_available() -> tuple[bool, str]:
    """Whether namespaces can be created here, and why not."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return False, f"`ip netns add` failed: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _list_namespaces() -> list[str]:
    res = _ip("-j", "netns", "list", check=False)
    try:
        return [n["name"] for n in json.loads(res.stdout or "[]")]
    except json.JSONDecodeError:
        return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    res = _ip("netns", "pids", ns, check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def cleanup_stale() -> list[str]:
    """Remove namespaces left by FCDP clusters whose creating process is gone."""
    removed = []
    for ns in _list_namespaces():
        if not ns.startswith(PREFIX) or "x" not in ns:
            continue
        owner = ns[len(PREFIX):].split("x")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    return removed


@dataclass
class EmulatedCluster:
    """``nodes`` namespaces on one bridge; uplinks shaped to ``rate_mbit`` (None: unlimited)."""

    nodes: int
    rate_mbit: Optional[float] = None
    subnet: str = "10.77.{net}"
    tag: str = ""
    _created: list[str] = field(default_factory=list, repr=False)
    _old_sigterm: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Names carry the owner pid (for cleanup_stale) and fit the 15-character interface limit.
        self.prefix = f"{PREFIX}{os.getpid()}x{self.tag}"
        self.net = os.getpid() % 250 + 1
        if len(self.prefix) + 4 > 15:
            self.prefix = self.prefix[:11]

    # -- names --------------------------------------------------------------------------------
    def ns(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def address(self, node: int) -> str:
        return f"{self.subnet.format(net=self.net)}.{node + 1}"

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        ok, why = namespaces_available()
        if not ok:
            raise ClusterUnavailable(why)
        self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _on_sigterm(self, signum, frame) -> None:
        self.destroy()
        raise SystemExit(128 + signum)

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_mbit is None:
            return
        rate = f"{self.rate_mbit}mbit"
        # burst: at least one 10 ms worth of traffic or 32 KiB, so the shaper is smooth at any rate
        burst = max(32 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.01))
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                        "latency", "400ms"], check=True, capture_output=True, text=True, timeout=30)

    def _create(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, node_end, switch_end = self.ns(i), f"{self.prefix}a{i}", f"{self.prefix}b{i}"
            self._add_ns(ns)
            _ip("link", "add", node_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", node_end, "netns", ns)
            _ip("link", "set", switch_end, "netns", self.switch)
            _ip("-n", ns, "link", "set", node_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
            _ip("-n", self.switch, "link", "set", switch_end, "up")
            self._shape(ns, "eth0")
            self._shape(self.switch, switch_end)

    def destroy(self) -> None:
        for ns in reversed(self._created):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        self._created.clear()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- use ----------------------------------------------------------------------------------
    def popen(self, node: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None, **kw) -> subprocess.Popen:
        """Start ``argv`` inside node ``node`` (a new session, so a timeout can kill its whole tree)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=dict(env or os.environ),
                                start_new_session=True, **kw)

    def counters(self) -> list[dict[str, int]]:
        """Kernel counters of every node's uplink (bytes and packets, both directions)."""
        out = []
        for i in range(self.nodes):
            res = _ip("-n", self.ns(i), "-j", "-s", "link", "show", "eth0")
            stats = json.loads(res.stdout)[0]["stats64"]
            out.append({"tx_bytes": stats["tx"]["bytes"], "tx_packets": stats["tx"]["packets"],
                        "rx_bytes": stats["rx"]["bytes"], "rx_packets": stats["rx"]["packets"]})
        return out

    def inter_node_payload_bytes(self, before: list[dict], after: list[dict]) -> int:
        """TCP payload that crossed node uplinks between two counter readings (all nodes' tx).

        Kernel tx bytes minus one header per packet: the pure-ACK packets flowing back are exactly
        headers, so this is the application bytes the collectives put on the wire."""
        total = 0
        for b, a in zip(before, after):
            total += (a["tx_bytes"] - b["tx_bytes"]) - HEADER_BYTES * (a["tx_packets"] - b["tx_packets"])
        return total
