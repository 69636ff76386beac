"""nnsight's traced transformers model (nnsight 0.8.1) under the Implementation protocol.

    port = NnsightLlama(folder, policy="fp32")      # nnsight.TransformersModel(folder, task="text-generation",
                                                    #   dtype=..., dispatch=True) (NNsight below without a tokenizer)
    port = NnsightLlama(folder, loader="NNsight")   # nnsight.NNsight(AutoModelForCausalLM.from_pretrained(folder))
    port = NnsightLlama.wrap(model, checkpoint=folder)   # a user's own nnsight model (or a LlamaForCausalLM)

The folder is loaded as an nnsight user loads it: `TransformersModel(folder, task="text-generation")` (0.8.1's
name for what `LanguageModel(folder)` loads; loader="LanguageModel" takes the deprecated name) when the folder
has a tokenizer (its pipeline loads one), else `NNsight` over transformers' `AutoModelForCausalLM`. Every tap
is read as nnsight's users read values, inside one `with model.trace(...)` block per capture:

    embed       model.embed_tokens.output            resid_mid  post_attention_layernorm.input
    attn_norm   input_layernorm.output               mlp_norm   post_attention_layernorm.output
    q, k, v     q_proj / k_proj / v_proj.output      gate, up   mlp.gate_proj / mlp.up_proj.output
    q_rope,     self_attn.source                     act        mlp.down_proj.input
      k_rope      .apply_rotary_pos_emb_0.output     mlp_out    mlp.output
    attn_ctx    o_proj.input                         out        model.layers[i].output
    attn_out    o_proj.output                        final_norm model.norm.output
                                                     logits     model.output.logits

nnsight raises OutOfOrderError when a value is asked for after the forward has passed it, so the reads are
made in execution order (llamaspec.taps.all_taps, the order torchref computes them), whatever order the
caller names the taps in. q, k, v, q_rope and k_rope come out [B, T, heads, head_dim]. q_rope and k_rope are
the two values the attention's `apply_rotary_pos_emb` call returns, read through nnsight's operation-level
access (`.source`), so transformers' own rotation is what is tapped.

Inputs: input_ids, attention_mask and position_ids = cumsum(mask) - 1 are passed to the traced call (nnsight
supplies no positions of its own when they are given). inject {layer: hidden} is nnsight's own intervention:
`model.model.layers[i].input = hidden` inside the block, set after layer i - 1's taps are read.

Tracing checked against the plain forward. At load, the model's forward on a probe batch (three rows of
twelve tokens: unpadded, right- and left-padded) is run before nnsight source-instruments the attention
modules, then the same batch is traced with every tap read; at every capture without inject, the traced
logits are compared with the same model called outside a trace on the same inputs (one more forward per
capture; check_trace=False turns that off). Each comparison is bitwise over all positions; a difference
raises TracingChangedNumbers naming how many values differ, by how much, and the first position. Measured
with nnsight 0.8.1 and transformers 5.25 on the tiny checkpoints and SmolLM2-135M at float32, bfloat16 and
float64: no difference (tests/test_port_nnsight.py).

float64(): the same loader on the checkpoint folder at dtype float64 (the checkpoint's weights at float64,
whatever the working dtype); for a wrapped model, its transformers module deep-copied at float64, with the
checkpoint's values when its bf16/fp16 weights are the checkpoint's rounded (TransformersModel.float64).
transformers' Llama keeps f32 steps in a float64 model (its RMSNorm and RoPE compute in float32), so
keeps_f32 is True, as for compare.adapters.transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llamaspec import positions_from_mask
from llamaspec import taps as tapnames

from ..generic import HF_LLAMA_TAPS
from .common import PortBase, PortConfig, by_rows, port_dtype

LOADERS = ("TransformersModel", "LanguageModel", "NNsight")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ROPE_OP = "apply_rotary_pos_emb"    # the call inside transformers' LlamaAttention.forward that rotates q and k
PER_HEAD = ("q", "k", "v")


class TracingChangedNumbers(RuntimeError):
    """The traced run's logits differ from the same model's plain forward on the same inputs."""


def _nnsight():
    try:
        import nnsight
    except ImportError as e:
        raise ImportError("NnsightLlama needs nnsight (pip install nnsight==0.8.1; docs/ports.md)") from e
    return nnsight


def load(folder, dtype: str, loader: str | None = None, attn_implementation: str | None = None):
    """(nnsight model, loader name): the folder loaded as an nnsight user loads it, at `dtype`."""
    import torch  # torch: slow import; compare loads without it
    nnsight = _nnsight()
    folder = Path(folder)
    loader = loader or ("TransformersModel" if any((folder / f).is_file() for f in TOKENIZER_FILES) else "NNsight")
    if loader not in LOADERS:
        raise ValueError(f"loader={loader!r}: use one of {', '.join(LOADERS)}")
    kw = {"dtype": getattr(torch, dtype)}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if loader == "NNsight":
        import transformers  # transformers: slow import
        module = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kw).eval()
        return nnsight.NNsight(module), loader
    task = {} if loader == "LanguageModel" else {"task": "text-generation"}
    return getattr(nnsight, loader)(str(folder), dispatch=True, **task, **kw), loader


def module_of(model):
    """The transformers module inside an nnsight model (an Envoy wraps it as `_module`)."""
    return getattr(model, "_module", model)


def difference(traced, plain) -> str | None:
    """None when the two logits tensors are equal bit for bit, else what differs."""
    import torch  # torch: slow import; compare loads without it
    if traced.shape != plain.shape or traced.dtype != plain.dtype:
        return f"shape/dtype {tuple(traced.shape)} {traced.dtype} (traced) vs {tuple(plain.shape)} {plain.dtype}"
    if torch.equal(traced.contiguous().view(-1).view(torch.uint8), plain.contiguous().view(-1).view(torch.uint8)):
        return None
    a, b = traced.double(), plain.double()
    diff = (a != b) & ~(a.isnan() & b.isnan())
    where = tuple(int(i) for i in diff.nonzero()[0]) if bool(diff.any()) else None
    gap = (a - b).abs()[diff].max().item() if where else 0.0
    first = f", first at {list(where)} ({a[where].item():.9g} traced vs {b[where].item():.9g} plain)" if where else ""
    return f"{int(diff.sum())} of {diff.numel()} values differ, by up to {gap:.3g}{first}"


class NnsightLlama(PortBase):
    """nnsight's traced transformers LlamaForCausalLM (see the module docstring)."""

    package = "nnsight"
    keeps_f32 = True    # transformers' Llama: RMSNorm and RoPE in float32 inside a float64 model

    def __init__(self, folder=None, policy="fp32", loader: str | None = None, attn_implementation: str | None = None,
                 check_trace: bool = True, model=None, checkpoint=None):
        nnsight = _nnsight()
        loaded = model is None      # by this adapter, from the folder (else a user's model, as it is)
        if loaded:
            if folder is None:
                raise ValueError("NnsightLlama needs a checkpoint folder, or model= (an nnsight model)")
            model, loader = load(folder, port_dtype(policy), loader, attn_implementation)
        elif not isinstance(model, nnsight.Envoy):     # a transformers model: wrapped as an nnsight user wraps it
            model, loader = nnsight.NNsight(model), "NNsight"
        self.model, self.loader, self.check_trace = model, loader or type(model).__name__, check_trace
        self.folder = folder if loaded else None
        self.checkpoint = checkpoint if checkpoint is not None else folder
        self.module = module_of(model)
        cfg = self.module.config
        if getattr(cfg, "model_type", None) != "llama":
            raise ValueError(f"NnsightLlama reads a transformers LlamaForCausalLM; got model_type "
                             f"{getattr(cfg, 'model_type', None)!r} ({type(self.module).__name__})")
        self.dtype = str(next(self.module.parameters()).dtype).removeprefix("torch.")
        if loaded and self.dtype != port_dtype(policy):
            raise ValueError(f"{self.loader} loaded {folder} at {self.dtype}, not {port_dtype(policy)}")
        self.attn_implementation = getattr(cfg, "_attn_implementation", None)
        self.name = f"nnsight.{self.loader}[{self.dtype}, {self.attn_implementation}]"
        plain = self._probe_plain()
        self.rope_op = self._rope_op()      # source-instruments the attention modules
        self.taps = tuple(t for t in tapnames.all_taps(cfg.num_hidden_layers)
                          if self.rope_op or tapnames.parse(t)[1] not in ("q_rope", "k_rope"))
        self._check_probe(plain)

    @classmethod
    def wrap(cls, model, checkpoint=None, check_trace: bool = True) -> "NnsightLlama":
        """A user's own nnsight model (NNsight, TransformersModel, LanguageModel over a LlamaForCausalLM), or a
        transformers LlamaForCausalLM (wrapped in NNsight). checkpoint: the folder its weights came from, read
        by float64()."""
        return cls(model=model, checkpoint=checkpoint, check_trace=check_trace)

    # ----- the port's own numbers ------------------------------------------------------------------------------

    @property
    def config(self) -> PortConfig:
        """The module's config, the epsilon layer 0's first norm holds, tying as the head's weight is the
        embedding's, the RoPE base the rotary embedding was built from."""
        m = self.module
        c = m.config
        rope = getattr(c, "rope_parameters", None) or {}
        return PortConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=m.model.layers[0].self_attn.head_dim,
            rms_norm_eps=float(m.model.layers[0].input_layernorm.variance_epsilon),
            tie_word_embeddings=m.lm_head.weight is m.model.embed_tokens.weight,
            rope_theta=float(rope["rope_theta"]) if "rope_theta" in rope else getattr(c, "rope_theta", None))

    def float64(self, checkpoint=None) -> "NnsightLlama":
        """The same port at float64 (see the module docstring)."""
        checkpoint = checkpoint if checkpoint is not None else self.checkpoint
        if self.folder is not None:
            return NnsightLlama(self.folder, "fp64", self.loader, self.attn_implementation, self.check_trace)
        from ..transformers import TransformersModel  # lazy: imports torch (nnsight has loaded it)
        twin = TransformersModel(self.module, checkpoint=checkpoint).float64().model
        return NnsightLlama(model=_nnsight().NNsight(twin), checkpoint=checkpoint, check_trace=self.check_trace)

    # ----- capture ---------------------------------------------------------------------------------------------

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        ids, mask, _ = self.inputs(tokens, attention_mask)
        forced = self.forced(inject, ids.shape)
        if self.dtype == "float64" and self.attn_implementation == "eager":
            # transformers' eager attention at float64 turns left padding into NaN (EAGER_F64_LEFT_PADDING)
            logits, acts = by_rows(lambda i, f: self._capture(i, np.ones_like(i), wanted, f), ids, mask, forced)
        else:
            logits, acts = self._capture(ids, mask, wanted, forced)
        return self.finish(logits, acts, wanted)

    def _capture(self, ids, mask, wanted, forced):
        import torch  # torch: slow import; compare loads without it

        from torchref.dtypes import from_numpy, to_numpy
        args = self._args(ids, mask)
        dt = next(self.module.parameters()).dtype
        events = self._events(wanted, {i: from_numpy(h).to(dt) for i, h in forced.items()})
        with torch.no_grad():
            logits, got = self._traced(args, events)
            if self.check_trace and not forced:
                self._check(logits, self.module(**args).logits, "this capture's inputs")
        acts = {}
        for (kind, tap, *_), value in zip((e for e in events if e[0] != "set"), got):
            for name, x in self._values(kind, tap, value, wanted):
                acts[name] = to_numpy(x).copy()
        logits = to_numpy(logits).copy()
        if "logits" in wanted:
            acts["logits"] = logits
        return logits, acts

    def _args(self, ids, mask) -> dict:
        import torch  # torch: slow import; compare loads without it
        pos = positions_from_mask(mask).astype(np.int64)
        dev = next(self.module.parameters()).device
        return {"input_ids": torch.from_numpy(ids).to(dev), "attention_mask": torch.from_numpy(mask).to(dev),
                "position_ids": torch.from_numpy(pos).to(dev), "use_cache": False}

    def _traced(self, args: dict, events):
        """One `with model.trace(...)` block: each event in order (a read of an envoy's .output / .input, or a
        layer's input set), then the model's logits. Returns (logits, [each read's value])."""
        nnsight = _nnsight()
        model = self.model
        got = []
        with model.trace(**args):
            for kind, _, envoy, where, value in events:
                if kind == "set":
                    envoy.input = value
                else:
                    got.append(nnsight.save(getattr(envoy, where)))
            logits = nnsight.save(model.output.logits)
        return logits, got

    def _events(self, wanted, forced: dict) -> list:
        """[(kind, tap, envoy, "output" | "input", value)] in execution order: a read for each wanted tap (q_rope
        and k_rope: one read of the RoPE call), and ("set", ...) for each forced layer's input, before its taps."""
        rank = {t: 2 * n + 1 for n, t in enumerate(tapnames.all_taps(self.num_layers))}
        events = [(rank[f"layers.{i}.{tapnames.LAYER_TAPS[0]}"] - 1,
                   ("set", None, self._envoy(f"model.layers.{i}"), "input", h)) for i, h in forced.items()]
        for tap in wanted:
            layer, kind = tapnames.parse(tap)
            if kind == "logits":
                continue    # read last, from the model's output, in _traced
            if kind in ("q_rope", "k_rope"):
                if kind == "k_rope" and f"layers.{layer}.q_rope" in wanted:
                    continue    # read with q_rope: one call returns both
                source = self._envoy(f"model.layers.{layer}.self_attn").source
                events.append((rank[tap], ("rope", tap, getattr(source, self.rope_op), "output", None)))
                continue
            path = HF_LLAMA_TAPS[tap if layer is None else f"layers.{{i}}.{kind}"].replace("{i}", str(layer))
            where = "input" if path.startswith("pre:") else "output"
            events.append((rank[tap], (kind, tap, self._envoy(path.removeprefix("pre:")), where, None)))
        return [e for _, e in sorted(events, key=lambda e: e[0])]

    def _values(self, kind, tap, value, wanted):
        """(tap, tensor) pairs from one read: per-head views, both rotated halves of the RoPE call."""
        if kind == "rope":
            layer = tapnames.parse(tap)[0]
            q, k = value
            return [(n, x.transpose(1, 2)) for n, x in ((f"layers.{layer}.q_rope", q), (f"layers.{layer}.k_rope", k))
                    if n in wanted]
        if kind in PER_HEAD:
            head_dim = self.module.model.layers[0].self_attn.head_dim
            return [(tap, value.view(*value.shape[:-1], -1, head_dim))]
        return [(tap, value)]

    def _envoy(self, path: str):
        envoy = self.model
        for part in path.split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        return envoy

    # ----- tracing checked against the plain forward -----------------------------------------------------------

    def _rope_op(self) -> str | None:
        """The operation name nnsight gives transformers' RoPE call in each attention's forward (the first
        access source-instruments the module), or None when a transformers version has no such call."""
        names = [self._envoy(f"model.layers.{i}.self_attn").source.names for i in range(self.num_layers)]
        op = f"{ROPE_OP}_0"
        return op if all(op in n for n in names) else None

    def _probe(self):
        """Three rows of twelve tokens: unpadded, right-padded, left-padded."""
        ids = np.random.default_rng(0).integers(0, self.module.config.vocab_size, (3, 12))
        mask = np.ones_like(ids)
        mask[1, 8:] = 0
        mask[2, :5] = 0
        return ids, mask

    def _probe_plain(self):
        import torch  # torch: slow import; compare loads without it
        with torch.no_grad():
            return self.module(**self._args(*self._probe())).logits

    def _check_probe(self, plain):
        import torch  # torch: slow import; compare loads without it
        ids, mask = self._probe()
        with torch.no_grad():
            logits, _ = self._traced(self._args(ids, mask), self._events(self.taps, {}))
        self._check(logits, plain, "the load-time probe (every tap read; the plain forward run before this "
                                   "adapter source-instrumented the attention)")

    def _check(self, traced, plain, where: str):
        what = difference(traced, plain)
        if what is not None:
            raise TracingChangedNumbers(f"{self.name}: tracing changed the numbers on {where}: the traced run's "
                                        f"logits differ from the same model's plain forward: {what}")


__all__ = ["LOADERS", "NnsightLlama", "TracingChangedNumbers", "difference", "load", "module_of"]
