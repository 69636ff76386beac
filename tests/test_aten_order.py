"""The fast backend's one-row 16-bit products (torchref.fast.one_row_linear): the kernels' copy
of torch's own one-row kernel (llamaspec/fixed_order.h, AtenDots) gives torch's bits at every
CPU capability this CPU runs and on every code path of the kernels, bf16 and fp16, with and
without a bias, at sizes that end in each of the program's tails; the plan confirms torch's
order before using it, and refuses an order that is not torch's.

Each capability runs in a process of its own (tests/aten_order_worker.py): torch fixes it at
start. The probes are built so that the order decides the bits (the other lane order differs
from torch on them), so a wrong copy cannot pass by rounding alone.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from llamaspec import Policy  # noqa: E402
from llamaspec import fixed_order as fo  # noqa: E402
from torchref import fast  # noqa: E402
from torchref import plan as tplan  # noqa: E402

WORKER = Path(__file__).with_name("aten_order_worker.py")


def kernels_or_skip():
    try:
        fast.fixed_order_kernels()
    except Exception as e:      # no compiler, not x86-64: the fast backend leaves these rows to torch
        pytest.skip(f"fixed-order kernels not available: {e}")


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_the_copy_gives_torchs_bits(tmp_path, capability):
    kernels_or_skip()
    out = tmp_path / "out.json"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    run = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    if res["capability"].lower() != capability:
        pytest.skip(f"this CPU does not run torch's {capability} capability (torch took {res['capability']})")
    assert res["plan_order"] == res["order"]
    paths = {c[3] for c in res["cases"]}
    assert "scalar" in paths and res["sizes"] >= 10
    assert len(res["cases"]) == 2 * res["sizes"] * 2 * len(paths)      # dtypes, sizes, bias or not, code paths
    wrong = [c for c in res["cases"] if c[4]]
    assert not wrong, f"outputs differing from torch's [dtype, K, bias, code path, count]: {wrong}"
    assert res["other_order"] > 100      # the probes tell the two lane orders apart


def test_the_plan_refuses_an_order_that_is_not_torchs(monkeypatch):
    """one_row_order checks the table's order against torch.dot: a wrong table leaves None (and
    one-row products with torch)."""
    kernels_or_skip()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in fast.ONE_ROW_ORDERS:
        pytest.skip(f"torch's capability {capability} has no known one-row order")
    right = fast.ONE_ROW_ORDERS[capability]
    tplan.one_row_order.cache_clear()
    try:
        assert tplan.one_row_order() == right
        monkeypatch.setitem(fast.ONE_ROW_ORDERS, capability, "sequential" if right == "butterfly" else "butterfly")
        tplan.one_row_order.cache_clear()
        assert tplan.one_row_order() is None
    finally:
        tplan.one_row_order.cache_clear()


def test_one_row_rule():
    """One row of bf16 / fp16 operands on the copy where the kernels build and torch's order is
    known, on products=auto; never f32, two rows, another device, the reference or kernel setting."""
    cpu, bf16, f16, f32 = torch.device("cpu"), torch.bfloat16, torch.float16, torch.float32
    c = fast.Choices(products="auto", logits="auto", attention="auto", x86=True, kernel_isa=fo.ISAS["avx2"],
                     kernel_error=None, hardware_bf16=True, hardware_fp16=False, amx_bf16=False, amx_fp16=False,
                     dots_auto=True, mkl_off_intel=False, one_row_order="butterfly")
    rule = fast.one_row_in_torch_order
    assert rule(c, bf16, 1, cpu) and rule(c, f16, 1, cpu)
    assert not rule(c, f32, 1, cpu) and not rule(c, bf16, 2, cpu) and not rule(c, bf16, 1, torch.device("meta"))
    assert not rule(c._replace(one_row_order=None), bf16, 1, cpu)
    assert not rule(c._replace(kernel_isa=None), bf16, 1, cpu)
    assert not rule(c._replace(products="reference"), bf16, 1, cpu)
    assert not rule(c._replace(products="kernel"), bf16, 1, cpu)
    assert "one-row order" in fast.describe(c, Policy.get("bf16"), cpu)["products"]


def test_the_fast_backend_sends_one_row_there():
    """Fast.linears of one bf16 row gives one_row_linear's bits in torch's order, on probes where
    the other order gives other bits (so it is that path, not a coincidence of rounding)."""
    kernels_or_skip()
    order = tplan.one_row_order()
    if order is None:
        pytest.skip("torch's one-row order is not known here")
    c = tplan.choices(Policy.get("bf16"), torch.device("cpu"), {})
    x, w = tplan.order_probe(213, 64, torch.bfloat16, torch.Generator().manual_seed(1))
    got = fast.Fast(c).linears(x[None, None], (w,), (None,), Policy.get("bf16"))[0]
    assert torch.equal(got, fast.one_row_linear(x[None, None], w, None, order == "sequential"))
    assert not torch.equal(got, fast.one_row_linear(x[None, None], w, None, order != "sequential"))
