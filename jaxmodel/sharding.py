"""jaxmodel on a jax.sharding.Mesh: one rules table, the sizes that divide, and weights placed
shard by shard.

    m = jaxmodel.from_pretrained(folder, policy="bf16", mesh={"data": 2, "tensor": 4})

The mesh has up to two axes, `data` (the batch) and `tensor` (Megatron-style tensor
parallelism: attention heads and MLP columns). Every array's layout comes from RULES, which
maps a logical axis to a mesh axis, and from the logical axes each weight (PARAM_AXES) and
activation (the model's `shard` calls) is given. JAX places, partitions and communicates
(XLA's SPMD partitioner inserts the all-reduces after o_proj and down_proj); nothing here
moves data itself.

Sizes (checked when the model is built, each error names the config field and the axis):
- num_attention_heads and intermediate_size must divide by the tensor size;
- KV heads: sharded when num_key_value_heads divides by the tensor size; when there are fewer
  KV heads than the tensor size and the tensor size is a multiple of them, each KV head is
  stored tensor / num_key_value_heads times (k_proj and v_proj rows, and the cache), so every
  shard holds the KV heads its query heads read. A copy computes the same dot products as the
  original, so this changes no number; taps and weights() show each head once. Anything else
  (5 KV heads over tensor=2) is an error;
- vocab_size: the embedding and lm_head rows are sharded when it divides, else replicated;
- the batch must divide by the data size (an error at the call, naming both);
- a family's q/k norm over the whole projection (OLMo 2: qk_norm "projection") takes no tensor
  axis (its sum of squares spans every head); the other family features (llamaspec.config: norms
  by role, per-head q/k norms, soft-caps, sliding windows, the embedding scale, GELU) are per head
  or per element and lay out as Llama's steps do.

The two products whose sums cross shards (o_proj over the heads, down_proj over the MLP
columns) add their per-shard partial sums in shard order (row_parallel): each shard's partial
products are gathered, which is exact, then added one after the other. An all-reduce would
add them in whatever order its algorithm takes (XLA's in-process one and gloo's across
processes differ), so the same mesh would give other last bits in one process and in two;
with the fixed order they are bitwise the same, at the cost of gathering tensor-size partial
sums where an all-reduce moves about twice one (docs/sharding.md has the numbers).

Weights go from the safetensors memory map to their devices one shard at a time
(jax.make_array_from_callback), rounded to param_dtype on the host, so no process holds a
host copy of the whole model and per-device parameter memory falls as 1/tensor. Under
jax.distributed.initialize() the same code runs in every process on the global mesh; the
results the model returns (logits, taps) are replicated on every device, so each process
reads them whole.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llamaspec import LlamaConfig, Policy
from llamaspec.budget import MAX_HOST_DEVICES, check_count
from llamaspec.errors import ConfigError, InputError

from . import ops
from .dtypes import of

AXES = ("data", "tensor")

# logical axis -> mesh axis. The whole layout policy of the model is this table.
RULES = {"batch": "data", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}

# A weight's logical axes, by the end of its checkpoint key (HF layout: [out, in]).
PARAM_AXES = {
    "embed_tokens.weight": ("vocab", None),
    "lm_head.weight": ("vocab", None),
    "q_proj.weight": ("heads", None), "q_proj.bias": ("heads",),
    "k_proj.weight": ("kv_heads", None), "k_proj.bias": ("kv_heads",),
    "v_proj.weight": ("kv_heads", None), "v_proj.bias": ("kv_heads",),
    "o_proj.weight": (None, "heads"), "o_proj.bias": (None,),
    "gate_proj.weight": ("mlp", None), "gate_proj.bias": ("mlp",),
    "up_proj.weight": ("mlp", None), "up_proj.bias": ("mlp",),
    "down_proj.weight": (None, "mlp"), "down_proj.bias": (None,),
    "layernorm.weight": (None,), "norm.weight": (None,),
}


class ShardingError(ConfigError):
    """A mesh the model cannot be laid out on (sizes that do not divide, unknown axes)."""


def param_axes(key: str) -> tuple:
    """The logical axes of the weight under checkpoint key `key`."""
    for suffix, axes in PARAM_AXES.items():
        if key.endswith(suffix):
            return axes
    raise KeyError(f"jaxmodel.sharding: no layout rule for weight '{key}' (PARAM_AXES)")


def make_mesh(mesh) -> Mesh:
    """A Mesh with axes ("data", "tensor") from a Mesh, {"data": 2, "tensor": 4}, or "data=2,tensor=4"
    (a missing axis has size 1; the devices are jax.devices(), all processes' under
    jax.distributed, the first data x tensor of them)."""
    if isinstance(mesh, Mesh):
        unknown = [a for a in mesh.axis_names if a not in AXES]
        if unknown:
            raise ShardingError(f"mesh axes {list(mesh.axis_names)}: jaxmodel lays a model out over "
                                f"{' and '.join(AXES)} only, not {unknown}")
        if mesh.axis_names != tuple(a for a in AXES if a in mesh.axis_names):
            raise ShardingError(f"mesh axes {list(mesh.axis_names)}: give them in the order {list(AXES)}")
        return mesh
    sizes = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    unknown = [a for a in sizes if a not in AXES]
    if unknown:
        raise ShardingError(f"mesh {sizes}: unknown axis {unknown} (the axes are {' and '.join(AXES)})")
    shape = tuple(sizes.get(a, 1) for a in AXES)
    if not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ShardingError(f"mesh {sizes}: axis sizes must be positive integers")
    devices = jax.devices()
    if math.prod(shape) > len(devices):
        raise ShardingError(f"mesh {sizes} needs {math.prod(shape)} devices; JAX has {len(devices)} "
                            f"({devices[0].platform}; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                            "before JAX starts gives N)")
    return Mesh(np.asarray(devices[:math.prod(shape)]).reshape(shape), AXES)


def host_devices(n: int) -> None:
    """Asks XLA:CPU for n host devices (XLA_FLAGS --xla_force_host_platform_device_count), so that
    a mesh of n fits on one CPU: only before JAX has started its backends (the count is fixed
    then) and only when the flag is not set already; GPUs and TPUs ignore it. n is checked
    against MAX_HOST_DEVICES and the user's XLA_FLAGS against XLA first (jaxmodel.plan)."""
    import os

    from jax._src import xla_bridge

    from llamaspec.plan import check_xla_flags
    check_count(n, MAX_HOST_DEVICES, "host devices asked of XLA:CPU for the mesh", ShardingError,
                "each has threads of its own")
    check_xla_flags()
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and not xla_bridge.backends_are_initialized() and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def parse_mesh(text: str, what: str = "--mesh") -> dict[str, int]:
    """"data=2,tensor=4" -> {"data": 2, "tensor": 4} (the CLI's --mesh): known axes, each once,
    sizes positive integers within MAX_HOST_DEVICES (checked before any device is asked for;
    check_mesh then checks them against a model)."""
    sizes: dict[str, int] = {}
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ShardingError(f"{what} {text!r}: give axis=size parts, e.g. data=2,tensor=4")
    for part in parts:
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq or not re.fullmatch(r"[0-9]{1,12}", value):
            raise ShardingError(f"{what} {text!r}: each part is axis=size, e.g. data=2,tensor=4 (got {part!r})")
        if name not in AXES:
            raise ShardingError(f"{what} {text!r}: unknown axis {name!r} (the axes are {' and '.join(AXES)})")
        if name in sizes:
            raise ShardingError(f"{what} {text!r}: axis {name!r} is given twice ({name}={sizes[name]} and "
                                f"{part}); give each axis once")
        if int(value) < 1:
            raise ShardingError(f"{what} {text!r}: axis {name!r} has size {value}; sizes are at least 1")
        sizes[name] = int(value)
    check_count(math.prod(sizes.values()), MAX_HOST_DEVICES, f"{what} {text!r}: devices", ShardingError,
                "a sanity bound on the devices of one mesh")
    return sizes


