"""Agreement of torchref and jaxmodel at fp64 / fp32 / tf32 / bf16 on whatever device
the frameworks see (a CUDA GPU when there is one), then the speed benchmark.

    python3 -m bench.gpu_check [--checkpoint DIR] [--out DIR]

Without --checkpoint it writes a random checkpoint with SmolLM2-135M's exact shapes
(the real weights are 540 MB and cannot travel to a lent GPU machine; the numerics
questions asked here do not depend on trained values). Prints a table, writes
gpu_check.json, exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      rms_norm_eps=1e-5, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      tie_word_embeddings=True, rope_theta=None)

# Bounds on logits relative L2 vs the fp64 oracle, per policy: rounding at that precision
# through 30 layers, with margin. fp64: the two models must agree to the bit-level noise.
BOUNDS = {"fp64": 1e-12, "fp32": 1e-4, "tf32": 3e-2, "bf16": 1.5e-1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)

    import torch

    import jaxmodel
    import torchref
    from compare.environment import environment
    from compare.metrics import rel_l2
    from llamaspec.testing import make_checkpoint

    folder = args.checkpoint
    if folder is None:
        folder = make_checkpoint(Path(tempfile.mkdtemp()) / "smollm2-shaped", seed=0, **SMOLLM2_SHAPES)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = {**environment("fp32"), "torch_device": device}
    print(json.dumps(env), flush=True)

    ids = np.random.default_rng(1).integers(3, 49152, (2, args.tokens))
    oracle = np.asarray(torchref.from_pretrained(folder, policy="fp64", device=device)(ids).cpu())
    rows, ok = [], True
    for policy in ("fp64", "fp32", "tf32", "bf16"):
        out = {}
        for name, mod in (("torchref", torchref), ("jaxmodel", jaxmodel)):
            kw = {"device": device} if name == "torchref" else {}
            if name == "torchref" and device == "cuda":
                _cuda_settings_for(torch, policy)   # torchref checks them at each call, never sets them
            m = mod.from_pretrained(folder, policy=policy, **kw)
            t0 = time.perf_counter()
            logits = m(ids)
            logits = logits.cpu() if hasattr(logits, "cpu") else logits
            out[name] = np.asarray(logits, np.float64)
            print(f"  {policy:<5} {name:<9} forward {time.perf_counter() - t0:6.2f} s (incl. compile)", flush=True)
            del m
        row = {"policy": policy, "torchref_vs_oracle": rel_l2(out["torchref"], oracle),
               "jaxmodel_vs_oracle": rel_l2(out["jaxmodel"], oracle),
               "jax_vs_torch": rel_l2(out["jaxmodel"], out["torchref"])}
        if policy == "fp64":
            row["pass"] = row["jax_vs_torch"] <= BOUNDS["fp64"]
        else:
            row["pass"] = max(row["torchref_vs_oracle"], row["jaxmodel_vs_oracle"]) <= BOUNDS[policy]
        ok &= row["pass"]
        rows.append(row)

    print(f"\n{'policy':<7}{'torchref vs fp64':>18}{'jaxmodel vs fp64':>18}{'jax vs torch':>14}  pass")
    for r in rows:
        print(f"{r['policy']:<7}{r['torchref_vs_oracle']:>18.2e}{r['jaxmodel_vs_oracle']:>18.2e}"
              f"{r['jax_vs_torch']:>14.2e}  {r['pass']}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps({"environment": env, "checkpoint": str(folder),
                                                                "rows": rows}, indent=1))
    print(f"checkpoint for the benchmark: {folder}")
    return 0 if ok else 1




def _cuda_settings_for(torch, policy: str) -> None:
    """This script's own process: torch's CUDA matmul settings as `policy` needs them (TF32 only for
    tf32; no reduced-precision reductions: every policy here sums in f32 or wider)."""
    mm = torch.backends.cuda.matmul
    mm.fp32_precision = "tf32" if policy == "tf32" else "ieee"
    mm.allow_bf16_reduced_precision_reduction = False
    mm.allow_fp16_reduced_precision_reduction = False


if __name__ == "__main__":
    sys.exit(main())
