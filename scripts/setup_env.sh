#!/usr/bin/env bash
# Create .venv (if missing) and install fcdp-deepspeed with the given extras, with the exact releases of
# constraints.txt (the package itself declares ranges: pyproject.toml).
# Usage: source scripts/setup_env.sh [extras]     e.g. source scripts/setup_env.sh test,hf
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"
python3 -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch first, exactly pinned (constraints.txt): this pin is a CPU build on the project's machines, where
# a looser spec resolved on its own pulls a CUDA build.
python -m pip install -q -c constraints.txt torch 2>&1 | grep -v "^WARNING: Location" || true
python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}" 2>&1 | grep -v "^WARNING: Location" || true
# The lab (fcdp_lab/: harness, bench, fuzz, ... ; not in the wheel) on this venv's path, for every process of it:
# tests, scripts and the rank processes they start.
python - <<'PY'
import os, site, sysconfig
with open(os.path.join(sysconfig.get_paths()["purelib"], "fcdp_lab.pth"), "w") as f:
    f.write(os.getcwd() + "\nimport fcdp_lab.startup\n")
PY
python -c "import fcdp_deepspeed, deepspeed, torch; print('fcdp-deepspeed', fcdp_deepspeed.__version__, '| deepspeed', deepspeed.__version__, '| torch', torch.__version__)"
