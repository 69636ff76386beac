#!/usr/bin/env bash
# One prepared GPU check, for a machine with a CUDA GPU and a Python that already has
# torch, jax[cuda], flax, safetensors, tokenizers, ml_dtypes and transformers (the lent
# H200 image has them all). Installs nothing, except flax from ./.whl when the image's
# flax cannot run jaxmodel (step 0). Runs from the repository root:
#
#     bash bench/gpu_check.sh [OUT_DIR]
#
# Sized for a lease of 15 device minutes, start included: every step has its own time
# limit (about 8 minutes in all, usually less), so a step that hangs costs only itself, and
# each step's JSON is written as it ends.
#
# 0. versions, the GPU, and a smoke test (a tiny checkpoint through both models);
# 1. fp64/fp32/tf32/bf16 agreement of torchref and jaxmodel vs an fp64 oracle on a
#    random checkpoint with SmolLM2-135M's shapes (bench/gpu_check.py);
# 2. the speed benchmark (bench/bench_models.py) on the same checkpoint, side by side
#    with transformers sdpa, at fp32 and bf16;
# 3. prefill (2048 tokens) and decode (batch 1 and 8) of a Llama-3.2-1B-shaped random
#    checkpoint at bf16 against the device's roofline: bf16 peak flops for prefill, memory
#    bandwidth for decode (bench/bench_roofline.py; peaks of known GPUs by name);
# 4. batch invariance of the GPU's default kernels on the step-1 checkpoint: does a row's output
#    change with the batch it shares (probe batch, torchref and jaxmodel, fp32 and bf16), and
#    from which layer and op (probe where, bf16). The invariant mode is CPU code: not run here;
# 5. jaxmodel on one GPU vs tensor-parallel over as many GPUs as the model's sizes allow
#    (bench/bench_sharding.py: times, and whether the logits are bitwise those of one GPU);
#    on a one-GPU host it measures one device and says so.
# Results: OUT_DIR/gpu_check.json, bench.json, roofline.json, probes.json, where.json,
# sharding.json, log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-bench/results}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX must not grab 75% of GPU memory up front: torch runs in the same process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG="$OUT/log.txt"
want() { [[ " ${GPU_CHECK_STEPS:-0 1 2 3 4 5} " == *" $1 "* ]]; }   # GPU_CHECK_STEPS="2 4": those only
step() { echo "== $(date +%T) step $*" | tee -a "$LOG"; }
run() {  # run LIMIT_S CMD...: one step under its own limit, its output in the log
    local limit=$1; shift
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "!! timed out after ${limit} s: $*" | tee -a "$LOG"
    return "$rc"
}

if want 0; then
    step "0: versions and smoke test"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
    "$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, importlib
print("python", platform.python_version())
for name in ("torch", "jax", "jaxlib", "flax", "transformers", "safetensors", "ml_dtypes", "numpy"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "missing:", e)
import jax, torch
print("jax devices", jax.devices(), "torch cuda", torch.cuda.is_available())
EOF
    SMOKE='
import tempfile, numpy as np, torch, jaxmodel, torchref
from llamaspec.testing import make_checkpoint
from compare.metrics import rel_l2
folder = make_checkpoint(tempfile.mkdtemp() + "/tiny", seed=0)
ids = np.random.default_rng(0).integers(3, 90, (2, 16))
dev = "cuda" if torch.cuda.is_available() else "cpu"
a = np.asarray(torchref.from_pretrained(folder, policy="fp64", device=dev)(ids).cpu())
b = np.asarray(jaxmodel.from_pretrained(folder, policy="fp64")(ids), np.float64)
print("smoke: tiny checkpoint, fp64, torchref on", dev, "vs jaxmodel: rel_l2", rel_l2(a, b))
assert rel_l2(a, b) < 1e-12
'
    if ! run 90 "$PY" -c "$SMOKE"; then
        if ls .whl/flax-*.whl >/dev/null 2>&1; then
            echo "smoke test failed: retrying with the carried flax" | tee -a "$LOG"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flax-*.whl
            export PYTHONPATH="/tmp/site:$PYTHONPATH"
            run 90 "$PY" -c "$SMOKE" || echo "!! smoke test failed again; the steps below will say where" | tee -a "$LOG"
        fi
    fi
