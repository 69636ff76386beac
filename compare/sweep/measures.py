"""What a precision policy costs on a text: llama.cpp's `perplexity --kl-divergence` measures,
accumulated window by window over a candidate's and a base's logits on the same tokens.

Notation, per scored token i (N of them): b_i, c_i the base's and the candidate's log-softmax
rows (compare.metrics.log_softmax, float64), t_i the next token (the target).

- KLD_i = KL(softmax(base) || softmax(cand)) = sum_v exp(b_iv) (b_iv - c_iv), in nats
  (compare.metrics.kl_of_log_probs). Mean KLD = (1/N) sum_i KLD_i; its standard error
  SE = sqrt((mean(KLD^2) - mean(KLD)^2) / (N - 1)). Percentiles (50, 90, 99, 99.9) and the max
  are of the N per-token values (np.percentile, linear interpolation).
- same top p = (1/N) sum_i [argmax b_i == argmax c_i] (top-1 agreement), SE = sqrt(p (1 - p) / (N - 1)).
- NLL_i = -b_i[t_i] (base) or -c_i[t_i] (candidate); PPL = exp(mean NLL), its uncertainty
  PPL * SE(NLL) (first order).
- PPL ratio = PPL(cand) / PPL(base) = exp(mean d), d_i = NLL_cand_i - NLL_base_i; its uncertainty
  ratio * SE(d), SE(d) = sqrt((mean(d^2) - mean(d)^2) / (N - 1)). llama.cpp computes the same
  from the two NLL means' variances and their covariance (var(d) = var(a) + var(b) - 2 cov(a, b)):
  the pairing is what makes the ratio's uncertainty much smaller than either PPL's.
- Δp_i = exp(c_i[t_i]) - exp(b_i[t_i]) (the change in the correct token's probability);
  RMS Δp = sqrt(mean(Δp^2)), its uncertainty SE(Δp^2) / (2 RMS) (first order, as llama.cpp),
  SE(Δp^2) = sqrt((mean(Δp^4) - mean(Δp^2)^2) / (N - 1)).

Only sums (of KLD, KLD^2, agreement, NLLs, d, d^2, Δp^2, Δp^4) and the N per-token KLD values are
kept: no logits, so memory does not grow with the text beyond 8 bytes a token. A NaN anywhere in
a window's logits makes every measure it touches NaN (never masked).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from compare.metrics import kl_of_log_probs, log_softmax

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
_SUMS = ("kld", "kld2", "same", "nll_base", "nll_base2", "nll_cand", "nll_cand2", "d", "d2", "dp2", "dp4")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A value and its standard error (NaN where N < 2 or the value is NaN)."""
    value: float
    se: float


@dataclasses.dataclass(frozen=True)
class Measures:
    """The measures of one candidate against one base over N scored tokens (module docstring)."""
    tokens: int
    kld_mean: Estimate
    kld_percentiles: dict        # "p50", "p90", "p99", "p99.9" -> nats
    kld_max: float
    same_top_p: Estimate
    ppl_base: Estimate
    ppl_cand: Estimate
    ppl_ratio: Estimate
    rms_dp: Estimate


def _se(sum_x: float, sum_x2: float, n: int) -> float:
    """Standard error of the mean from the sums of x and x^2 over n samples."""
    if n < 2:
        return float("nan")
    mean = sum_x / n
    return math.sqrt(max(sum_x2 / n - mean * mean, 0.0) / (n - 1))


def log_probs(logits) -> np.ndarray:
    """[N, V] logits -> float64 log-softmax rows (compute once per window, share between pairs)."""
    return log_softmax(np.asarray(logits).reshape(-1, np.shape(logits)[-1]))


class Accumulator:
    """Sums and per-token KLD for one (candidate, base) pair, fed one window at a time:

        acc = Accumulator()
        acc.add(log_probs(base_logits), log_probs(cand_logits), targets)   # per window
        acc.result()                                                      # Measures
    """

    def __init__(self):
        self.n = 0
        self.sums = dict.fromkeys(_SUMS, 0.0)
        self._kld: list[np.ndarray] = []

    def add(self, base_lp, cand_lp, targets) -> None:
        """One window: base_lp, cand_lp [n, V] log-probabilities (log_probs) at the positions
        that have a next token, targets [n] that token's id."""
        b, c = np.asarray(base_lp, np.float64), np.asarray(cand_lp, np.float64)
        t = np.asarray(targets, np.int64).reshape(-1)
        if b.shape != c.shape or b.ndim != 2 or b.shape[0] != t.size:
            raise ValueError(f"Accumulator.add: base {b.shape}, candidate {c.shape} and targets {t.shape} "
                             "must be [n, V], [n, V] and [n]")
        if t.size and (t.min() < 0 or t.max() >= b.shape[1]):
            raise ValueError(f"Accumulator.add: a target id outside the vocabulary [0, {b.shape[1]})")
        kld = kl_of_log_probs(b, c)       # both already normalised (log_probs): not again
        rows = np.arange(t.size)
        nll_b, nll_c = -b[rows, t], -c[rows, t]
        d = nll_c - nll_b
        dp = np.exp(-nll_c) - np.exp(-nll_b)
        with np.errstate(invalid="ignore"):
            same = np.where(np.isnan(b).any(1) | np.isnan(c).any(1), np.nan,
                            (b.argmax(1) == c.argmax(1)).astype(np.float64))
        for key, x in (("kld", kld), ("kld2", kld * kld), ("same", same), ("nll_base", nll_b),
                       ("nll_base2", nll_b * nll_b), ("nll_cand", nll_c), ("nll_cand2", nll_c * nll_c),
                       ("d", d), ("d2", d * d), ("dp2", dp * dp), ("dp4", dp ** 4)):
            self.sums[key] += float(x.sum())
        self._kld.append(kld)
        self.n += t.size

    def result(self) -> Measures:
        n, s = self.n, self.sums
        if n == 0:
            raise ValueError("no tokens were scored (the text is shorter than two tokens)")
        kld = np.concatenate(self._kld)
        pct = {f"p{p:g}": float(np.percentile(kld, p)) for p in PERCENTILES}
        same = s["same"] / n
        ms = s["dp2"] / n
        rms = math.sqrt(ms)
        se_ms = _se(s["dp2"], s["dp4"], n)
        mean_b, mean_c, mean_d = s["nll_base"] / n, s["nll_cand"] / n, s["d"] / n
        ppl_b, ppl_c, ratio = math.exp(mean_b), math.exp(mean_c), math.exp(mean_d)
        return Measures(
            tokens=n,
            kld_mean=Estimate(s["kld"] / n, _se(s["kld"], s["kld2"], n)),
            kld_percentiles=pct, kld_max=float(kld.max()),
            same_top_p=Estimate(same, math.sqrt(max(same * (1 - same), 0.0) / (n - 1)) if n > 1 else float("nan")),
            ppl_base=Estimate(ppl_b, ppl_b * _se(s["nll_base"], s["nll_base2"], n)),
            ppl_cand=Estimate(ppl_c, ppl_c * _se(s["nll_cand"], s["nll_cand2"], n)),
            ppl_ratio=Estimate(ratio, ratio * _se(s["d"], s["d2"], n)),
            rms_dp=Estimate(rms, se_ms / (2 * rms) if rms > 0 else se_ms),
        )
