"""compare.capture: run one implementation and write its taps as a dump (docs/dumps.md), to be
judged later, elsewhere, against a live or dumped other side (compare.adapters.dump.Dump)."""

from __future__ import annotations

import json
import os
import shutil
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from llamaspec import LlamaConfig, Policy
from llamaspec import taps as tapnames
from llamaspec.files import atomic_write
from llamaspec.interrupts import new_scratch, sweep_scratch

from .adapters import PACKAGES, OurModel, as_implementation, inject_support
from .adapters.dump import (
    FLOAT_DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    DumpError,
    expected_shape,
    file_for,
    file_sha256,
    fingerprint,
    policy_differences,
)
from .adapters.generic import HandedOver, read_only
from .environment import environment
from .ladder.engine import parse_inputs
from .ladder.stream import CheckpointModel, stream_capture

# the private folders a capture writes in beside its --out (.<name>.capture-<pid>@<host>-*) and
# the old dump's while it is replaced (.<name>.old-...): a kill -9 leaves them, the next capture
# in that folder removes them (llamaspec.interrupts.sweep_scratch)
SCRATCH_RE = r"\..+\.(?:capture|old)-"


def _tool_version() -> str:
    try:
        return version("llama-parity")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _prepare_folder(out: Path, force: bool) -> bool:
    """Checks `out`: new or empty (False), or holding an earlier dump and force (True: it is
    replaced at the end, as a whole); anything else is refused, so a capture never mixes
    with other files. Nothing in `out` is touched here."""
    if out.exists() and not out.is_dir():
        raise DumpError(f"--out {out}: is a file, not a folder")
    if out.is_symlink():
        raise DumpError(f"--out {out}: is a symlink; give the dump's own folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not present:
        return False
    manifest = out / MANIFEST
    ours = manifest.is_file() and not manifest.is_symlink() and FORMAT in manifest.read_text(errors="replace")[:200]
    if not ours:
        raise DumpError(f"--out {out}: the folder is not empty and holds no dump ({', '.join(present[:5])}); "
                        "choose an empty or new folder")
    if not force:
        raise DumpError(f"--out {out}: holds a dump already; pass force=True (--force) to replace it")
    return True


def _publish(staging: Path, out: Path, replace: bool) -> None:
    """The finished dump (written in `staging`, a private folder beside `out`) takes the name
    `out` in one rename: a new or empty `out` is replaced; an old dump (replace) is moved
    aside first and removed after. A folder that another capture filled meanwhile is left
    as it is, and this run is refused: one folder, one run's manifest and files."""
    os.chmod(staging, 0o777 & ~_umask())
    trash = None
    if replace:
        trash = new_scratch(out.parent, f".{out.name}.old-")
        os.rename(out, trash / "dump")
    try:
        os.rename(staging, out)
    except OSError as e:
        raise DumpError(f"--out {out}: another capture wrote into this folder while this one ran ({e.strerror}); "
                        "this run's dump was discarded, the folder holds the other one") from None
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _resolve(impl, checkpoint, policy, batch_invariant):
    """(Implementation, Policy) for a name (loaded here at the policy, bf16 by default) or an
    object (its own policy when it states one; a different one given is refused)."""
    if isinstance(impl, str):
        if impl not in PACKAGES:
            raise ValueError(f"unknown implementation '{impl}' (torchref, jaxmodel, or an object following the "
                             "Implementation protocol)")
        policy = Policy.get(policy or "bf16")
        if batch_invariant:
            return OurModel.load(impl, checkpoint, policy, batch_invariant), policy
        return CheckpointModel(impl, checkpoint, policy), policy     # captured layer by layer
    side = as_implementation(impl, checkpoint)
    own = getattr(side, "policy", None)
    if isinstance(own, Policy):
        if policy is not None and policy_differences(own, Policy.get(policy)):
            raise ValueError(f"{side.name} runs at {own.name}, not {Policy.get(policy).name}: "
                             f"{'; '.join(policy_differences(own, Policy.get(policy)))}")
        return side, own
    if policy is None:
        raise ValueError(f"{side.name} states no policy: say which one it ran at (policy=...), the comparison "
                         "judges it at that one")
    return side, Policy.get(policy)


def _write_taps(out: Path, side, acts, names, cfg, shape, prefix: str, progress) -> dict:
    """The taps checked (present, float, the config's shape) and written one file per layer;
    returns {file name: [taps]}."""
    files: dict[str, list[str]] = {}
    for t in names:
        if t not in acts:
            raise DumpError(f"{side.name}: capture returned no '{t}'")
        a = np.asarray(acts[t])
        if a.shape != expected_shape(t, cfg, *shape) or str(a.dtype) not in FLOAT_DTYPES.values():
            raise DumpError(f"{side.name}: tap '{t}' came back as {a.dtype} {list(a.shape)}, expected a float array "
                            f"of shape {list(expected_shape(t, cfg, *shape))}")
        files.setdefault(prefix + file_for(t), []).append(t)
    for i, (name, ts) in enumerate(files.items()):
        _save(out, name, {t: np.ascontiguousarray(acts[t]) for t in ts})
        progress(f"wrote {name} ({i + 1}/{len(files)})")
    return files


def _save(folder: Path, name: str, tensors: dict) -> None:
    """One tap file in the (private) staging folder; a full disk names the file."""
    try:
        save_file(tensors, str(folder / name), metadata={"format": FORMAT})
    except OSError as e:
        raise DumpError(f"{name}: cannot write the tap file ({e.strerror or e}); the dump was not written") from None


def _manifest_text(manifest: dict) -> str:
    """Indented JSON with each row of token ids and mask on one line."""
    rows = {f"@row{k}{i}@": json.dumps(r) for k, v in manifest["inputs"].items() for i, r in enumerate(v)}
    marked = {**manifest, "inputs": {k: [f"@row{k}{i}@" for i in range(len(v))]
                                     for k, v in manifest["inputs"].items()}}
    text = json.dumps(marked, indent=1)
    for mark, row in rows.items():
        text = text.replace(f'"{mark}"', row)
    return text


def _forced(side, folder, cfg, ids, mask, names, progress):
    """The teacher-forced run the ladder makes on the judging side (teacher.local_errors):
    every layer fed the oracle's input (torchref at fp64, the default reference's oracle).
    Returns ({layer: injected input}, {tap: forced activation}) for the layer taps of the
    kinds in `names`, layers.<i>.out always."""
    no_inject = inject_support(side)
    if no_inject:
        raise DumpError(f"{side.name}: {no_inject}, so it has no teacher-forced run to capture")
    n = cfg.num_hidden_layers
    progress("teacher forcing: the oracle (torchref at fp64)")
    _, o = stream_capture(CheckpointModel("torchref", str(folder), "fp64"), ids, mask, ["embed", "layers.*.out"])
    inject = tapnames.layer_inputs(o, n)
    kinds = dict.fromkeys([tapnames.tap(t).kind for t in names if tapnames.layer_of(t) is not None] + ["out"])
    want = tapnames.select([f"layers.*.{k}" for k in kinds], cfg, side.taps,
                           lambda pattern, t: f"{side.name} cannot capture '{t}' (asked for as '{pattern}')")
    progress(f"teacher forcing: {side.name} with every layer fed the oracle's input (the whole model loaded)")
    given = HandedOver(ids=ids, mask=mask)
    with given.call(side.name):
        _, forced = side.capture(given["ids"], given["mask"], want, inject=inject)
    return inject, {t: forced[t] for t in want}


def capture(checkpoint, impl="jaxmodel", policy=None, inputs=None, out=None, taps="*", batch_invariant=False,
            teacher_forcing=False, force=False, progress=lambda msg: None) -> Path:
    """Captures `impl` ("torchref", "jaxmodel" or an Implementation object) on `inputs` (as
    compare_models takes them) at `policy` (default bf16; an object's own when it states one)
    and writes the taps (names or globs, default all it has) to the folder `out`. Returns
    the folder. teacher_forcing: also capture the run with every layer fed the oracle's
    input (needs inject), so that the comparison can localise with this dump too."""
    if out is None:
        raise ValueError("out: give the folder the dump goes to")
    out, folder = Path(out), Path(checkpoint)
    t0 = time.perf_counter()
    print_fp = fingerprint(folder)     # first: a bad checkpoint folder is named before any model loads
    cfg_dict = json.loads((folder / "config.json").read_text())
    cfg = LlamaConfig.from_dict(cfg_dict, source=str(folder / "config.json"))
    ids, mask = parse_inputs(inputs, str(folder))
    # read-only copies: a port that writes into what it is given cannot change the caller's
    # arrays or the inputs this dump records (it is named instead: generic.HandedOver)
    ids, mask = read_only(np.asarray(ids, np.int64)), read_only(np.asarray(mask, np.int64))
    replace = _prepare_folder(out, force)
    # the private folders of captures killed with -9 (their process gone, or untouched for an hour)
    sweep_scratch(out.parent, SCRATCH_RE, say=progress)
    progress(f"loading {impl if isinstance(impl, str) else type(impl).__name__}")
    side, policy = _resolve(impl, str(folder), policy, batch_invariant)
    try:
        names = tapnames.select(taps, cfg, side.taps,
                                lambda pattern, t: f"{side.name} cannot capture '{t}' (asked for as '{pattern}')")
    except KeyError as e:      # a tap this model lacks (layers.9.out of a 2-layer model): bad input
        raise DumpError(f"--taps: {e.args[0]}") from None
    progress(f"capturing {len(names)} taps of {side.name} at {policy.name} on {ids.shape[0]} x {ids.shape[1]} tokens")
    t1 = time.perf_counter()
    # torchref / jaxmodel by name: one layer's weights in memory at a time (bitwise the whole model's capture)
    given = HandedOver(ids=ids, mask=mask)
    with given.call(side.name):
        _, acts = stream_capture(side, given["ids"], given["mask"], names) if isinstance(side, CheckpointModel) \
            else side.capture(given["ids"], given["mask"], names)
    seconds = time.perf_counter() - t1
    # written into a private folder beside `out`, renamed to `out` when complete (_publish)
    staging = new_scratch(out.parent, f".{out.name}.capture-")
    try:
        manifest = _write_dump(staging, side, acts, names, cfg, ids, mask, folder, teacher_forcing, progress)
        manifest.update({
            "implementation": {"name": side.name, "package": impl if isinstance(impl, str) else None,
                               "batch_invariant": bool(getattr(side, "batch_invariant", False))},
            "policy": policy.to_dict(), "config": cfg_dict,
            "checkpoint": {"path": str(folder.resolve()), "fingerprint": print_fp},
            "environment": environment(policy, uses_jax=getattr(side, "package", None) == "jaxmodel",
                                       sides={"captured": side}),
            "capture_seconds": round(seconds, 3)})
        atomic_write(staging / MANIFEST, _manifest_text(manifest), "dump manifest")
        _publish(staging, out, replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"dump written in {time.perf_counter() - t0:.1f} s: {out}")
    return out


def _write_dump(staging: Path, side, acts, names, cfg, ids, mask, folder, teacher_forcing, progress) -> dict:
    """The tap files (and the teacher-forced run's) in `staging`; returns the manifest's
    fields about them, the sha256 of every file included (Dump checks them when opened)."""
    files = _write_taps(staging, side, acts, names, cfg, ids.shape, "", progress)
    forcing = None
    if teacher_forcing:
        inject, forced = _forced(side, folder, cfg, ids, mask, names, progress)
        _save(staging, "forced-inputs.safetensors",
              {f"layers.{i}.input": np.ascontiguousarray(x, np.float64) for i, x in inject.items()})
        forcing = {"oracle": "torchref at fp64", "inputs_file": "forced-inputs.safetensors", "taps": list(forced),
                   "files": _write_taps(staging, side, forced, tuple(forced), cfg, ids.shape, "forced-", progress)}
    written = sorted(p.name for p in staging.iterdir())
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "inputs": {"input_ids": ids.tolist(), "attention_mask": mask.tolist()},
        "taps": list(names), "files": files, "teacher_forcing": forcing,
        "sha256": {name: file_sha256(staging / name) for name in written},
        "tool": {"name": "llama-parity", "version": _tool_version()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
