"""TransformerLens' TransformerBridge (PyTorch) under the Implementation protocol.

    port = TransformerLensLlama(folder, policy="fp32")                     # the bridge as booted
    port = TransformerLensLlama(folder, process_weights=True)              # enable_compatibility_mode()
    port = TransformerLensLlama(folder, process_weights={"center_unembed": False})   # one step off
    port = TransformerLensLlama(folder, process_weights=True, withhold=False)        # judge every tap

Loaded as its users load it: `TransformerBridge.boot_transformers(folder, device="cpu",
dtype=...)` on a local Hugging Face folder (a hub name is refused: nothing is downloaded).
The bridge wraps transformers' LlamaForCausalLM (eager attention) and reimplements the
attention itself (PositionEmbeddingsAttentionBridge: q, k, v, RoPE, scores, softmax, z).
A folder without a tokenizer (the tiny test checkpoints) gets a stand-in word-level
tokenizer of the model's vocabulary size: boot needs one, and the adapter hands the model
token ids, so no text is ever tokenized.

Weight processing is what `bridge.enable_compatibility_mode()` does (HookedTransformer's
load-time processing; TransformerLens' own default for that call): process_weights=True
applies its defaults, a dict sets its keyword arguments (fold_ln, center_writing_weights,
center_unembed, fold_value_biases). On a Llama it changes the weights, not the function
the model computes (up to rounding), but some taps then hold other quantities than
torchref's. The adapter says which (`not_comparable`, tap -> reason) and, by default
(withhold=True), does not return the folded norms (`withheld`):

    fold_ln            layers.{i}.attn_norm, layers.{i}.mlp_norm, final_norm (withheld): each
                       RMSNorm's weight is folded into the linear layers that read it (W_Q,
                       W_K, W_V; W_gate, W_in; W_U) and set to 1, so the tap is x / rms(x)
                       without the weight (torchref's times w, per channel). q, k, v, gate, up
                       and the residual stream are the same math.
    center_unembed     logits (returned): W_U minus its mean over the vocabulary, so each
                       position's logits are shifted by minus their mean over the vocabulary
                       (measured at float64 on the tiny checkpoint: the shift equals -mean of
                       torchref's logits to 1.3e-7, float32 steps); softmax and log-probs are
                       unchanged. The ladder names a per-position constant as a convention that
                       changes no probability (drift, not a finding), so they stay judged.
    fold_value_biases  layers.{i}.v, layers.{i}.attn_ctx (withheld), only for a model with
                       attention biases: b_V is moved into b_O (v and z lose b_V; attn_out is
                       the same math).
    center_writing_weights  nothing: TransformerLens centers writing weights only for
                       LayerNorm models (a Llama's RMSNorm is not centered).

Every other tap stays comparable: embed, q, k, v, q_rope, k_rope, attn_ctx, attn_out,
resid_mid, gate, up, act, mlp_out, out (the table's exceptions aside); `comparable` lists
them. withhold=False returns every tap, and the ladder then names the fold itself: "first
semantic at layers.0.attn_norm ... per-feature scale factor: a weight vector applied
differently" (tests/test_port_transformer_lens.py asserts it). Withheld, a bug inside a
norm shows at the first comparable tap after it (q, k, v for attn_norm; gate, up for mlp_norm).

Taps are TransformerLens' own hook points (run_with_hooks), per head [B, T, heads, head_dim]
as the bridge gives them (k and v per kv-head, not repeated):

    embed       hook_embed                    resid_mid   blocks.{i}.hook_resid_mid
    attn_norm   blocks.{i}.ln1.hook_out       mlp_norm    blocks.{i}.ln2.hook_out
    q, k, v     blocks.{i}.attn.hook_q/_k/_v  gate        blocks.{i}.mlp.hook_pre
    q_rope      blocks.{i}.attn.hook_rot_q    up          blocks.{i}.mlp.hook_pre_linear
    k_rope      blocks.{i}.attn.hook_rot_k    act         blocks.{i}.mlp.hook_post
    attn_ctx    blocks.{i}.attn.hook_z        mlp_out     blocks.{i}.hook_mlp_out
                (reshaped to [B, T, H * D])   out         blocks.{i}.hook_resid_post
    attn_out    blocks.{i}.hook_attn_out      final_norm  ln_final.hook_out

attn_norm is the norm's output (ln1.hook_out, weight applied), not `hook_normalized`
(x / rms(x) before the weight, which TransformerLens exposes for its own analyses).
inject {layer: hidden} replaces block i's residual input through blocks.{i}.hook_resid_pre.
The bridge's forward takes the attention mask and position ids: the adapter hands it both
(positions = cumsum(mask) - 1, the protocol's), so padded batches run as one batch, with one
exception. At float64 without compatibility mode, a query slot that sees no real token (a
left-padded row's leading pads) is NaN, and from the next layer on the NaN reaches the row's
real positions (found on the tiny checkpoint): the bridge's attention adds transformers'
float64 mask minimum to the scores and takes the softmax in float32, where it is -inf (as
transformers' eager attention does: compare.adapters.transformers.EAGER_F64_LEFT_PADDING).
Compatibility mode masks with -inf and zeroes fully masked rows, float32 and bfloat16 keep the
minimum finite. So the float64 bridge without processing runs such a batch one row at a time
on its real tokens (padding slots hold 0).

float64(): the folder booted at dtype float64 (the checkpoint's weights at float64) with
the same processing. It keeps float32 steps (keeps_f32=True): transformers' RMSNorm and
rotary tables compute in float32, the bridge's attention softmax runs in float32, and
TransformerLens' process_weights casts every tensor that is not float32 to float32 to
process it and back, so a float64 model's processed weights are float32 numbers
(found: folded W_Q fits float32 exactly, 5.7e-8 from the float64 product).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from llamaspec import positions_from_mask
from llamaspec import taps as tapnames

from .common import PortBase, PortConfig, by_rows, port_dtype

# tap -> TransformerLens hook point ("{i}": the layer)
TL_HOOKS = {
    "embed": "hook_embed",
    "layers.{i}.attn_norm": "blocks.{i}.ln1.hook_out",
    "layers.{i}.q": "blocks.{i}.attn.hook_q",
    "layers.{i}.k": "blocks.{i}.attn.hook_k",
    "layers.{i}.v": "blocks.{i}.attn.hook_v",
    "layers.{i}.q_rope": "blocks.{i}.attn.hook_rot_q",
    "layers.{i}.k_rope": "blocks.{i}.attn.hook_rot_k",
    "layers.{i}.attn_ctx": "blocks.{i}.attn.hook_z",
    "layers.{i}.attn_out": "blocks.{i}.hook_attn_out",
    "layers.{i}.resid_mid": "blocks.{i}.hook_resid_mid",
    "layers.{i}.mlp_norm": "blocks.{i}.ln2.hook_out",
    "layers.{i}.gate": "blocks.{i}.mlp.hook_pre",
    "layers.{i}.up": "blocks.{i}.mlp.hook_pre_linear",
    "layers.{i}.act": "blocks.{i}.mlp.hook_post",
    "layers.{i}.mlp_out": "blocks.{i}.hook_mlp_out",
    "layers.{i}.out": "blocks.{i}.hook_resid_post",
    "final_norm": "ln_final.hook_out",
}
INJECT_HOOK = "blocks.{i}.hook_resid_pre"

# enable_compatibility_mode's weight steps, TransformerLens 4.3's defaults
PROCESSING_DEFAULTS = {"fold_ln": True, "center_writing_weights": True, "center_unembed": True,
                       "fold_value_biases": True}


@dataclasses.dataclass(frozen=True)
class Incomparable:
    """What one weight-processing step does to taps: the taps (globs over the layers) that
    then hold another quantity than torchref's, why, and whether the adapter returns them
    anyway (`returned`: the ladder itself names what the step did, as for a centred unembedding)."""
    step: str
    taps: tuple[str, ...]
    reason: str
    returned: bool = False


FOLD_LN = Incomparable("fold_ln", ("layers.*.attn_norm", "layers.*.mlp_norm", "final_norm"), (
    "fold_ln: the RMSNorm weight is folded into the linear layers that read it (W_Q, W_K, W_V; W_gate, W_in; "
    "W_U) and set to 1, so this tap is x / rms(x) without the weight (torchref's is times the weight, per "
    "channel); what reads it (q, k, v, gate, up, logits) is the same math"))
CENTER_UNEMBED = Incomparable("center_unembed", ("logits",), (
    "center_unembed: W_U minus its mean over the vocabulary, so each position's logits are shifted by minus "
    "their mean over the vocabulary (a per-position constant); softmax and log-probabilities are unchanged. "
    "Returned: the ladder names a per-position constant as a convention that changes no probability"),
    returned=True)
FOLD_VALUE_BIASES = Incomparable("fold_value_biases", ("layers.*.v", "layers.*.attn_ctx"), (
    "fold_value_biases: the value bias b_V is moved into the output bias (b_O + W_O b_V), so v and the "
    "attention context lack b_V (attention rows sum to 1); attn_out is the same math"))


def _transformer_bridge():
    from transformer_lens.model_bridge import TransformerBridge  # lazy: a port's optional dependency (torch)
    return TransformerBridge


def processing_steps(process_weights) -> dict[str, bool]:
    """process_weights (False, True, or a dict of enable_compatibility_mode's weight
    arguments) -> {step: on}; {} for no processing."""
    if process_weights is False or process_weights is None:
        return {}
    if process_weights is True:
        return dict(PROCESSING_DEFAULTS)
    unknown = sorted(set(process_weights) - set(PROCESSING_DEFAULTS))
    if unknown:
        raise ValueError(f"process_weights: unknown step(s) {', '.join(unknown)}; the steps are "
                         f"{', '.join(PROCESSING_DEFAULTS)} (refactor_factored_attn_matrices is refused by "
                         "TransformerLens on rotary models)")
    return {**PROCESSING_DEFAULTS, **{k: bool(v) for k, v in process_weights.items()}}


def incomparable_steps(steps: dict[str, bool], has_value_bias: bool) -> tuple[Incomparable, ...]:
    """The steps among `steps` that change what some tap holds, on a Llama (RMSNorm: TransformerLens
    does not center its writing weights) with or without a value bias."""
    out = []
    if steps.get("fold_ln"):
        out.append(FOLD_LN)
    if steps.get("center_unembed"):
        out.append(CENTER_UNEMBED)
    if steps.get("fold_value_biases") and has_value_bias:
        out.append(FOLD_VALUE_BIASES)
    return tuple(out)


def _standin_tokenizer(folder: Path, vocab_size: int, bos: int, eos: int, pad: int):
    """A word-level tokenizer of `vocab_size` tokens "t0".. for a folder that has none: boot
    needs a tokenizer; the adapter passes token ids and never tokenizes text."""
    # lazy: transformers' dependencies, loaded with transformer_lens
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size)}
    word = Tokenizer(models.WordLevel(vocab, unk_token=f"t{pad}"))
    # name_or_path and add_bos_token: TransformerLens' setup reads the first and, without the
    # second, reloads the tokenizer from that name
    return PreTrainedTokenizerFast(tokenizer_object=word, name_or_path=str(folder), add_bos_token=True,
                                   bos_token=f"t{bos}", eos_token=f"t{eos}", pad_token=f"t{pad}",
                                   unk_token=f"t{pad}")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def boot(folder, dtype: str, steps: dict[str, bool]):
    """TransformerBridge.boot_transformers on a local folder at `dtype` (a torch dtype name),
    then enable_compatibility_mode with `steps` when there are any."""
    import torch  # torch: slow import; compare loads without it
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"TransformerLensLlama: {folder} is not a local Hugging Face folder (no config.json); "
                         "this adapter boots the bridge from a folder and downloads nothing")
    bridge_cls = _transformer_bridge()
    kw = {}
    if not _has_tokenizer(folder):
        cfg = json.loads((folder / "config.json").read_text())
        kw["tokenizer"] = _standin_tokenizer(folder, int(cfg["vocab_size"]), int(cfg.get("bos_token_id") or 1),
                                             int(cfg.get("eos_token_id") or 2), int(cfg.get("pad_token_id") or 0))
    bridge = bridge_cls.boot_transformers(str(folder), device="cpu", dtype=getattr(torch, dtype), **kw)
    bridge.eval()
    tied = bool(bridge.unembed.original_component.weight.data_ptr()
                == bridge.embed.original_component.weight.data_ptr())
    if steps:
        bridge.enable_compatibility_mode(disable_warnings=True, **steps)
    return bridge, tied


class TransformerLensLlama(PortBase):
    """TransformerLens TransformerBridge booted from a Hugging Face folder (see the module
    docstring: loading, weight processing and which taps it leaves comparable, hooks, float64).

    Attributes beyond the protocol's: `bridge` (the TransformerBridge), `steps` (the weight
    processing applied, {} for none), `not_comparable` ({tap: reason} for this mode),
    `comparable` (the other taps), `withheld` (the taps not returned: not_comparable's when
    withhold=True, else none)."""

    package = "transformer-lens"
    keeps_f32 = True

    def __init__(self, folder, policy="fp32", process_weights=False, withhold: bool = True):
        self.folder = folder
        self.dtype = port_dtype(policy)
        self.process_weights, self.withhold = process_weights, withhold
        self.steps = processing_steps(process_weights)
        self.bridge, self._tied = boot(folder, self.dtype, self.steps)
        b = self.bridge
        if getattr(b.cfg, "normalization_type", "RMS") not in ("RMS", "RMSPre"):
            raise ValueError(f"TransformerLensLlama: the bridge's normalization is {b.cfg.normalization_type}; "
                             "this adapter maps a Llama (RMSNorm) model's hooks")
        has_value_bias = b.blocks[0].attn.v.original_component.bias is not None
        self.incomparable = incomparable_steps(self.steps, has_value_bias)
        every = tuple(tapnames.all_taps(len(b.blocks)))
        named = [(step, tapnames.select(step.taps, len(b.blocks), every, None)) for step in self.incomparable]
        self.not_comparable = {t: step.reason for step, taps in named for t in taps}
        self.comparable = tuple(t for t in every if t not in self.not_comparable)
        hidden = {t for step, taps in named if withhold and not step.returned for t in taps}
        self.withheld = tuple(t for t in every if t in hidden)
        self.taps = tuple(t for t in every if t not in hidden)
        done = ("processed" if self.steps == PROCESSING_DEFAULTS else
                "processed: " + ("+".join(s for s, on in self.steps.items() if on) or "none"))
        self.name = f"transformer-lens[{self.dtype}]" if not self.steps else f"transformer-lens[{self.dtype}, {done}]"

    @property
    def config(self) -> PortConfig:
        """The bridge's own numbers: TransformerLens' config for the shapes it reshapes its
        hooks by, the epsilon of layer 0's RMSNorm module, the RoPE base of the rotary module
        that computes the angles (rope_parameters), tying as booted (before processing)."""
        b = self.bridge
        c = b.cfg
        rotary = b.rotary_emb.original_component
        params = getattr(rotary.config, "rope_parameters", None) or {}
        return PortConfig(
            vocab_size=int(c.d_vocab), hidden_size=int(c.d_model), intermediate_size=int(c.d_mlp),
            num_hidden_layers=len(b.blocks), num_attention_heads=int(c.n_heads),
            num_key_value_heads=int(c.n_key_value_heads or c.n_heads), head_dim=int(c.d_head),
            rms_norm_eps=float(b.blocks[0].ln1.original_component.variance_epsilon),
            tie_word_embeddings=self._tied,
            rope_theta=None if params.get("rope_theta") is None else float(params["rope_theta"]))

    def float64(self) -> "TransformerLensLlama":
        """The folder booted at float64 with the same processing (keeps f32 steps: see the
        module docstring)."""
        return TransformerLensLlama(self.folder, "fp64", self.process_weights, self.withhold)

    def _hooks(self, wanted, acts, forced):
        """(hook name, function) pairs: each records one tap; a forced layer's input is replaced."""
        import torch  # torch: slow import; compare loads without it

        from torchref.dtypes import to_numpy  # torchref imports torch (loaded above)
        b = self.bridge
        dtype = b.blocks[0].attn.q.original_component.weight.dtype
        heads, head_dim = int(b.cfg.n_heads), int(b.cfg.d_head)

        def record(tap):
            kind = tapnames.parse(tap)[1]

            def hook(x, hook=None):
                y = x.detach()
                if kind == "attn_ctx" and y.dim() == 4:
                    y = y.reshape(*y.shape[:2], heads * head_dim)
                elif kind in tapnames.PER_HEAD and y.dim() == 3:
                    y = y.reshape(*y.shape[:2], -1, head_dim)
                acts[tap] = to_numpy(y).copy()
            return hook

        def replace(h):
            def hook(x, hook=None):
                return h.to(x.dtype)
            return hook

        out = []
        for i, h in forced.items():
            out.append((INJECT_HOOK.format(i=i), replace(torch.from_numpy(np.ascontiguousarray(h)).to(dtype))))
        for tap in wanted:
            if tap == "logits":
                continue
            layer, kind = tapnames.parse(tap)
            hook = TL_HOOKS[tap] if layer is None else TL_HOOKS[f"layers.{{i}}.{kind}"].format(i=layer)
            out.append((hook, record(tap)))
        return out

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        ids, mask, pos = self.inputs(tokens, attention_mask)
        forced = self.forced(inject, ids.shape)
        if self.dtype == "float64" and not self.bridge.compatibility_mode and not mask[:, 0].all():
            # a slot that sees no real token (left padding) is NaN at float64 and poisons the row
            # from the next layer on (see the module docstring): such a batch goes row by row
            logits, acts = by_rows(lambda i, f: self._run(i, np.ones_like(i), positions_from_mask(np.ones_like(i)),
                                                          wanted, f), ids, mask, forced)
        else:
            logits, acts = self._run(ids, mask, pos, wanted, forced)
        return self.finish(logits, acts, wanted)

    def _run(self, ids, mask, pos, wanted, forced):
        """One forward of the bridge with the mask and positions handed to it: (logits, {tap: array})."""
        import torch  # torch: slow import; compare loads without it

        from torchref.dtypes import to_numpy  # torchref imports torch (loaded above)
        acts: dict = {}
        with torch.no_grad():
            logits = self.bridge.run_with_hooks(
                torch.tensor(ids), fwd_hooks=self._hooks(wanted, acts, forced),
                attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos, dtype=torch.int64))
        logits = to_numpy(logits.detach()).copy()
        if "logits" in wanted:
            acts["logits"] = logits
        return logits, acts


__all__ = ["CENTER_UNEMBED", "FOLD_LN", "FOLD_VALUE_BIASES", "INJECT_HOOK", "PROCESSING_DEFAULTS", "TL_HOOKS",
           "Incomparable", "TransformerLensLlama", "boot", "incomparable_steps", "processing_steps"]
