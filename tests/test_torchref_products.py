"""torchref's 16-bit products on the CPU (torchref.ops: hardware_products, linear).

On a CPU without bf16 / fp16 products in hardware torch multiplies 16-bit matrices in software,
several times slower than its f32 product; torchref then widens the operands of products with
many rows to f32 (exact products, f32 sums: the policy's arithmetic, the sums in another
order). A one-row product keeps torch's 16-bit kernel (ATen's matrix-vector product), and f32
products of a few rows (f32 logits of a decode step) run in blocks of the weight's rows. On an
x86-64 CPU products of a few rows whose arithmetic is f32 run on the fixed-order kernels' gemm
instead (kernel_products); the tests of torch's paths ask for torch's
($LLAMA_PARITY_TORCHREF_PRODUCTS=torch). These tests hold each path to f32 rounding of the same
products and check which path runs, on any CPU: the rule is forced with $LLAMA_PARITY_BF16_DOTS
or fed a CPU's features.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import compare  # noqa: E402
import torchref  # noqa: E402
from llamaspec import Policy, cpuinfo, load_weights  # noqa: E402
from torchref import ops  # noqa: E402
from torchref.model import head_logits  # noqa: E402

U32 = 2.0 ** -24   # f32's unit roundoff


def within_f32_sums(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got == x @ w.T up to f32 summation: |error| <= K u sum|x_k w_k| per output (the products
    of 16-bit values are exact in f32, so only the sums round), against the product in f64."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T
    bound = x.shape[-1] * U32 * (x64.abs() @ w64.abs().T)
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound.clamp_min(1e-300)).max()):.3g}"


def rounded_within(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """y == x @ w.T + b summed in f32 then rounded once to y's 16-bit dtype: within half a unit
    of y's dtype of a value within f32 summation of the f64 result."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T + (0 if b is None else b.double())
    bound = (x.shape[-1] + 1) * U32 * (x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs()))
    info = torch.finfo(y.dtype)
    err = (y.double() - exact).abs()
    assert bool((err <= info.eps * (exact.abs() + bound) + bound + info.tiny * info.eps).all())


