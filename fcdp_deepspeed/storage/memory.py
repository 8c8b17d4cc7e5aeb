"""What memory a budget may really take: host limits beyond ``psutil``, pinned rounding, margins.

Pure functions of numbers and files (every path is a parameter, so tests read real files from a
temporary directory); the runtime (``runtime/allocation.py``, ``grads/buffer.py``) applies them.

[Note: why psutil is not enough]
``psutil.virtual_memory().available`` is the machine's free memory. A job in a container or a SLURM
allocation is killed by the kernel's OOM killer at its cgroup's limit, long before the machine is
full, and a kill is not an exception any fallback can catch. So the host limit is the smallest of
every limit that applies, each named with its source, minus a safety margin. Page-locked memory
counts against the cgroup like any other; PyTorch's caching host allocator also rounds each pinned
request up to a power of two, so a request costs :func:`pinned_cost`, not its size.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

GiB = 2**30
#: cgroup v1 reports "no limit" as a huge page-aligned number (2^63 - 4096 on x86-64).
_UNLIMITED = 2**60


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest host-memory headroom found, and where it came from."""

    bytes: int
    source: str
    #: Every limit that was read, ``(source, headroom bytes)``, tightest first.
    candidates: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        return f"{self.source}: {self.bytes / GiB:.3g} GiB"


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """``/proc/self/cgroup``: controller (``""`` for the v2 unified hierarchy) -> cgroup path."""
    out: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _levels(mount: Path, rel: str) -> list[Path]:
    """The process's cgroup directory and its ancestors inside ``mount`` (limits nest: the tightest
    level counts). A cgroup namespace or a container mount may hide the path: ``mount`` itself is then
    the process's own cgroup."""
    leaf = mount / rel.strip("/")
    if not leaf.is_dir():
        leaf = mount
    out = [leaf]
    while out[-1] != mount and mount in out[-1].parents:
        out.append(out[-1].parent)
    return out


def _cgroup_headroom(mount: Path, rel: str, limit_file: str, usage_file: str, label: str) -> Optional[tuple[str, int]]:
    best: Optional[tuple[str, int]] = None
    for level in _levels(mount, rel):
        limit, usage = _read_int(level / limit_file), _read_int(level / usage_file)
        if limit is None:
            continue
        headroom = max(0, limit - (usage or 0))
        if best is None or headroom < best[1]:
            best = (f"{label} {level / limit_file} - {usage_file}", headroom)
    return best


