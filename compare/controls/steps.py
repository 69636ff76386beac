"""Steps computed below the policy's dtype for that step (positive controls: precision findings).

A policy prescribes a dtype per step (llamaspec.Policy: norm_dtype for the RMSNorm's
mean(x^2) and rsqrt, softmax_dtype for the scores' softmax, rope_dtype for the RoPE angles,
accum_dtype for every matmul's sums). Each control here hard-codes one of those steps to
bfloat16 in one layer, in the candidate's working model and in its float64 twin alike (code
like `softmax(scores.to(torch.bfloat16))` runs the same in both), in torchref (through its
seams) or in transformers' eager LlamaForCausalLM (modules swapped or hooked on their public
attributes), at the first, a middle or the last layer, or at the final norm. Under both the
fp32 and the bf16 policy the ladder must say precision at that step's tap, layer and
component: bf16 is narrower than every dtype either policy prescribes for these steps.

    controls = step_controls(num_layers=3)      # {name: Control}, names step_<step>_<where>_<policy>_<place>
"""

from __future__ import annotations

import copy
import dataclasses

from .prefill import Control, Ops, hf_side, torch_side

LOW = "bfloat16"
STEPS = ("softmax", "norm", "rope", "accum")
WHERE = ("torchref", "transformers")
POLICIES = ("fp32", "bf16")
ACCUM_CHUNK = 16        # the hard-coded bf16 accumulator adds partial sums of this many products


