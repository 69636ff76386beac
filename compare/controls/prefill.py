"""Planted bugs (positive controls) and clean runs (negative controls) for the ladder.

Each Control builds a candidate Side with one bug planted at one layer of one model (a
patched torchref, a patched transformers LlamaForCausalLM, or jaxmodel loading a
doctored copy of the checkpoint) and says what the ladder must answer: verdict, first
tap, layer, component, and words the hint must contain. Code-level bugs patch the
module at LAYER only, through torchref's public seams (a module's `ops` namespace, its
parameters and attributes, the network's lm_head, a forward pre-hook on the context),
never its private names or a copy of its forward; precision controls change one policy
knob of the candidate's working model, its fp64 twin stays clean. tests/test_controls.py asserts them;
bench/controls.py prints the table for a checkpoint.

    side = CONTROLS["rope_layout"].side(folder)      # a Side to pass as candidate
    report = run_control(CONTROLS["rope_layout"], folder, ids, mask)
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from llamaspec import Policy, load_weights
from llamaspec import taps as tapnames
from llamaspec.testing import write_safetensors

from ..adapters import OurModel, Side, resolve_side
from ..ladder.engine import Report, run_ladder

LAYER = 1


@dataclasses.dataclass
class Control:
    name: str
    where: str              # "torchref" | "transformers" | "jaxmodel"
    policy: str             # working policy (preset name)
    verdict: str | None     # None: informational, reported but not asserted
    tap: str | None         # expected first divergence ("{L}" = LAYER), None for clean runs
    component: str | None
    hint: tuple[str, ...]   # words the hint must contain (case-insensitive)
    build: Callable = dataclasses.field(repr=False, default=None)   # (folder, Policy) -> Side
    what: str = ""

    @property
    def expected_tap(self) -> str | None:
        return None if self.tap is None else self.tap.format(L=LAYER)

    @property
    def expected_layer(self) -> int | None:
        return None if self.tap is None else tapnames.layer_of(self.expected_tap)

    def side(self, folder) -> Side:
        return self.build(folder, Policy.get(self.policy))


# ----- torchref: code-level patches at one layer -------------------------------------------

def torch_side(patch, knobs=None):
    """Candidate: torchref with `patch` applied (at P and in its fp64 twin), or with policy
    knobs changed at P only (precision controls: the fp64 twin is clean)."""
    def build(folder, policy):
        import torchref  # torchref imports torch: the jaxmodel controls run without it
        at_p = torchref.from_pretrained(folder, policy=Policy.get(policy, **knobs) if knobs else policy)
        at_64 = torchref.from_pretrained(folder, policy="fp64")
        for m in (at_p, at_64):
            patch(m)
        name = "torchref+" + (",".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "bug")
        return Side(name, OurModel(at_p), OurModel(at_64), False, tuple(tapnames.all_taps(at_p.cfg)))
    return build


class Ops:
    """An op namespace: `base`'s functions, some replaced (set as a module's `ops` seam)."""

    def __init__(self, base, **replaced):
        self.base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self.base, name)


def _layer_ops(module: str, **replaced):
    """Layer LAYER's `module` ("self_attn" or "mlp") computes with some ops replaced."""
    def patch(m):
        target = m.model.layers[LAYER].get_submodule(module)
        target.ops = Ops(target.ops, **replaced)
    return patch


def _attn_bug(**replaced):
    return torch_side(_layer_ops("self_attn", **replaced))


def _mlp_bug(**replaced):
    return torch_side(_layer_ops("mlp", **replaced))


