"""The tap recorder both models call at every named step of the forward pass."""

from __future__ import annotations


class Recorder:
    """Keeps the activations whose tap names were asked for (llamaspec.taps names).

    `rec(name, x)` records x under the name (with this recorder's layer prefix) when it
    was asked for, and returns x; `rec.layer(i)` is the recorder for layer i's steps,
    filling the same dict. Asking for no taps costs one set lookup per step.
    """

    def __init__(self, wanted=(), prefix: str = "", acts: dict | None = None):
        self.wanted, self.prefix = frozenset(wanted), prefix
        self.acts = {} if acts is None else acts

    def __call__(self, name: str, x):
        if self.prefix + name in self.wanted:
            self.acts[self.prefix + name] = x
        return x

    def layer(self, i: int) -> "Recorder":
        return Recorder(self.wanted, f"layers.{i}.", self.acts)
