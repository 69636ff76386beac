"""The classifier's controls on one checkpoint: every planted bug and clean runs, one table.

    .venv/bin/python -m bench.controls                 # tiny random checkpoint (seconds)
    .venv/bin/python -m bench.controls --smollm2       # the real SmolLM2-135M (minutes)
    .venv/bin/python -m bench.controls --only rope_layout clean --tokens 64
    .venv/bin/python -m bench.controls --families      # the family slips, each on a tiny checkpoint of its family

Positive controls (compare/controls/prefill.py): one bug planted at layer 1 of torchref, of a
transformers LlamaForCausalLM, or of a doctored checkpoint copy read by jaxmodel;
precision controls change one policy knob of the candidate. Negative controls: clean
jaxmodel vs torchref at fp64/fp32/bf16/fp16, clean transformers vs torchref at
fp32/bf16. Columns: verdict, first-divergence tap/layer/component, teacher forcing's
confirmation, the hint, and a key number:
    semantic   err64: rel L2 of the candidate's fp64 run vs the oracle at that tap;
    precision  ratio = err(cand) / (M * err(ref) + floor) at that tap (> 1 flags);
    clean      the largest such ratio over all taps (< 1 stays drift): the margin.
Writes JSON to bench/results/controls-<checkpoint>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from compare.controls import CONTROLS, check, clean, run_control
from compare.vocabulary import FLOOR_ULPS, M
from llamaspec.files import atomic_write

TINY_HEAD_DIM = 32   # RoPE tables in bf16 need angles > ~30 rad to show: wide heads, 128 tokens
CLEAN = [("jaxmodel", p) for p in ("fp64", "fp32", "bf16", "fp16")] + \
        [("transformers", p) for p in ("fp32", "bf16")]


def key_number(control, report) -> tuple[str, float]:
    d = report.first_divergence
    if control.tap is None or d is None:
        rated = [v for v in report.taps if v.precision_ratio == v.precision_ratio]
        if not rated:
            return "all taps exact", 0.0
        worst = max(rated, key=lambda v: v.precision_ratio)
        return f"max ratio {worst.precision_ratio:.2f} at {worst.tap}", worst.precision_ratio
    v = next(v for v in report.taps if v.tap == d.tap)
    if d.kind == "semantic":
        return f"err64 {v.err_fp64:.1e}", v.err_fp64
    return f"ratio {v.precision_ratio:.2f} ({v.err_cand:.1e} vs {v.err_ref:.1e})", v.precision_ratio


def inputs(folder, smollm2: bool, tokens: int, batch: int):
    if smollm2:
        from llamaspec.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained(folder)
        text = ("Floating-point addition is not associative, so two correct implementations of "
                "the same model can round differently. A real bug changes the numbers even in "
                "double precision, and in a pattern that follows positions, heads or rows. ")
        ids = tok.encode_chat(text * 8)[:tokens]
        return np.array([ids] * batch)[:1], np.ones((1, len(ids)), np.int64)
    ids = np.random.default_rng(0).integers(3, 96, (batch, tokens))
    return ids, np.ones_like(ids)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smollm2", action="store_true", help="the cached SmolLM2-135M-Instruct")
    ap.add_argument("--checkpoint", help="any HF Llama folder (default: a tiny random one)")
    ap.add_argument("--tokens", type=int, default=None, help="sequence length (tiny 128, SmolLM2 64)")
    ap.add_argument("--batch", type=int, default=2, help="rows (tiny only)")
    ap.add_argument("--only", nargs="*", help="control names; 'clean' for the clean runs")
    ap.add_argument("--no-jax-bugs", action="store_true", help="skip jaxmodel doctored checkpoints")
    ap.add_argument("--no-twin", action="store_true",
                    help="drop each candidate's float64 twin: judged by structure alone")
    ap.add_argument("--families", action="store_true",
                    help="the family slips (compare/controls/families.py) and each family's clean runs, "
                         "each on a tiny random checkpoint of its family")
    args = ap.parse_args(argv)
    if args.families:
        return families(args)

    if args.smollm2:
        from llama_parity.fetch import default_model_dir
        folder, label = default_model_dir(), "smollm2"
    elif args.checkpoint:
        folder, label = Path(args.checkpoint), Path(args.checkpoint).name
    else:
        import tempfile

        from llamaspec.testing import make_checkpoint
        folder = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", head_dim=TINY_HEAD_DIM)
        label = "tiny"
    tokens = args.tokens or (64 if args.smollm2 else 128)
    ids, mask = inputs(folder, args.smollm2, tokens, args.batch)

    controls = [c for c in CONTROLS.values()
                if not (args.no_jax_bugs and c.where == "jaxmodel")]
    controls += [clean(w, p) for w, p in CLEAN]
    if args.only:
        controls = [c for c in controls if c.name in args.only
                    or ("clean" in args.only and c.tap is None)]

    run_all(controls, lambda c: folder, ids, mask, label, args.no_twin)


def families(args):
    """The family controls, each on its family's tiny checkpoint (written once per family)."""
    import tempfile

    from compare.controls.families import FAMILY_CONTROLS, FAMILY_OF, clean_family, family_checkpoint
    from llamaspec.testing import TINY_FAMILIES
    root = Path(tempfile.mkdtemp())
    folders = {f: family_checkpoint(root / f, f) for f in TINY_FAMILIES}
    controls = list(FAMILY_CONTROLS.values())
    of = dict(FAMILY_OF)
    for f in TINY_FAMILIES:
        for where in ("torchref", "transformers"):
            for p in ("fp32", "bf16"):
                c = clean_family(f, p, where)
                controls.append(c)
                of[c.name] = f
    if args.only:
        controls = [c for c in controls if c.name in args.only or ("clean" in args.only and c.tap is None)]
    ids = np.random.default_rng(0).integers(3, 96, (args.batch, args.tokens or 12))
    run_all(controls, lambda c: folders[of[c.name]], ids, np.ones_like(ids), "families", args.no_twin)


