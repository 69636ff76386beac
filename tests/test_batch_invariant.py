"""Batch-invariant mode, both models: a sequence's logits and greedy completion are bitwise
the same alone and inside batches (random companions of equal and mixed lengths, any row,
left/right/interior padding); the mode computes the same function as the default one."""

import importlib

import numpy as np
import pytest

from compare.metrics import rel_l2
from llamaspec import InputError

FRAMEWORKS = ["torchref", "jaxmodel"]
VOCAB, TARGET_LEN, WIDTH = 96, 11, 16  # canonical widths stay 16: few JAX compiles


def load(framework, folder, policy, batch_invariant=True):
    return importlib.import_module(framework).from_pretrained(
        folder, policy=policy, batch_invariant=batch_invariant)


def bits(x) -> np.ndarray:
    """The raw bits of an array (bf16 and f32 alike), so -0.0 != 0.0 and NaN == NaN."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def batch_with(target, B, row, padding, lengths, rng):
    """[B, WIDTH] ids and mask: `target` in row `row`, random companions of `lengths`."""
    ids = rng.integers(3, VOCAB, (B, WIDTH))
    mask = np.zeros((B, WIDTH), np.int64)
    for b in range(B):
        n = len(target) if b == row else int(lengths[b])
        if padding == "right":
            slots = np.arange(n)
        elif padding == "left":
            slots = np.arange(WIDTH - n, WIDTH)
        else:  # interior: real tokens at random slots, in order
            slots = np.sort(rng.choice(WIDTH, n, replace=False))
        mask[b, slots] = 1
        if b == row:
            ids[b, slots] = target
    return ids, mask


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_logits_are_bitwise_invariant_to_batch_row_and_padding(framework, policy, tiny_dir):
    m = load(framework, tiny_dir(), policy)
    rng = np.random.default_rng(1)
    target = rng.integers(3, VOCAB, TARGET_LEN)
    alone = bits(m(target[None]))[0]
    cases = [(3, "equal"), (3, "mixed"), (8, "mixed")]
    for B, kind in cases:
        for padding in ("right", "left", "interior"):
            row = int(rng.integers(B))
            lengths = (np.full(B, TARGET_LEN) if kind == "equal"
                       else rng.integers(1, WIDTH + 1, B))
            ids, mask = batch_with(target, B, row, padding, lengths, rng)
            got = bits(m(ids, mask))[row][mask[row].astype(bool)]
            assert np.array_equal(got, alone), \
                f"{framework}/{policy}: B={B} {kind} lengths, row {row}, {padding} padding"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_greedy_generation_is_invariant_to_batching(framework, policy, tiny_dir):
    m = load(framework, tiny_dir(), policy)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, n) for n in (11, 5, 16, 9)]
    alone = [m.generate(p[None], max_new_tokens=6, eos_token_ids=[])[0] for p in prompts[:2]]
    ids, mask = np.zeros((4, 16), np.int64), np.zeros((4, 16), np.int64)
    for b, p in enumerate(prompts):  # right-padded: generate left-aligns them itself
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    together = m.generate(ids, mask, max_new_tokens=6, eos_token_ids=[])
    for b in range(2):
        assert np.array_equal(together[b], alone[b]), f"{framework}/{policy}: prompt {b}"
    swapped = m.generate(ids[::-1].copy(), mask[::-1].copy(), max_new_tokens=6, eos_token_ids=[])
    assert np.array_equal(swapped[::-1], together)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_decode_logits_are_bitwise_invariant_in_large_batches(framework, tiny_dir):
    """SmolLM2's attention shape (9 query heads, 3 kv heads, head_dim 64): decode at 8 and
    16 rows is where XLA once moved the softmax to YNNPACK and broke jaxmodel's invariance
    (dtypes._INVARIANT_OPTIONS); the 4-row tests above stayed under that size."""
    folder = tiny_dir("gqa", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=None, intermediate_size=64, num_hidden_layers=1)
    m = load(framework, folder, "fp32")
    rng = np.random.default_rng(5)
    target, steps = rng.integers(3, VOCAB, 9), [7, 31, 64]

    def decode_logits(B):
        lengths = [len(target)] + list(rng.integers(1, 40, B - 1))
        W = max(lengths)
        ids, mask = rng.integers(3, VOCAB, (B, W)), np.zeros((B, W), np.int64)
        for b, n in enumerate(lengths):  # left-padded, as prefill wants
            mask[b, W - n:] = 1
        ids[0, W - len(target):] = target
        logits, cache = m.prefill(ids, mask, W + len(steps))
        out = [bits(logits)[0]]
        for t in steps:
            nxt = rng.integers(3, VOCAB, B)
            nxt[0] = t
            logits, cache = m.decode(cache, nxt)
            out.append(bits(logits)[0])
        return out

    alone = decode_logits(1)
    for B in (8, 16):
        for step, (got, want) in enumerate(zip(decode_logits(B), alone)):
            assert np.array_equal(got, want), f"{framework}: B={B}, decode step {step}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_invariant_mode_computes_the_same_function(framework, tiny_dir):
    """fp64: only the summation order differs from the default mode; capture and teacher
    forcing work in the caller's layout (zeros on padding slots)."""
    folder = tiny_dir()
    rng = np.random.default_rng(3)
    ids = rng.integers(3, VOCAB, (2, 18))
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    real = mask.astype(bool)
    ref = load(framework, folder, "fp64", batch_invariant=False)
    inv = load(framework, folder, "fp64")
    want, want_acts = ref.capture(ids, mask, taps=["layers.1.out"])
    got, acts = inv.capture(ids, mask, taps=["layers.1.out"])
    assert rel_l2(got[real], want[real]) < 1e-12
    assert rel_l2(acts["layers.1.out"][real], want_acts["layers.1.out"][real]) < 1e-12
    assert not got[~real].any()
    forced, _ = inv.capture(ids, mask, taps=[], inject={1: want_acts["layers.1.out"]})
    assert np.isfinite(forced).all()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_too_long_for_invariant_mode_is_a_clear_error(framework, tiny_dir):
    """Dynamic NTK RoPE may run past max_position_embeddings by default, not here."""
    m = load(framework, tiny_dir("dynamic"), "fp32")
    with pytest.raises(InputError, match="max_position_embeddings=128"):
        m(np.full((1, 129), 5))
    with pytest.raises(InputError, match="max_position_embeddings=128"):
        m.generate(np.full((1, 120), 5), max_new_tokens=9)


