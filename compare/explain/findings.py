"""What a structure Finding says, in words: one explainer for every finding kind.

A Finding (compare.judge.structure) is data: kind, score, size and `data`, the plain
numbers, indices and names behind it. `detail(f)` gives the numbers as a sentence,
`cause(f)` the likely cause, `hint(findings)` the one line a report shows. Nothing
decides on these strings: a caller asks the data (`findings == []`, `f.kind`, `f.data`).
"""

from __future__ import annotations

# Pair layouts as RoPE implementations write them (data["cand"], data["ref"], data["layout"]).
_PAIRS = {"half-split": "(i, i + D/2): half-split, HF rotate_half",
          "interleaved": "(2i, 2i + 1): interleaved, GPT-J / Meta style"}
# Named permutations (structure.PERMUTATIONS' keys).
_PERMUTATION = {"reversed": "reversed",
                "to_interleaved": "half-split -> interleaved (RoPE layout)",
                "to_half_split": "interleaved -> half-split (RoPE layout)",
                "swap_halves": "swap of halves",
                "swap_pairs": "swap within pairs (2i <-> 2i+1)"}
# Attention conventions (conventions.alternatives' names).
_CONVENTION = {
    "no_scale": "no attention scale (scores not divided by sqrt(head_dim))",
    "scale_1_over_d": "attention scale 1/head_dim instead of 1/sqrt(head_dim)",
    "tiled_gqa": "GQA grouping: query head h reads kv head h % n_kv (tiled) instead of h // G",
    "sees_next": "causal mask off by one: each query also sees the next token",
    "misses_self": "causal mask off by one: each query misses its own token",
    "no_causal_mask": "no causal mask: every query sees the whole sequence",
    "head_dim_scale": ("attention scale 1/sqrt(head_dim) where the config scales by another "
                       "(query_pre_attn_scalar ** -0.5)"),
}
NOISE_LIKE = "noise-like: no systematic pattern (consistent with rounding)"


def indices(idx, limit=8) -> str:
    """'0, 3, 5' (and '... (n in all)' past `limit`)."""
    idx = [int(i) for i in idx]
    more = f", ... ({len(idx)} in all)" if len(idx) > limit else ""
    return ", ".join(map(str, idx[:limit])) + more


def _way(d) -> str:
    return "grows" if d["rho"] > 0 else "shrinks"


def _permutation_name(d) -> str:
    if d["pattern"] is not None:
        name = _PERMUTATION[d["pattern"]]
        return name if d["block"] is None else f"{name} in each block of {d['block']}"
    perm = d["perm"]
    moved = [j for j in range(len(perm)) if perm[j] != j]
    pairs = [f"{j}<-{perm[j]}" for j in moved[:6]]
    more = f", ... ({len(moved)} moved)" if len(moved) > 6 else ""
    return "cand[j] = ref[k]: " + ", ".join(pairs) + more


def _rope_what(d) -> str:
    """The frequencies as measured: one ratio (linear scaling); two implied thetas where one theta
    for the other explains every pair; else the ratio from the highest frequencies to the lowest
    (a schedule that keeps some bands and scales others: llama3-style scaling), never two thetas
    that the frequencies do not follow."""
    if d["constant_ratio"]:
        return f"all frequencies scaled by {d['ratio_first']:.6g} (linear position scaling)"
    first, last = d["ratio_first"], d.get("ratio_last", d["ratio_min"])
    ratio = (f"frequency ratio (candidate / reference) from {first:.3g} at the highest frequencies to {last:.3g} "
             f"at the lowest (range {d['ratio_min']:.3g} .. {d['ratio_max']:.3g})")
    if d.get("one_theta", True):
        return f"implied theta {d['theta_cand']:.6g} (candidate) vs {d['theta_ref']:.6g} (reference); {ratio}"
    scaled, factor = ("the candidate", 1 / last) if last < 1 else ("the reference", last)
    return (f"{ratio}, not one theta for another: a scaled RoPE in {scaled} (llama3-style band scaling, "
            f"factor {factor:.3g}?)")


