#!/usr/bin/env bash
# Build .whl/ (git-ignored): the offline wheelhouse the GPU device command installs (scripts/gpu_run.sh) into a bare
# image that has Python 3.12 and torch (CUDA) but no deepspeed, hjson or pydantic, and no network. See docs/gpu.md.
#   bash scripts/gpu_bundle.sh            # FCDP_BUNDLE_PYTHON: a Python with torch and setuptools (default .venv's)
# - DeepSpeed 0.19.8 has only an sdist on PyPI: built here into a pure-Python wheel with DS_BUILD_OPS=0 (every op
#   JIT-compiled on first use; the check uses torch's Adam, so none is built there).
# - Its requirements and this package's (pydantic, hjson, psutil, py-cpuinfo; einops, msgpack, ninja, packaging,
#   tqdm), cp312 manylinux binaries, at the versions this repository's .venv runs.
# - numpy goes to .whl/optional/: torch's image normally has it; gpu_run.sh installs it only where `import numpy` fails.
# - This package's own wheel (gpu_run.sh installs it, though gpu_check.py runs the working tree's code first on sys.path).
# Total at most 40 MiB (checked at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
py="${FCDP_BUNDLE_PYTHON:-.venv/bin/python}"
if [[ ! -x "$py" ]]; then
    echo "gpu_bundle: no $py: run 'source scripts/setup_env.sh test,hf,bench' first (it creates .venv), or set FCDP_BUNDLE_PYTHON" >&2
    exit 2
fi
rm -rf "$out"
mkdir -p "$out/optional"
dl() {
    nice -n 19 "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@" 2>&1 \
        | grep -v "^WARNING: Location" || true
}
# One line per wheel: NAME==VERSION (the .venv's, where it is the suite's).
pins=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-extensions==4.16.0
      typing-inspection==0.4.5 py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.2 ninja==1.13.2 psutil==7.2.2
      packaging==26.4 tqdm==4.70.1)
for pin in "${pins[@]}"; do dl -d "$out" "$pin"; done
dl -d "$out/optional" numpy==2.4.6
# DeepSpeed: sdist -> pure-Python wheel, no ops compiled (DS_BUILD_OPS=0), no build isolation (its setup.py imports torch).
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu nice -n 19 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" \
    deepspeed==0.19.8 2>&1 | grep -v "^WARNING: Location" || true
nice -n 19 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" . 2>&1 | grep -v "^WARNING: Location" || true
rm -rf build  # setuptools' build folder of this package
n=$(ls "$out"/*.whl | wc -l)
[[ "$n" -eq $(( ${#pins[@]} + 2 )) ]] || { echo "gpu_bundle: expected $(( ${#pins[@]} + 2 )) wheels, got $n" >&2; ls "$out" >&2; exit 1; }
ls "$out"/deepspeed-0.19.8-*.whl >/dev/null
size=$(du -sb "$out" | cut -f1)
(( size <= 40 * 2**20 )) || { echo "gpu_bundle: $out is $size bytes, over 40 MiB" >&2; exit 1; }
echo "gpu_bundle: $n wheels (+ optional numpy) in $out, $((size / 2**20)) MiB"
