#!/usr/bin/env bash
# Check one DeepSpeed release: build .venv-ds-VERSION from scratch and run the release smoke subset
# (tests/test_release_smoke.py) on 2 nodes x 2 gloo ranks.
# Usage: bash scripts/check_deepspeed_release.sh VERSION [pytest args...]    e.g. 0.17.6
# Env: FCDP_KEEP_VENV=1 reuses a .venv-ds-VERSION that an earlier run finished (its .fcdp-ready marker)
#      instead of rebuilding it; FCDP_PREPARE_ONLY=1 stops once the venv and the shm op are ready (.ci/run
#      prepares the release venvs this way in the background while the main suite runs).
#
# [Note: torch from the suite's venv] Where the main suite's .venv exists with the pinned torch (CI runs
# scripts/test.sh first), the release venv sees it through a .pth path line instead of installing torch
# again (~20 s of unpacking per release): the same torch==2.13.0, and the release's own DeepSpeed (and
# whatever else it needs in other versions) installed into the release venv, ahead of the suite's on
# sys.path. pip installs only what the suite's venv does not already satisfy, as it would into a user's
# environment. Without a usable .venv it installs torch itself, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: check_deepspeed_release.sh VERSION [pytest args...]}"
shift
venv=".venv-ds-$version"
start=$SECONDS
ready="$venv/.fcdp-ready"
if [[ "${FCDP_KEEP_VENV:-0}" != 1 || ! -e "$ready" ]]; then
    rm -rf "$venv"
    py="$venv/bin/python"
    pip_q() { nice -n 5 "$py" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
    suite_site=""
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '2.13.0')" 2>/dev/null; then
        suite_site="$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    fi
    if [[ -n "$suite_site" ]]; then
        python3 -m venv --without-pip "$venv"
        "$py" -c "import sysconfig, sys; open(sysconfig.get_paths()['purelib'] + '/_suite_env.pth', 'w').write(sys.argv[1] + '\n')" "$suite_site"
        echo "torch (and pip, pytest) from the suite's venv: $suite_site"
    else
        python3 -m venv "$venv"
        # torch first, exactly pinned: this pin is a CPU build from local disk; a looser spec pulls CUDA.
        pip_q "torch==2.13.0"
    fi
    # The constraint keeps this DeepSpeed (and torch) when pip resolves the rest.
    constraints="$venv/constraints.txt"
    printf 'deepspeed==%s\ntorch==2.13.0\n' "$version" > "$constraints"
    pip_q -c "$constraints" "deepspeed==$version" "pytest>=8" pytest-timeout
fi
py="$venv/bin/python"
if [[ "${FCDP_PREPARE_ONLY:-0}" != 1 ]]; then
    # This package without its deepspeed pin (editable: the startup hook's .pth goes into site-packages).
    # [Note: not while preparing] Not in a background preparation: the editable build writes its metadata into
    # the source tree, where the main suite may be building the sdist at the same time.
    "$py" -m pip install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
fi
"$py" -c "import deepspeed, torch; assert deepspeed.__version__.split('+')[0] == '$version', deepspeed.__version__; \
print('deepspeed', deepspeed.__version__, '| torch', torch.__version__)"
echo "venv ready in $((SECONDS - start)) s"
export DS_ACCELERATOR=cpu
# DeepSpeed JIT-builds its CPU shm comm op at init_distributed: build it once here, in this venv (see test.sh).
export TORCH_EXTENSIONS_DIR="$PWD/$venv/torch_extensions"
# A build killed earlier (timeout, Ctrl-C) leaves its file lock behind and every later build waits on it
# forever; nothing else builds into this venv's folder, so a lock here is always stale.
find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null || true
# [Note: ~1 min on an idle 2-core machine; under heavy load 15 min were not enough, and a killed build
# leaves its lock, so remove it again after a failure.]
if ! timeout 1800 nice -n 5 "$py" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null 2>&1; then
    echo "warning: prebuilding DeepSpeed's shm_comm op failed; the first distributed test will build it" >&2
    find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null || true
fi
echo "shm op ready at $((SECONDS - start)) s"
touch "$ready"
if [[ "${FCDP_PREPARE_ONLY:-0}" == 1 ]]; then
    exit 0
fi
smoke=$SECONDS
FCDP_TESTS=full PYTHONPATH="$PWD" "$py" -m pytest -ra -q -p no:cacheprovider tests/test_release_smoke.py "$@"
echo "deepspeed $version: smoke $((SECONDS - smoke)) s, total $((SECONDS - start)) s"