def _rope_interleaved(x, cos, sin):
    """RoPE on pairs (2i, 2i+1) (GPT-J / Meta layout) with the same frequencies."""
    import torch  # torch: slow import; the jaxmodel controls run without it
    D = x.shape[-1]
    c = cos[..., : D // 2].repeat_interleave(2, -1).to(x.dtype)[:, :, None]
    s = sin[..., : D // 2].repeat_interleave(2, -1).to(x.dtype)[:, :, None]
    rot = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).reshape(x.shape)
    return x * c + rot * s


def _rope_theta(theta):
    """Layer LAYER's RoPE tables built with another rope_theta (e.g. Llama 3's 500000): a
    forward pre-hook on its attention rebuilds the context's tables at its positions."""
    def patch(m):
        from torchref.model import rope_tables  # torchref imports torch: the jaxmodel controls run without it
        cfg = dataclasses.replace(m.cfg, rope=dataclasses.replace(m.cfg.rope, theta=theta))

        def retabled(attn, args):
            x, ctx, *rest = args
            cos, sin = rope_tables(cfg, ctx.policy, attn.ops, ctx.positions)
            return (x, ctx._replace(cos=cos, sin=sin), *rest)
        m.model.layers[LAYER].self_attn.register_forward_pre_hook(retabled)
    return patch


def _scale_factor(how: str, D: int) -> float:
    """Factor on the right 1/sqrt(D): "missing" -> scale 1, "1/D" -> scale 1/D."""
    return {"missing": D ** 0.5, "1/D": D ** -0.5}[how]


def _scaled_attention(how):
    def attention(q, k, v, allowed, policy):
        from torchref import ops  # torchref imports torch: the jaxmodel controls run without it
        return ops.attention(q * _scale_factor(how, q.shape[-1]), k, v, allowed, policy)
    return attention


def _softmax_in(dtype):
    """Attention whose softmax is hard-coded to `dtype`, in the float64 run too (code like
    softmax(scores.to(torch.bfloat16)))."""
    def attention(q, k, v, allowed, policy):
        from torchref import ops  # torchref imports torch: the jaxmodel controls run without it
        return ops.attention(q, k, v, allowed, dataclasses.replace(policy, softmax_dtype=dtype))
    return attention


def _tiled_gqa(q, k, v, allowed, policy):
    """Query head h reads kv head h % n_kv (k/v tiled) instead of h // G (repeat_kv)."""
    from torchref import ops  # torchref imports torch: the jaxmodel controls run without it
    G = q.shape[2] // k.shape[2]
    return ops.attention(q, k.repeat(1, 1, G, 1), v.repeat(1, 1, G, 1), allowed, policy)


def _masked(change):
    """Attention over the mask change(allowed) instead of the call's own."""
    def attention(q, k, v, allowed, policy):
        from torchref import ops  # torchref imports torch: the jaxmodel controls run without it
        return ops.attention(q, k, v, change(allowed), policy)
    return attention


def _sees_next(allowed):
    nxt = allowed.clone()
    nxt[:, :, 1:] |= allowed[:, :, :-1]
    return nxt


def _misses_self(allowed):
    import torch  # torch: slow import; the jaxmodel controls run without it
    T = allowed.shape[1]
    return allowed & ~torch.eye(T, allowed.shape[2], dtype=torch.bool, device=allowed.device)


def _gelu(x):
    import torch  # torch: slow import; the jaxmodel controls run without it
    return torch.nn.functional.gelu(x)


def _swapped_linears(x, ws, bs, policy, out_dtype=None):
    """ops.linears with its projections in reverse order (MLP: gate and up swapped)."""
    from torchref import ops  # torchref imports torch: the jaxmodel controls run without it
    return ops.linears(x, ws[::-1], bs[::-1], policy, out_dtype)


def _set_eps(eps, attr="eps"):
    """The input RMSNorm's epsilon at LAYER (torchref names it eps, transformers
    variance_epsilon)."""
    def patch(m):
        setattr(m.model.layers[LAYER].input_layernorm, attr, eps)
    return patch


def _one_plus_w(m):
    import torch  # torch: slow import; the jaxmodel controls run without it
    norm = m.model.layers[LAYER].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight + 1, requires_grad=False)


def _qk_interleave_rows(w, head_dim):
    """A conversion script's q/k row permutation per head (half-split <-> interleaved)."""
    n = w.shape[0]
    perm = np.arange(n).reshape(-1, 2, head_dim // 2).transpose(0, 2, 1).reshape(-1)
    return w[perm]


def _qk_permuted(m):
    import torch  # torch: slow import; the jaxmodel controls run without it
    attn = m.model.layers[LAYER].self_attn
    for proj in (attn.q_proj, attn.k_proj):
        proj.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(
            _qk_interleave_rows(proj.weight.cpu().numpy(), attn.head_dim))).to(proj.weight.device),
            requires_grad=False)


def _tied_head(m):
    """lm_head tied vs untied, whichever is wrong for the checkpoint: an untied checkpoint's
    lm_head.weight dropped and the embedding used instead; a tied checkpoint's head
    "newly initialized" by a loader that unties it (transformers warns, many ignore it)."""
    import torch  # torch: slow import; the jaxmodel controls run without it

    from torchref.model import Linear
    net = m.model
    if net.lm_head is not None:
        net.lm_head = None       # head_weight() now gives the embedding table
        return
    w = net.head_weight()
    fresh = np.random.default_rng(0).standard_normal(tuple(w.shape)) * float(w.float().std())
    head = Linear(w.shape[1], w.shape[0], False, net.ops)
    head.weight = torch.nn.Parameter(torch.from_numpy(fresh).to(dtype=w.dtype, device=w.device), requires_grad=False)
    net.lm_head = head


