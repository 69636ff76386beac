"""probe where: one implementation in two circumstances, judged tap by tap against its own
float64 twin. Planted controls are built on the models' public seams (each module's .ops
namespace), on the model and on its twin alike, and each must be found at its tap and named;
clean runs must give drift at most in default mode and exact everywhere in invariant mode."""

import types

import numpy as np
import pytest
import torch

import torchref
from compare.adapters import OurModel
from compare.probes.where import BEYOND, judge_tap, pad_fit, probe_where
from compare.probes.where_plan import plan
from compare.probes.where_text import explain_where, hint
from llamaspec import Policy
from torchref import invariant as inv_ops
from torchref import ops

L = 1   # the layer the planted o_proj sits in (tiny checkpoints have 2)


def namespace(base, **override):
    """An ops namespace: every op function of `base`, some replaced."""
    ns = types.SimpleNamespace(**{k: getattr(base, k) for k in dir(base) if not k.startswith("__")})
    for k, v in override.items():
        setattr(ns, k, v)
    return ns


def pair(folder, policy, patch, batch_invariant=False):
    """A torchref model and its float64 twin (the same rounded weights), both patched."""
    model = torchref.from_pretrained(folder, policy=policy, batch_invariant=batch_invariant)
    twin = OurModel(model).float64(rounded_weights=True).model
    patch(model, inv_ops if batch_invariant else ops)
    patch(twin, ops)
    return model, twin


def split_k_o_proj(model, base, layer=L):
    """Layer `layer`'s o_proj sums its inner dimension in two halves when the call has more
    than one row: a product order that depends on the batch (same math)."""
    def linear(x, w, b, policy, out_dtype=None):
        if x.shape[0] == 1:
            return base.linear(x, w, b, policy, out_dtype)
        h = x.shape[-1] // 2
        lo, hi = x.clone(), x.clone()
        lo[..., h:], hi[..., :h] = 0, 0
        return base.linear(lo, w, b, policy, out_dtype) + base.linear(hi, w, None, policy, out_dtype)
    model.model.layers[layer].self_attn.o_proj.ops = namespace(base, linear=linear)


def attends_pads(model, base):
    """Attention masks by slot order only: pad keys before a real query are attended."""
    def attention(q, k, v, allowed, policy):
        T, S = allowed.shape[-2:]
        causal = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
        return base.attention(q, k, v, causal.expand_as(allowed), policy)
    for layer in model.model.layers:
        layer.self_attn.ops = namespace(base, attention=attention)


def slot_positions(model, base):
    """RoPE tables from slot indices instead of the given positions: an offset that depends
    on the padding before a token."""
    def rope_cos_sin(inv_freq, positions, dtype):
        slots = torch.arange(positions.shape[-1]).expand_as(positions)
        return base.rope_cos_sin(inv_freq, slots, dtype)
    model.ops = namespace(base, rope_cos_sin=rope_cos_sin)


def batch_mean_norm(model, base, layer=0):
    """Layer `layer`'s input RMSNorm takes its mean of squares over the whole batch: a row leak."""
    def rms_norm(x, weight, eps, policy):
        h = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        var = h.pow(2).mean((0, -1), keepdim=True)
        return ops.norm_weight((h * torch.rsqrt(var + eps)).to(h.dtype), x, weight, policy)
    model.model.layers[layer].input_layernorm.ops = namespace(base, rms_norm=rms_norm)


def row_shifted_keys(model, base):
    """Attention reads row b's keys and values b slots off (a cache slot that depends on
    the row): row 0 is right, every other row reads the wrong slots."""
    def attention(q, k, v, allowed, policy):
        k = torch.stack([torch.roll(k[b], b, 0) for b in range(k.shape[0])])
        v = torch.stack([torch.roll(v[b], b, 0) for b in range(v.shape[0])])
        return base.attention(q, k, v, allowed, policy)
    for layer in model.model.layers:
        layer.self_attn.ops = namespace(base, attention=attention)