def on_one_thread(fn, *args):
    """fn(*args) with torch on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU's features hardware_products reads (and no cap, the rule on auto)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, "auto")

    def set_flags(*names):
        monkeypatch.setattr(cpuinfo, "name_and_flags", lambda: ("a CPU", frozenset(names)))
    return set_flags


def test_hardware_products_rule(flags, monkeypatch):
    """By the CPU's features and oneDNN's cap, never a timing: bf16 in hardware with AMX-BF16 or
    AVX-512-BF16, fp16 with AMX-FP16 or AVX-512-FP16; a cap below them, or oneDNN switched off,
    means software; the variable forces either path; a bad value names it."""
    bf16, fp16 = torch.bfloat16, torch.float16
    for features, hw_bf16, hw_fp16 in (({"amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16"}, True, True),
                                       ({"avx512_bf16", "avx512f"}, True, False),   # Zen 4, Cooper Lake
                                       ({"amx_bf16"}, True, False),
                                       ({"avx512_fp16"}, False, True),
                                       ({"avx2", "fma"}, False, False),              # Zen 3, most laptops
                                       (set(), False, False)):
        flags(*features)
        assert (ops.hardware_products(bf16), ops.hardware_products(fp16)) == (hw_bf16, hw_fp16), features
        for cap, bf16_on, fp16_on in (("AVX2", False, False), ("AVX512_CORE", False, False),
                                      ("avx512_core_vnni", False, False), ("AVX512_CORE_BF16", True, False),
                                      ("AVX512_CORE_FP16", True, True), ("AVX512_CORE_AMX", True, True),
                                      ("AVX512_CORE_AMX_FP16", True, True), ("AVX10_1_512", True, True),
                                      ("SSE41", False, False), ("ALL", True, True)):
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
            assert ops.hardware_products(bf16) is (hw_bf16 and bf16_on), (features, cap)
            assert ops.hardware_products(fp16) is (hw_fp16 and fp16_on), (features, cap)
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")          # oneDNN's older name for the cap
        assert not ops.hardware_products(bf16)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    flags("amx_bf16", "avx512_bf16")
    with torch.backends.mkldnn.flags(enabled=False):
        assert not ops.hardware_products(bf16)
    assert ops.hardware_products(bf16)
    monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, "widened")
    assert not ops.hardware_products(bf16)
    flags()
    monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, "native")
    assert ops.hardware_products(bf16) and ops.hardware_products(fp16)
    monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, "fast")
    with pytest.raises(ValueError, match=cpuinfo.BF16_DOTS_ENV):
        ops.hardware_products(bf16)


class LinearSpy:
    """Records the operand dtypes and the oneDNN switch of each torch linear call (or of another
    product function with linear's arguments), then runs it."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, x, w, b=None):
        self.calls.append((x.shape[:-1].numel(), x.dtype, w.dtype, torch._C._get_mkldnn_enabled()))
        return self.real(x, w, b)


class BmmSpy(LinearSpy):
    """LinearSpy for torch.bmm, as ops' row blocks call it (blocks of w, the rows' transpose):
    records the rows, their dtype, the blocks' dtype and the oneDNN switch."""

    def __call__(self, blocks, rows_t):
        self.calls.append((rows_t.shape[-1], rows_t.dtype, blocks.dtype, torch._C._get_mkldnn_enabled()))
        return self.real(blocks, rows_t)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows", [1, 3, ops.WIDE_MIN_ROWS, 40])
def test_linear_paths_are_the_policys_products(dtype, rows, monkeypatch):
    """Every path of ops.linear is x @ w.T with exact 16-bit products summed in f32 (within f32
    summation of the f64 product, then rounded once), with and without a bias, rounded to the
    16-bit compute dtype or kept in f32 (logits). Widened (forced: the rule of a CPU without
    hardware products), products of WIDE_MIN_ROWS rows or more take f32 operands (in blocks of
    the weight's rows up to FEW_ROWS rows, torch's linear above) and fewer rows the 16-bit ones;
    one row runs with oneDNN off (ATen's matrix-vector kernel), the switch back on after; forced
    native, every product takes 16-bit operands. f32 logits take the widened copy, in row blocks
    up to FEW_ROWS rows."""
    policy = Policy.get("bf16" if dtype == "bfloat16" else "fp16")
    half = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(half)
    # weight rows: blocks of _linear_by_row_blocks and a rest
    n = 20 * ops.ROW_BLOCK + 37
    w = (torch.randn(n, 96, generator=gen) * 0.1).to(half)
    b = (torch.randn(n, generator=gen) * 0.1).to(half)
    for choice in ("widened", "native"):
        monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, choice)
        monkeypatch.setenv(ops.LOGITS_ENV, "torch")   # the kernel's logits: test_bf16_logits_of_few_rows_on_the_kernel
        monkeypatch.setenv(ops.PRODUCTS_ENV, "torch")  # the kernel's products: test_products_on_the_kernel
        spy, blocks = LinearSpy(torch.nn.functional.linear), BmmSpy(torch.bmm)
        monkeypatch.setattr(torch.nn.functional, "linear", spy)
        monkeypatch.setattr(torch, "bmm", blocks)
        y = ops.linear(x, w, None, policy)
        yb = ops.linear(x, w, b, policy)
        n_before_logits = len(spy.calls), len(blocks.calls)
        logits = ops.linear(x, w, None, policy, "float32")
        monkeypatch.undo()
        assert torch._C._get_mkldnn_enabled()
        assert y.dtype == yb.dtype == half and logits.dtype == torch.float32
        within_f32_sums(logits, x, w)
        rounded_within(y, x, w)
        rounded_within(yb, x, w, b)
        wide = choice == "widened" and rows >= ops.WIDE_MIN_ROWS
        in_blocks = wide and rows <= ops.FEW_ROWS
        # y and yb
        assert n_before_logits == ((0, 2) if in_blocks else (2, 0)), (choice, n_before_logits)
        for r, xd, wd, onednn in (blocks if in_blocks else spy).calls[:2]:
            assert r == rows and (xd, wd) == ((torch.float32,) * 2 if wide else (half, half)), (choice, xd, wd)
            if not wide:
                assert onednn is (rows != 1), "one-row 16-bit products run on ATen's kernel"
        # the logits: one product on the widened copy, in row blocks up to FEW_ROWS rows
        logit_calls = (blocks if rows <= ops.FEW_ROWS else spy).calls[n_before_logits[rows <= ops.FEW_ROWS]:]
        assert len(spy.calls) + len(blocks.calls) == sum(n_before_logits) + 1
        assert [(r, xd, wd) for r, xd, wd, _ in logit_calls] == [(rows, torch.float32, torch.float32)]


