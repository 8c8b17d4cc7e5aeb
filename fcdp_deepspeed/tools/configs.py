"""``fcdp configs``: the shipped DeepSpeed configs and example scripts, where they are, and a copy to start from.

    fcdp configs                       # every shipped config and example, with its path
    fcdp configs toy_fcdp.json         # copy one into the current folder (or: --to DIR)

A wheel holds them in ``fcdp_deepspeed/shipped/`` (setup.py copies ``configs/`` and ``examples/`` there); a
checkout or an editable install reads them from the checkout's ``configs/`` and ``examples/``.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional

from fcdp_deepspeed.tools import args as checks

FOLDERS = {"configs": ".json", "examples": ".py"}


def shipped_root() -> Path:
    """The folder holding ``configs/`` and ``examples/``: the installed package's, else the checkout's."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "shipped"
    return installed if (installed / "configs").is_dir() else package.parent


def shipped_files() -> dict[str, Path]:
    """File name -> path of every shipped config and example."""
    root = shipped_root()
    return {p.name: p for folder, suffix in FOLDERS.items() for p in sorted((root / folder).glob(f"*{suffix}"))}


def main(argv: Optional[list[str]] = None) -> int:
    ap = checks.parser("fcdp configs", __doc__)
    ap.add_argument("name", nargs="?", help="a shipped config or example to copy (e.g. toy_fcdp.json)")
    ap.add_argument("--to", default=".", help="folder to copy it into")
    args = ap.parse_args(argv)
    files = shipped_files()
    if not files:
        print(f"fcdp configs: no shipped configs under {shipped_root()} (a broken install?)", file=sys.stderr)
        return 1
    if args.name is None:
        for name, path in files.items():
            print(f"{path.parent.name + '/' + name:<32} {path}")
        return 0
    if args.name not in files:
        from fcdp_deepspeed.config.errors import did_you_mean
        print(f"fcdp configs: no shipped file {args.name!r}{did_you_mean(args.name, files)}; "
              f"shipped: {', '.join(files)}", file=sys.stderr)
        return 2
    dest = Path(args.to) / args.name
    if dest.exists():
        print(f"fcdp configs: {dest} exists; not overwritten (remove it or pass --to DIR)", file=sys.stderr)
        return 1
    Path(args.to).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(files[args.name], dest)
    print(f"copied {files[args.name]} to {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
