"""write_repro: the first divergent unit of a comparison as a standalone case (docs/repro.md).

A unit is a decoder layer, the embedding, or the head (final norm + lm_head). The case is a
folder: the unit's weights from the checkpoint, its config, the input both sides were fed (the
oracle's: teacher forcing through capture(..., inject={layer: x}) where a side takes it), the
mask and positions, every side's captured taps inside the unit, and case.py copied as repro.py:
plain numpy that recomputes the unit in float64 and says where the candidate's error leaves the
reference's rounding. Nothing in the case imports llama-parity.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from llamaspec import LlamaConfig, Policy, check_tokens, left_align, positions_from_mask
from llamaspec import taps as tapnames
from llamaspec.checkpoint import check_checkpoint, expected_shapes
from llamaspec.config import ROPE_TYPES
from llamaspec.files import atomic_write, json_text, printable

from ..adapters import InjectUnsupported, Side, forced_capture, inject_support, resolve_side
from ..adapters.dump import bind_dumps
from ..environment import PACKAGES, cpu
from ..ladder.decode import FULL_RECOMPUTE, Forcing, decode_run, oracle_kind
from ..ladder.engine import parse_inputs
from ..results import inputs_record
from ..vocabulary import (
    FP64_FLOOR,
    QUARTER_POSITIONS,
    STRUCT_F32_FLOOR,
    SUBSET_MIN_VALUES,
    drift_factor,
    precision_floor,
)
from .summary import Decoded, ReproError, Summary, check_tap, summarize

SCRIPT = Path(__file__).with_name("case.py")
# Every file a case folder holds; a folder holding anything else is not written into.
FILES = ("README.txt", "repro.py", "case.json", "weights.npz", "inputs.npz", "oracle.npz", "reference.npz",
         "candidate.npz", "candidate_fp64.npz")
FORMAT = "llama-parity repro 1"
# LlamaConfig's fields, each either handed to the script (unit_config) or without effect on a
# unit's float64 math (sizes the weights carry, token ids, the rounding order of a norm's
# weight). A field added to LlamaConfig later is refused until the script implements it.
KNOWN_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope",
                "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_ids", "pad_token_id",
                "model_type", "o_bias", "qk_norm", "norm_offset", "norm_weight_in_norm_dtype", "norms",
                "sliding_window", "attn_softcap", "final_softcap", "query_scale", "embed_scale", "activation",
                "local_rope"}


@dataclasses.dataclass(frozen=True)
class Unit:
    kind: str                   # "layer" | "embed" | "head"
    layer: int | None
    name: str                   # "layers.3" | "embed" | "head"
    taps: tuple[str, ...]       # its tap names in execution order


@dataclasses.dataclass(frozen=True)
class Step:
    """A decode case's place: step `step` (1..N) of a decode after a left-aligned prompt of
    `prompt` slots, with `tokens` [B, step] the tokens fed at steps 1..step. The step writes
    and reads cache slot prompt + step - 1: the one column of the full sequence judged. The
    cache holds `slots` (prompt + the report's N steps, as the decode comparison allocates it:
    a bug that depends on the cache's size sees the same size)."""
    step: int
    prompt: int
    tokens: np.ndarray
    slots: int

    @property
    def slot(self) -> int:
        return self.prompt + self.step - 1

    def sequence(self, ids, mask) -> tuple[np.ndarray, np.ndarray]:
        """The prompt and the tokens fed up to this step, [B, slot + 1], and its mask."""
        return (np.concatenate([ids, self.tokens], 1),
                np.concatenate([mask, np.ones_like(self.tokens)], 1).astype(np.int64))


@dataclasses.dataclass
class Repro:
    """A written case: its folder, the unit, how each side was fed ("oracle": the oracle's input
    forced; "own": the side's own run), the taps both sides captured, and what it could not do."""
    folder: Path
    unit: Unit
    fed: dict
    taps: tuple[str, ...]
    notes: list[str]
    step: Step | None = None    # a decode report's case: the step (None: a prefill's)


def unit_of(summary: Summary | None, cfg: LlamaConfig, unit=None) -> Unit:
    """The unit to write: `unit` when given (a layer index, "layers.<i>", "embed", "head", or a tap
    name: its unit); else the report's first divergence's; for a run without one, the unit of the
    tap the report rated nearest a finding (highest precision ratio), layer 0 when none is rated."""
    n = cfg.num_hidden_layers
    if unit is None:
        unit = _reported_unit(summary)
    if isinstance(unit, (int, np.integer)) and not isinstance(unit, bool):
        unit = f"layers.{int(unit)}"
    if unit == "head" or unit in ("final_norm", "logits"):
        return Unit("head", None, "head", ("final_norm", "logits"))
    if unit == "embed":
        return Unit("embed", None, "embed", ("embed",))
    if isinstance(unit, str) and unit.startswith("layers.") and unit.count(".") == 1:
        unit += ".out"
    layer = tapnames.layer_of(check_tap(unit, "unit"))
    if not 0 <= layer < n:
        raise ReproError(f"unit {unit}: the model has layers 0..{n - 1}")
    return Unit("layer", layer, f"layers.{layer}", tuple(f"layers.{layer}.{s}" for s in cfg.layer_steps))


def _reported_unit(summary: Summary | None):
    if summary is not None and summary.divergence is not None:
        return summary.divergence.tap
    if summary is not None and summary.ratios:
        return max(summary.ratios, key=lambda r: r[1])[0]
    return 0


def write_repro(report, reference, candidate, checkpoint, out, inputs=None, policy=None, unit=None, step=None,
                progress=lambda msg: None) -> Repro:
    """Writes the first divergent unit of `report` (a compare Report, a decode comparison's
    DecodeReport, or either's JSON object) as a standalone case in the folder `out` (new, empty,
    or an earlier case), and returns a Repro.

    reference, candidate: what compare_models took (names, model objects, a port, a Side): the
    sides are run again on the unit; their names must be the report's. inputs: the comparison's
    (compare_models' `inputs`; None: the built-in prompt). policy: the report's unless given.
    unit: another unit than the report's (unit_of). Each side is fed the oracle's input to the
    unit through capture(..., inject=...) where it takes inject, else runs on its own input.

    A decode report's case is one step (`step`: 1..N; default the report's first divergent step,
    else the step whose taps it lists): each side prefills the prompt and decodes the report's
    tokens through its own cache up to that step, the unit's layer fed the oracle's input in the
    prefill and at every step (prefill / decode_capture with inject); the case holds the step's
    one column, and repro.py recomputes the whole sequence in float64 without a cache."""
    summary = summarize(report)
    # a dump fixes the inputs and the policy, and supplies (and checks) the checkpoint
    checkpoint, inputs, policy = bind_dumps(reference, candidate, checkpoint, inputs,
                                            summary.policy if policy is None else policy)
    policy = Policy.get(policy)
    if policy.quantizes_weights:
        raise ReproError(f"policy {policy.name}: the oracle of a policy that quantizes weights (weight_fp8) computes "
                         "over the quantized weights; a repro holds the checkpoint's, so it is not written")
    ckpt = check_checkpoint(checkpoint)
    cfg = ckpt.config
    _check_config(cfg)
    if summary.divergence is not None and summary.divergence.tap not in tapnames.all_taps(cfg):
        raise ReproError(f"the report's first divergence {summary.divergence.tap} is not a tap of the checkpoint's "
                         f"model ({cfg.num_hidden_layers} layers): not the checkpoint it was compared on")
    ids, mask = check_tokens(cfg, *parse_inputs(inputs, checkpoint))
    at = None
    if summary.decode is not None:
        ids, mask = left_align(np.asarray(ids, np.int64), np.asarray(mask, np.int64))
        at = _step(summary.decode, ids, cfg, step)
        check_tokens(cfg, *at.sequence(ids, mask))
    elif step is not None:
        raise ReproError(f"step={step}: the report is a prefill comparison's; a step is a decode report's")
    _check_inputs(summary, ids, mask)
    folder = case_folder(out)
    the_unit = unit_of(summary, cfg, unit)
    ref, cand = (resolve_side(s, checkpoint, policy) for s in (reference, candidate))
    ref.needs_twin("reference", "a repro (its float64 run is the oracle the unit's input comes from)")
    for role, side, named in (("reference", ref, summary.reference), ("candidate", cand, summary.candidate)):
        if side.name != named:
            raise ReproError(f"the report's {role} is {named}; the {role} given is {printable(side.name)}: give the "
                             "same implementation the report compared")
    if at is None:
        progress(f"repro: {the_unit.name}, each side fed the oracle's input where it takes inject")
        runs = capture_unit(the_unit, ref, cand, ids, mask, cfg, summary, progress)
    else:
        if oracle_kind(ref, int(mask.sum(1).max()) + at.step) != FULL_RECOMPUTE:
            raise ReproError(f"decode step {at.step}: dynamic RoPE past the trained length "
                             f"({cfg.max_position_embeddings}): a full recompute rotates the cached keys with other "
                             "frequencies than a cache does, so repro.py's float64 without a cache is no oracle here")
        progress(f"repro: {the_unit.name} at decode step {at.step} (cache slot {at.slot}), each side decoding "
                 "through its own cache")
        runs = capture_decode_unit(the_unit, ref, cand, ids, mask, at, cfg, summary, progress)
        ids, mask = at.sequence(ids, mask)
    _write(folder, the_unit, runs, ckpt, cfg, ids, mask, summary, policy, ref, cand, at)
    return Repro(folder, the_unit, {r: run.fed for r, run in runs.items()}, _both(the_unit, runs),
                 [n for run in runs.values() for n in run.notes], at)


def _check_inputs(summary: Summary, ids, mask) -> None:
    """The inputs given are the report's, where it records them (results.inputs_record)."""
    want = summary.inputs
    if want is None:
        return
    got = inputs_record(ids, mask)
    if got["sha256"] != want["sha256"]:
        raise ReproError(f"the report was computed on other inputs ({want['rows']} x {want['tokens']} slots, "
                         f"{want['real_tokens']} real tokens, sha256 {want['sha256'][:12]}...) than those given "
                         f"({got['rows']} x {got['tokens']}, {got['real_tokens']} real, "
                         f"sha256 {got['sha256'][:12]}...): "
                         "give the compare run's inputs again (its --prompt / --random-tokens, or its ids)")


def _step(decoded: Decoded, ids, cfg: LlamaConfig, step) -> Step:
    """The decode step to write, checked against the inputs given (the report's prompt)."""
    tokens = np.asarray(decoded.tokens, np.int64)
    if ids.shape != (tokens.shape[0], decoded.prompt_tokens):
        raise ReproError(f"the decode report decoded {tokens.shape[0]} row(s) after a prompt of "
                         f"{decoded.prompt_tokens} slots (left-aligned); the inputs given are {ids.shape[0]} x "
                         f"{ids.shape[1]}: give the compare run's inputs again")
    n = tokens.shape[1]
    s = step if step is not None else decoded.first_step or decoded.taps_step
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 1 <= s <= n:
        raise ReproError(f"step {s!r}: the report decoded steps 1..{n}")
    return Step(int(s), decoded.prompt_tokens, tokens[:, :int(s)], decoded.prompt_tokens + n)


def _check_config(cfg: LlamaConfig) -> None:
    unknown = sorted(f.name for f in dataclasses.fields(cfg) if f.name not in KNOWN_FIELDS)
    if unknown:
        raise ReproError(f"the model's config has field(s) {unknown} that the repro script does not implement")
    for rope in (cfg.rope, cfg.local_rope):
        if rope is not None and rope.type not in ROPE_TYPES:
            raise ReproError(f"RoPE type {rope.type!r}: the repro script implements {', '.join(ROPE_TYPES)}")


def case_folder(out) -> Path:
    """`out`, made: refused when it holds anything but a case's files (FILES), so that writing a
    case never replaces a user's file."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ReproError(f"repro folder {folder}: is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    other = sorted(p.name for p in folder.iterdir() if p.name not in FILES)
    if other:
        raise ReproError(f"repro folder {folder}: holds {', '.join(other[:5])}{', ...' if len(other) > 5 else ''}, "
                         "which a repro case does not; choose a new or empty folder")
    return folder


# ----- the captures ------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    name: str
    taps: dict              # {tap name: array} of the unit's taps this side returned
    fed: str                # "oracle" | "own" | "ids"
    input: np.ndarray | None
    notes: list


def capture_unit(unit: Unit, ref: Side, cand: Side, ids, mask, cfg: LlamaConfig, summary: Summary,
                 progress=lambda msg: None) -> dict[str, Run]:
    """{role: Run}: the oracle (the reference at float64) on its own input, then the reference and
    the candidate at the policy and the candidate's float64 twin (unless it has none or the
    ladder refused it), each fed the oracle's input to the unit where it takes inject."""
    layer = _forced_layer(unit, cfg)
    entry = None if layer is None else tapnames.input_tap(layer)
    # what the unit reads: a layer its input; the head the last layer's output (the last layer is
    # forced, so that only one layer of each side's own arithmetic comes before the head)
    reads = None if unit.kind == "embed" else f"layers.{layer}.out" if unit.kind == "head" else entry
    progress(f"repro: oracle ({ref.name} at float64)")
    ask = [t for t in dict.fromkeys([entry, reads, *unit.taps]) if t is not None and t in ref.taps]
    o = ref.at_fp64.capture(ids, mask, ask)
    runs = {"oracle": Run(ref.name + " at float64", _pick(o, unit), "ids" if reads is None else "oracle",
                          None if reads is None else o[1][reads], [])}
    x = None if entry is None else o[1][entry]
    for role, impl, name in _sides(ref, cand, summary, runs["oracle"]):
        progress(f"repro: {role} ({name})")
        runs[role] = _side_run(impl, name, unit, ids, mask, layer, x, reads)
    return runs