def check_mesh(sizes: dict[str, int], cfg: LlamaConfig, what: str = "--mesh") -> None:
    """A parsed mesh (parse_mesh: its device count bounded) checked against model `cfg` before any
    device is asked for: the tensor size divides the heads and MLP columns (check_sizes' rules).
    ShardingError naming the argument and the config fields otherwise."""
    problems, _ = _size_problems(cfg, sizes.get("tensor", 1))
    if problems:
        raise ShardingError(f"{what} {mesh_text(sizes)} does not fit the model: " + "; ".join(problems))


def mesh_text(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={n}" for a, n in sizes.items())


def check_batch(rows: int, data: int) -> None:
    """InputError unless `rows` splits evenly over the data axis."""
    if rows % data:
        raise InputError(f"batch of {rows} rows does not divide over the mesh's data axis (size {data}): "
                         f"give a multiple of {data} rows, or a smaller data axis")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A model's layout on a mesh: the rules after the size checks (a logical axis that cannot be
    sharded maps to None) and kv_repeat, the copies kept of each KV head. Static, hashable: it
    is part of the model's graphdef, so each layout compiles its own programs."""
    mesh: Mesh
    rules: tuple          # ((logical axis, mesh axis or None), ...)
    kv_repeat: int = 1
    head_dim: int = 0     # for repeating KV heads
    sums: str = "ordered"  # cross-shard sums: "ordered" (gathered, added in shard order) | "all-reduce"

    @property
    def data(self) -> int:
        return self.mesh.shape.get("data", 1)

    @property
    def tensor(self) -> int:
        return self.mesh.shape.get("tensor", 1)

    def spec(self, *logical) -> P:
        rules = dict(self.rules)
        return P(*(None if a is None else rules.get(a) for a in logical))

    def sharding(self, *logical) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*logical))

    def shard(self, x, *logical):
        """x constrained to the layout of its logical axes (inside a jitted program)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(*logical))

    def replicated(self, tree):
        """Every array of a pytree whole on every device (what the model returns to its caller)."""
        full = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, full), tree)

    def put(self, x, *logical, dtype=None, store=None) -> jax.Array:
        """A host array (a memory-mapped checkpoint tensor included) as a global array laid out by
        its logical axes: each device's block read, rounded to dtype (numpy: round to nearest
        even, as on every platform), kept in `store` (a wider dtype: exact; default dtype) and
        copied on its own."""
        dtype = np.dtype(dtype or x.dtype)
        store = np.dtype(store or dtype)
        sharding = self.sharding(*logical)
        return jax.make_array_from_callback(tuple(x.shape), sharding,
                                            lambda idx: np.asarray(x[idx]).astype(dtype).astype(store))

    def put_batch(self, x) -> jax.Array:
        """A per-row input [B, ...] (ids, mask, positions, injected states) split over `data`."""
        x = np.asarray(x)
        check_batch(x.shape[0] if x.ndim else 1, self.data)
        return self.put(x, *(("batch",) + (None,) * (x.ndim - 1) if x.ndim else ()))

    def put_replicated(self, x) -> jax.Array:
        x = np.asarray(x)
        return self.put(x, *((None,) * x.ndim))

    def weight(self, key: str, w, dtype, store=None) -> jax.Array:
        """Checkpoint tensor `key` in param_dtype (kept in `store`), laid out by PARAM_AXES (KV
        heads repeated)."""
        return self.put(self.as_stored(key, w), *param_axes(key), dtype=dtype, store=store)

    def repeats(self, key: str) -> bool:
        """Whether the weight under checkpoint key `key` is stored with its KV heads repeated."""
        return self.kv_repeat > 1 and ("k_proj." in key or "v_proj." in key)

    def as_stored(self, key: str, w):
        """A checkpoint tensor as the model stores it (KV heads repeated where they are)."""
        return repeat_heads(np.asarray(w), self.kv_repeat, self.head_dim) if self.repeats(key) else w

    def as_checkpoint(self, key: str, w: np.ndarray) -> np.ndarray:
        """A stored tensor back in the checkpoint's shape (each KV head once)."""
        if not self.repeats(key):
            return w
        return self.unrepeat(w.reshape(-1, self.head_dim, *w.shape[1:]), 0).reshape(-1, *w.shape[1:])

    def unrepeat(self, x, axis: int):
        """An array with each KV head kept kv_repeat times along `axis` -> each head once."""
        if self.kv_repeat == 1:
            return x
        index = [slice(None)] * x.ndim
        index[axis] = slice(None, None, self.kv_repeat)
        return x[tuple(index)]


