#!/usr/bin/env bash
# Everything of issue #27 that needs a GPU machine, in one run of at most BUDGET seconds (580 by
# default, inside one 10-minute call of the device tool), each phase in priority order under a
# timeout cut to what is left:
#
#   tests     pytest -m gpu over every package (4 xdist workers when pytest-xdist is there)
#   demo      examples/train_gpt.py under torchrun, one rank per GPU (NCCL)
#   gpu_step  bench/bench_gpu_step.py: ZeRO-3 step of a Llama-shaped model, zengine against FSDP2
#             and DeepSpeed, and offload_states
#   zoffload  bench/bench_zoffload.py: pinned offload/reload GB/s against one torch copy
#   pipe      bench/bench_pipe.py on the CPU cores (CUDA hidden): 4 stages x 16 micro-batches
#
# Usage, from the repository root: bash bench/gpu_check.sh [PHASE ...] (all by default).
# Logs and summary.txt go to $OUT (the device tool's folder) or /tmp/gpu_check. Without a GPU
# the GPU tests skip and bench_gpu_step measures nothing: a dry run of the script itself.
#
# The machine's Python must hold torch (and, for the compatibility tests, Transformers,
# Accelerate and PEFT); what it lacks travels as wheels in .whl/ (installed into /tmp/site,
# first on the path), and the real DeepSpeed, a peer of bench_gpu_step, in .whl/peers/
# (installed into /tmp/peers, put on that bench's DeepSpeed worker's path alone, since
# zstack's compatibility `deepspeed` is on everyone else's). Make them with
# bench/gpu_wheels.sh.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
BUDGET=${BUDGET:-580}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
START=$(date +%s)
PHASES=("$@")
[ ${#PHASES[@]} -eq 0 ] && PHASES=(tests demo gpu_step zoffload pipe)

install() {  # install() FOLDER TARGET: the wheels in FOLDER into TARGET
    ls "$1"/*.whl >/dev/null 2>&1 || return 0
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$2" "$1"/*.whl
}

phase() {  # phase NAME LIMIT COMMAND...: run under the smaller of LIMIT and what is left
    local name=$1 limit=$2 left began rc
    shift 2
    left=$((BUDGET - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        echo "$name: not run, the budget is spent" | tee -a "$OUT/summary.txt"
        return
    fi
    began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - began)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tail -1
    echo "cores: $(nproc)"
} >"$OUT/summary.txt"
install .whl /tmp/site || { echo "installing .whl failed" | tee -a "$OUT/summary.txt"; exit 1; }
install .whl/peers /tmp/peers || echo "installing .whl/peers failed" | tee -a "$OUT/summary.txt"

SOURCES=$(ls -d "$PWD"/packages/z*/src | tr '\n' ':')  # zstack without the compatibility package
COMPAT=$PWD/packages/deepspeed-compat/src
export PYTHONPATH=/tmp/site:$SOURCES$COMPAT PYTHONUNBUFFERED=1 ZSTACK_DEEPSPEED_PATH=/tmp/peers

{
    "$PY" - <<'EOF' 2>&1
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("cupy", "transformers", "accelerate", "peft", "pydantic", "deepspeed"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, "missing:", error)
EOF
    PYTHONPATH=/tmp/peers:/tmp/site "$PY" -c "import deepspeed; print('peer: deepspeed', deepspeed.__version__)" 2>&1 | tail -1
} >>"$OUT/summary.txt"

xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4)
for name in "${PHASES[@]}"; do
    case $name in
    tests) phase tests 260 "$PY" -m pytest packages/*/tests -m gpu -q -p no:cacheprovider \
        "${xdist[@]}" --continue-on-collection-errors --junitxml="$OUT/tests.xml" ;;
    demo) phase demo 60 "$PY" -m torch.distributed.run --nproc-per-node=1 \
        examples/train_gpt.py ;;
    gpu_step) phase gpu_step 260 env PYTHONPATH="/tmp/site:$SOURCES" \
        "$PY" bench/bench_gpu_step.py --logs /tmp/gpu_step_logs ;;
    zoffload) phase zoffload 90 env ZOFFLOAD_BENCH_MB=256 "$PY" bench/bench_zoffload.py ;;
    pipe) phase pipe 90 env CUDA_VISIBLE_DEVICES= ZCOMM_ACCELERATOR=cpu "$PY" bench/bench_pipe.py ;;
    *) echo "unknown phase $name (tests, demo, gpu_step, zoffload, pipe)" | tee -a "$OUT/summary.txt" ;;
    esac
done
# the benchmark's workers' logs, for a contender that failed
tail -n 40 /tmp/gpu_step_logs/*.log >"$OUT/gpu_step_workers.log" 2>/dev/null
echo "whole run: $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
