#!/usr/bin/env bash
# Restarts and resizes (docs/reliability.md): random SIGKILLs of a node's ranks under torchrun's elastic agent
# on the emulated cluster (needs root: network namespaces), then universal-checkpoint resumes at 1x2, 2x1 and
# 4x2. Updates docs/results/reliability/restarts.json and the figures table of docs/reliability.md.
# Usage: bash scripts/reliability.sh [--kills N] [--seed S] [--failure-modes] [--no-resizes]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test
export DS_ACCELERATOR=cpu
# The shm_comm op once, in this venv (see scripts/test.sh): a rank killed while building it leaves a lock behind.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
timeout 900 python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null 2>&1 || true
python -m fcdp_lab.reliability "$@"
