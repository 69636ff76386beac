"""Generic adapters: a user's own port under the Implementation protocol, with no class to write.

    TorchModule(module, {"layers.{i}.attn_out": "model.layers.{i}.self_attn", ...})
        a PyTorch module tree and a map from tap names to submodule paths (forward hooks);
        "pre:<path>" taps a module's input instead of its output; "<path>#n" its n-th call
        (from 0) inside the tap's layer, for a module that runs more than once per layer
    JaxFunction(fn, params, taps=("embed", "layers.{i}.out", ...), num_layers=L)
        a plain JAX function fn(params, ids, mask, positions) -> (logits, {tap: array})
    NnxModule(module, {"layers.{i}.out": "layers.{i}", ...})
        a Flax NNX module: outputs of its submodules (nnx.capture with method_outputs) and
        values it sows itself ("sow:<path>.<name>")
    LinenModule(module, variables, {"layers.{i}.out": "layers_{i}", ...})
        a Flax linen module: capture_intermediates=True, paths into the intermediates tree

Every adapter takes (tokens, attention_mask), checks them (llamaspec.inputs.check_token_array)
and hands the port position ids = llamaspec.positions_from_mask(mask): real tokens count
from 0 whatever the padding side, as torchref and jaxmodel compute them. Outputs are numpy.
Tap names in a map may hold "{i}" (every layer) and must be names of the shared vocabulary
(llamaspec.taps); per-head taps (q, k, v, q_rope, k_rope) come out [B, T, heads, head_dim]
(reshaped with head_dim when the port gives [B, T, heads * head_dim]).

inject {layer: hidden [B, T, D]} (teacher forcing) replaces a decoder layer's input where
the adapter can: TorchModule by a forward pre-hook on the layer module (inject_map, or the
path of "layers.{i}.out"); JaxFunction, NnxModule and LinenModule when the user's function
takes an `inject` keyword. `supports_inject` says which; capture(..., inject=...) on an
adapter without it is a NotImplementedError naming the way to add it.

float64(): the same port computing in float64 where the framework allows: a deep copy of
the torch module cast with .to(torch.float64) (with the checkpoint's own weights at float64
when the module holds them rounded to bf16/fp16 and the checkpoint is known:
checkpoint_weights); JAX params cast to float64 and every call run under
jax.enable_x64(True) (a JAX port's params are cast as they are: bf16 params stay rounded,
which the ladder finds by the embed tap and says). Code that hard-codes a narrower dtype
keeps it (say so with keeps_f32=True: its float64 run keeps f32 steps, as transformers'
does; the ladder infers it from the twin's numbers otherwise, compare.ladder.twins).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import warnings
import weakref

import numpy as np

from llamaspec import load_weights, positions_from_mask
from llamaspec import taps as tapnames
from llamaspec.inputs import check_token_array

from .errors import PortError

# The module paths of a Hugging Face-layout Llama (transformers' LlamaForCausalLM, and the
# Mistral/Qwen2-style models that share its names). q_rope/k_rope have no module boundary
# there (RoPE is a function inside the attention's forward).
HF_LLAMA_TAPS = {
    "embed": "model.embed_tokens",
    "layers.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "layers.{i}.q": "model.layers.{i}.self_attn.q_proj",
    "layers.{i}.k": "model.layers.{i}.self_attn.k_proj",
    "layers.{i}.v": "model.layers.{i}.self_attn.v_proj",
    "layers.{i}.attn_ctx": "pre:model.layers.{i}.self_attn.o_proj",
    "layers.{i}.attn_out": "model.layers.{i}.self_attn.o_proj",
    "layers.{i}.resid_mid": "pre:model.layers.{i}.post_attention_layernorm",
    "layers.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm",
    "layers.{i}.gate": "model.layers.{i}.mlp.gate_proj",
    "layers.{i}.up": "model.layers.{i}.mlp.up_proj",
    "layers.{i}.act": "pre:model.layers.{i}.mlp.down_proj",
    "layers.{i}.mlp_out": "model.layers.{i}.mlp",
    "layers.{i}.out": "model.layers.{i}",
    "final_norm": "model.norm",
    "logits": "lm_head",
}

_VALID = ("embed, layers.{i}.<" + "|".join(tapnames.STEPS) + ">, final_norm, logits "
          "({i}: every layer, or a layer number)")


def _vocabulary(num_layers: int) -> tapnames.Vocabulary:
    """The taps a port may name: every family's steps (llamaspec.taps.STEPS) at every layer (a
    glob expands over a Llama's steps: name a family's own steps, e.g. layers.{i}.q_norm, to map them)."""
    return tapnames.Vocabulary(num_layers, tapnames.STEPS)


# ----- what a port is handed -----------------------------------------------------------------

def read_only(a) -> np.ndarray:
    """A copy of `a` that cannot be written: a view of a frozen copy, so that even its
    writeable flag cannot be set back (numpy refuses it on a view of a read-only base)."""
    base = np.array(a, copy=True)
    base.flags.writeable = False
    return base.view()


class HandedOver:
    """A caller's arrays as a port receives them: read-only copies (the caller's own are never
    handed over), and their values kept, so that `call` can name a port that changed them
    anyway (through torch.from_numpy, ctypes, or by writing into a read-only array)."""

    def __init__(self, **arrays):
        self.arrays = {k: None if a is None else read_only(a) for k, a in arrays.items()}
        self._kept = {k: None if a is None else a.copy() for k, a in self.arrays.items()}

    def __getitem__(self, key):
        return self.arrays[key]

    @contextlib.contextmanager
    def call(self, name: str):
        """Runs a call of port `name`; a write into what it was handed (a ValueError from numpy
        inside the port, or values changed after it) is a PortError naming the port."""
        with refused_writes(name):
            yield self
        changed = [k for k, a in self.arrays.items() if a is not None and not np.array_equal(a, self._kept[k])]
        if changed:
            _wrote_into_inputs(name, f"changed {', '.join(changed)} in place")


@contextlib.contextmanager
def refused_writes(name: str):
    """numpy's "read-only" ValueError raised inside port `name` -> PortError naming it."""
    try:
        yield
    except ValueError as e:
        if "read-only" not in str(e) and "WRITEABLE" not in str(e):
            raise
        _wrote_into_inputs(name, f"wrote into a read-only array ({e})")


