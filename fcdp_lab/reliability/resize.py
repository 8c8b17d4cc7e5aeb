"""Jobs of ``examples/train_elastic.py`` on local ranks, and resuming them at another world size.

What a user does to change the world size, step by step: the job saves ZeRO-3 checkpoints (here at 2
nodes x 2); DeepSpeed's tool converts one into a universal checkpoint,

    python -m deepspeed.checkpoint.ds_to_universal --input_folder D/global_step4 --output_folder D/global_step4_universal

(which also writes ``D/latest_universal``), and the same script started at the new size with
``"checkpoint": {"load_universal": true}`` in its config resumes from it. Layouts are simulated on one
machine: ``fcdp.ranks_per_node`` sets the node layout FCDP uses (:func:`config`), ranks are forked by
:func:`~fcdp_lab.harness.launch.run_local` (:func:`run_script`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from fcdp_lab.harness.launch import run_local

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_elastic.py"
#: ``exact``: FCDP with ZeRO-3's gradient path (bit-identical); ``defaults``: the fcdp block as users write
#: it (hierarchical reduction, node accumulation where it applies); ``plain``: DeepSpeed's ZeRO-3.
MODES = ("exact", "defaults", "plain")
EXACT_GRADS = {"grad_reduce": "flat", "grad_accumulation": "rank"}
#: The gradient defaults' documented tolerance against ZeRO-3 (docs/how-it-works.md), relative.
DEFAULTS_RTOL = 1e-5


def config(mode: str, ranks_per_node: Optional[int] = None, universal: bool = False) -> dict:
    """``configs/toy_fcdp.json`` in one of :data:`MODES`; ``ranks_per_node`` None: from the launcher."""
    text = (ROOT / "configs" / "toy_fcdp.json").read_text()
    cfg = json.loads("\n".join(line.split("//")[0] for line in text.splitlines()))
    if mode == "plain":
        cfg.pop("fcdp")
    else:
        cfg["fcdp"] = {"enabled": True, **(EXACT_GRADS if mode == "exact" else {}),
                       **({"ranks_per_node": ranks_per_node} if ranks_per_node else {})}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg, indent=1))
    return path


def script_argv(cfg: Path, save_dir: Path, steps: int, save_interval: int, metrics: Path) -> list[str]:
    return [str(SCRIPT), "--deepspeed_config", str(cfg), "--save_dir", str(save_dir), "--steps", str(steps),
            "--save_interval", str(save_interval), "--metrics", str(metrics)]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_script(argv: list[str], world: int, timeout: float = 600) -> None:
    """The script on ``world`` local ranks (rank 0's metrics go where ``argv`` says)."""
    run_local("fcdp_lab.harness.script_rank:run", world, {"script": argv[0], "argv": argv[1:]}, timeout=timeout)


def convert(save_dir: Path, tag: str, timeout: float = 600) -> str:
    """DeepSpeed's universal checkpoint tool on ``save_dir/tag``; returns the universal tag."""
    out = f"{tag}_universal"
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(save_dir / tag),
           "--output_folder", str(save_dir / out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu")))
    if res.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed ({res.returncode}):\n{(res.stdout + res.stderr)[-4000:]}")
    return out


def universal_copy(save_dir: Path, universal_tag: str, dest: Path) -> Path:
    """A fresh save directory holding only the universal checkpoint and ``latest_universal``, for one resume
    (each resume writes its own checkpoints and ``latest`` there)."""
    dest.mkdir(parents=True)
    shutil.copytree(save_dir / universal_tag, dest / universal_tag)
    (dest / "latest_universal").write_text(universal_tag)
    return dest


def fp32_weights(save_dir: Path, tag: Optional[str] = None) -> dict:
    """The fp32 master weights of a ZeRO checkpoint (DeepSpeed's ``zero_to_fp32``)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return dict(get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag))


def universal_fp32(save_dir: Path, universal_tag: str) -> dict:
    """The fp32 weights of a universal checkpoint, flattened (``zero/<name>/fp32.pt``)."""
    import torch
    zero = save_dir / universal_tag / "zero"
    return {p.parent.name: torch.load(p, map_location="cpu", weights_only=False).reshape(-1)
            for p in sorted(zero.glob("*/fp32.pt"))}


def optimizer_states(save_dir: Path, tag: str) -> list[dict]:
    """Every rank's fp32 partition and Adam moments, as saved (same world size only)."""
    import torch
    out = []
    for path in sorted((save_dir / tag).glob("*_optim_states.pt")):
        sd = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        out.append({"fp32": sd["fp32_flat_groups"], "state": sd["optimizer_state_dict"]["state"]})
    return out


def optimizer_keys(save_dir: Path, tag: str) -> list[str]:
    """The top-level keys of rank 0's ZeRO optimizer state, as saved."""
    import torch
    path = next(iter(sorted((save_dir / tag).glob("*_optim_states.pt"))))
    return sorted(torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"])


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest relative norm difference over the tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k] - b[k]).norm() / max(b[k].norm(), 1e-12)).item() for k in b)


def bitwise_equal(a: dict, b: dict) -> bool:
    import torch
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