@pytest.mark.smollm2
def test_torchref_bf16_logits_do_not_depend_on_the_cache_length(smollm2):
    """A row's prefill logits must not change with the cache's length: its keys are then
    a slice of a longer buffer, and torch's bf16 matmul sums in another order for another
    operand layout (found by the 100-completion greedy run: one rounding in layer 24 moved
    the logits by 0.44 when companions and new tokens passed 128 slots)."""
    m = load("torchref", smollm2, "bf16")
    rng = np.random.default_rng(0)
    target, companion = rng.integers(3, 49152, 37), rng.integers(3, 49152, 67)
    ids, mask = np.zeros((2, 67), np.int64), np.zeros((2, 67), np.int64)
    ids[0, 30:], mask[0, 30:] = target, 1
    ids[1], mask[1] = companion, 1
    short, _ = m.prefill(ids, mask, 128)   # a 128-slot cache: attention reads all of it
    long, _ = m.prefill(ids, mask, 129)    # 192 slots: attention reads the first 128
    assert np.array_equal(bits(long[0]), bits(short[0]))


# ----- torchref's linears on llamaspec.fixed_order (torchref/invariant.py) ------------------

def _f32():
    from llamaspec import Policy
    return Policy.get("fp32")


@pytest.mark.parametrize("n_out, n_in", [(48, 32), (96, 64), (576, 576)])
def test_torchref_f32_linear_gives_a_row_one_result_at_every_row_count(n_out, n_in):
    """What fixed_order guarantees, through torchref's linear: a row alone and at any
    position of any row count up to 300 gets the same bits."""
    import torch

    from torchref import invariant
    g = torch.Generator().manual_seed(n_out)
    w, b = torch.randn(n_out, n_in, generator=g), torch.randn(n_out, generator=g)
    x = torch.randn(300, n_in, generator=g)
    alone = torch.cat([invariant.linear(x[i:i + 1], w, b, _f32()) for i in range(300)])
    for start, rows in [(0, 300), (0, 2), (5, 3), (17, 4), (40, 13), (101, 64), (299, 1)]:
        assert torch.equal(invariant.linear(x[start:start + rows], w, b, _f32()), alone[start:start + rows])


