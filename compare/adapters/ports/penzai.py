"""penzai's llamalike transformer (JAX) under the Implementation protocol.

    port = PenzaiLlama(folder, policy="fp32")                     # as loaded
    port = PenzaiLlama(folder, rope_theta="rope_parameters")      # the fix by hand
    port = PenzaiLlama(folder, rope_theta=10000.0)                # what transformers 4.x's attribute held

Loaded as its users load it: transformers' LlamaForCausalLM from the folder (at the
policy's dtype; penzai converts float32 and bfloat16 models), then penzai's
llamalike_common.llamalike_from_huggingface_model. penzai reads the RoPE base from
`config.rope_theta`, an attribute transformers 5 no longer has (it keeps it in
`rope_parameters`), so as loaded under transformers 5 the conversion fails with
AttributeError; rope_theta="rope_parameters" sets the attribute from rope_parameters
before converting, a number sets it to that number.

Taps: penzai models are trees of layers; a recording layer is inserted after each layer
that computes a tap (pz.select), and a forcing layer before each decoder block (inject):

    embed      EmbeddingLookup             attn_out   Attention
    attn_norm  attention RMSLayerNorm      resid_mid  the attention Residual
    q, k, v    input_to_query/key/value    mlp_norm   feed-forward RMSLayerNorm
               Linear                      gate, up   the gate branch's Linear, the up Linear
    q_rope     input_to_query ApplyRoPE    act        BranchAndMultiplyTogether
    k_rope     input_to_key ApplyRoPE      mlp_out    TransformerFeedForward
    attn_ctx   attn_value_to_output's      out        TransformerBlock
               NamedEinsum                 final_norm, logits   the body's last two layers

penzai's forward takes token positions but no padding mask (causal only): a padded batch
is captured one row at a time on its real tokens (padding slots hold 0), which puts every
real token at position cumsum(mask) - 1.

float64(): the same conversion from the float32 model, every floating leaf cast to float64,
and the two constants penzai stores in the activation dtype (norm epsilon, query scale)
made from their float64 sources, as its builder does for a float64 model; calls under
jax.enable_x64. penzai's layers compute in their inputs' dtype, so the twin is float64
throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from llamaspec import taps as tapnames

from .common import PortBase, PortConfig, by_rows, port_dtype

# axis order of a tap's positional array after batch and seq (penzai names its axes)
_AXIS_ORDER = ("head_groups", "heads", "query_heads", "projection", "embedding", "neurons", "vocabulary")

_RECORDING: dict | None = None      # {"wanted": set, "acts": dict, "forced": {layer: array}} during a capture


def _penzai():
    from penzai import pz  # penzai: optional (the ports extra), slow import (jax)
    return pz


def _layer_classes():
    pz = _penzai()

    @pz.pytree_dataclass
    class Record(pz.nn.Layer):
        """Passes its input on; records it under `tap` while a capture wants it."""
        tap: str = dataclasses.field(metadata={"pytree_node": False})

        def __call__(self, x, **side_inputs):
            if _RECORDING is not None and self.tap in _RECORDING["wanted"]:
                _RECORDING["acts"][self.tap] = x
            return x

    @pz.pytree_dataclass
    class Force(pz.nn.Layer):
        """Replaces decoder block `layer`'s input while a capture forces it."""
        layer: int = dataclasses.field(metadata={"pytree_node": False})

        def __call__(self, x, **side_inputs):
            if _RECORDING is None or self.layer not in _RECORDING["forced"]:
                return x
            h = _RECORDING["forced"][self.layer]
            return pz.nx.wrap(h.astype(x.dtype)).tag("batch", "seq", "embedding")

    return Record, Force