def _none(m):
    pass


# ----- transformers: a patched LlamaForCausalLM ----------------------------------------------

def hf_side(patch, dtype="float32"):
    """A control's candidate builder: transformers' eager LlamaForCausalLM loaded in `dtype`,
    `patch`(model) applied before the float64 copy is made (so the copy carries it)."""
    def build(folder, policy):
        # lazy: torch and transformers are slow imports (TransformersModel imports torch)
        import torch
        import transformers

        from ..adapters.transformers import TransformersModel
        hf = transformers.LlamaForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
        patch(hf)
        side = Side.of(TransformersModel(hf, checkpoint=folder))
        if patch is not _none:
            side.name += "+bug"
        return side
    return build


def _hf_scaling(how):
    def patch(hf):
        attn = hf.model.layers[LAYER].self_attn
        attn.scaling = attn.head_dim ** -0.5 * _scale_factor(how, attn.head_dim)
    return patch


def _hf_output_in(module: str, dtype: str):
    """A forward hook that rounds LAYER's `module` output (e.g. "self_attn.q_proj") to
    `dtype` and back, in every copy of the model: a step hard-coded to low precision."""
    def patch(hf):
        import torch  # torch: slow import; the jaxmodel controls run without it
        target = hf.model.layers[LAYER].get_submodule(module)
        target.register_forward_hook(lambda mod, args, out: out.to(getattr(torch, dtype)).to(out.dtype))
    return patch


def _hf_rope_angles_in_model_dtype(hf):
    """transformers' rotary_emb computing the angles position x inv_freq in the model's
    dtype (x.dtype) rather than float32: the 2024 bug of RoPE under bf16/autocast. In the
    float64 copy that dtype is float64, so only the policy's run loses precision."""
    import torch  # torch: slow import; the jaxmodel controls run without it
    rotary = hf.model.rotary_emb

    def forward(x, position_ids):
        freqs = position_ids[..., None].to(x.dtype) * rotary.inv_freq.to(device=x.device, dtype=x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)
    rotary.forward = forward


def _hf_weights(fn):
    def patch(hf):
        import torch  # torch: slow import; the jaxmodel controls run without it
        with torch.no_grad():
            fn(hf.model.layers[LAYER])
    return patch


def _hf_swap_gate_up(layer):
    g, u = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
    tmp = g.clone()
    g.copy_(u), u.copy_(tmp)


def _hf_qk_permuted(layer):
    import torch  # torch: slow import; the jaxmodel controls run without it
    attn = layer.self_attn
    for proj in (attn.q_proj, attn.k_proj):
        w = proj.weight
        w.copy_(torch.from_numpy(np.ascontiguousarray(_qk_interleave_rows(w.numpy(), attn.head_dim))))


def _hf_one_plus_w(layer):
    layer.post_attention_layernorm.weight += 1


# ----- jaxmodel: a doctored copy of the checkpoint ------------------------------------------

def _jax_side(doctor):
    """jaxmodel loading a copy of the checkpoint whose layer-LAYER weights `doctor` changed
    (what a broken conversion script writes)."""
    def build(folder, policy):
        import jaxmodel  # jaxmodel imports jax: slow, and XLA_FLAGS must be set first
        cfg, weights = load_weights(folder)
        weights = {k: np.array(v) for k, v in weights.items()}
        doctor(weights, cfg, f"model.layers.{LAYER}.")
        out = Path(tempfile.mkdtemp(prefix="planted-"))
        (out / "config.json").write_text((Path(folder) / "config.json").read_text())
        write_safetensors(out / "model.safetensors", weights, {"format": "pt"})
        at_p, at_64 = (jaxmodel.from_pretrained(out, policy=p) for p in (policy, "fp64"))
        return Side("jaxmodel+bug", OurModel(at_p), OurModel(at_64), False,
                    tuple(tapnames.all_taps(cfg)))
    return build


def _w_swap_gate_up(w, cfg, p):
    w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = \
        w[p + "mlp.up_proj.weight"], w[p + "mlp.gate_proj.weight"]


def _w_qk_permuted(w, cfg, p):
    for k in ("q_proj", "k_proj"):
        w[p + f"self_attn.{k}.weight"] = _qk_interleave_rows(w[p + f"self_attn.{k}.weight"], cfg.head_dim)


