"""jaxmodel's one-row products of 16-bit policies on the fixed-order kernel (the fast backend's
kernel_matvecs, chosen by plan.py):
the rule, that a batch-1 decode step's products really take it and nothing else does, the
arithmetic (the policy's products, summed in f32 within the f32 summation bound) and the
ladder's verdict on a batch-1 decode (drift, never a bug)."""

import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from llamaspec import Policy

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the kernel is CPU code")


def _kernels_build() -> bool:
    from jaxmodel import kernels
    from llamaspec.errors import InvarianceError
    try:
        kernels.library()
    except InvarianceError:
        return False
    return True


needs_kernels = pytest.mark.skipif(not _kernels_build(), reason="the fixed-order kernels cannot be built here")


def _fast(policy="bf16"):
    from jaxmodel import plan
    return plan.load(policy, "cpu", "fast")


@needs_kernels
def test_rule_by_policy_and_variable(monkeypatch):
    """auto: 16-bit compute with f32 sums only (bf16, fp16), on a kernel code path of AVX2 or
    better (the default here unless $LLAMA_PARITY_KERNEL_ISA says scalar); reference: never;
    kernel: any 16-bit policy; the plan says which; a bad value names the variable."""
    from jaxmodel import kernels, plan
    from llamaspec import fixed_order as fo
    from llamaspec.errors import PolicyError
    fast = kernels.library().fo_isa() >= fo.ISAS["avx2"]
    for choice, want in (("auto", fast), ("kernel", True), ("reference", False)):
        monkeypatch.setenv(plan.PRODUCTS_ENV, choice)
        ops = _fast()[1]
        for name in ("bf16", "fp16"):
            assert ops.kernel_matvecs(Policy.get(name)) is want, (choice, name)
        for name in ("fp32", "bf16w-f32", "fp64", "fp64-hf", "tf32"):
            assert not ops.kernel_matvecs(Policy.get(name)), (choice, name)
        assert not ops.kernel_matvecs(Policy.get("bf16", accum_dtype="float64")), choice
        made = _fast()[0]
        assert (plan.PRODUCTS_ENV, choice) in made.settings
        assert ("fixed-order kernel" in made.op("products")) is want
    monkeypatch.setenv(plan.PRODUCTS_ENV, "fast")
    with pytest.raises(PolicyError, match=plan.PRODUCTS_ENV):
        _fast()


@needs_kernels
@pytest.mark.parametrize("isa,want", [("scalar", False), ("avx2", True)])
def test_rule_follows_the_kernels_code_path(isa, want):
    """The rule reads the kernel's code path, which is fixed per process: a fresh one under each cap
    (the scalar path is the program's definition, not a fast one)."""
    code = ("from jaxmodel.plan import load; from llamaspec import Policy; "
            "print(load('bf16', 'cpu', 'fast')[1].kernel_matvecs(Policy.get('bf16')))")
    env = {**os.environ, "LLAMA_PARITY_KERNEL_ISA": isa}
    env.pop("LLAMA_PARITY_PRODUCTS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(want), out.stdout


def _operands(n, k, seed, dtype=ml_dtypes.bfloat16):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(dtype)
    x = rng.standard_normal((1, 1, k)).astype(dtype)
    return x, w


@needs_kernels
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(1, 7), (40, 576), (33, 1536)])
def test_one_row_product_is_the_policys_within_the_f32_bound(policy, n, k, monkeypatch):
    """The fast linear with a Weight that keeps a matvec copy: one row goes to the kernel, the
    exact products of the 16-bit operands summed in f32, so within k * 2^-24 * sum|x w| of the
    f64 sum (the bound of any f32 summation order); XLA's widened dot is within it too, and a
    product of two rows does not take the kernel (the same bits as without the copy). The bias is
    added in f32 after the sums."""
    import jax.numpy as jnp

    from jaxmodel import fast, kernels
    ops = fast.Fast()
    pol = Policy.get(policy)
    dtype = ml_dtypes.bfloat16 if policy == "bf16" else np.float16
    x, w = _operands(n, k, seed=n + k, dtype=dtype)
    b = np.random.default_rng(1).standard_normal(n).astype(dtype)
    calls = []
    real = kernels.gemm
    monkeypatch.setattr(kernels, "gemm", lambda *a: calls.append(a[1].n) or real(*a))
    kept = fast.Weight(jnp.asarray(w.astype(np.float32)), None, kernels.PackedWeight.widening(w))
    plain = fast.Weight(jnp.asarray(w.astype(np.float32)))
    exact = x.astype(np.float64)[0] @ w.astype(np.float64).T
    bound = k * 2.0 ** -24 * (np.abs(x.astype(np.float64)[0]) @ np.abs(w.astype(np.float64)).T)
    for weight in (kept, plain):
        y = np.asarray(ops.linear_sums(jnp.asarray(x), weight, pol), np.float64)[0]
        assert np.all(np.abs(y - exact) <= bound), np.max(np.abs(y - exact) - bound)
    assert calls == [n]
    y = np.asarray(ops.linear(jnp.asarray(x), kept, jnp.asarray(b), pol, "float32"), np.float64)[0]
    want = np.asarray(ops.linear_sums(jnp.asarray(x), kept, pol), np.float64)[0] + b.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=2.0 ** -23, atol=0)
    assert calls == [n, n, n]   # linear with the bias and its sums alone
    two = np.concatenate([x, x[:, :, ::-1]], 1)
    np.testing.assert_array_equal(np.asarray(ops.linear_sums(jnp.asarray(two), kept, pol)),
                                  np.asarray(ops.linear_sums(jnp.asarray(two), plain, pol)))
    assert calls == [n, n, n]   # none for two rows


