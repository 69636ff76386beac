"""torchref: a plain, readable PyTorch Llama on Hugging Face-layout checkpoints.

    m = torchref.from_pretrained("path/to/hf-folder", policy="fp32")
    logits = m(tokens, attention_mask=mask)
    new_ids = m.generate(tokens, attention_mask=mask, max_new_tokens=32)
"""

from .model import LlamaModel, from_pretrained, from_weights

__all__ = ["LlamaModel", "from_pretrained", "from_weights"]