def cgroup_headroom(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                    proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> list[tuple[str, int]]:
    """Headroom under this process's cgroup memory limits: v2 ``memory.max - memory.current`` and
    v1 ``memory.limit_in_bytes - memory.usage_in_bytes``, the tightest level of each. Empty if unlimited."""
    root, paths = Path(cgroup_root), _cgroup_paths(Path(proc_cgroup))
    found = []
    if "" in paths and (root / "cgroup.controllers").exists():  # v2 mounted at the root
        found.append(_cgroup_headroom(root, paths[""], "memory.max", "memory.current", "cgroup v2"))
    elif "" in paths and (root / "unified" / "cgroup.controllers").exists():  # hybrid: v2 under unified/
        found.append(_cgroup_headroom(root / "unified", paths[""], "memory.max", "memory.current", "cgroup v2"))
    if "memory" in paths and (root / "memory").is_dir():
        found.append(_cgroup_headroom(root / "memory", paths["memory"], "memory.limit_in_bytes",
                                      "memory.usage_in_bytes", "cgroup v1"))
    return [f for f in found if f is not None]


def cgroup_current(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                   proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> Optional[tuple[str, int]]:
    """``(path, bytes)`` of this process's cgroup v2 ``memory.current`` (v1: ``memory.usage_in_bytes``), or
    ``None`` where neither is readable. What the cgroup charges, page-locked memory included."""
    root, paths = Path(cgroup_root), _cgroup_paths(Path(proc_cgroup))
    candidates = []
    if "" in paths:
        for mount in (root, root / "unified"):
            if (mount / "cgroup.controllers").exists():
                candidates.append(_levels(mount, paths[""])[0] / "memory.current")
    if "memory" in paths and (root / "memory").is_dir():
        candidates.append(_levels(root / "memory", paths["memory"])[0] / "memory.usage_in_bytes")
    for path in candidates:
        value = _read_int(path)
        if value is not None:
            return str(path), value
    return None


def slurm_limit(environ: Mapping[str, str], used_bytes: int) -> Optional[tuple[str, int]]:
    """Headroom under the job's SLURM memory request (MB): ``SLURM_MEM_PER_NODE``, else
    ``SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE``, minus ``used_bytes``. ``None`` outside SLURM."""
    def num(key: str) -> Optional[int]:
        try:
            return int(environ[key])
        except (KeyError, ValueError):
            return None
    per_node = num("SLURM_MEM_PER_NODE")
    if per_node:  # 0 means "all of the node's memory": no extra limit
        return f"SLURM_MEM_PER_NODE={per_node}M", max(0, per_node * 2**20 - used_bytes)
    per_cpu, cpus = num("SLURM_MEM_PER_CPU"), num("SLURM_CPUS_ON_NODE")
    if per_cpu and cpus:
        return (f"SLURM_MEM_PER_CPU={per_cpu}M x SLURM_CPUS_ON_NODE={cpus}",
                max(0, per_cpu * cpus * 2**20 - used_bytes))
    return None


def host_limit(psutil_available: Optional[int] = None, *, cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
               proc_cgroup: str | os.PathLike = "/proc/self/cgroup", environ: Optional[Mapping[str, str]] = None,
               used_bytes: Optional[int] = None) -> MemoryLimit:
    """The host memory this node's ranks may still take: the smallest of psutil's available memory,
    the cgroup limits and the SLURM request. ``used_bytes`` (for SLURM, which reports no usage)
    defaults to this process's resident memory."""
    import psutil
    available = psutil.virtual_memory().available if psutil_available is None else psutil_available
    candidates = [("psutil available", int(available))] + cgroup_headroom(cgroup_root, proc_cgroup)
    used = psutil.Process().memory_info().rss if used_bytes is None else used_bytes
    slurm = slurm_limit(os.environ if environ is None else environ, used)
    if slurm is not None:
        candidates.append(slurm)
    candidates.sort(key=lambda c: c[1])
    return MemoryLimit(bytes=candidates[0][1], source=candidates[0][0], candidates=tuple(candidates))


def host_margin(limit_bytes: int) -> int:
    """Host memory never budgeted: max(10% of the limit, 1 GiB). [Note: the margin covers what the
    budgets do not see: the other ranks' activity between measurement and allocation, the allocator's
    own caching, Python, DeepSpeed's buffers allocated later]."""
    return max(limit_bytes // 10, GiB)


def usable_host(limit: MemoryLimit) -> int:
    """What host budgets (per node) may be resolved against: the limit minus :func:`host_margin`."""
    return max(0, limit.bytes - host_margin(limit.bytes))


def pinned_cost(nbytes: int, pinned: bool = True) -> int:
    """Bytes a host request really takes: PyTorch's caching host allocator rounds a pinned request up
    to the next power of two (up to 2x); pageable memory costs its size."""
    if nbytes <= 0:
        return 0
    return 1 << (nbytes - 1).bit_length() if pinned else nbytes


def pinned_capacity(budget_bytes: int, pinned: bool = True) -> int:
    """The largest single host request whose :func:`pinned_cost` fits ``budget_bytes``."""
    if not pinned or budget_bytes <= 0:
        return max(0, budget_bytes)
    return 1 << (budget_bytes.bit_length() - 1)


def chunk_groups(nbytes: list[int], chunk_bytes: int, pinned: bool = False) -> list[list[int]]:
    """Indices of ``nbytes`` (one dtype, in order) grouped into chunks of at most ``chunk_bytes``.

    A larger slot opens a chunk of its own, which costs ``pinned_cost`` of it (pinned: up to 2x): the slots
    after it fill what that rounding pays for anyway, so a large slot wastes at most the rest of the pool's
    tail. (A slot is one tensor, DeepSpeed's secondary, so it cannot span chunks.)"""
    chunks: list[list[int]] = []
    used = capacity = 0
    for i, n in enumerate(nbytes):
        if chunks and used + n <= capacity:
            chunks[-1].append(i)
            used += n
        else:
            chunks.append([i])
            used, capacity = n, max(chunk_bytes, pinned_cost(n, pinned))
    return chunks


def chunks_cost(nbytes: list[int], chunk_bytes: int, pinned: bool) -> int:
    """Bytes the chunks of :func:`chunk_groups` take, pinned rounding included (see ``memory.pinned_cost``)."""
    return sum(pinned_cost(sum(nbytes[i] for i in chunk), pinned)
               for chunk in chunk_groups(nbytes, chunk_bytes, pinned))


def device_margin(total_bytes: int) -> int:
    """Accelerator memory ``cache_device: auto`` never takes: max(10% of total, 2 GiB), for what the
    peak-reserved measurement cannot see (CUDA context, NCCL communicator buffers, fragmentation,
    later growth)."""
    return max(total_bytes // 10, 2 * GiB)


def auto_device_headroom(total_bytes: int, peak_reserved_bytes: int) -> int:
    """``cache_device: auto``: accelerator bytes the cache may take once a complete step was measured:
    total minus the allocator's peak *reserved* memory (allocated + cached + fragmentation) minus
    :func:`device_margin`."""
    return max(0, total_bytes - peak_reserved_bytes - device_margin(total_bytes))


def measured_device_headroom(total_bytes: int, peak_reserved_bytes: int, reserved_bytes: int,
                             available_bytes: int) -> int:
    """The accelerator bytes a cache may take after a measured step: :func:`auto_device_headroom`, less the
    memory in use outside the caching allocator (``total - available - reserved`` now: the CUDA context,
    NCCL's communicator buffers, other processes), which the allocator's peak cannot see."""
    outside = max(0, total_bytes - available_bytes - reserved_bytes)
    return max(0, auto_device_headroom(total_bytes, peak_reserved_bytes) - outside)


def node_resident_bytes(rss_by_rank: list[int], node_of_rank: list[str] | tuple[str, ...], node: str) -> int:
    """Resident memory of every rank on ``node`` (SLURM's limit is per node and reports no usage)."""
    return sum(rss for rss, n in zip(rss_by_rank, node_of_rank) if n == node)
