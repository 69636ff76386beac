"""litgpt's GPT (PyTorch) under the Implementation protocol, on generic.TorchModule.

    port = LitGPTLlama(folder, policy="fp32")                 # config from litgpt's table by folder name
    port = LitGPTLlama(folder, model_name="SmolLM2-135M-Instruct")
    port = LitGPTLlama(folder, litgpt_config={...})           # a config litgpt's table lacks

Loaded as its users load it: litgpt's convert_hf_checkpoint turns the folder's safetensors
into lit_model.pth with litgpt's own key map, and the config comes from litgpt's name
table (config.json is not read: the `config` this adapter states is litgpt's). The
converter writes into the folder it converts, so it runs on a temporary folder of links to
the checkpoint's files, named as the model is; the checkpoint folder is left untouched.

Taps (forward hooks, TorchModule's map): every vocabulary tap except q, k, v, q_rope and
k_rope: litgpt projects q, k and v with one fused `qkv` Linear and rotates them inside
CausalSelfAttention.forward, with no module boundary to hook.

litgpt's forward takes no attention mask (causal only): a batch with padding is captured
one row at a time on its real tokens (padding slots hold 0), which puts every real token
at position cumsum(mask) - 1, the protocol's convention. inject {layer: hidden} replaces
block i's input (a forward pre-hook).

float64(): TorchModule's deep copy cast to float64. litgpt keeps f32 steps inside it
(RMSNorm computes in x.float(), the RoPE cache is built in float32), so the twin says
keeps_f32=True and agrees with a true float64 run to float32's rounding, not 1e-12.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

from ..generic import TorchModule
from .common import PortBase, PortConfig, by_rows, port_dtype

LITGPT_TAPS = {
    "embed": "transformer.wte",
    "layers.{i}.attn_norm": "transformer.h.{i}.norm_1",
    "layers.{i}.attn_ctx": "pre:transformer.h.{i}.attn.proj",
    "layers.{i}.attn_out": "transformer.h.{i}.attn",
    "layers.{i}.resid_mid": "pre:transformer.h.{i}.norm_2",
    "layers.{i}.mlp_norm": "transformer.h.{i}.norm_2",
    "layers.{i}.gate": "transformer.h.{i}.mlp.fc_1",
    "layers.{i}.up": "transformer.h.{i}.mlp.fc_2",
    "layers.{i}.act": "pre:transformer.h.{i}.mlp.proj",
    "layers.{i}.mlp_out": "transformer.h.{i}.mlp",
    "layers.{i}.out": "transformer.h.{i}",
    "final_norm": "transformer.ln_f",
    "logits": "lm_head",
}


def _forward(module, ids, mask, positions):
    return module(ids)


def load_gpt(folder, model_name: str | None = None, litgpt_config: dict | None = None):
    """litgpt's GPT with the folder's weights, converted by litgpt's convert_hf_checkpoint
    (on a temporary folder of links; see the module docstring)."""
    # litgpt, torch: optional (the ports extra) and slow imports
    import torch
    from litgpt import GPT, Config
    from litgpt.config import name_to_config
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    folder = Path(folder)
    name = model_name or (litgpt_config or {}).get("name") or folder.name
    if litgpt_config is not None:
        name_to_config[name] = {**litgpt_config, "name": name}
    elif name not in name_to_config:
        raise ValueError(f"litgpt has no config named '{name}' (it picks one by the folder's name; config.json is "
                         "not read): pass model_name= one of litgpt's names, or litgpt_config=")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / name
        work.mkdir()
        for f in folder.iterdir():
            if f.suffix in (".json", ".safetensors", ".bin"):
                os.symlink(f.resolve(), work / f.name)
        with contextlib.redirect_stdout(io.StringIO()):     # it pprints its arguments
            convert_hf_checkpoint(work, model_name=name)
        state = torch.load(work / "lit_model.pth", map_location="cpu", weights_only=True)
    config = Config.from_name(name)
    model = GPT(config)
    model.load_state_dict(state)
    return model.eval()


class LitGPTLlama(PortBase):
    """litgpt GPT loaded from a Hugging Face folder (see the module docstring)."""

    package = "litgpt"

    def __init__(self, folder, policy="fp32", model_name: str | None = None, litgpt_config: dict | None = None,
                 module=None):
        import torch  # torch: slow import; compare loads without it
        self.folder, self.model_name, self.litgpt_config = folder, model_name, litgpt_config
        self.dtype = port_dtype(policy)
        if module is None:
            module = load_gpt(folder, model_name, litgpt_config).to(getattr(torch, self.dtype))
        self.module = module
        self.keeps_f32 = True
        self.name = f"litgpt[{self.dtype}]"
        c = module.config
        self.torch_module = TorchModule(module, LITGPT_TAPS, self.name, _forward, num_layers=c.n_layer,
                                        head_dim=c.head_size, vocab_size=c.padded_vocab_size, keeps_f32=True)
        self.taps = self.torch_module.taps

    @property
    def config(self) -> PortConfig:
        """litgpt's config (from its table), the epsilon its first norm holds; tied when the
        head holds the embedding's values."""
        import torch  # torch: slow import; compare loads without it
        c = self.module.config
        return PortConfig(
            vocab_size=c.padded_vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_query_groups,
            head_dim=c.head_size, rms_norm_eps=float(self.module.transformer.h[0].norm_1.eps),
            tie_word_embeddings=bool(torch.equal(self.module.lm_head.weight, self.module.transformer.wte.weight)),
            rope_theta=float(c.rope_base))

    def float64(self) -> "LitGPTLlama":
        import torch  # torch: slow import; compare loads without it
        twin = load_gpt(self.folder, self.model_name, self.litgpt_config).to(torch.float64)
        return LitGPTLlama(self.folder, "fp64", self.model_name, self.litgpt_config, module=twin)

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        ids, mask, _ = self.inputs(tokens, attention_mask)
        forced = self.forced(inject, ids.shape)
        logits, acts = by_rows(lambda row_ids, row_forced: self.torch_module.capture(row_ids, None, wanted,
                                                                                   row_forced or None),
                               ids, mask, forced)
        return self.finish(logits, acts, wanted)


__all__ = ["LITGPT_TAPS", "LitGPTLlama", "load_gpt"]
