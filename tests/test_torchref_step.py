"""What a torchref call decides once, and a decode step's shortcuts (torchref.ops.one_call,
Attention.rotated, the KV cache's slots per call): each is the same arithmetic as the long way,
bit for bit, and a setting changed between calls counts at the next call."""

import platform

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torchref  # noqa: E402
from llamaspec import Policy  # noqa: E402
from torchref import model as tm  # noqa: E402
from torchref import ops  # noqa: E402

IDS = np.array([[5, 9, 2, 7, 1, 3], [4, 4, 8, 6, 2, 9]])
MASK = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
TAPS = ("layers.*.q_rope", "layers.*.k_rope", "layers.*.attn_ctx", "layers.*.out")


def counting(monkeypatch, name):
    """ops.<name> wrapped to count its calls (the list of their arguments)."""
    calls, real = [], getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a: calls.append(a) or real(*a))
    return calls


def steps(m, n=3):
    """A prefill of IDS then n greedy decode steps: [(logits, taps)] per step, as numpy."""
    logits, cache = m.prefill(IDS, MASK, IDS.shape[1] + n)
    out = []
    for _ in range(n):
        logits, cache, acts = m.decode_capture(cache, np.asarray(logits).argmax(-1), taps=TAPS)
        out.append((np.asarray(logits), acts))
    return out


def assert_same_bits(a, b):
    for (la, ta), (lb, tb) in zip(a, b, strict=True):
        assert np.array_equal(la, lb)
        assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_products_decided_once_a_call_and_anew_at_the_next(policy, tiny_dir, monkeypatch):
    """Inside a model call linears asks its rules once per kind of product (dtypes, rows), not at
    every product; the next call asks again, and outside a call every product asks: a setting
    changed between calls counts at once."""
    m = torchref.from_pretrained(tiny_dir("gqa"), policy=policy)
    asked, products = counting(monkeypatch, "kernel_products"), counting(monkeypatch, "linears")
    m.forward(IDS, MASK)
    # one kind for the layers' products, one for the logits (their own result dtype at bf16)
    kinds = {a[:4] for a in asked}
    assert len(asked) == len(kinds) <= 2
    assert len(products) >= 4 * m.cfg.num_hidden_layers
    m.forward(IDS, MASK)
    assert len(asked) == 2 * len(kinds)
    x, w = torch.ones(2, 64), torch.ones(8, 64)
    before = len(asked)
    for _ in range(3):
        ops.linear(x, w, None, Policy.get(policy))
    assert len(asked) == before + 3


