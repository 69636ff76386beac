"""compare.adapters.transformers: taps on a transformers LlamaForCausalLM mean what torchref's mean.

The peer is torchref at policy fp64-hf (transformers' f32 norm/RoPE/softmax islands
inside an f64 run) against transformers at float64 with eager attention, the pair that
is bitwise equal on logits.
"""

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torchref  # noqa: E402
from compare.adapters.transformers import (  # noqa: E402
    EAGER_F64_LEFT_PADDING,
    TransformersModel,  # noqa: E402
    copy_at,
    forcing_hook,
)
from compare.metrics import rel_l2  # noqa: E402
from llamaspec import InputError, Policy  # noqa: E402
from llamaspec import taps as tapnames  # noqa: E402

TOL = 1e-12


def hf_model(folder, dtype=torch.float64, attn="eager"):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype,
                                                         attn_implementation=attn).eval()


def batch(kind, B=3, T=12, seed=0):
    """Rows: full, then padded ('left' or 'right') by 4 slots, then padded by 2."""
    ids = np.random.default_rng(seed).integers(3, 96, (B, T))
    mask = np.ones((B, T), np.int64)
    for row, n in ((1, 4), (2, 2)):
        if kind == "left":
            mask[row, :n] = 0
        elif kind == "right":
            mask[row, T - n:] = 0
    return ids, mask


def worst(acts, ref, mask):
    """{tap: rel L2 on real positions}; NaN propagates (never masked)."""
    real = np.asarray(mask, bool)
    return {k: rel_l2(acts[k][real], ref[k][real]) for k in acts}


def all_hooks(model):
    return {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._forward_hooks_with_kwargs),
                   dict(m._forward_pre_hooks_with_kwargs), dict(m._backward_hooks))
            for name, m in model.named_modules()}


# ----- 1. every available tap means what torchref's does ---------------------------------

@pytest.mark.parametrize("config", ["gqa", "bias_head_dim"])
@pytest.mark.parametrize("attn,padding", [("eager", "right"), ("sdpa", "left")])
def test_taps_match_torchref(config, attn, padding, tiny_dir):
    """Every available tap, same name, shape and meaning as torchref's, to f64 rounding.

    eager is the bitwise peer of fp64-hf. Left padding runs on sdpa: transformers' eager
    attention at float64 gives NaN for left-padding rows (test below); sdpa keeps the
    softmax in float64, so the peer is fp64-hf with a float64 softmax.
    """
    folder = (tiny_dir("gqa") if config == "gqa"
              else tiny_dir("bias", head_dim=16))
    adapter = TransformersModel(hf_model(folder, attn=attn))
    policy = Policy.get("fp64-hf") if attn == "eager" else Policy.get("fp64-hf", softmax_dtype="float64")
    ids, mask = batch(padding)
    logits, acts = adapter.capture(ids, mask, taps="*")
    ref_logits, ref = torchref.from_pretrained(folder, policy=policy).capture(ids, mask, taps=list(acts))
    assert tuple(acts) == adapter.taps
    assert {k: v.shape for k, v in acts.items()} == {k: v.shape for k, v in ref.items()}
    errs = worst({**acts, "returned logits": logits}, {**ref, "returned logits": ref_logits}, mask)
    print(f"\nMEASURED {config}/{attn}/{padding}-padded: max rel L2 over {len(errs)} taps = "
          f"{max(errs.values()):.2e} ({max(errs, key=errs.get)})")
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, f"taps off torchref fp64-hf: {bad}"


def test_eager_float64_left_padding_nan_is_reported(tiny_dir):
    """transformers 5.24 eager at float64: NaN on a left-padded row. The adapter passes it
    through (NaN is never masked) and says why; an sdpa copy has none."""
    model = hf_model(tiny_dir("gqa"))
    ids, mask = batch("left")
    with pytest.warns(RuntimeWarning) as record:
        logits, _ = TransformersModel(model).capture(ids, mask, taps="logits")
    if not np.isnan(logits).any():  # fixed upstream: then no warning either
        assert not [w for w in record if str(w.message) == EAGER_F64_LEFT_PADDING]
        pytest.skip("this transformers version no longer produces NaN here")
    assert any(str(w.message) == EAGER_F64_LEFT_PADDING for w in record)
    assert np.isnan(logits[1]).all() and not np.isnan(logits[0]).any()
    sdpa = copy_at(model, torch.float64, attn_implementation="sdpa")
    assert model.config._attn_implementation == "eager"
    assert not np.isnan(TransformersModel(sdpa).capture(ids, mask, taps=())[0]).any()


