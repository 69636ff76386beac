"""The GPU check: one prepared command that answers, on one GPU inside a short lease, whether the
invariant mode is bitwise on the GPU, what it costs, how much the default mode moves with the
batch, how the GPU's numbers part from the CPU's, and how far the models are from the roofline.

    python3 -m bench.gpu_check [--out DIR] [--steps invariant default ...] [--impl torchref jaxmodel]
    python3 -m bench.gpu_check --dry-run        # the same on the CPU, tiny shapes (GPU_CHECK_DRY_RUN=1 too)
    python3 -m bench.gpu_check --summary --out DIR    # the table again, from DIR/gpu_check.json

bench/gpu_check.sh runs it after the machine's versions and a smoke test. Each step runs in a
process of its own under its own time limit (LIMITS), so a step that hangs or compiles too long
costs only itself; its section of DIR/gpu_check.json is written as it ends (and within a step
after each model), with the step's status, so that a lease that ends early keeps what ran.

    environment  versions, compare.environment (the plans' inputs) and determinism_settings()
    invariant    the invariant mode (backend="invariant"; on a GPU the plan's portable path), both
                 models: one target alone vs inside batches (BATCH_SIZES, at the first, middle and
                 last row), padded left and right among companions of mixed lengths, and the first
                 decode step after a batched prefill: bitwise or not, per case
    default      the same cases in the default mode (its batch variance: cases bitwise, max abs
                 logit difference) and its run-to-run check (one batch run twice), with the
                 determinism settings that were on
    cost         prefill and decode times, invariant vs default mode (bench_invariant.time_modes)
    device       the same model and policy on the CPU and on the device: the logits compared, each
                 judged against the float64 twin (compare.probes.compare_case); and `probe where
                 --circumstance device` (torchref: the first tap where they part)
    roofline     bf16 prefill 2048 and decode at Llama-3.2-1B's shape against the device's peaks
                 (bench_roofline)
    sharding     jaxmodel on one device vs tensor parallel over the devices there are
                 (bench_sharding): a multi-GPU host runs TP with the same command
    agreement    (not in the default list) fp64/fp32/tf32/bf16 agreement vs an fp64 oracle

The dry run (--dry-run, GPU_CHECK_DRY_RUN=1) runs every step on the CPU with a tiny checkpoint,
small batches and short limits, the portable path forced (LLAMA_PARITY_INVARIANT=portable), the
"device" being the CPU (CUDA hidden): the JSON has the same sections and keys, and the test suite
runs it (tests/test_gpu_check.py). Its roofline fractions use nominal peaks, not this CPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      rms_norm_eps=1e-5, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      tie_word_embeddings=True, rope_theta=None)
# Bounds on logits relative L2 vs the fp64 oracle, per policy (the agreement step): rounding at that
# precision through 30 layers, with margin. fp64: the two models must agree to the bit-level noise.
BOUNDS = {"fp64": 1e-12, "fp32": 1e-4, "tf32": 3e-2, "bf16": 1.5e-1}
STEPS = ("environment", "invariant", "default", "cost", "device", "roofline", "sharding")
OPTIONAL = ("agreement",)
IMPLS = ("jaxmodel", "torchref")   # jaxmodel first: a lease that ends early keeps it
JSON_NAME = "gpu_check.json"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: the GPU's sizes or the dry run's."""
    policy: str
    target_len: int
    batch_sizes: tuple        # the target alone vs batches of companions of its length
    padded_sizes: tuple       # ... of mixed lengths, padded left and right
    decode_sizes: tuple       # ... of a prefill and the first decode step
    pad: int                  # slots beyond the target's length in padded batches
    cost_prompt: int
    cost_batches: tuple
    cost_decode: int
    cost_repeats: int
    limits: dict              # step -> seconds
    roofline: tuple           # bench_roofline's arguments
    sharding: tuple           # bench_sharding's (the checkpoint added)