def _sides(ref: Side, cand: Side, summary: Summary, oracle: Run) -> list[tuple]:
    """(role, implementation, name) of the sides captured after the oracle: the reference and the
    candidate at the policy, and the candidate's float64 twin unless it has none or the comparison
    refused it (said in the oracle's notes)."""
    sides = [("reference", ref.at_policy, ref.name), ("candidate", cand.at_policy, cand.name)]
    if cand.at_fp64 is not None and summary.twin_refused is None:
        sides.append(("candidate_fp64", cand.at_fp64, cand.name + " at float64"))
    elif summary.twin_refused is not None:
        oracle.notes.append(f"candidate at float64: not captured (the comparison refused its twin: "
                            f"{summary.twin_refused})")
    return sides


def _forced_layer(unit: Unit, cfg: LlamaConfig) -> int | None:
    """The layer whose input is forced: the unit's; the last one for the head; none for the embedding."""
    return unit.layer if unit.kind == "layer" else cfg.num_hidden_layers - 1 if unit.kind == "head" else None


def _side_run(impl, name: str, unit: Unit, ids, mask, layer, x, reads) -> Run:
    offered = set(getattr(impl, "taps", ()))
    ask = [t for t in unit.taps if t in offered]
    if reads is None:       # the embedding: every side reads the token ids
        return Run(name, _pick(impl.capture(ids, mask, ask), unit), "ids", None, [])
    # a forced layer's input is x; the head reads the forced last layer's output
    also = [reads] if unit.kind == "head" and reads in offered else []
    why = inject_support(impl)
    if why is None:
        try:
            out = forced_capture(impl, ids, mask, ask + also, {layer: x})
            fed = x if unit.kind == "layer" else out[1].get(reads)
            if fed is not None:
                return Run(name, _pick(out, unit), "oracle", fed, [])
            why = f"it returns no {reads}, the head's input"
        except InjectUnsupported as e:
            why = str(e)
    out = impl.capture(ids, mask, ask + ([reads] if reads in offered else []))
    if reads in out[1]:
        return Run(name, _pick(out, unit), "own", out[1][reads],
                   [f"{name}: fed its own input, not the oracle's ({printable(why)})"])
    return Run(name, _pick(out, unit), "own", None,
               [f"{name}: fed its own input ({printable(why)}), which it does not return ({reads}): its taps are held "
                "to the float64 of the oracle's input, so they carry what earlier steps added"])


