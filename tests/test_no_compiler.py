"""Without a C++ compiler (CXX naming a missing file, an empty cache): one clear message naming
the compiler tried, nothing compiled or retried at every model load, everything but the kernel
backends working (the fast backends on their framework's ops, the invariant backends on their
portable path, bitwise batch-invariant there too), and every plan saying why, in the report.

Run in a fresh process: the kernels a process has built stay loaded, so only a new process
starts without them.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np
    warnings.simplefilter("always")             # every warning issued, not Python's once-per-place
    import compare, jaxmodel, torchref
    from llamaspec.testing import TINY_CONFIGS, make_checkpoint

    folder = make_checkpoint(sys.argv[1], **TINY_CONFIGS["gqa"])
    out = {"plans": {}}
    ids = np.random.default_rng(0).integers(3, 90, (3, 8))
    for name, mod in (("torchref", torchref), ("jaxmodel", jaxmodel)):
        for backend in ("fast", "invariant"):
            m = mod.from_pretrained(folder, "bf16", backend=backend)
            out["plans"][f"{name} {backend}"] = {"kernel_error": m.plan.kernel_error, "ops": dict(m.plan.ops)}
            if backend == "invariant":
                alone = np.asarray(m(ids[1:2]), np.float32)
                batched = np.asarray(m(ids), np.float32)[1:2]
                out[f"{name} invariant bitwise"] = bool(np.array_equal(alone, batched))
    report = compare.compare_models("torchref", "jaxmodel", folder, inputs=(ids, np.ones_like(ids)), policy="fp32")
    out["verdict"] = report.verdict
    out["report plan"] = {k: v for k, v in report.environment.items() if k.endswith("fixed-order kernels")}
    print("RESULT " + json.dumps(out))
""")


def run_without_compiler(tmp_path, **env):
    cache = tmp_path / "cache"
    cache.mkdir()
    full = {**os.environ, "CXX": str(tmp_path / "no-such-compiler" / "g++"), "LLAMA_PARITY_CACHE": str(cache), **env}
    for key in ("LLAMA_PARITY_INVARIANT", "LLAMA_PARITY_KERNEL_ISA"):
        if key not in env:
            full.pop(key, None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ck")], env=full, capture_output=True,
                          text=True, timeout=600)
    return done, cache


def test_without_a_compiler_one_message_and_everything_but_the_kernels_works(tmp_path):
    done, cache = run_without_compiler(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    cxx = str(tmp_path / "no-such-compiler" / "g++")
    # one message, naming the compiler it tried; nothing compiled, nothing blamed on the cache folder
    assert done.stderr.count("not available") == 1, done.stderr
    assert f"no C++ compiler: CXX={cxx} is not an executable file" in done.stderr
    assert "compiling" not in done.stderr and "cannot write" not in done.stderr
    assert not any(cache.rglob("*.so"))
    # every plan says why, the same words; the invariant backends run their portable path
    for name, plan in result["plans"].items():
        assert plan["kernel_error"] and f"CXX={cxx}" in plan["kernel_error"], (name, plan)
        if name.endswith("invariant"):
            assert plan["ops"]["products"].startswith("portable"), (name, plan["ops"])
    assert result["torchref invariant bitwise"] and result["jaxmodel invariant bitwise"]
    assert result["verdict"] in ("exact", "drift")
    # the process's state and the reference's plan (torchref fp32 products use the kernels; jaxmodel's
    # fp32 plan has no use for them and says "not used")
    assert result["report plan"]["fixed-order kernels"].startswith("unavailable: no C++ compiler"), result
    assert result["report plan"]["reference plan fixed-order kernels"].startswith("unavailable: no C++ compiler")


def test_asking_for_the_kernels_without_a_compiler_names_the_compiler(tmp_path):
    done, _ = run_without_compiler(tmp_path, LLAMA_PARITY_INVARIANT="kernels")
    assert done.returncode != 0
    assert "LLAMA_PARITY_INVARIANT=kernels" in done.stderr and "no C++ compiler: CXX=" in done.stderr, \
        done.stderr[-2000:]
    assert "cannot write" not in done.stderr