# Limits: 405 s in all, with bench/gpu_check.sh's smoke test (60 s) and the checkpoint's writing
# under 8 minutes, for a 15-minute lease with the machine's start. jaxmodel compiles each shape once
# (bf16 ~4 s on the H200, 2026-12-04; the persistent cache shares them between the steps), so the
# cases use few shapes; within a step the JSON is written after each model (jaxmodel first).
GPU = Sizes(policy="bf16", target_len=24, batch_sizes=(1, 2, 3, 8, 17, 32), padded_sizes=(17,),
            decode_sizes=(32,), pad=8, cost_prompt=512, cost_batches=(1, 8), cost_decode=8, cost_repeats=2,
            limits={"environment": 25, "invariant": 120, "default": 50, "cost": 50, "device": 45,
                    "roofline": 85, "sharding": 30, "agreement": 150},
            roofline=("--shape", "llama-3.2-1b", "--policy", "bf16", "--prefill", "2048", "--decode-batch", "1", "8",
                      "--decode-prompt", "512", "--decode-steps", "8", "--repeats", "2",
                      "--impl", "jaxmodel", "sdpa", "torchref"),
            sharding=("--policies", "bf16", "--repeats", "3", "--batch", "4", "--length", "128"))
DRY = Sizes(policy="bf16", target_len=7, batch_sizes=(1, 3, 8), padded_sizes=(3,), decode_sizes=(3,), pad=4,
            cost_prompt=16, cost_batches=(1, 3), cost_decode=2, cost_repeats=1,
            limits={"environment": 60, "invariant": 120, "default": 90, "cost": 90, "device": 120,
                    "roofline": 90, "sharding": 90, "agreement": 120},
            roofline=("--shape", "tiny", "--policy", "bf16", "--prefill", "32", "--decode-batch", "1",
                      "--decode-prompt", "16", "--decode-steps", "2", "--repeats", "1", "--impl", "torchref",
                      "jaxmodel", "--peak-tflops", "1", "--hbm-gbs", "50"),
            sharding=("--policies", "bf16", "--repeats", "1", "--batch", "2", "--length", "8"))
DRY_PEAKS_NOTE = "dry run: nominal peaks (1 TFLOP/s, 50 GB/s), not this CPU's: the fractions measure nothing"


def dry_run_env() -> dict:
    """The dry run's variables for its steps: the portable path forced, the GPU hidden."""
    return {"LLAMA_PARITY_INVARIANT": "portable", "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}


# ----------------------------------------------------------------- the orchestrator

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu-check")
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1")
    ap.add_argument("--steps", nargs="+", default=(os.environ.get("GPU_CHECK_STEPS") or " ".join(STEPS)).split(),
                    choices=STEPS + OPTIONAL)
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--summary", action="store_true", help="print the table of an earlier run's JSON")
    ap.add_argument("--step", choices=STEPS + OPTIONAL, help=argparse.SUPPRESS)       # one step, in its process
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-logits", nargs=2, metavar=("IDS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    sizes = DRY if args.dry_run else GPU
    if args.cpu_logits:
        return cpu_logits(args, sizes)
    if args.step:
        return run_step(args.step, args, sizes, out)
    if args.summary:
        doc = json.loads((out / JSON_NAME).read_text())
        print(format_summary({**doc, "summary": summary_rows(doc)}))
        return 0
    return orchestrate(args, sizes, out)


def orchestrate(args, sizes: Sizes, out: Path) -> int:
    """Every step in a process of its own under its limit; the JSON merged after each; the table."""
    from llamaspec.files import atomic_write
    out.mkdir(parents=True, exist_ok=True)
    (out / "sections").mkdir(exist_ok=True)
    doc = {"format": "llama-parity gpu check 2", "dry_run": args.dry_run, "commit": _commit(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "impls": args.impl, "sizes": dataclasses.asdict(sizes),
           "steps": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        folder = write_checkpoint(Path(scratch) / "model", args.dry_run)
        doc["checkpoint"] = ("tiny random (llamaspec.testing)" if args.dry_run else
                             "random, SmolLM2-135M's shapes (bf16 stored)")
        say(out, f"== checkpoint: {doc['checkpoint']} ({time.perf_counter() - t0:.1f} s)")
        env = {**os.environ, **(dry_run_env() if args.dry_run else {}), "PYTHONUNBUFFERED": "1",
               "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}    # torch and JAX share the GPU's memory
        for step in args.steps:
            cmd = [sys.executable, "-m", "bench.gpu_check", "--step", step, "--out", str(out),
                   "--checkpoint", str(folder), "--impl", *args.impl] + (["--dry-run"] if args.dry_run else [])
            limit = sizes.limits[step]
            say(out, f"== {time.strftime('%H:%M:%S')} step {step} (limit {limit} s)")
            doc["steps"][step] = run_limited(cmd, limit, env, out / "log.txt")
            section = out / "sections" / f"{step}.json"
            if section.is_file():
                doc.update(json.loads(section.read_text()))
            doc["seconds"] = round(time.perf_counter() - t0, 1)
            atomic_write(out / JSON_NAME, json.dumps(doc, indent=1, default=str), "GPU check JSON")
    doc["summary"] = summary_rows(doc)
    atomic_write(out / JSON_NAME, json.dumps(doc, indent=1, default=str), "GPU check JSON")
    say(out, "\n" + format_summary(doc))
    say(out, f"\nwrote {out / JSON_NAME} ({doc['seconds']:.0f} s)")
    return 0 if all(s["status"] == "ok" for s in doc["steps"].values()) else 1


def say(out: Path, msg: str) -> None:
    """A line on stdout and in the log (the steps' output goes there too)."""
    print(msg, flush=True)
    with open(out / "log.txt", "a") as f:
        f.write(msg + "\n")


def run_limited(cmd, limit: float, env: dict, log: Path) -> dict:
    """cmd in a session of its own, its output to ours and to the log; killed (its whole group,
    the processes it started too) at `limit` seconds. The step's status record."""
    t0 = time.perf_counter()
    with open(log, "a") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                errors="replace", start_new_session=True)

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                sink.write(line)
            sys.stdout.flush()
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = f"timed out after {limit} s"
        reader.join(timeout=5)
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), "limit_s": limit}


def _commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parents[1])
        return r.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def write_checkpoint(folder: Path, dry_run: bool) -> Path:
    """The checkpoint the steps share: tiny for the dry run, SmolLM2-135M's shapes on a GPU (the
    real weights cannot travel to a lent machine; the questions here do not depend on trained values)."""
    if dry_run:
        from llamaspec.testing import make_checkpoint
        return make_checkpoint(folder, seed=0)
    from llamaspec import shapes
    return shapes.write_checkpoint(folder, "smollm2-135m", dtype="bfloat16", seed=0)