def capture_decode_unit(unit: Unit, ref: Side, cand: Side, ids, mask, at: Step, cfg: LlamaConfig, summary: Summary,
                        progress=lambda msg: None) -> dict[str, Run]:
    """{role: Run} at decode step `at`, each holding the step's one column: the oracle (the
    reference at float64 on the whole sequence, no cache: the decode comparison's oracle), then
    the reference, the candidate and its float64 twin each decoding through its own cache, the
    forced layer fed the oracle's input in the prefill and at every step (decode.Forcing)."""
    layer = _forced_layer(unit, cfg)
    entry = None if layer is None else tapnames.input_tap(layer)
    reads = None if unit.kind == "embed" else f"layers.{layer}.out" if unit.kind == "head" else entry
    full_ids, full_mask = at.sequence(ids, mask)
    col = slice(at.slot, at.slot + 1)
    progress(f"repro: oracle ({ref.name} at float64, the whole sequence without a cache)")
    ask = [t for t in dict.fromkeys([entry, reads, *unit.taps]) if t is not None and t in ref.taps]
    logits, o = ref.at_fp64.capture(full_ids, full_mask, ask)
    oracle_in = None if reads is None else o[reads] if unit.kind == "layer" else np.asarray(o[reads])[:, col]
    runs = {"oracle": Run(ref.name + " at float64", {t: np.asarray(a)[:, col] for t, a in _pick((logits, o),
                                                                                                unit).items()},
                          "ids" if reads is None else "oracle", oracle_in, [])}
    forcing = None
    if entry is not None:
        x = np.asarray(o[entry])
        forcing = Forcing({layer: x[:, :at.prompt]}, {layer: x[:, at.prompt:]})
    for role, impl, name in _sides(ref, cand, summary, runs["oracle"]):
        progress(f"repro: {role} ({name}): prefill and {at.step} decode step(s) through its cache")
        runs[role] = _decode_side_run(impl, name, unit, ids, mask, at, forcing, reads)
    return runs