def test_torchref_stacked_projections_equal_separate_ones():
    """linears() runs q/k/v (gate/up) as one product: the same bits as one call per weight."""
    import torch

    from torchref import invariant
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 64, generator=g) for n in (64, 16, 16)]
    x = torch.randn(5, 64, generator=g)
    for got, w in zip(invariant.linears(x, ws, [None] * 3, _f32()), ws):
        assert torch.equal(got, invariant.linear(x, w, None, _f32()))


def test_torchref_packed_weights_follow_changes_to_the_weight():
    """The packed copy of a weight is made once: a weight changed in place or replaced must
    be packed again, never served stale; a dead weight's copy is freed."""
    import gc

    import torch

    from torchref import fast, invariant
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(24, 32, generator=g), torch.randn(3, 32, generator=g)
    before = invariant.linear(x, w, None, _f32())
    with torch.no_grad():
        w.mul_(2)
    after = invariant.linear(x, w, None, _f32())
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(after, invariant.linear(x, w.clone(), None, _f32()))
    n = len(fast._KEPT)
    del w
    gc.collect()
    assert len(fast._KEPT) < n


@pytest.mark.parametrize("op", ["linear", "silu"])
def test_torchref_self_check_catches_an_order_changing_kernel_and_names_it(op, tiny_dir, monkeypatch):
    """The self-check at load: a kernel whose summation order changes with the row count
    (planted here) makes from_pretrained refuse, naming the operation."""
    import torch

    from llamaspec.errors import InvarianceError
    from torchref import invariant, portable
    if op == "linear":
        def gemm(x, packed):  # sums k in two halves once there is more than one row
            K = x.shape[1]
            w = packed.data.view(-1, K, 16).transpose(1, 2).reshape(-1, K)[:packed.n].to(x.dtype)
            h = K // 2
            return x @ w.T if x.shape[0] == 1 else x[:, :h] @ w[:, :h].T + x[:, h:] @ w[:, h:].T
        monkeypatch.setattr(invariant, "_gemm", gemm)
        named = "linear q/k/v"
    else:
        exp = invariant._exp
        monkeypatch.setattr(invariant, "_exp", lambda x: exp(x) if x.numel() < 200 else torch.exp(x) * 1.0000001)
        named = "silu"
    monkeypatch.setattr(portable, "_CHECKED", set())     # the one self-check (torchref.portable's)
    with pytest.raises(InvarianceError, match=f"self-check failed on this machine: {named} gives a row"):
        load("torchref", tiny_dir(), "fp32")


def test_jaxmodel_self_check_catches_an_order_changing_op_and_names_it(tiny_dir, monkeypatch):
    """jaxmodel's self-check at load: an op whose result changes with the row count
    (planted: silu computed another way once the batch has more than one row) makes
    from_pretrained refuse, naming it."""
    import jax
    import jax.numpy as jnp

    from jaxmodel import invariant, portable
    from llamaspec.errors import InvarianceError
    monkeypatch.setattr(invariant, "silu", lambda x: x * jax.nn.sigmoid(x) if x.shape[0] == 1
                        else x / (1 + jnp.exp(-x)))
    monkeypatch.setattr(portable, "_CHECKED", set())     # the one self-check (jaxmodel.portable's)
    with pytest.raises(InvarianceError, match="self-check failed on this machine: silu gives a row"):
        load("jaxmodel", tiny_dir(), "fp32")


