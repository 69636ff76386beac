"""torchref's attention of a bf16 policy on the fixed-order kernels (torchref.fast:
kernel_attention_applies, kernel_attention; llamaspec/fixed_order.h, CausalAttention).

The kernel computes block_attention's function (scores rounded to bf16, masked, f32 softmax,
probabilities rounded to bf16, their product with the values rounded to bf16) one tile of
queries at a time, the sums in the kernels' fixed order. These tests hold it to
block_attention element by element (the same roundings, another order: most outputs equal,
the rest one bf16 step apart), check that its bits do not depend on the code path, the batch,
the thread count or which tile a query lands in, and that masks (padding, holes), the late
scale and NaN behave as in block_attention. Where the kernels cannot be built the module is
skipped (they need g++ on x86-64)."""

import platform

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torchref  # noqa: E402
from llamaspec import Policy  # noqa: E402
from llamaspec import fixed_order as fo  # noqa: E402
from torchref import fast  # noqa: E402
from torchref import plan as tplan  # noqa: E402

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the fixed-order kernels are x86-64 code")

BF16 = Policy.get("bf16")


def qkv(B, T, S, Hq=6, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=g).to(torch.bfloat16) for n, h in ((T, Hq), (S, Hkv), (S, Hkv)))
    return q, k, v


def causal(B, T, S):
    """The queries are the last T of S slots (S - T cached keys before them)."""
    return torch.ones(T, S, dtype=torch.bool).tril(S - T)[None].repeat(B, 1, 1)


def masks(B, T, S, seed=0):
    c = causal(B, T, S)
    padded = c.clone()
    padded[B - 1, :, :7] = False           # the last row left-padded by 7: its first queries see nothing
    holes = c & (torch.rand(B, T, S, generator=torch.Generator().manual_seed(seed)) > 0.3)
    return {"causal": c, "padded": padded, "holes": holes}


C = tplan.choices(BF16, torch.device("cpu"), {})   # this machine's fast backend, default settings


@pytest.fixture(scope="module")
def kernels():
    return fast.fixed_order_kernels()


@pytest.mark.parametrize("B,T,S,D", [(1, 40, 40, 16), (2, 37, 53, 16), (3, 70, 70, 24), (1, 33, 33, 64)])
def test_kernel_computes_block_attention(kernels, B, T, S, D):
    """Every mask, head_dim 16 and 64 (the queries scaled first: a power-of-two scale) and 24
    (the scores scaled after, rounded again): the kernel's result is block_attention's, the
    sums in another order. Where the two f32 sums straddle a bf16 rounding boundary, a
    probability (or an output) lands one bf16 step away: a few outputs differ, each by at most
    2^-8 of the values' size (one step of every probability). Measured: 0-0.17% of the outputs
    differ, by at most 9.2e-4 of max |v|. A kernel that skips the probabilities' bf16 rounding
    differs in 33-43% of them (measured, mutated kernel); one that reads a wrong key, scales at
    the wrong point or drops a rounding of the scores, by far more than 2^-8."""
    q, k, v = qkv(B, T, S, D=D, seed=T)
    for name, allowed in masks(B, T, S, seed=S).items():
        got = fast.kernel_attention(q, k, v, allowed, BF16)
        want = fast.block_attention(C, q, k, v, allowed, BF16)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, name
        assert bool(torch.isfinite(got).all()), name
        diff = (got.double() - want.double()).abs()
        assert float(diff.max()) <= 2 ** -8 * float(v.double().abs().max()), f"{name}: max |diff| {float(diff.max())}"
        assert float((diff > 0).double().mean()) <= 0.01, f"{name}: {float((diff > 0).double().mean()):.2%} differ"


