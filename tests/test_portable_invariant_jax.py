"""jaxmodel's portable invariant path (jaxmodel/portable.py), forced on this CPU with
LLAMA_PARITY_INVARIANT=portable: its element programs are llamaspec.portable's, bit for bit; a
sequence's logits, first decode step and greedy completion are bitwise the same alone and inside
batches (first, middle and last row, left and right padding, more rows than a product chunk);
the plan records the path; the self-check refuses a planted order change; tensor and data
parallel meshes on forced host devices give the one-device bits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llamaspec import left_align
from llamaspec import portable as spec
from llamaspec.errors import InvarianceError
from llamaspec.plan import INVARIANT_ENV, SettingError

VOCAB, TARGET_LEN, WIDTH = 96, 11, 16
ROWS = 16          # the plan's rows per product chunk on a CPU (checked below)
WORKER = Path(__file__).with_name("sharded_worker.py")


@pytest.fixture
def portable(monkeypatch):
    """The portable path forced for models loaded in the test."""
    monkeypatch.setenv(INVARIANT_ENV, "portable")


def load(folder, policy):
    import jaxmodel
    return jaxmodel.from_pretrained(folder, policy=policy, batch_invariant=True)


def bits(x) -> np.ndarray:
    """The raw bits of an array (bf16 and f32 alike), so -0.0 != 0.0."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def nan_bits(x) -> np.ndarray:
    """bits() with every NaN the same (which NaN an add passes on is the hardware's choice)."""
    x = np.asarray(x)
    return bits(np.where(np.isnan(x), np.array(np.nan, x.dtype), x))


# ----- the element programs against llamaspec.portable's numpy ------------------------------

def _flushes(dt) -> bool:
    """Whether XLA on this device flushes subnormal results to zero (XLA:CPU does: it runs its
    programs with the CPU's flush-to-zero and denormals-are-zero modes on)."""
    import jax
    import jax.numpy as jnp
    tiny = np.finfo(dt).tiny
    return float(jax.jit(lambda x: x * 0.5)(jnp.asarray(tiny, dt))) == 0.0


def _exp_inputs(dt) -> np.ndarray:
    rng = np.random.default_rng(0)
    lo, hi = spec.EXP_MIN[np.dtype(dt)], spec.EXP_MAX[np.dtype(dt)]
    edges = [lo, hi, np.nextafter(dt(lo), dt(0)), np.nextafter(dt(hi), dt(0)), np.nextafter(dt(lo), dt(-np.inf)),
             np.nextafter(dt(hi), dt(np.inf)), np.log(np.finfo(dt).tiny), 0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]
    return np.concatenate([rng.uniform(lo - 5, hi + 5, 20000), rng.standard_normal(5000) * 4,
                           rng.uniform(lo, np.log(np.finfo(dt).tiny), 2000),     # subnormal results
                           np.array(edges)]).astype(dt)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_exp_is_llamaspec_portables_program(dt):
    """Bitwise equal to the numpy definition over the range, at its edges, for NaN and +-inf,
    and where the result is subnormal, under the device's denormal mode (XLA:CPU flushes such
    results to zero, as it flushes every subnormal result). This holds only because no product
    of the program becomes part of an fma (portable._product: XLA's LLVM backends contract a
    multiply feeding an add)."""
    import jax

    import jaxmodel  # noqa: F401 (x64)
    from jaxmodel import portable
    from jaxmodel.dtypes import compiler_options
    x = _exp_inputs(dt)
    got = np.asarray(jax.jit(portable.exp, compiler_options=compiler_options(True))(x))
    want = spec.exp(x)
    subnormal = (want != 0) & (np.abs(want) < np.finfo(dt).tiny)
    assert subnormal.sum() > 1000 and np.isinf(want).any() and np.isnan(want).any() and (want == 0).any()
    if _flushes(dt):
        want = np.where(subnormal, dt(0), want)
    assert np.array_equal(nan_bits(got), nan_bits(want)), np.nonzero(nan_bits(got) != nan_bits(want))[0][:10]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_tree_sum_is_llamaspec_portables_program(dt):
    import jax

    import jaxmodel  # noqa: F401 (x64)
    from jaxmodel import portable
    from jaxmodel.dtypes import compiler_options
    rng = np.random.default_rng(1)
    f = jax.jit(portable.tree_sum, static_argnums=1, compiler_options=compiler_options(True))
    for n in (1, 2, 3, 7, 64, 576, 1000):
        x = (rng.standard_normal((40, n)) * 2.0 ** rng.integers(-30, 30, (40, n))).astype(dt)
        x[0, 0], x[1, -1], x[2, 0], x[3, :] = np.nan, np.inf, -np.inf, np.finfo(dt).max   # NaN, inf, overflow
        for axis in (-1, 0):
            with np.errstate(over="ignore"):
                want = spec.tree_sum(x, axis)
            assert np.array_equal(nan_bits(f(x, axis)), nan_bits(want)), (n, axis)
    # subnormal inputs: added as they are, or as zeros where the device treats them so
    tiny = np.finfo(dt).tiny
    x = np.array([[tiny / 2, tiny / 2], [tiny / 4, 1.0]], dt)
    want = spec.tree_sum(x)
    if _flushes(dt):
        want = np.array([0.0, 1.0], dt)
    assert np.array_equal(bits(f(x, -1)), bits(want))