def repeat_heads(w: np.ndarray, r: int, head_dim: int) -> np.ndarray:
    """k_proj / v_proj rows (or bias) [Hkv * D, ...] -> [Hkv * r * D, ...], head j's rows kept as
    heads j*r .. j*r + r - 1, so query head h still reads a copy of KV head h // (Hq / Hkv)."""
    heads = w.shape[0] // head_dim
    return np.repeat(w.reshape(heads, head_dim, *w.shape[1:]), r, axis=0).reshape(heads * r * head_dim,
                                                                                  *w.shape[1:])


SUMS = ("ordered", "all-reduce")


def layout_for(cfg: LlamaConfig, mesh, sums: str = "ordered") -> MeshLayout:
    """The layout of model `cfg` on `mesh` (a Mesh, a {"data": n, "tensor": m} dict or a
    "data=n,tensor=m" string), or ShardingError naming the sizes that do not divide. sums: how
    o_proj's and down_proj's partial sums are added across tensor shards, "ordered" (the
    default: bitwise the same in one process or several) or "all-reduce" (XLA's collective:
    less data moved, an order of its runtime's choosing)."""
    if sums not in SUMS:
        raise ShardingError(f"sums={sums!r}: one of {', '.join(SUMS)}")
    mesh = make_mesh(mesh)
    rules, kv_repeat = check_sizes(cfg, mesh.shape.get("tensor", 1))
    return MeshLayout(mesh, tuple(sorted(rules.items())), kv_repeat, cfg.head_dim, sums)