def row_write_slot(layers=None):
    """The decode step writes row b's new key and value b slots early (a cache write slot
    computed per row, wrongly): row 0 is right, every other row overwrites an earlier key and
    attends an empty slot. On torchref's write_slots seam, decode steps only, at `layers`
    (default: every layer)."""
    def patch(model, base):
        for i, layer in enumerate(model.model.layers):
            if layers is not None and i not in layers:
                continue
            attn, own = layer.self_attn, layer.self_attn.write_slots

            def write_slots(index, T, S, own=own):
                if T != 1:
                    return own(index, T, S)
                return torch.clamp(index - torch.arange(len(index), device=index.device), min=0)[:, None]
            attn.write_slots = write_slots
    return patch


def by_name(result, name):
    return next(c for c in result.comparisons if c.name == name)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir("gqa")


# ----- planted controls ------------------------------------------------------------------------

def test_batch_dependent_o_proj_order_is_the_first_difference_and_drift(tiny):
    model, twin = pair(tiny, "fp32", split_k_o_proj, batch_invariant=True)
    r = probe_where(model, "batch", oracle=twin, batch_sizes=(4,), kinds=("equal",))
    assert r.verdict == "drift", explain_where(r)
    for c in r.comparisons:
        fd = c.first_difference
        assert (fd.tap, fd.component, fd.op.name, fd.op.k) == (f"layers.{L}.attn_out", "attn", "o_proj", 32)
        assert fd.before_exact and fd.forced.local and c.first_beyond is None, explain_where(r)
    assert f"layers.{L}.attn_out" in hint(r) and "o_proj" in hint(r)


def test_attending_pad_keys_is_found_at_layer_0_attn_ctx_under_left_padding(tiny):
    model, twin = pair(tiny, "fp32", attends_pads)
    r = probe_where(model, "padding", oracle=twin)
    assert r.verdict == "semantic", explain_where(r)
    for name in ("left padding (+5, pad id)", "left padding (+5, random pad tokens)"):
        c = by_name(r, name)
        fb = c.first_beyond
        assert (fb.tap, fb.op.name, fb.kind) == ("layers.0.attn_ctx", "attention", "semantic"), explain_where(r)
        assert "pad_keys" in c.findings and fb.forced.local is True
        assert fb.position == 0      # the first real position already sees the pads
    # right padding sits after every real query: causal order alone masks it
    assert by_name(r, "right padding (+5, random pad tokens)").first_beyond is None
    assert "pad keys are attended" in hint(r)


def test_a_position_offset_that_depends_on_padding_is_found_at_q_rope(tiny):
    model, twin = pair(tiny, "fp32", slot_positions)
    r = probe_where(model, "padding", oracle=twin)
    left, inner = by_name(r, "left padding (+5, pad id)"), [c for c in r.comparisons if c.group == "interior"][0]
    for c in (left, inner):
        assert c.first_beyond.tap == "layers.0.q_rope" and "positions" in c.findings, explain_where(r)
    # contiguous left padding shifts every position alike: attention sees only differences
    assert "absorbed" in left.findings
    # interior padding shifts only the tokens after the gap: the attention output changes
    ctx = next(d for d in inner.taps if d.tap == "layers.0.attn_ctx")
    assert ctx.kind == "semantic" and "absorbed" not in inner.findings


def test_a_row_leak_in_a_batched_norm_is_found_at_attn_norm(tiny):
    model, twin = pair(tiny, "fp32", batch_mean_norm)
    r = probe_where(model, "batch", oracle=twin, batch_sizes=(4,), kinds=("equal",))
    assert r.verdict == "semantic"
    for c in r.comparisons:
        fb = c.first_beyond
        assert (fb.tap, fb.component, fb.op.name) == ("layers.0.attn_norm", "attn_norm", "input rms_norm")
        assert "rows" in c.findings and fb.before_exact and fb.forced.local
    assert "leak across rows" in hint(r)


