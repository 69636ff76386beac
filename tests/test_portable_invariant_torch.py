"""torchref's portable invariant path (torchref/portable.py) on the CPU, chosen by the plan's
setting (LLAMA_PARITY_INVARIANT=portable): its element programs give llamaspec.portable's numpy
bits, a sequence's logits, first generated step and greedy completion are bitwise the same alone
and inside batches (first, middle and last row, left and right padding, more rows than one
product call holds), the plan says which path runs, the self-check refuses an op whose result
changes with the row count, and both invariant paths compute the reference's function."""

import platform
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

import torchref
from compare.metrics import rel_l2
from llamaspec import portable as spec
from llamaspec.errors import InvarianceError, PolicyError
from llamaspec.plan import INVARIANT_ENV, SettingError
from torchref import plan as tplan
from torchref import portable

VOCAB = 96


@pytest.fixture
def use_portable(monkeypatch):
    monkeypatch.setenv(INVARIANT_ENV, "portable")


def load(folder, policy, backend="invariant"):
    return torchref.from_pretrained(folder, policy=policy, backend=backend)


def bits(x) -> np.ndarray:
    """The raw bits of an array (bf16 and f32 alike), so -0.0 != 0.0 and NaN == NaN."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def same_bits(got, want) -> bool:
    """Bitwise equal; NaNs compared as NaNs (their payloads are the hardware's, not the program's)."""
    got, want = np.asarray(got), np.asarray(want)
    nan = np.isnan(want)
    return np.array_equal(np.isnan(got), nan) and np.array_equal(bits(got)[~nan], bits(want)[~nan])


# ----- the element programs: torch gives llamaspec.portable's numpy bits ----------------------

def _values(dtype, n, rng) -> np.ndarray:
    """Random values over the whole range (random bit patterns, NaN and inf included), ordinary
    ones, and the edges of exp: overflow, underflow, results in the subnormal range, zeros."""
    uint = np.uint32 if dtype == np.float32 else np.uint64
    raw = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True).view(dtype)
    lo, hi = spec.EXP_MIN[np.dtype(dtype)], spec.EXP_MAX[np.dtype(dtype)]
    tiny = np.log(np.finfo(dtype).smallest_normal)             # below it: subnormal results
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, lo, hi, tiny], dtype)
    near = np.concatenate([np.nextafter(edges[5:], np.array(np.inf, dtype)),
                           np.nextafter(edges[5:], np.array(-np.inf, dtype))])
    return np.concatenate([raw, rng.uniform(lo - 2, hi + 2, n).astype(dtype),
                           rng.uniform(lo, tiny, n).astype(dtype), rng.standard_normal(n).astype(dtype),
                           edges, near])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_is_the_portable_program_bit_for_bit(dtype):
    x = _values(dtype, 50000, np.random.default_rng(0))
    assert x.size > portable.EXP_PIECE     # a CPU takes it in pieces: those too
    want = spec.exp(x)
    assert (want[(want > 0) & (want < np.finfo(dtype).smallest_normal)]).size > 100   # subnormal results seen
    assert same_bits(portable.exp(torch.from_numpy(x)).numpy(), want)


def test_exp_of_16_bit_inputs_is_the_f32_program_rounded_once():
    with np.errstate(invalid="ignore"):    # NaNs cast
        x = _values(np.float32, 5000, np.random.default_rng(1)).astype(ml_dtypes.bfloat16)
    want = spec.exp(x.astype(np.float32)).astype(ml_dtypes.bfloat16)
    got = portable.exp(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16))
    assert same_bits(got.view(torch.int16).numpy().view(ml_dtypes.bfloat16), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 5, 64, 577])
def test_tree_sum_is_the_portable_program_bit_for_bit(dtype, n):
    rng = np.random.default_rng(n)
    uint = np.uint32 if dtype == np.float32 else np.uint64
    wild = rng.integers(0, np.iinfo(uint).max, (40, n), dtype=uint, endpoint=True).view(dtype)  # inf, NaN, overflows
    top = 126 if dtype == np.float32 else 1022
    with np.errstate(over="ignore"):
        scaled = (rng.standard_normal((200, n)) * np.exp2(rng.integers(-150, top, (200, n)))).astype(dtype)
    for x in (wild, scaled, -np.abs(scaled) * 0.0):
        xt = np.ascontiguousarray(x.T)
        with np.errstate(over="ignore", invalid="ignore"):     # sums overflow; inf - inf
            want, want_t = spec.tree_sum(x), spec.tree_sum(xt, 0)
        assert same_bits(portable.tree_sum(torch.from_numpy(x)).numpy(), want)
        assert same_bits(portable.tree_sum(torch.from_numpy(xt), 0).numpy(), want_t)


def test_tree_dot_is_the_tree_sum_of_the_products():
    """tree_dot forms the tree's first level from halves: the same bits as the products' tree."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 8, 77):
        a, b = torch.randn(5, 1, n, generator=g), torch.randn(1, 4, n, generator=g)
        assert torch.equal(portable.tree_dot(a, b, 2), portable.tree_sum(a * b, 2))


