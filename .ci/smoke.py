"""The installed llama-parity, as a user's project gets it: run by .ci/wheel inside a fresh
virtual environment, from a folder outside the source tree. Checks that the package imported
is the installed one, that the torch the environment held before is still there, and that the
main entry points work on a tiny random checkpoint: the CLI's help, compare_models,
assert_parity, a planted bug found, the batch-invariant mode (its kernels compiled from the
wheel's sources) and the plan in the report.

    python .ci/smoke.py EXPECTED_TORCH_VERSION
"""

import importlib.metadata
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        sys.exit(1)


def main(expected_torch: str) -> None:
    import torch

    import compare
    import compare.controls
    import jaxmodel
    import torchref
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for mod in (compare, torchref, jaxmodel):
        where = Path(mod.__file__).resolve()
        check(site in where.parents, f"{mod.__name__} imported from the installed wheel ({where})")
    now = importlib.metadata.version("torch")
    check(now == expected_torch, f"torch stayed {expected_torch} (installed before llama-parity; now {now}, "
          f"{torch.__version__})")

    cli = Path(sys.executable).with_name("llama-parity")
    help_text = subprocess.run([str(cli), "--help"], capture_output=True, text=True, timeout=300)
    check(help_text.returncode == 0 and "compare" in help_text.stdout, "llama-parity --help")

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(Path(tmp) / "tiny", **TINY_CONFIGS["gqa"])
        ids = np.random.default_rng(0).integers(3, 90, (2, 10))
        mask = np.ones_like(ids)
        mask[1, 7:] = 0
        report = compare.compare_models("torchref", "jaxmodel", folder, inputs=(ids, mask), policy="fp32")
        check(report.verdict in ("exact", "drift"), f"compare_models torchref vs jaxmodel fp32: {report.verdict}")
        compare.assert_parity("torchref", "jaxmodel", folder, inputs=(ids, mask), policy="bf16")
        check(True, "assert_parity torchref vs jaxmodel bf16")
        plan = {k: v for k, v in report.environment.items() if "plan" in k}
        check(any(k.endswith("plan backend") for k in plan), "the report records each side's plan")

        bug = compare.controls.CONTROLS["rmsnorm_eps"]
        found = compare.controls.run_control(bug, folder, ids, mask)
        problems = compare.controls.check(bug, found)
        check(not problems, f"planted control '{bug.name}' found: {found.verdict} at "
          f"{getattr(found.first_divergence, 'tap', None)}")

        for name, mod in (("torchref", torchref), ("jaxmodel", jaxmodel)):
            model = mod.from_pretrained(folder, "bf16", backend="invariant")
            alone = np.asarray(model(ids[1:2]), np.float32)
            batched = np.asarray(model(ids), np.float32)[1:2]
            check(np.array_equal(alone, batched), f"{name} invariant backend: a row alone == in a batch, bitwise "
                  f"({model.plan.record()['fixed-order kernels']})")


if __name__ == "__main__":
    main(sys.argv[1])
