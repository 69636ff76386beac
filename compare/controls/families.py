"""Planted family slips (issue 62): the porting mistakes of Llama's relatives, each planted in
torchref on a tiny checkpoint of its family (llamaspec.testing.TINY_FAMILIES), at layer LAYER
(or at the embedding / the logits, which sit outside the layers), in the model at the policy
and its float64 twin alike, as prefill.torch_side does. Each says what the ladder must answer:
verdict, first tap, layer, component, and words the hint must contain.

The patches go through torchref's public seams only: a module's `ops` namespace (prefill.Ops),
its parameters, the `family` keywords a module passes to its op, and the network's `contexts`
(the masks each layer reads). The hints are the judge's, made from what the taps show and the
reference's config (compare.judge); nothing here tells the judge which slip was planted.

    folder = family_checkpoint(tmp / "gemma2", "gemma2")
    report = run_control(FAMILY_CONTROLS["gemma2_attn_softcap_missing"], folder, ids)
    assert check(FAMILY_CONTROLS["gemma2_attn_softcap_missing"], report) == []

FAMILY_OF[name] names the tiny family config a control runs on; clean_family(family, policy,
where) is the negative control of each family (no plant: torchref's reference backend, jaxmodel
or the family's transformers class as the candidate), judged by the same machinery.
tests/test_family_controls.py asserts them all.
"""

from __future__ import annotations

import numpy as np

from llamaspec import taps as tapnames
from llamaspec.testing import TINY_FAMILIES, make_checkpoint

from ..adapters import OurModel, Side, resolve_side
from .prefill import LAYER, Control, Ops, torch_side


def family_checkpoint(folder, family: str, **extra):
    """A tiny random checkpoint of `family` (TINY_FAMILIES' config, every feature engaged)."""
    return make_checkpoint(folder, **{**TINY_FAMILIES[family], **extra})


# ----- the patches (each returns patch(model), applied to the model at P and its fp64 twin) -----

def _norm_ops(select, rms_norm_of):
    """Layer LAYER's RMSNorm modules chosen by select(layer) compute with rms_norm_of(their ops)
    in place of the ops' rms_norm."""
    def patch(m):
        for norm in select(m.model.layers[LAYER]):
            norm.ops = Ops(norm.ops, rms_norm=rms_norm_of(norm.ops, m.cfg))
    return patch


def _block_and_qk_norms(layer):
    """Every norm of a layer: the block's (cfg.norm_modules) and the attention's q/k norms."""
    norms = [getattr(layer, name) for name in layer.roles.values()]
    if layer.self_attn.qk_norm:
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return norms


def _qk_norms(layer):
    return [layer.self_attn.q_norm, layer.self_attn.k_norm]


def _without_offset(ops, cfg):
    """rms_norm multiplying by w where the family multiplies by (1 + w): a port whose RMSNorm
    ignores Gemma's convention."""
    def rms_norm(x, weight, eps, policy, offset=0.0):
        return ops.rms_norm(x, weight, eps, policy)
    return rms_norm


def _identity_norm(ops, cfg):
    """No norm at all: the step returns its input (a port that leaves q_norm / k_norm out)."""
    def rms_norm(x, weight, eps, policy, **family):
        return x
    return rms_norm


def _over_projection(ops, cfg):
    """A per-head q/k norm (Qwen3: weight [head_dim], input [B, T, H, D]) computed over the whole
    projection (OLMo 2's axis): the statistic over H x D, the weight repeated per head."""
    def rms_norm(x, weight, eps, policy, **family):
        B, T, H, D = x.shape
        return ops.rms_norm(x.reshape(B, T, H * D), weight.repeat(H), eps, policy, **family).view(B, T, H, D)
    return rms_norm