def test_a_key_slot_that_depends_on_the_row_is_found_at_attn_ctx_for_rows_after_the_first(tiny):
    model, twin = pair(tiny, "fp32", row_shifted_keys)
    r = probe_where(model, "batch", oracle=twin, batch_sizes=(4,), kinds=("equal",))
    rows = {c.b_row: c for c in r.comparisons}
    assert set(rows) == {0, 2, 3}
    assert rows[0].first_beyond is None, explain_where(r)
    for b in (2, 3):
        assert rows[b].first_beyond.tap == "layers.0.attn_ctx" and "row_position" in rows[b].findings
    assert "row in the batch" in hint(r)


def test_a_cache_write_slot_that_depends_on_the_row_is_found_at_the_first_generated_step(tiny):
    """The decode circumstance: prefill + the first generated step, alone vs in a batch. A
    real KV cache whose write slot is computed per row: row 0 clean, rows 2 and 3 beyond
    drift at layers.0.attn_ctx, named as an index that depends on the row."""
    model, twin = pair(tiny, "fp32", row_write_slot())
    r = probe_where(model, "decode", oracle=twin, batch_sizes=(4,), kinds=("equal", "mixed"))
    assert r.circumstance == "decode" and r.verdict == "semantic"
    for c in r.comparisons:
        assert c.step and c.positions == 1 and c.a_shape == [1, 1] and c.b_shape == [4, 1]
        if c.b_row == 0:
            assert c.first_beyond is None, explain_where(r)
        else:
            fb = c.first_beyond
            assert (fb.tap, fb.kind) == ("layers.0.attn_ctx", "semantic"), explain_where(r)
            assert "row_position" in c.findings and fb.position is None
    assert "first generated step" in hint(r) and "row in the batch" in hint(r)


def test_decode_teacher_forcing_feeds_the_prompt_and_the_step(tiny, monkeypatch):
    """The write-slot bug in layer 1 only: at fp32 with torch's products layer 0's q_proj
    already differs in a batch (a [1 vs 4 rows] product: drift; the fixed-order kernel that
    runs few-row products on x86-64 gives every row the same bits, so the reference's are asked
    for here), so layer 1's input differs and teacher forcing runs: B's prefill and step fed A's
    layer-1 input for the target row (its cached keys too); the layer still differs beyond
    drift, so this layer does it."""
    from torchref.plan import PRODUCTS_ENV
    monkeypatch.setenv(PRODUCTS_ENV, "reference")
    model, twin = pair(tiny, "fp32", row_write_slot(layers={1}))
    r = probe_where(model, "decode", oracle=twin, batch_sizes=(4,), kinds=("mixed",))
    for c in r.comparisons:
        if c.b_row == 0:
            assert c.first_beyond is None, explain_where(r)
            continue
        fb = c.first_beyond
        assert fb.tap == "layers.1.attn_ctx" and not fb.before_exact, explain_where(r)
        assert fb.forced.ran and fb.forced.local and fb.forced.kind == "semantic", fb.forced
    assert r.cost["teacher_forced_layers"] >= 2


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("impl", ["torchref", "jaxmodel", "transformers"])
def test_decode_forcing_replays_a_run_bitwise(impl, tiny):
    """The decode source's teacher forcing first replays a run with its own layer inputs (the
    prompt's as the prefill computed them: prefill_capture); the replay must be the run,
    bit for bit, at every layer, at the policy and on the twin, or forcing says so."""
    from compare.probes.models import ModelSpec
    from compare.probes.where import _load
    from compare.probes.where_sources import DecodeSource
    target = np.random.default_rng(0).integers(0, 96, (1, 10))
    runs, pairs = plan("decode", target, 96, 0, batch_sizes=(3,), kinds=("mixed",))
    rows_of = {r.key: sorted({s.row for p in pairs for s in (p.a, p.b) if s.run == r.key}) for r in runs}
    main = _load(ModelSpec(impl, str(tiny), "fp32"))
    src = DecodeSource({"main": main, "twin": main.float64(rounded_weights=True)}, runs, rows_of, tuple(main.taps))
    for r in runs:
        for twin in (False, True):
            for layer in (0, 1):
                assert src.can_force(r.key, twin)
                got = src.force(r.key, twin, layer, src.layer_input(r.key, twin, layer))   # raises if not
                row, out = rows_of[r.key][-1], f"layers.{layer}.out"
                assert np.array_equal(got[out][row], src.kept[(r.key, twin, row)][out])


