"""Planted sharding bugs (positive controls) and a clean sharded run (negative control):
jaxmodel tensor-parallel on a mesh, against torchref on one device, through the ladder.

Each bug is planted at layer LAYER of the sharded model and of its sharded float64 twin
(like torch_side's code-level bugs: the twin carries the bug, so the twins disagree), on
jaxmodel's public seams: a Linear's `reduce` (the cross-shard sum), an Attention's `ops`.
The mesh is the smallest tensor size above 1 the model's sizes allow (2 for the tests' tiny
GQA model, 3 for SmolLM2), unless one is given. They need that many devices: on a CPU, a
process started with XLA_FLAGS=--xla_force_host_platform_device_count=N (tests run them in a
worker process, tests/test_sharding.py).

    report = run_control(SHARDING_CONTROLS["shard_missing_all_reduce"], folder, ids, mask)
"""

from __future__ import annotations

from llamaspec import Policy, load_weights
from llamaspec import taps as tapnames

from ..adapters import OurModel, Side
from .prefill import LAYER, Control, Ops


def default_tensor(cfg) -> int:
    """The smallest tensor size above 1 that the model's sizes allow (jaxmodel.sharding rules)."""
    # jaxmodel imports jax: slow, and XLA_FLAGS (the host device count) must be set first
    from jaxmodel.sharding import ShardingError, check_sizes
    for t in range(2, cfg.num_attention_heads + 1):
        try:
            check_sizes(cfg, t)
            return t
        except ShardingError:
            continue
    raise ShardingError(f"no tensor size above 1 divides this model (num_attention_heads "
                        f"{cfg.num_attention_heads}, intermediate_size {cfg.intermediate_size})")


def sharded_side(patch, mesh=None):
    """A control's candidate builder: jaxmodel on `mesh` (default: tensor=default_tensor) at the
    policy and at fp64, `patch`(module, layout) applied to both before they compile."""
    def build(folder, policy):
        # jaxmodel imports jax: slow, and XLA_FLAGS (the host device count) must be set first
        from jaxmodel.model import Llama, LlamaModel
        from jaxmodel.sharding import layout_for
        cfg, weights = load_weights(folder)
        layout = layout_for(cfg, mesh or {"tensor": default_tensor(cfg)})
        models = []
        for p in (Policy.get(policy), "fp64"):
            module = Llama(cfg, Policy.get(p), weights, False, layout)
            patch(module, layout)
            models.append(OurModel(LlamaModel(module), folder))
        name = models[0].name + ("" if patch is _none else "+bug")
        return Side(name, *models, False, tuple(tapnames.all_taps(cfg)))
    return build


def _none(module, layout):
    pass


def _missing_all_reduce(module, layout):
    """o_proj's partial sums never added across shards: the output is shard 0's partial sum
    (a row-parallel layer without its all-reduce)."""
    module.layers[LAYER].self_attn.o_proj.reduce = lambda parts: parts[0]


def _kv_next_shard(module, layout):
    """Each shard's query heads read the next shard's KV heads (a KV head placement off by one
    shard): the stored heads rolled by one shard's share before attention."""
    attn = module.layers[LAYER].self_attn
    share = attn.kv_heads // layout.tensor

    def attention(q, k, v, allowed, policy):
        import jax.numpy as jnp  # jax: slow import, and XLA_FLAGS (the host device count) must be set first

        from jaxmodel import ops
        return ops.attention(q, jnp.roll(k, -share, axis=2), jnp.roll(v, -share, axis=2), allowed, policy)
    attn.ops = Ops(attn.ops, attention=attention)


def _rope_on_head_dim_shards(module, layout):
    """RoPE applied per shard with head_dim split over `tensor` (a partition spec on head_dim
    instead of heads): rotate_half pairs the halves of each shard's slice of a head."""
    attn = module.layers[LAYER].self_attn

    def apply_rope(x, cos, sin):
        # jax: slow import, and XLA_FLAGS (the host device count) must be set first
        import jax
        from jax.sharding import PartitionSpec as P

        from jaxmodel import ops
        data = dict(layout.rules).get("batch")
        heads, tables = P(data, None, None, "tensor"), P(data, None, "tensor")
        return jax.shard_map(ops.apply_rope, mesh=layout.mesh, in_specs=(heads, tables, tables),
                             out_specs=heads)(x, cos, sin)
    attn.ops = Ops(attn.ops, apply_rope=apply_rope)


def _c(name, verdict, tap, component, hint, patch, what):
    return Control(name, "jaxmodel", "fp32", verdict, tap, component, tuple(hint), sharded_side(patch), what)


A = "layers.{L}."
SHARDING_CONTROLS: dict[str, Control] = {c.name: c for c in [
    _c("shard_clean", "drift", None, None, [], _none, "clean tensor-parallel jaxmodel vs torchref"),
    _c("shard_missing_all_reduce", "semantic", A + "attn_out", "attn", [], _missing_all_reduce,
       "o_proj's partial sums not added across tensor shards"),
    _c("shard_kv_next_shard", "semantic", A + "attn_ctx", "attn", [], _kv_next_shard,
       "each shard's query heads read the next shard's KV heads"),
    _c("shard_rope_head_dim", "semantic", A + "q_rope", "attn", [], _rope_on_head_dim_shards,
       "RoPE per shard with head_dim split over tensor instead of the heads"),
]}