def _instrument(model):
    """The model with Record layers after every tapped layer and Force layers before every
    block; children are wrapped before their parents so that every path stays valid."""
    pz = _penzai()
    Record, Force = _layer_classes()
    n = len(model.body.sublayers) - 3

    def after(path, tap):
        nonlocal model
        model = pz.select(model).at(path).apply(lambda layer: pz.nn.Sequential([layer, Record(tap)]))

    after(lambda m: m.body.sublayers[0], "embed")
    for i in range(n):
        p = f"layers.{i}."

        def blk(m, i=i):
            return m.body.sublayers[1 + i]

        def att(m, i=i):
            return blk(m, i).sublayers[0].delta.sublayers[1]

        def ffw(m, i=i):
            return blk(m, i).sublayers[1].delta.sublayers[1]
        after(lambda m, i=i: att(m, i).input_to_query.sublayers[0], p + "q")
        after(lambda m, i=i: att(m, i).input_to_query.sublayers[1], p + "q_rope")
        after(lambda m, i=i: att(m, i).input_to_key.sublayers[0], p + "k")
        after(lambda m, i=i: att(m, i).input_to_key.sublayers[1], p + "k_rope")
        after(lambda m, i=i: att(m, i).input_to_value.sublayers[0], p + "v")
        after(lambda m, i=i: att(m, i).attn_value_to_output.sublayers[0], p + "attn_ctx")
        after(lambda m, i=i: att(m, i), p + "attn_out")
        after(lambda m, i=i: blk(m, i).sublayers[0].delta.sublayers[0], p + "attn_norm")
        after(lambda m, i=i: ffw(m, i).sublayers[0].branches[0].sublayers[0], p + "gate")
        after(lambda m, i=i: ffw(m, i).sublayers[0].branches[1], p + "up")
        after(lambda m, i=i: ffw(m, i).sublayers[0], p + "act")
        after(lambda m, i=i: ffw(m, i), p + "mlp_out")
        after(lambda m, i=i: blk(m, i).sublayers[1].delta.sublayers[0], p + "mlp_norm")
        after(lambda m, i=i: blk(m, i).sublayers[0], p + "resid_mid")
        model = pz.select(model).at(lambda m, i=i: blk(m, i)).apply(
            lambda layer, i=i: pz.nn.Sequential([Force(i), layer, Record(f"layers.{i}.out")]))
    after(lambda m: m.body.sublayers[1 + n], "final_norm")
    return model


def _positional(tap: str, x) -> np.ndarray:
    """A recorded NamedArray -> numpy [B, T, ...] in the shared layout."""
    rest = sorted((a for a in x.named_shape if a not in ("batch", "seq")), key=_AXIS_ORDER.index)
    a = np.asarray(x.unwrap("batch", "seq", *rest))
    kind = tapnames.parse(tap)[1]
    if kind in tapnames.PER_HEAD:
        return a.reshape(*a.shape[:2], -1, a.shape[-1])
    if kind == "attn_ctx":
        return a.reshape(*a.shape[:2], -1)
    return a


def _to_float64(model, hf_config):
    """Every floating array of a freshly converted model as float64: parameters (penzai
    Variables, set in place) and plain leaves; the two constants penzai stores in the
    activation dtype (the norms' epsilon, the query scale projection_dim ** -0.5) from
    their float64 sources, as penzai's builder makes them for a float64 model."""
    # penzai, jax: optional (the ports extra) and slow imports
    import jax
    import jax.numpy as jnp
    from penzai.nn.standardization import RMSStandardize
    pz = _penzai()
    eps = jnp.asarray(hf_config.rms_norm_eps, jnp.float64)
    scale = jnp.asarray(model.metadata.projection_dim ** -0.5, jnp.float64)

    def wide(a):
        return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a

    def leaf(x):
        if isinstance(x, pz.Parameter):
            x.value = jax.tree_util.tree_map(wide, x.value)
            return x
        return wide(x)
    model = jax.tree_util.tree_map(leaf, model, is_leaf=lambda x: isinstance(x, pz.Parameter))
    model = pz.select(model).at_instances_of(RMSStandardize).apply(lambda n: dataclasses.replace(n, epsilon=eps))
    return pz.select(model).at_instances_of(pz.nn.ConstantRescale).apply(lambda r: dataclasses.replace(r, by=scale))