def test_teacher_forcing_runs_where_the_layer_input_already_differs(tiny):
    """Layer 0's o_proj sums in another order in a batch (drift), layer 1's norm leaks across
    rows: at layer 1 the input already differs, so teacher forcing runs; fed A's input the
    norm still differs beyond drift: this layer does it."""
    def both(model, base):
        split_k_o_proj(model, base, layer=0)
        batch_mean_norm(model, base, layer=1)
    model, twin = pair(tiny, "fp32", both, batch_invariant=True)
    r = probe_where(model, "batch", oracle=twin, batch_sizes=(4,), kinds=("equal",))
    for c in r.comparisons:
        assert c.first_difference.tap == "layers.0.attn_out" and c.first_difference.kind == "drift"
        fb = c.first_beyond
        assert fb.tap == "layers.1.attn_norm" and not fb.before_exact, explain_where(r)
        assert fb.forced.ran and fb.forced.local and fb.forced.kind == "semantic"


# ----- clean runs --------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("circumstance", ["batch", "padding", "append"])
def test_clean_default_mode_differences_are_drift(tiny, policy, circumstance):
    opts = {"batch_sizes": (2, 5)} if circumstance == "batch" else {}
    r = probe_where("torchref", circumstance, checkpoint=tiny, policy=policy, **opts)
    assert r.streamed
    bad = [(c.name, d.tap, d.kind) for c in r.comparisons for d in c.taps if d.kind in BEYOND]
    assert not bad, explain_where(r)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("impl", ["torchref", "transformers"])
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_clean_first_generated_step_is_drift_at_most(tiny, impl, policy):
    r = probe_where(impl, "decode", checkpoint=tiny, policy=policy, batch_sizes=(2, 5))
    assert len(r.comparisons) == 10 and all(c.step for c in r.comparisons)
    bad = [(c.name, d.tap, d.kind) for c in r.comparisons for d in c.taps if d.kind in BEYOND]
    assert not bad, explain_where(r)


@pytest.mark.slow      # a jax compile per batch shape
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_clean_jaxmodel_first_generated_step_is_drift_at_most(tiny, policy):
    r = probe_where("jaxmodel", "decode", checkpoint=tiny, policy=policy, batch_sizes=(2, 5))
    assert r.verdict in ("exact", "drift"), explain_where(r)


@pytest.mark.parametrize("circumstance", ["batch", "padding", "append", "decode"])
def test_batch_invariant_mode_is_exact_at_every_tap(tiny, circumstance):
    model = torchref.from_pretrained(tiny, policy="bf16", batch_invariant=True)
    opts = {"batch_sizes": (3,)} if circumstance in ("batch", "decode") else {}
    r = probe_where(model, circumstance, **opts)
    assert r.verdict == "exact" and all(d.bitwise_equal for c in r.comparisons for d in c.taps), explain_where(r)


def test_default_vs_invariant_mode_is_drift_at_most(tiny):
    r = probe_where("torchref", "invariant-mode", checkpoint=tiny, policy="bf16")
    assert r.verdict in ("exact", "drift"), explain_where(r)
    assert [c.group for c in r.comparisons] == ["mode", "mode"]


