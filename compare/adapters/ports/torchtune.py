"""torchtune's Llama (PyTorch) under the Implementation protocol, on generic.TorchModule.

    port = TorchtuneLlama(folder, policy="fp32")                      # llama3 builder, the protocol's mask
    port = TorchtuneLlama(folder, padding="torchtune")                # torchtune.generation's mask and positions
    port = TorchtuneLlama(folder, padding="none")                     # module(tokens) alone
    port = TorchtuneLlama(folder, builder="llama3_2")                 # its Llama 3.2 builder (scaled RoPE)

Loaded as a torchtune user loads a Hugging Face folder: config.json gives the builder's
arguments, the model is built with torchtune's own component builder under
torchtune.training.set_default_dtype(dtype) (as its recipes build it: the RoPE tables stay
float32 there, as torchtune computes them), the folder's safetensors are converted with
torchtune.models.convert_weights.hf_to_tune and loaded with load_state_dict(strict=True).

Builders. torchtune 0.6.1 has no Llama builder for SmolLM2's shape (tied embeddings, GQA,
RoPE base 100000, no RoPE scaling):

    "llama3"    torchtune.models.llama3.llama3: plain RotaryPositionalEmbeddings(base=rope_theta),
                an untied output Linear. For a tied checkpoint its parts are put in the
                TransformerDecoder its llama3_2 builder makes, output = TiedLinear(embedding)
                (as its llama3_2 and qwen2 builders tie), so the folder's keys load strictly.
    "llama3_2"  torchtune.models.llama3_2.llama3_2(tie_word_embeddings=...): ties as the config
                says, but its RoPE is always Llama3ScaledRoPE (scale_factor 32, low/high frequency
                factors 1 and 4, old context 8192: Llama 3.1's scaling), whatever config.json says.
                On a checkpoint without RoPE scaling that is a wrong model, which the ladder names at
                layers.0.q_rope (tests/test_port_torchtune.py).

"llama3" (the default) refuses a config with RoPE scaling, biases, another activation or a
head_dim other than hidden_size / num_attention_heads (torchtune's builders compute it).

Taps (forward hooks, TorchModule's map TORCHTUNE_TAPS): every vocabulary tap. torchtune's one
RoPE module is shared by every attention and called twice per layer (q, then k), so q_rope and
k_rope are its calls #0 and #1 inside each layer (TorchModule's "<path>#n"). The logits tap is
the output projection's result before TransformerDecoder.unembed's .float().

q/k layout. hf_to_tune permutes the q_proj and k_proj rows of each head so that torchtune's
RoPE can rotate adjacent pairs: for a head of size d, output channel 2j + s (j < d/2, s in
{0, 1}) of torchtune's projection is channel s * d/2 + j of Hugging Face's
(`view(heads, 2, d/2, dim).transpose(1, 2)`). torchtune's RoPE rotates the pair (2j, 2j + 1)
by position * theta_j, Hugging Face's the pair (j, j + d/2) by the same angle, so the map
back, x_hf[..., s * d/2 + j] = x_tt[..., 2j + s], i.e. x_hf = concat(x_tt[..., 0::2],
x_tt[..., 1::2]) on the head_dim axis, turns torchtune's q, k, q_rope and k_rope into Hugging
Face's (and torchref's) values exactly. The adapter applies it to those four taps.

Padding (padding=, the way the batch reaches torchtune's forward(tokens, mask=, input_pos=)):

    "mask"       (default) the protocol's: mask[b, i, j] = causal and key j real (a padding row
                 attends to itself only, so that no row is empty), input_pos = cumsum(mask) - 1
                 (0 on padding), as torchref computes.
    "torchtune"  torchtune.generation's get_causal_mask_from_padding_mask and
                 get_position_ids_from_padding_mask, as its generate() prepares a padded prompt.
    "positions"  input_pos as "mask", no mask: torchtune's causal default, padding keys attended.
    "none"       module(tokens) alone: positions 0..T-1 in every row and padding keys attended,
                 what a batch gets from a user who does not hand torchtune the padding.

A batch without padding is the same call in all four (up to the mask being given or not).

inject {layer: hidden} replaces layers.{i}'s input (a forward pre-hook, TorchModule's).

float64(): the model built again under set_default_dtype(float64) with the checkpoint's
weights at float64 (hf_to_tune on them; not a cast of a bf16 model). torchtune keeps float32
steps inside it: RMSNorm normalises x.float() (then multiplies its float64 scale), RoPE rotates
x.float() with float32 tables, and unembed returns .float() logits. The twin says
keeps_f32=True and agrees with a true float64 run to float32's rounding, not 1e-12.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llamaspec import taps as tapnames

from ..generic import TorchModule
from .common import PortBase, PortConfig, port_dtype

TORCHTUNE_TAPS = {
    "embed": "tok_embeddings",
    "layers.{i}.attn_norm": "layers.{i}.sa_norm",
    "layers.{i}.q": "layers.{i}.attn.q_proj",
    "layers.{i}.k": "layers.{i}.attn.k_proj",
    "layers.{i}.v": "layers.{i}.attn.v_proj",
    "layers.{i}.q_rope": "layers.{i}.attn.pos_embeddings#0",
    "layers.{i}.k_rope": "layers.{i}.attn.pos_embeddings#1",
    "layers.{i}.attn_ctx": "pre:layers.{i}.attn.output_proj",
    "layers.{i}.attn_out": "layers.{i}.attn",
    "layers.{i}.resid_mid": "pre:layers.{i}.mlp_norm",
    "layers.{i}.mlp_norm": "layers.{i}.mlp_norm",
    "layers.{i}.gate": "layers.{i}.mlp.w1",
    "layers.{i}.up": "layers.{i}.mlp.w3",
    "layers.{i}.act": "pre:layers.{i}.mlp.w2",
    "layers.{i}.mlp_out": "layers.{i}.mlp",
    "layers.{i}.out": "layers.{i}",
    "final_norm": "norm",
    "logits": "output",                 # "output.linear" when the output is torchtune's TiedLinear
}

BUILDERS = ("llama3", "llama3_2")
PADDINGS = ("mask", "torchtune", "positions", "none")
INTERLEAVED = ("q", "k", "q_rope", "k_rope")        # the steps whose head_dim axis hf_to_tune permuted


def hf_order(head_dim: int) -> np.ndarray:
    """Indices that take torchtune's interleaved head_dim axis to Hugging Face's half-split one:
    x_hf = x_tt[..., hf_order(d)] = concat(x_tt[..., 0::2], x_tt[..., 1::2])."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def read_config(folder) -> dict:
    """The builder's arguments from config.json (RoPE base from rope_theta or, as transformers 5
    writes it, rope_parameters), plus what a builder must be refused for."""
    c = json.loads((Path(folder) / "config.json").read_text())
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    theta = c.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"}
                                        if params.get("rope_type", "default") != "default" else None)
    heads = c["num_attention_heads"]
    return dict(vocab_size=c["vocab_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
                num_kv_heads=c.get("num_key_value_heads") or heads, embed_dim=c["hidden_size"],
                max_seq_len=c.get("max_position_embeddings", 4096), rope_base=float(theta),
                intermediate_dim=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-5),
                tied=bool(c.get("tie_word_embeddings", False)), rope_scaling=scaling,
                head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                bias=bool(c.get("attention_bias") or c.get("mlp_bias")),
                act=c.get("hidden_act", "silu"))


