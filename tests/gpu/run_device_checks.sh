#!/usr/bin/env bash
# The GPU checks of the device path (NCCL, CUDA IPC, the torch binding on it) and the CUDA
# benchmarks, in a few minutes, on a machine with a CUDA GPU.
#
# Run from the repository root on the GPU machine:   bash tests/gpu/run_device_checks.sh
# Needs a Python with torch (CUDA), cupy (cupy-cuda12x or cupy-cuda13x, with NCCL: the
# nvidia-nccl wheel of the same CUDA), numpy, cloudpickle, ml-dtypes, pyarrow and pytest;
# hvd_spark itself runs from the checkout (PYTHONPATH=.). PYTHON picks the interpreter.
# Everything it prints also lands in $OUT (when set) as device_checks.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/device_checks.log
: > "$log"
step() { echo "=== $*" | tee -a "$log"; }
run() { "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }

step "what is here"
run "$PY" - <<'PY'
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

failed=0
step "GPU tests (tests/gpu)"
run timeout 420 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout=180 tests/gpu || failed=1

step "bench allreduce --device cuda (2 ranks on GPU 0 through CUDA IPC, or NCCL with 2+ GPUs)"
run timeout 240 "$PY" -m hvd_spark.bench allreduce --device cuda -np 2 --sizes 1M,16M,64M \
    --budget-mb 512 || failed=1

step "bench torch --device cuda (DistributedOptimizer on the device path vs DDP)"
run timeout 240 "$PY" -m hvd_spark.bench torch --device cuda || failed=1

step "done: $([ $failed = 0 ] && echo all passed || echo SOME FAILED)"
exit $failed
