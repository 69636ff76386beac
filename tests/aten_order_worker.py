"""Checks, in a process of its own (torch's CPU capability is fixed when torch starts:
ATEN_CPU_CAPABILITY), that the kernels' copy of torch's one-row 16-bit product gives torch's
bits, for tests/test_aten_order.py.

    ATEN_CPU_CAPABILITY=avx2 python tests/aten_order_worker.py OUT.json

torch's side is torch.nn.functional.linear with oneDNN switched off, the product the fast
backend replaces (torch runs it on ATen's dot kernel then). This process flips that switch
itself; nothing in torchref does. OUT: {"capability", "order", "cases": [[dtype, K, bias, code
path, outputs differing]], "sizes": how many K, "other_order": outputs where the other lane order
differs from torch}.
"""

import json
import sys
from pathlib import Path

import torch

from llamaspec import fixed_order as fo
from llamaspec.files import atomic_write
from torchref import fast
from torchref import plan as tplan

SIZES = (1, 7, 16, 63, 64, 65, 100, 213, 576, 1536, 4160)
ROWS = 96


def main(out: Path) -> None:
    capability = torch.backends.cpu.get_cpu_capability()
    order = fast.ONE_ROW_ORDERS[capability]
    other = "butterfly" if order == "sequential" else "sequential"
    lib = fast.fixed_order_kernels()
    g = torch.Generator().manual_seed(0)
    cases, other_differs = [], 0
    for dtype in (torch.bfloat16, torch.float16):
        for K in SIZES:
            x, w = tplan.order_probe(K, ROWS, dtype, g)
            for bias in (None, torch.randn(ROWS, generator=g).to(dtype)):
                with torch.backends.mkldnn.flags(enabled=False):
                    want = torch.nn.functional.linear(x[None], w, bias)
                for path in fo.code_paths(lib):
                    with fo.code_path(lib, path):
                        got = fast.one_row_linear(x[None], w, bias, order == "sequential")
                    cases.append([str(dtype), K, bias is not None, path, int((got != want).sum())])
                if K >= 64:
                    other_differs += int((fast.one_row_linear(x[None], w, bias, other == "sequential") != want).sum())
    result = {"capability": capability, "order": order, "plan_order": tplan.one_row_order(), "cases": cases,
              "sizes": len(SIZES), "other_order": other_differs}
    atomic_write(out, json.dumps(result), "the worker's result")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