# ----------------------------------------------------------------- one step, in its own process

class Section:
    """A step's part of the JSON (its section, and any other top-level keys it fills), written whole
    after every part (sections/<step>.json), read by the orchestrator when the step ends."""

    def __init__(self, out: Path, step: str, content: dict, **others):
        self.path, self.step, self.content, self.others = out / "sections" / f"{step}.json", step, content, others
        self.write()

    def write(self):
        from llamaspec.files import atomic_write
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps({self.step: self.content, **self.others}, indent=1, default=str),
                     "GPU check section")


def run_step(step: str, args, sizes: Sizes, out: Path) -> int:
    import torch
    if torch.cuda.is_available():
        cuda_settings_for(torch, sizes.policy)
    steps = {"environment": step_environment, "invariant": step_invariant, "default": step_default,
             "cost": step_cost, "device": step_device, "roofline": step_roofline, "sharding": step_sharding,
             "agreement": step_agreement}
    return steps[step](args, sizes, out) or 0


def torch_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(impl: str, folder, policy: str, mode: str, device: str | None = None):
    """torchref / jaxmodel at `policy`, backend "invariant" or the default ("fast"); torchref on `device`
    (default: the GPU where there is one)."""
    import importlib
    backend = "invariant" if mode == "invariant" else "fast"
    kw = {"device": device or torch_device()} if impl == "torchref" else {}
    return importlib.import_module(impl).from_pretrained(folder, policy=policy, backend=backend, **kw)