def _wrote_into_inputs(name: str, what: str):
    raise PortError(f"{name}: {what}: a port must not change the inputs it is given (the token ids, attention "
                    "mask and positions are handed over read-only; copy them before changing them), or the "
                    "other side of the comparison would be judged on different inputs") from None


def unchanged_tensors(name: str, given: dict) -> None:
    """{what: (torch tensor handed to port `name`, numpy values it was made from)}: a
    PortError naming the port when it changed one in place."""
    import torch  # torch: slow import; JAX ports never load it
    changed = [k for k, (t, a) in given.items() if not torch.equal(t.detach().cpu(), torch.from_numpy(a))]
    if changed:
        _wrote_into_inputs(name, f"changed {', '.join(changed)} in place")


# ----- tap names ---------------------------------------------------------------------------

def _layer_count(names, num_layers, what) -> int:
    """num_layers as given, else 1 + the highest layer a concrete name names."""
    if num_layers is not None:
        return int(num_layers)
    if any("{i}" in n or any(c in n for c in "*?[") for n in names):
        raise ValueError(f"{what}: num_layers is needed to expand "
                         f"{[n for n in names if '{i}' in n or any(c in n for c in '*?[')]}")
    layers = [tapnames.layer_of(n) for n in names if tapnames.layer_of(n) is not None]
    return max(layers) + 1 if layers else 0


def expand_taps(names, num_layers: int, what: str = "taps") -> tuple[str, ...]:
    """Names with "{i}" (every layer) or globs -> concrete vocabulary names, in execution
    order; a name outside the vocabulary (every family's steps) is a ValueError listing the valid
    ones. A glob expands over a Llama's steps (a family's own steps are named)."""
    valid = tapnames.all_taps(_vocabulary(num_layers))
    out = []
    for name in names:
        if "{i}" in name:
            hits = [name.replace("{i}", str(i)) for i in range(num_layers)]
            if num_layers == 0 or any(h not in valid for h in hits):
                raise ValueError(f"{what}: '{name}' is not a tap name of the shared vocabulary; tap names are "
                                 f"{_VALID}")
        else:
            glob = any(c in name for c in "*?[")
            try:
                hits = list(tapnames.resolve([name], num_layers if glob else _vocabulary(num_layers)))
            except KeyError:
                raise ValueError(f"{what}: '{name}' is not a tap name of the shared vocabulary for a "
                                 f"{num_layers}-layer model; tap names are {_VALID}") from None
        out += [h for h in hits if h not in out]
    order = {n: i for i, n in enumerate(valid)}
    return tuple(sorted(out, key=order.__getitem__))


def _expand_map(taps_map: dict, num_layers: int, what: str) -> dict[str, str]:
    """{tap pattern: path pattern} -> {concrete tap: concrete path}, execution order."""
    out = {}
    for pattern, path in taps_map.items():
        for tap in expand_taps([pattern], num_layers, what):
            layer = tapnames.layer_of(tap)
            out[tap] = path.replace("{i}", str(layer)) if layer is not None else path
    order = {n: i for i, n in enumerate(tapnames.all_taps(_vocabulary(num_layers)))}
    return dict(sorted(out.items(), key=lambda kv: order[kv[0]]))


