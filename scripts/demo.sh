#!/usr/bin/env bash
# Set up and run the demo: a toy model trained with plain ZeRO-3 and with FCDP on 4 CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh ""  # no extras (and not the demo's arguments)
export DS_ACCELERATOR=cpu
python -m fcdp_lab.demo "$@"