def _shifts(shifts: dict) -> str:
    """{row: shift} -> 'row 1 rotated at its position + 11 (row 0 at its own)'."""
    moved = {r: k for r, k in shifts.items() if k}
    same = [r for r, k in shifts.items() if not k]
    text = "; ".join(f"row {r} rotated at its position {'+' if k > 0 else '-'} {abs(k)}" for r, k in moved.items())
    return text + (f" (row{'s' if len(same) > 1 else ''} {indices(same)} at {'their' if len(same) > 1 else 'its'} "
                   "own)" if same else "")


def _norm_convention(d) -> str:
    """The weight the candidate's norm multiplies by against the reference's: w vs (1 + w); against
    the config's own offset (ref_offset: Gemma's 1) where the pair is neither of those two."""
    named = {"one_plus_w": "(1 + w) instead of w", "w": "w instead of (1 + w)"}.get(
        d["convention"], f"w + {d['a']:.4g} instead of w")
    if d.get("ref_offset") is None or d["convention"] is None:
        return named
    ref = round(d["ref_offset"])
    cand = ref + (1 if d["convention"] == "one_plus_w" else -1)
    if {ref, cand} == {0, 1}:
        return named
    return (f"{_offset_weight(cand)} instead of {_offset_weight(ref)}: a weight stored for the other convention "
            "(w vs (1 + w))")


def _offset_weight(offset: int) -> str:
    """The weight a norm multiplies by with an integer offset: w, (1 + w), (w - 1)."""
    return "w" if offset == 0 else f"({offset} + w)" if offset > 0 else f"(w - {-offset})"


def _detail_scales(kind, d) -> str | None:
    if kind == "global_scale":
        return (f"cand ≈ {d['factor']:.6g} × ref over the whole tap (fit explains {d['explained']:.1%} "
                "of the error)")
    if kind == "per_row_scale":
        return (f"d ≈ c_row × ref per position (fit explains {d['explained']:.1%}, one global factor "
                f"{d['global_explained']:.1%}); c_row from {d['min']:.3g} to {d['max']:.3g}, non-zero in "
                f"{d['share']:.0%} of {d['rows']} rows")
    if kind == "per_feature_scale":
        return (f"d ≈ s_f × ref per feature (fit explains {d['explained']:.1%}, one global factor "
                f"{d['global_explained']:.1%}); s_f from {d['min']:.3g} to {d['max']:.3g}")
    if kind == "offset":
        return (f"d ≈ the same vector at every position (its mean explains {d['explained']:.1%} of the "
                f"error; |mean d| / rms ref = {d['mean_over_rms']:.3g})")
    if kind == "norm_epsilon":
        return (f"cand = k_row x ref with ms x (1/k^2 - 1) = {d['eps_diff']:.3g} in every row (spread "
                f"{d['spread']:.1e}; fit explains {d['explained']:.1%}); ms = mean square of the norm input")
    if kind == "norm_weight_offset":
        return (f"cand - ref = {d['a']:.4g} x the normalised input, in every row and feature (fit "
                f"explains {d['explained']:.1%})")
    return None


def _detail_places(kind, d) -> str | None:
    if kind == "position_trend":
        return (f"relative error per position {_way(d)} from {d['early']:.3g} (first quarter) to "
                f"{d['late']:.3g} (last quarter) over {d['positions']} positions; Spearman "
                f"rho = {d['rho']:.2f}")
    if kind == "head_confinement":
        return (f"{d['share']:.1%} of the error energy (relative and absolute) in head(s) "
                f"{indices(d['heads'])} of {d['of']}")
    if kind == "half_confinement":
        return (f"{d['share']:.1%} of the error energy (relative and absolute) in the {d['half']} "
                f"of head_dim ({d['head_dim']})")
    if kind == "permutation":
        return (f"cand ≈ ref with its {d['axis']} permuted: {_permutation_name(d)} (explains "
                f"{d['explained']:.1%} of the error, {d['moved']} of {len(d['perm'])} moved)")
    if kind == "sign_bias":
        return (f"{(1 + d['effect']) / 2:.1%} of the non-zero differences are positive (z = {d['z']:.1f} "
                f"over all elements, t = {d['t']:.1f} over rows); rounding noise is 50/50")
    if kind == "causal_edge":
        return (f"the last real position of each sequence agrees (rel error <= {d['last_max']:.1e}) "
                f"while the others differ (median {d['typical']:.1e})")
    if kind == "nonfinite":
        return f"NaN/Inf: {d['cand']} in cand, {d['ref']} in ref"
    return None


