"""The fast backend's drop-ins for the model's small seams (torchref.fast: apply_rope on the
kernel, write_cache's one-block copy, times in place) are the reference op's bits, and the plan
is read once, at load."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torchref  # noqa: E402
from llamaspec import Policy, RopeConfig  # noqa: E402
from torchref import fast, ops  # noqa: E402
from torchref import plan as tplan  # noqa: E402

IDS = np.array([[5, 9, 2, 7, 1, 3], [4, 4, 8, 6, 2, 9]])
MASK = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


def namespace(policy="bf16", **env):
    return fast.namespace(tplan.choices(Policy.get(policy), torch.device("cpu"), env))


@pytest.mark.parametrize("T", [1, 5])
def test_fast_rope_is_apply_ropes_bits(T):
    """The fast apply_rope (a bf16 prompt's on the fixed-order kernel) gives apply_rope's bits,
    for strided inputs and tables broadcast over the batch."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 6, 32, generator=g).bfloat16()[:, :, 1:]          # a strided view
    pos = torch.arange(T)[None].repeat(2, 1) + 3
    inv = ops.rope_inv_freq(RopeConfig(), 32, 64, T + 3, torch.float32)
    cos, sin = ops.rope_cos_sin(inv, pos, torch.float32)
    ns = namespace()
    for c, s in ((cos, sin), (cos[:1], sin[:1])):
        assert torch.equal(ns.apply_rope(x, c, s), ops.apply_rope(x, c, s))


def test_fast_cache_write_is_the_scatters_values():
    """write_cache's one-block copy (every row's slots one block) and the scatter it falls back to
    (rows at different slots, slots out of order) write the reference's values."""
    g = torch.Generator().manual_seed(0)
    ns = namespace("fp32")
    for slots in (torch.tensor([[3, 4, 5], [3, 4, 5]]), torch.tensor([[0], [0]]), torch.tensor([[2], [5]]),
                  torch.tensor([[1, 3, 2], [1, 3, 2]])):
        x = torch.randn(2, slots.shape[1], 3, 4, generator=g)
        want, got = torch.zeros(2, 3, 8, 4), torch.zeros(2, 3, 8, 4)
        ops.write_cache(want, slots, x)
        ns.write_cache(got, slots, x)
        assert torch.equal(got, want), slots


def test_plan_is_read_at_load(tiny_dir, monkeypatch):
    """A setting changed after load leaves the loaded model's plan and ops as they were; a model
    loaded after it follows it. The plan names every op and the settings it read."""
    monkeypatch.delenv(tplan.ATTENTION_ENV, raising=False)
    m = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32")
    before = np.asarray(m(IDS, attention_mask=MASK))
    monkeypatch.setenv(tplan.ATTENTION_ENV, "reference")
    assert m.plan.op("attention") != "reference"
    assert np.array_equal(np.asarray(m(IDS, attention_mask=MASK)), before)
    again = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32")
    assert again.plan.op("attention") == "reference" and (tplan.ATTENTION_ENV, "reference") in again.plan.settings
    ref = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32", backend="reference")
    assert ref.plan.backend == "reference" and set(dict(ref.plan.ops).values()) == {"reference"}
    assert ref.model.ops is ops


def test_times_writes_into_its_first_operand_only_where_that_is_the_same_tensor():
    """fast.times_in_place(a, b, *inputs) is a * b: into a (the same object, the same bits) where a is of
    the product's shape and dtype and shares memory with neither b nor the inputs; a new tensor,
    a untouched, otherwise."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    want = a * b
    got = fast.times_in_place(a.clone(), b)
    assert torch.equal(got, want)
    fresh = a.clone()
    assert fast.times_in_place(fresh, b) is fresh

    def out_of_place(x, y, *inputs):
        before = x.clone()
        got = fast.times_in_place(x, y, *inputs)
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
    """The MLP multiplies silu(gate) by up in silu's own result (the fast backend's times): with an activation
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


def test_matmul_settings_are_checked_at_each_call_and_never_changed(tiny_dir):
    """torchref reads torch's process-wide matmul settings at each call and names the one that
    contradicts the policy; it sets none of them (they belong to the user's process)."""
    import torch

    from llamaspec.errors import PolicyError
    from torchref.plan import check_matmul_settings

    m = torchref.from_pretrained(tiny_dir("gqa"), policy="fp32")
    ids = np.arange(3, 11)[None]
    mm, cpu = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    names = ((mm, "fp32_precision"), (mm, "allow_bf16_reduced_precision_reduction"),
             (mm, "allow_fp16_reduced_precision_reduction"), (cpu, "fp32_precision"))
    before = [getattr(o, n) for o, n in names]
    try:
        m(ids)
        assert [getattr(o, n) for o, n in names] == before
        cpu.fp32_precision = "bf16"
        with pytest.raises(PolicyError, match="mkldnn.matmul.fp32_precision"):
            m(ids)
        assert cpu.fp32_precision == "bf16"
        cpu.fp32_precision = before[3]
        m(ids)
        # the CUDA rules read the flags only: checked here without a GPU
        bf16 = Policy.get("bf16")
        mm.fp32_precision, mm.allow_bf16_reduced_precision_reduction = "ieee", True
        with pytest.raises(PolicyError, match="allow_bf16_reduced_precision_reduction"):
            with check_matmul_settings(bf16, "cuda"):
                pass
        mm.allow_bf16_reduced_precision_reduction = mm.allow_fp16_reduced_precision_reduction = False
        with check_matmul_settings(bf16, "cuda"):
            pass
        # each flag concerns its own dtype's products: torch's defaults (both True) do not stop an
        # f32 policy, and the fp16 flag does not stop a bf16 one
        mm.allow_bf16_reduced_precision_reduction = mm.allow_fp16_reduced_precision_reduction = True
        with check_matmul_settings(Policy.get("fp32"), "cuda"):
            pass
        mm.allow_bf16_reduced_precision_reduction = False
        with check_matmul_settings(bf16, "cuda"):
            pass
        with pytest.raises(PolicyError, match="allow_fp16_reduced_precision_reduction"):
            with check_matmul_settings(Policy.get("fp16"), "cuda"):
                pass
    finally:
        for (o, n), v in zip(names, before):
            setattr(o, n, v)


def test_one_block_finds_exactly_the_calls_written_as_one_block():
    """fast.one_block against its definition, on slot arrays that are and are not one block (a
    row off by one, a gap, out of the cache), small (Python's path) and large (numpy's)."""
    import torch

    from torchref.fast import one_block

    def defined(s, S):
        B, T = s.shape
        start = int(s[0, 0])
        block = np.arange(start, start + T)
        return start if 0 <= start and start + T <= S and all((s[b] == block).all() for b in range(B)) else None

    rng = np.random.default_rng(0)
    for B, T in ((1, 1), (3, 1), (2, 5), (1, 128), (4, 40)):
        for start in (0, 3, 60):
            base = np.tile(np.arange(start, start + T), (B, 1))
            cases = [base, base + 1]
            bent = base.copy()
            bent[rng.integers(B), rng.integers(T)] += 1
            cases.append(bent)
            for s in cases:
                for S in (64, 200):
                    assert one_block(torch.as_tensor(s), S) == defined(s, S), (B, T, start, S)
