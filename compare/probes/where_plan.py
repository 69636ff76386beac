"""The circumstances of `probe where` as data: which forward calls to make (Run) and which
target rows to compare (Pair of Samples). No model is touched here.

    runs, pairs = plan("padding", target, vocab_size=..., pad_id=...)

A Run is one forward call (ids, mask) of one model ("main", or "other": the invariant-mode
model of the invariant-mode circumstance), made in this process or in a fresh one; a
decode Run (`step` set: decode) is a prefill of (ids, mask) and one decode step through the
cache with the token `step[b]` per row, whose one new position is what is captured. A
Sample is the target inside a run: its row and the slots of the positions compared (of
a decode Run: [0], the step; `feed`: the slots teacher forcing replaces, there the row's
real prompt slots and the step, in the prompt + step layout of the layer inputs). A
Pair compares sample A with sample B; own_twin says whether B's circumstance gets its own
float64 twin run (batch, padding, append, sharding, device: the twin run in B's circumstance is
the fp64 rung of the comparison) or is judged against A's (rerun, invariant-mode: same input).

CIRCUMSTANCES is the one registry of circumstances: each a Circumstance record (its plan,
the bound on its largest call, how it is run, its help line); a new circumstance is one
entry there, and the CLI, the budget check and probe_where read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from llamaspec.budget import check_tokens
from llamaspec.caps import DEFAULT as DEFAULT_CAP
from llamaspec.errors import InputError

ALONE = "alone"
# The plans' defaults, shared by the plans and the bounds on their largest calls.
BATCH_SIZES = (2, 8)    # batch, decode
PAD = 5                 # padding: pad slots
APPENDED = (1, 8)       # append: tokens appended
BATCH = 4               # rerun, invariant-mode, sharding, device: the rows of the one mixed batch
GPU = "gpu"             # device: the other device is the GPU (else an instruction-set cap, llamaspec.caps)


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    key: str
    ids: np.ndarray          # [B, W] int64
    mask: np.ndarray         # [B, W] 0/1
    model: str = "main"      # main | other (the invariant-mode model) | "mesh <axes>" (a sharded model) |
                             # "gpu" (the model on the GPU) | "cap <name>" (the model under an instruction-set cap)
    fresh: bool = False      # made in a fresh Python process (rerun; device under a cap)
    twin: bool = True        # its float64 twin run is needed
    step: np.ndarray | None = None   # [B] a decode Run: the token each row is fed after the prompt

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    @property
    def call_shape(self) -> list:
        """[rows, slots] of the call whose products are compared: a decode step has one slot."""
        return [self.rows, 1 if self.step is not None else self.width]


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    run: str
    row: int
    slots: np.ndarray        # caller slots of the compared target positions, in order
    feed: np.ndarray | None = None   # the slots teacher forcing replaces (None: slots)

    @property
    def fed(self) -> np.ndarray:
        return self.slots if self.feed is None else self.feed


@dataclasses.dataclass(frozen=True, eq=False)
class Pair:
    name: str                # "B=8 mixed lengths, row 4"
    group: str               # equal | mixed | right | left | left-noise | interior | append | repeat | fresh | mode
    a: Sample
    b: Sample
    own_twin: bool = True


def _tokens(rng, vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, vocab, n).astype(np.int64)


def pack(rows: list[np.ndarray], side: str, width: int | None = None, pad_id: int = 0):
    """Rows of different lengths -> ids, mask [B, width], padded on `side` (right | left)."""
    width = width or max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for b, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask


def target_rows(B: int) -> list[int]:
    """First, middle and last row."""
    return sorted({0, B // 2, B - 1})


def _alone(target) -> tuple[Run, Sample]:
    T = target.shape[1]
    return Run(ALONE, target, np.ones_like(target)), Sample(ALONE, 0, np.arange(T))


def _batches(target, rng, vocab, pad_id, batch_sizes, kinds, side):
    """(kind, B, target rows, ids, mask) per kind and batch size: the target at the first,
    middle and last row, companions of its length (equal) or of random lengths T/4..2T
    (mixed), padded on `side`. A generator: a caller may draw from rng between batches."""
    T = target.shape[1]
    for kind in kinds:
        for B in batch_sizes:
            rows = target_rows(B)
            seqs = [target[0] if b in rows else
                    _tokens(rng, vocab, T if kind == "equal" else int(rng.integers(max(1, T // 4), 2 * T + 1)))
                    for b in range(B)]
            yield (kind, B, rows, *pack(seqs, side, pad_id=pad_id))


def plan_batch(target, rng, vocab, pad_id, batch_sizes=BATCH_SIZES, kinds=("equal", "mixed"), side="right"):
    """The target alone vs inside batches: companions of its length (equal) or of random
    lengths T/4..2T padded on `side` (mixed); the target at the first, middle and last row."""
    run_a, a = _alone(target)
    runs, pairs = [run_a], []
    for kind, B, rows, ids, mask in _batches(target, rng, vocab, pad_id, batch_sizes, kinds, side):
        key = f"B={B} {kind}"
        runs.append(Run(key, ids, mask))
        for r in rows:
            pairs.append(Pair(f"B={B} {kind} lengths, row {r}", kind, a, Sample(key, r, np.flatnonzero(mask[r]))))
    return runs, pairs


def plan_padding(target, rng, vocab, pad_id, pad=PAD):
    """Unpadded vs right padding (random pad tokens), left padding (pad id, then random pad
    tokens: if these two differ, pad content reaches real positions) and interior padding
    (pad slots in the middle of the row), each B=1, and left padding in a B=2 batch whose
    other row is longer (the last-token, CLS-style readout sits at the last slot)."""
    run_a, a = _alone(target)
    T = target.shape[1]
    noise = _tokens(rng, vocab, pad)
    right = pack([target[0]], "right", T + pad, pad_id)
    right[0][0, T:] = noise
    left = pack([target[0]], "left", T + pad, pad_id)
    left_noise = (left[0].copy(), left[1])
    left_noise[0][0, :pad] = noise
    cut = T // 2
    inner = (np.concatenate([target[:, :cut], np.full((1, pad), pad_id), target[:, cut:]], 1),
             np.concatenate([np.ones((1, cut)), np.zeros((1, pad)), np.ones((1, T - cut))], 1).astype(np.int64))
    cls = pack([target[0], _tokens(rng, vocab, T + pad)], "left", pad_id=pad_id)
    cases = [("right", f"right padding (+{pad}, random pad tokens)", right),
             ("left", f"left padding (+{pad}, pad id)", left),
             ("left-noise", f"left padding (+{pad}, random pad tokens)", left_noise),
             ("interior", f"interior padding ({pad} pad slots after position {cut - 1})", inner),
             ("cls-left", f"left padding in a B=2 batch (+{pad}), row 0", cls)]
    runs, pairs = [run_a], []
    for group, name, (ids, mask) in cases:
        runs.append(Run(group, ids, mask))
        pairs.append(Pair(name, group, a, Sample(group, 0, np.flatnonzero(mask[0]))))
    return runs, pairs


def plan_append(target, rng, vocab, pad_id, appended=APPENDED):
    """A sequence vs the same sequence with tokens appended: positions < T must not change
    (no padding: pad_id is not used)."""
    run_a, a = _alone(target)
    T = target.shape[1]
    runs, pairs = [run_a], []
    for k in appended:
        ids = np.concatenate([target, _tokens(rng, vocab, k)[None]], 1)
        key = f"+{k}"
        runs.append(Run(key, ids, np.ones_like(ids)))
        pairs.append(Pair(f"{k} token(s) appended: positions 0-{T - 1}", "append", a, Sample(key, 0, np.arange(T))))
    return runs, pairs


def plan_decode(target, rng, vocab, pad_id, batch_sizes=BATCH_SIZES, kinds=("equal", "mixed"), token=None):
    """The first generated step ("compare the layerwise features of first generated step for
    both settings"): the target prefilled alone and decoded one step, vs the same inside
    batches (companions of its length, or of random lengths T/4..2T left-padded, as a KV
    cache needs the rows left-aligned), the target at the first, middle and last row. The
    target is fed `token` at the step (default: a random one, the same in every run; the
    companions random ones); only the step's one position is compared."""
    T = target.shape[1]
    tok = int(rng.integers(0, vocab)) if token is None else int(token)
    alone = Run(ALONE, target, np.ones_like(target), step=np.array([tok]))
    a = Sample(ALONE, 0, np.array([0]), np.arange(T + 1))
    runs, pairs = [alone], []
    for kind, B, rows, ids, mask in _batches(target, rng, vocab, pad_id, batch_sizes, kinds, "left"):
        step = np.where(np.isin(np.arange(B), rows), tok, _tokens(rng, vocab, B))
        key = f"decode B={B} {kind}"
        runs.append(Run(key, ids, mask, step=step))
        for r in rows:
            pairs.append(Pair(f"B={B} {kind} lengths, row {r}: the first generated step", kind, a,
                              Sample(key, r, np.array([0]), np.append(np.flatnonzero(mask[r]), ids.shape[1]))))
    return runs, pairs


def _mixed_batch(target, rng, vocab, pad_id, batch):
    T = target.shape[1]
    seqs = [target[0]] + [_tokens(rng, vocab, int(rng.integers(max(1, T // 2), 2 * T))) for _ in range(batch - 1)]
    return pack(seqs, "right", pad_id=pad_id)


def plan_rerun(target, rng, vocab, pad_id, batch=BATCH, repeats=1, processes=1):
    """One batch (the target at row 0, companions of mixed lengths) run again in this
    process `repeats` times and once in each of `processes` fresh processes."""
    ids, mask = _mixed_batch(target, rng, vocab, pad_id, batch)
    slots = np.flatnonzero(mask[0])
    first = Run("first run", ids, mask)
    a = Sample(first.key, 0, slots)
    runs, pairs = [first], []
    for i in range(repeats):
        runs.append(Run(f"repeat {i + 1}", ids, mask, twin=False))
        pairs.append(Pair(f"repeat {i + 1} in this process", "repeat", a, Sample(runs[-1].key, 0, slots), False))
    for i in range(processes):
        runs.append(Run(f"fresh {i + 1}", ids, mask, fresh=True, twin=False))
        pairs.append(Pair(f"fresh process {i + 1}", "fresh", a, Sample(runs[-1].key, 0, slots), False))
    return runs, pairs


def plan_invariant_mode(target, rng, vocab, pad_id, batch=BATCH):
    """Default vs batch-invariant mode on the same input: the target alone and in a batch."""
    run_a, a = _alone(target)
    ids, mask = _mixed_batch(target, rng, vocab, pad_id, batch)
    slots = np.flatnonzero(mask[0])
    runs = [run_a, Run(f"B={batch} mixed", ids, mask),
            Run("invariant alone", run_a.ids, run_a.mask, "other", twin=False),
            Run(f"invariant B={batch} mixed", ids, mask, "other", twin=False)]
    pairs = [Pair("target alone: default vs invariant mode", "mode", a, Sample("invariant alone", 0, a.slots), False),
             Pair(f"B={batch} mixed, row 0: default vs invariant mode", "mode", Sample(runs[1].key, 0, slots),
                  Sample(runs[3].key, 0, slots), False)]
    return runs, pairs


def mesh_label(mesh: dict) -> str:
    """{"data": 2, "tensor": 1} -> "data=2"; {"tensor": 3} -> "tensor=3" (axes of size 1 left out)."""
    return ",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "one device"


def plan_sharding(target, rng, vocab, pad_id, meshes=(), batch=BATCH):
    """One batch (the target at row 0, companions of mixed lengths) on one device vs the same
    batch on each mesh (jaxmodel sharded: tensor-parallel, data-parallel); the sharded runs have
    their own float64 twin, sharded alike, so that a sharding bug is in the fp64 rung."""
    if not meshes:
        raise ValueError("probe where, sharding: no mesh to compare (meshes=[{'tensor': 2}, ...])")
    ids, mask = _mixed_batch(target, rng, vocab, pad_id, batch)
    slots = np.flatnonzero(mask[0])
    one = Run("one device", ids, mask)
    runs, pairs = [one], []
    for mesh in meshes:
        label = mesh_label(mesh)
        runs.append(Run(f"mesh {label}", ids, mask, f"mesh {label}"))
        pairs.append(Pair(f"B={batch} mixed, row 0: mesh {label} vs one device", "mesh", Sample(one.key, 0, slots),
                          Sample(runs[-1].key, 0, slots)))
    return runs, pairs


def device_key(device: str) -> str:
    """The run key and model of the other device: "gpu", or "cap <name>" (an instruction-set cap)."""
    return GPU if device == GPU else f"cap {device}"


def plan_device(target, rng, vocab, pad_id, device=DEFAULT_CAP, batch=BATCH, labels=("this CPU", None)):
    """One batch (the target at row 0, companions of mixed lengths) on this CPU vs the same batch
    on another device: `device` "gpu" (the model on the GPU, in this process) or the name of an
    instruction-set cap (llamaspec.caps: the model in a fresh process started under the cap's
    variables, its float64 twin there too, so that a bug that shows only under the cap is in the
    fp64 rung; probe_where picks the GPU by default where there is one). labels: (this side, the
    other) as the comparison names them (probe_where fills them: "this CPU (avx512_bf16)", "cap
    avx2 (a second process)")."""
    key = device_key(device)
    ids, mask = _mixed_batch(target, rng, vocab, pad_id, batch)
    slots = np.flatnonzero(mask[0])
    here = Run(labels[0], ids, mask)
    other = Run(key, ids, mask, key, fresh=device != GPU)
    name = f"B={batch} mixed, row 0: {labels[0]} vs {labels[1] or key}"
    return [here, other], [Pair(name, "device", Sample(here.key, 0, slots), Sample(other.key, 0, slots))]


# ----- the bounds on each plan's largest forward call: (rows, slots) for a target of T tokens --------
# (companions of mixed lengths are at most 2T slots, a decode run one step more)

def _batches_call(T, batch_sizes=BATCH_SIZES, **_):
    return max(batch_sizes, default=2), 2 * T


def _decode_call(T, batch_sizes=BATCH_SIZES, **_):
    return max(batch_sizes, default=2), 2 * T + 1


def _padding_call(T, pad=PAD, **_):
    return 2, T + pad       # its B=2 readout


def _append_call(T, appended=APPENDED, **_):
    return 1, T + max(appended, default=0)


def _mixed_call(T, batch=BATCH, **_):
    return batch, 2 * T     # one mixed batch


@dataclasses.dataclass(frozen=True)
class Circumstance:
    """One circumstance of `probe where`. plan(target, rng, vocab, pad_id, **options) -> (runs,
    pairs); largest_call(T, **options) -> (rows, slots) bounding every call the plan makes,
    computed without making them; options: the plan's keyword options (the CLI fills those it
    has flags for)."""
    name: str
    plan: Callable
    largest_call: Callable
    options: tuple[str, ...]
    help: str
    streamed: bool = False      # our models walk it layer by layer (compare.adapters.streaming)
    needs_other: bool = False   # a second model: the same one in batch-invariant mode
    sharded: bool = False       # its other runs are jaxmodel on meshes
    other_device: bool = False  # its other runs are on another device (the GPU) or under an instruction-set cap


CIRCUMSTANCES: dict[str, Circumstance] = {c.name: c for c in (
    Circumstance("batch", plan_batch, _batches_call, ("batch_sizes", "kinds", "side"),
                 "the target alone vs inside batches of equal and mixed lengths", streamed=True),
    Circumstance("padding", plan_padding, _padding_call, ("pad",),
                 "unpadded vs right, left and interior padding", streamed=True),
    Circumstance("append", plan_append, _append_call, ("appended",),
                 "a sequence vs the same with tokens appended", streamed=True),
    Circumstance("decode", plan_decode, _decode_call, ("batch_sizes", "kinds", "token"),
                 "the first generated step, alone vs inside batches"),
    Circumstance("rerun", plan_rerun, _mixed_call, ("batch", "repeats", "processes"),
                 "one batch again in this process and in fresh processes"),
    Circumstance("invariant-mode", plan_invariant_mode, _mixed_call, ("batch",),
                 "default vs batch-invariant mode on the same input", needs_other=True),
    Circumstance("sharding", plan_sharding, _mixed_call, ("meshes", "batch"),
                 "one device vs meshes (jaxmodel only)", sharded=True),
    Circumstance("device", plan_device, _mixed_call, ("device", "batch", "labels"),
                 "this CPU vs another device: the GPU, or this CPU capped to an older instruction set in a "
                 "second process (--other-device, --device-cap)", other_device=True),
)}


def circumstance(name: str) -> Circumstance:
    """The registry's entry; an unknown name is a ValueError that lists the known ones."""
    if name not in CIRCUMSTANCES:
        raise ValueError(f"unknown circumstance '{name}' (one of {', '.join(CIRCUMSTANCES)})")
    return CIRCUMSTANCES[name]


def largest_call(name: str, T: int, **options) -> tuple[int, int]:
    """(rows, slots) that bound every forward call plan() makes for a target of T tokens with
    these options, computed without making them (the circumstance's largest_call)."""
    return circumstance(name).largest_call(T, **options)


def check_budget(name: str, T: int, max_positions: int, vocab_size: int, error=None, what: str = "",
                 **options) -> None:
    """The plan's largest call (largest_call) within the budget `--random-tokens` has
    (llamaspec.budget.check_tokens: T within max_position_embeddings, one float64 logits array
    of the call within this machine's memory), before any array of the plan is made."""
    rows, width = largest_call(name, T, **options)
    what = what or f"probe where, {name}"
    check_tokens(rows, T, max_positions, vocab_size, f"{what}: a target of {T} tokens in calls of up to {rows} rows "
                 f"x {width} slots", error or InputError, width=width)


def plan(name: str, target, vocab_size: int, pad_id: int = 0, seed: int = 0, **options):
    """(runs, pairs) of one circumstance (by name, from CIRCUMSTANCES); options: the entry's
    options (batch_sizes, kinds, side for batch; pad for padding; ...)."""
    return circumstance(name).plan(target, np.random.default_rng(seed + 11), vocab_size, pad_id, **options)