def _refused(builder: str, c: dict) -> str | None:
    if builder not in BUILDERS:
        return f"builder '{builder}': one of {', '.join(BUILDERS)}"
    if c["head_dim"] * c["num_heads"] != c["embed_dim"]:
        return (f"head_dim {c['head_dim']} is not hidden_size / num_attention_heads "
                f"({c['embed_dim']} / {c['num_heads']}): torchtune's Llama builders compute it")
    if c["bias"]:
        return "attention_bias / mlp_bias: torchtune's Llama builders have no biases"
    if c["act"] != "silu":
        return f"hidden_act '{c['act']}': torchtune's Llama MLP is SiLU-gated"
    if builder == "llama3" and c["rope_scaling"]:
        return (f"config.json has RoPE scaling {c['rope_scaling']}; torchtune's llama3 builder has none (its "
                "llama3_2 builder hard-codes Llama 3.1's: builder='llama3_2', knowing it is that one)")
    return None


def load_state(folder, dtype):
    """The folder's safetensors (every file, merged, as torchtune's checkpointer merges them) at
    `dtype` (the checkpoint's values, not a cast of a rounded copy)."""
    import torch  # torch: slow import; compare loads without it
    from safetensors import safe_open  # lazy: with torch, only for torch ports

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files (torchtune's HF checkpointer reads those)")
    state = {}
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                state[k] = t.to(getattr(torch, dtype)) if t.is_floating_point() else t
    return state


def load_model(folder, dtype: str = "float32", builder: str = "llama3"):
    """torchtune's TransformerDecoder for the folder (see the module docstring): built with its
    builder under set_default_dtype, weights through hf_to_tune, load_state_dict strict."""
    import torch  # torch: slow import; compare loads without it

    # torchtune: optional (torchao 0.11 for its nf4tensor import) and slow to import
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama3 import llama3
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.modules import TiedLinear, TransformerDecoder
    from torchtune.training import set_default_dtype

    c = read_config(folder)
    why = _refused(builder, c)
    if why:
        raise ValueError(f"TorchtuneLlama({folder}): {why}")
    args = {k: c[k] for k in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "embed_dim", "max_seq_len",
                              "rope_base", "intermediate_dim", "norm_eps")}
    with set_default_dtype(getattr(torch, dtype)):
        if builder == "llama3":
            model = llama3(**args)
            if c["tied"]:       # the decoder its llama3_2 builder makes: output = TiedLinear(embedding)
                model = TransformerDecoder(tok_embeddings=model.tok_embeddings, layers=model.layers,
                                           max_seq_len=c["max_seq_len"], num_heads=c["num_heads"],
                                           head_dim=c["head_dim"], norm=model.norm,
                                           output=TiedLinear(model.tok_embeddings))
        else:
            model = llama3_2(**args, tie_word_embeddings=c["tied"])
    state = hf_to_tune(load_state(folder, dtype), num_heads=c["num_heads"], num_kv_heads=c["num_kv_heads"],
                       dim=c["embed_dim"], head_dim=c["head_dim"])
    if c["tied"] and "output.weight" in state:     # a tied checkpoint that also stores lm_head
        if not torch.equal(state["output.weight"], state["tok_embeddings.weight"]):
            raise ValueError(f"{folder}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
        del state["output.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


# ----- how the batch reaches torchtune's forward (padding=) ---------------------------------------

def _forward_mask(module, ids, mask, positions):
    import torch  # torch: loaded (the arguments are tensors)
    T = ids.shape[1]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=ids.device))
    allowed = (causal & mask.bool()[:, None, :]) | torch.eye(T, dtype=torch.bool, device=ids.device)
    return module(ids, mask=allowed, input_pos=positions)


