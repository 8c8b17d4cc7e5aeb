#!/usr/bin/env bash
# Set up and run the demo: a toy model trained with plain ZeRO-3 and with FCDP on 4 CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh ""  # no extras (and not the demo's arguments)
export DS_ACCELERATOR=cpu
# DeepSpeed JIT-builds its CPU comm op (shm_comm) at init_distributed: build it once here, single-process, in this
# venv (as scripts/test.sh does), so the demo's ranks do not sit silent behind the compiler. FCDP prints one line
# when the build is due (the first run); later runs load the built op at once.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
timeout 900 python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null \
    || echo "warning: prebuilding DeepSpeed's shm_comm op failed; the demo's first rank will build it" >&2
python -m fcdp_lab.demo "$@"