def places(step: str, num_layers: int) -> dict[str, int | None]:
    """{place: layer}: first, middle and last layer; the norm also at the final norm (None)."""
    at = {"first": 0, "middle": num_layers // 2, "last": num_layers - 1}
    return {**at, "final": None} if step == "norm" else at


def expected_tap(step: str, layer: int | None, place: str) -> tuple[str, str]:
    """(the tap where the step's rounding first shows, its component)."""
    if layer is None:
        return "final_norm", "final_norm"
    norm = "attn_norm" if place == "first" else "mlp_norm"   # both norms of a layer are covered
    tap, component = {"softmax": ("attn_ctx", "attn"), "norm": (norm, norm),
                      "rope": ("q_rope", "attn"), "accum": ("mlp_out", "mlp")}[step]
    return f"layers.{layer}.{tap}", component


# ----- torchref, on its seams ------------------------------------------------------------------

def _norm_module(m, layer, norm):
    return m.model.norm if layer is None else getattr(m.model.layers[layer], norm)


def _t_softmax(layer, place):
    def patch(m):
        from torchref import ops  # torchref imports torch: the jaxmodel controls run without it

        def attention(q, k, v, allowed, policy):
            return ops.attention(q, k, v, allowed, dataclasses.replace(policy, softmax_dtype=LOW))
        attn = m.model.layers[layer].self_attn
        attn.ops = Ops(attn.ops, attention=attention)
    return patch


def _rms_stats_low(x, weight, eps, policy):
    """torchref's rms_norm with mean(x^2) taken of x rounded to bf16 and the mean itself
    rounded to bf16: `x.to(torch.bfloat16).pow(2).mean(-1)`, the rest in norm_dtype."""
    import torch  # torch: slow import; the jaxmodel controls run without it

    from torchref import ops
    from torchref.dtypes import dt
    h = x.to(dt(policy.norm_dtype))
    var = x.to(torch.bfloat16).pow(2).mean(-1, keepdim=True).to(h.dtype)
    return ops.norm_weight(h * torch.rsqrt(var + eps), x, weight, policy)


def _t_norm(layer, place):
    norm = "input_layernorm" if place == "first" else "post_attention_layernorm"

    def patch(m):
        module = _norm_module(m, layer, norm)
        module.ops = Ops(module.ops, rms_norm=_rms_stats_low)
    return patch


def _t_rope(layer, place):
    """Layer `layer`'s RoPE tables rebuilt with rope_dtype bf16 (angles and cos/sin rounded)."""
    def patch(m):
        from torchref.model import rope_tables  # torchref imports torch: the jaxmodel controls run without it
        cfg = m.cfg

        def retabled(attn, args):
            x, ctx, *rest = args
            cos, sin = rope_tables(cfg, dataclasses.replace(ctx.policy, rope_dtype=LOW), attn.ops, ctx.positions)
            return (x, ctx._replace(cos=cos, sin=sin), *rest)
        m.model.layers[layer].self_attn.register_forward_pre_hook(retabled)
    return patch


def chunked_low_sum(x, w, b=None):
    """x @ w.T (+ b) with a bf16 accumulator: partial products over ACCUM_CHUNK inputs are
    computed in x's dtype and added to a running sum that is rounded to bf16 after every
    chunk (split-K with bf16 partials), then returned in x's dtype."""
    import torch  # torch: slow import; the jaxmodel controls run without it
    acc = None
    for a in range(0, x.shape[-1], ACCUM_CHUNK):
        part = x[..., a:a + ACCUM_CHUNK] @ w[:, a:a + ACCUM_CHUNK].T.to(x.dtype)
        acc = (part if acc is None else acc.to(x.dtype) + part).to(torch.bfloat16)
    out = acc.to(x.dtype)
    return out if b is None else out + b.to(x.dtype)


def _t_accum(layer, place):
    def patch(m):
        from torchref.dtypes import dt  # torchref imports torch: the jaxmodel controls run without it

        def linear(x, w, b, policy, out_dtype=None):
            y = chunked_low_sum(x.to(dt(policy.accum_dtype)), w, b)
            return y.to(dt(out_dtype or policy.compute_dtype))
        down = m.model.layers[layer].mlp.down_proj
        down.ops = Ops(down.ops, linear=linear)
    return patch


# ----- transformers (eager), on its modules ----------------------------------------------------

def _hf_classes():
    """Module classes for the transformers plants (defined on first use: torch is optional)."""
    # torch: slow import; the classes are defined on first use
    import torch
    from torch import nn

    class StatsLowRMSNorm(nn.Module):
        """LlamaRMSNorm with its variance taken of the input rounded to bf16, and rounded to bf16."""

        def __init__(self, norm):
            super().__init__()
            self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

        def forward(self, hidden):
            dtype = hidden.dtype
            h = hidden.to(torch.float32)
            var = hidden.to(torch.bfloat16).pow(2).mean(-1, keepdim=True).to(torch.float32)
            return self.weight * (h * torch.rsqrt(var + self.variance_epsilon)).to(dtype)

    class LowAccumLinear(nn.Module):
        """nn.Linear (no bias) whose sums run in a bf16 accumulator (chunked_low_sum)."""

        def __init__(self, linear):
            super().__init__()
            self.weight, self.bias = linear.weight, linear.bias

        def forward(self, x):
            return chunked_low_sum(x, self.weight, self.bias)

    return StatsLowRMSNorm, LowAccumLinear


def _low_softmax_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention with the scores cast to bf16 for the softmax (`softmax(scores.to(
    torch.bfloat16))`), probabilities back in the query's dtype."""
    # torch, transformers: slow imports; the jaxmodel controls run without them
    import torch
    from transformers.models.llama.modeling_llama import repeat_kv
    k, v = (repeat_kv(t, module.num_key_value_groups) for t in (key, value))
    scores = query @ k.transpose(2, 3) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : k.shape[-2]]
    probs = torch.softmax(scores.to(torch.bfloat16), dim=-1).to(query.dtype)
    return (probs @ v).transpose(1, 2).contiguous(), probs


_LOW_SOFTMAX = "llama_parity_bf16_softmax"


def _h_softmax(layer, place):
    def patch(hf):
        from transformers import AttentionInterface  # transformers: slow import; only its controls need it
        AttentionInterface.register(_LOW_SOFTMAX, _low_softmax_attention)
        attn = hf.model.layers[layer].self_attn
        attn.config = copy.copy(attn.config)     # this layer alone
        attn.config._attn_implementation = _LOW_SOFTMAX
    return patch


