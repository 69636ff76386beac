"""A planted bug for probe where's device circumstance: a port that computes wrong only under an
instruction-set cap, as a kernel path taken only on some CPUs would.

    pm = compare.probes.load_model("torchref+avx2 bug", folder, "fp32", factory=FACTORY)
    r = probe_where(pm, "device", device="avx2")      # semantic at layers.{LAYER}.attn_norm

The port is torchref; when its plan says the process runs under ATEN_CPU_CAPABILITY=avx2 (the
avx2 cap's variables, read once at load by torchref's plan), layer LAYER's input RMSNorm uses
epsilon WRONG_EPS instead of the config's, in the model and in its float64 twin alike (the bug
is in the code path, so the fp64 rung keeps it). Anywhere else it is torchref, bit for bit.
"""

from __future__ import annotations

from ..adapters import OurModel, fp64_policy

LAYER = 1
WRONG_EPS = 1e-2
TRIGGER = ("ATEN_CPU_CAPABILITY", "avx2")
FACTORY = "compare.controls.device:avx2_bug"


class CapBugPort:
    """torchref (an OurModel) with the planted epsilon where its plan records TRIGGER."""

    def __init__(self, ours: OurModel):
        self.ours = ours
        self.model = ours.model         # its plan: what compare.environment records
        self.name = "torchref+avx2 bug"
        self.taps = ours.taps
        self.cfg, self.policy = ours.cfg, ours.policy
        self.planted = TRIGGER in self.model.plan.settings
        if self.planted:
            self.model.model.layers[LAYER].input_layernorm.eps = WRONG_EPS

    def capture(self, tokens, attention_mask=None, taps=("layers.*.out",), inject=None):
        return self.ours.capture(tokens, attention_mask, taps, inject)

    def float64(self) -> "CapBugPort":
        """The same port computing in float64 on the same rounded weights (torchref's plan for the
        twin reads the same settings, so the bug is planted there too)."""
        import torchref  # torchref imports torch: only where the port is built
        m = self.model
        twin = torchref.from_weights(m.cfg, m.weights(), fp64_policy(m.policy), device=m.device)
        return CapBugPort(OurModel(twin, self.ours.checkpoint))


def avx2_bug(checkpoint, policy) -> CapBugPort:
    """The factory (compare.probes.ModelSpec.factory): the port over `checkpoint` at `policy`."""
    return CapBugPort(OurModel.load("torchref", checkpoint, policy))
