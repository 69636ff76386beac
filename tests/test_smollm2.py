"""Acceptance checks on the real SmolLM2-135M-Instruct weights (marked `smollm2`).

Skipped with a reason when the weights are not cached; the README's test command
fetches them first. Each test prints its measured numbers (run with -s to see them).
"""

import numpy as np
import pytest
import torch

import jaxmodel
import torchref
from compare.metrics import rel_l2
from llamaspec.generate import until_eos

pytestmark = pytest.mark.smollm2

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for learning to code.",
    "Why is the sky blue? Answer in one sentence.",
    "List the first five prime numbers.",
]


@pytest.fixture(scope="module")
def long_prompt(smollm2):
    """A 256-token prompt of real text (the tokenizer's own chat rendering, repeated)."""
    from llamaspec.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(smollm2)
    ids = []
    for p in PROMPTS * 8:
        ids += tok.encode_chat(p)
    return np.array([ids[:256]])


@pytest.fixture(scope="module")
def hf64(smollm2):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float64,
                                                         attn_implementation="eager").eval()


def hf_run(hf, ids, mask=None):
    with torch.no_grad():
        m = None if mask is None else torch.from_numpy(mask)
        return hf(torch.from_numpy(ids), attention_mask=m).logits.numpy()


def test_fp64_torchref_equals_jaxmodel(smollm2, long_prompt):
    a = np.asarray(torchref.from_pretrained(smollm2, policy="fp64")(long_prompt))
    b = np.asarray(jaxmodel.from_pretrained(smollm2, policy="fp64")(long_prompt))
    err = rel_l2(b, a)
    print(f"\nMEASURED smollm2 fp64 jaxmodel vs torchref logits rel L2 = {err:.3e}")
    assert err <= 1e-12


def test_fp64_hf_policy_matches_transformers(smollm2, long_prompt, hf64):
    ref = hf_run(hf64, long_prompt)
    errs = {}
    for name, mod in (("torchref", torchref), ("jaxmodel", jaxmodel)):
        errs[name] = rel_l2(np.asarray(mod.from_pretrained(smollm2, policy="fp64-hf")(long_prompt)), ref)
        print(f"\nMEASURED smollm2 fp64-hf {name} vs transformers fp64 rel L2 = {errs[name]:.3e}")
    assert errs["torchref"] <= 1e-10
    # jaxmodel computes the f32 RoPE/norm/softmax steps with XLA's f32 kernels, which
    # may differ from torch's by an ulp: well under f32 roundoff, far above 1e-10.
    assert errs["jaxmodel"] <= 1e-6


def test_fp32_matches_transformers(smollm2, long_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    ref = hf_run(hf, long_prompt)
    for name, mod in (("torchref", torchref), ("jaxmodel", jaxmodel)):
        out = np.asarray(mod.from_pretrained(smollm2, policy="fp32")(long_prompt))
        diff = float(np.abs(out.astype(np.float64) - ref).max())
        print(f"\nMEASURED smollm2 fp32 {name} vs transformers max abs = {diff:.3e} "
              f"(rel L2 {rel_l2(out, ref):.3e})")
        assert diff <= 1e-3


def test_greedy_fp32_same_tokens_in_all_three(smollm2):
    transformers = pytest.importorskip("transformers")
    from llamaspec.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(smollm2)
    ids, mask = tok.batch_encode(PROMPTS, chat=True, padding_side="left")
    n = 32
    outs = {name: mod.from_pretrained(smollm2, policy="fp32").generate(
        ids, attention_mask=mask, max_new_tokens=n)
        for name, mod in (("torchref", torchref), ("jaxmodel", jaxmodel))}
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        g = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                        max_new_tokens=n, pad_token_id=tok.pad_id)
    outs["transformers"] = g[:, ids.shape[1]:].numpy()
    diffs = []
    for i, p in enumerate(PROMPTS):
        rows = {k: until_eos(v[i], tok.eos_ids) for k, v in outs.items()}
        print(f"\n{p!r} -> {tok.decode(rows['torchref'])!r}")
        for k, v in rows.items():
            if v != rows["torchref"]:
                step = next((s for s, (a, b) in enumerate(zip(v, rows["torchref"])) if a != b),
                            min(len(v), len(rows["torchref"])))
                diffs.append((p, k, step))
    print(f"\nMEASURED smollm2 greedy fp32 {len(PROMPTS)} prompts x {n} tokens: "
          f"{len(diffs)} differing rows {diffs}")
    assert not diffs, f"greedy tokens differ: {diffs}"
