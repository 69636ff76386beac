"""Ready adapters for third-party Llama ports, each loading a Hugging Face folder:

    KerasHubLlama(folder, policy)    keras-hub Llama3Backbone, Keras 3 on JAX  (ports.keras_hub)
    PenzaiLlama(folder, policy)      penzai llamalike from a transformers model  (ports.penzai)
    LitGPTLlama(folder, policy)      litgpt GPT through its converter, PyTorch  (ports.litgpt)
    TorchtuneLlama(folder, policy)   torchtune's Llama builders through its hf_to_tune  (ports.torchtune)
    TransformerLensLlama(folder, policy)  TransformerLens' TransformerBridge  (ports.transformer_lens)
    NnsightLlama(folder, policy)     nnsight's traced transformers model  (ports.nnsight)

Each follows the Implementation protocol (name, taps, capture, supports_inject, float64,
config as the port uses it). Importing this package imports none of the ports: each class
is loaded when first asked for. docs/ports.md says how to install them side by side.
"""

from __future__ import annotations

import importlib

_WHERE = {"KerasHubLlama": "keras_hub", "PenzaiLlama": "penzai", "LitGPTLlama": "litgpt",
          "TorchtuneLlama": "torchtune", "TransformerLensLlama": "transformer_lens", "NnsightLlama": "nnsight"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_WHERE)