# ----- 2. teacher forcing -----------------------------------------------------------------

def test_inject_replaces_every_layer_input(tiny_dir):
    folder = tiny_dir("gqa", num_hidden_layers=3)
    adapter = TransformersModel(hf_model(folder))
    ids, mask = batch("right")
    _, ref = torchref.from_pretrained(folder, policy="fp64-hf").capture(ids, mask, taps=["embed", "layers.*.out"])
    inject = {0: ref["embed"], **{i: ref[f"layers.{i - 1}.out"] for i in range(1, 3)}}
    _, forced = adapter.capture(ids, mask, taps="layers.*.out", inject=inject)
    errs = worst(forced, {k: ref[k] for k in forced}, mask)
    print(f"\nMEASURED teacher-forced layer outputs vs torchref fp64-hf: {errs}")
    assert all(e <= TOL for e in errs.values()), errs

    # Each forced layer gets its given input, not what the previous layer produced:
    # forcing layer 1 with a perturbed input changes layers 1.. and leaves layer 0 bitwise.
    _, plain = adapter.capture(ids, mask, taps="layers.*.out")
    _, bumped = adapter.capture(ids, mask, taps="layers.*.out", inject={1: plain["layers.0.out"] * 1.01})
    assert np.array_equal(bumped["layers.0.out"], plain["layers.0.out"])
    for i in (1, 2):
        assert not np.allclose(bumped[f"layers.{i}.out"], plain[f"layers.{i}.out"])
    # Forcing layer 1 with a perturbed input and layer 2 with the plain one: layer 2 is
    # then the plain run's again, bitwise.
    _, both = adapter.capture(ids, mask, taps="layers.*.out",
                              inject={1: plain["layers.0.out"] * 1.01, 2: plain["layers.1.out"]})
    assert np.array_equal(both["layers.2.out"], plain["layers.2.out"])

    with pytest.raises(InputError, match="inject: layer 5"):
        adapter.capture(ids, mask, inject={5: ref["embed"]})
    with pytest.raises(InputError, match=r"inject\[0\]: shape"):
        adapter.capture(ids, mask, inject={0: ref["embed"][:, :3]})


def test_forcing_hook_handles_keyword_hidden_states(tiny_dir):
    """LlamaModel passes hidden_states positionally; the hook also takes the keyword form."""
    model = hf_model(tiny_dir("gqa"))
    layer = model.model.layers[0]
    # f32-representable values: handing the hook an f32 copy tests the cast to f64 too.
    h = torch.randn(1, 5, model.config.hidden_size, dtype=torch.float32).to(torch.float64)
    pos = torch.arange(5)[None]
    rope = model.model.rotary_emb(h, position_ids=pos)
    with torch.no_grad():
        direct = layer(h, position_embeddings=rope, position_ids=pos)
        handle = layer.register_forward_pre_hook(forcing_hook(h.to(torch.float32)), with_kwargs=True)
        try:
            via_kw = layer(hidden_states=torch.zeros_like(h), position_embeddings=rope, position_ids=pos)
            via_pos = layer(torch.zeros_like(h), position_embeddings=rope, position_ids=pos)
        finally:
            handle.remove()
    assert torch.equal(via_kw, direct) and torch.equal(via_pos, direct)


# ----- 3. the model is left as given; names, errors, dtypes ------------------------------

def test_hooks_removed_and_model_untouched(tiny_dir):
    model = hf_model(tiny_dir("gqa"))
    ids, mask = batch("right")
    with torch.no_grad():  # installs transformers' own output-capturing hooks: they must stay
        model(torch.from_numpy(ids), output_hidden_states=True)
    before = all_hooks(model)
    assert any(any(h) for h in before.values())
    adapter = TransformersModel(model)
    adapter.capture(ids, mask, taps="*", inject={1: np.zeros((3, 12, 32))})
    assert all_hooks(model) == before
    # ...also when the forward raises midway.
    boom = model.model.norm.register_forward_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        adapter.capture(ids, mask, taps="*", inject={0: np.zeros((3, 12, 32))})
    boom.remove()
    assert all_hooks(model) == before
    # A fresh model has no hooks at all before or after.
    fresh = hf_model(tiny_dir("gqa"))
    TransformersModel(fresh).capture(ids, mask, taps="*")
    assert not any(any(h) for h in all_hooks(fresh).values())


