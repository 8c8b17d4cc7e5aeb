#!/usr/bin/env bash
# Train a tiny GPT with a real Megatron-DeepSpeed checkout on the CPU, plain ZeRO-3 vs FCDP, and
# compare: losses, grad norms and final weights must be bit-identical (within 1e-5 with GRAD_MODES); FCDP must cut the
# inter-node all-gather bytes. 4 gloo ranks as 2 nodes x 2 ("ranks_per_node": 2), TP=1 and TP=2.
#
#   scripts/megatron_deepspeed_check.sh /path/to/Megatron-DeepSpeed
#   MEGATRON_DEEPSPEED_DIR=/path/to/Megatron-DeepSpeed scripts/megatron_deepspeed_check.sh
#
# What it does to the checkout: three small idempotent edits for CPU + DeepSpeed 0.19.8
# (`python scripts/megatron_deepspeed_check.py patch DIR --check` shows them; `git -C DIR diff`
# afterwards; `git -C DIR checkout megatron/` undoes them), and Megatron compiles its dataset
# helper (megatron/data/helpers*.so) as it always does. It pip-installs into $PYTHON's environment
# what Megatron imports and this venv lacks (pybind11, six, nltk; all from PyPI). Nothing is
# downloaded at run time: the data are random token ids run through Megatron's
# tools/preprocess_data.py with its NullTokenizer.
#
# Environment (all optional):
#   PYTHON      interpreter with torch, deepspeed and fcdp-deepspeed (default: .venv/bin/python)
#   WORKDIR     where data, configs, logs and results go (default: a new /tmp directory, kept)
#   TPS         tensor-parallel sizes to run (default "1 2")
#   LAUNCHERS   how the FCDP runs are launched, any of (default "run"):
#                 run        torchrun ... -m fcdp_deepspeed.run pretrain_gpt.py ...
#                 deepspeed  deepspeed --num_gpus 4 --module fcdp_deepspeed.run pretrain_gpt.py ...
#                 install    torchrun ... pretrain_gpt.py with an fcdp_deepspeed.install() line
#   ITERS       training iterations (default 10)
#   GLOBAL_BATCH global batch (default 8; micro-batch 2: at TP=1, DP=4 and no accumulation; at
#               TP=2, DP=2 and 2 accumulated micro-batches per step; GLOBAL_BATCH=4 TPS=2: none)
#   RELEASE     ZeRO-3 release regime: "large" (default; stage3_max_reuse_distance=0 and
#               stage3_prefetch_bucket_size=0, as a model larger than device memory behaves) or
#               "default" (DeepSpeed's defaults: this tiny model then stays gathered from forward
#               to backward, so there is no backward gather for FCDP to save)
#   RUN_TIMEOUT seconds per training run before its process group is killed (default 900)
#   GRAD_MODES  1 (default): per TP, one more FCDP run with "grad_accumulation": "node" (hierarchical
#               gradient reduction; not bit-identical: losses, grad norms and weights within 1e-5
#               relative of ZeRO-3, inter-node gradient bytes reported); 0: skip it. At TP=2 on
#               2 x 2 each node holds one rank of a DP group, so the modes fall back to flat (said once)
#   LAYERED     1 (default): at TP=1, one more FCDP run with "layered": 2, which must be refused by name at
#               the first training call (Megatron's GPT passes hidden states sequence-first, [Note: batch
#               first] in fcdp_deepspeed/layered/stack.py); 0: skip it
# Exit status 0 when every comparison passes.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MDS="${1:-${MEGATRON_DEEPSPEED_DIR:-}}"
if [[ -z "$MDS" ]]; then
    echo "usage: $0 MEGATRON_DEEPSPEED_DIR   (or set MEGATRON_DEEPSPEED_DIR)" >&2
    exit 2
fi
MDS="$(cd "$MDS" && pwd)"
if [[ ! -f "$MDS/pretrain_gpt.py" || ! -d "$MDS/megatron" ]]; then
    echo "$MDS is not a Megatron-DeepSpeed checkout (no pretrain_gpt.py / megatron/)" >&2
    exit 2
fi
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"
PYBIN="$(dirname "$PYTHON")"
WORKDIR="${WORKDIR:-$(mktemp -d /tmp/fcdp-megatron-XXXXXX)}"
TPS="${TPS:-1 2}"
GRAD_MODES="${GRAD_MODES:-1}"
LAYERED="${LAYERED:-1}"
LAUNCHERS="${LAUNCHERS:-run}"
ITERS="${ITERS:-10}"
RELEASE="${RELEASE:-large}"
RUN_TIMEOUT="${RUN_TIMEOUT:-900}"
NPROC=4
HELPER="$REPO/scripts/megatron_deepspeed_check.py"
PROBE="$REPO/scripts/megatron_probe.py"

