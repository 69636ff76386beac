"""The batch-invariant mode's self-check: a row's result must be bitwise the same alone
and inside batches of several sizes, at several positions, on this machine.

Both models run it at load on the ops they use (torchref.invariant.self_check,
jaxmodel.invariant.self_check), so a mode called invariant is verified where it runs,
whatever CPU and library build that is.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .errors import InvarianceError

# Batch sizes and the target's positions in them: sizes that straddle common kernel
# panel heights (4, 8, 16) and a size above a row-block (64 rows of fixed_order).
SIZES = (2, 3, 5, 8, 13, 17, 70)


def check_rows(ops: dict[str, Callable[[np.ndarray], np.ndarray]], pool: int, seed: int = 0,
               sizes: tuple[int, ...] = SIZES) -> None:
    """ops: name -> fn(indices) giving the op's result for the batch of pool rows at
    `indices` (first axis: the batch). For each op, a target row alone is compared with
    the same row at the first, a middle and the last position of batches of `sizes` rows
    (companions drawn from the pool, repeats allowed). Raises InvarianceError naming the
    op, batch size, position and the largest difference."""
    rng = np.random.default_rng(seed)
    for name, fn in ops.items():
        target = 0
        alone = np.asarray(fn(np.array([target])))[0]
        for size in sizes:
            for pos in sorted({0, size // 2, size - 1}):
                idx = rng.integers(1, pool, size)
                idx[pos] = target
                got = np.asarray(fn(idx))[pos]
                if not _same_bits(alone, got):
                    diff = np.abs(got.astype(np.float64) - alone.astype(np.float64))
                    detail = (f"max abs difference {np.nanmax(diff):.3g}" if np.nanmax(diff, initial=0) > 0
                              else "the same values with other bits: signed zeros or NaNs")
                    raise InvarianceError(
                        f"batch-invariant self-check failed on this machine: {name} gives a row "
                        f"another result inside a batch of {size} rows (at position {pos}) than "
                        f"alone ({detail}). The mode cannot promise "
                        "batch invariance here; please report the CPU (lscpu) and library versions")


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