# ----- the plan ----------------------------------------------------------------------------

def test_the_plan_records_the_path_and_its_rows(monkeypatch):
    from jaxmodel.plan import PORTABLE_ROWS, PORTABLE_ROWS_OTHER, make_plan
    assert PORTABLE_ROWS["cpu"] == ROWS
    monkeypatch.setenv(INVARIANT_ENV, "portable")
    plan = make_plan("bf16", "cpu", "invariant")
    assert plan.op("products").startswith(f"portable: one shape, rows in chunks of {ROWS} (16-bit operands widened")
    assert all(plan.op(op).startswith("portable") for op in ("logits", "attention", "norm", "mlp"))
    assert f"{INVARIANT_ENV}=portable" in plan.record()["settings"]
    monkeypatch.setenv(INVARIANT_ENV, "auto")     # here: the kernels where they build (x86), else portable
    here = make_plan("bf16", "cpu", "invariant")
    assert here.op("products").startswith("fixed-order kernel" if here.kernel_isa else "portable")
    # another device: the portable path, natively
    gpu = make_plan("bf16", "gpu", "invariant")
    assert gpu.op("products").startswith(f"portable: one shape, rows in chunks of {PORTABLE_ROWS_OTHER} "
                                         "(16-bit operands native, f32 accumulation)")
    monkeypatch.setenv(INVARIANT_ENV, "kernels")
    with pytest.raises(InvarianceError, match=f"{INVARIANT_ENV}=kernels: .* JAX's backend is gpu"):
        make_plan("bf16", "gpu", "invariant")
    monkeypatch.setenv(INVARIANT_ENV, "fastest")
    with pytest.raises(SettingError, match=f"{INVARIANT_ENV}='fastest': expected auto, kernels, portable"):
        make_plan("bf16", "cpu", "invariant")


# ----- the model ---------------------------------------------------------------------------