def _decode_side_run(impl, name: str, unit: Unit, ids, mask, at: Step, forcing, reads) -> Run:
    offered = set(getattr(impl, "taps", ()))
    # the logits: a side without the tap is held by the logits its step returns (decode_run)
    ask = [t for t in dict.fromkeys([*unit.taps, *([reads] if unit.kind == "head" else [])])
           if t in offered or t == "logits"]
    if forcing is not None:
        why = inject_support(impl, ("prefill", "decode_capture"))
        if why is not None:
            raise ReproError(f"{name}: a decode case feeds layer {min(forcing.prompt)} the oracle's input in the "
                             f"prefill and at every step (prefill and decode_capture with inject), and {why}")
    out, _ = decode_run(impl, ids, mask, ask, at.tokens, slack=at.slots - at.prompt - at.step, forcing=forcing)
    taps = {t: np.asarray(a)[:, -1:] for t, a in out.items() if t in unit.taps}
    if unit.kind == "embed":
        return Run(name, taps, "ids", None, [])
    if unit.kind == "layer":    # fed the oracle's input at every column: the prompt's, then each step's
        fed = np.concatenate([forcing.prompt[unit.layer], forcing.steps[unit.layer]], 1)
        return Run(name, taps, "oracle", fed, [])
    if reads not in out:
        raise ReproError(f"{name}: the head's case holds it to the float64 of its own last-layer output, and its "
                         f"decode_capture returns no {reads}")
    return Run(name, taps, "oracle", np.asarray(out[reads])[:, -1:], [])