# ----- the model: bitwise alone vs batched --------------------------------------------------

def batch_with(target, B, row, padding, rng, longest=18):
    """[B, longest] ids and mask: `target` in row `row`, companions of random lengths (so the
    canonical width, and with it where the target's tokens fall in a product's rows, varies)."""
    ids = rng.integers(3, VOCAB, (B, longest))
    mask = np.zeros((B, longest), np.int64)
    lengths = rng.integers(1, longest + 1, B)
    lengths[row] = len(target)
    for b, n in enumerate(lengths):
        slots = np.arange(n) if padding == "right" else np.arange(longest - n, longest)
        mask[b, slots] = 1
        if b == row:
            ids[b, slots] = target
    return ids, mask


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp64"])
def test_logits_are_bitwise_the_same_alone_and_in_batches(policy, tiny_dir, use_portable):
    m = load(tiny_dir(), policy)
    rng = np.random.default_rng(1)
    target = rng.integers(3, VOCAB, 11)
    alone = bits(m(target[None]))[0]
    for B in (2, 5, 17):            # 17 rows of sequences: several product calls of 16 rows
        for row in sorted({0, B // 2, B - 1}):
            for padding in ("left", "right"):
                ids, mask = batch_with(target, B, row, padding, rng)
                got = bits(m(ids, mask))[row][mask[row].astype(bool)]
                assert np.array_equal(got, alone), f"{policy}: B={B}, row {row}, {padding} padding"


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_first_generated_step_is_bitwise_the_same_alone_and_in_batches(policy, tiny_dir, use_portable):
    """prefill then one decode step: the target's logits at both, alone and at the first, middle
    and last row of batches (left-padded, as prefill takes them)."""
    m = load(tiny_dir(), policy)
    rng = np.random.default_rng(2)
    target, nxt = rng.integers(3, VOCAB, 9), 7

    def step(B, row):
        ids, mask = batch_with(target, B, row, "left", rng)
        logits, cache = m.prefill(ids, mask, ids.shape[1] + 1)
        new = rng.integers(3, VOCAB, B)
        new[row] = nxt
        after, _ = m.decode(cache, new)
        return bits(logits)[row], bits(after)[row]

    alone = step(1, 0)
    for B in (3, 17, 20):
        for row in sorted({0, B // 2, B - 1}):
            got = step(B, row)
            assert np.array_equal(got[0], alone[0]), f"{policy}: prefill, B={B}, row {row}"
            assert np.array_equal(got[1], alone[1]), f"{policy}: decode step, B={B}, row {row}"
    # the step decoded is the prompt and the token prefilled: the same bits (prefill vs decode)
    whole = np.append(target, nxt)[None]
    assert np.array_equal(bits(m.prefill(whole, np.ones_like(whole), whole.shape[1])[0])[0], alone[1])


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_greedy_completion_is_the_same_alone_and_in_a_batch(policy, tiny_dir, use_portable):
    m = load(tiny_dir(), policy)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, n) for n in (11, 5, 16, 9, 3)]
    alone = [m.generate(p[None], max_new_tokens=6, eos_token_ids=[])[0] for p in prompts[:2]]
    ids, mask = np.zeros((5, 16), np.int64), np.zeros((5, 16), np.int64)
    for b, p in enumerate(prompts):   # right-padded: generate left-aligns them itself
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    together = m.generate(ids, mask, max_new_tokens=6, eos_token_ids=[])
    swapped = m.generate(ids[::-1].copy(), mask[::-1].copy(), max_new_tokens=6, eos_token_ids=[])
    for b in range(2):
        assert np.array_equal(together[b], alone[b]), f"{policy}: prompt {b}"
    assert np.array_equal(swapped[::-1], together)


def _causal(lengths, width):
    """allowed [B, width, width] of the canonical layout: row b's keys at slots [0, lengths[b])."""
    slots = torch.arange(width)
    n = torch.tensor(lengths)[:, None, None]
    return (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < n)


def test_attention_gives_the_same_bits_in_pieces_of_any_size(monkeypatch):
    """Long prompts run in pieces of positions and key blocks, blocks no query of a piece may
    see left out: the same bits with one piece, alone and batched, and the reference's values."""
    from llamaspec import Policy
    from torchref import ops
    g = torch.Generator().manual_seed(0)
    lengths, width = [150, 90, 20], 152
    q, k, v = (torch.randn(3, width, h, 8, generator=g) for h in (4, 2, 2))
    allowed, pol = _causal(lengths, width), Policy.get("fp32")
    one_piece = portable.attention(q, k, v, allowed, pol)
    monkeypatch.setattr(portable, "PIECE", 1 << 12)
    computed, tree_dot = [], portable.tree_dot
    monkeypatch.setattr(portable, "tree_dot", lambda a, b, dim: computed.append(tree_dot(a, b, dim)) or computed[-1])
    pieces = portable.attention(q, k, v, allowed, pol)
    assert torch.equal(pieces, one_piece)
    blocks, queries = 3, width * 2        # key blocks (152 keys padded to 192), queries per kv head
    assert len(computed) > 10 and sum(c.shape[1] * c.shape[2] for c in computed) < 2 * blocks * queries
    for b, n in enumerate(lengths):
        w = -(-n // 4) * 4
        alone = portable.attention(q[b:b + 1, :w], k[b:b + 1, :w], v[b:b + 1, :w], _causal([n], w), pol)
        assert torch.equal(alone[0, :n], pieces[b, :n]), f"row {b}"
        want = ops.attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], _causal([n], n), pol)
        torch.testing.assert_close(alone[0, :n], want[0], rtol=1e-5, atol=1e-6)


def test_long_prompts_and_their_decode_steps_are_bitwise_the_same_alone_and_in_batches(tiny_dir, use_portable,
                                                                                       monkeypatch):
    """Prompts over two key blocks, in small pieces (so blocks are left out where no query of a
    piece sees them), then decode steps that cross a block's end."""
    monkeypatch.setattr(portable, "PIECE", 1 << 13)
    m = load(tiny_dir(), "fp32")
    rng = np.random.default_rng(5)
    target = rng.integers(3, VOCAB, 62)

    def steps(B, row):
        lengths = rng.integers(1, 100, B)
        lengths[row] = len(target)
        W = int(lengths.max())
        ids, mask = rng.integers(3, VOCAB, (B, W)), (np.arange(W)[None] >= W - lengths[:, None]).astype(np.int64)
        ids[row, W - len(target):] = target
        logits, cache = m.prefill(ids, mask, W + 4)
        out = [bits(logits)[row]]
        for t in (5, 9, 11, 13):
            new = rng.integers(3, VOCAB, B)
            new[row] = t
            logits, cache = m.decode(cache, new)
            out.append(bits(logits)[row])
        return out

    alone = steps(1, 0)
    for B, row in ((3, 0), (3, 2), (6, 3)):
        for i, (got, want) in enumerate(zip(steps(B, row), alone)):
            assert np.array_equal(got, want), f"B={B}, row {row}, step {i}"


# ----- the plan ---------------------------------------------------------------------------

def test_the_plan_records_the_portable_path_and_its_rows(tiny_dir, use_portable):
    m = load(tiny_dir(), "bf16")
    rows = tplan.PORTABLE_ROWS["cpu"]
    assert m.plan.backend == "invariant" and (INVARIANT_ENV, "portable") in m.plan.settings
    assert m.plan.op("products").startswith(f"portable: products in fixed [{rows}, K] calls")
    assert all(m.plan.op(op).startswith("portable: ") for op in ("logits", "attention", "norm", "mlp", "rope"))
    assert m.plan.kernel_isa is None and m.plan.record()["fixed-order kernels"] == "not used"
    assert isinstance(m.model.ops, portable.Portable) and m.model.ops.rows == rows


def test_the_plan_takes_the_portable_path_on_a_gpu_and_refuses_kernels_there(monkeypatch):
    """No GPU needed: the plan decides before anything runs on the device."""
    monkeypatch.delenv(INVARIANT_ENV, raising=False)
    plan, ops = tplan.make_backend("bf16", "cuda", "invariant")
    assert plan.op("products").startswith(f"portable: products in fixed [{tplan.PORTABLE_ROWS_ACCELERATOR}, K]")
    assert "16-bit operands as they are" in plan.op("products") and ops.native_half
    monkeypatch.setenv(INVARIANT_ENV, "kernels")
    with pytest.raises(PolicyError, match=f"{INVARIANT_ENV}=kernels: .* the model is on cuda"):
        tplan.make_backend("bf16", "cuda", "invariant")
    monkeypatch.setenv(INVARIANT_ENV, "fast")
    with pytest.raises(SettingError, match=f"{INVARIANT_ENV}='fast': expected auto, kernels, portable"):
        tplan.make_backend("bf16", "cpu", "invariant")


def _kernels_build() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and shutil.which("g++") is not None


# ----- the self-check ---------------------------------------------------------------------

@pytest.mark.parametrize("op", ["linear", "silu"])
def test_the_self_check_refuses_an_op_that_changes_with_the_row_count(op, tiny_dir, use_portable, monkeypatch):
    """Planted: a product that multiplies all rows in one call and sums k in two halves once
    there is more than one row; an exp computed another way for larger tensors. from_pretrained
    refuses, naming the op."""
    if op == "linear":
        def product(self, x, w, half=False):
            h = x.shape[1] // 2
            return x @ w.T if x.shape[0] == 1 else x[:, :h] @ w[:, :h].T + x[:, h:] @ w[:, h:].T
        monkeypatch.setattr(portable.Portable, "product", product)
        named = "linear q/k/v"
    else:
        exp = portable.exp
        monkeypatch.setattr(portable, "exp", lambda x: exp(x) if x.numel() < 200 else torch.exp(x) * 1.0000001)
        named = "silu"
    monkeypatch.setattr(portable, "_CHECKED", set())
    with pytest.raises(InvarianceError, match=f"self-check failed on this machine: {named} gives a row"):
        load(tiny_dir(), "fp32")


# ----- both paths: invariant, and the reference's function -----------------------------------

@pytest.mark.skipif(not _kernels_build(), reason="the fixed-order kernels are x86-64 code built with g++")
def test_kernels_and_portable_are_both_invariant_and_both_the_reference_to_rounding(tiny_dir, monkeypatch):
    folder, rng = tiny_dir(), np.random.default_rng(4)
    target = rng.integers(3, VOCAB, 11)
    ids, mask = batch_with(target, 5, 2, "left", rng)
    want = load(folder, "fp32", "reference")(ids, mask).numpy()
    real = mask.astype(bool)
    got = {}
    for path in ("kernels", "portable"):
        monkeypatch.setenv(INVARIANT_ENV, path)
        m = load(folder, "fp32")
        assert m.plan.op("products").startswith("fixed-order kernel" if path == "kernels" else "portable: ")
        got[path] = m(ids, mask).numpy()
        alone = bits(m(target[None]))[0]
        assert np.array_equal(bits(got[path])[2][real[2]], alone), path
        assert rel_l2(got[path][real], want[real]) < 1e-5, path
    assert rel_l2(got["kernels"][real], got["portable"][real]) < 1e-5


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_smollm2_portable_is_bitwise_the_same_alone_and_in_a_batch(policy, smollm2, use_portable):
    """SmolLM2's shapes (its self-check at load included): a prompt alone and at the last row of
    a batch with longer companions (two key blocks), and the first decode step."""
    m = load(smollm2, policy)
    rng = np.random.default_rng(6)
    target = rng.integers(3, 49152, 37)
    ids, mask = rng.integers(3, 49152, (3, 90)), np.zeros((3, 90), np.int64)
    for b, n in enumerate((90, 61, len(target))):
        mask[b, 90 - n:] = 1
    ids[2, 90 - len(target):] = target
    alone, cache1 = m.prefill(target[None], np.ones((1, len(target)), np.int64), len(target) + 1)
    together, cache3 = m.prefill(ids, mask, 91)
    assert np.array_equal(bits(together)[2], bits(alone)[0])
    step1, _ = m.decode(cache1, np.array([11]))
    step3, _ = m.decode(cache3, np.array([5, 7, 11]))
    assert np.array_equal(bits(step3)[2], bits(step1)[0])
