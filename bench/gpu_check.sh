#!/usr/bin/env bash
# One prepared GPU check, for a machine with a CUDA GPU and a Python that already has
# torch, jax[cuda], flax, safetensors, tokenizers, ml_dtypes and transformers (the lent
# H200 image has them all). Installs nothing; runs from the repository root:
#
#     bash bench/gpu_check.sh [OUT_DIR]        # about 2-3 minutes on an H200 before step 4 (not yet run)
#
# 1. fp64/fp32/tf32/bf16 agreement of torchref and jaxmodel vs an fp64 oracle on a
#    random checkpoint with SmolLM2-135M's shapes (bench/gpu_check.py);
# 2. the speed benchmark (bench/bench_models.py) on the same checkpoint, side by side
#    with transformers, at fp32, tf32 and bf16;
# 3. jaxmodel on one GPU vs tensor-parallel over as many GPUs as the model's sizes allow
#    (bench/bench_sharding.py: times, and whether the logits are bitwise those of one GPU);
#    on a one-GPU host it measures one device and says so;
# 4. prefill (2048 tokens) and decode (batch 1 and 8) of a Llama-3.2-1B-shaped random
#    checkpoint at bf16 against the device's roofline: bf16 peak flops for prefill, memory
#    bandwidth for decode (bench/bench_roofline.py; peaks of known GPUs by name);
# 5. batch invariance of the GPU's default kernels on the step-1 checkpoint: does a row's output
#    change with the batch it shares (probe batch, torchref and jaxmodel, fp32 and bf16), and
#    from which layer and op (probe where, bf16). The invariant mode is CPU code: not run here.
#    On the 2-core CPU (SmolLM2): about 1 min each.
# Results: OUT_DIR/gpu_check.json, OUT_DIR/bench.json, OUT_DIR/sharding.json,
# OUT_DIR/roofline.json, OUT_DIR/probes.json, OUT_DIR/where.json, OUT_DIR/log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-bench/results}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX must not grab 75% of GPU memory up front: torch runs in the same process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/log.txt"
"$PY" -m bench.gpu_check --out "$OUT" 2>&1 | tee -a "$OUT/log.txt"
status=${PIPESTATUS[0]}
ckpt=$(grep '^checkpoint for the benchmark:' "$OUT/log.txt" | tail -1 | cut -d' ' -f5-)
timeout 240 "$PY" -m bench.bench_models --checkpoint "$ckpt" --policy fp32 tf32 bf16 \
    --repeats 5 --decode-steps 32 --prefill 128 512 2048 --out "$OUT/bench.json" 2>&1 | tee -a "$OUT/log.txt"
timeout 240 "$PY" -m bench.bench_sharding --checkpoint "$ckpt" --policies fp32,bf16 --repeats 5 \
    --out "$OUT/sharding.json" 2>&1 | tee -a "$OUT/log.txt"
timeout 300 "$PY" -m bench.bench_roofline --shape llama-3.2-1b --policy bf16 --prefill 2048 --decode-batch 1 8 \
    --repeats 3 --out "$OUT/roofline.json" 2>&1 | tee -a "$OUT/log.txt"
timeout 180 "$PY" -m llama_parity.cli probe batch --checkpoint "$ckpt" --impl torchref,jaxmodel \
    --policy fp32,bf16 --mode default --json "$OUT/probes.json" --no-colour 2>&1 | tee -a "$OUT/log.txt"
timeout 180 "$PY" -m llama_parity.cli probe where --checkpoint "$ckpt" --impl torchref,jaxmodel \
    --policy bf16 --circumstance batch --json "$OUT/where.json" --no-colour 2>&1 | tee -a "$OUT/log.txt"
exit $status
