#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs). `--fast` first: the fast tier for local iteration
# (FCDP_TESTS=fast: only the allow-list in tests/conftest.py, [Note: the fast tier]); other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--fast" ]]; then
    export FCDP_TESTS=fast
    shift
fi
source scripts/setup_env.sh test,hf,bench
export DS_ACCELERATOR=cpu
# DeepSpeed JIT-builds a small CPU comm op (shm_comm) at init_distributed, under a file lock. Build it
# once, single-process, in this venv (not the shared ~/.cache, where other venvs rebuild it and a killed
# build leaves a lock), so no distributed test spends its deadline compiling.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
timeout 900 python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null 2>&1 \
    || echo "warning: prebuilding DeepSpeed's shm_comm op failed; the first distributed test will build it" >&2
# .ci/run waits for this marker to prepare the release venvs in the background (they read torch from .venv)
touch .venv/.fcdp-setup-done
python -m pytest -ra "$@"
