"""A standalone repro case written by llama-parity (README.txt beside this file says what it holds).

It recomputes one unit of a Llama-family model (a decoder layer, the embedding, or the head:
final norm + lm_head) in float64 with numpy, from the files beside it, and holds both
implementations' captured outputs to that, tap by tap. Python 3 and numpy are all it needs.

    python repro.py

exit 0: no difference beyond the reference's own rounding; 1: the candidate differs where the
reference does not; 2: this case cannot be run here (a file missing, a feature this script does
not implement); 3: this script's float64 does not agree with the float64 run recorded beside
it, so its verdict is not to be trusted.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OK, DIFFERENCE, REFUSED, UNTRUSTED = 0, 1, 2, 3
# The files of a case, by role (fixed names: nothing read from case.json names a file).
SIDE_FILES = {"oracle": "oracle.npz", "reference": "reference.npz", "candidate": "candidate.npz",
              "candidate_fp64": "candidate_fp64.npz"}
CONFIG_KEYS = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "rms_norm_eps", "norm_offset", "norms", "qk_norm", "attention_bias", "o_bias", "mlp_bias", "scale",
               "attn_softcap", "window", "rope", "max_position_embeddings", "activation", "final_softcap",
               "embed_scale", "head_key", "prefix", "model_type"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
NORM_ROLES = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


class Refused(Exception):
    """This case asks for something this script does not do: exit 2, naming it."""


# ----- the unit in float64 ---------------------------------------------------------------------

def rms_norm(x, w, eps, offset):
    """x / sqrt(mean(x^2) + eps) * (offset + w) over the last axis (Gemma's offset is 1)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w)


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def soft_cap(x, cap):
    return x if cap is None else cap * np.tanh(x / cap)


def rope_inv_freq(rope, head_dim, max_positions, seq_len):
    """transformers' inverse frequencies (default, linear, dynamic NTK, llama3)."""
    base, factor = rope["theta"], rope["factor"]
    if rope["type"] == "dynamic":
        seq_len = max(seq_len, max_positions)
        base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    if rope["type"] == "linear":
        inv = inv / factor
    elif rope["type"] == "llama3":
        old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv


def apply_rope(x, cos, sin):
    """Hugging Face's half-split layout: pair i is dims i and i + head_dim/2. x [B, T, H, D]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def allowed_keys(mask, window):
    """allowed[b, t, s]: slot s holds a real token and is not after t; within a sliding window
    (counted in the row's real keys) where the layer has one."""
    T = mask.shape[1]
    allowed = mask.astype(bool)[:, None, :] & (np.arange(T)[None, :] <= np.arange(T)[:, None])[None]
    if window is not None:
        seen = np.cumsum(allowed, axis=-1)
        allowed = allowed & (seen[..., -1:] - seen < window)
    return allowed


def attention(q, k, v, allowed, scale, softcap):
    """Causal GQA attention: query head h reads kv head h // (heads / kv heads)."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = soft_cap(np.einsum("bthd,bshd->bhts", q, k) * scale, softcap)
    scores = np.where(allowed[:, None], scores, np.finfo(np.float64).min)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * D)


def activation(name, x):
    if name == "silu":
        return x / (1 + np.exp(-x))
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))     # gelu_tanh


def layer(x, w, c, positions, mask):
    """One decoder layer from its input x [B, T, hidden]: {tap: value} in execution order."""
    taps, B, T = {}, x.shape[0], x.shape[1]
    H, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    p, norms, eps, offset = c["prefix"], c["norms"], c["rms_norm_eps"], c["norm_offset"]

    def weight(name, needed=True):
        if p + name not in w:
            if needed:
                raise Refused(f"weights.npz has no {p + name}, which this layer needs")
            return None
        return w[p + name]

    def norm(role, h):
        if role not in norms:
            return h
        taps[role] = rms_norm(h, weight(norms[role] + ".weight"), eps, offset)
        return taps[role]

    def proj(module, h, bias):
        return linear(h, weight(module + ".weight"), weight(module + ".bias") if bias else None)

    a = norm("attn_norm", x)
    q = taps["q"] = proj("self_attn.q_proj", a, c["attention_bias"]).reshape(B, T, H, D)
    k = taps["k"] = proj("self_attn.k_proj", a, c["attention_bias"]).reshape(B, T, Hkv, D)
    taps["v"] = proj("self_attn.v_proj", a, c["attention_bias"]).reshape(B, T, Hkv, D)
    if c["qk_norm"] == "head":
        q = taps["q_norm"] = rms_norm(q, weight("self_attn.q_norm.weight"), eps, offset)
        k = taps["k_norm"] = rms_norm(k, weight("self_attn.k_norm.weight"), eps, offset)
    elif c["qk_norm"] == "projection":
        q = taps["q_norm"] = rms_norm(q.reshape(B, T, -1), weight("self_attn.q_norm.weight"), eps,
                                      offset).reshape(q.shape)
        k = taps["k_norm"] = rms_norm(k.reshape(B, T, -1), weight("self_attn.k_norm.weight"), eps,
                                      offset).reshape(k.shape)
    angles = positions[..., None] * rope_inv_freq(c["rope"], D, c["max_position_embeddings"],
                                                  int(positions.max()) + 1)
    emb = np.concatenate([angles, angles], axis=-1)
    q = taps["q_rope"] = apply_rope(q, np.cos(emb), np.sin(emb))
    k = taps["k_rope"] = apply_rope(k, np.cos(emb), np.sin(emb))
    ctx = taps["attn_ctx"] = attention(q, k, taps["v"], allowed_keys(mask, c["window"]), c["scale"],
                                       c["attn_softcap"])
    h = norm("post_attn_norm", rec(taps, "attn_out", proj("self_attn.o_proj", ctx, c["o_bias"])))
    h = taps["resid_mid"] = x + h
    m = norm("mlp_norm", h)
    gate, up = taps["gate"], taps["up"] = (proj("mlp.gate_proj", m, c["mlp_bias"]),
                                           proj("mlp.up_proj", m, c["mlp_bias"]))
    act = taps["act"] = activation(c["activation"], gate) * up
    out = norm("post_mlp_norm", rec(taps, "mlp_out", proj("mlp.down_proj", act, c["mlp_bias"])))
    taps["out"] = h + out
    return taps


def rec(taps, name, value):
    taps[name] = value
    return value


def head(x, w, c):
    """The final norm and the lm_head (soft-capped where the family caps logits)."""
    final = rms_norm(x, w["model.norm.weight"], c["rms_norm_eps"], c["norm_offset"])
    return {"final_norm": final, "logits": soft_cap(linear(final, w[c["head_key"]]), c["final_softcap"])}


def embed(ids, w, c):
    """The embedding rows of the ids (weights.npz keeps only the rows the batch uses)."""
    rows, table = w["embed_row_ids"], w["model.embed_tokens.weight"]
    e = table[np.searchsorted(rows, ids)]
    return {"embed": e * math.sqrt(c["hidden_size"]) if c["embed_scale"] else e}


def judged(case):
    """The columns of inputs.npz the sides' taps hold: all of them, or (a decode step's case) the
    step's slot, whose taps read every column before it."""
    cols = case.get("columns")
    return slice(None) if cols is None else np.asarray(cols, np.int64)


def float64_unit(case, w, inputs, fed):
    """The unit's taps in float64 from the input a side was fed, at the judged columns. A layer's
    input holds every column (attention reads them all); the head's, the judged ones."""
    c, kind, cols = case["config"], case["unit"]["kind"], judged(case)
    if kind == "embed":
        return embed(inputs["ids"][:, cols], w, c)
    if kind == "head":
        return head(fed, w, c)
    taps = layer(fed, w, c, inputs["positions"].astype(np.float64), inputs["mask"])
    return {t: v[:, cols] for t, v in taps.items()}


# ----- the comparison ----------------------------------------------------------------------------

def rel(x, ref):
    """||x - ref|| / ||ref|| (NaN when x holds NaN or Inf)."""
    if not np.isfinite(x).all():
        return float("nan")
    d, e = math.sqrt(float(np.sum(ref * ref))), math.sqrt(float(np.sum((x - ref) ** 2)))
    return e / d if d else e


def ratio(r, ro, c, co, pos, tap, rule):
    """The candidate's error over the reference's drift bound, err(c) / (m err(r) + floor), each
    side against the float64 of its own input (ro, co: the same array when both were fed one),
    over the whole tap, each quarter of the positions, and (q_rope, k_rope) each quarter of the
    RoPE frequency pairs: the worst, and where. A part whose size is carried by a few values
    (fewer than min_values effective ones) is no statistic and is skipped. Arrays: [N, ...] rows."""
    m, floor, least = rule["m"], rule["floor"], rule["min_values"]

    def bound(pick):
        return rel(pick(c), pick(co)) / (m * rel(pick(r), pick(ro)) + floor)

    def enough(x):
        s2 = float(np.sum(x * x))
        return s2 > 0 and s2 * s2 / float(np.sum(x ** 4)) >= least
    best, where = bound(lambda x: x), "the whole tap"
    parts = []
    distinct = np.unique(pos)
    if len(distinct) >= rule["quarter_positions"]:
        edges = distinct[np.linspace(0, len(distinct), 5).astype(int)[1:-1]]
        quarter = np.searchsorted(edges, pos, side="right")
        parts += [(lambda x, sel=quarter == i: x[sel], f"positions {int(pos[quarter == i].min())}-"
                   f"{int(pos[quarter == i].max())}") for i in range(4) if (quarter == i).any()]
    if tap in ("q_rope", "k_rope") and co.ndim == 3 and co.shape[-1] % 8 == 0:
        half = co.shape[-1] // 2
        for i in range(4):
            lo, hi = i * half // 4, (i + 1) * half // 4
            parts.append((lambda x, lo=lo, hi=hi: np.concatenate([x[..., lo:hi], x[..., half + lo:half + hi]], -1),
                          f"RoPE pairs {lo}-{hi - 1} of {half} (pair i turns at theta^(-2i/head_dim))"))
    for pick, name in parts:
        if enough(pick(co)):
            x = bound(pick)
            if x > best:
                best, where = x, name
    return best, where


def load(name, required=True):
    path = HERE / name
    if not path.is_file():
        if required:
            raise Refused(f"{name} is missing beside repro.py")
        return None
    with np.load(path, allow_pickle=False) as z:
        return {k: np.asarray(z[k], np.float64) if z[k].dtype.kind == "f" else z[k] for k in z.files}


def check_case(case):
    """Refuses what this script does not compute, naming it."""
    if not isinstance(case, dict) or case.get("format") != "llama-parity repro 1":
        raise Refused("case.json is not a case of the format this script reads ('llama-parity repro 1')")
    missing = sorted({"title", "about", "unit", "taps", "tap_names", "config", "sides", "rule"} - set(case))
    if missing:
        raise Refused(f"case.json lacks {missing}")
    cols = case.get("columns")
    if cols is not None and not (isinstance(cols, list) and cols and all(type(i) is int and i >= 0 for i in cols)):
        raise Refused(f"case.json: columns {cols!r} is not a list of column numbers")
    c = case["config"]
    unknown = sorted(set(c) - CONFIG_KEYS)
    if unknown:
        raise Refused(f"case.json names model features this script does not implement: {unknown}")
    if case["unit"]["kind"] not in ("layer", "embed", "head"):
        raise Refused(f"unit {case['unit']['kind']!r}: this script recomputes a layer, the embedding or the head")
    if case["unit"]["kind"] != "layer":
        return
    if c["rope"]["type"] not in ROPE_TYPES:
        raise Refused(f"RoPE type {c['rope']['type']!r}: this script implements {', '.join(ROPE_TYPES)}")
    if c["activation"] not in ("silu", "gelu_tanh"):
        raise Refused(f"MLP activation {c['activation']!r}: this script implements silu and gelu_tanh")
    if c["qk_norm"] not in (None, "head", "projection"):
        raise Refused(f"q/k norm {c['qk_norm']!r}: this script implements none, per head and over the projection")
    if set(c["norms"]) - set(NORM_ROLES):
        raise Refused(f"norms {sorted(set(c['norms']) - set(NORM_ROLES))}: this script knows {NORM_ROLES}")


def compare(case, w, inputs, sides):
    """Prints the table; returns (the first tap where the candidate differs and why, or None;
    the check of this script's float64 against the recorded float64 run: (the worst difference
    over its gate, its tap, the difference, the gate))."""
    rule, taps, names = case["rule"], case["taps"], case["sides"]
    real = inputs["mask"][:, judged(case)].astype(bool)
    pos = inputs["positions"][:, judged(case)][real]
    done = []       # (input, its float64 taps): computed once per distinct input

    def float64_of(fed):
        for given, out in done:
            if (given is None and fed is None) or (given is not None and fed is not None
                                                   and given.shape == fed.shape and np.array_equal(given, fed)):
                return out
        done.append((fed, float64_unit(case, w, inputs, fed)))
        return done[-1][1]
    # a side that returned no input of its own is held to the float64 of the oracle's input
    f64 = {role: float64_of(data.get("input", sides.get("oracle", {}).get("input"))) for role, data in sides.items()}
    twin = "candidate_fp64" in sides
    print(f"{'tap':<15}{'reference':>12}{'candidate':>12}{'ratio':>10}" + (f"{'cand fp64':>12}" if twin else "")
          + f"{'check':>10}")
    print(f"{'':<15}{'vs float64':>12}{'vs float64':>12}{'':>10}" + (f"{'vs float64':>12}" if twin else "")
          + f"{'(oracle)':>10}")
    first, check, rope = None, (0.0, None), False
    for tap in taps:
        rope = rope or tap in ("q_rope", "k_rope")     # the gates from RoPE on (case.json's rule)
        gate, oracle_gate = (rule["fp64_gate_rope"], rule["oracle_gate_rope"]) if rope else \
            (rule["fp64_gate"], rule["oracle_gate"])
        row = {role: (sides[role][tap][real], f64[role][tap][real]) for role in sides if tap in sides[role]}
        if "reference" not in row or "candidate" not in row:
            print(f"{tap:<15}  (not captured on both sides)")
            continue
        (r, ro), (c, co) = row["reference"], row["candidate"]
        e_r, e_c = rel(r, ro), rel(c, co)
        x, where = ratio(r, ro, c, co, pos, tap, rule)
        line, why = f"{tap:<15}{e_r:>12.2e}{e_c:>12.2e}{x:>10.3g}", []
        if not np.isfinite(c).all() and np.isfinite(r).all():
            why.append("the candidate holds NaN or Inf here and the reference does not")
        elif x > 1:
            why.append(f"at {names['candidate']['at']} the candidate's error is {e_c:.2e} against the reference's "
                       f"{e_r:.2e}: {x:.3g} x the drift bound (m = {rule['m']:g} x the reference's error + floor "
                       f"{rule['floor']:.1e}), worst over {where}")
        if twin:
            e64 = rel(*row["candidate_fp64"]) if "candidate_fp64" in row else float("nan")
            line += f"{e64:>12.2e}"
            if e64 > gate:
                why.insert(0, f"the candidate's float64 run differs from float64 by {e64:.2e} (above "
                           f"{gate:.1e}, {rule['fp64_gate_means']}): the math differs, or a step keeps a "
                           "narrower dtype even at float64")
        if "oracle" in row:
            e_o = rel(*row["oracle"])
            line += f"{e_o:>10.1e}"
            if not e_o / oracle_gate <= check[0]:
                check = (e_o / oracle_gate, case["tap_names"][taps.index(tap)], e_o, oracle_gate)
        if why and first is None:
            first = (case["tap_names"][taps.index(tap)], "; and ".join(why))
            line += "   <- first difference"
        print(line)
    return first, check


def main():
    try:
        case = json.loads((HERE / "case.json").read_text())
        check_case(case)
        w, inputs = load("weights.npz"), load("inputs.npz")
        if case.get("columns") is not None and max(case["columns"]) >= inputs["mask"].shape[1]:
            raise Refused(f"case.json's columns {case['columns']} lie past inputs.npz's {inputs['mask'].shape[1]}")
        sides = {role: load(name) for role, name in SIDE_FILES.items()
                 if role in case["sides"] and (HERE / name).is_file()}
        for role in ("reference", "candidate"):
            if role not in sides:
                raise Refused(f"{SIDE_FILES[role]} is missing beside repro.py")
        print(case["title"])
        for line in case["about"]:
            print(line)
        print()
        first, check = compare(case, w, inputs, sides)
    except Refused as e:
        print(f"repro: cannot run this case: {e}", file=sys.stderr)
        return REFUSED
    print()
    trusted = check[0] <= 1
    if "oracle" in sides:
        worst = f"worst relative difference {check[2]:.1e} at {check[1]}" if check[1] else "no difference"
        print(f"check: this script's float64 against the recorded float64 run ({case['sides']['oracle']['name']}, "
              f"oracle.npz): {worst}" + ("" if not check[1] else f", within {check[3]:.1e}" if trusted else
                                        f", above {check[3]:.1e}"))
        if not trusted:
            print("this script does not compute what the recorded float64 run computes: its verdict below is "
                  "not to be trusted (a feature of the model it does not implement?)")
    if first is None:
        print("no difference: the candidate's error stays within the reference's own rounding at every tap")
        code = OK
    else:
        print(f"first difference at {first[0]}: {first[1]}")
        code = DIFFERENCE
    return code if trusted else UNTRUSTED


if __name__ == "__main__":
    sys.exit(main())