def test_copy_at_leaves_the_user_model(tiny_dir):
    folder = tiny_dir("gqa", dtype="bfloat16")
    model = hf_model(folder, dtype=torch.bfloat16)
    twin = TransformersModel(model).float64()
    assert twin.model is not model and twin.dtype == torch.float64
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.dtype == torch.bfloat16 and model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # Widening bf16 weights is exact: the copy computes what a float64 load computes.
    ids, mask = batch("right")
    # the copy runs padded rows alone on their real tokens (padding slots hold 0); so does this
    loaded = TransformersModel(hf_model(folder, dtype=torch.float64), unpadded_rows=True).capture(ids, mask)
    copied = twin.capture(ids, mask)
    real = mask.astype(bool)
    assert np.array_equal(loaded[0][real], copied[0][real])
    assert all(np.array_equal(loaded[1][k][real], copied[1][k][real]) for k in loaded[1])
    assert not copied[0][~real].any()


def test_bf16_taps_stay_bf16(tiny_dir):
    model = hf_model(tiny_dir("gqa", dtype="bfloat16"), dtype=torch.bfloat16)
    logits, acts = TransformersModel(model).capture(*batch("left"), taps="*")
    assert logits.dtype == ml_dtypes.bfloat16
    assert {a.dtype for a in acts.values()} == {np.dtype(ml_dtypes.bfloat16)}


def test_tap_names_every_tap_available(tiny_dir):
    adapter = TransformersModel(hf_model(tiny_dir("gqa")))
    assert adapter.num_layers == 2 and adapter.name == "transformers[eager, float64]"
    assert adapter.unavailable_taps == {} and adapter.taps == tuple(tapnames.all_taps(2))
    ids, mask = batch("right")
    with pytest.raises(KeyError, match="unknown tap"):
        adapter.capture(ids, mask, taps="layers.0.qq")
    # Globs expand over what is available, in execution order.
    assert adapter.resolve("layers.1.*") == tuple(f"layers.1.{t}" for t in tapnames.LAYER_TAPS)
    assert adapter.resolve(["logits", "embed", "layers.0.q"]) == ("embed", "layers.0.q", "logits")
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        TransformersModel(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("side", ["left", "right"])
def test_rope_taps_are_the_models_own_rotation(tiny_dir, side):
    """q_rope/k_rope are recomputed from q_proj/k_proj's output and rotary_emb's cos/sin
    with the model's apply_rotary_pos_emb: equal to torchref's at fp32 (the same
    elementwise arithmetic), and a RoPE table changed inside the model (rotary_emb
    patched: angles in bf16) shows in them while q and k stay bitwise the same."""
    folder = tiny_dir("gqa")
    model = hf_model(folder, dtype=torch.float32)
    ids, mask = batch(side)
    taps = ["layers.0.q", "layers.0.q_rope", "layers.1.k_rope"]
    _, acts = TransformersModel(model).capture(ids, mask, taps=taps)
    _, ours = torchref.from_pretrained(folder, policy="fp32").capture(ids, mask, taps)
    real = mask.astype(bool)
    for t in taps:
        assert acts[t].shape == ours[t].shape and np.array_equal(acts[t][real], ours[t][real]), t
    rotary = model.model.rotary_emb

    def bf16_angles(x, position_ids):
        freqs = position_ids[..., None].to(torch.bfloat16) * rotary.inv_freq.to(torch.bfloat16)
        emb = torch.cat((freqs, freqs), dim=-1).float()
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rotary.forward = bf16_angles
    _, bad = TransformersModel(model).capture(ids, mask, taps=taps)
    assert np.array_equal(bad["layers.0.q"], acts["layers.0.q"])
    assert not np.array_equal(bad["layers.0.q_rope"][real], acts["layers.0.q_rope"][real])
