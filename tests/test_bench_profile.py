"""bench/profile_ops.py: a traced jaxmodel prefill, each op charged to jaxmodel's source."""

import re

import pytest

from bench import profile_ops as po


def test_wall_time_is_split_among_the_ops_running_at_once():
    """Two ops overlapping for half their length share that half; a lone op keeps its time;
    the shares add up to the span in which some op ran."""
    events = [(0.0, 10.0, "a"), (5.0, 10.0, "b"), (20.0, 4.0, "c")]
    share = po.wall_shares(events)
    assert share == {"a": 7.5, "b": 7.5, "c": 4.0}
    assert sum(share.values()) == 19.0
    with pytest.raises(ValueError, match="name none of the program"):
        po.breakdown(events, {}, {})


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_a_traced_prefill_is_charged_to_the_model_parts_that_built_its_ops(tiny_dir, policy):
    """On a tiny checkpoint: every op the trace shows is found in the compiled program and traced
    back to a jaxmodel function and line; attention's and the MLP's products are theirs (a dot
    among each part's kinds; SiLU among what the MLP's elementwise fusion holds); per-part and
    per-site times add up to the totals; every top-level op of the program was traced (no event
    lost; lost() says so when one was)."""
    from llamaspec import LlamaConfig
    folder = tiny_dir("gqa")
    layers = LlamaConfig.from_file(folder).num_hidden_layers
    r = po.profile_prefill(folder, policy, tokens=40)
    parts = {p["part"]: p for p in r["parts"]}
    for part in ("Attention.__call__", "MLP.__call__", "RMSNorm.__call__"):
        assert parts[part]["thread_ms"] > 0 and parts[part]["wall_ms"] > 0, part
    assert parts.get(po.NO_STACK, {"thread_ms": 0.0})["thread_ms"] <= 0.05 * r["thread_ms"]
    assert sum(p["thread_ms"] for p in r["parts"]) == pytest.approx(r["thread_ms"])
    assert sum(s["thread_ms"] for s in r["sites"]) == pytest.approx(r["thread_ms"])
    assert sum(p["wall_ms"] for p in r["parts"]) == pytest.approx(r["busy_wall_ms"])
    assert 0 < r["busy_wall_ms"] <= r["traced_wall_ms"] and r["thread_ms"] >= r["busy_wall_ms"] * 0.999
    for s in r["sites"]:
        assert s["site"] == po.NO_STACK or re.fullmatch(r"(ops|model|kernels|fast)\.[\w.]+:\d+", s["site"]), s["site"]
    dots = {s["part"] for s in r["sites"] if any("dot" in k for k in s["kinds"])}
    assert {"Attention.__call__", "MLP.__call__"} <= dots
    # SiLU runs inside the fusion that multiplies it by up (and, at bf16, rounds the products)
    assert any(w.startswith("ops.silu:") for s in r["sites"] if s["part"] == "MLP.__call__" for w in s["fused_with"])
    assert r["entry_ops"] > 10 * layers and r["entry_ops_traced"] == r["entry_ops"] and not po.lost(r)
    assert r["compiled_from"]            # the program's stacks name a jaxmodel folder
    assert po.elsewhere({**r, "compiled_from": ["/elsewhere/jaxmodel"]})[0].startswith("note: the program came from")
    assert po.lost({**r, "entry_ops_traced": r["entry_ops"] - 3})[0].startswith("WARNING: the trace lacks 3 ")


def test_the_call_stacks_read_from_the_program_text(tiny_dir):
    """The HLO text's frame tables give each op its Python call stack, innermost first, down
    from the prefill through Llama and Block into the module and the op's own function."""
    import numpy as np

    import jaxmodel
    m = jaxmodel.from_pretrained(tiny_dir("gqa"), policy="fp32")
    ids = np.full((1, 12), 5)
    text = m.prefill_program_text(ids, np.ones_like(ids), 13)
    stacks = po.call_stacks(text)
    ops = po.instructions(text)
    mlp = [o for o in ops.values() if o["frame"] and "MLP.__call__" in [f for _, f, _ in stacks[o["frame"]]]]
    assert mlp
    chain = [f for _, f, _ in stacks[mlp[0]["frame"]]]
    assert chain.index("MLP.__call__") < chain.index("Block.__call__") < chain.index("Llama.__call__")
    with pytest.raises(ValueError, match="StackFrames"):
        po.call_stacks("HloModule m\n\nENTRY %main () -> f32[] {\n}\n")