@pytest.mark.parametrize("rows", [1, 3, ops.FEW_ROWS, ops.FEW_ROWS + 1])
def test_f32_products_of_few_rows_in_row_blocks(rows, monkeypatch):
    """An f32 product of at most FEW_ROWS rows runs in blocks of ROW_BLOCK of the weight's rows
    (one batched product, the rows past the last whole block apart), with and without a bias,
    for weights of fewer rows than a block, of whole blocks and of blocks and a rest: within f32
    rounding of the f64 product (each product and sum rounded once), the result's shape and dtype
    linear's; its bits do not depend on torch's thread count; more rows go to torch's linear.
    (torch's path: on x86-64 such products run on the kernel, test_products_on_the_kernel.)"""
    policy = Policy.get("fp32")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 80, generator=gen)[1:]            # [1, rows, 80], a view
    for n in (ops.ROW_BLOCK // 2, 3 * ops.ROW_BLOCK, 3 * ops.ROW_BLOCK + 5):
        monkeypatch.setenv(ops.PRODUCTS_ENV, "torch")          # again after each undo
        w = torch.randn(n, 80, generator=gen)
        b = torch.randn(n, generator=gen)
        spy, blocks = LinearSpy(torch.nn.functional.linear), BmmSpy(torch.bmm)
        monkeypatch.setattr(torch.nn.functional, "linear", spy)
        monkeypatch.setattr(torch, "bmm", blocks)
        y, yb = ops.linear(x, w, None, policy), ops.linear(x, w, b, policy)
        monkeypatch.undo()
        monkeypatch.setenv(ops.PRODUCTS_ENV, "torch")
        few = rows <= ops.FEW_ROWS   # row blocks: a batched product when w has a whole block
        assert (len(blocks.calls), len(spy.calls)) == ((2 * (n >= ops.ROW_BLOCK), 0) if few else (0, 2)), (rows, n)
        assert all(call[:3] == (rows, torch.float32, torch.float32) for call in blocks.calls)
        assert y.shape == yb.shape == (1, rows, n) and y.dtype == yb.dtype == torch.float32
        x64, w64, b64 = x[0].double(), w.double(), b.double()
        for got, bias in ((y, 0), (yb, b64)):
            err = (got[0].double() - (x64 @ w64.T + bias)).abs()
            bound = (80 + 2) * U32 * (x64.abs() @ w64.abs().T + abs(bias))
            assert bool((err <= bound).all()), (rows, n)
        assert torch.equal(on_one_thread(ops.linear, x, w, b, policy), yb), (rows, n)


@pytest.mark.parametrize("choice", ["torch", "kernel"])
def test_decode_lm_head_is_the_whole_product(choice, monkeypatch):
    """The f32 logits of a 16-bit lm_head (a decode step's few rows, or many) are one product on
    a widened copy kept per weight, or (the few rows, on the fixed-order kernel) on a packed copy
    kept per weight, each made once and remade when the weight changes in place: the same exact
    products summed in f32."""
    policy = Policy.get("bf16")
    monkeypatch.setenv(ops.LOGITS_ENV, choice)
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter((torch.randn(7 * ops.ROW_BLOCK + 5, 64, generator=gen)).bfloat16(), requires_grad=False)
    for rows in (1, ops.WIDE_MIN_ROWS - 1, ops.WIDE_MIN_ROWS, 33):
        x = torch.randn(2, rows, 64, generator=gen).bfloat16()[:1]
        got = head_logits(x, w, ops, policy)
        assert got.shape == (1, rows, w.shape[0]) and got.dtype == torch.float32
        within_f32_sums(got[0], x[0], w)
    for rows in (1, ops.WIDE_MIN_ROWS):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        before = head_logits(x, w, ops, policy)
        with torch.no_grad():
            w.mul_(2)                           # exact in bf16: every product doubles
        after = head_logits(x, w, ops, policy)
        assert torch.equal(after, 2 * before), f"{rows} rows: a weight changed in place is widened again"


@pytest.mark.parametrize("config", ["gqa", "tied"])
def test_torchref_widened_products_are_drift(config, tiny_dir, monkeypatch):
    """torchref at bf16 with products widened (a CPU without hardware bf16 products, forced here
    on any CPU) against torch's bf16 kernels: the ladder against jaxmodel says exact or drift on
    both paths, the two runs agree to bf16 rounding at every tap, and prefill then decode at
    batch 1 (one-row products, the lm_head in row blocks) gives the logits the full forward gives."""
    folder = tiny_dir(config)
    cfg, weights = load_weights(folder)
    ids = np.random.default_rng(7).integers(3, 96, (2, 24))
    mask = np.ones((2, 24), np.int64)
    mask[1, :3] = 0
    runs = {}
    for choice in ("widened", "native"):
        monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, choice)
        m = torchref.from_weights(cfg, weights, "bf16")
        runs[choice] = m.capture(ids, mask, taps=["*"])
        report = compare.compare_models("jaxmodel", "torchref", folder, inputs=(ids, mask), policy="bf16")
        assert report.verdict in ("exact", "drift"), (choice, report.summary())
        one = ids[:1, :12]
        logits, cache = m.prefill(one, np.ones_like(one), 16)
        steps = [np.asarray(logits)]
        full = np.asarray(m(ids[:1, :15], np.ones((1, 15), np.int64)), np.float64)
        for t in range(12, 15):                   # teacher-forced: the prompt's own next tokens
            logits, cache = m.decode(cache, ids[:1, t])
            steps.append(np.asarray(logits))
        for t, got in zip(range(11, 15), steps):
            want = full[0, t]
            assert np.linalg.norm(got[0] - want) <= 2e-2 * np.linalg.norm(want), (choice, t)
    (wl, wa), (nl, na) = runs["widened"], runs["native"]
    for tap, a, b in [("logits", wl, nl)] + [(t, wa[t], na[t]) for t in na]:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(a).all() and np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), tap