def _w_one_plus_w(w, cfg, p):
    key = p + "post_attention_layernorm.weight"
    w[key] = (w[key].astype(np.float64) + 1).astype(w[key].dtype)


def up_proj_fp8_port(spec: str = "e4m3:block128", roll_scales: int = 0):
    """A candidate builder: torchref whose layer LAYER's up_proj weight is fp8 in its code (at P and
    in its float64 run): quantized by `spec` and dequantized with its scales, or (roll_scales) with
    the scales of the row block that many along: a scale of other rows, an indexing slip."""
    def patch(m):
        import torch

        from torchref import quant
        lin = m.model.layers[LAYER].mlp.up_proj
        q, scales = quant.quantize(lin.weight.detach(), spec)
        scales = scales.roll(roll_scales, dims=0)
        w = quant.dequantize(q, scales, spec, "float64" if lin.weight.dtype == torch.float64 else "float32")
        lin.weight = torch.nn.Parameter(w.to(lin.weight.dtype), requires_grad=False)
    return torch_side(patch)


def kv_fp8_port(fmt: str = "e4m3", roll_scales: int = 0):
    """A candidate builder: torchref whose layer LAYER keeps an fp8 KV cache in its code (_kv_fp8)."""
    return _attn_bug(kv_round=_kv_fp8(fmt, roll_scales))


def _kv_fp8(fmt: str = "e4m3", roll_scales: int = 0):
    """kv_round as a port with a hard-coded fp8 KV cache computes it (whatever its policy, in its
    float64 run too): keys and values quantized with one scale per token and kv head, and
    dequantized with those scales, or (roll_scales) with the scales of the kv head that many
    along: the scale of another head, an indexing slip."""
    def kv_round(x, policy):
        import torch

        from torchref import quant
        B, T, H, D = x.shape
        q, scales = quant.quantize(x.reshape(-1, D), f"{fmt}:channel")
        scales = scales.reshape(B, T, H, 1).roll(roll_scales, dims=2).reshape(-1, 1)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        return (q.to(wide) * scales.to(wide)).reshape(x.shape).to(x.dtype)
    return kv_round


# ----- the suite ---------------------------------------------------------------------------

def _c(name, where, policy, verdict, tap, component, hint, build, what):
    return Control(name, where, policy, verdict, tap, component, tuple(hint), build, what)


