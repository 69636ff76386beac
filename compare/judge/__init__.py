"""The one judge of a tap: drift, precision or semantic from two runs (a reference and a
candidate, or one model in two circumstances), the reference's float64 twin, the candidate's
own twin when it has one, and the policy (verdicts.classify). The ladder (compare.ladder) and
the probes (compare.probes: `probe where`, the invariance probes) all call it, so a rung added
here reaches every verdict the project gives."""
