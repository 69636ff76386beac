"""Planted cache bugs on the decode path (positive controls for compare.ladder.decode).

Each DecodeControl patches one cache bug into layer LAYER of torchref (on its Attention's
cache seams: write_slots, cache_allowed, key_tables, stored) or of a transformers
LlamaForCausalLM (through its own DynamicCache), at P and in the float64 twin, and says at
which step, tap and component the decode comparison must find it. tests/test_decode.py
asserts them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llamaspec import Policy
from llamaspec import taps as tapnames

from ..adapters import OurModel, Side, resolve_side
from ..ladder.decode import DecodeReport, run_decode
from .prefill import findings_after, hf_side

LAYER = 1


@dataclasses.dataclass
class DecodeControl:
    name: str
    what: str
    patch: object = dataclasses.field(repr=False)   # (torchref LlamaModel) -> None, at P and fp64
    tap: str = "layers.1.attn_ctx"
    component: str = "attn"
    # the first divergent step, given the prompt's width T
    step: object = dataclasses.field(repr=False, default=lambda T: 1)
    verdict: str | None = "semantic"     # None: informational, reported but not asserted
    hint: str = "decode path is wrong"     # words the first divergence's hint must contain
    where: str = "torchref"     # or "transformers": patch(LlamaForCausalLM) on an eager model

    def side(self, folder, policy) -> Side:
        if self.where == "transformers":
            side = hf_side(self.patch, Policy.get(policy).param_dtype)(folder, policy)
            side.name = side.name.removesuffix("+bug") + f"+{self.name}"
            return side
        import torchref  # torchref imports torch: the jaxmodel controls run without it
        at_p = torchref.from_pretrained(folder, policy=policy)
        at_64 = torchref.from_pretrained(folder, policy="fp64")
        for m in (at_p, at_64):
            self.patch(m)
        return Side(f"torchref+{self.name}", OurModel(at_p), OurModel(at_64), False,
                    tuple(tapnames.all_taps(at_p.cfg)))


def _cache_bug(slot=None, hide_newest=False, key_shift=0, store=None):
    """A cache bug planted on the seams of layer LAYER's torchref Attention, on decode steps
    (one new position): slot(index [B], S) -> the slot the new key/value is written to;
    hide_newest: the mask over the cache misses the slot just written; key_shift: the new key
    is rotated at its position + key_shift; store: keys and values are rounded to this dtype
    when cached (prefill too: a cache kept in bf16 whatever the policy)."""
    def patch(m):
        import torch  # torch: slow import; the jaxmodel controls run without it

        from torchref.model import rope_tables
        attn = m.model.layers[LAYER].self_attn
        own_slots, own_tables = attn.write_slots, attn.key_tables

        def write_slots(index, T, S):
            return slot(index, S)[:, None] if T == 1 else own_slots(index, T, S)

        def cache_allowed(allowed, index):
            if allowed.shape[1] != 1:
                return allowed
            newest = torch.arange(allowed.shape[-1], device=allowed.device)[None, :] == index[:, None]
            return allowed & ~newest[:, None, :]

        def key_tables(ctx, cache):
            if cache is None or ctx.cos.shape[1] != 1:
                return own_tables(ctx, cache)
            return rope_tables(m.cfg, ctx.policy, attn.ops, ctx.positions + key_shift)

        if slot is not None:
            attn.write_slots = write_slots
        if hide_newest:
            attn.cache_allowed = cache_allowed
        if key_shift:
            attn.key_tables = key_tables
        if store is not None:
            attn.stored = lambda x: x.to(getattr(torch, store)).to(x.dtype)
    return patch


def _on_decode_steps(change):
    """transformers: a forward pre-hook on layer LAYER's decoder layer that lets
    change(module, kwargs) edit its keyword arguments on decode steps (one new position)
    only; the float64 copy (a deep copy) keeps the hook, so it carries the bug too."""
    def patch(hf):
        def pre(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[1] == 1 and kwargs.get("cache") is not None:
                change(module, kwargs)
            return args, kwargs
        hf.model.layers[LAYER].register_forward_pre_hook(pre, with_kwargs=True)
    return patch


def _hf_hide_newest(module, kwargs):
    mask = kwargs["attention_mask"].clone()
    mask[..., -1] = mask.new_tensor(float("-inf") if mask.dtype.is_floating_point else False)
    kwargs["attention_mask"] = mask


def _hf_positions_plus_one(rotary):
    def change(module, kwargs):
        pos = kwargs["position_ids"] + 1
        cos, _ = kwargs["position_embeddings"]
        kwargs["position_embeddings"] = rotary(cos, pos)
    return change


def _hf_decode_positions_plus_one(hf):
    _on_decode_steps(_hf_positions_plus_one(hf.model.rotary_emb))(hf)


def _wrapping(slots: int):
    """A cache that wraps after `slots` slots (a ring buffer sized for the prompt): the
    first `slots` writes are right, later ones overwrite slot index - slots."""
    return lambda index, S: index % slots


LATE_SLOTS = 4      # the wrapping control: right for the prompt and this many decode steps


DECODE_CONTROLS: dict[str, DecodeControl] = {c.name: c for c in [
    DecodeControl("write_slot_off_by_one", "decode writes the new key/value one slot late (index + 1)",
                  _cache_bug(slot=lambda index, S: _clamp(index + 1, S - 1))),
    DecodeControl("stale_mask", "the mask over the cache misses the slot just written (updated after the step)",
                  _cache_bug(hide_newest=True)),
    DecodeControl("key_position_off_by_one", "the new key is rotated at position + 1 (the position counter "
                  "advanced before the key is cached)", _cache_bug(key_shift=1), tap="layers.1.k_rope"),
    # Informational (verdict None: reported, not asserted). Not a bug in the math: a cache
    # kept in bf16 (in the float64 run too) rounds from step 1 on and should read as
    # precision. The dtype-noise test sees one row per step, too few values: measured, it
    # says precision at 6 of 8 steps on SmolLM2 and semantic ("no simple structure") at 2.
    DecodeControl("cache_in_bf16", "keys and values rounded to bfloat16 when cached, whatever the policy",
                  _cache_bug(store="bfloat16"), verdict=None,
                  hint="layer 1's attention computes at about bfloat16 precision even in the float64 run"),
    # transformers LlamaForCausalLM (eager), through its own DynamicCache, patched on decode steps
    DecodeControl("hf_stale_mask", "transformers: layer 1's attention mask over the cache misses the newest "
                  "slot on decode steps", _on_decode_steps(_hf_hide_newest), where="transformers"),
    # seen at q_rope: the transformers adapter rotates q/k with the tables each layer's
    # self_attn is called with (here the hooked ones), so the first tap that differs is RoPE's
    DecodeControl("hf_decode_positions_off_by_one", "transformers: layer 1 rotates the decode step's query and key "
                  "at position + 1", _hf_decode_positions_plus_one, tap="layers.1.q_rope", where="transformers"),
    DecodeControl("cache_wraps", f"the cache wraps after the prompt + {LATE_SLOTS} slots (a ring buffer sized for "
                  "the prompt): later writes overwrite the oldest slot", None,
                  step=lambda T: LATE_SLOTS + 1),
]}


def _clamp(a, top: int):
    import torch  # torch: slow import; the jaxmodel controls run without it
    return torch.clamp(a, max=top)


def control_side(control: DecodeControl, folder, policy, prompt_width: int) -> Side:
    """The candidate Side of a control (the wrapping one is sized from the prompt)."""
    if control.patch is None:
        control = dataclasses.replace(control, patch=_cache_bug(slot=_wrapping(prompt_width + LATE_SLOTS)))
    return control.side(folder, Policy.get(policy))


def run_decode_control(control: DecodeControl, folder, ids, mask=None, steps: int = 8,
                       policy="fp32") -> DecodeReport:
    """The control's buggy torchref against clean torchref, decoding `steps` tokens."""
    mask = np.ones(np.shape(ids), np.int64) if mask is None else mask
    policy = Policy.get(policy)
    ref = resolve_side("torchref", folder, policy)
    return run_decode(ref, control_side(control, folder, policy, np.shape(ids)[1]), ids, mask, policy, steps,
                      slack=1)


def check_decode(control: DecodeControl, report: DecodeReport) -> list[str]:
    """What is wrong with the report for this control ([] = as expected)."""
    if control.verdict is None:
        return []
    want = (control.step(report.prompt_tokens), control.tap, tapnames.layer_of(control.tap), control.component)
    if report.verdict != control.verdict or report.first_divergence is None:
        return [f"verdict {report.verdict}, expected {control.verdict}: {report.summary()}"]
    d = report.first_divergence
    got = (report.first_step, d.tap, d.layer, d.component)
    problems = [] if got == want else [f"found at (step, tap, layer, component) {got}, expected {want}"]
    if control.hint not in d.hint:
        problems.append(f"hint lacks '{control.hint}': {d.hint}")
    lone = findings_after(report)
    if lone:
        problems.append(f"findings after the first divergence that teacher forcing did not judge: {lone}")
    return problems
