"""torchref's products on the CPU: the fast backend's paths (torchref.fast: linear, linears) and
the plan's rules that pick them (torchref.plan: choices).

On a CPU without bf16 / fp16 products in hardware torch multiplies 16-bit matrices in software,
several times slower than its f32 product; the fast backend then widens the operands of products
with many rows to f32 (exact products, f32 sums: the policy's arithmetic, the sums in another
order); f32 products of a few rows run in blocks of the weight's rows; on an x86-64 CPU products
of a few rows whose arithmetic is f32 run on the fixed-order kernels' gemm (kernel_products).
These tests hold every path to f32 rounding of the same products against f64, and check the
rules on a CPU's features given as data, so they run the same on any CPU.
"""

import numpy as np  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

from llamaspec import Policy, cpuinfo  # noqa: E402
from torchref import fast, ops  # noqa: E402
from torchref import plan as tplan  # noqa: E402

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


def choices(policy="bf16", **env) -> fast.Choices:
    """This machine's fast-backend choices with these settings ({name: value})."""
    return tplan.choices(Policy.get(policy), torch.device("cpu"), env)


def test_hardware_products_rule():
    """bf16 products in hardware with AMX-BF16 or AVX-512-BF16, fp16 with AMX-FP16 or AVX-512-FP16,
    oneDNN enabled and not capped below them; $LLAMA_PARITY_BF16_DOTS native / widened overrides."""
    rule = tplan.hardware_products
    for flags, bf16, fp16 in [((), False, False), (("avx512_bf16",), True, False), (("amx_bf16",), True, False),
                              (("avx512_fp16", "avx512_bf16"), True, True), (("amx_fp16",), False, True)]:
        f = frozenset(flags)
        assert (rule("bfloat16", f, "auto", "ALL", True), rule("float16", f, "auto", "ALL", True)) == (bf16, fp16)
        assert not rule("bfloat16", f, "auto", "AVX2", True) and not rule("float16", f, "auto", "AVX512_CORE", True)
        assert rule("bfloat16", f, "auto", "AVX512_CORE_BF16", True) is bf16
        assert not rule("bfloat16", f, "auto", "ALL", False)          # oneDNN off
        assert rule("bfloat16", f, "native", "AVX2", False) and not rule("bfloat16", f, "widened", "ALL", True)
    with pytest.raises(ValueError, match=cpuinfo.BF16_DOTS_ENV):
        choices(**{cpuinfo.BF16_DOTS_ENV: "fast"})


def test_kernel_products_rule():
    """kernel_products on auto: f32 sums of f32 operands, of 16-bit ones torch would widen, or of 16-bit
    rows torch would pair (no AMX): 2 to FEW_ROWS (one row is torch's own order: test_aten_order.py);
    at most FEW_ROWS rows or any off Intel with MKL; reference: never; kernel: every product with
    f32 sums."""
    from llamaspec import fixed_order as fo
    cpu, f32, bf16, f64 = torch.device("cpu"), torch.float32, torch.bfloat16, torch.float64
    base = choices()
    if base.kernel_isa is None:
        pytest.skip("fixed-order kernels not available")
    paired = base._replace(products="auto", hardware_bf16=True, amx_bf16=False, dots_auto=True)
    scalar = paired._replace(kernel_isa=fo.ISAS["scalar"], mkl_off_intel=True)   # auto leaves the scalar path
    assert not any(fast.kernel_products(scalar, d, f32, d, rows, cpu) for d in (f32, bf16) for rows in (1, 8, 500))
    for isa in ("avx2", "avx512", "avx512_bf16"):
        assert not fast.kernel_products(paired._replace(kernel_isa=fo.ISAS[isa]), bf16, f32, bf16, 1, cpu), isa
        assert fast.kernel_products(paired._replace(kernel_isa=fo.ISAS[isa]), bf16, f32, bf16, 2, cpu), isa
    # the rule as data, on the kernels' AVX-512-BF16 path whatever this machine's (make test-caps runs others)
    for hw, amx, off_intel in [(False, False, False), (True, False, False), (True, True, True)]:
        c = base._replace(products="auto", hardware_bf16=hw, hardware_fp16=hw, amx_bf16=amx, amx_fp16=amx,
                          dots_auto=True, mkl_off_intel=off_intel, kernel_isa=fo.ISAS["avx512_bf16"])
        for rows in (1, 2, fast.WIDE_MIN_ROWS - 1, fast.WIDE_MIN_ROWS, fast.FEW_ROWS, fast.FEW_ROWS + 1, 500):
            few = rows <= fast.FEW_ROWS
            assert fast.kernel_products(c, f32, f32, f32, rows, cpu) is (few or off_intel), (hw, rows)
            wide = not hw and rows >= fast.WIDE_MIN_ROWS
            pairs = hw and not amx and 1 < rows <= fast.FEW_ROWS
            assert fast.kernel_products(c, bf16, f32, bf16, rows, cpu) is ((wide or pairs) and (few or off_intel))
            assert fast.kernel_products(c, bf16, f32, f32, rows, cpu) is (few or off_intel)   # widened: f32 out
        assert not fast.kernel_products(c, f32, f64, f32, 1, cpu) and not fast.kernel_products(c, f64, f64, f64, 1, cpu)
        assert not fast.kernel_products(c, f32, f32, f32, 1, torch.device("meta"))
        assert not fast.kernel_products(c._replace(products="reference"), f32, f32, f32, 1, cpu)
        assert fast.kernel_products(c._replace(products="kernel"), bf16, f32, bf16, 1, cpu)
    with pytest.raises(ValueError, match=tplan.PRODUCTS_ENV):
        choices(**{tplan.PRODUCTS_ENV: "torch"})


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 3, fast.WIDE_MIN_ROWS, fast.FEW_ROWS + 1, 40])
@pytest.mark.parametrize("setting", [{}, {tplan.PRODUCTS_ENV: "kernel"}, {cpuinfo.BF16_DOTS_ENV: "widened"},
                                     {cpuinfo.BF16_DOTS_ENV: "native", tplan.PRODUCTS_ENV: "reference"}])