A = "layers.{L}."
CONTROLS: dict[str, Control] = {c.name: c for c in [
    # torchref, code-level, layer LAYER, fp32
    _c("rmsnorm_eps", "torchref", "fp32", "semantic", A + "attn_norm", "attn_norm", ["per-row scale"],
       torch_side(_set_eps(1e-6)), "input RMSNorm epsilon 1e-6 (config 1e-5)"),
    _c("norm_one_plus_w", "torchref", "fp32", "semantic", A + "mlp_norm", "mlp_norm",
       ["norm weight", "(1 + w)"], torch_side(_one_plus_w), "post-attention norm weight applied as (1 + w)"),
    _c("silu_to_gelu", "torchref", "fp32", "semantic", A + "act", "mlp",
       ["MLP activation: GELU (exact, erf) instead of SiLU"],
       _mlp_bug(silu=_gelu), "MLP activation GELU instead of SiLU"),
    _c("gate_up_swapped", "torchref", "fp32", "semantic", A + "gate", "mlp", [],
       _mlp_bug(linears=_swapped_linears), "gate and up projections swapped"),
    _c("qk_permutation", "torchref", "fp32", "semantic", A + "q", "attn", ["permuted", "RoPE layout"],
       torch_side(_qk_permuted), "q/k weight rows permuted (half-split -> interleaved, per head)"),
    _c("rope_layout", "torchref", "fp32", "semantic", A + "q_rope", "attn", ["RoPE layout"],
       _attn_bug(apply_rope=_rope_interleaved), "RoPE rotates pairs (2i, 2i+1): interleaved"),
    _c("rope_theta", "torchref", "fp32", "semantic", A + "q_rope", "attn",
       ["RoPE frequencies", "theta", "linearly with position"],
       torch_side(_rope_theta(500000.0)), "rope_theta 500000 (config 10000 / 100000)"),
    _c("attn_scale_missing", "torchref", "fp32", "semantic", A + "attn_ctx", "attn",
       ["no attention scale"], _attn_bug(attention=_scaled_attention("missing")),
       "scores not divided by sqrt(head_dim)"),
    _c("attn_scale_wrong", "torchref", "fp32", "semantic", A + "attn_ctx", "attn",
       ["1/head_dim"], _attn_bug(attention=_scaled_attention("1/D")),
       "scores divided by head_dim instead of sqrt(head_dim)"),
    _c("gqa_grouping", "torchref", "fp32", "semantic", A + "attn_ctx", "attn", ["GQA grouping"],
       _attn_bug(attention=_tiled_gqa), "query head h reads kv head h % n_kv"),
    _c("causal_sees_next", "torchref", "fp32", "semantic", A + "attn_ctx", "attn",
       ["causal mask off by one", "next token"], _attn_bug(attention=_masked(_sees_next)),
       "causal mask lets each query see the next token"),
    _c("causal_misses_self", "torchref", "fp32", "semantic", A + "attn_ctx", "attn",
       ["causal mask off by one", "own token"], _attn_bug(attention=_masked(_misses_self)),
       "causal mask hides each query's own token"),
    _c("lm_head_tied", "torchref", "fp32", "semantic", "logits", "lm_head", ["lm_head matrix"],
       torch_side(_tied_head), "lm_head tied to the embedding although the checkpoint has its own"),
    # A difference the policy rounds away where it starts (bitwise equal at bf16 there): it
    # is localised by the first tap where the float64 runs differ, not where bf16 shows it.
    _c("rmsnorm_eps_hidden_bf16", "torchref", "bf16", "semantic", A + "attn_norm", "attn_norm",
       ["per-row scale", "policy rounds it away"], torch_side(_set_eps(1.001e-5)),
       "input RMSNorm epsilon 1.001e-5 (config 1e-5) under bf16"),
    # precision: one policy knob of the candidate at P (its fp64 twin is clean)
    _c("rope_tables_bf16", "torchref", "bf16", "precision", "layers.0.q_rope", "attn", ["RoPE tables"],
       torch_side(_none, dict(rope_dtype="bfloat16")), "RoPE angles and cos/sin in bf16 (bf16 policy)"),
    _c("softmax_bf16_in_fp32", "torchref", "fp32", "precision", "layers.0.attn_ctx", "attn",
       ["attention"], torch_side(_none, dict(softmax_dtype="bfloat16")),
       "softmax in bf16 inside an fp32 model"),
    # precision in the float64 run too: a step hard-coded to a narrower dtype (dtype noise)
    _c("softmax_bf16_hardcoded", "torchref", "fp32", "precision", A + "attn_ctx", "attn",
       ["layer 1's attention computes at about bfloat16 precision even in the float64 run"],
       _attn_bug(attention=_softmax_in("bfloat16")), "softmax(scores.to(bfloat16)) in one layer"),
    _c("softmax_fp16_hardcoded", "torchref", "fp32", "precision", A + "attn_ctx", "attn",
       ["about float16 precision even in the float64 run"],
       _attn_bug(attention=_softmax_in("float16")), "softmax(scores.to(float16)) in one layer"),
    _c("hf_q_proj_bf16", "transformers", "fp32", "precision", A + "q", "attn",
       ["layer 1's attention computes at about bfloat16 precision even in the float64 run"],
       hf_side(_hf_output_in("self_attn.q_proj", "bfloat16")), "q_proj output rounded to bfloat16"),
    _c("hf_mlp_out_fp16", "transformers", "fp32", "precision", A + "mlp_out", "mlp",
       ["MLP computes at about float16 precision"],
       hf_side(_hf_output_in("mlp", "float16")), "MLP output rounded to float16"),
    _c("hf_rope_angles_bf16", "transformers", "bf16", "precision", "layers.0.q_rope", "attn",
       ["RoPE tables", "highest-frequency"], hf_side(_hf_rope_angles_in_model_dtype, "bfloat16"),
       "rotary_emb computes position x inv_freq in the model's dtype (bf16), every layer"),
    # fp8 KV cache (docs/fp8.md): at P only (a policy knob of one layer), and hard-coded in a port's
    # code (its float64 run stores fp8 too: judge.storage recognises the rounding), and a wrong scale
    # (at fp32: under bf16 an e4m3 cache in one layer costs ~4x the reference's error at attn_ctx, at
    # the drift bound's edge on this tiny model, so no verdict is certain there)
    _c("kv_cache_fp8_at_policy", "torchref", "fp32", "precision", A + "attn_ctx", "attn", ["attention"],
       torch_side(_none, dict(layers=[("1", "fp32+kv_cache=e4m3:channel")])),
       "layer 1 keeps its keys and values in fp8 e4m3 (fp32 policy)"),
    _c("kv_cache_fp8_hardcoded", "torchref", "bf16", "precision", A + "attn_ctx", "attn",
       ["keys and values stored in float8_e4m3fn per token and kv head even in the float64 run"],
       kv_fp8_port("e4m3"), "one layer's KV cache hard-coded to fp8 e4m3 (per token and head)"),
    _c("kv_cache_fp8_wrong_scale", "torchref", "bf16+kv_cache=e4m3:channel", "semantic", A + "attn_ctx", "attn",
       [], kv_fp8_port("e4m3", roll_scales=1),
       "fp8 KV cache dequantized with the next kv head's scale (policy: e4m3 KV cache)"),
    # fp8 weights in a port's code: recognised from the reference's weight (judge.storage), and a wrong scale
    _c("up_proj_fp8_hardcoded", "torchref", "bf16", "precision", A + "up", "mlp",
       ["multiplies by weights stored in float8_e4m3fn", "even in the float64 run"],
       up_proj_fp8_port("e4m3:block128"), "one layer's up_proj weight fp8 e4m3 in 128 x 128 blocks, in code"),
    _c("up_proj_fp8_wrong_scale", "torchref", "bf16", "semantic", A + "up", "mlp", [],
       up_proj_fp8_port("e4m3:channel", roll_scales=1), "fp8 up_proj dequantized with the next row's scale"),
    # Reported, not asserted: under bf16 the policy itself rounds scores and probabilities
    # to bf16, so a bf16 softmax adds about one more rounding (measured 1.0-1.4x the
    # reference's error at attn_ctx, teacher-forced or not): drift by the ladder's rule.
    _c("softmax_bf16", "torchref", "bf16", None, "layers.0.attn_ctx", "attn", [],
       torch_side(_none, dict(softmax_dtype="bfloat16")), "softmax in bf16 (bf16 policy)"),
    # transformers LlamaForCausalLM (eager), patched, against torchref
    # (its float64 run keeps the norm in f32: an epsilon change must pass STRUCT_F32_FLOOR to be seen)
    _c("hf_rmsnorm_eps_hidden_bf16", "transformers", "bf16", "semantic", A + "attn_norm", "attn_norm",
       ["per-row scale"], hf_side(_set_eps(1.5e-5, "variance_epsilon"), "bfloat16"),
       "input_layernorm.variance_epsilon 1.5e-5 (config 1e-5) under bf16"),
    _c("hf_rmsnorm_eps", "transformers", "fp32", "semantic", A + "attn_norm", "attn_norm",
       ["per-row scale"], hf_side(_set_eps(1e-6, "variance_epsilon")), "input_layernorm.variance_epsilon 1e-6"),
    _c("hf_attn_scale_missing", "transformers", "fp32", "semantic", A + "attn_ctx", "attn",
       ["no attention scale"], hf_side(_hf_scaling("missing")), "self_attn.scaling = 1"),
    _c("hf_qk_permutation", "transformers", "fp32", "semantic", A + "q", "attn", ["permuted"],
       hf_side(_hf_weights(_hf_qk_permuted)), "q/k weight rows permuted"),
    _c("hf_gate_up_swapped", "transformers", "fp32", "semantic", A + "gate", "mlp", [],
       hf_side(_hf_weights(_hf_swap_gate_up)), "gate_proj and up_proj weights swapped"),
    _c("hf_norm_one_plus_w", "transformers", "fp32", "semantic", A + "mlp_norm", "mlp_norm",
       ["norm weight", "(1 + w)"], hf_side(_hf_weights(_hf_one_plus_w)), "post-attention norm weight + 1"),
    # jaxmodel on a doctored checkpoint copy
    _c("jax_gate_up_swapped", "jaxmodel", "fp32", "semantic", A + "gate", "mlp", [],
       _jax_side(_w_swap_gate_up), "checkpoint with gate_proj / up_proj swapped"),
    _c("jax_qk_permutation", "jaxmodel", "fp32", "semantic", A + "q", "attn", ["permuted"],
       _jax_side(_w_qk_permuted), "checkpoint with q/k rows permuted (Meta layout)"),
    _c("jax_norm_one_plus_w", "jaxmodel", "fp32", "semantic", A + "mlp_norm", "mlp_norm",
       ["norm weight", "(1 + w)"], _jax_side(_w_one_plus_w), "checkpoint with norm weight stored as w - 1"),
]}