def _pick(out, unit: Unit) -> dict:
    """The unit's taps from a capture's (logits, taps); the logits it returns stand for a "logits"
    tap the side lacks (as the ladder judges a port's returned logits)."""
    logits, got = out
    taps = {t: got[t] for t in unit.taps if t in got}
    if "logits" in unit.taps and "logits" not in taps and logits is not None:
        taps["logits"] = logits
    return taps


def _both(unit: Unit, runs: dict) -> tuple[str, ...]:
    return tuple(t for t in unit.taps if t in runs["reference"].taps and t in runs["candidate"].taps)


# ----- the files ---------------------------------------------------------------------------------

def _stored(a) -> np.ndarray:
    """A captured array or a weight widened exactly: float64 as it is, any narrower float
    (bfloat16, float16, float32) to float32, which holds each of their values."""
    a = np.asarray(a)
    return np.asarray(a, np.float64 if a.dtype == np.float64 else np.float32)


def _npz(path: Path, arrays: dict, what: str) -> None:
    atomic_write(path, lambda f: np.savez(f, **arrays), what)


def _kind(tap: str) -> str:
    """The name of a tap inside its unit: 'layers.3.q' -> 'q'; 'logits' -> 'logits'."""
    return tapnames.parse(tap)[1]


def _write(folder: Path, unit: Unit, runs: dict, ckpt, cfg: LlamaConfig, ids, mask, summary: Summary,
           policy: Policy, ref: Side, cand: Side, at: Step | None = None) -> None:
    """The case's files. ids, mask: every column the unit reads (a decode case's: the prompt and the
    tokens up to its step); the sides' taps hold the judged columns (a decode case's one slot)."""
    for stale in FILES:     # an earlier case's files go first: none of them may survive into this one
        (folder / stale).unlink(missing_ok=True)
    weights = unit_weights(ckpt, cfg, unit, ids)
    _npz(folder / "weights.npz", weights, "repro weights")
    _npz(folder / "inputs.npz", {"ids": np.asarray(ids, np.int64), "mask": np.asarray(mask, np.int64),
                                 "positions": positions_from_mask(np.asarray(mask)).astype(np.int64)}, "repro inputs")
    for role, run in runs.items():
        arrays = {_kind(t): _stored(a) for t, a in run.taps.items()}
        if run.input is not None:
            arrays["input"] = _stored(run.input)
        _npz(folder / f"{role}.npz", arrays, f"repro {role} taps")
    layer_policy = policy if unit.layer is None else policy.for_layer(unit.layer, cfg.num_hidden_layers)
    rule = _rule(layer_policy, cfg, unit, mask, cand.keeps_f32 or summary.keeps_f32_inferred, ref.keeps_f32)
    about = _about(unit, cfg, runs, ids, summary, policy, at)
    case = {"format": FORMAT, "title": about[0], "about": about[1:],
            "unit": {"kind": unit.kind, "layer": unit.layer, "name": unit.name},
            "taps": [_kind(t) for t in _both(unit, runs)], "tap_names": list(_both(unit, runs)),
            "config": unit_config(cfg, unit),
            "sides": {role: {"name": run.name, "fed": run.fed,
                             "at": "float64" if role in ("oracle", "candidate_fp64") else policy.name}
                      for role, run in runs.items()},
            "rule": rule, "weights": sorted(weights), "report": _report_record(summary),
            "inputs": f"{np.shape(ids)[0]} x {np.shape(ids)[1]} slots, {int(np.sum(mask))} real tokens",
            # the columns of inputs.npz the sides' taps hold (null: all); a decode case's: its step's slot
            "columns": None if at is None else [at.slot],
            "decode": None if at is None else {"step": at.step, "slot": at.slot, "prompt_tokens": at.prompt}}
    atomic_write(folder / "case.json", json_text(case, indent=1), "repro case.json")
    atomic_write(folder / "repro.py", SCRIPT.read_text(), "repro script")
    atomic_write(folder / "README.txt", readme(case, runs, weights, ckpt, summary), "repro README")