def _h_norm(layer, place):
    def patch(hf):
        StatsLowRMSNorm, _ = _hf_classes()
        if layer is None:
            hf.model.norm = StatsLowRMSNorm(hf.model.norm)
        else:
            norm = "input_layernorm" if place == "first" else "post_attention_layernorm"
            block = hf.model.layers[layer]
            setattr(block, norm, StatsLowRMSNorm(getattr(block, norm)))
    return patch


def _low_rope_tables(attn, args, kwargs):
    """A forward pre-hook on one layer's self_attn: its cos/sin rebuilt from angles
    position x inv_freq rounded to bf16 (position_ids are passed to every layer)."""
    import torch  # torch: slow import; the jaxmodel controls run without it
    cos, sin = kwargs["position_embeddings"]
    if kwargs.get("position_ids") is None:
        raise ValueError("step_rope (transformers): the layer was called without position_ids")
    D = cos.shape[-1]
    cfg = attn.config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = (kwargs["position_ids"].to(torch.float64)[..., None] * inv_freq).to(torch.bfloat16).to(torch.float64)
    emb = torch.cat((angles, angles), dim=-1)
    kwargs["position_embeddings"] = (emb.cos().to(cos.dtype), emb.sin().to(sin.dtype))
    return args, kwargs


def _h_rope(layer, place):
    def patch(hf):
        hf.model.layers[layer].self_attn.register_forward_pre_hook(_low_rope_tables, with_kwargs=True)
    return patch


def _h_accum(layer, place):
    def patch(hf):
        _, LowAccumLinear = _hf_classes()
        mlp = hf.model.layers[layer].mlp
        mlp.down_proj = LowAccumLinear(mlp.down_proj)
    return patch


_PATCHES = {("torchref", "softmax"): _t_softmax, ("torchref", "norm"): _t_norm, ("torchref", "rope"): _t_rope,
            ("torchref", "accum"): _t_accum, ("transformers", "softmax"): _h_softmax,
            ("transformers", "norm"): _h_norm, ("transformers", "rope"): _h_rope,
            ("transformers", "accum"): _h_accum}
_WHAT = {"softmax": "softmax(scores.to(bfloat16))", "norm": "RMSNorm mean(x^2) of x.to(bfloat16)",
         "rope": "RoPE angles position x inv_freq in bfloat16",
         "accum": f"down_proj summed in a bfloat16 accumulator ({ACCUM_CHUNK}-input chunks)"}
_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


# A no-op at the policy, so no finding: torch's softmax on a bf16 tensor computes in f32 and
# rounds once, and under bf16 transformers' scores are bf16 already, so softmax(scores.to(
# bfloat16)) is bitwise the prescribed f32 softmax rounded to bf16. The float64 twin shows the
# cast; the policy's run does not (torchref's bf16 softmax does compute in bf16: a finding).
NO_OP_AT_POLICY = {("softmax", "transformers", "bf16")}


def step_control(step: str, where: str, policy: str, place: str, num_layers: int) -> Control:
    layer = places(step, num_layers)[place]
    tap, component = expected_tap(step, layer, place)
    patch = _PATCHES[where, step](layer, place)
    build = torch_side(patch) if where == "torchref" else hf_side(patch, _DTYPE[policy])
    at = "the final norm" if layer is None else f"layer {layer} ({place})"
    name, what = f"step_{step}_{where}_{policy}_{place}", f"{_WHAT[step]} at {at}, under {policy}"
    if (step, where, policy) in NO_OP_AT_POLICY:
        return Control(name, where, policy, "drift", None, None, (), build, what + " (bitwise the policy's own)")
    return Control(name, where, policy, "precision", tap, component, ("precision even in the float64 run",),
                   build, what)


def step_controls(num_layers: int) -> dict[str, Control]:
    """Every step x model x policy x place (places(step, num_layers))."""
    out = {}
    for step in STEPS:
        for where in WHERE:
            for policy in POLICIES:
                for place in places(step, num_layers):
                    c = step_control(step, where, policy, place, num_layers)
                    out[c.name] = c
    return out
