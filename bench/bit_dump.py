"""Every array a model gives through the public API, dumped to compare two trees bit for bit (a
speed change must keep the fast backend's bits: docs/performance.md).

    .venv/bin/python -m bench.bit_dump dump OUT.npz [--model torchref|jaxmodel] [--tiny DIR]
    PYTHONPATH=<other tree> .venv/bin/python <this tree>/bench/bit_dump.py dump OTHER.npz ...
    .venv/bin/python -m bench.bit_dump compare A.npz B.npz

dump: SmolLM2-135M-Instruct (the cached copy) at bf16, fp16 and fp32: every tap and the logits of a
1x128 prompt, 6 decode steps with every tap at batch 1 and at batch 3 (two rows left-padded), a
greedy generation; and three tiny random checkpoints written into --tiny (once; an existing folder
is reused, so that two trees read the same files): K = 64; K = 200 with q/k/v biases; bf16 storage
with an intermediate size of 4200 (a row longer than 4096), each at bf16, fp16, fp32, bf16w-f32
and fp64, capture and 4 decode steps at batch 1 and 2. Inputs come from a fixed seed. Under a cap:
`env $(python -m llamaspec.caps avx2) ...`. compare: the arrays whose bytes differ, by group.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
from pathlib import Path

import numpy as np

from llama_parity.fetch import default_model_dir
from llamaspec.files import atomic_write
from llamaspec.testing import make_checkpoint

TINY = {"tiny_a": dict(seed=1),
        "tiny_b": dict(seed=2, hidden_size=200, intermediate_size=328, num_attention_heads=4,
                       num_key_value_heads=2, attention_bias=True),
        "tiny_c": dict(dtype="bfloat16", seed=3, hidden_size=136, intermediate_size=4200,
                       num_attention_heads=2, num_key_value_heads=1)}


def _decode(m, out: dict, key: str, ids: np.ndarray, mask: np.ndarray, steps: int, rng) -> None:
    lg, cache = m.prefill(ids, mask, ids.shape[1] + steps)
    out[f"{key}/prefill_logits"] = np.asarray(lg)
    for s in range(steps):
        lg, cache, acts = m.decode_capture(cache, rng.integers(0, m.cfg.vocab_size, (ids.shape[0],)), taps="*")
        out[f"{key}/step{s}/logits"] = np.asarray(lg)
        out.update({f"{key}/step{s}/{k}": np.asarray(v) for k, v in acts.items()})


def dump(path: Path, model: str, tiny: Path) -> int:
    pkg = importlib.import_module(model)
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}
    smollm2 = default_model_dir()
    for pol in ("bf16", "fp16", "fp32"):
        m = pkg.from_pretrained(smollm2, policy=pol)
        ids = rng.integers(0, m.cfg.vocab_size, (1, 128))
        logits, acts = m.capture(ids, np.ones_like(ids), taps="*")
        out[f"{pol}/prefill1x128/logits"] = logits
        out.update({f"{pol}/prefill1x128/{k}": v for k, v in acts.items()})
        for B, T in ((1, 40), (3, 30)):
            rows = rng.integers(0, m.cfg.vocab_size, (B, T))
            mask = np.ones_like(rows)
            mask[1:, :5] = 0
            _decode(m, out, f"{pol}/decode{B}", rows, mask, 6, rng)
        out[f"{pol}/generate"] = np.asarray(m.generate(ids[:, :20], max_new_tokens=8))
    for name, spec in TINY.items():
        folder = tiny / name
        if not (folder / "config.json").exists():
            make_checkpoint(folder, **spec)
        for pol in ("bf16", "fp16", "fp32", "bf16w-f32", "fp64"):
            m = pkg.from_pretrained(folder, policy=pol)
            for B, T in ((1, 9), (2, 7)):
                ids = rng.integers(0, m.cfg.vocab_size, (B, T))
                mask = np.ones_like(ids)
                mask[1:, :2] = 0
                logits, acts = m.capture(ids, mask, taps="*")
                out[f"{name}/{pol}/capture{B}/logits"] = logits
                out.update({f"{name}/{pol}/capture{B}/{k}": v for k, v in acts.items()})
                _decode(m, out, f"{name}/{pol}/decode{B}", ids, mask, 4, rng)
    # 16-bit floats as their bits (npz has no bfloat16)
    arrays = {k: v.view(np.uint16) if v.dtype.itemsize == 2 and v.dtype.kind not in "iu" else v for k, v in out.items()}
    atomic_write(path, lambda f: np.savez(f, **arrays), "the dump")
    print(f"{len(arrays)} arrays -> {path}")
    return 0


def compare(a_path: Path, b_path: Path) -> int:
    a, b = np.load(a_path), np.load(b_path)
    missing = sorted(set(a.files) ^ set(b.files))
    differ = [k for k in sorted(set(a.files) & set(b.files))
              if a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes()]
    print(f"{len(set(a.files) | set(b.files))} arrays; {len(differ)} differ; {len(missing)} in one file only")
    for group, n in collections.Counter("/".join(k.split("/")[:2]) for k in differ).most_common():
        print(f"  {group}: {n}")
    return 1 if differ or missing else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--model", default="torchref", choices=("torchref", "jaxmodel"))
    d.add_argument("--tiny", type=Path, default=Path("/tmp/bit-dump-checkpoints"))
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    return dump(args.out, args.model, args.tiny) if args.verb == "dump" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