fi

status=0
if want 1; then
    step "1: agreement vs fp64 (SmolLM2 shapes)"
    run 150 "$PY" -m bench.gpu_check --out "$OUT"
    status=$?
fi
ckpt=$(grep '^checkpoint for the benchmark:' "$LOG" 2>/dev/null | tail -1 | cut -d' ' -f5-)
if [ -z "$ckpt" ]; then  # step 1 skipped, or died before naming its checkpoint: write one for the rest
    ckpt=$("$PY" -c "import tempfile; from bench.gpu_check import SMOLLM2_SHAPES as s; \
from llamaspec.testing import make_checkpoint; print(make_checkpoint(tempfile.mkdtemp() + '/m', seed=0, **s))")
fi

# jaxmodel's fp32 programs take ~45 s each to compile on the H200 (bf16 ~4 s; first run 2026-12-04), and
# steps 2 and 4 compile one per shape: they run at bf16 (torchref's probe at fp32 too).
if want 2; then
    step "2: speed, SmolLM2 shapes, torchref / jaxmodel / transformers sdpa, bf16"
    run 130 "$PY" -m bench.bench_models --checkpoint "$ckpt" --policy bf16 --impl torchref jaxmodel sdpa \
        --repeats 3 --decode-steps 16 --prefill 512 2048 --decode-batch 1 8 --out "$OUT/bench.json"
fi

if want 3; then
    step "3: Llama-3.2-1B shape against the roofline, bf16"
    run 150 "$PY" -m bench.bench_roofline --shape llama-3.2-1b --policy bf16 --prefill 2048 --decode-batch 1 8 \
        --impl torchref jaxmodel sdpa --repeats 3 --decode-steps 16 --out "$OUT/roofline.json"
fi

if want 4; then
    step "4: batch invariance of the GPU's default kernels"
    run 60 "$PY" -m llama_parity.cli probe batch --checkpoint "$ckpt" --impl torchref \
        --policy fp32,bf16 --mode default --json "$OUT/probes.json" --no-colour
    run 60 "$PY" -m llama_parity.cli probe batch --checkpoint "$ckpt" --impl jaxmodel \
        --policy bf16 --mode default --json "$OUT/probes-jaxmodel.json" --no-colour
    run 60 "$PY" -m llama_parity.cli probe where --checkpoint "$ckpt" --impl torchref,jaxmodel \
        --policy bf16 --circumstance batch --json "$OUT/where.json" --no-colour
fi

if want 5; then
    step "5: sharding"
    run 35 "$PY" -m bench.bench_sharding --checkpoint "$ckpt" --policies fp32,bf16 --repeats 3 \
        --out "$OUT/sharding.json"
fi
if want 6; then  # not in the default list: a diagnosis of step 1's 47 s fp32 first call (first run 2026-12-04)
    step "6: jaxmodel's fp32 first forward with XLA:GPU's autotuning off (XLA_FLAGS=--xla_gpu_autotune_level=0)"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" run 90 "$PY" -c "
import sys, time, numpy as np, jaxmodel, torchref
from compare.metrics import rel_l2
ids = np.random.default_rng(1).integers(3, 49152, (2, 256))
m = jaxmodel.from_pretrained(sys.argv[1], policy='fp32')
t = time.perf_counter(); a = np.asarray(m(ids), np.float64); first = time.perf_counter() - t
t = time.perf_counter(); np.asarray(m(ids)); again = time.perf_counter() - t
b = torchref.from_pretrained(sys.argv[1], policy='fp32')(ids).cpu().double().numpy()
print(f'fp32 jaxmodel, autotuning off: first call {first:.2f} s, again {again * 1e3:.1f} ms; '
      f'rel_l2 vs torchref fp32 {rel_l2(a, b):.2e}')" "$ckpt"
fi
step "end"
exit $status
