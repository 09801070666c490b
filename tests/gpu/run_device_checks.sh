#!/usr/bin/env bash
# The GPU checks, in at most 8 minutes, on a machine with one or more NVIDIA GPUs: the device
# path (NCCL, CUDA IPC, the torch binding on it) against CPU references, the CUDA benchmarks,
# and Spark's GPU scheduling with a TorchEstimator fit on half a GPU per task. Ends in one
# table: each step, its verdict, its seconds and its last line.
#
# Run from the repository root on the GPU machine:   bash tests/gpu/run_device_checks.sh
# Needs a Python with torch (CUDA), cupy (cupy-cuda12x or cupy-cuda13x, with NCCL: the
# nvidia-nccl wheel of the same CUDA), numpy, cloudpickle, ml-dtypes, pyarrow and pytest;
# the Spark step also needs pyspark and Java (without them it is reported NOT RUN).
# hvd_spark itself runs from the checkout (PYTHONPATH, absolute: Spark's executors run
# elsewhere). PYTHON picks the interpreter. Everything it prints also lands in $OUT (when
# set) as device_checks.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/device_checks.log
: > "$log"
rows=()
failed=0
# Caps per step (seconds) keep the whole run under 8 minutes.
step() {  # step NAME CAP COMMAND...: run it, capped, and add its row to the table
    local name=$1 cap=$2 start=$SECONDS rc last verdict out
    shift 2
    echo "=== $name (at most ${cap} s)" | tee -a "$log"
    out=$(mktemp)
    timeout "$cap" "$@" 2>&1 | tee -a "$log" "$out"
    rc=${PIPESTATUS[0]}
    last=$(grep -v '^\s*$' "$out" | tail -n 1 | cut -c1-110)
    rm -f "$out"
    case $rc in
        0) verdict=ok ;;
        124) verdict=TIMEOUT; failed=1 ;;
        *) verdict="FAILED($rc)"; failed=1 ;;
    esac
    rows+=("$(printf '%-34s %-10s %5d  %s' "$name" "$verdict" $((SECONDS - start)) "$last")")
}

step "what is here" 30 "$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
try:
    import cupy
    from cupy.cuda import nccl
    print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount(),
          "nccl", nccl.get_version())
except Exception as exc:  # a GPU machine without cupy/NCCL fails the tests below: say why
    print("cupy/NCCL NOT usable:", repr(exc))
import hvd_spark.collectives as hvd
print("hvd_spark nccl_built", hvd.nccl_built(), "cuda_built", hvd.cuda_built())
PY

step "GPU tests (tests/gpu)" 180 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout=120 tests/gpu

step "bench allreduce --device cuda" 80 "$PY" -m hvd_spark.bench allreduce --device cuda -np 2 \
    --sizes 1M,16M,64M --budget-mb 512

step "bench torch --device cuda" 50 "$PY" -m hvd_spark.bench torch --device cuda

if "$PY" -c "import pyspark" 2>/dev/null && command -v java >/dev/null; then
    step "Spark GPUs: run + TorchEstimator" 130 "$PY" tests/gpu/spark_gpu_check.py
else
    rows+=("$(printf '%-34s %-10s %5s  %s' "Spark GPUs: run + TorchEstimator" "NOT RUN" "-" \
        "needs pyspark and java on this machine")")
    failed=1
fi

{
    echo
    printf '%-34s %-10s %5s  %s\n' "step" "verdict" "s" "last line"
    printf '%s\n' "${rows[@]}"
    echo "total $SECONDS s: $([ $failed = 0 ] && echo all passed || echo SOME FAILED OR NOT RUN)"
} | tee -a "$log"
exit $failed