def test_attention_products_count_the_rows_of_every_matrix(monkeypatch):
    """A decode step's attention in block_attention (where the fixed-order kernels do not take
    it: ops.kernel_attention_applies) is one small product per row of the batch and KV head (G
    query heads: G rows each). Widened (forced), they take f32 operands once all their matrices
    together have WIDE_MIN_ROWS rows, although each has fewer, and the result stays within bf16
    rounding of torch's bf16 products."""
    policy = Policy.get("bf16")
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, S = 2, 8, 2, 16, 40
    assert Hq // Hkv < ops.WIDE_MIN_ROWS <= B * Hq
    q = torch.randn(B, 1, Hq, D, generator=gen).bfloat16()
    k = torch.randn(B, S, Hkv, D, generator=gen).bfloat16()
    v = torch.randn(B, S, Hkv, D, generator=gen).bfloat16()
    allowed = torch.ones(B, 1, S, dtype=torch.bool)
    out = {}
    for choice in ("widened", "native"):
        monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, choice)
        seen = []
        real = torch.bmm
        monkeypatch.setattr(torch, "bmm", lambda a, b, **out: seen.append((a.dtype, b.dtype)) or real(a, b, **out))
        out[choice] = ops.block_attention(q, k, v, allowed, policy)
        monkeypatch.undo()
        want = torch.float32 if choice == "widened" else torch.bfloat16
        assert len(seen) == 2 and all(d == (want, want) for d in seen), (choice, seen)
    a, b = out["widened"].double(), out["native"].double()
    assert torch.linalg.norm(a - b) <= 2 ** -7 * torch.linalg.norm(b)