def _batch(target, B, row, padding, rng):
    """[B, WIDTH] ids and mask: `target` at row `row`, random companions of mixed lengths."""
    ids, mask = rng.integers(3, VOCAB, (B, WIDTH)), np.zeros((B, WIDTH), np.int64)
    for b in range(B):
        n = len(target) if b == row else int(rng.integers(1, WIDTH + 1))
        slots = np.arange(n) if padding == "right" else np.arange(WIDTH - n, WIDTH)
        mask[b, slots] = 1
        if b == row:
            ids[b, slots] = target
    return ids, mask


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(policy, tiny_dir, portable):
    """Logits of every token (17 x 16 rows: many product chunks), the first decode step (17 rows:
    more than one chunk) and the greedy completion, alone vs at the first, middle and last row of
    a batch of 17, right and left padded; and the same function as the default mode."""
    import jaxmodel
    folder = tiny_dir()
    m = load(folder, policy)
    assert m.plan.op("products").startswith(f"portable: one shape, rows in chunks of {ROWS}")
    rng = np.random.default_rng(1)
    target = rng.integers(3, VOCAB, TARGET_LEN)
    alone = bits(m(target[None]))[0]
    default = np.asarray(jaxmodel.from_pretrained(folder, policy=policy)(target[None])).astype(np.float64)
    got = np.asarray(m(target[None])).astype(np.float64)
    assert np.linalg.norm(got - default) <= (1e-5 if policy == "fp32" else 2e-2) * np.linalg.norm(default)
    first, cache = m.prefill(target[None], np.ones((1, TARGET_LEN), np.int64), TARGET_LEN + 4)
    step, _ = m.decode(cache, np.array([7]))
    greedy = m.generate(target[None], max_new_tokens=4, eos_token_ids=[])[0]
    for B, padding in ((17, "right"), (17, "left")):
        for row in (0, B // 2, B - 1):
            where = f"{policy}: B={B}, row {row}, {padding} padding"
            ids, mask = _batch(target, B, row, padding, rng)
            got = bits(m(ids, mask))[row][mask[row].astype(bool)]
            assert np.array_equal(got, alone), where
            logits, cache = m.prefill(*left_align(ids, mask), WIDTH + 4)   # prefill takes them left-padded
            assert np.array_equal(bits(logits[row]), bits(first[0])), where + ": prefill"
            nxt = rng.integers(3, VOCAB, B)
            nxt[row] = 7
            logits, _ = m.decode(cache, nxt)
            assert np.array_equal(bits(logits[row]), bits(step[0])), where + ": first decode step"
    ids, mask = _batch(target, 17, 9, "right", rng)
    together = m.generate(ids, mask, max_new_tokens=4, eos_token_ids=[])
    assert np.array_equal(together[9], greedy)


@pytest.mark.slow
def test_the_portable_path_computes_the_models_function(tiny_dir, portable):
    """At fp64 only the summation order differs from the default mode (1e-12)."""
    import jaxmodel
    folder = tiny_dir()
    ids = np.random.default_rng(3).integers(3, VOCAB, (2, 18))
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    want = np.asarray(jaxmodel.from_pretrained(folder, policy="fp64")(ids, mask))
    got = np.asarray(load(folder, "fp64")(ids, mask))
    real = mask.astype(bool)
    assert np.linalg.norm(got[real] - want[real]) <= 1e-12 * np.linalg.norm(want[real])


@pytest.mark.parametrize("planted", ["products", "exp"])
def test_the_self_check_refuses_a_planted_order_change(planted, tiny_dir, portable, monkeypatch):
    """An op whose result changes with the batch (planted: products summing K in two halves once
    there is more than one chunk; silu rounding otherwise once there is more than one row) makes
    from_pretrained refuse, naming the op."""
    import jax.numpy as jnp

    from jaxmodel import portable as pp
    if planted == "products":
        def products(x, w, policy, rows, widen):
            h = x.shape[1] // 2
            if x.shape[0] <= rows:
                return x.astype(jnp.float32) @ w.astype(jnp.float32).T
            return (x[:, :h].astype(jnp.float32) @ w[:, :h].astype(jnp.float32).T
                    + x[:, h:].astype(jnp.float32) @ w[:, h:].astype(jnp.float32).T)
        monkeypatch.setattr(pp, "products", products)
        named = "linear q_proj"
    else:     # the namespace's op (a class attribute: what the model calls)
        monkeypatch.setattr(pp.Portable, "silu", staticmethod(lambda x: pp.silu(x) if x.shape[0] == 1
                                                               else pp.silu(x) * (1 + 2.0 ** -20)))
        named = "silu"
    monkeypatch.setattr(pp, "_CHECKED", set())
    with pytest.raises(InvarianceError, match=f"self-check failed on this machine: {named} .*gives a row"):
        load(tiny_dir(), "fp32")


# ----- meshes ------------------------------------------------------------------------------

@pytest.mark.parametrize("meshes", [
    [{"data": 2, "tensor": 2}],
    pytest.param([{"tensor": 2}, {"tensor": 4}, {"data": 2}], marks=pytest.mark.slow)])
def test_tensor_and_data_parallel_meshes_give_the_one_device_bits(meshes, tmp_path):
    """The portable path on forced host devices (tests/sharded_worker.py, a process of its own):
    logits and greedy tokens on each mesh, bf16, bit for bit those of one device (weights whole on
    every device, each device's rows of the batch multiplied there; tensor=4 keeps each of the 2
    KV heads twice)."""
    from llamaspec.files import atomic_write
    from llamaspec.testing import make_checkpoint
    ckpt = make_checkpoint(tmp_path / "gqa", num_attention_heads=4, num_key_value_heads=2)
    job, out = tmp_path / "job.json", tmp_path / "out.npz"
    atomic_write(job, json.dumps({"checkpoint": str(ckpt), "devices": 4, "policies": ["bf16"],
                               "meshes": [None, *meshes], "invariant": True}), "sharding job")
    done = subprocess.run([sys.executable, str(WORKER), str(job), str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, INVARIANT_ENV: "portable", "PYTHONHASHSEED": "0"})
    assert done.returncode == 0, done.stderr[-4000:]
    r = dict(np.load(out))
    for mesh in meshes:
        name = ",".join(f"{k}={v}" for k, v in sorted(mesh.items()))
        for what in ("logits", "greedy"):
            assert np.array_equal(r[f"bf16|{name}|{what}"], r[f"bf16|none|{what}"]), (name, what)