def _detail_rope_attention(kind, d) -> str | None:
    if kind == "rope_layout":
        return (f"the candidate keeps the norm of pairs {_PAIRS[d['cand']]}, the reference "
                f"of pairs {_PAIRS[d['ref']]}: both rotate, different pairs")
    if kind == "rope_position":
        return (f"same pairs rotated ({d['layout']}) at the same frequencies, at shifted positions: angle "
                f"difference = shift x frequency for every pair and token of a row; {_shifts(d['shifts'])}")
    if kind == "rope_frequency":
        return (f"same pairs rotated ({d['layout']}), at other frequencies: omega_cand / omega_ref "
                f"from {d['ratio_min']:.4g} to {d['ratio_max']:.4g}; "
                + ("angle error = position x frequency error at every row"
                   if d["linear"] else "angle error not proportional to position"))
    if kind == "attention_convention" and d["convention"] == "scale":
        ref = d.get("ref_scale", d["head_dim"] ** -0.5)
        return (f"the candidate's attention output equals attention of the oracle's q/k/v "
                f"with softmax scale {d['scale']:.6g} (rel L2 {d['rel_l2']:.1e}); the reference uses "
                f"{ref:.6g} = {ref * d['head_dim'] ** 0.5:.4g} / sqrt({d['head_dim']})")
    if kind == "attention_convention" and d["convention"] in ("softcap", "window"):
        return (f"the candidate's attention output equals attention of the oracle's q/k/v with "
                f"{_attention_change(d)} (rel L2 {d['rel_l2']:.1e}; {d['base']:.1e} with the reference's "
                f"{_attention_own(d)}); the largest |score| before any cap is {d['max_score']:.3g}")
    if kind == "attention_convention":
        return (f"the candidate's attention output equals attention of the oracle's "
                f"q/k/v with {_CONVENTION[d['convention']]} (rel L2 {d['rel_l2']:.1e}; {d['base']:.1e} "
                "with the reference's conventions)")
    return None


def _cause_rope_attention(kind, d) -> str | None:
    if kind == "rope_layout":
        return (f"RoPE layout: rotates pairs {_PAIRS[d['cand']].split(':')[0]} instead of "
                f"{_PAIRS[d['ref']].split(':')[0]} (interleaved vs half-split; a missing "
                "or extra q/k permutation on conversion)")
    if kind == "rope_position":
        return (f"RoPE positions shifted: {_shifts(d['shifts'])} (positions that count padding slots, or "
                "position_ids not passed)")
    if kind == "rope_frequency":
        return (f"RoPE frequencies: {_rope_what(d)}; the angle error grows linearly with position "
                "(rope_theta or rope scaling)" if d["linear"] else
                f"RoPE angles differ ({_rope_what(d)}): positions or scaling")
    if kind == "attention_convention" and d["convention"] == "scale":
        return (f"wrong attention scale: {d['scale']:.6g} = {d['scale'] * d['head_dim'] ** 0.5:.4g} "
                "/ sqrt(head_dim)")
    if kind == "attention_convention" and d["convention"] == "softcap":
        return _softcap_cause("attention", d["softcap"], d["ref_softcap"], "attn_logit_softcapping",
                              "scores", d["max_score"])
    if kind == "attention_convention" and d["convention"] == "window":
        return _window_cause(d["window"], d["ref_window"])
    if kind == "attention_convention":
        return _CONVENTION[d["convention"]]
    return None


def _attention_change(d) -> str:
    if d["convention"] == "softcap":
        return "no soft-cap" if d["softcap"] is None else f"the scores soft-capped at {d['softcap']:.6g}"
    return "no sliding window" if d["window"] is None else f"a sliding window of {d['window']} keys"


def _attention_own(d) -> str:
    cap = "no soft-cap" if d["ref_softcap"] is None else f"soft-cap {d['ref_softcap']:g}"
    window = "no window" if d["ref_window"] is None else f"window {d['ref_window']}"
    return f"conventions: scale {d['ref_scale']:.6g}, {cap}, {window}"