def step_environment(args, sizes: Sizes, out: Path):
    import importlib
    import platform

    from compare.environment import determinism_settings, environment
    versions = {"python": platform.python_version()}
    for name in ("torch", "jax", "jaxlib", "flax", "transformers", "numpy"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError as e:
            versions[name] = f"missing: {e}"
    env = environment(sizes.policy)
    Section(out, "environment", {"versions": versions, "torch device": torch_device(), "record": env},
            determinism=determinism_settings())
    print(json.dumps({"versions": versions, "gpu": env.get("gpu"), "jax backend": env.get("jax backend")}))


# ----- invariance: the target alone vs in batches, padded, the first decode step

def bits(x) -> np.ndarray:
    """The raw bits (bf16 and f32 alike; -0.0 != 0.0, NaN == NaN)."""
    x = np.ascontiguousarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def case(name: str, group: str, B: int, row: int, got, want) -> dict:
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return {"name": name, "group": group, "batch": B, "row": row,
            "bitwise": bool(np.array_equal(bits(got), bits(want))),
            "max_abs": float(np.nanmax(diff)) if diff.size else 0.0}


def invariance_cases(m, sizes: Sizes, vocab: int, pad_id: int, seed: int = 0) -> list[dict]:
    """The target alone vs: batches of companions of its length (no padding), mixed lengths padded
    right and left, and a batched prefill's last position and first decode step; the target at the
    first, middle and last row of each batch (compare.probes.where_plan's target_rows)."""
    from compare.adapters.ours import host_array
    from compare.probes.where_plan import pack, target_rows
    rng = np.random.default_rng(seed)
    T = sizes.target_len
    target = rng.integers(3, vocab, T)
    alone = host_array(m(target[None]))[0]
    cases = []
    for B in sizes.batch_sizes:
        rows = target_rows(B)
        ids = rng.integers(3, vocab, (B, T))
        ids[rows] = target
        got = host_array(m(ids))
        cases += [case(f"B={B} row {r}", "batch", B, r, got[r], alone) for r in rows]
    W = T + sizes.pad
    for B in sizes.padded_sizes:
        rows = target_rows(B)
        seqs = [target if b in rows else rng.integers(3, vocab, int(rng.integers(1, W + 1))) for b in range(B)]
        for side in ("right", "left"):
            ids, mask = pack(seqs, side, W, pad_id)
            got = host_array(m(ids, mask))
            cases += [case(f"B={B} mixed, {side} padding, row {r}", f"padded {side}", B, r,
                           got[r][mask[r].astype(bool)], alone) for r in rows]
    first, cache = m.prefill(target[None], np.ones((1, T), np.int64), T + 1)
    first = host_array(first)[0]
    token = int(np.argmax(first))
    step = host_array(m.decode(cache, np.array([token]))[0])[0]
    for B in sizes.decode_sizes:
        rows = target_rows(B)
        seqs = [target if b in rows else rng.integers(3, vocab, int(rng.integers(1, W + 1))) for b in range(B)]
        ids, mask = pack(seqs, "left", W, pad_id)     # prefill takes rows aligned at the end
        logits, cache = m.prefill(ids, mask, W + 1)
        logits = host_array(logits)
        nxt = rng.integers(3, vocab, B)
        nxt[rows] = token
        got = host_array(m.decode(cache, nxt)[0])
        for r in rows:
            cases.append(case(f"B={B} prefill (last position), row {r}", "prefill", B, r, logits[r], first))
            cases.append(case(f"B={B} first decode step, row {r}", "decode", B, r, got[r], step))
    return cases


def _model_entry(impl: str, mode: str, policy: str, fn) -> dict:
    """One model's part of a section: what fn(entry) fills in, or the error that stopped it."""
    entry = {"impl": impl, "mode": mode, "policy": policy, "error": None}
    t0 = time.perf_counter()
    try:
        fn(entry)
    except Exception as e:  # noqa: BLE001 - a model that cannot run here is a finding, the step goes on
        entry["error"] = f"{type(e).__name__}: {e}"
        print(f"  {impl} {mode}: {entry['error']}", flush=True)
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    return entry


def _cases_of(mode: str, folder, sizes: Sizes, impl: str, cfg, rerun: bool):
    def fill(entry):
        t0 = time.perf_counter()
        m = load(impl, folder, sizes.policy, mode)
        entry["load_s"] = round(time.perf_counter() - t0, 1)
        entry["device"] = m.plan.device
        entry["path"] = m.plan.op("products")
        entry["plan"] = m.plan.record()
        cases = invariance_cases(m, sizes, cfg.vocab_size, cfg.pad_token_id or 0)
        entry.update(cases=cases, bitwise=sum(c["bitwise"] for c in cases), total=len(cases),
                     max_abs=max(c["max_abs"] for c in cases))
        if rerun:
            entry["rerun"] = rerun_check(m, sizes, cfg.vocab_size, cfg.pad_token_id or 0)
        print(f"  {impl} {mode} {sizes.policy} on {entry['device']}: {entry['bitwise']}/{entry['total']} bitwise, "
              f"max abs {entry['max_abs']:.3g} ({entry['path']})", flush=True)
    return fill


def rerun_check(m, sizes: Sizes, vocab: int, pad_id: int) -> dict:
    """The default mode's run-to-run check: one mixed batch run twice in this process, bitwise or
    not, with the determinism settings that were on (compare.environment.determinism_settings)."""
    from compare.adapters.ours import host_array
    from compare.environment import determinism_settings
    from compare.probes.where_plan import pack
    rng = np.random.default_rng(7)
    W = sizes.target_len + sizes.pad
    B = max(sizes.padded_sizes)
    ids, mask = pack([rng.integers(3, vocab, int(rng.integers(1, W + 1))) for _ in range(B)], "right", W, pad_id)
    a, b = host_array(m(ids, mask)), host_array(m(ids, mask))
    real = mask.astype(bool)
    diff = np.abs(a[real].astype(np.float64) - b[real].astype(np.float64))
    return {"batch": B, "bitwise": bool(np.array_equal(bits(a[real]), bits(b[real]))),
            "max_abs": float(diff.max()), "determinism": determinism_settings()}


def _modes_step(step: str, mode: str, args, sizes: Sizes, out: Path):
    from llamaspec import LlamaConfig
    cfg = LlamaConfig.from_file(Path(args.checkpoint) / "config.json")
    content = {"policy": sizes.policy, "target_len": sizes.target_len, "batch_sizes": list(sizes.batch_sizes),
               "padded_sizes": list(sizes.padded_sizes), "decode_sizes": list(sizes.decode_sizes), "models": []}
    if mode == "default":
        from compare.environment import determinism_settings
        content["determinism"] = determinism_settings()
    section = Section(out, step, content)
    for impl in args.impl:
        content["models"].append(_model_entry(impl, mode, sizes.policy,
                                              _cases_of(mode, args.checkpoint, sizes, impl, cfg, mode == "default")))
        section.write()


def step_invariant(args, sizes, out):
    _modes_step("invariant", "invariant", args, sizes, out)


def step_default(args, sizes, out):
    _modes_step("default", "default", args, sizes, out)


# ----- cost: invariant vs default mode

def step_cost(args, sizes: Sizes, out: Path):
    from bench.bench_invariant import timing_row
    from llamaspec import LlamaConfig
    cfg = LlamaConfig.from_file(Path(args.checkpoint) / "config.json")
    content = {"policy": sizes.policy, "prompt": sizes.cost_prompt, "decode_steps": sizes.cost_decode,
               "repeats": sizes.cost_repeats, "rows": []}
    section = Section(out, "cost", content)
    for impl in args.impl:
        def fill(entry, impl=impl):
            models = {mode: load(impl, args.checkpoint, sizes.policy, mode) for mode in ("default", "invariant")}
            entry["path"] = models["invariant"].plan.op("products")
            entry["rows"] = []
            for B in sizes.cost_batches:
                ids = np.random.default_rng(B).integers(3, cfg.vocab_size, (B, sizes.cost_prompt))
                entry["rows"].append({"batch": B, **timing_row(models, ids, sizes.cost_decode, sizes.cost_repeats)})
                section.write()
        content["rows"].append(_model_entry(impl, "invariant vs default", sizes.policy, fill))
        section.write()


# ----- device: CPU vs the device

def cpu_logits(args, sizes: Sizes) -> int:
    """(in a process with JAX_PLATFORMS=cpu) jaxmodel's logits on the CPU for the ids saved at IDS."""
    ids_path, out_path = args.cpu_logits
    ids = np.load(ids_path)
    m = load("jaxmodel", args.checkpoint, sizes.policy, "default")
    from compare.adapters.ours import host_array
    np.save(out_path, host_array(m(ids)).astype(np.float32))
    return 0


def _jax_on_cpu(args, sizes: Sizes, ids: np.ndarray) -> np.ndarray:
    with tempfile.TemporaryDirectory(prefix="gpu-check-cpu-") as tmp:
        np.save(Path(tmp) / "ids.npy", ids)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        cmd = [sys.executable, "-m", "bench.gpu_check", "--checkpoint", args.checkpoint,
               "--cpu-logits", str(Path(tmp) / "ids.npy"), str(Path(tmp) / "logits.npy")]
        subprocess.run(cmd + (["--dry-run"] if args.dry_run else []), env=env, check=True, timeout=300)
        return np.load(Path(tmp) / "logits.npy")


def step_device(args, sizes: Sizes, out: Path):
    """Each model at the policy on the CPU and on the device (the GPU; the CPU in a dry run), on one
    target: bitwise or not, and the device's logits judged against the CPU's by the probes' one judge
    (compare_case: drift within M x the CPU's own error vs the float64 twin + the floor)."""
    from compare.adapters.ours import host_array
    from compare.probes import compare_case
    from compare.probes.invariance import make_judge
    from compare.probes.models import as_probe_model, fp64_twin, logits_of
    from llamaspec import LlamaConfig
    cfg = LlamaConfig.from_file(Path(args.checkpoint) / "config.json")
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, (1, sizes.target_len))
    content = {"policy": sizes.policy, "tokens": sizes.target_len, "method": "direct: the logits of one target",
               "oracle": "torchref's float64 twin on the CPU (the policy's rounded weights)", "models": [],
               "where": None}
    section = Section(out, "device", content)
    cpu_ref = load("torchref", args.checkpoint, sizes.policy, "default", device="cpu")
    oracle = logits_of(fp64_twin(cpu_ref), ids, np.ones_like(ids))

    for impl in args.impl:
        def fill(entry, impl=impl):
            here = load(impl, args.checkpoint, sizes.policy, "default")
            entry["device"] = here.plan.device
            on_device = host_array(here(ids))[0]
            on_cpu = host_array(cpu_ref(ids))[0] if impl == "torchref" else _jax_on_cpu(args, sizes, ids)[0]
            judge = make_judge(as_probe_model(here, oracle=lambda i, attention_mask=None: oracle), ids, on_cpu)
            c = compare_case(f"CPU vs {entry['device']}", "device", 1, on_device.astype(on_cpu.dtype), on_cpu, judge)
            entry.update(bitwise=c.bitwise_equal, kind=c.kind, max_abs=c.max_abs, rel_l2=c.rel_l2,
                         cpu_vs_fp64=judge.rounding_rel, reason=c.reason)
            print(f"  {impl}: CPU vs {entry['device']}: {c.kind}, max abs {c.max_abs:.3g}", flush=True)
        content["models"].append(_model_entry(impl, "default", sizes.policy, fill))
        section.write()
    content["where"] = _where_device(args, sizes, out)
    section.write()


