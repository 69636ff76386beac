"""keras-hub's Llama3Backbone (Keras 3 on JAX) under the Implementation protocol.

    port = KerasHubLlama(folder, policy="fp32")      # Backbone.from_preset(folder, dtype=...)
    port = KerasHubLlama(folder, rms_norm_eps=1e-5)  # a config value passed to from_preset by hand

The backbone is loaded the way its users load it, through keras-hub's transformers
converter, and run as its functional model is (embedding, decoder layers, final norm);
logits are its embedding's reverse projection, as Llama3CausalLM computes them. Taps come
from wrapping, for one call, the `call` of the Keras layers that compute them:

    embed       token_embedding             attn_out    _self_attention_layer
    attn_norm   _self_attention_layernorm   resid_mid   _feedforward_layernorm input
    q, k, v     _query/_key/_value_dense    mlp_norm    _feedforward_layernorm
    q_rope      rotary_embedding_layer,     gate, up    _feedforward_gate/intermediate_dense
    k_rope        1st and 2nd call          act         _feedforward_output_dense input
    attn_ctx    _output_dense input         mlp_out     _feedforward_output_dense
    out         transformer_layer_{i}       final_norm  layer_norm

Positions: the backbone rotates by arange(T) (start_index 0); the wrapper hands its
RotaryEmbedding the mask's positions (cumsum(mask) - 1) through the layer's own
`positions` argument, the protocol's convention, equal to arange on unpadded and
right-padded rows. inject {layer: hidden} replaces decoder layer i's input.

float64(): the backbone loaded at dtype float64 under jax.enable_x64. keras-hub keeps f32
steps inside it (RMSNorm and SiLU cast to float32, softmax layer at float32, RoPE tables
from float32 arange, jax's dot_product_attention softmax in float32), and Keras on JAX
narrows a float64 result type to float32 (ops.mean computes in it). In the twin, and only
during its calls, they run in float64: keras-hub's `ops` is seen through a view that reads
"float32" as "float64", Keras' 64-to-32 bit table keeps float64, and attention takes
keras-hub's own einsum path, whose float32 softmax layer gets a float64 policy.
The math is keras-hub's, at float64 throughout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import numpy as np

from llamaspec import taps as tapnames

from .common import PortBase, PortConfig, port_dtype

KERAS_HUB_MODULES = ("keras_hub.src.models.llama.llama_layernorm", "keras_hub.src.models.llama.llama_decoder",
                     "keras_hub.src.models.llama.llama_attention",
                     "keras_hub.src.models.llama.llama_rotary_embedding",
                     "keras_hub.src.layers.modeling.rotary_embedding",
                     "keras_hub.src.layers.modeling.reversible_embedding")


def _keras_hub():
    """keras_hub, imported on the JAX backend (a clear error when Keras runs another)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras  # keras: optional (the ports extra), and KERAS_BACKEND must be set before it loads
    if keras.config.backend() != "jax":
        raise RuntimeError(f"KerasHubLlama needs Keras on JAX; Keras was imported with backend "
                           f"'{keras.config.backend()}' (set KERAS_BACKEND=jax before importing keras)")
    import keras_hub
    return keras_hub


class _Float64Ops(types.ModuleType):
    """keras.ops, except that a "float32" dtype argument reads "float64"."""

    def __init__(self, ops):
        super().__init__("keras.ops")
        self._ops = ops

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def wide(*args, **kw):
            args = tuple("float64" if a == "float32" else a for a in args)
            kw = {k: "float64" if v == "float32" else v for k, v in kw.items()}
            return fn(*args, **kw)
        return wide


@contextlib.contextmanager
def _f32_steps_in_f64(on: bool):
    """keras-hub's f32 steps run in float64 for the duration (the twin's calls only)."""
    if not on:
        yield
        return
    # jax, keras: slow imports, loaded by the port already
    import jax
    from keras.src.backend.common import dtypes
    mods = [sys.modules[m] for m in KERAS_HUB_MODULES if m in sys.modules]
    attn = sys.modules["keras_hub.src.models.llama.llama_attention"]
    saved = [(m, m.ops) for m in mods if hasattr(m, "ops")], attn.fused_attention_op_available
    narrowed = dtypes.BIT64_TO_BIT32_DTYPE.get("float64")
    try:
        for m, ops in saved[0]:
            m.ops = _Float64Ops(ops)
        attn.fused_attention_op_available = lambda: False
        dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"
        with jax.enable_x64(True):
            yield
    finally:
        for m, ops in saved[0]:
            m.ops = ops
        attn.fused_attention_op_available = saved[1]
        dtypes.BIT64_TO_BIT32_DTYPE["float64"] = narrowed


@contextlib.contextmanager
def _wrapped(plan):
    """plan [(layer, wrap)]: layer.call replaced by wrap(original call) on the instance,
    restored on exit."""
    done = []
    try:
        for layer, wrap in plan:
            done.append((layer, layer.__dict__.get("call")))
            object.__setattr__(layer, "call", wrap(layer.call))
        yield
    finally:
        for layer, before in reversed(done):
            if before is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", before)