def clean(where: str, policy: str) -> Control:
    """A negative control: the clean candidate `where` against torchref at `policy`."""
    def build(folder, pol):
        if where == "transformers":
            dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}[policy]
            return hf_side(_none, dtype)(folder, pol)
        return resolve_side(where, folder, pol)
    return Control(f"clean_{where}_{policy}", where, policy, "drift", None, None, (), build,
                   f"clean {where} vs torchref at {policy}")


def run_control(control: Control, folder, ids, mask=None, teacher_forcing=True, twin=True) -> Report:
    """twin=False drops the candidate's float64 twin: the control judged by structure alone."""
    mask = np.ones(np.shape(ids), np.int64) if mask is None else mask
    policy = Policy.get(control.policy)
    ref = resolve_side("torchref", folder, policy)
    cand = control.side(folder)
    if not twin:
        cand = dataclasses.replace(cand, at_fp64=None)
    return run_ladder(ref, cand, ids, mask, policy, teacher_forcing)


def check(control: Control, report: Report) -> list[str]:
    """What is wrong with the report for this control ([] = as expected)."""
    d = report.first_divergence
    if control.tap is None:
        return [] if report.verdict in ("exact", "drift") else [f"clean run gave {report.verdict}: "
                                                                 f"{report.summary()}"]
    problems = []
    if control.verdict is None:     # informational: reported, not asserted
        return problems
    if report.verdict != control.verdict:
        problems.append(f"verdict {report.verdict}, expected {control.verdict}")
    if d is None:
        return problems + ["no first divergence"]
    got = (d.tap, d.layer, d.component)
    want = (control.expected_tap, control.expected_layer, control.component)
    if got != want:
        problems.append(f"at {got}, expected {want}")
    missing = [w for w in control.hint if w.lower() not in d.hint.lower()]
    if missing:
        problems.append(f"hint lacks {missing}: {d.hint}")
    return problems