def spelled_out_attention(q, k, v, allowed, policy):
    """block_attention's arithmetic for a 16-bit policy whose products widen, step by step as the
    policy names them: scores of widened operands rounded to compute_dtype, scaled (HF's order),
    masked and softmaxed in softmax_dtype, the probabilities rounded to compute_dtype, their
    widened product with the values rounded to compute_dtype. The same products, in the same
    layout, as block_attention's (each query head's rows of its kv group together)."""
    compute, soft = getattr(torch, policy.compute_dtype), getattr(torch, policy.softmax_dtype)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    scores = (qg.float() @ k.permute(0, 2, 3, 1).float()).to(compute) * D ** -0.5
    scores = scores.view(B, Hkv, G, T, -1).to(soft)
    scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(soft).min)
    if soft == torch.float32:
        probs = torch.softmax(scores, -1)
    else:
        e = torch.exp(scores - scores.amax(-1, keepdim=True))
        probs = e / e.sum(-1, keepdim=True)
    ctx = probs.to(compute).view(B, Hkv, G * T, -1).float() @ v.permute(0, 2, 1, 3).float()
    return ctx.to(compute).view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


@pytest.mark.parametrize("policy", ["bf16", "fp16", "bf16+softmax_dtype=bfloat16"])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_widened_attention_blocks_are_the_policys_steps(policy, head_dim, monkeypatch):
    """The blocks of a long prompt share one Scratch (their scores and probabilities in its
    buffers, rounded to compute_dtype in place there): each block's result is, bit for bit, the
    policy's steps spelled out on that block's queries and keys. head_dim 32 scales the scores
    after the product (HF's order: 2^-2.5 is no power of two); softmax in f32 or in bf16.
    Row 1 is left-padded (its first queries see nothing) and has holes."""
    name, _, knob = policy.partition("+")
    policy = Policy.get(name, **dict([knob.split("=")]) if knob else {})
    compute = getattr(torch, policy.compute_dtype)
    monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, "widened")
    monkeypatch.setattr(ops, "QUERY_BLOCK", 8)
    g = torch.Generator().manual_seed(head_dim)
    B, T, Hq, Hkv = 2, 42, 4, 2
    q = torch.randn(B, T, Hq, head_dim, generator=g).to(compute)
    k, v = (torch.randn(B, T, Hkv, head_dim, generator=g).to(compute) for _ in range(2))
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None].repeat(B, 1, 1)
    allowed[1, :, :5] = False
    allowed[1] &= torch.rand(T, T, generator=g) > 0.2
    got = ops.attention(q, k, v, allowed, policy)
    assert got.dtype == compute
    # the keys and values widened whole, then each block's prefix: the operands attention hands
    # its products, in the same memory layout (a kernel may sum another layout in another order)
    kw, vw = k.float(), v.float()
    for a, n in zip(range(0, T, ops.QUERY_BLOCK), ops.keys_read(allowed)):   # the keys each block reads
        rows = slice(a, a + ops.QUERY_BLOCK)
        want = spelled_out_attention(q[:, rows], kw[:, :n], vw[:, :n], allowed[:, rows, :n], policy)
        assert torch.equal(got[:, rows], want), a