def _rule(policy: Policy, cfg: LlamaConfig, unit: Unit, mask, cand_keeps_f32: bool, ref_keeps_f32: bool) -> dict:
    """The numbers repro.py decides by (docs/repro.md): the ladder's drift bound (m, floor) at the
    unit's policy, and the float64 gates. A float64 run that keeps float32 steps (transformers')
    is held to STRUCT_F32_FLOOR, 16 float32 unit roundoffs: a unit fed its input carries only its
    own steps' rounding, not a whole run's; from RoPE on, plus the rounding of float32 angles,
    two roundoffs of the largest (the last position times the highest frequency, 1)."""
    u32 = 2.0 ** -24
    longest = int(np.max(positions_from_mask(np.asarray(mask)))) + 1
    gates = {}
    for role, keeps in (("fp64_gate", cand_keeps_f32), ("oracle_gate", ref_keeps_f32)):
        gates[role] = STRUCT_F32_FLOOR if keeps else FP64_FLOOR
        gates[role + "_rope"] = STRUCT_F32_FLOOR + 2 * u32 * longest if keeps and unit.kind == "layer" \
            else gates[role]
    means = ("the rounding of the float32 steps its float64 run keeps, in one unit" if cand_keeps_f32 else
             "what two float64 implementations of the same math may differ by")
    return {"m": drift_factor(policy), "floor": precision_floor(policy, cfg.hidden_size), **gates,
            "fp64_gate_means": means, "quarter_positions": QUARTER_POSITIONS, "min_values": SUBSET_MIN_VALUES}


