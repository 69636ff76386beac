"""torchref's attention through torch's fused kernel (torchref.fast: fused_attention_applies,
fused_block).

For policies whose attention is f32 throughout, torchref runs each block of a long prompt's
queries through torch's scaled_dot_product_attention (on the CPU a flash kernel: keys in tiles, a running max,
one division at the end) instead of separate products, mask and softmax: the same function,
the sums in another order. These tests hold the fused blocks to block_attention at f64 (where
only the order of f64 sums differs), padding rows and arbitrary masks included, and check the
rule that picks the path; the path is forced with $LLAMA_PARITY_ATTENTION's choices, so they run
the same on any CPU.
"""


import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torchref  # noqa: E402
from llamaspec import Policy  # noqa: E402
from torchref import fast  # noqa: E402
from torchref import plan as tplan  # noqa: E402
from torchref.dtypes import from_numpy  # noqa: E402

F64_BOUND = 1e-12   # f64 sums of a few hundred terms of size ~1, in two orders


def ch(attention: str = "auto", policy: str = "fp32") -> fast.Choices:
    """The fast backend's choices on this machine with $LLAMA_PARITY_ATTENTION=attention."""
    return tplan.choices(Policy.get(policy), torch.device("cpu"), {tplan.ATTENTION_ENV: attention})


C = ch()


def masks(T: int, S: int, seed: int) -> dict[str, torch.Tensor]:
    """[2, T, S] masks: causal (the queries are the last T of S slots), causal with row 1
    left-padded by 5 (its first queries see nothing), and random holes in the causal mask."""
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None].repeat(2, 1, 1)
    padded = causal.clone()
    padded[1, :, :5] = False
    holes = causal & (torch.rand(2, T, S, generator=torch.Generator().manual_seed(seed)) > 0.3)
    return {"causal": causal, "padded": padded, "holes": holes}


def qkv(T: int, S: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, n, h, 16, generator=g, dtype=dtype) for n, h in ((T, 4), (S, 2), (S, 2)))


@pytest.mark.parametrize("T,S", [(1, 30), (3, 30), (42, 42), (40, 50)])
def test_fused_blocks_compute_block_attention(T, S, monkeypatch):
    """At fp64 every query's result through fused_block is block_attention's to f64 rounding,
    for decode-like (1 and 3 queries over 30 keys) and prompt shapes; and attention() over a
    long prompt (QUERY_BLOCK shrunk to 8), forced fused, is its result with the separate ops.
    With padding, a query that may see nothing averages every value (an additive mask of the
    most negative finite value, as block_attention's fill; -inf would give NaN), and holes in
    the mask are honoured."""
    policy = Policy.get("fp64")
    q, k, v = qkv(T, S)
    monkeypatch.setattr(fast, "QUERY_BLOCK", 8)
    for name, allowed in masks(T, S, seed=T).items():
        pairs = [(fast.fused_block(q, k, v, allowed, policy), fast.block_attention(C, q, k, v, allowed, policy))]
        if T >= 2 * fast.QUERY_BLOCK:
            fused = fast.attention(ch("fused"), q, k, v, allowed, policy)
            pairs.append((fused, fast.attention(C, q, k, v, allowed, policy)))
        for got, want in pairs:
            assert got.shape == want.shape and bool(torch.isfinite(got).all()), name
            err = float((got - want).abs().max())
            assert err <= F64_BOUND, f"{name}: fused vs separate ops max |diff| {err:.3g}"


def test_fused_blocks_pass_nan_through():
    """A NaN key reaches the output of every query that sees it, as through the separate ops
    (never hidden), and no other row of the batch. (The kernel adds the mask to the scores, so
    a NaN key also reaches the queries of its tile that may not see it, where the separate ops'
    fill hides it: more NaN, never less, and the key's own tap holds the NaN first.)"""
    policy = Policy.get("fp64")
    q, k, v = qkv(6, 6)
    k[0, 2, 0, 0] = float("nan")
    allowed = masks(6, 6, 0)["causal"]
    out = fast.fused_block(q, k, v, allowed, policy)
    assert bool(out[0, 2:, :2].isnan().all()) and bool(out[1].isfinite().all())