def load_penzai(folder, dtype: str, rope_theta=None):
    """(penzai model, transformers config): transformers' model from the folder at `dtype`
    (float32 or bfloat16), rope_theta set as asked, converted by penzai."""
    # penzai, transformers, torch: optional (the ports extra) and slow imports
    import torch
    import transformers
    from penzai.models.transformer.variants import llamalike_common

    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
    if rope_theta == "rope_parameters":
        hf.config.rope_theta = float(hf.config.rope_parameters["rope_theta"])
    elif rope_theta is not None:
        hf.config.rope_theta = float(rope_theta)
    try:
        return llamalike_common.llamalike_from_huggingface_model(hf), hf.config
    except AttributeError as e:
        if "rope_theta" not in str(e):
            raise
        raise AttributeError(f"penzai reads config.rope_theta, which transformers {transformers.__version__} does "
                             f"not set (it holds rope_parameters={hf.config.rope_parameters}): {e}. Pass "
                             "rope_theta='rope_parameters' (the fix) or a number") from e


class PenzaiLlama(PortBase):
    """penzai llamalike transformer converted from the folder's transformers model (see the
    module docstring)."""

    package = "penzai"

    def __init__(self, folder, policy="fp32", rope_theta=None, model=None):
        import jax  # jax: slow import; compare loads without it
        self.folder, self.rope_theta = folder, rope_theta
        self.dtype = port_dtype(policy)
        self.x64 = self.dtype == "float64"
        if model is None:
            if self.x64:
                with jax.enable_x64(True):
                    model = _to_float64(*load_penzai(folder, "float32", rope_theta))
            else:
                model, _ = load_penzai(folder, self.dtype, rope_theta)
        self.model = model
        self.tapped = _instrument(model)
        how = "" if rope_theta is None else f", rope_theta {rope_theta}"
        self.name = f"penzai[{self.dtype}{how}]"
        self.taps = tuple(tapnames.all_taps(self.config.num_hidden_layers))

    @property
    def config(self) -> PortConfig:
        """From the converted model: its metadata, layer 0's norm epsilon and RoPE wavelength."""
        meta = self.model.metadata
        att = self.model.body.sublayers[1].sublayers[0].delta
        kv = int(np.prod(list(meta.common_head_axes.values())))
        heads = kv * int(np.prod(list(meta.query_only_head_axes.values())))
        return PortConfig(
            vocab_size=meta.vocab_size, hidden_size=meta.embedding_dim, intermediate_size=meta.mlp_hidden_dim,
            num_hidden_layers=len(self.model.body.sublayers) - 3, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=meta.projection_dim,
            rms_norm_eps=float(att.sublayers[0].sublayers[0].epsilon),
            tie_word_embeddings=None,   # penzai converts with tie_embedder_and_logits=False (two copies)
            rope_theta=float(att.sublayers[1].input_to_query.sublayers[1].max_wavelength))

    def float64(self) -> "PenzaiLlama":
        return PenzaiLlama(self.folder, "fp64", self.rope_theta)

    def _row(self, ids, wanted, forced):
        import jax  # jax: slow import; compare loads without it
        pz = _penzai()
        global _RECORDING
        ctx = jax.enable_x64(True) if self.x64 else contextlib.nullcontext()
        with ctx:
            _RECORDING = {"wanted": set(wanted), "acts": {}, "forced": {i: jax.numpy.asarray(h)
                                                                        for i, h in forced.items()}}
            try:
                logits = self.tapped(pz.nx.wrap(jax.numpy.asarray(ids, np.int32)).tag("batch", "seq"))
                acts = {t: _positional(t, x) for t, x in _RECORDING["acts"].items()}
            finally:
                _RECORDING = None
        acts["logits"] = np.asarray(logits.unwrap("batch", "seq", "vocabulary"))
        return acts["logits"], acts

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        ids, mask, _ = self.inputs(tokens, attention_mask)
        forced = self.forced(inject, ids.shape)
        logits, acts = by_rows(lambda row_ids, row_forced: self._row(row_ids, wanted, row_forced), ids, mask, forced)
        return self.finish(logits, acts, wanted)