def unit_weights(ckpt, cfg: LlamaConfig, unit: Unit, ids) -> dict[str, np.ndarray]:
    """The unit's tensors from the checkpoint, widened exactly (_stored): a layer's own
    (model.layers.<i>.*), the embedding rows the batch reads (with embed_row_ids, the token ids
    of those rows), or the final norm and the lm_head (the embedding where tied)."""
    if unit.kind == "embed":
        rows = np.unique(np.asarray(ids))
        return {"model.embed_tokens.weight": _stored(np.asarray(ckpt.get("model.embed_tokens.weight"))[rows]),
                "embed_row_ids": rows.astype(np.int64)}
    if unit.kind == "head":
        keys = ["model.norm.weight", _head_key(cfg)]
    else:
        keys = [k for k in expected_shapes(cfg) if k.startswith(f"model.layers.{unit.layer}.")]
    return {k: _stored(ckpt.get(k)) for k in keys}


def _head_key(cfg: LlamaConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def unit_config(cfg: LlamaConfig, unit: Unit) -> dict:
    """The numbers and family features the unit's float64 math needs (case.py's CONFIG_KEYS)."""
    if unit.kind == "embed":
        return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "embed_scale": cfg.embed_scale}
    if unit.kind == "head":
        return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "rms_norm_eps": cfg.rms_norm_eps,
                "norm_offset": cfg.norm_offset, "final_softcap": cfg.final_softcap, "head_key": _head_key(cfg)}
    i = unit.layer
    return {"model_type": cfg.model_type, "prefix": f"model.layers.{i}.", "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
            "norm_offset": cfg.norm_offset, "norms": dict(cfg.norm_modules), "qk_norm": cfg.qk_norm,
            "attention_bias": cfg.attention_bias, "o_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias,
            "scale": cfg.scale, "attn_softcap": cfg.attn_softcap, "window": cfg.window(i),
            "rope": dataclasses.asdict(cfg.rope_of(i)), "max_position_embeddings": cfg.max_position_embeddings,
            "activation": cfg.activation}


def _report_record(summary: Summary) -> dict:
    d = summary.divergence
    return {"reference": summary.reference, "candidate": summary.candidate, "policy": summary.policy.name,
            "verdict": summary.verdict, "first_divergence": None if d is None else dataclasses.asdict(d),
            "environment": summary.environment}


def _about(unit: Unit, cfg: LlamaConfig, runs: dict, ids, summary: Summary, policy: Policy,
           at: Step | None = None) -> list[str]:
    """The title and the lines repro.py prints above its table."""
    d = summary.divergence
    what = {"layer": f"decoder layer {unit.layer}", "embed": "the embedding",
            "head": "the head (final norm + lm_head)"}[unit.kind]
    feats = cfg.features()
    lines = [f"llama-parity repro case: {what} ({unit.name}) of a {cfg.model_type} model: {cfg.num_hidden_layers} "
             f"layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads "
             f"of {cfg.head_dim}" + (f"; features {', '.join(f'{k}={v}' for k, v in feats.items())}" if feats else ""),
             f"reference: {summary.reference}; candidate: {summary.candidate}; policy {policy.name}; "
             f"{np.shape(ids)[0]} x {np.shape(ids)[1]} tokens",
             f"the report: {summary.verdict}" + ("" if d is None else f", first divergence {d.tap} ({d.kind})")]
    if at is not None:
        lines.append(f"decode step {at.step} after a prompt of {at.prompt} slots: each side prefilled the prompt and "
                     f"decoded through its own KV cache, the step writing and reading slot {at.slot}; float64 is "
                     f"the whole sequence without a cache, column {at.slot}")
    fed = {role: _fed(run, unit, at is not None) for role, run in runs.items() if role != "oracle"}
    lines.append("each side fed: " + (next(iter(fed.values())) if len(set(fed.values())) == 1 else
                                      "; ".join(f"{role} {how}" for role, how in fed.items())))
    return lines


def _fed(run: Run, unit: Unit, decode: bool = False) -> str:
    if run.fed == "ids":
        return "the token ids"
    if run.fed == "own":
        return "its own input" + ("" if run.input is not None else " (not returned: held to the oracle's)")
    how = ("prefill(..., inject=...) and decode_capture(..., inject=...) at each step" if decode else
           "capture(..., inject=...)")
    if unit.kind == "head":
        return f"the oracle's input to the last layer ({how}), then its own last layer"
    return f"the oracle's input (teacher forcing: {how})"


