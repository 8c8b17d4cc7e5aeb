#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test,hf,bench
export DS_ACCELERATOR=cpu
python -m pytest -ra "$@"