def findings_after(report) -> list[str]:
    """The findings after the first divergence of a Report or DecodeReport (its listed step)
    that have no error of their own: each one left must have teacher forcing's local record
    (its layer fed the oracle's input) showing a finding; any other is one the report should
    have called inherited ([] = none)."""
    if report.first_divergence is None:
        return []
    names = [v.tap for v in report.taps]
    after = report.taps[names.index(report.first_divergence.tap) + 1:]
    return [f"{v.tap} ({v.kind})" for v in after if v.kind in ("precision", "semantic")
            and not (v.local is not None and v.local.kind in ("precision", "semantic"))]


# ----- structure the hints name from the step's own inputs (structure.tap_inputs), on
# transformers' public seams: asserted with the others (verdict, tap, layer, component, hint).

def _hf_partial_rotary(hf):
    """rotary_emb's cos/sin cover only the first half of head_dim (cos 1, sin 0 on the rest):
    the second half of each head is left unrotated, every layer."""
    def half(module, args, out):
        cos, sin = (t.clone() for t in out)
        D = cos.shape[-1]
        cos[..., D // 2:], sin[..., D // 2:] = 1.0, 0.0
        return cos, sin
    hf.model.rotary_emb.register_forward_hook(half)


def _hf_activation(name):
    """Layer LAYER's MLP activation replaced by transformers' ACT2FN[name]."""
    def patch(hf):
        from transformers.activations import ACT2FN  # transformers: slow import; only its controls need it
        hf.model.layers[LAYER].mlp.act_fn = ACT2FN[name]
    return patch


def _hf_o_proj_transposed(layer):
    w = layer.self_attn.o_proj.weight
    if w.shape[0] != w.shape[1]:
        raise ValueError(f"hf_o_proj_transposed needs a square o_proj (hidden_size = heads x head_dim), "
                         f"this checkpoint's is {tuple(w.shape)}")
    w.copy_(w.T.clone())


def _hf_q_heads_swapped(layer):
    """q_proj's rows of heads 0 and 1 exchanged (a head order mixed up on conversion)."""
    attn = layer.self_attn
    w, D = attn.q_proj.weight, attn.head_dim
    w[:2 * D].copy_(w[:2 * D].view(2, D, -1).flip(0).reshape(2 * D, -1).clone())


def _hf_residual(where: str, factor: float):
    """Layer LAYER's residual scaled by `factor` (0: missing, 2: added twice): "attn" scales
    the residual of the attention block (resid_mid = factor x input + attn_out), "mlp" that
    of the MLP block (out = factor x resid_mid + mlp_out), by hooks on the layer's modules."""
    def patch(hf):
        layer = hf.model.layers[LAYER]
        seen = {}
        # the inputs are read at the norms, so that teacher forcing's replaced input is the one seen
        if where == "attn":    # self_attn's output gets (factor - 1) x the layer input added
            layer.input_layernorm.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
            layer.self_attn.register_forward_hook(
                lambda mod, args, out: (out[0] + (factor - 1) * seen["x"],) + tuple(out[1:]))
        else:                  # the layer's output gets (factor - 1) x resid_mid added
            layer.post_attention_layernorm.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
            layer.register_forward_hook(lambda mod, args, out: out + (factor - 1) * seen["x"])
    return patch


CONTROLS.update({c.name: c for c in [
    _c("hf_partial_rotary", "transformers", "fp32", "semantic", "layers.0.q_rope", "attn",
       ["RoPE applied to", "partial rotary"], hf_side(_hf_partial_rotary),
       "RoPE tables cover half of head_dim: the other half of each head is not rotated"),
    _c("hf_q_heads_swapped", "transformers", "fp32", "semantic", A + "q", "attn", ["heads permuted"],
       hf_side(_hf_weights(_hf_q_heads_swapped)), "q_proj rows of heads 0 and 1 exchanged"),
    _c("hf_gelu_tanh", "transformers", "fp32", "semantic", A + "act", "mlp",
       ["MLP activation: GELU (tanh approximation) instead of SiLU"],
       hf_side(_hf_activation("gelu_pytorch_tanh")), "MLP activation GELU (tanh) instead of SiLU"),
    _c("hf_quick_gelu", "transformers", "fp32", "semantic", A + "act", "mlp", ["MLP activation: quick GELU"],
       hf_side(_hf_activation("quick_gelu")), "MLP activation quick GELU instead of SiLU"),
    _c("hf_attn_residual_doubled", "transformers", "fp32", "semantic", A + "resid_mid", "attn",
       ["residual (skip connection) is added twice"],
       hf_side(_hf_residual("attn", 2.0)), "the attention block's residual added twice"),
    _c("hf_mlp_residual_missing", "transformers", "fp32", "semantic", A + "out", "mlp",
       ["residual (skip connection) is missing"],
       hf_side(_hf_residual("mlp", 0.0)), "the MLP block's residual dropped: the layer returns mlp_out"),
]})

def _hf_qk_swapped(layer):
    """q_proj's and k_proj's weights exchanged (one shape under MHA): a conversion's key mix-up."""
    q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
    if q.shape != k.shape:
        raise ValueError(f"hf_qk_swapped needs q_proj and k_proj of one shape (MHA), this checkpoint's are "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    tmp = q.clone()
    q.copy_(k), k.copy_(tmp)


def _hf_q_bias_dropped(layer):
    """q_proj's bias left out (a loader that drops attention_bias): zeroed."""
    bias = layer.self_attn.q_proj.bias
    if bias is None:
        raise ValueError("hf_q_bias_dropped needs a checkpoint with attention_bias (q_proj has no bias)")
    bias.zero_()


# Controls that need a checkpoint of their own, with the tiny config (llamaspec.testing.TINY_CONFIGS)
# it takes: tests/test_structure.py runs each on it.
OWN_CHECKPOINT_CONTROLS: dict[str, tuple[str, Control]] = {c.name: (config, c) for config, c in [
    ("mha", _c("hf_qk_swapped", "transformers", "fp32", "semantic", A + "q", "attn", ["q_proj and k_proj swapped"],
               hf_side(_hf_weights(_hf_qk_swapped)), "q_proj and k_proj weights swapped (MHA)")),
    ("bias", _c("hf_q_bias_dropped", "transformers", "fp32", "semantic", A + "q", "attn", ["constant offset", "bias"],
                hf_side(_hf_weights(_hf_q_bias_dropped)), "q_proj bias dropped")),
]}

# Controls that need a square o_proj (hidden_size = heads x head_dim, as SmolLM2's 9 x 64 = 576),
# which tests/test_controls.py's checkpoint (4 heads x head_dim 32, hidden 32) has not:
# tests/test_structure.py runs them on a square one.
SQUARE_CONTROLS: dict[str, Control] = {c.name: c for c in [
    _c("hf_o_proj_transposed", "transformers", "fp32", "semantic", A + "attn_out", "attn",
       ["projection weight transposed"],
       hf_side(_hf_weights(_hf_o_proj_transposed)), "o_proj weight transposed (square)"),
]}