class KerasHubLlama(PortBase):
    """keras-hub Llama3Backbone loaded from a Hugging Face folder (see the module docstring)."""

    package = "keras-hub"

    def __init__(self, folder, policy="fp32", rms_norm_eps: float | None = None, backbone=None):
        keras_hub = _keras_hub()
        self.folder, self.rms_norm_eps = folder, rms_norm_eps
        self.dtype = port_dtype(policy)
        self.x64 = self.dtype == "float64"
        if backbone is None:
            kw = {} if rms_norm_eps is None else {"layer_norm_epsilon": float(rms_norm_eps)}
            with _f32_steps_in_f64(self.x64):
                backbone = keras_hub.models.Backbone.from_preset(str(folder), dtype=self.dtype, **kw)
        if self.x64:    # its float32 softmax layer, at float64 in the twin
            import keras  # keras: optional (the ports extra), loaded by _keras_hub() above
            for layer in backbone.transformer_layers:
                layer._self_attention_layer._softmax.dtype_policy = keras.DTypePolicy("float64")
        self.backbone = backbone
        fixed = "" if rms_norm_eps is None else f", eps {rms_norm_eps:g} passed"
        self.name = f"keras-hub[{self.dtype}{fixed}]"
        self.taps = tuple(tapnames.all_taps(backbone.num_layers))

    @property
    def config(self) -> PortConfig:
        """Read from the layers that compute: the norm epsilon of layer 0's first norm, the
        RoPE wavelength of its rotary layer."""
        b = self.backbone
        layer = b.transformer_layers[0]
        return PortConfig(
            vocab_size=b.vocabulary_size, hidden_size=b.hidden_dim, intermediate_size=b.intermediate_dim,
            num_hidden_layers=b.num_layers, num_attention_heads=b.num_query_heads,
            num_key_value_heads=b.num_key_value_heads, head_dim=b.hidden_dim // b.num_query_heads,
            rms_norm_eps=float(layer._self_attention_layernorm.epsilon),
            tie_word_embeddings=bool(b.token_embedding.tie_weights),
            rope_theta=float(layer._self_attention_layer.rotary_embedding_layer.max_wavelength))

    def float64(self) -> "KerasHubLlama":
        """The same folder loaded at float64 (and the same epsilon passed, if one was)."""
        return KerasHubLlama(self.folder, "fp64", self.rms_norm_eps)

    def _plan(self, wanted, acts, positions, forced):
        """(layer, wrapper) pairs: each wrapper records one tap around a keras-hub call."""
        import jax.numpy as jnp  # jax: slow import, loaded by keras-hub already
        w = _Wrappers(set(wanted), acts, jnp.asarray(positions))
        b = self.backbone
        plan = [(b.token_embedding, w.out("embed"))]
        for i, layer in enumerate(b.transformer_layers):
            att = layer._self_attention_layer
            p = f"layers.{i}."
            plan += [(layer, w.out(p + "out"))]
            if i in forced:     # wraps the call that `out` wraps: the layer's own taps see h
                plan += [(layer, w.forcing(jnp.asarray(forced[i])))]
            plan += [(layer._self_attention_layernorm, w.out(p + "attn_norm")),
                     (att._query_dense, w.out(p + "q")), (att._key_dense, w.out(p + "k")),
                     (att._value_dense, w.out(p + "v")),
                     (att.rotary_embedding_layer, w.rope(p + "q_rope", p + "k_rope")),
                     (att._output_dense, w.pre(p + "attn_ctx", lambda x: x.reshape(*x.shape[:2], -1))),
                     (att, w.out(p + "attn_out")),
                     (layer._feedforward_layernorm, w.pre(p + "resid_mid")),
                     (layer._feedforward_layernorm, w.out(p + "mlp_norm")),
                     (layer._feedforward_gate_dense, w.out(p + "gate")),
                     (layer._feedforward_intermediate_dense, w.out(p + "up")),
                     (layer._feedforward_output_dense, w.pre(p + "act")),
                     (layer._feedforward_output_dense, w.out(p + "mlp_out"))]
        plan += [(b.layer_norm, w.out("final_norm"))]
        return plan

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        ids, mask, pos = self.inputs(tokens, attention_mask)
        forced = self.forced(inject, ids.shape)
        acts: dict = {}
        b = self.backbone
        with _f32_steps_in_f64(self.x64):
            # wrapping one layer's call twice (tap its input and its output) nests the wraps
            plan = self._plan(wanted, acts, pos, forced)
            with _wrapped(plan):
                hidden = b({"token_ids": ids.astype(np.int32), "padding_mask": mask.astype(np.int32)})
            logits = b.token_embedding(hidden, reverse=True)
            acts["logits"] = np.asarray(logits)
            return self.finish(acts["logits"], acts, wanted)


class _Wrappers:
    """Call wrappers that record the wanted taps into `acts` (numpy): a call's output, its
    input, the two RoPE calls of one attention (q, then k), or a forced input."""

    def __init__(self, want: set, acts: dict, positions):
        self.want, self.acts, self.positions = want, acts, positions

    def out(self, tap, reshape=None):
        def wrap(call):
            def run(*args, **kw):
                y = call(*args, **kw)
                if tap in self.want:
                    self.acts[tap] = np.asarray(y if reshape is None else reshape(y))
                return y
            return run
        return wrap

    def pre(self, tap, reshape=None):
        def wrap(call):
            def run(x, *args, **kw):
                if tap in self.want:
                    self.acts[tap] = np.asarray(x if reshape is None else reshape(x))
                return call(x, *args, **kw)
            return run
        return wrap

    def rope(self, q_tap, k_tap):
        def wrap(call):
            seen = []

            def run(x, start_index=0, positions=None):
                y = call(x, start_index=start_index, positions=self.positions)
                tap = (q_tap, k_tap)[len(seen)] if len(seen) < 2 else None
                seen.append(tap)
                if tap in self.want:
                    self.acts[tap] = np.asarray(y)
                return y
            return run
        return wrap

    @staticmethod
    def forcing(h):
        def wrap(call):
            def run(x, *args, **kw):
                return call(h.astype(x.dtype), *args, **kw)
            return run
        return wrap