def test_kernel_bits_do_not_depend_on_path_batch_threads_or_tile(kernels):
    """The same bits on every code path this CPU runs (scalar, AVX2, AVX-512, AVX-512-BF16),
    for a row alone and in a batch of three (the others with other lengths of padding), with 1
    and 2 threads, and for a query whether its tile holds 16 queries or it comes alone."""
    q, k, v = qkv(3, 50, 50, seed=5)
    allowed = causal(3, 50, 50)
    allowed[1, :, :9] = False
    allowed[2, :, :3] = False
    ref = {}
    for path in fo.code_paths(kernels):
        with fo.code_path(kernels, path):
            ref[path] = fast.kernel_attention(q, k, v, allowed, BF16)
    first = ref[fo.code_paths(kernels)[0]]
    for path, out in ref.items():
        assert torch.equal(out, first), path
    alone = fast.kernel_attention(q[:1], k[:1], v[:1], allowed[:1], BF16)
    assert torch.equal(alone, first[:1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fast.kernel_attention(q, k, v, allowed, BF16), first)
    finally:
        torch.set_num_threads(threads)
    # query 20 of row 0 alone (one query over its 21 keys) is the same as in its tile of 16
    one = fast.kernel_attention(q[:1, 20:21], k[:1, :21], v[:1, :21], allowed[:1, 20:21, :21], BF16)
    assert torch.equal(one[0, 0], first[0, 20])


def test_kernel_reads_bf16_and_f32_operands_alike(kernels):
    """The kernel reads q, k and v as they come: bf16, or f32 rounded to bf16 inside (a bf16
    policy's f32 KV cache holds bf16 values; other f32 values round as block_attention's cast
    rounds them), contiguous or strided (the cache's [B, Hkv, S, D] seen as [B, S, Hkv, D]), and
    another float dtype through torch's cast: the same bits every way, on every code path. A
    kernel that took f32 operands without rounding them differs here (the f32 values below are
    not bf16 ones)."""
    B, T, S, Hq, Hkv = 2, 37, 45, 6, 2
    for D in (16, 24):                                  # the queries scaled first; the scores after
        q, k, v = qkv(B, T, S, Hq, Hkv, D, seed=D)
        allowed = masks(B, T, S, seed=D)["padded"]
        want = fast.kernel_attention(q, k, v, allowed, BF16)
        g = torch.Generator().manual_seed(D)

        def off_grid(t):
            # f32 values within a quarter step of t's bf16 values, rounding back to them
            ulp = (t.float().abs() * 2.0 ** -8).clamp_min(2.0 ** -133)
            near = t.float() + (torch.rand(t.shape, generator=g) - 0.5) * 0.5 * ulp
            assert torch.equal(near.to(torch.bfloat16), t) and not torch.equal(near, t.float())
            return near

        def strided(t):
            # the layout of the cache: heads before positions, seen through a transpose
            return t.transpose(1, 2).contiguous().transpose(1, 2)

        forms = {"f32": [t.float() for t in (q, k, v)], "off grid": [off_grid(t) for t in (q, k, v)],
                 "strided": [strided(t) for t in (q, k, v)], "f32 strided": [strided(t.float()) for t in (q, k, v)],
                 "f64": [t.double() for t in (q, k, v)], "mixed": [q, k.float(), strided(v)]}
        for path in fo.code_paths(kernels):
            with fo.code_path(kernels, path):
                assert torch.equal(fast.kernel_attention(q, k, v, allowed, BF16), want), (D, path)
                for name, (fq, fk, fv) in forms.items():
                    got = fast.kernel_attention(fq, fk, fv, allowed, BF16)
                    assert got.dtype == torch.bfloat16 and torch.equal(got, want), (D, path, name)


def test_kernel_nan_reaches_the_queries_that_see_it(kernels):
    """A NaN key makes NaN the outputs of the queries that see it, and of no other batch row;
    a NaN key that the mask hides from every query leaves everything finite (as
    block_attention's fill)."""
    q, k, v = qkv(2, 40, 40, seed=2)
    allowed = causal(2, 40, 40)
    k[0, 25, 0, 3] = float("nan")
    out = fast.kernel_attention(q, k, v, allowed, BF16)
    assert bool(out[0, 25:, :3].isnan().all())          # kv head 0: query heads 0-2 of queries 25..
    assert bool(out[0, :16].isfinite().all()) and bool(out[1].isfinite().all())
    hidden = allowed.clone()
    hidden[0, :, 25] = False
    assert bool(fast.kernel_attention(q, k, v, hidden, BF16).isfinite().all())


def rule(policy, device="cpu", **env):
    c = tplan.choices(Policy.get(policy), torch.device(device), {tplan.ATTENTION_ENV: v for v in env.values()})
    return fast.kernel_attention_applies(c, Policy.get(policy), torch.device(device))


def test_kernel_attention_rule(monkeypatch):
    """auto: a bf16 policy (bf16 operands, f32 accumulation and softmax) on an x86-64 CPU without
    AMX (the flags of an AVX-512-BF16 CPU such as a Zen 4, whatever CPU runs the test: on an AMX
    Xeon auto keeps block attention, the test below), never another policy or device; kernel:
    the same; fused and reference: never; another value is an error naming the variable."""
    from llamaspec import cpuinfo
    flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
    monkeypatch.setattr(cpuinfo, "name_and_flags", lambda: ("AMD EPYC (flags as an AVX-512-BF16 CPU's)", flags))
    monkeypatch.delenv(cpuinfo.BF16_DOTS_ENV, raising=False)
    auto = {name: rule(name) for name in ("bf16", "fp16", "fp32", "bf16w-f32", "fp64", "tf32")}
    assert auto == {"bf16": True, "fp16": False, "fp32": False, "bf16w-f32": False, "fp64": False,
                    "tf32": False}
    assert not rule("bf16", "meta")
    assert rule("bf16", choice="kernel") and not rule("fp32", choice="kernel")
    for choice in ("fused", "reference"):
        assert not rule("bf16", choice=choice)
    with pytest.raises(ValueError, match=tplan.ATTENTION_ENV):
        rule("bf16", choice="fast")


def test_kernel_attention_rule_leaves_amx_cpus_to_the_separate_ops(monkeypatch):
    """auto on a CPU whose bf16 products run on AMX tiles (the CPU's flags as such a Xeon reports
    them) keeps block attention: the two were never timed there. oneDNN capped below AMX, or
    $LLAMA_PARITY_ATTENTION=kernel, takes the kernel again."""
    from llamaspec import cpuinfo
    flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16",
                       "amx_tile"})
    monkeypatch.setattr(cpuinfo, "name_and_flags", lambda: ("Intel(R) Xeon(R) (flags as an AMX CPU's)", flags))
    monkeypatch.delenv(cpuinfo.BF16_DOTS_ENV, raising=False)
    cpu = torch.device("cpu")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: its bf16 products never run on AMX")
    c = tplan.choices(BF16, cpu, {})
    assert c.amx_bf16 and not fast.kernel_attention_applies(c, BF16, cpu)
    c = tplan.choices(BF16, cpu, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert not c.amx_bf16 and fast.kernel_attention_applies(c, BF16, cpu)
    c = tplan.choices(BF16, cpu, {tplan.ATTENTION_ENV: "kernel"})
    assert fast.kernel_attention_applies(c, BF16, cpu)


def test_kernel_attention_runs_in_the_model(tiny_dir, monkeypatch):
    """The whole model at bf16, one row padded: the plan says the kernel attends; the logits are
    the reference attention's to bf16 drift (rel L2 2e-2: bf16 keeps 8 bits, and a flipped
    rounding of one attention output moves the later layers), and prefill + decode give the
    forward's logits to the same bound."""
    ids = np.random.default_rng(3).integers(3, 96, (2, 12))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    runs = {}
    for choice in ("reference", "auto"):
        monkeypatch.setenv(tplan.ATTENTION_ENV, choice)
        m = torchref.from_pretrained(tiny_dir("gqa"), policy="bf16")
        assert (m.plan.op("attention") == "reference") is (choice == "reference")
        runs[choice] = np.asarray(m(ids, attention_mask=mask), np.float64)
    scale = np.linalg.norm(runs["reference"])
    assert np.linalg.norm(runs["auto"] - runs["reference"]) <= 2e-2 * scale
    logits, cache = m.prefill(ids[:, :9], mask[:, :9], 12)
    steps = [np.asarray(logits, np.float64)]
    for t in range(9, 12):
        logits, cache = m.decode(cache, ids[:, t])
        steps.append(np.asarray(logits, np.float64))
    got = np.stack(steps, 1)
    assert np.linalg.norm(got - runs["auto"][:, 8:12]) <= 2e-2 * np.linalg.norm(runs["auto"][:, 8:12])