def check_sizes(cfg: LlamaConfig, tensor: int) -> tuple[dict, int]:
    """(the rules for this model, copies kept of each KV head) at tensor size `tensor`, or
    ShardingError listing every size that does not divide (the module docstring's rules)."""
    problems, kv_repeat = _size_problems(cfg, tensor)
    if problems:
        raise ShardingError(f"tensor={tensor}: " + "; ".join(problems))
    rules = dict(RULES)
    if cfg.vocab_size % tensor:
        rules["vocab"] = None
    return rules, kv_repeat


def _size_problems(cfg: LlamaConfig, t: int) -> tuple[list[str], int]:
    """(each size of `cfg` that does not divide over tensor size t, copies kept of each KV head)."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if heads % t:
        problems.append(f"num_attention_heads {heads} does not divide over tensor={t} "
                        f"(tensor sizes that do: {_divisors(heads)})")
    if cfg.intermediate_size % t:
        problems.append(f"intermediate_size {cfg.intermediate_size} does not divide over tensor={t}")
    kv_repeat = 1
    if kv % t:
        if t % kv:
            problems.append(f"num_key_value_heads {kv} neither divides over tensor={t} nor divides it "
                            "(KV heads are sharded, or each stored tensor / num_key_value_heads times)")
        else:
            kv_repeat = t // kv
    if cfg.qk_norm == "projection" and t > 1:
        problems.append(f"qk_norm 'projection' (model_type {cfg.model_type!r}: q and k normalised over all heads "
                        f"at once) does not split over tensor={t}: its sums would cross the head shards in XLA's "
                        "order; use a data-only mesh (tensor=1)")
    return problems, kv_repeat


def per_device_bytes(state) -> dict:
    """{device: bytes of the state's arrays it holds}: the parameter memory of each device."""
    out: dict = {}
    for leaf in jax.tree.leaves(state):
        for shard in getattr(leaf, "addressable_shards", ()):
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def to_host(x) -> np.ndarray:
    """A jax array as numpy, whole: gathered from every process when it spans several."""
    if getattr(x, "is_fully_addressable", True) or getattr(x, "is_fully_replicated", False):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def row_parallel(layout: MeshLayout, x, w, b, policy: Policy, axis: str, reduce=None, out_dtype=None,
                 sums=ops.linear_sums):
    """ops.linear for a weight [out, in] whose input columns are split over `tensor` (logical axis
    `axis`: "heads" for o_proj, "mlp" for down_proj), x split the same way: every shard's partial
    products in accum_dtype (`sums`: the backend's linear_sums), gathered to every shard (exact),
    added in shard order by `reduce` (default: add_in_order; a planted-bug control replaces it),
    then the bias and one rounding, as ops.linear does. With layout.sums "all-reduce" the partial
    sums go to XLA's psum instead."""
    accum = of(policy.accum_dtype)
    lead = (None,) * (x.ndim - 2)

    in_specs = (layout.spec("batch", *lead, axis), layout.spec(None, axis))
    if layout.sums == "all-reduce":
        y = jax.shard_map(lambda x, w: jax.lax.psum(sums(x, w, policy), "tensor"), mesh=layout.mesh,
                          in_specs=in_specs, out_specs=layout.spec("batch", *lead, None))(x, w)
    else:
        def partial_sums(x, w):
            return jax.lax.all_gather(sums(x, w, policy), "tensor")

        parts = jax.shard_map(partial_sums, mesh=layout.mesh, in_specs=in_specs,
                              # all_gather's result is the same on every tensor shard (not inferred)
                              out_specs=layout.spec(None, "batch", *lead, None), check_vma=False)(x, w)
        y = (reduce or add_in_order)(parts)
    if b is not None:
        y = y + b.astype(accum)
    return y.astype(out_dtype or of(policy.compute_dtype))


def per_shard_attention(layout: MeshLayout, attention, q, k, v, allowed):
    """attention(q, k, v, allowed) (a custom call XLA cannot partition: fast's fused kernel) on each
    device's shard: rows of the batch over `data`, query and KV heads over `tensor` (a shard's query
    heads read its own KV heads, as GQA maps them). The kernel's result for a row and a KV head
    depends on nothing else (attention.h), so the sharded result is bitwise the one-device one.
    k, v may be pytrees (fast.Weight: a widened cache): the spec covers each."""
    heads, kv = layout.spec("batch", None, "heads", None), layout.spec("batch", None, "kv_heads", None)
    return jax.shard_map(attention, mesh=layout.mesh,
                         in_specs=(heads, kv, kv, layout.spec("batch", None, None)), out_specs=heads)(
                             q, k, v, allowed)


def add_in_order(parts):
    """parts [n, ...] -> parts[0] + parts[1] + ... + parts[n - 1], added left to right."""
    y = parts[0]
    for i in range(1, parts.shape[0]):
        y = y + parts[i]
    return y