# The CPU accelerator; Megatron's Makefile runs `python3 -m pybind11`, so $PYTHON's bin comes first.
export DS_ACCELERATOR=cpu PATH="$PYBIN:$PATH" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning,ignore::UserWarning}"
# DeepSpeed's CPU accelerator counts "devices" from LOCAL_SIZE (else NUMA nodes, here 1), and
# Megatron asserts local_rank == rank % device_count. The deepspeed launcher sets it; torchrun does not.
export LOCAL_SIZE="$NPROC"

t_start=$(date +%s)
section() { echo "== [$(($(date +%s) - t_start))s] $*"; }
mkdir -p "$WORKDIR"
section "Megatron-DeepSpeed: $MDS ($(git -C "$MDS" rev-parse HEAD 2>/dev/null || echo 'not a git checkout'))"
section "work dir: $WORKDIR"

section "Python dependencies of Megatron-DeepSpeed"
if ! "$PYTHON" -c "import pybind11, six, nltk" 2>/dev/null; then
    "$PYTHON" -m pip install -q pybind11 six nltk
fi
"$PYTHON" -c "import torch, deepspeed, fcdp_deepspeed; print('torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| fcdp-deepspeed', fcdp_deepspeed.__version__)"

# DeepSpeed JIT-builds a small CPU op (shm_comm) at init_distributed, under a file lock in
# TORCH_EXTENSIONS_DIR. The shared default (~/.cache/torch_extensions) is rebuilt by every venv
# with other flags, and a build killed midway leaves a lock every later job waits on forever;
# so build it here, single-process, in a directory of $PYTHON's venv (else of this run).
if [[ -z "${TORCH_EXTENSIONS_DIR:-}" ]]; then
    venv="$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')"
    TORCH_EXTENSIONS_DIR="${venv:-$WORKDIR}/torch_extensions"
fi
export TORCH_EXTENSIONS_DIR
section "DeepSpeed's CPU comm op (JIT build, once, into $TORCH_EXTENSIONS_DIR)"
if ! timeout 900 "$PYTHON" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
        >"$WORKDIR/op_build.log" 2>&1; then
    tail -20 "$WORKDIR/op_build.log"
    echo "building DeepSpeed's shm_comm op failed or passed 900 s; if a killed build left" \
         "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/lock behind, remove it" >&2
    exit 1
fi
grep -v -i warn "$WORKDIR/op_build.log" | tail -1

section "Compatibility edits (CPU, DeepSpeed 0.19.8)"
"$PYTHON" "$HELPER" patch "$MDS"

section "Megatron's dataset helper (C++, as Megatron builds it on rank 0)"
make -s -C "$MDS/megatron/data" >/dev/null

section "Synthetic data and DeepSpeed configs"
"$PYTHON" "$HELPER" data "$MDS" "$WORKDIR/data" >"$WORKDIR/data.log" 2>&1 || { tail -30 "$WORKDIR/data.log"; exit 1; }
MICRO=2
GLOBAL="${GLOBAL_BATCH:-8}"
"$PYTHON" "$HELPER" configs "$WORKDIR" --global-batch "$GLOBAL" --micro-batch "$MICRO" --ranks-per-node 2 \
    --release "$RELEASE"

MEGATRON_ARGS=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
    --micro-batch-size "$MICRO" --global-batch-size "$GLOBAL" --train-iters "$ITERS"
    --lr 1e-2 --lr-decay-style constant --seed 1234
    --tokenizer-type NullTokenizer --vocab-size 255
    --data-path "$WORKDIR/data/synthetic_text_document" --data-impl mmap --split 100,0,0
    --distributed-backend gloo --log-interval 1 --eval-iters 0 --eval-interval 1000
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion
    --deepspeed --zero-stage 3 --no-pipeline-parallel
)

# Each training run gets its own session; a signal to this script (or its end) takes it down too.
RUN_PGID=""
kill_run() {
    [[ -n "$RUN_PGID" ]] || return 0
    if kill -0 -- "-$RUN_PGID" 2>/dev/null; then
        kill -TERM -- "-$RUN_PGID" 2>/dev/null || true
        sleep 3
        kill -KILL -- "-$RUN_PGID" 2>/dev/null || true
    fi
    RUN_PGID=""
}
trap kill_run EXIT
trap 'kill_run; exit 143' TERM
trap 'kill_run; exit 130' INT