def _where_device(args, sizes: Sizes, out: Path) -> dict | None:
    """`probe where --circumstance device` for torchref (the first tap and op where the CPU and the
    device part) where this tree has it: against the GPU, or in a dry run an instruction-set cap. In
    this process: torch's CUDA matmul settings are the ones the policy needs (cuda_settings_for); a
    fresh process has torch's defaults, which torchref refuses on CUDA (reduced-precision reductions)."""
    from compare.probes.where_plan import CIRCUMSTANCES
    from llama_parity.cli import main as cli
    if "device" not in CIRCUMSTANCES or "torchref" not in args.impl:
        return {"skipped": "this tree has no probe where --circumstance device"}
    other = ["--other-device", "cap"] if args.dry_run or torch_device() == "cpu" else ["--other-device", "gpu"]
    path = out / "where-device.json"
    argv = ["probe", "where", "--checkpoint", args.checkpoint, "--impl", "torchref", "--policy", sizes.policy,
            "--circumstance", "device", *other, "--length", str(sizes.target_len), "--json", str(path), "--force",
            "--no-colour"]
    try:
        rc = cli(argv)
    except Exception as e:  # noqa: BLE001 - recorded; the direct comparison above stands
        return {"command": " ".join(argv), "error": f"{type(e).__name__}: {e}"}
    if not path.is_file():
        return {"command": " ".join(argv), "error": f"exit {rc}, no JSON"}
    res = json.loads(path.read_text())["results"]
    return {"command": " ".join(argv), "exit": rc,
            "results": [{k: x.get(k) for k in ("impl", "policy", "verdict", "hint")} for x in res]}


