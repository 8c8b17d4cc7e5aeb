#!/usr/bin/env bash
# The one command of the GPU check on the device machine (docs/gpu.md):
#   bash scripts/gpu_run.sh OUTDIR [gpu_check.py options]   # run tool: carry [".whl"], command "bash scripts/gpu_run.sh $OUT/gpu"
#   (a rerun of some cases: bash scripts/gpu_run.sh $OUT/gpu --cases bd)
# Installs the offline wheelhouse built by scripts/gpu_bundle.sh into /tmp/site (no network, no index), puts it
# on PYTHONPATH, runs scripts/gpu_check.py within a time budget, and writes into OUTDIR: gpu_check.json, the
# check's log, the environment it saw (env.txt) and the install log. At most 8 minutes in all (the check's own
# case deadlines sum to under 7; FCDP_GPU_BUDGET_S caps the whole check, default 450 s).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_run.sh OUTDIR}"
mkdir -p "$out"
site=/tmp/site
py="${FCDP_GPU_PYTHON:-python3}"
budget="${FCDP_GPU_BUDGET_S:-450}"
start=$SECONDS
{
    echo "date: $(date -u +%FT%TZ)"; echo "python: $($py -V 2>&1)"; nvidia-smi -L 2>&1 | head -8
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" 2>&1
} > "$out/env.txt"
ls .whl/*.whl > /dev/null 2>&1 || { echo "gpu_run: no .whl/ here (build it with scripts/gpu_bundle.sh, carry .whl)" | tee -a "$out/env.txt" >&2; exit 3; }
rm -rf "$site"
extra=()
$py -c "import numpy" 2>/dev/null || extra=(.whl/optional/*.whl)  # torch images normally ship numpy
$py -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl "${extra[@]}" > "$out/install.log" 2>&1
rc=$?
echo "install rc=$rc (numpy from the bundle: ${#extra[@]}) in $((SECONDS - start)) s" >> "$out/env.txt"
[[ $rc -eq 0 ]] || { tail -20 "$out/install.log" >&2; exit 3; }
# The working tree first: the check and every rank it starts run this checkout's code, not a wheel built earlier.
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
# DeepSpeed JIT-builds ops into this folder if anything asks for one (the check uses torch's Adam: nothing should).
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions PYTHONUNBUFFERED=1
$py -c "import deepspeed, fcdp_deepspeed, pydantic, hjson; print('deepspeed', deepspeed.__version__, '| fcdp', fcdp_deepspeed.__version__, fcdp_deepspeed.__file__, '| accelerator', deepspeed.get_accelerator().device_name())" >> "$out/env.txt" 2>&1
timeout -k 10 "$budget" $py scripts/gpu_check.py --json "$out/gpu_check.json" "${@:2}" > "$out/gpu_check.log" 2>&1
rc=$?
echo "gpu_check rc=$rc in $((SECONDS - start)) s (budget ${budget} s; 124: timed out)" | tee -a "$out/env.txt"
tail -40 "$out/gpu_check.log"
exit $rc