free_port() { "$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# run_one OUT_DIR LOG CMD...: run in its own session with a deadline; success = every rank wrote
# its result file (written after training; a gloo abort at interpreter exit is reported, not fatal).
run_one() {
    local out="$1" log="$2"
    shift 2
    rm -rf "$out"
    mkdir -p "$out"
    echo "   \$ $*"
    local t0 rc=0
    t0=$(date +%s)
    (cd "$MDS" && FCDP_MEGATRON_OUT="$out" exec setsid -w "$@") >"$log" 2>&1 &
    local pid=$!
    RUN_PGID=$pid
    while kill -0 "$pid" 2>/dev/null; do
        if (($(date +%s) - t0 > RUN_TIMEOUT)); then
            echo "   timed out after ${RUN_TIMEOUT}s; killing its process group"
            kill_run
            break
        fi
        sleep 1
    done
    wait "$pid" || rc=$?
    kill_run  # stragglers of a run that ended (a launcher that exited before its ranks)
    local n
    n=$(find "$out" -name 'rank*.json' | wc -l)
    if ((n != NPROC)); then
        echo "   FAILED (exit $rc, $n of $NPROC ranks wrote results); last lines of $log:"
        grep -v -e "Warning" -e "warnings.warn" "$log" | tail -40 | sed 's/^/   | /'
        return 1
    fi
    local note=""
    ((rc == 0)) || note=" (exit status $rc after all ranks wrote results; ignored)"
    echo "   done in $(($(date +%s) - t0))s$note; log: $log"
}

# run_refused LOG MESSAGE CMD...: a run that must stop with MESSAGE in its log (a refusal by name), no rank results.
run_refused() {
    local log="$1" message="$2"
    shift 2
    echo "   \$ $*"
    local t0 rc=0
    t0=$(date +%s)
    (cd "$MDS" && FCDP_MEGATRON_OUT="$WORKDIR/refused" exec setsid -w timeout "$RUN_TIMEOUT" "$@") >"$log" 2>&1 || rc=$?
    if ((rc != 0)) && grep -qF "$message" "$log"; then
        echo "   refused as expected in $(($(date +%s) - t0))s (exit $rc): $(grep -m1 -F "$message" "$log" | cut -c1-240)"
        return 0
    fi
    echo "   NOT REFUSED as expected (exit $rc, looked for: $message); last lines of $log:"
    grep -v -e "Warning" -e "warnings.warn" "$log" | tail -40 | sed 's/^/   | /'
    return 1
}

mkdir -p "$WORKDIR/logs"
failed=0
for tp in $TPS; do
    res="$WORKDIR/results/tp$tp"
    args=("${MEGATRON_ARGS[@]}" --tensor-model-parallel-size "$tp")
    section "TP=$tp: plain ZeRO-3"
    run_one "$res/zero3" "$WORKDIR/logs/tp${tp}_zero3.log" \
        "$PYBIN/torchrun" --nproc_per_node "$NPROC" --master_port "$(free_port)" \
        "$PROBE" pretrain_gpt.py "${args[@]}" --deepspeed_config "$WORKDIR/ds_zero3.json" || failed=1
    for launcher in $LAUNCHERS; do
        section "TP=$tp: FCDP via $launcher"
        case "$launcher" in
            run) cmd=("$PYBIN/torchrun" --nproc_per_node "$NPROC" --master_port "$(free_port)"
                      -m fcdp_deepspeed.run "$PROBE" pretrain_gpt.py) ;;
            deepspeed) cmd=("$PYBIN/deepspeed" --num_gpus "$NPROC" --master_port "$(free_port)"
                            --module fcdp_deepspeed.run "$PROBE" pretrain_gpt.py) ;;
            install) cmd=("$PYBIN/torchrun" --nproc_per_node "$NPROC" --master_port "$(free_port)"
                          "$PROBE" --install pretrain_gpt.py) ;;
            *) echo "unknown launcher $launcher (run, deepspeed, install)" >&2; exit 2 ;;
        esac
        run_one "$res/fcdp-$launcher" "$WORKDIR/logs/tp${tp}_fcdp-$launcher.log" \
            "${cmd[@]}" "${args[@]}" --deepspeed_config "$WORKDIR/ds_fcdp.json" || failed=1
    done
    if [[ "$GRAD_MODES" == 1 ]]; then
        section "TP=$tp: FCDP with grad_accumulation node (hierarchical reduction), via run"
        run_one "$res/fcdp_node-run" "$WORKDIR/logs/tp${tp}_fcdp_node-run.log" \
            "$PYBIN/torchrun" --nproc_per_node "$NPROC" --master_port "$(free_port)" -m fcdp_deepspeed.run \
            "$PROBE" pretrain_gpt.py "${args[@]}" --deepspeed_config "$WORKDIR/ds_fcdp_node.json" || failed=1
    fi
    if [[ "$LAYERED" == 1 && "$tp" == 1 ]]; then
        section "TP=$tp: FCDP with layered accumulation: refused (Megatron's GPT is sequence-first)"
        run_refused "$WORKDIR/logs/tp${tp}_fcdp_layered-run.log" \
            "first dimension is 64, more than the $MICRO examples of a micro-batch" \
            "$PYBIN/torchrun" --nproc_per_node "$NPROC" --master_port "$(free_port)" -m fcdp_deepspeed.run \
            "$PROBE" pretrain_gpt.py "${args[@]}" --deepspeed_config "$WORKDIR/ds_fcdp_layered.json" || failed=1
    fi
done

section "Comparison (FCDP vs plain ZeRO-3, per TP)"
expect=()
[[ "$RELEASE" == "large" ]] && expect=(--expect-saving)
"$PYTHON" "$HELPER" compare "$WORKDIR/results" "${expect[@]}" || failed=1
echo "== total time: $(($(date +%s) - t_start))s; results, logs and configs in $WORKDIR"
exit "$failed"