# ----- roofline, sharding: the benchmarks' own scripts, their JSON folded in

def step_roofline(args, sizes: Sizes, out: Path):
    from bench import bench_roofline
    path = out / "roofline.json"
    rc = bench_roofline.main([*sizes.roofline, "--out", str(path)])
    doc = json.loads(path.read_text())
    rows = [{k: r.get(k) for k in ("policy", "case", "impl", "median_s", "first_s", "roofline_s", "x_roofline")}
            for r in doc["results"]]
    Section(out, "roofline", {"shape": doc["shape"], "device": doc["device"], "peak_flops_s": doc["peak_flops_s"],
                              "hbm_bytes_s": doc["hbm_bytes_s"], "note": DRY_PEAKS_NOTE if args.dry_run else "",
                              "rows": rows})
    return rc


def step_sharding(args, sizes: Sizes, out: Path):
    path = out / "sharding.json"
    r = subprocess.run([sys.executable, "-m", "bench.bench_sharding", "--checkpoint", args.checkpoint,
                        *sizes.sharding, "--out", str(path)])
    doc = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    Section(out, "sharding", {"platform": doc.get("platform"), "rows": doc["rows"]})
    return r.returncode


# ----- agreement (optional): both models vs an fp64 oracle at every precision

def step_agreement(args, sizes: Sizes, out: Path):
    import torch

    import jaxmodel
    import torchref
    from compare.metrics import rel_l2
    device = torch_device()
    ids = np.random.default_rng(1).integers(3, 90 if args.dry_run else 49152, (2, 32 if args.dry_run else 256))
    oracle = np.asarray(torchref.from_pretrained(args.checkpoint, policy="fp64", device=device)(ids).cpu())
    rows = []
    for policy in ("fp64", "fp32", "tf32", "bf16"):
        if device == "cuda":
            cuda_settings_for(torch, policy)   # torchref checks them at each call, never sets them
        got = {"torchref": torchref.from_pretrained(args.checkpoint, policy=policy, device=device)(ids).cpu(),
               "jaxmodel": jaxmodel.from_pretrained(args.checkpoint, policy=policy)(ids)}
        got = {k: np.asarray(v, np.float64) for k, v in got.items()}
        row = {"policy": policy, "torchref_vs_oracle": rel_l2(got["torchref"], oracle),
               "jaxmodel_vs_oracle": rel_l2(got["jaxmodel"], oracle),
               "jax_vs_torch": rel_l2(got["jaxmodel"], got["torchref"])}
        row["pass"] = (row["jax_vs_torch"] <= BOUNDS["fp64"] if policy == "fp64" else
                       max(row["torchref_vs_oracle"], row["jaxmodel_vs_oracle"]) <= BOUNDS[policy])
        rows.append(row)
        print(f"  {policy}: {row}", flush=True)
    Section(out, "agreement", {"rows": rows})
    return 0 if all(r["pass"] for r in rows) else 1