def _versions() -> str:
    out = [f"python {platform.python_version()}"]
    for pkg in PACKAGES:
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            continue
    return ", ".join(out)


def readme(case: dict, runs: dict, weights: dict, ckpt, summary: Summary) -> str:
    """README.txt: what the case is, what the report said, where and with what it was captured, and
    how to run it."""
    d, env, here = summary.divergence, summary.environment, cpu()
    case_unit = Unit(case["unit"]["kind"], case["unit"]["layer"], case["unit"]["name"], ())
    stored = sorted({str(ckpt.storage_dtype(k)) for k in weights if k in ckpt.keys()})
    sides = "\n".join(f"  {role + '.npz':<20} {run.name}: {len(run.taps)} taps, fed "
                      + ("its own input (the oracle's run)" if role == "oracle" and run.fed != "ids" else
                         _fed(run, case_unit, case.get("decode") is not None)) for role, run in runs.items())
    notes = [n for run in runs.values() for n in run.notes]
    return "\n".join([
        case["title"], "",
        "What the comparison said",
        f"  reference {summary.reference}, candidate {summary.candidate}, policy {case['report']['policy']}",
        f"  verdict: {summary.verdict}",
        "  first divergence: " + ("none (this unit is the one nearest a finding)" if d is None else
                                  f"{d.tap} (layer {d.layer}, component {d.component}, {d.kind})"),
        *([f"  hint: {d.hint}"] if d is not None and d.hint else []),
        *([f"  decode step {case['decode']['step']} after a prompt of {case['decode']['prompt_tokens']} slots: each "
           f"side decoded through its own KV cache; the step's slot {case['decode']['slot']} is the one column "
           "its .npz files hold"] if case.get("decode") else []),
        "  measured on: " + (f"{env.get('cpu', '?')} ({env.get('cpu isa', '?')}); "
                             + ", ".join(f"{k} {env[k]}" for k in ("python", "numpy", "torch", "jax", "transformers")
                                         if k in env) if env else "(the report records no environment)"),
        "",
        "What this folder holds",
        f"  weights.npz          the unit's {len(weights)} tensors from the checkpoint (stored as {', '.join(stored)};",
        "                       narrower floats widened exactly to float32)",
        f"  inputs.npz           ids, mask (1 = a real token), positions: {case['inputs']}",
        sides,
        "  case.json            the unit's config (the numbers and family features it needs), the sides, the rule",
        "  repro.py             recomputes the unit in float64 with numpy and holds each side to it",
        *(["", "Notes"] + [f"  {printable(n)}" for n in notes] if notes else []),
        "",
        f"Captured {time.strftime('%Y-%m-%d')} on {here.get('cpu', '?')} ({here.get('cpu isa', '?')}"
        + ("" if here.get("isa caps", "none") == "none" else f"; instruction sets capped: {here['isa caps']}")
        + f") with {_versions()}.",
        "",
        "How to run it (Python 3 and numpy; nothing else)",
        "  python repro.py",
        "  exit 0: the candidate stays within the reference's own rounding at every tap",
        "  exit 1: the candidate differs where the reference does not (the first such tap is named)",
        "  exit 2: the case cannot be run (a file missing, a feature the script does not implement)",
        "  exit 3: the script's float64 disagrees with the recorded float64 run (oracle.npz): not to be trusted",
        "",
        "Per tap it prints each side's relative L2 error against float64 at the real tokens; the ratio",
        f"err(candidate) / (m x err(reference) + floor), m = {case['rule']['m']:g} and floor = "
        f"{case['rule']['floor']:.2e} at this policy,",
        "the worst over the whole tap, each quarter of the positions and, at q_rope / k_rope, each quarter",
        "of the RoPE pairs; the candidate's float64 run against float64 (above "
        + (f"{case['rule']['fp64_gate']:.1e}" if case['rule']['fp64_gate'] == case['rule']['fp64_gate_rope'] else
           f"{case['rule']['fp64_gate']:.1e}, from RoPE on {case['rule']['fp64_gate_rope']:.1e}")
        + ": math, not rounding);",
        "and the check of this script's float64 against the recorded float64 run of the reference.", ""])