def test_fused_attention_rule():
    """auto: f32-throughout policies on the CPU (fp32, bf16w-f32), not 16-bit attention (bf16,
    fp16: another rounding point), not f64, not tf32 products, not off the CPU; fused: any
    policy in one float dtype (f32 or f64), on any device; reference: never; another value is an
    error naming the variable."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")   # only the device's type is read
    auto = {name: fast.fused_attention_applies(C, Policy.get(name), cpu)
            for name in ("fp32", "bf16w-f32", "bf16", "fp16", "fp64", "fp64-hf", "tf32")}
    assert auto == {"fp32": True, "bf16w-f32": True, "bf16": False, "fp16": False, "fp64": False,
                    "fp64-hf": False, "tf32": False}
    assert not fast.fused_attention_applies(C, Policy.get("fp32"), cuda)
    fused = ch(" Fused ")
    assert fast.fused_attention_applies(fused, Policy.get("fp64"), cpu)
    assert fast.fused_attention_applies(fused, Policy.get("fp32"), cuda)
    assert not fast.fused_attention_applies(fused, Policy.get("bf16"), cpu)
    assert not fast.fused_attention_applies(fused, Policy.get("fp64-hf"), cpu)   # f32 softmax inside f64
    assert not fast.fused_attention_applies(ch("reference"), Policy.get("fp32"), cpu)
    with pytest.raises(ValueError, match=tplan.ATTENTION_ENV):
        ch("fast")


def test_fused_attention_runs_in_the_model(tiny_dir, monkeypatch):
    """The whole model at fp32 over a long prompt (QUERY_BLOCK shrunk to 4: 12 tokens are 3
    blocks) against the reference attention: the logits agree to f32 rounding (rel L2 1e-5; the
    model's logits are O(1)), and prefill + decode give the forward's logits to f32 rounding."""
    ids = np.random.default_rng(3).integers(3, 96, (2, 12))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    runs = {}
    monkeypatch.setattr(fast, "QUERY_BLOCK", 4)
    for choice in ("reference", "auto"):
        monkeypatch.setenv(tplan.ATTENTION_ENV, choice)
        m = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32")
        runs[choice] = np.asarray(m(ids, attention_mask=mask))
    assert m.plan.op("attention").startswith("torch sdpa")
    scale = np.linalg.norm(runs["reference"])
    assert np.linalg.norm(runs["auto"] - runs["reference"]) <= 1e-5 * scale
    logits, cache = m.prefill(ids[:, :9], mask[:, :9], 12)
    steps = [np.asarray(logits)]
    for t in range(9, 12):
        logits, cache = m.decode(cache, ids[:, t])
        steps.append(np.asarray(logits))
    got = np.stack(steps, 1)
    assert np.linalg.norm(got - runs["auto"][:, 8:12]) <= 1e-5 * np.linalg.norm(runs["auto"][:, 8:12])


def test_weights_in_torch_aligned_memory():
    """from_numpy copies into memory torch allocated (64-byte aligned: MKL's products ran slower
    on numpy's 16-byte-aligned copies), read-only and strided arrays and bf16 included; the
    values are the array's."""
    import ml_dtypes
    a = np.arange(3 * 40, dtype=np.float32).reshape(3, 40)[:, ::2]
    a.flags.writeable = False
    b = np.linspace(-2, 2, 33).astype(ml_dtypes.bfloat16)
    for arr in (a, b, np.arange(7, dtype=np.int64)):
        t = from_numpy(arr)
        assert t.data_ptr() % 64 == 0 and t.is_contiguous()
        back = t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
        assert back.dtype == arr.dtype and np.array_equal(back, arr)


def test_fill_starts_at_the_first_hidden_key(monkeypatch):
    """first_hidden against its definition block by block (the first key some query of the block,
    in any row, may not see; S when none), and block_attention filling from there is bitwise
    block_attention filling every score, at fp32 and bf16, for causal, padded and holed masks;
    attention() over a long prompt (separate ops) likewise, its blocks cut by first_hidden."""
    monkeypatch.setattr(fast, "QUERY_BLOCK", 8)
    real = fast.first_hidden
    for T, S in ((42, 42), (40, 50), (16, 16)):
        for name, allowed in {**masks(T, S, seed=S), "none hidden": torch.ones(2, T, S, dtype=torch.bool)}.items():
            want = []
            for a in range(0, T, 8):
                cols = (~allowed[:, a:a + 8]).any(1).any(0)
                want.append(int(cols.nonzero()[0, 0]) if bool(cols.any()) else S)
            got = fast.first_hidden(allowed)
            assert got == want, (name, got, want)
            for policy in ("fp32", "bf16"):
                p = Policy.get(policy)
                q, k, v = (t.to(getattr(torch, p.compute_dtype)) for t in qkv(T, S, torch.float32, seed=T))
                for a, hidden in zip(range(0, T, 8), got):
                    block = q[:, a:a + 8], k, v, allowed[:, a:a + 8], p
                    filled = fast.block_attention(C, *block, fill_from=hidden)
                    assert torch.equal(filled, fast.block_attention(C, *block)), (name, policy, a)
                cut = fast.attention(ch("reference"), q, k, v, allowed, p)   # not fused: separate ops
                monkeypatch.setattr(fast, "first_hidden", lambda m: [0] * -(-m.shape[1] // 8))   # fill all
                assert torch.equal(cut, fast.attention(ch("reference"), q, k, v, allowed, p)), (name, policy)
                monkeypatch.setattr(fast, "first_hidden", real)


def test_plain_long_prompt_is_one_causal_kernel_call(monkeypatch):
    """A long prompt from slot 0 without padding (plain_causal, read from the mask) runs torch's
    kernel once with is_causal over the prompt's own keys (spy). A padded batch, a mask with one
    more key or one less, and a prompt after earlier slots run the blocks with their masks. At
    fp64 (forced fused) each is the separate ops' result to f64 rounding, and a key's NaN reaches
    only the queries that see it."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((args[1].shape[2], kwargs.get("is_causal", False)))     # keys read, causal flag
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(fast, "QUERY_BLOCK", 4)
    # causal mask over the first T of S slots (the rest empty, as a prefill's cache)
    T, S = 12, 15
    q, k, v = qkv(T, S)
    plain = torch.ones(T, S, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
    fp64, fused = Policy.get("fp64"), ch("fused")
    assert fast.plain_causal(plain) and fast.plain_causal(plain[:, :, :T]) and not fast.plain_causal(plain[:, 1:])
    got = fast.attention(fused, q, k, v, plain, fp64)
    assert calls == [(T, True)]
    assert float((got - fast.block_attention(C, q, k, v, plain, fp64)).abs().max()) <= F64_BOUND
    padded, more, less = plain.clone(), plain.clone(), plain.clone()
    padded[1, :, :3] = False
    more[0, 4, 5] = True
    less[1, 7, 2] = False
    others = {"padded": padded, "one more key": more, "one less key": less,
              "after slot 2": torch.ones(T, S, dtype=torch.bool).tril(2)[None].repeat(2, 1, 1)}
    for name, mask in others.items():
        calls.clear()
        assert not fast.plain_causal(mask), name
        got = fast.attention(fused, q, k, v, mask, fp64)
        assert calls and not any(c for _, c in calls), name          # the blocks, with their masks
        assert float((got - fast.block_attention(C, q, k, v, mask, fp64)).abs().max()) <= F64_BOUND, name
    k[0, 5, 1, 3] = float("nan")
    out = fast.attention(fused, q, k, v, plain, fp64)
    assert bool(out[0, 5:, 2:].isnan().all()) and bool(out[0, :5].isfinite().all()) and bool(out[1].isfinite().all())


def test_answers_kept_per_mask_follow_the_mask_asked_about():
    """plain_causal's answer and block_attention's mask inverse are kept for the last mask asked
    about (a call's layers share it): another mask, even one that differs in one key or equals
    an earlier one, gets its own."""
    policy = Policy.get("fp32")
    gen = torch.Generator().manual_seed(5)
    T, S, H, D = 3, 4, 2, 8
    q, k, v = (torch.randn(1, n, H, D, generator=gen) for n in (T, S, S))
    a = torch.ones(1, T, S, dtype=torch.bool).tril()
    b = a.clone()
    b[0, -1, 0] = False          # one key hidden from the last query
    first_b = fast.block_attention(C, q, k, v, b, policy)
    first_a = fast.block_attention(C, q, k, v, a, policy)
    assert fast.plain_causal(a) and not fast.plain_causal(b) and fast.plain_causal(a.clone())
    assert not torch.equal(first_a, first_b)
    assert torch.equal(fast.block_attention(C, q, k, v, b.clone(), policy), first_b)
    assert torch.equal(fast.block_attention(C, q, k, v, a, policy), first_a)