@needs_kernels
@pytest.mark.parametrize("config", ["tied", "bias"])
def test_batch_one_decode_steps_take_the_kernel_and_nothing_else_does(config, tiny_dir, monkeypatch):
    """A bf16 model keeps a matvec copy of each matrix (lm_head included) beside the widened one;
    a batch-1 decode step's program multiplies every one of them on the kernel, a batch-1 prefill
    only its last position's logits, and nothing else does: not a batch-3 step or prefill. With
    $LLAMA_PARITY_PRODUCTS=reference no copy is kept and the kernel is never called. (Forced with "kernel":
    whether auto takes it is the rule's test.)"""
    from flax import nnx

    import jaxmodel
    from jaxmodel import fast, kernels, plan
    from jaxmodel.model import clear_programs
    from llamaspec import load_weights
    cfg, w = load_weights(tiny_dir(config))
    matrices = 7 * cfg.num_hidden_layers + 1
    calls = []
    real = kernels.gemm
    monkeypatch.setattr(kernels, "gemm", lambda *a: calls.append(a[1].n) or real(*a))
    ids = np.random.default_rng(2).integers(3, 96, (3, 9))
    for choice in ("kernel", "reference"):
        monkeypatch.setenv(plan.PRODUCTS_ENV, choice)
        on = choice == "kernel"
        clear_programs()   # traced again, through the spy
        m = jaxmodel.from_weights(cfg, w, "bf16")
        copies = [v for _, v in nnx.to_flat_state(nnx.filter_state(m.state, nnx.Param))
                  if isinstance(v.get_value(), fast.Weight) and v.get_value().matvec is not None]
        assert len(copies) == (matrices if on else 0)
        calls.clear()
        first, cache = m.prefill(ids, np.ones_like(ids), 12)
        m.decode(cache, first.argmax(-1))
        assert calls == []
        one, cache = m.prefill(ids[:1], np.ones_like(ids[:1]), 12)
        assert calls == ([cfg.vocab_size] if on else [])   # the last position's logits: one row
        calls.clear()
        m.decode(cache, one.argmax(-1))
        assert len(calls) == (matrices if on else 0)
        assert calls.count(cfg.vocab_size) == (1 if on else 0)
    clear_programs()


@needs_kernels
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_batch_one_decode_on_the_kernel_is_drift_at_every_step(policy, tiny_dir):
    """The ladder on a batch-1 decode (each step's taps against the oracle's full recompute):
    jaxmodel's kernel products are drift against torchref's, never a bug or a precision step."""
    from compare import compare_decode
    ids = np.random.default_rng(4).integers(3, 96, (1, 11))
    report = compare_decode("torchref", "jaxmodel", tiny_dir("gqa"), inputs=(ids, np.ones_like(ids)), steps=6,
                            policy=policy)
    assert all(s.verdict in ("exact", "drift") for s in report.per_step), report.summary()
    assert report.first_step is None


def test_widening_pack_takes_16_bit_weights_only():
    from jaxmodel import kernels
    with pytest.raises(ValueError, match="bf16 or f16"):
        kernels.PackedWeight.widening(np.ones((3, 4), np.float32))