def test_rerun_in_this_process_is_exact(tiny):
    r = probe_where("torchref", "rerun", checkpoint=tiny, policy="fp32", processes=0, repeats=2)
    assert [c.group for c in r.comparisons] == ["repeat", "repeat"]
    assert r.verdict == "exact", explain_where(r)


@pytest.mark.slow
def test_rerun_in_a_fresh_process_is_exact(tiny):
    r = probe_where("torchref", "rerun", checkpoint=tiny, policy="fp32", processes=1)
    assert {c.group for c in r.comparisons} == {"repeat", "fresh"}
    assert r.verdict == "exact", explain_where(r)


def test_streamed_and_whole_captures_give_the_same_records(tiny):
    """The same taps, kinds and a-vs-b differences; the errors against the fp64 oracle to fp64's
    own rounding: the streamed oracle computes the lm_head in vocabulary chunks, and on some CPUs
    (AMD EPYC Zen 4: MKL's dgemm blocks a chunk's K sums otherwise) its logits differ from the
    whole matrix's in the last bit (measured: err 0.004157215057548355 vs ...354)."""
    a = probe_where("torchref", "padding", checkpoint=tiny, policy="bf16")
    b = probe_where("torchref", "padding", checkpoint=tiny, policy="bf16", stream=False)
    assert a.streamed and not b.streamed
    for ca, cb in zip(a.comparisons, b.comparisons):
        assert [(d.tap, d.kind, d.rel_l2) for d in ca.taps] == [(d.tap, d.kind, d.rel_l2) for d in cb.taps]
        for da, db in zip(ca.taps, cb.taps):
            np.testing.assert_allclose([da.err_a, da.err_b], [db.err_a, db.err_b], rtol=1e-12, atol=0,
                                       err_msg=da.tap)


@pytest.mark.slow
@pytest.mark.parametrize("circumstance", ["batch", "padding"])
def test_clean_jaxmodel_default_mode_is_drift_at_most(tiny, circumstance):
    r = probe_where("jaxmodel", circumstance, checkpoint=tiny, policy="bf16")
    assert r.verdict in ("exact", "drift"), explain_where(r)


# ----- the pieces ----------------------------------------------------------------------------------

def test_judge_tap_kinds_follow_the_two_rungs():
    from compare.probes.where import Yardstick
    rng = np.random.default_rng(0)
    o = rng.standard_normal((6, 2, 4))     # [slots, heads, head_dim], as a q tap comes
    yard = Yardstick.of(Policy.get("fp32"), 8, False)
    a = (o + 1e-7 * rng.standard_normal(o.shape)).astype(np.float32)
    b = (o + 1e-7 * rng.standard_normal(o.shape)).astype(np.float32)
    assert judge_tap("layers.0.q", a, a.copy(), o, o, yard).kind == "exact"
    assert judge_tap("layers.0.q", a, b, o, o, yard).kind == "drift"
    assert judge_tap("layers.0.q", a, b, o, o + 1e-6, yard).kind == "semantic"      # the twin moved
    assert judge_tap("layers.0.q", a, (o * 1.01).astype(np.float32), o, o, yard).kind == "precision"
    assert judge_tap("layers.0.q", a, (o * 1.01).astype(np.float32), o, None, yard).kind == "semantic"
    # NaN/Inf: the ladder's rule (one judge): where the twin in B stays finite it is the policy's
    # overflow (precision), where the twin has it too, the math (semantic)
    nan, o_nan = b.copy(), o.copy()
    nan[0, 0] = o_nan[0, 0] = np.nan
    assert judge_tap("layers.0.q", a, nan, o, o, yard).kind == "precision"
    assert judge_tap("layers.0.q", a, nan, o, o_nan, yard).kind == "semantic"
    assert judge_tap("layers.0.q", a, nan, o, o, yard).reason == "nonfinite"