def kernels_or_skip():
    from llamaspec import fixed_order as fo
    from llamaspec.errors import InvarianceError
    try:
        return fo, fo.library()
    except InvarianceError as e:
        pytest.skip(f"fixed-order kernels not available: {e}")


@pytest.mark.parametrize("rows", [1, 3, ops.FEW_ROWS, ops.FEW_ROWS + 1])
def test_bf16_logits_of_few_rows_on_the_kernel(rows, monkeypatch):
    """With the kernel forced, a bf16 policy's f32 logits (model.head_logits) of up to FEW_ROWS
    rows are the fixed-order kernel's product (invariant.linear's bits, within f32 summation of
    the f64 product), torch's products untouched; more rows and fp16 policies keep torch's
    product."""
    kernels_or_skip()
    from torchref import invariant
    monkeypatch.setenv(ops.LOGITS_ENV, "kernel")
    monkeypatch.setenv(ops.PRODUCTS_ENV, "torch")   # fp16's few rows: torch's product, not kernel_products
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=gen).bfloat16()[1:]
    w = (torch.randn(5 * ops.ROW_BLOCK + 3, 96, generator=gen) * 0.1).bfloat16()
    bf16 = Policy.get("bf16")
    spy, blocks = LinearSpy(torch.nn.functional.linear), BmmSpy(torch.bmm)
    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    monkeypatch.setattr(torch, "bmm", blocks)
    logits = head_logits(x, w, ops, bf16)
    torch_calls = len(spy.calls) + len(blocks.calls)
    head_logits(x.half(), w.half(), ops, Policy.get("fp16"))   # fp16: torch's
    monkeypatch.undo()
    few = rows <= ops.FEW_ROWS
    assert torch_calls == (0 if few else 1) and len(spy.calls) + len(blocks.calls) == torch_calls + 1
    assert logits.shape == (1, rows, w.shape[0]) and logits.dtype == torch.float32
    within_f32_sums(logits[0], x[0], w)
    if few:
        assert torch.equal(logits, invariant.linear(x, w, None, bf16, "float32"))