class _Port:
    """What every generic adapter shares: tap selection, input checks, results."""

    keeps_f32 = False
    supports_inject = False
    num_layers = 0
    vocab_size = None
    head_dim = None

    def resolve(self, requested) -> tuple[str, ...]:
        """Names and globs -> concrete taps this port returns; an explicitly named tap it
        does not return is a KeyError listing the ones it does."""
        return tapnames.select(requested, _vocabulary(self.num_layers), self.taps, lambda pattern, _: (
            f"tap '{pattern}' is not returned by {self.name}; it returns: {', '.join(self.taps) or 'nothing'}"))

    def _set_taps(self, taps):
        self.taps = tuple(taps)

    def _count_layers(self, given, prefix: str):
        """num_layers as given, else the length of the container a "{i}" path indexes
        (after its `prefix`), else the module's config; 0 when no tap needs layers."""
        if given is not None:
            return int(given)
        for path in self.taps_map.values():
            head = path.removeprefix(prefix)
            if "{i}" in head:
                return len(_walk(self.module, head.split(".{i}")[0], "num_layers"))
        found = _config_value(self.module, "num_hidden_layers")
        if found is None and any("{i}" in t for t in self.taps_map):
            raise ValueError(f"{self.name}: pass num_layers (no path holds '{{i}}' to count them by)")
        return int(found or 0)

    def _inputs(self, tokens, attention_mask):
        vocab = self.vocab_size if self.vocab_size is not None else np.iinfo(np.int64).max
        ids, mask = check_token_array(tokens, attention_mask, vocab)     # copies, never the caller's
        return read_only(ids), read_only(mask), read_only(positions_from_mask(mask))

    def _inject(self, inject, ids) -> dict[int, np.ndarray]:
        if not inject:
            return {}
        if not self.supports_inject:
            raise NotImplementedError(f"{self.name} cannot take inject (teacher forcing): {self._no_inject}")
        out = {}
        for layer, x in inject.items():
            if not (isinstance(layer, (int, np.integer)) and 0 <= layer < self.num_layers):
                raise ValueError(f"inject: layer {layer!r} is not in 0..{self.num_layers - 1}")
            x = np.asarray(x) if not hasattr(x, "shape") else x
            if tuple(x.shape[:2]) != tuple(ids.shape) or len(x.shape) != 3:
                raise ValueError(f"inject[{layer}]: shape {tuple(x.shape)}, expected ({ids.shape[0]}, "
                                 f"{ids.shape[1]}, hidden)")
            out[int(layer)] = x
        return out

    def _per_head(self, tap, x: np.ndarray) -> np.ndarray:
        if tapnames.parse(tap)[1] not in tapnames.PER_HEAD or x.ndim != 3:
            return x
        if not self.head_dim:
            raise ValueError(f"{self.name}: tap '{tap}' came out {x.shape}; per-head taps are [B, T, heads, "
                             "head_dim]: pass head_dim= so that it can be reshaped")
        return x.reshape(*x.shape[:2], -1, self.head_dim)

    def _finish(self, logits, acts: dict, wanted, where: dict | None = None):
        missing = [t for t in wanted if t not in acts]
        if missing:
            said = "; ".join(f"'{t}' ({where[t]})" for t in missing) if where else ", ".join(missing)
            raise RuntimeError(f"{self.name}: taps not produced: {said}: the forward never reached them")
        return np.asarray(logits), {t: self._per_head(t, np.asarray(acts[t])) for t in wanted}


def _parameters(fn) -> dict:
    """fn's parameters by name ({} when its signature cannot be read)."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _accepts(fn, name: str) -> bool:
    return name in _parameters(fn)   # named: a **kwargs catch-all does not say it uses the argument


def _takes_any_keyword(fn) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in _parameters(fn).values())


def _config_value(obj, *names):
    cfg = getattr(obj, "config", None) or getattr(obj, "cfg", None)
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


# ----- PyTorch ------------------------------------------------------------------------------

def _walk(root, path: str, tap: str):
    """The object at a dotted path (attributes, or indices into lists / ModuleLists / dicts);
    a path that does not exist is a LookupError naming the tap, the path and what is there."""
    obj = root
    done = []
    for part in path.split(".") if path else []:
        nxt = getattr(obj, part, None) if not part.isdigit() else None
        if nxt is None:
            try:
                nxt = obj[int(part)] if part.isdigit() else obj[part]
            except (IndexError, KeyError, TypeError):
                nxt = None
        if nxt is None:
            here = ".".join(done) or "the module"
            children = _children(obj)
            raise LookupError(f"tap '{tap}': path '{path}' does not exist: {here} has no '{part}'"
                              + (f" (it has: {', '.join(children)})" if children else ""))
        obj = nxt
        done.append(part)
    return obj


def _children(obj) -> list[str]:
    named = getattr(obj, "named_children", None)
    if callable(named):
        return [n for n, _ in named()]
    if isinstance(obj, (list, tuple)):
        return [str(i) for i in range(len(obj))]
    if isinstance(obj, dict):
        return [str(k) for k in obj]
    if hasattr(obj, "__len__") and hasattr(obj, "__getitem__"):   # nnx.List and the like
        return [str(i) for i in range(len(obj))]
    # a plain module object (Flax NNX): attributes that are modules or lists of them
    return [k for k, v in vars(obj).items() if not k.startswith("_") and not hasattr(v, "shape")
            and (callable(v) or hasattr(v, "__getitem__") and not isinstance(v, (str, bytes)))] \
        if hasattr(obj, "__dict__") else []


def first_tensor(x, what):
    """A module's output (or input): the tensor itself or element 0 of (nested) tuples."""
    import torch  # torch: slow import; JAX ports never load it
    while isinstance(x, (tuple, list)) and x:
        x = x[0]
    if not isinstance(x, torch.Tensor):
        raise RuntimeError(f"{what}: the module gave a {type(x).__name__}, not a tensor")
    return x


def first_input(args, kwargs, what):
    """The first positional input, else the first tensor keyword, of a hooked call."""
    import torch  # torch: slow import; JAX ports never load it
    if args:
        return first_tensor(args[0], what)
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v
    raise RuntimeError(f"{what}: the module was called without a tensor input")


def _torch_numpy(t):
    from torchref.dtypes import to_numpy  # torchref imports torch (loaded: t is a tensor)
    return to_numpy(t).copy()