def test_torchref_invariant_model_sees_a_replaced_weight(tiny_dir):
    """A control that swaps a Linear's weight on a loaded invariant model (compare/controls.py
    does this on default models) changes its output, as in the default mode."""
    import torch
    m, d = load("torchref", tiny_dir(), "fp32"), load("torchref", tiny_dir(), "fp32", False)
    ids = np.random.default_rng(0).integers(3, VOCAB, (2, WIDTH))
    before = m(ids)
    for model in (m, d):
        proj = model.model.layers[0].mlp.up_proj
        proj.weight = torch.nn.Parameter(proj.weight.flip(0), requires_grad=False)
    got, want = m(ids).float().numpy(), d(ids).float().numpy()
    assert not np.array_equal(bits(before), bits(m(ids)))
    assert rel_l2(got, want) < 1e-5


# ----- jaxmodel's fixed-order kernels through XLA's FFI (jaxmodel/kernels.py) ------------

@pytest.mark.parametrize("compute", ["float32", "bfloat16", "float64"])
def test_jaxmodel_ffi_products_are_the_same_program_as_the_ctypes_ones(compute):
    """One program, two doors: XLA's FFI gives the bits llamaspec.fixed_order gives, at
    any row count, through XLA's thread pool."""
    import jax
    import ml_dtypes

    from jaxmodel import kernels
    from llamaspec import fixed_order as fo
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1000, 576))
    accum = "float64" if compute == "float64" else "float32"
    packed, wtype, x_dtype, acc = fo.pack_for(w, compute, accum)
    pw = kernels.PackedWeight.of(w, compute, accum)
    x = rng.standard_normal((300, 576)).astype(ml_dtypes.bfloat16 if x_dtype == "bfloat16" else x_dtype)
    want = fo.gemm_pairs(x, packed, 1000) if wtype == fo.BF16_PAIRS else fo.gemm(x, packed, 1000)
    f = jax.jit(kernels.gemm)
    for start, rows in [(0, 1), (7, 1), (3, 2), (40, 13), (0, 300)]:
        got = np.asarray(f(x[start:start + rows], pw))
        assert np.array_equal(bits(got), bits(want[start:start + rows])), (start, rows)


def test_jaxmodel_ffi_row_sums_and_exp_are_the_ctypes_programs():
    import jax

    from jaxmodel import kernels
    from llamaspec import fixed_order as fo
    x = np.random.default_rng(1).standard_normal((3, 70, 577)).astype(np.float32)
    assert np.array_equal(np.asarray(jax.jit(kernels.row_sums, static_argnums=1)(x, True)), fo.row_sums(x, True))
    assert np.array_equal(bits(np.asarray(jax.jit(kernels.exp)(x))), bits(fo.exp(x)))


def test_both_invariant_models_run_the_same_linear_program(tiny_dir):
    """torchref and jaxmodel in invariant mode multiply on the same kernels: one linear
    layer gives both the same bits (the models as a whole still differ where their
    frameworks round elementwise steps differently)."""
    import torch
    t, j = load("torchref", tiny_dir(), "bf16"), load("jaxmodel", tiny_dir(), "bf16")
    x = np.random.default_rng(2).standard_normal((5, 3, t.cfg.hidden_size)).astype(np.float32)
    pol = t.policy
    got_t = t.model.layers[0].mlp.up_proj(torch.from_numpy(x).bfloat16(), pol).float().numpy()
    import jax.numpy as jnp
    got_j = np.asarray(j.module.layers[0].mlp.up_proj(jnp.asarray(x, jnp.bfloat16), pol).astype(jnp.float32))
    assert np.array_equal(bits(got_t), bits(got_j))