def _softcap_cause(what, cap, ref, field, values, largest) -> str:
    """A soft-cap (cap x tanh(x / cap)) left out, put where the reference has none, or another value."""
    reach = f"the largest |{values[:-1]}| before the cap is {largest:.3g}"
    if cap is None:
        return (f"{what} soft-cap missing: the {values} are not capped where the reference caps them at {ref:g} "
                f"(cap x tanh(x / cap), {field}; {reach})")
    if ref is None:
        return (f"{what} soft-cap {cap:.4g} where the reference has none (cap x tanh(x / cap): a cap of another "
                f"model of the family; {reach})")
    return f"{what} soft-cap {cap:.4g} instead of {ref:g} ({field}; {reach})"


def _window_cause(window, ref) -> str:
    """A sliding window (a query sees the last `window` keys, itself included) against the reference's."""
    if window is None:
        return (f"sliding window missing: the candidate's queries see every earlier key where the reference's "
                f"layer sees the last {ref} (sliding_window, layer_types)")
    if ref is None:
        return (f"sliding window applied to a global layer: the candidate's queries see only the last {window} keys "
                "where the reference's layer sees every earlier key (layer_types: which layers slide)")
    off = " off by one" if abs(window - ref) == 1 else ""
    return (f"sliding window{off}: the candidate's queries see the last {window} keys, the reference's {ref} "
            f"(itself included: kv_idx > q_idx - window); the first {min(window, ref)} positions agree")


def _cause_other(kind, d) -> str | None:
    if kind == "global_scale":
        return (f"global scale factor {d['factor']:.6g}: a missing or extra constant factor "
                "(attention scale, (1+w) norm weight, logit scaling)")
    if kind == "permutation":
        what = d["axis"]
        return (f"{what} permuted ({_permutation_name(d)}): " + (
            "q/k weight permutation or RoPE layout (interleaved vs half-split)" if d["rope_layout"]
            else "head order / GQA grouping" if what == "heads" else "a layout or ordering mismatch"))
    if kind == "position_trend":
        return f"error {_way(d)} with position: RoPE (theta, layout, scaling) or mask"
    if kind == "head_confinement":
        return f"confined to heads {indices(d['heads'])} of {d['of']}: GQA grouping / head order"
    if kind == "half_confinement":
        return f"confined to the {d['half']} of each head: RoPE layout or partial rotary"
    if kind == "sign_bias":
        return ("one-sided error (cand mostly " + ("above" if d["effect"] > 0 else "below")
                + " ref): a missing or extra term, or biased rounding")
    if kind == "norm_epsilon":
        return (f"per-row scale factor of an RMSNorm epsilon difference: eps(candidate) - "
                f"eps(reference) = {d['eps_diff']:.3g}")
    if kind == "norm_weight_offset":
        return (f"norm weight convention: applied as {_norm_convention(d)} (a per-feature offset of the "
                "norm weight)")
    return None


_FIXED_CAUSE = {
    "per_row_scale": "per-row scale factor: RMSNorm epsilon or normalisation",
    "per_feature_scale": ("per-feature scale factor: a weight vector applied differently "
                          "(norm weight w vs 1+w, wrong or missing weight)"),
    "offset": ("constant offset: a bias term added or missing (attention/MLP bias, "
               "embedding or norm bias)"),
    "causal_edge": ("all positions but the last differ: queries see a later token (causal mask "
                    "off by one, future leak)"),
    "nonfinite": "NaN/Inf: overflow, a fully masked softmax row, or a division by zero",
}


def detail(f) -> str:
    """The numbers behind a finding, as one sentence."""
    for part in (_detail_scales, _detail_places, _detail_rope_attention, _detail_new):
        text = part(f.kind, f.data)
        if text is not None:
            return text
    raise ValueError(f"no sentence for finding kind {f.kind!r}")


def cause(f) -> str:
    """The likely cause a finding points to, in plain language."""
    if f.kind in _FIXED_CAUSE:
        return _FIXED_CAUSE[f.kind]
    for part in (_cause_rope_attention, _cause_other, _cause_new):
        text = part(f.kind, f.data)
        if text is not None:
            return text
    raise ValueError(f"no sentence for finding kind {f.kind!r}")