def test_pad_fit_tells_attended_pads_from_masked_ones():
    rng = np.random.default_rng(1)
    W, H, D = 7, 2, 4
    q, k, v = (rng.standard_normal((W, H, D)) for _ in range(3))
    mask = np.array([0, 0, 1, 1, 1, 1, 1])
    slots = np.flatnonzero(mask)

    def ctx(allowed):
        s = np.einsum("thd,shd->hts", q[slots], k) / np.sqrt(D)
        s = np.where(allowed[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hts,shd->thd", p, v).reshape(len(slots), -1)
    causal = np.arange(W)[None, :] <= slots[:, None]
    masked, attended = pad_fit(q, k, v, ctx(causal), mask, slots)
    assert attended < 1e-12 < masked
    masked, attended = pad_fit(q, k, v, ctx(causal & mask.astype(bool)[None]), mask, slots)
    assert masked < 1e-12 < attended


def test_plans_compare_only_the_targets_positions():
    target = np.arange(3, 11)[None]
    runs, pairs = plan("append", target, 96, appended=(2,))
    assert runs[1].ids.shape == (1, 10) and list(pairs[0].b.slots) == list(range(8))
    runs, pairs = plan("padding", target, 96, pad=3)
    inner = next(p for p in pairs if p.group == "interior")
    run = next(r for r in runs if r.key == inner.b.run)
    assert list(run.ids[0][inner.b.slots]) == list(target[0])
    with pytest.raises(ValueError, match="unknown circumstance 'tp'"):
        plan("tp", target, 96)


def test_a_model_without_a_twin_or_policy_gets_a_clear_error(tiny):
    port = types.SimpleNamespace(name="my port", taps=("embed",), capture=lambda *a, **k: None)
    with pytest.raises(TypeError, match="my port: probe where needs the model's float64 twin"):
        probe_where(port, "batch")
    with pytest.raises(ValueError, match="checkpoint="):
        probe_where("torchref", "batch")


# ----- CLI and report ------------------------------------------------------------------------------

def test_cli_probe_where_prints_the_table_and_writes_json_and_html(tiny, tmp_path, capsys):
    import json

    from llama_parity.cli import main
    out, page = tmp_path / "where.json", tmp_path / "where.html"
    rc = main(["probe", "where", str(tiny), "--circumstance", "padding", "--policy", "bf16", "--no-colour",
               "--json", str(out), "--html", str(page)])
    text = capsys.readouterr().out
    assert rc == 0 and "per layer and component" in text and "left padding (+5, pad id)" in text
    doc = json.loads(out.read_text())
    (res,) = doc["results"]
    assert res["circumstance"] == "padding" and res["streamed"] and len(res["comparisons"]) == 5
    assert res["comparisons"][0]["taps"][0]["tap"] == "embed"
    html = page.read_text()
    assert html.count("data:image/png") == 2 and "Per layer and component" in html


def test_cli_probe_where_decode(tiny, tmp_path, capsys):
    import json

    from llama_parity.cli import main
    out = tmp_path / "where-decode.json"
    rc = main(["probe", "where", str(tiny), "--circumstance", "decode", "--batch-sizes", "3", "--no-colour",
               "--json", str(out), "--html", str(tmp_path / "where-decode.html")])
    assert rc == 0 and "the first generated step" in capsys.readouterr().out
    (res,) = json.loads(out.read_text())["results"]
    assert res["circumstance"] == "decode" and len(res["comparisons"]) == 6     # equal, mixed x rows 0-2
    assert all(c["step"] and c["b_shape"] == [3, 1] for c in res["comparisons"])


def test_cli_probe_where_refuses_one_page_for_several_results(tiny, capsys):
    from llama_parity.cli import main
    rc = main(["probe", "where", str(tiny), "--policy", "fp32,bf16", "--html", "/tmp/x.html"])
    assert rc == 2 and "draws one result" in capsys.readouterr().err


def test_a_probe_that_is_not_exact_points_to_probe_where(tiny):
    from compare.probes import probe_padding
    model, twin = pair(tiny, "fp32", attends_pads)
    r = probe_padding(model, oracle=twin)
    assert r.verdict == "semantic"
    assert r.details["where"].endswith("--circumstance padding") and "probe where" in r.hint


def test_report_table_marks_the_first_differing_tap_per_component(tiny):
    from compare.report.where import component_rows, format_table
    model, twin = pair(tiny, "fp32", batch_mean_norm)
    r = probe_where(model, "batch", oracle=twin, batch_sizes=(4,), kinds=("equal",))
    rows = component_rows(r.to_dict()["comparisons"][0])
    first = next(x for x in rows if x["kind"] != "exact")
    assert (first["layer"], first["component"], first["first"]) == (0, "attn_norm", "attn_norm")
    assert "semantic" in format_table(r)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_clean_transformers_batch_is_drift_at_most(tiny, attn):
    pytest.importorskip("transformers")
    r = probe_where("transformers", "batch", checkpoint=tiny, policy="bf16", attn_implementation=attn,
                    batch_sizes=(4,))
    assert not r.streamed and r.verdict in ("exact", "drift"), explain_where(r)


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("circumstance", ["batch", "padding"])
def test_smollm2_torchref_bf16_batch_and_padding_are_drift_at_most(smollm2, circumstance):
    """docs/where.md's tables: on the real weights batching and padding change bits, not math."""
    opts = {"batch_sizes": (8,)} if circumstance == "batch" else {}
    r = probe_where("torchref", circumstance, checkpoint=smollm2, policy="bf16", **opts)
    print(f"\nMEASURED smollm2 where {circumstance}: {explain_where(r).splitlines()[0]}")
    assert r.streamed and r.verdict in ("exact", "drift"), explain_where(r)


# ----- a twin that never sees B's circumstance -------------------------------------------------

def _hf_with_pads_attended(folder):
    """A transformers Llama whose attention ignores the padding mask (causal order only: pad keys
    before a real query are attended), registered as its attention implementation, so that its
    float64 copy carries the same code. That copy captures padded batches row by row on the real
    tokens (TransformersModel.unpadded_rows), so it never runs the bug."""
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attention(module, query, key, value, attention_mask, **kw):
        T, S = query.shape[-2], key.shape[-2]
        causal = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
        keep = torch.zeros((), dtype=query.dtype)
        blocked = torch.tensor(torch.finfo(query.dtype).min, dtype=query.dtype)
        return eager_attention_forward(module, query, key, value, torch.where(causal, keep, blocked)[None, None],
                                       **kw)
    AttentionInterface.register("pads_attended", attention)
    AttentionMaskInterface.register("pads_attended", eager_mask)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="pads_attended")
    return model.eval()


def test_a_padding_bug_the_twin_cannot_see_is_semantic_not_precision(tiny):
    """The twin's run of a padded batch is not the padded computation (it runs each row alone):
    B is judged as a port without a twin, by size and structure, and attending pad keys is far
    beyond any rounding of float32: semantic at layer 0's attention, not "precision" (the twin
    agreeing with A would otherwise make every excess a precision loss)."""
    from compare.adapters.transformers import TransformersModel
    model = TransformersModel(_hf_with_pads_attended(tiny), checkpoint=tiny)
    assert model.float64().unpadded_rows
    r = probe_where(model, "padding", policy="fp32")
    assert r.verdict == "semantic", explain_where(r)
    c = by_name(r, "left padding (+5, pad id)")
    fb = c.first_beyond
    assert (fb.tap, fb.kind) == ("layers.0.attn_ctx", "semantic"), explain_where(r)
    d = next(d for d in c.taps if d.tap == fb.tap)
    assert d.twin_rel is None and d.reason.startswith("no_twin"), d
    # right padding sits after every real query: causal order alone masks it
    assert by_name(r, "right padding (+5, random pad tokens)").first_beyond is None