def _call_index(path: str, tap: str) -> tuple[str, int | None]:
    """"<path>#n" -> (path, n); a path without "#" -> (path, None)."""
    if "#" not in path:
        return path, None
    m = re.fullmatch(r"(.+)#(\d+)", path)
    if m is None:
        raise ValueError(f"tap '{tap}': path '{path}': a call index is '#' and a number at the end "
                         "(e.g. 'layers.0.attn.pos_embeddings#1', the second call, from 0)")
    return m.group(1), int(m.group(2))


def forcing_hook(h):
    """Forward pre-hook (with_kwargs): the layer's hidden-state input, positional or the
    keyword hidden_states (else the first tensor keyword), becomes h in its dtype/device."""
    import torch  # torch: slow import; JAX ports never load it

    def pre(module, args, kwargs):
        if args:
            x = args[0]
            return (h.to(device=x.device, dtype=x.dtype), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(
            (k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
        if key is None:
            raise RuntimeError(f"inject: {type(module).__name__} was called without a tensor input")
        x = kwargs[key]
        return args, {**kwargs, key: h.to(device=x.device, dtype=x.dtype)}
    return pre


def default_torch_forward(module, ids, mask, positions):
    """module(input_ids=, attention_mask=, position_ids=[, use_cache=False]) where its forward
    takes those keywords; .logits, element 0 of a tuple, or the tensor itself.

    Nothing it was given is dropped without a word: a forward without `input_ids` is called as
    module(ids) only for a batch without padding (mask all ones, positions 0..T-1: nothing to
    hand over), with a warning; a padded batch is a ValueError, as is one whose positions are
    not 0..T-1 (left or interior padding) for a forward that takes no `position_ids`. Pass
    forward= to hand such a port the mask and positions its own way."""
    fwd = getattr(module, "forward", module)
    padded = not bool(mask.all())
    if not _accepts(fwd, "input_ids"):
        if padded:
            raise ValueError(f"its forward{_signature(fwd)} takes no input_ids / attention_mask keywords, so the "
                             "default forward cannot hand it this batch's padding mask and positions; pass "
                             "forward=lambda module, ids, mask, positions: ... (docs/ports.md), or unpadded input")
        _warn_once(module, f"{type(module).__name__}: its forward{_signature(fwd)} takes no input_ids keyword: "
                   "called as module(ids) without the attention mask and positions (this batch has no padding, so "
                   "nothing is lost); a padded batch will be refused. Pass forward= to hand them over")
        out = module(ids)
    else:
        kw = {"input_ids": ids}
        if _accepts(fwd, "attention_mask") or _takes_any_keyword(fwd):
            kw["attention_mask"] = mask
        elif padded:
            raise ValueError(f"its forward{_signature(fwd)} takes no attention_mask keyword, so the default forward "
                             "cannot hand it this batch's padding; pass forward=... (docs/ports.md), or unpadded input")
        if _accepts(fwd, "position_ids"):
            kw["position_ids"] = positions
        elif padded and not bool((positions == torch_arange_like(positions))[mask.bool()].all()):
            raise ValueError(f"its forward{_signature(fwd)} takes no position_ids keyword, and this batch's positions "
                             "are not 0..T-1 (left or interior padding); pass forward=... (docs/ports.md), or right "
                             "padding")
        if _accepts(fwd, "use_cache"):
            kw["use_cache"] = False
        out = module(**kw)
    out = getattr(out, "logits", out)
    return first_tensor(out, "logits")


def torch_arange_like(positions):
    """0..T-1 in every row of a [B, T] position tensor."""
    import torch  # torch: slow import; JAX ports never load it
    return torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


_WARNED = weakref.WeakKeyDictionary()     # module -> the messages it was warned with


def _warn_once(module, message: str) -> None:
    """One warning per module object and message, not one per capture (a module gone, its entry
    goes: an id reused by a new module does not silence that one's warning)."""
    said = _WARNED.setdefault(module, set())
    if message not in said:
        said.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


class TorchModule(_Port):
    """A PyTorch module tree and a map {tap name: submodule path} read by forward hooks.

    taps_map: e.g. {"embed": "model.embed_tokens", "layers.{i}.attn_out":
    "model.layers.{i}.self_attn", "logits": "lm_head"} (HF_LLAMA_TAPS is the whole map for a
    Hugging Face-layout Llama). A path is a submodule's output (element 0 of a tuple);
    "pre:<path>" is its first input. "<path>#n" is the module's n-th call (from 0) while the
    tap's layer runs (the layers: inject_map's modules), or in the whole forward for a tap
    outside the layers: a module that runs more than once per layer, such as one RoPE module
    shared by every attention and called for q then k ("layers.{i}.q_rope":
    "layers.{i}.attn.pos_embeddings#0", "layers.{i}.k_rope": "...#1"); a module mapped
    without "#n" must run once per forward. forward(module, ids, mask, positions) -> logits tensor
    (default_torch_forward by default; ids, mask, positions are int64 tensors on the
    module's device). num_layers: counted from the container that "{i}" indexes, or the
    module's config. inject_map: the decoder layer path ("model.layers.{i}") whose first
    input inject replaces; by default the path of "layers.{i}.out". head_dim reshapes
    per-head taps (default: the module's config). checkpoint: the folder the module was
    loaded from, for float64() to read the weights at full precision (see there). config: the
    architecture as the port computes it (hidden_size, num_hidden_layers, ...), for the
    report's config check and `probe where`; by default the module's own `config` when it has
    a hidden_size.
    """

    def __init__(self, module, taps_map: dict, name: str | None = None, forward=None, num_layers: int | None = None,
                 inject_map: str | None = None, head_dim: int | None = None, vocab_size: int | None = None,
                 keeps_f32: bool = False, checkpoint=None, config=None):
        self.module = module
        self.checkpoint = checkpoint
        own = getattr(module, "config", None)
        self.config = config if config is not None else own if getattr(own, "hidden_size", None) else None
        self.taps_map = dict(taps_map)
        self.name = name or type(module).__name__
        self.forward = forward or default_torch_forward
        self.keeps_f32 = keeps_f32
        self.vocab_size = vocab_size if vocab_size is not None else _config_value(module, "vocab_size")
        self.head_dim = head_dim or _config_value(module, "head_dim")
        if not self.head_dim and _config_value(module, "num_attention_heads"):
            self.head_dim = _config_value(module, "hidden_size") // _config_value(module, "num_attention_heads")
        self.num_layers = self._count_layers(num_layers, "pre:")
        self.paths = _expand_map(self.taps_map, self.num_layers, f"{self.name} taps_map")
        out_path = self.taps_map.get("layers.{i}.out", "")
        self.inject_map = inject_map or (out_path if out_path and not out_path.startswith("pre:") else None)
        self.supports_inject = self.inject_map is not None
        self._no_inject = ("name the decoder layers with inject_map='model.layers.{i}' (or map 'layers.{i}.out' "
                           "to them), or compare with teacher_forcing=False")
        self._layers = ([_walk(module, self.inject_map.replace("{i}", str(i)), f"inject_map layer {i}")
                         for i in range(self.num_layers)] if self.supports_inject else [])
        self._targets = {}
        for tap, path in self.paths.items():
            where, call = _call_index(path, tap)
            if call is not None and tapnames.layer_of(tap) is not None and not self._layers:
                raise ValueError(f"{self.name}: tap '{tap}' ({path}) counts calls inside its layer: name the decoder "
                                 "layers with inject_map='model.layers.{i}' (or map 'layers.{i}.out' to them)")
            self._targets[tap] = (_walk(module, where.removeprefix("pre:"), tap),
                                  "pre" if where.startswith("pre:") else "post", call)
        self._set_taps(self.paths)

    def _device(self):
        p = next(iter(self.module.parameters()), None) if hasattr(self.module, "parameters") else None
        return p.device if p is not None else "cpu"

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        import torch  # torch: slow import; JAX ports never load it

        wanted = self.resolve(taps)
        ids, mask, pos = self._inputs(tokens, attention_mask)
        forced = self._inject(inject, ids)
        dev = self._device()
        acts, fired, handles = {}, {}, []
        running = []          # the layers whose forward is running (innermost last)
        calls = {}            # tap -> calls of its module seen inside its layer (or the forward)

        def counted(tap, call) -> bool:
            """Whether this call of the tap's module is the one the tap reads."""
            if call is None:
                fired[tap] = fired.get(tap, 0) + 1
                return True
            layer = tapnames.layer_of(tap)
            if layer is not None and (not running or running[-1] != layer):
                return False
            seen = calls[tap] = calls.get(tap, -1) + 1
            if seen == call:
                fired[tap] = fired.get(tap, 0) + 1
            return seen == call

        def record(tap, when, call):
            def post(module, args, kwargs, output):
                if counted(tap, call):
                    acts[tap] = _torch_numpy(first_tensor(output, tap))

            def pre(module, args, kwargs):
                if counted(tap, call):
                    acts[tap] = _torch_numpy(first_input(args, kwargs, tap))
            return pre if when == "pre" else post

        def entering(i):
            def pre(module, args, kwargs):
                running.append(i)
            return pre

        def leaving(module, args, kwargs, output):
            running.pop()

        try:
            if any(self._targets[t][2] is not None for t in wanted):
                for i, layer in enumerate(self._layers):
                    handles.append(layer.register_forward_pre_hook(entering(i), with_kwargs=True))
                    handles.append(layer.register_forward_hook(leaving, with_kwargs=True))
            for i, h in forced.items():   # first, so the layer's own taps see the forced input
                h = h.clone() if isinstance(h, torch.Tensor) else torch.from_numpy(np.array(h))   # the port's own
                handles.append(self._layers[i].register_forward_pre_hook(forcing_hook(h), with_kwargs=True))
            for tap in wanted:
                mod, when, call = self._targets[tap]
                hook = record(tap, when, call)
                handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True) if when == "pre"
                               else mod.register_forward_hook(hook, with_kwargs=True))
            given = [a.astype(np.int64) for a in (ids, mask, pos)]
            t = [torch.from_numpy(a.copy()).to(dev) for a in given]     # fresh tensors: the port's own
            with torch.no_grad(), refused_writes(self.name):
                logits = self.forward(self.module, *t)
        finally:
            for h in handles:
                h.remove()
        unchanged_tensors(self.name, dict(zip(("input_ids", "attention_mask", "position_ids"), zip(t, given))))
        twice = {t: n for t, n in fired.items() if n > 1}
        if twice:
            raise RuntimeError(f"{self.name}: " + "; ".join(f"tap '{t}' ({self.paths[t]}) fired {n} times"
                                                          for t, n in twice.items())
                               + " in one forward: map a module called once per forward, or name the call "
                               "(a path ending in '#n', the n-th call inside the tap's layer, from 0)")
        return self._finish(_torch_numpy(first_tensor(logits, "logits")), acts, wanted, self.paths)

    def float64(self, checkpoint=None) -> "TorchModule":
        """A deep copy cast to float64 (the module is left as given); same maps. Hooks the
        user registered on the module are copied with it.

        The twin's contract is the checkpoint's weights at float64. A bf16/fp16 module holds
        them rounded, and a cast keeps the rounding; so when a checkpoint folder is known (this
        argument, the constructor's, or the ladder's: compare.adapters.Checked hands it over)
        and every floating parameter is the checkpoint's tensor of the same name rounded to the
        module's dtype, the twin gets the checkpoint's values instead. A module whose names are
        not the checkpoint's keys, or whose weights were changed, keeps its own (the ladder then
        finds a twin of rounded weights by its embed tap and runs without it)."""
        import torch  # torch: slow import; JAX ports never load it
        twin = copy.deepcopy(self.module).to(torch.float64)
        if getattr(getattr(twin, "config", None), "dtype", None) is not None:
            twin.config.dtype = torch.float64
        checkpoint = checkpoint if checkpoint is not None else self.checkpoint
        if checkpoint is not None:
            checkpoint_weights(twin, self.module, checkpoint)
        return TorchModule(twin, self.taps_map, self.name, self.forward, self.num_layers, self.inject_map,
                           self.head_dim, self.vocab_size, self.keeps_f32, checkpoint,
                           None if self.config is getattr(self.module, "config", None) else self.config)


def checkpoint_weights(twin, module, checkpoint) -> bool:
    """Gives `twin` (module's float64 copy) the checkpoint's weights at float64 when `module`
    holds them rounded to bf16/fp16: every floating parameter named as a checkpoint key, of its
    shape, equal to that tensor rounded to the parameter's dtype. True when it did; False (twin
    untouched) for a module already at float32 or wider, or one that does not hold exactly the
    checkpoint's rounded tensors (its own names or changes: it keeps its weights)."""
    import torch  # torch: slow import; JAX ports never load it
    params = dict(module.named_parameters())
    if not params or not any(p.dtype in (torch.bfloat16, torch.float16) for p in params.values()):
        return False
    _, weights = load_weights(checkpoint, check_finite=False)
    for name, p in params.items():
        w = weights.get(name)
        if w is None or tuple(w.shape) != tuple(p.shape) or not torch.equal(
                torch.from_numpy(np.array(w, np.float32)).to(p.dtype), p.detach().cpu()):
            return False
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(torch.from_numpy(np.array(weights[name], np.float64)))
    return True


# ----- JAX ----------------------------------------------------------------------------------

def _x64_leaf(x):
    dtype = getattr(x, "dtype", None)
    if dtype is not None and np.issubdtype(np.dtype(dtype), np.inexact) or str(dtype) == "bfloat16":
        if len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1:
            # a sharded jax array stays sharded alike (no gathered host copy): cast where it lies
            # jax: slow import, after XLA_FLAGS are set; torch ports never load it
            import jax
            import jax.numpy as jnp
            with jax.enable_x64(True):
                return x.astype(jnp.float64)
        return np.asarray(x).astype(np.float64)
    return x


def _x64(tree):
    """Floating leaves of a pytree as float64 numpy (jax turns them into float64 arrays
    when called under jax.enable_x64)."""
    import jax  # jax: slow import, after XLA_FLAGS are set; torch ports never load it
    return jax.tree_util.tree_map(_x64_leaf, tree)


class _X64:
    """Runs a call under jax.enable_x64(True) (or does nothing)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            import jax  # jax: slow import, after XLA_FLAGS are set; torch ports never load it
            self._ctx = jax.enable_x64(True)
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self.on:
            return self._ctx.__exit__(*exc)
        return False


def _jax_arrays(forced: dict, x64: bool) -> dict:
    """Teacher forcing's layer inputs {layer: array} as jax arrays, float64 where the port runs in x64."""
    import jax.numpy as jnp  # jax: slow import, after XLA_FLAGS are set; torch ports never load it
    return {i: jnp.asarray(np.asarray(x).astype(np.float64) if x64 else x) for i, x in forced.items()}


class JaxFunction(_Port):
    """A plain JAX function fn(params, ids, mask, positions) -> (logits, {tap: array}) that
    returns its own intermediates under the shared tap names.

    taps: the names it returns ("layers.{i}.out" for every layer, or globs); num_layers
    expands them. ids, mask, positions arrive as int32 numpy [B, T]. When fn takes a `taps`
    keyword it is given the names wanted; when it takes `inject`, {layer: hidden} (jax
    arrays) for teacher forcing. float64(): params cast to float64, calls under
    jax.enable_x64(True).
    """

    def __init__(self, fn, params, name: str | None = None, taps=(), num_layers: int | None = None,
                 head_dim: int | None = None, vocab_size: int | None = None, keeps_f32: bool = False,
                 x64: bool = False):
        self.fn, self.params = fn, params
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.tap_patterns = tuple([taps] if isinstance(taps, str) else taps)
        self.num_layers = _layer_count(self.tap_patterns, num_layers, self.name)
        self._set_taps(expand_taps(self.tap_patterns, self.num_layers, f"{self.name} taps"))
        self.head_dim, self.vocab_size, self.keeps_f32, self.x64 = head_dim, vocab_size, keeps_f32, x64
        self.supports_inject = _accepts(fn, "inject")
        self._takes_taps = _accepts(fn, "taps")
        self._no_inject = "give the function an inject={layer: hidden} keyword, or compare with teacher_forcing=False"

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        ids, mask, pos = self._inputs(tokens, attention_mask)
        forced = self._inject(inject, ids)
        kw = {"taps": wanted} if self._takes_taps else {}
        with _X64(self.x64):
            if forced:
                kw["inject"] = _jax_arrays(forced, self.x64)
            handed = HandedOver(ids=ids.astype(np.int32), mask=mask.astype(np.int32), positions=pos)
            with handed.call(self.name):
                logits, acts = self.fn(self.params, handed["ids"], handed["mask"], handed["positions"], **kw)
            return self._finish(logits, dict(acts), wanted)

    def float64(self) -> "JaxFunction":
        return JaxFunction(self.fn, _x64(self.params), self.name, self.tap_patterns, self.num_layers,
                           self.head_dim, self.vocab_size, self.keeps_f32, x64=True)


# ----- Flax NNX -----------------------------------------------------------------------------

def _nnx_default_forward(module, ids, mask, positions):
    return module(ids, mask, positions)


def _nnx_forward_inject(module, ids, mask, positions, inject=None):
    return module(ids, mask, positions, inject=inject)


def _linen_apply(module, variables, ids, mask, positions, **kw):
    return module.apply(variables, ids, mask, positions, **kw)


def _linen_apply_inject(module, variables, ids, mask, positions, inject=None, **kw):
    return module.apply(variables, ids, mask, positions, inject=inject, **kw)


def _tree_get(tree, parts):
    """tree[parts[0]][parts[1]]..., None where a key is missing."""
    node = tree
    for p in parts:
        try:
            node = node[int(p)] if p.isdigit() and not _has_key(node, p) else node[p]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _has_key(node, key) -> bool:
    try:
        return key in node
    except TypeError:
        return False


def _value(v):
    """A sown or captured value: nnx Variable / tuple of calls -> the one array."""
    v = getattr(v, "value", v) if not hasattr(v, "shape") else v
    if hasattr(v, "get_value"):
        v = v.get_value()
    return v


class NnxModule(_Port):
    """A Flax NNX module and a map {tap name: path}.

    "<path>" (e.g. "layers.{i}.self_attn"): the output of that submodule's __call__
    (element 0 of a tuple), captured with nnx.capture(..., method_outputs=nnx.Intermediate);
    "sow:<path>.<name>": a value the module sows itself (self.sow(nnx.Intermediate, name, x)
    in the module at <path>; "sow:<name>" at the top). A module's inputs cannot be tapped
    (sow them). forward(module, ids, mask, positions) -> logits (default module(ids, mask,
    positions)); a forward with an `inject` keyword takes teacher forcing. float64(): the
    state cast to float64 (nnx.split / merge on a copy), calls under jax.enable_x64(True).
    """

    def __init__(self, module, taps_map: dict, name: str | None = None, forward=None, num_layers: int | None = None,
                 head_dim: int | None = None, vocab_size: int | None = None, keeps_f32: bool = False,
                 x64: bool = False):
        self.module, self.taps_map = module, dict(taps_map)
        self.name = name or type(module).__name__
        self.forward = forward or (_nnx_forward_inject if _accepts(type(module).__call__, "inject")
                                   else _nnx_default_forward)
        self.num_layers = self._count_layers(num_layers, "sow:")
        self.paths = _expand_map(self.taps_map, self.num_layers, f"{self.name} taps_map")
        self._set_taps(self.paths)
        self.head_dim = head_dim or _config_value(module, "head_dim")
        self.vocab_size = vocab_size if vocab_size is not None else _config_value(module, "vocab_size")
        self.keeps_f32, self.x64 = keeps_f32, x64
        self.supports_inject = _accepts(self.forward, "inject")
        self._takes_taps = _accepts(self.forward, "taps")
        self._no_inject = "give forward an inject={layer: hidden} keyword, or compare with teacher_forcing=False"
        for tap, path in self.paths.items():
            if not path.startswith("sow:"):
                _walk(module, path, tap)

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        from flax import nnx  # flax (jax): slow import; only NNX ports load it

        wanted = self.resolve(taps)
        ids, mask, pos = self._inputs(tokens, attention_mask)
        forced = self._inject(inject, ids)
        kw = {"taps": wanted} if self._takes_taps else {}
        outputs = any(not self.paths[t].startswith("sow:") for t in wanted)
        with _X64(self.x64):
            if forced:
                import jax.numpy as jnp
                kw["inject"] = {i: jnp.asarray(np.asarray(x).astype(np.float64) if self.x64 else x)
                                for i, x in forced.items()}
            handed = HandedOver(ids=ids.astype(np.int32), mask=mask.astype(np.int32), positions=pos)
            run = nnx.capture(lambda m: self.forward(m, handed["ids"], handed["mask"], handed["positions"], **kw),
                              nnx.Intermediate, method_outputs=nnx.Intermediate if outputs else None)
            with handed.call(self.name):
                logits, state = run(self.module)
            tree = nnx.to_pure_dict(state)
            acts = {}
            for tap in wanted:
                path = self.paths[tap]
                if path.startswith("sow:"):
                    found = _tree_get(tree, path[4:].split("."))
                else:
                    found = _tree_get(tree, [*path.split("."), "__call__"] if path else ["__call__"])
                if found is None:
                    continue
                found = _value(found)
                if isinstance(found, (tuple, list)):
                    if len(found) != 1 and not path.startswith("sow:"):
                        raise RuntimeError(f"{self.name}: tap '{tap}' ({path}) was called {len(found)} times in "
                                           "one forward: map a module called once per forward")
                    found = found[-1] if path.startswith("sow:") else found[0]
                    while isinstance(found, (tuple, list)):
                        found = found[0]
                acts[tap] = np.asarray(found)
            return self._finish(logits, acts, wanted, self.paths)

    def float64(self) -> "NnxModule":
        from flax import nnx  # flax (jax): slow import; only NNX ports load it
        graphdef, state = nnx.split(self.module)
        with _X64(True):
            twin = nnx.merge(graphdef, _x64(state))
        return NnxModule(twin, self.taps_map, self.name, self.forward, self.num_layers, self.head_dim,
                         self.vocab_size, self.keeps_f32, x64=True)


# ----- Flax linen ---------------------------------------------------------------------------

class LinenModule(_Port):
    """A Flax linen module, its variables and a map {tap name: path in its intermediates}.

    module.apply(variables, ids, mask, positions, capture_intermediates=True,
    mutable=["intermediates"]) records every submodule's __call__ output; "layers_{i}.attn"
    names the output of the submodule `layers_{i}.attn` (element 0 of a tuple), and
    "sow:<path>.<name>" a value sown with self.sow("intermediates", name, x). apply_fn(module,
    variables, ids, mask, positions, **kw) replaces the call (kw: capture_intermediates and
    mutable, to pass on); with an `inject` keyword it takes teacher forcing. float64():
    variables cast to float64, calls under jax.enable_x64(True).
    """

    def __init__(self, module, variables, taps_map: dict, name: str | None = None, apply_fn=None,
                 num_layers: int | None = None, head_dim: int | None = None, vocab_size: int | None = None,
                 keeps_f32: bool = False, x64: bool = False):
        self.module, self.variables, self.taps_map = module, variables, dict(taps_map)
        self.name = name or type(module).__name__
        self.apply_fn = apply_fn or (_linen_apply_inject if _accepts(type(module).__call__, "inject")
                                     else _linen_apply)
        if num_layers is None:
            num_layers = _config_value(module, "num_hidden_layers", "num_layers")
        self.num_layers = _layer_count(list(self.taps_map), num_layers, self.name)
        self.paths = _expand_map(self.taps_map, self.num_layers, f"{self.name} taps_map")
        self._set_taps(self.paths)
        self.head_dim = head_dim or _config_value(module, "head_dim")
        self.vocab_size = vocab_size if vocab_size is not None else _config_value(module, "vocab_size")
        self.keeps_f32, self.x64 = keeps_f32, x64
        self.supports_inject = _accepts(self.apply_fn, "inject")
        self._no_inject = "give apply_fn an inject={layer: hidden} keyword, or compare with teacher_forcing=False"

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        wanted = self.resolve(taps)
        ids, mask, pos = self._inputs(tokens, attention_mask)
        forced = self._inject(inject, ids)
        kw = {}
        with _X64(self.x64):
            if forced:
                kw["inject"] = _jax_arrays(forced, self.x64)
            handed = HandedOver(ids=ids.astype(np.int32), mask=mask.astype(np.int32), positions=pos)
            with handed.call(self.name):
                logits, state = self.apply_fn(self.module, self.variables, handed["ids"], handed["mask"],
                                              handed["positions"], capture_intermediates=True,
                                              mutable=["intermediates"], **kw)
            tree = state.get("intermediates", {})
            acts = {}
            for tap in wanted:
                path = self.paths[tap]
                sown = path.startswith("sow:")
                parts = path[4:].split(".") if sown else ([*path.split("."), "__call__"] if path else ["__call__"])
                found = _tree_get(tree, parts)
                if found is None:
                    continue
                if isinstance(found, (tuple, list)):
                    if len(found) != 1 and not sown:
                        raise RuntimeError(f"{self.name}: tap '{tap}' ({path}) was called {len(found)} times in "
                                           "one forward: map a module called once per forward")
                    found = found[-1] if sown else found[0]
                    while isinstance(found, (tuple, list)):
                        found = found[0]
                acts[tap] = np.asarray(found)
            return self._finish(logits, acts, wanted, {t: self._where(t) for t in wanted})

    def _where(self, tap):
        path = self.paths[tap]
        return f"{path}: not in the intermediates tree (paths are module names, e.g. layers_0.attn)"

    def float64(self) -> "LinenModule":
        return LinenModule(self.module, _x64(self.variables), self.taps_map, self.name, self.apply_fn,
                           self.num_layers, self.head_dim, self.vocab_size, self.keeps_f32, x64=True)


__all__ = ["HF_LLAMA_TAPS", "HandedOver", "JaxFunction", "LinenModule", "NnxModule", "TorchModule",
           "default_torch_forward", "expand_taps", "read_only", "refused_writes"]