def test_kernel_logits_rule(monkeypatch):
    """auto: the kernel for one row where its code path is AVX2 or better, for up to FEW_ROWS
    rows where it is AVX-512-BF16; never on its scalar path, for more rows, other dtypes or
    outputs, or with torch asked for; an unknown choice is an error."""
    fo, lib = kernels_or_skip()
    bf16, f32, f16, cpu = torch.bfloat16, torch.float32, torch.float16, torch.device("cpu")
    monkeypatch.setenv(ops.LOGITS_ENV, "auto")
    paths = fo.code_paths(lib)
    for path in paths:
        with fo.code_path(lib, path):
            for rows in (1, 2, ops.FEW_ROWS, ops.FEW_ROWS + 1):
                want = (rows == 1 and path != "scalar") or (rows <= ops.FEW_ROWS and path == "avx512_bf16")
                assert ops.kernel_logits(bf16, f32, f32, rows, cpu) is want, (path, rows)
            assert not ops.kernel_logits(bf16, f32, bf16, 1, cpu)
            assert not ops.kernel_logits(f16, f32, f32, 1, cpu)
            assert not ops.kernel_logits(f32, f32, f32, 1, cpu)
    monkeypatch.setenv(ops.LOGITS_ENV, "torch")
    assert not ops.kernel_logits(bf16, f32, f32, 1, cpu)
    monkeypatch.setenv(ops.LOGITS_ENV, "kernel")
    assert ops.kernel_logits(bf16, f32, f32, ops.FEW_ROWS, cpu)
    monkeypatch.setenv(ops.LOGITS_ENV, "fast")
    with pytest.raises(ValueError, match=ops.LOGITS_ENV):
        ops.kernel_logits(bf16, f32, f32, 1, cpu)


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 3, ops.FEW_ROWS, 3 * ops.FEW_ROWS + 5])
def test_products_on_the_kernel(policy, rows, monkeypatch):
    """kernel_products (forced): q/k/v-like weights read by one x, with and without biases, are one
    product on the fixed-order kernel, torch's products untouched: each result within f32 summation
    of the f64 product (16-bit ones then rounded once), shaped and typed as torch's path gives it,
    and the same bits whatever the thread count and whichever rows share the call (the kernel's
    order per output is fixed), and as each weight's own call; a weight changed in place is packed
    again, and the packed copy does not keep the weights alive."""
    kernels_or_skip()
    monkeypatch.setenv(ops.PRODUCTS_ENV, "kernel")
    pol = Policy.get(policy)
    c = getattr(torch, pol.compute_dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=gen).to(c)[1:]                     # [1, rows, 96], a view
    ws = [torch.nn.Parameter((torch.randn(n, 96, generator=gen) * 0.1).to(c), requires_grad=False)
          for n in (40, 17, 17)]
    bs = [(torch.randn(40, generator=gen) * 0.1).to(c), None, (torch.randn(17, generator=gen) * 0.1).to(c)]
    spy, blocks = LinearSpy(torch.nn.functional.linear), BmmSpy(torch.bmm)
    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    monkeypatch.setattr(torch, "bmm", blocks)
    ys = ops.linears(x, ws, bs, pol)
    logits = ops.linear(x, ws[0], None, pol, "float32")
    monkeypatch.undo()
    assert spy.calls == blocks.calls == []
    monkeypatch.setenv(ops.PRODUCTS_ENV, "kernel")
    for y, w, b in zip(ys, ws, bs):
        assert y.shape == (1, rows, w.shape[0]) and y.dtype == c
        if c == torch.float32:
            x64, w64 = x[0].double(), w.double()
            err = (y[0].double() - (x64 @ w64.T + (0 if b is None else b.double()))).abs()
            assert bool((err <= 98 * U32 * (x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs()))).all())
        else:
            rounded_within(y[0], x[0], w, b)
    assert logits.dtype == torch.float32
    within_f32_sums(logits[0], x[0], ws[0])
    one_thread = on_one_thread(ops.linears, x, ws, bs, pol)
    for y, alone, one in zip(ys, [ops.linear(x, w, b, pol) for w, b in zip(ws, bs)], one_thread):
        assert torch.equal(y, alone) and torch.equal(y, one)
    for r in range(rows):
        assert all(torch.equal(y[:, r:r + 1], part) for y, part in zip(ys, ops.linears(x[:, r:r + 1], ws, bs, pol)))
    with torch.no_grad():
        ws[0].mul_(2)                        # exact: every product doubles
    assert torch.equal(ops.linear(x, ws[0], None, pol, "float32"), 2 * logits), "a changed weight is packed again"
    import gc
    import weakref
    ref = weakref.ref(ws[0])
    del ws
    gc.collect()
    assert ref() is None, "the packed copy keeps its weights alive"