def run_all(controls, folder_of, ids, mask, label, no_twin):
    rows = []
    head = f"{'control':24s} {'where':12s} {'policy':6s} {'verdict':9s} {'tap':20s} {'L':>2s} " \
           f"{'component':10s} {'tf':3s} {'ok':3s} {'s':>5s}  key number | hint"
    print(f"checkpoints: {label}, inputs {ids.shape[0]}x{ids.shape[1]} tokens\n{head}")
    for c in controls:
        t0 = time.perf_counter()
        try:
            report = run_control(c, folder_of(c), ids, mask, twin=not no_twin)
        except Exception as e:  # a control that cannot run is a row, not a crash
            rows.append(dict(control=c.name, where=c.where, policy=c.policy, error=repr(e)))
            print(f"{c.name:24s} {c.where:12s} {c.policy:6s} ERROR {e!r}")
            continue
        secs = time.perf_counter() - t0
        d = report.first_divergence
        key, value = key_number(c, report)
        problems = check(c, report)
        ok = "info" if c.verdict is None else ("yes" if not problems else "NO")
        tf = "-" if d is None or d.confirmed is None else ("yes" if d.confirmed else "no")
        hint = "" if d is None else d.hint.split("not rounding; ")[-1]
        row = dict(control=c.name, what=c.what, where=c.where, policy=c.policy,
                   expected=dict(verdict=c.verdict, tap=c.expected_tap, component=c.component),
                   verdict=report.verdict, tap=d and d.tap, layer=d and d.layer,
                   component=d and d.component, confirmed=d and d.confirmed,
                   evidence=d and d.evidence, hint=d and d.hint, key=key, key_value=value,
                   ok=ok, problems=problems, seconds=round(secs, 2))
        rows.append(row)
        print(f"{c.name:24s} {c.where:12s} {c.policy:6s} {report.verdict:9s} "
              f"{str(d and d.tap):20s} {str(d and d.layer):>2s} {str(d and d.component):10s} "
              f"{tf:3s} {ok:3s} {secs:5.1f}  {key} | {hint}")
        for p in problems:
            print(f"{'':24s} !! {p}")
    bad = [r["control"] for r in rows if r.get("ok") == "NO" or "error" in r]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} controls as expected"
          + (f"; failing: {', '.join(bad)}" if bad else ""))
    label += "-no-twin" if no_twin else ""
    out = Path(__file__).parent / "results" / f"controls-{label}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    atomic_write(out, json.dumps(dict(checkpoints=label, label=label, inputs=list(ids.shape), M=M,
                                      floor_ulps=FLOOR_ULPS, rows=rows), indent=1, default=str), "controls table")
    print(f"wrote {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