def test_every_products_path_is_the_policys_products(policy, rows, setting):
    """The fast backend's linears and linear (f32 logits too), on the path each setting takes, are
    the policy's products: each result within f32 summation of the f64 product (16-bit ones then
    rounded once), shaped and typed as the reference's; a row's result does not depend on the rows
    beside it where the kernel runs."""
    if setting.get(tplan.PRODUCTS_ENV) == "kernel":
        kernels_or_skip()
    pol = Policy.get(policy)
    c = getattr(torch, pol.compute_dtype)
    ns = fast.namespace(tplan.choices(pol, torch.device("cpu"), setting))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=gen).to(c)[1:]                     # [1, rows, 96], a view
    n = 3 * fast.ROW_BLOCK + 5
    ws = [torch.nn.Parameter((torch.randn(m, 96, generator=gen) * 0.1).to(c), requires_grad=False) for m in (n, 17)]
    bs = [(torch.randn(n, generator=gen) * 0.1).to(c), None]
    ys = ns.linears(x, ws, bs, pol)
    for y, want, w, b in zip(ys, ops.linears(x, ws, bs, pol), ws, bs):
        assert y.shape == want.shape and y.dtype == want.dtype
        if c == torch.float32:
            x64, w64 = x[0].double(), w.double()
            err = (y[0].double() - (x64 @ w64.T + (0 if b is None else b.double()))).abs()
            assert bool((err <= 98 * U32 * (x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs()))).all())
        else:
            rounded_within(y[0], x[0], w, b)
    logits = ns.linear(x, ws[0], None, pol, "float32")
    assert logits.dtype == torch.float32
    within_f32_sums(logits[0], x[0], ws[0])
    if setting.get(tplan.PRODUCTS_ENV) == "kernel":
        for r in range(rows):
            assert all(torch.equal(y[:, r:r + 1], p) for y, p in zip(ys, ns.linears(x[:, r:r + 1], ws, bs, pol)))
        assert all(torch.equal(y, one) for y, one in zip(ys, on_one_thread(ns.linears, x, ws, bs, pol)))


def kernels_or_skip():
    from llamaspec import fixed_order as fo
    from llamaspec.errors import InvarianceError
    try:
        return fo, fo.library()
    except InvarianceError as e:
        pytest.skip(f"fixed-order kernels not available: {e}")


@pytest.mark.parametrize("rows", [1, 3, fast.FEW_ROWS])
def test_bf16_logits_of_few_rows_on_the_kernel(rows):
    """A bf16 policy's f32 logits of a few rows on the fixed-order gemm (LLAMA_PARITY_LOGITS=kernel)
    are invariant.linear's bits, within f32 summation of the f64 product, a row's the same alone."""
    kernels_or_skip()
    from torchref import invariant
    pol = Policy.get("bf16")
    ns = fast.namespace(tplan.choices(pol, torch.device("cpu"), {tplan.LOGITS_ENV: "kernel"}))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 96, generator=gen).bfloat16()
    w = (torch.randn(5 * fast.ROW_BLOCK + 3, 96, generator=gen) * 0.1).bfloat16()
    y = ns.linear(x, w, None, pol, "float32")
    assert torch.equal(y, invariant.linear(x, w, None, pol, "float32"))
    within_f32_sums(y[0], x[0], w)
    assert torch.equal(y[:, :1], ns.linear(x[:, :1], w, None, pol, "float32"))


def test_kernel_logits_rule():
    """kernel_logits on auto: bf16 operands, f32 sums and result, one row on AVX2 or better, up to
    FEW_ROWS on AVX-512-BF16; reference: never; kernel: any few rows."""
    from llamaspec import fixed_order as fo
    cpu, f32, bf16, f16 = torch.device("cpu"), torch.float32, torch.bfloat16, torch.float16
    c = choices()._replace(logits="auto", x86=True)
    for path, isa in fo.ISAS.items():
        ci = c._replace(kernel_isa=isa)
        for rows in (1, 2, fast.FEW_ROWS, fast.FEW_ROWS + 1):
            want = (rows == 1 and path != "scalar") or (rows <= fast.FEW_ROWS and path == "avx512_bf16")
            assert fast.kernel_logits(ci, bf16, f32, f32, rows, cpu) is want, (path, rows)
        assert not fast.kernel_logits(ci, bf16, f32, bf16, 1, cpu) and not fast.kernel_logits(ci, f16, f32, f32, 1, cpu)
    assert not fast.kernel_logits(c._replace(kernel_isa=3, logits="reference"), bf16, f32, f32, 1, cpu)
    assert fast.kernel_logits(c._replace(kernel_isa=0, logits="kernel"), bf16, f32, f32, fast.FEW_ROWS, cpu)
    assert not fast.kernel_logits(c._replace(kernel_isa=None, logits="kernel"), bf16, f32, f32, 1, cpu)
    with pytest.raises(ValueError, match=tplan.LOGITS_ENV):
        choices(**{tplan.LOGITS_ENV: "fast"})