def test_kernel_products_rule(flags, monkeypatch):
    """auto: products with an f32 accumulator on an x86-64 CPU whose kernel code path is AVX2 or
    better, of f32 operands, or of 16-bit ones linears widens (an f32 result; WIDE_MIN_ROWS rows
    or more where torch multiplies them in software), or of 2 or more 16-bit rows torch would run
    on AVX-512 pair products (not on AMX tiles for that dtype, amx_products: oneDNN capped below
    them counts as without), of at most FEW_ROWS rows, or of any number
    where torch's MKL runs on a CPU of a known vendor other than Intel; not other 16-bit ones,
    more rows on an Intel CPU or one of unknown vendor, f64, off the CPU, or on the scalar path;
    kernel takes any rows, any 16-bit operands and the scalar path too; torch never; an unknown
    choice is an error."""
    fo, lib = kernels_or_skip()
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the rule takes x86-64 CPUs only")
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    cpu = torch.device("cpu")
    monkeypatch.setenv(ops.PRODUCTS_ENV, "auto")
    mkl = torch.backends.mkl.is_available()
    for vendor in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", ""):
        monkeypatch.setattr(cpuinfo, "vendor", lambda vendor=vendor: vendor)
        assert ops.mkl_off_intel() is (mkl and vendor not in ("GenuineIntel", "")), vendor
        for path in fo.code_paths(lib):
            with fo.code_path(lib, path):
                vector = path != "scalar"
                for features, hw in (({"avx2", "fma"}, set()), ({"avx512_bf16"}, {bf16}),
                                     ({"amx_bf16", "avx512_fp16"}, {bf16, f16})):
                    flags(*features)
                    amx = {bf16: "amx_bf16" in features, f16: "amx_fp16" in features}   # AMX tiles for it
                    for rows in (1, 2, ops.WIDE_MIN_ROWS - 1, ops.WIDE_MIN_ROWS, ops.FEW_ROWS, ops.FEW_ROWS + 1,
                                 2048):
                        runs = vector and (rows <= ops.FEW_ROWS or ops.mkl_off_intel())
                        where = (vendor, path, features, rows)
                        assert ops.kernel_products(f32, f32, f32, rows, cpu) is runs, where
                        for c in (bf16, f16):
                            # torch multiplies c in software: the widened products (WIDE_MIN_ROWS
                            # rows on); on AVX-512 pair products without AMX: 2 to FEW_ROWS rows
                            in_software = c not in hw and rows >= ops.WIDE_MIN_ROWS
                            on_pairs = c in hw and not amx[c] and 1 < rows <= ops.FEW_ROWS
                            want = runs and (in_software or on_pairs)
                            assert ops.kernel_products(c, f32, c, rows, cpu) is want, (*where, c)
                            assert ops.kernel_products(c, f32, f32, rows, cpu) is runs, (*where, c)
                    assert not ops.kernel_products(f32, f64, f32, 1, cpu)
                    assert not ops.kernel_products(f64, f64, f64, 1, cpu)
                    assert not ops.kernel_products(f32, f32, f32, 1, torch.device("meta"))
    vector_paths = [p for p in fo.code_paths(lib) if p != "scalar"]
    if vector_paths:
        with fo.code_path(lib, vector_paths[0]):
            flags("avx512_bf16")      # pair products without AMX; forced native keeps torch's 16-bit kernels
            assert ops.kernel_products(bf16, f32, bf16, ops.WIDE_MIN_ROWS, cpu)
            monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, "native")
            assert not ops.kernel_products(bf16, f32, bf16, ops.WIDE_MIN_ROWS, cpu)
            monkeypatch.setenv(cpuinfo.BF16_DOTS_ENV, "auto")
            flags("amx_bf16", "avx512_bf16")   # AMX tiles keep torch's, unless oneDNN is capped below them
            assert not ops.kernel_products(bf16, f32, bf16, ops.WIDE_MIN_ROWS, cpu)
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
            assert ops.kernel_products(bf16, f32, bf16, ops.WIDE_MIN_ROWS, cpu)
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    with fo.code_path(lib, "scalar"):
        monkeypatch.setenv(ops.PRODUCTS_ENV, "kernel")
        assert ops.kernel_products(f32, f32, f32, 1, cpu)
    monkeypatch.setattr(cpuinfo, "vendor", lambda: "GenuineIntel")
    assert ops.kernel_products(bf16, f32, bf16, 1, cpu) and ops.kernel_products(f16, f32, f16, ops.FEW_ROWS, cpu)
    assert ops.kernel_products(f32, f32, f32, 2048, cpu) and ops.kernel_products(bf16, f32, bf16, 2048, cpu)
    assert not ops.kernel_products(f64, f64, f64, 2048, cpu)
    monkeypatch.setenv(ops.PRODUCTS_ENV, "torch")
    assert not ops.kernel_products(f32, f32, f32, 1, cpu)
    monkeypatch.setenv(ops.PRODUCTS_ENV, "fast")
    with pytest.raises(ValueError, match=ops.PRODUCTS_ENV):
        ops.kernel_products(f32, f32, f32, 1, cpu)