def _forward_torchtune(module, ids, mask, positions):
    # torchtune: loaded with the module
    from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask
    pad = mask.bool()
    return module(ids, mask=get_causal_mask_from_padding_mask(pad), input_pos=get_position_ids_from_padding_mask(pad))


def _forward_positions(module, ids, mask, positions):
    return module(ids, input_pos=positions)


def _forward_none(module, ids, mask, positions):
    return module(ids)


FORWARDS = {"mask": _forward_mask, "torchtune": _forward_torchtune, "positions": _forward_positions,
            "none": _forward_none}


class TorchtuneLlama(PortBase):
    """torchtune's Llama loaded from a Hugging Face folder (see the module docstring)."""

    package = "torchtune"
    keeps_f32 = True

    def __init__(self, folder, policy="fp32", padding: str = "mask", builder: str = "llama3", module=None):
        if padding not in PADDINGS:
            raise ValueError(f"padding '{padding}': one of {', '.join(PADDINGS)}")
        if builder not in BUILDERS:
            raise ValueError(f"builder '{builder}': one of {', '.join(BUILDERS)}")
        self.folder, self.padding, self.builder = folder, padding, builder
        self.dtype = port_dtype(policy)
        self.module = module if module is not None else load_model(folder, self.dtype, builder)
        self.name = f"torchtune.{builder}[{self.dtype}" + (f",padding={padding}]" if padding != "mask" else "]")
        cfg = self.config
        taps = dict(TORCHTUNE_TAPS)
        if not hasattr(self.module.output, "parameters"):      # TiedLinear: not a Module; its .linear is
            taps["logits"] = "output.linear"
        self.torch_module = TorchModule(self.module, taps, self.name, FORWARDS[padding],
                                        num_layers=cfg.num_hidden_layers, inject_map="layers.{i}",
                                        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, keeps_f32=True)
        self.taps = self.torch_module.taps
        self._order = hf_order(cfg.head_dim)

    @property
    def config(self) -> PortConfig:
        """The architecture as torchtune's modules hold it: layer 0's attention and norms, the
        RoPE module's base; tied when the output is the embedding's TiedLinear or holds its values."""
        import torch  # torch: slow import; compare loads without it
        m = self.module
        attn = m.layers[0].attn
        out = m.output
        tied = (getattr(out, "tied_module", None) is m.tok_embeddings
                or bool(torch.equal(out.weight, m.tok_embeddings.weight)))
        return PortConfig(
            vocab_size=m.tok_embeddings.num_embeddings, hidden_size=m.tok_embeddings.embedding_dim,
            intermediate_size=m.layers[0].mlp.w1.out_features, num_hidden_layers=len(m.layers),
            num_attention_heads=attn.num_heads, num_key_value_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            rms_norm_eps=float(m.layers[0].sa_norm.eps), tie_word_embeddings=tied,
            rope_theta=float(attn.pos_embeddings.base))

    def float64(self) -> "TorchtuneLlama":
        return TorchtuneLlama(self.folder, "fp64", self.padding, self.builder,
                              module=load_model(self.folder, "float64", self.builder))

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        logits, acts = self.torch_module.capture(tokens, attention_mask, wanted, inject)
        for tap in wanted:
            if tapnames.parse(tap)[1] in INTERLEAVED:
                acts[tap] = acts[tap][..., self._order]
        return self.finish(logits, acts, wanted)


__all__ = ["BUILDERS", "PADDINGS", "TORCHTUNE_TAPS", "TorchtuneLlama", "hf_order", "load_model", "read_config"]
