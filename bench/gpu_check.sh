#!/usr/bin/env bash
# The GPU check: one prepared command for a machine with a CUDA GPU and a Python that already has
# torch, jax[cuda], flax, safetensors, tokenizers, ml_dtypes and transformers (the lent H200 image
# has them all). Installs nothing, except flax from ./.whl when the image's flax cannot run
# jaxmodel (the smoke test). Runs from the repository root:
#
#     bash bench/gpu_check.sh [OUT_DIR] [--dry-run]
#
# Sized for a lease of 15 device minutes, start included: about 8 minutes at most with a cold
# compilation cache. Every step has its own time limit (bench/gpu_check.py's LIMITS: a step that
# hangs costs only itself) and its JSON is written as it ends:
#
# 0. the GPU, versions and a smoke test (a tiny checkpoint through both models at fp64);
# then bench/gpu_check.py (its docstring says more), each step in a process of its own:
#    environment  the versions, the run's environment and the settings that decide a GPU's
#                 numbers (compare.environment.determinism_settings);
#    invariant    the invariant mode (the plan's portable path on a GPU) bitwise or not: one
#                 target alone vs batches of 1..32 at the first, middle and last row, padded left
#                 and right, the first decode step; torchref and jaxmodel, bf16;
#    default      the same cases in the default mode (its batch variance) and its run-to-run
#                 check, with the determinism settings that were on;
#    cost         prefill and decode, invariant vs default mode;
#    device       CPU vs GPU: the same model and policy on both, judged against the float64 twin,
#                 and `probe where --circumstance device` (torchref: the first tap where they part);
#    roofline     bf16 prefill 2048 and decode at Llama-3.2-1B's shape against the GPU's peaks;
#    sharding     jaxmodel on one GPU vs tensor parallel over every GPU there is (a multi-GPU host
#                 runs TP unchanged; one GPU: one device, said so).
# GPU_CHECK_STEPS="invariant cost" runs those steps only (and "agreement": fp64/fp32/tf32/bf16
# agreement vs an fp64 oracle, not in the default list).
#
# --dry-run (or GPU_CHECK_DRY_RUN=1): the whole command on the CPU, a tiny checkpoint, small
# batches, the portable path forced (LLAMA_PARITY_INVARIANT=portable), CUDA hidden; the JSON has
# the same sections and keys (tests/test_gpu_check.py runs it).
# Results: OUT_DIR/gpu_check.json (every section, the summary table's rows), log.txt, and the
# benchmarks' own roofline.json, sharding.json, where-device.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="bench/results/gpu-check"
DRY="${GPU_CHECK_DRY_RUN:-0}"
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        *) OUT="$arg" ;;
    esac
done
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX must not grab 75% of GPU memory up front: torch runs in the same processes.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$DRY" = 1 ]; then
    export GPU_CHECK_DRY_RUN=1 JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES="" LLAMA_PARITY_INVARIANT=portable
fi
LOG="$OUT/log.txt"
step() { echo "== $(date +%T) step $*" | tee -a "$LOG"; }
run() {  # run LIMIT_S CMD...: one step under its own limit, its output in the log
    local limit=$1; shift
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "!! timed out after ${limit} s: $*" | tee -a "$LOG"
    return "$rc"
}

step "0: the GPU, versions and smoke test"
if [ "$DRY" = 1 ]; then
    echo "dry run: on the CPU (CUDA hidden)" | tee -a "$LOG"
else
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
fi
SMOKE='
import tempfile, numpy as np, torch, jaxmodel, torchref, jax
from llamaspec.testing import make_checkpoint
from compare.metrics import rel_l2
from bench.gpu_check import cuda_settings_for
folder = make_checkpoint(tempfile.mkdtemp() + "/tiny", seed=0)
ids = np.random.default_rng(0).integers(3, 90, (2, 16))
dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cuda":   # torchref checks the torch CUDA matmul settings and never sets them: this process does
    cuda_settings_for(torch, "fp64")
a = np.asarray(torchref.from_pretrained(folder, policy="fp64", device=dev)(ids).cpu())
b = np.asarray(jaxmodel.from_pretrained(folder, policy="fp64")(ids), np.float64)
print("smoke: tiny checkpoint, fp64, torchref on", dev, "vs jaxmodel on", jax.default_backend(), ": rel_l2", rel_l2(a, b))
assert rel_l2(a, b) < 1e-12
'
if ! run 60 "$PY" -c "$SMOKE"; then
    if ls .whl/flax-*.whl >/dev/null 2>&1; then
        echo "smoke test failed: retrying with the carried flax" | tee -a "$LOG"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flax-*.whl
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
        run 60 "$PY" -c "$SMOKE" || echo "!! smoke test failed again; the steps below will say where" | tee -a "$LOG"
    fi
fi

# the steps, each under its own limit inside (this one only guards the whole)
timeout 900 "$PY" -m bench.gpu_check --out "$OUT"   # it writes the log itself
status=$?
step "end"
exit $status