def hint(findings) -> str:
    """One plain-language line: the top finding's cause, naming the others."""
    if not findings:
        return NOISE_LIKE
    others = [f.kind for f in findings[1:]]
    return cause(findings[0]) + (f" (also: {', '.join(others)})" if others else "")


# --- the issue-21 detectors (structure: partial rotary, activation, transposed projection,
# residual, q/k swap) -------------------------------------------------------------------------

ACTIVATION_NAMES = {"silu": "SiLU", "gelu": "GELU (exact, erf)", "gelu_tanh": "GELU (tanh approximation)",
                    "quick_gelu": "quick GELU (x sigmoid(1.702 x))", "relu": "ReLU"}
_RESIDUAL = {"missing": "is missing", "doubled": "is added twice"}


def ranges(idx) -> str:
    """[0, 1, 2, 5, 6] -> '0-2, 5-6'."""
    idx = sorted(int(i) for i in idx)
    runs, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            runs.append(f"{start}-{i}" if i > start else f"{i}")
            start = None
    return ", ".join(runs) or "none"


def _activations(names) -> str:
    return " or ".join(ACTIVATION_NAMES[n] for n in names) or "none of the listed ones"


def _residual_part(what: str, how: str, coefficient: float) -> str | None:
    if how == "kept":
        return None
    return f"the {what} " + (_RESIDUAL[how] if how in _RESIDUAL else f"is scaled by {coefficient:.4g}")


def _detail_new(kind, d) -> str | None:
    if kind == "partial_rotary":
        return (f"the candidate leaves dims {ranges(d['cand_identity'])} of each head's {d['head_dim']} as they "
                f"were (not rotated), the reference dims {ranges(d['ref_identity'])}")
    if kind == "activation":
        return (f"act = f(gate) x up with f = {_activations(d['cand'])} on the candidate's own gate and up "
                f"(exact to rounding); the reference's act fits {_activations(d['ref'])}")
    if kind == "transposed_projection":
        return (f"the candidate's output y' and input x satisfy y' x^T = (y x^T)^T of the reference's "
                f"(rel L2 {d['rel_l2']:.1e}; {d['as_is']:.1e} untransposed): y' = x W where the "
                f"reference computes x W^T ({d['width']} x {d['width']})")
    if kind == "residual":
        (a, b), (ra, rb) = d["cand"], d["ref"]
        return (f"cand = {a:.4g} x residual + {b:.4g} x branch, exact to rounding (reference: {ra:.4g} x "
                f"residual + {rb:.4g} x branch)")
    if kind == "swapped_projection":
        mine = "q" if d["other"] == "k" else "k"
        return f"the candidate's {mine} equals the reference's {d['other']} (exact to rounding)"
    return _detail_family(kind, d)


def _cause_new(kind, d) -> str | None:
    if kind == "partial_rotary":
        D = d["head_dim"]
        return (f"RoPE applied to {D - len(d['cand_identity'])} of {D} dims of each head where the reference "
                f"rotates {D - len(d['ref_identity'])} (partial rotary: rotary_dim / partial_rotary_factor)")
    if kind == "activation":
        return f"MLP activation: {_activations(d['cand'])} instead of {_activations(d['ref'])} (hidden_act)"
    if kind == "transposed_projection":
        return ("projection weight transposed: the square matrix is applied as W instead of W^T (a "
                "conversion that wrote [in, out] where [out, in] belongs)")
    if kind == "residual":
        parts = [p for p in (_residual_part("residual (skip connection)", d["residual"], d["cand"][0]),
                             _residual_part("branch output", d["branch"], d["cand"][1])) if p]
        return "residual connection: " + " and ".join(parts)
    if kind == "swapped_projection":
        return "q_proj and k_proj swapped (the candidate's q is the reference's k)" if d["other"] == "k" else \
            "q_proj and k_proj swapped (the candidate's k is the reference's q)"
    return _cause_family(kind, d)


# --- the family's slips (compare.judge.family) ---------------------------------------------------

_AXIS = {"head": "per head (over each head's {D} features)",
         "projection": "over the whole projection (all {H} heads x {D} features)"}


def _axis(name, d) -> str:
    return _AXIS[name].format(H=d["heads"], D=d["head_dim"])


def _norm_name(step) -> str:
    return "q/k norm" if step in ("q_norm", "k_norm") else f"the {step} RMSNorm"


