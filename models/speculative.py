"""Speculative decoding, analytically: acceptance, tokens per verification, improvement factor.

With per-token acceptance a (each drafted token accepted independently with probability a, the
first rejection ending the run) and k drafted tokens, a verification emits the accepted prefix
plus one token from the target (the correction, or the bonus token when all k are accepted):

    E[tokens per verify step] = (1 - a^(k+1)) / (1 - a)                    (Leviathan et al. 2023)
    improvement factor        = E[tokens] / (k c + 1)      c = draft pass / target pass

With per-position decay d (position i accepted with a d^(i-1), for draft heads whose later
positions accept less) the survival probabilities are the running products of a d^(i-1).
"""

from __future__ import annotations

import numpy as np


def expected_tokens(a: np.ndarray | float, k: int, decay: float = 1.0) -> np.ndarray:
    """Mean tokens emitted per verification (accepted + 1), elementwise in a."""
    a = np.asarray(a, dtype=np.float64)
    if k <= 0:
        return np.ones_like(a)
    if decay == 1.0:
        out = np.where(np.isclose(a, 1.0), k + 1.0, (1.0 - a ** (k + 1)) / np.where(np.isclose(a, 1.0), 1.0, 1.0 - a))
        return out
    surv = np.ones_like(a)
    total = np.ones_like(a)
    for i in range(k):
        surv = surv * a * decay**i
        total = total + surv
    return total


def expected_tokens_table(a: np.ndarray, k_max: int, decay: float = 1.0) -> np.ndarray:
    """E[tokens] for each sequence (rows) and each k = 0..k_max (columns)."""
    a = np.asarray(a, dtype=np.float64)
    out = np.ones((a.size, k_max + 1))
    surv = np.ones_like(a)
    for i in range(k_max):
        surv = surv * a * decay**i
        out[:, i + 1] = out[:, i] + surv
    return out


def sample_accepted(rng: np.random.Generator, a: np.ndarray, k: int, decay: float = 1.0,
                    steps: int | None = None) -> np.ndarray:
    """Accepted drafted tokens per sequence, each in [0, k]: a truncated geometric draw.

    Vectorised: k uniforms per sequence, accepted = number of leading positions that pass.
    With `steps`, the outcomes of that many verification steps of the same sequences at once, an
    array (steps, sequences), drawing exactly the uniforms (in the same order) that `steps`
    successive calls without it would draw (a fused run of speculative steps).
    """
    a = np.asarray(a, dtype=np.float64)
    shape = (a.size,) if steps is None else (steps, a.size)
    if k <= 0 or a.size == 0:
        return np.zeros(shape, dtype=np.int64)
    p = a[:, None] * (decay ** np.arange(k))[None, :]
    passed = rng.random((*shape, k)) < p
    # the number of leading positions that pass (the index of the first failure, k when all pass)
    return np.logical_and.accumulate(passed, axis=-1).sum(axis=-1, dtype=np.int64)


def improvement_factor(a: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected walltime improvement of speculative over plain decoding."""
    return float(expected_tokens(a, k)) / (k * c + 1.0)


def beta_params(mean: np.ndarray | float, spread: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """Beta(alpha, beta) with this mean and standard deviation `spread`; a spread too wide for a
    Beta (spread^2 >= m(1-m)) is narrowed to just inside the limit."""
    m = np.asarray(mean, dtype=np.float64)
    var = np.minimum(np.asarray(spread, dtype=np.float64) ** 2, 0.999 * m * (1.0 - m))
    common = m * (1.0 - m) / var - 1.0
    return m * common, (1.0 - m) * common


def acceptance_at_quantile(q: np.ndarray, mean: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per-request acceptance rates: each class's Beta distribution at the request's own quantile
    q ~ U(0,1) (common random numbers: every method maps the same q). Spread 0 gives the mean."""
    from scipy import stats

    m = np.asarray(mean, dtype=np.float64)
    s = np.asarray(spread, dtype=np.float64)
    out = m.copy()
    draw = (s > 0) & (m > 0) & (m < 1)
    if draw.any():
        a, b = beta_params(m[draw], s[draw])
        out[draw] = stats.beta.ppf(np.asarray(q)[draw], a, b)
    return np.clip(out, 0.0, 0.999)


def sample_acceptance(rng: np.random.Generator, mean: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per-request acceptance rates drawn from each class's Beta distribution."""
    return acceptance_at_quantile(rng.random(np.asarray(mean).size), mean, spread)