def cuda_settings_for(torch, policy: str) -> None:
    """This script's own process: torch's CUDA matmul settings as `policy` needs them (TF32 only for
    tf32; no reduced-precision reductions: every policy here sums in f32 or wider). The environment
    and the determinism record read them after."""
    mm = torch.backends.cuda.matmul
    mm.fp32_precision = "tf32" if policy == "tf32" else "ieee"
    mm.allow_bf16_reduced_precision_reduction = False
    mm.allow_fp16_reduced_precision_reduction = False


# ----------------------------------------------------------------- the summary

def _g(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def _models_rows(doc: dict, step: str) -> list[list[str]]:
    rows = []
    for e in doc.get(step, {}).get("models", []):
        what = f"{e['impl']} {e['policy']} {e['mode']}"
        if e.get("error"):
            rows.append([step, what, f"error: {e['error'][:110]}"])
            continue
        groups = {}
        for c in e["cases"]:
            groups.setdefault(c["group"], []).append(c["bitwise"])
        by = ", ".join(f"{g} {sum(v)}/{len(v)}" for g, v in groups.items())
        result = f"{e['bitwise']}/{e['total']} bitwise ({by}); max abs {_g(e['max_abs'])}"
        if "rerun" in e:
            result += f"; rerun {'bitwise' if e['rerun']['bitwise'] else 'differs'}"
        rows.append([step, f"{what} on {e['device']}", result])
        rows.append(["", "  path", e["path"][:120]])
    return rows


# The determinism settings the table shows (the JSON holds them all).
SUMMARY_SETTINGS = ("XLA_FLAGS", "XLA_FLAGS --xla_gpu_deterministic_ops", "XLA_FLAGS --xla_gpu_autotune_level",
                    "CUBLAS_WORKSPACE_CONFIG", "torch deterministic algorithms", "torch cuda matmul fp32_precision",
                    "torch bf16 reduced-precision reduction", "jax_default_matmul_precision")


def summary_rows(doc: dict) -> list[list[str]]:
    """[step, what, result] rows of the table, from the JSON."""
    rows = [["steps", name, f"{s['status']} ({s['seconds']:.0f} s of {s['limit_s']} s)"]
            for name, s in doc.get("steps", {}).items()]
    det = doc.get("determinism", {})
    if det:
        gpu = det.get("gpu settings", "")
        rows.append(["determinism", "gpu settings", "no GPU: recorded as set, deciding nothing here"
                     if gpu.startswith("no GPU") else gpu])
        rows += [["determinism", k, str(det[k])[:80]] for k in SUMMARY_SETTINGS if k in det]
    rows += _models_rows(doc, "invariant") + _models_rows(doc, "default")
    for e in doc.get("cost", {}).get("rows", []):
        if e.get("error"):
            rows.append(["cost", e["impl"], f"error: {e['error'][:110]}"])
        for r in e.get("rows", []):
            p, d, x = r["prefill_ms"], r["decode_ms_per_token"], r["ratio"]["invariant"]
            rows.append(["cost", f"{e['impl']} {e['policy']} B={r['batch']}, default -> invariant",
                         f"prefill {p['default']:.1f} -> {p['invariant']:.1f} ms ({x['prefill']:.2f}x); "
                         f"decode {d['default']:.1f} -> {d['invariant']:.1f} ms/token ({x['decode']:.2f}x)"])
    dev = doc.get("device", {})
    for e in dev.get("models", []):
        result = (f"error: {e['error'][:110]}" if e.get("error") else
                  f"{e['kind']}{' (bitwise)' if e['bitwise'] else ''}; max abs {_g(e['max_abs'])}, "
                  f"rel {_g(e['rel_l2'])} (CPU vs fp64 {_g(e['cpu_vs_fp64'])})")
        rows.append(["device", f"{e['impl']} {e['policy']}: CPU vs {e.get('device', '?')}", result])
    where = dev.get("where") or {}
    for r in where.get("results", []):
        rows.append(["device", f"probe where {r['impl']} {r['policy']}", f"{r['verdict']}: {str(r['hint'])[:110]}"])
    if where.get("skipped") or where.get("error"):
        rows.append(["device", "probe where --circumstance device", where.get("skipped") or where.get("error")])
    for r in doc.get("roofline", {}).get("rows", []):
        unit = "ms" if r["case"].startswith("prefill") else "ms/token"
        rows.append(["roofline", f"{r['impl']} {r['policy']} {r['case']}",
                     f"{r['median_s'] * 1e3:.2f} {unit}, x roofline {_g(r['x_roofline'], '.2f')}"])
    for r in doc.get("sharding", {}).get("rows", []):
        rows.append(["sharding", f"{r['policy']} {r['variant']}",
                     f"{r['median_s'] * 1e3:.1f} ms ({r['x_one_device']:.2f}x one device); logits "
                     f"{'bitwise' if r['logits_bitwise_one_device'] else 'differ from'} one device"])
    return rows


def format_summary(doc: dict) -> str:
    rows = doc.get("summary") or summary_rows(doc)
    w0, w1 = (max(len(r[i]) for r in rows) if rows else 8 for i in (0, 1))
    head = (f"GPU check{' (DRY RUN on the CPU)' if doc.get('dry_run') else ''}: commit {doc.get('commit')}, "
            f"{doc.get('seconds', 0):.0f} s; GPU: {doc.get('environment', {}).get('record', {}).get('gpu', '?')}")
    return "\n".join([head] + [f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}" for r in rows])


if __name__ == "__main__":
    sys.exit(main())