def _detail_family(kind, d) -> str | None:
    if kind == "norm_skipped":
        return (f"the candidate's {d['step']} equals its own input (to rounding), the reference's does not: "
                "no normalisation")
    if kind == "norm_axis":
        return (f"the candidate's {d['step']} is the RMSNorm of its own input {_axis(d['cand'], d)} with the "
                f"reference's per-feature weight (to rounding); the reference's {_axis(d['ref'], d)}")
    if kind == "soft_cap":
        cand = "z itself" if d["cap"] is None else f"{d['cap']:.6g} x tanh(z / {d['cap']:.6g})"
        z = ("the reference's logits before its cap ({:g})".format(d["ref_cap"]) if d["ref_cap"] is not None
             and d["cap"] is not None else "the reference's logits before its cap" if d["ref_cap"] is not None
             else "the reference's logits")
        if d["cap"] is None and d["ref_cap"] is not None:
            return (f"the candidate's logits equal z = {d['ref_cap']:.6g} x atanh(ref / {d['ref_cap']:.6g}), "
                    f"{z}, to rounding: uncapped (|z| up to {d['max_raw']:.3g})")
        return f"the candidate's logits equal {cand} with z {z}, to rounding (|z| up to {d['max_raw']:.3g})"
    if kind == "embedding_scale":
        return (f"cand = {d['factor']:.6g} x ref over the whole embedding = sqrt({d['hidden']}) ** {d['power']} "
                f"(hidden_size {d['hidden']}; fit explains {d['explained']:.1%})")
    if kind == "projection_bias":
        return (f"d ≈ the same vector at every position of {d['projection']}'s output (its mean explains "
                f"{d['explained']:.1%} of the error; |mean d| / rms ref = {d['mean_over_rms']:.3g})")
    return None


def _cause_family(kind, d) -> str | None:
    if kind == "norm_skipped":
        return (f"{_norm_name(d['step'])} missing: the candidate's {d['step']} returns its input unchanged where "
                "the reference normalises it" + (" (q_norm / k_norm: Qwen3, Gemma 3, OLMo 2)"
                                                 if d["step"] in ("q_norm", "k_norm") else ""))
    if kind == "norm_axis":
        return (f"q/k norm axis: the candidate normalises {_axis(d['cand'], d)} where the reference normalises "
                f"{_axis(d['ref'], d)} (Qwen3 and Gemma 3 per head, OLMo 2 over the projection)")
    if kind == "soft_cap":
        return _softcap_cause("final logit", d["cap"], d["ref_cap"], "final_logit_softcapping", "logits",
                              d["max_raw"])
    if kind == "embedding_scale":
        return _embedding_cause(d)
    if kind == "projection_bias":
        p, field = d["projection"], d["field"]
        if d["reference_bias"] is False:
            return (f"a bias on {p} where the model has none: a constant offset, one vector added at every position "
                    f"of its output (the config's {field} gives {p} no bias)")
        if d["reference_bias"]:
            return (f"{p}'s bias missing or another one: a constant offset, one vector at every position of its "
                    f"output (the config's {field} gives {p} a bias)")
        return f"constant offset at {p}'s output: a bias added to or missing from {p}"
    return None


def _embedding_cause(d) -> str:
    h, power, scales = d["hidden"], d["power"], d["reference_scales"]
    if power == -1 and scales is not False:
        return (f"embedding scale sqrt(hidden_size) missing: the candidate's embeddings are the reference's "
                f"/ sqrt({h}) (the model multiplies them by sqrt(hidden_size): Gemma's normalizer)")
    if power == 1 and scales:
        return (f"embedding scale sqrt(hidden_size) applied twice: the candidate's embeddings are sqrt({h}) x the "
                "reference's, which already scales them (a port that scales inputs_embeds before a model that "
                "scales again)")
    if power == 1 and scales is False:
        return (f"embedding scale sqrt(hidden_size) applied where the model has none: the candidate's embeddings "
                f"are sqrt({h}) x the reference's (Gemma's normalizer on another family)")
    return (f"embedding scale sqrt(hidden_size) off: the candidate's embeddings are sqrt({h}) ** {power} x the "
            "reference's (missing, applied twice, or where the model has none)")