def _per_head(ops, cfg):
    """A projection q/k norm (OLMo 2: weight [H x D], input [B, T, H x D]) computed per head
    (Qwen3's axis): the statistic over each head_dim slice, the weight split per head."""
    D = cfg.head_dim

    def rms_norm(x, weight, eps, policy, **family):
        B, T, F = x.shape
        return ops.rms_norm(x.view(B, T, F // D, D), weight.view(F // D, D), eps, policy, **family).reshape(B, T, F)
    return rms_norm


def _embedding_scale(times: int):
    """The embedding multiplied by sqrt(hidden_size) `times` times where the family does it once
    (0: missing, 2: applied twice, as a port that scales inputs_embeds and calls a model that
    scales them again)."""
    def patch(m):
        net = m.model
        base = net.ops

        def scale_embedding(rows, hidden_size):
            for _ in range(times):
                rows = base.scale_embedding(rows, hidden_size)
            return rows
        net.ops = Ops(base, scale_embedding=scale_embedding)
    return patch


def _final_softcap_missing(m):
    """The logits left uncapped (the network's own soft_cap op is the identity): a port that
    drops final_logit_softcapping."""
    net = m.model
    net.ops = Ops(net.ops, soft_cap=lambda x, cap: x)


def _attention_softcap(value_of):
    """Layer LAYER's attention soft-capped at value_of(cfg) (None: not capped) instead of the
    config's attn_logit_softcapping."""
    def patch(m):
        attn = m.model.layers[LAYER].self_attn
        family = {k: v for k, v in attn.family.items() if k != "softcap"}
        value = value_of(m.cfg)
        attn.family = family if value is None else {**family, "softcap": value}
    return patch


def _window(window_of):
    """Layer LAYER attends within window_of(cfg) keys (None: globally) instead of its own
    cfg.window(LAYER): the network's contexts() with that layer's mask rebuilt from the
    unwindowed one it was given."""
    def patch(m):
        from torchref.model import sliding_allowed  # torchref imports torch: the jaxmodel controls run without it
        net = m.model
        contexts = net.contexts

        def windowed(positions, allowed):
            ctxs = contexts(positions, allowed)
            w = window_of(net.cfg)
            ctxs[LAYER] = ctxs[LAYER]._replace(allowed=allowed if w is None else sliding_allowed(allowed, w))
            return ctxs
        net.contexts = windowed
    return patch


def _other_layers_window(cfg):
    """The window the config gives its sliding layers (for a global layer given one by mistake)."""
    return next(w for w in cfg.sliding_window if w is not None)


def _o_proj_bias(m):
    """o_proj given a bias the family has not (Qwen2: q/k/v carry one, o_proj none): a port that
    reads attention_bias as "every attention projection", its o_proj bias newly initialised."""
    import torch  # torch: slow import; the jaxmodel controls run without it
    proj = m.model.layers[LAYER].self_attn.o_proj
    bias = 0.1 * np.random.default_rng(0).standard_normal(proj.weight.shape[0])
    proj.bias = torch.nn.Parameter(torch.from_numpy(bias).to(dtype=proj.weight.dtype, device=proj.weight.device),
                                   requires_grad=False)


def _q_bias_dropped(m):
    """q_proj's bias left out (a loader that takes no attention bias): zero."""
    import torch  # torch: slow import; the jaxmodel controls run without it
    proj = m.model.layers[LAYER].self_attn.q_proj
    proj.bias = torch.nn.Parameter(torch.zeros_like(proj.bias), requires_grad=False)


# ----- the suite -------------------------------------------------------------------------------

A = "layers.{L}."


def _control(name, family, tap, component, hint, patch, what):
    return family, Control(name, "torchref", "fp32", "semantic", tap, component, tuple(hint), torch_side(patch),
                           what)


_SUITE = [
    _control("gemma2_norm_offset_missing", "gemma2", A + "attn_norm", "attn_norm", ["norm weight", "(1 + w)"],
             _norm_ops(_block_and_qk_norms, _without_offset), "layer 1's RMSNorms multiply by w, not (1 + w)"),
    _control("gemma2_embed_scale_missing", "gemma2", "embed", "embed",
             ["embedding scale", "sqrt(hidden_size)", "missing"], _embedding_scale(0),
             "embeddings not multiplied by sqrt(hidden_size)"),
    _control("gemma2_embed_scale_twice", "gemma2", "embed", "embed",
             ["embedding scale", "sqrt(hidden_size)", "twice"], _embedding_scale(2),
             "embeddings multiplied by sqrt(hidden_size) twice"),
    _control("gemma2_attn_softcap_missing", "gemma2", A + "attn_ctx", "attn", ["attention", "soft-cap", "missing"],
             _attention_softcap(lambda cfg: None), "layer 1's attention scores not soft-capped"),
    _control("gemma2_attn_softcap_wrong", "gemma2", A + "attn_ctx", "attn", ["attention", "soft-cap", "instead of"],
             _attention_softcap(lambda cfg: cfg.final_softcap),
             "layer 1's attention capped at final_logit_softcapping's value, not attn_logit_softcapping's"),
    _control("gemma2_final_softcap_missing", "gemma2", "logits", "lm_head", ["logit", "soft-cap", "missing"],
             _final_softcap_missing, "final logits not soft-capped"),
    _control("mistral_window_off_by_one", "mistral", A + "attn_ctx", "attn", ["sliding window", "off by one"],
             _window(lambda cfg: cfg.window(LAYER) + 1), "layer 1's sliding window one key wider"),
    _control("gemma2_window_on_global_layer", "gemma2", A + "attn_ctx", "attn", ["sliding window", "global layer"],
             _window(_other_layers_window), "layer 1 (global) given the sliding layers' window"),
    _control("qwen3_qk_norm_missing", "qwen3", A + "q_norm", "attn", ["q/k norm", "missing"],
             _norm_ops(_qk_norms, _identity_norm), "layer 1 leaves q_norm and k_norm out"),
    _control("qwen3_qk_norm_over_projection", "qwen3", A + "q_norm", "attn", ["q/k norm axis", "per head"],
             _norm_ops(_qk_norms, _over_projection), "layer 1's per-head q/k norm computed over the projection"),
    _control("olmo2_qk_norm_per_head", "olmo2", A + "q_norm", "attn", ["q/k norm axis", "whole projection"],
             _norm_ops(_qk_norms, _per_head), "layer 1's projection q/k norm computed per head"),
    _control("qwen2_o_proj_bias", "qwen2", A + "attn_out", "attn", ["bias", "o_proj"], _o_proj_bias,
             "layer 1's o_proj given a bias (Qwen2 has none there)"),
    _control("qwen2_q_bias_dropped", "qwen2", A + "q", "attn", ["bias", "q_proj"], _q_bias_dropped,
             "layer 1's q_proj bias dropped"),
]
FAMILY_CONTROLS: dict[str, Control] = {c.name: c for _, c in _SUITE}
FAMILY_OF: dict[str, str] = {c.name: family for family, c in _SUITE}


def clean_family(family: str, policy: str, where: str = "torchref") -> Control:
    """The negative control of a family at `policy`: no plant, so the verdict must be exact or
    drift and no finding named. The candidate (`where`): "torchref" on its reference backend, every
    op the plain reference's, against torchref as the ladder loads it (its default backend);
    "jaxmodel" (another framework's rounding); "transformers" (the family's own *ForCausalLM, its
    f32 islands inside a 16-bit model)."""
    def build(folder, pol):
        if where == "transformers":
            from ..adapters.transformers import TransformersModel  # lazy: imports torch and transformers (slow)
            return Side.of(TransformersModel.from_pretrained(folder, pol))
        if where != "torchref":
            return resolve_side(where, folder, pol)
        import torchref  # torchref imports torch: the jaxmodel controls run without it
        at_p = torchref.from_pretrained(folder, policy=pol, backend="reference")
        at_64 = torchref.from_pretrained(folder, policy="fp64", backend="reference")
        return Side("torchref (reference backend)", OurModel(at_p), OurModel(at_64), False,
                    tuple(tapnames.all_taps(at_p.cfg)))
    return Control(f"clean_{family}_{where}_{policy}", where, policy, "drift", None, None, (), build,
                   f"clean {family}: {where} against torchref at {policy}")