def test_products_plan_follows_the_setting_between_calls(tiny_dir, monkeypatch):
    """$LLAMA_PARITY_TORCHREF_PRODUCTS set between two calls of one model: the second call runs
    the products where the setting says (torch: never the fixed-order gemm)."""
    m = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32")
    gemm = counting(monkeypatch, "fixed_order_gemm")
    monkeypatch.setenv(ops.PRODUCTS_ENV, "torch")
    first = np.asarray(m.forward(IDS, MASK))
    assert not gemm
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the fixed-order kernels' products run on x86-64 CPUs")
    monkeypatch.setenv(ops.PRODUCTS_ENV, "kernel")
    second = np.asarray(m.forward(IDS, MASK))
    assert gemm
    assert np.allclose(first, second, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
def test_decode_rotates_queries_and_keys_together_bit_for_bit(policy, tiny_dir, monkeypatch):
    """A decode step rotates q and k in one apply_rope (Attention.rotated); with key tables that
    are equal but not the call's own objects (as a control's seam gives) it rotates them apart:
    the same logits and taps, bit for bit. (A bf16 prompt rotates in ops.kernel_rope where the
    fixed-order kernels are built, not in apply_rope.)"""
    m = torchref.from_pretrained(tiny_dir("gqa"), policy=policy)
    bf16 = torch.zeros(1, 2, 1, 2, dtype=torch.bfloat16)
    prompt = 0 if policy == "bf16" and ops.kernel_rope_applies(bf16, bf16) else 2
    rotations = counting(monkeypatch, "apply_rope")
    together = steps(m)
    assert len(rotations) == m.cfg.num_hidden_layers * (prompt + 3)   # the prompt's, then one a step
    monkeypatch.setattr(tm.Attention, "key_tables", lambda self, ctx, cache: (ctx.cos.clone(), ctx.sin.clone()))
    rotations.clear()
    apart = steps(m)
    assert len(rotations) == m.cfg.num_hidden_layers * (prompt + 2 * 3)
    assert_same_bits(together, apart)


def test_cache_slots_follow_each_calls_index(tiny_dir, monkeypatch):
    """The cache's write slots are worked out once per call's index array (every layer of the
    call reads it), and each step writes where its own array says: every step's logits are the
    full recompute's at that position (to f32 rounding), through the block write and through the
    scatter (a seam replaced by its own arithmetic) alike, and the two are the same bits."""
    m = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32")

    def against_recompute():
        n = 4
        logits, cache = m.prefill(IDS, MASK, IDS.shape[1] + n)
        ids, mask, got = IDS, MASK, []
        for _ in range(n):
            nxt = np.asarray(logits).argmax(-1)
            logits, cache = m.decode(cache, nxt)
            ids, mask = np.concatenate([ids, nxt[:, None]], 1), np.concatenate([mask, np.ones_like(mask[:, :1])], 1)
            full = np.asarray(m.forward(ids, mask))[:, -1]
            assert np.allclose(np.asarray(logits), full, rtol=1e-4, atol=1e-4)
            got.append(np.asarray(logits))
        return got

    block = against_recompute()
    own = tm.Attention.write_slots
    monkeypatch.setattr(tm.Attention, "write_slots", lambda self, index, T, S: own(self, index, T, S))
    scatter = against_recompute()
    assert all(np.array_equal(a, b) for a, b in zip(block, scatter, strict=True))


def test_times_writes_into_its_first_operand_only_where_that_is_the_same_tensor():
    """ops.times(a, b, *inputs) is a * b: into a (the same object, the same bits) where a is of
    the product's shape and dtype and shares memory with neither b nor the inputs; a new tensor,
    a untouched, otherwise."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    want = a * b
    got = ops.times(a.clone(), b)
    assert torch.equal(got, want)
    fresh = a.clone()
    assert ops.times(fresh, b) is fresh

    def out_of_place(x, y, *inputs):
        before = x.clone()
        got = ops.times(x, y, *inputs)
        assert got is not x and torch.equal(x, before) and torch.equal(got, before * y)

    both = torch.randn(4, 12, generator=g)
    out_of_place(both[:, :6], both[:, 6:])                     # a view of b's memory
    out_of_place(a, b, a)                                       # the op returned its input...
    out_of_place(a.view(4, 6), b, a)                            # ...or a view of it
    out_of_place(a.clone().to(torch.bfloat16), b)               # the product is f32, a bf16
    out_of_place(a[:1].clone(), b)                              # a broadcasts
    with torch.enable_grad():
        out_of_place(a.clone().requires_grad_(), b)             # a gradient is being taken


def test_mlp_taps_keep_their_values_when_the_activation_returns_its_input(tiny_dir):
    """The MLP multiplies silu(gate) by up in silu's own result (ops.times): with an activation
    that returns its input (as a control's or a user's op may), the gate tap is still the
    projection's output and act is gate * up, bit for bit."""
    m = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32")
    taps = ("layers.0.gate", "layers.0.up", "layers.0.act")
    _, own = m.capture(IDS, MASK, taps=taps)

    class Identity:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return (lambda x: x) if name == "silu" else getattr(self.inner, name)

    mlp = m.model.layers[0].mlp
    mlp.ops = Identity(mlp.ops)
    _, ident = m.capture(IDS, MASK, taps=taps)
    gate, up = (np.asarray(ident[f"layers.0.{k}"]) for k in ("gate", "up"))
    assert np.array_equal(gate, np.asarray(own["layers.0.gate"]))
    assert np.array_equal(up, np.asarray(own["layers.0.up"]))
    assert np.array_equal(np.asarray(ident["layers.0.act"]), gate * up)
    assert not np.array_equal(np.asarray(own["layers.0.act"]), gate * up)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_mlp_multiplies_into_the_activations_own_result(policy, tiny_dir, monkeypatch):
    """A prompt's MLP multiplies up into SiLU's own result (no [tokens, intermediate] tensor of
    its own for act), and act is silu(gate) * up bit for bit."""
    from llamaspec.forward import Recorder
    m = torchref.from_pretrained(tiny_dir("gqa"), policy=policy)
    made, real = [], ops.silu
    monkeypatch.setattr(ops, "silu", lambda x: made.append(real(x)) or made[-1])
    mlp, x = m.model.layers[0].mlp, torch.randn(2, 6, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    rec = Recorder({"gate", "up", "act"})
    with torch.inference_mode(), tm.call_settings(m.policy):
        mlp(x.to(m.model.embed_tokens.weight.dtype), m.policy, rec)
    assert len(made) == 1 and rec.acts["act"] is made[0]
    assert torch.equal(made[0], real(rec.acts["gate"]) * rec.acts["up"])


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_long_prompt_mlp_in_row_blocks_keeps_every_bit(policy, tiny_dir, monkeypatch):
    """With the MLP's products on the fixed-order kernel (forced here, any CPU), a prompt of more
    rows than a block runs its MLP in row blocks (ops.mlp_row_block; blocks of 8 rows here, the
    last of 7, across the batch's rows): logits, every tap (gate, up, act in the call's shape), the
    prefill and the decode steps are bitwise those of the MLP over all rows at once; with torch's
    products (whose order may follow the row count) or a control's SiLU the rows stay together."""
    from llamaspec import fixed_order as fo
    from llamaspec.errors import InvarianceError
    try:
        fo.library()
    except InvarianceError as e:
        pytest.skip(f"fixed-order kernels not available: {e}")
    monkeypatch.setenv(ops.PRODUCTS_ENV, "kernel")
    m = torchref.from_pretrained(tiny_dir("bias"), policy=policy)
    width = 2 * m.cfg.intermediate_size
    ids = np.random.default_rng(5).integers(3, 96, (3, 29))
    mask = np.ones_like(ids)
    mask[1, :6] = 0
    blocks = []
    real_rows = tm.MLP.rows
    monkeypatch.setattr(tm.MLP, "rows", lambda self, x, *a: blocks.append(x.shape) or real_rows(self, x, *a))

    def run():
        logits, acts = m.capture(ids, mask, taps=["*"])
        out = [np.asarray(logits), *(np.asarray(acts[k]) for k in sorted(acts))]
        first, cache = m.prefill(ids, mask, 33)
        step, _ = m.decode(cache, np.asarray(first).argmax(-1))
        return out + [np.asarray(first), np.asarray(step)], sorted(acts)

    monkeypatch.setattr(ops, "MLP_BLOCK_BYTES", 1 << 30)
    whole, names = run()
    assert all(len(s) == 3 for s in blocks)             # every call's rows at once
    monkeypatch.setattr(ops, "MLP_BLOCK_BYTES", 8 * 4 * width)
    assert ops.mlp_row_block(87, width, Policy.get(policy), torch.device("cpu")) == 8
    blocks.clear()
    parts, names_b = run()
    assert names_b == names and "layers.1.act" in names
    assert [s for s in blocks if len(s) == 2][:12] == [(8, 32)] * 10 + [(7, 32), (8, 32)]   # 87 rows of 32
    for a, b in zip(whole, parts, strict=True):
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    monkeypatch.setenv(ops.PRODUCTS_ENV, "torch")
    assert ops.mlp_row_block(87, width, Policy.get(policy), torch.device("cpu")) is None
    monkeypatch.setenv(ops.PRODUCTS_ENV, "kernel")
    m.model.layers[0].mlp.ops = type("Ops", (), {"linears": staticmethod(ops.linears), "silu": lambda x: x})
    assert m.model.layers[0].mlp.row_block(torch.ones(87, 32), m.policy) is None
