"""Acceptance measured on real traffic: fit the engine's acceptance model to speculative-decoding data.

The model is the one the engine samples from (models.speculative): each request draws a per-token
acceptance a ~ Beta(mean, spread) (spread = standard deviation, `acceptance_at_quantile`); a
verification of k drafted tokens accepts position i (1-based) with probability a d^(i-1), and the
accepted length x is the number of leading positions that pass, so for a given a

    P(x = j) = a^j d^(j(j-1)/2) (1 - a d^j)   for j < k,     P(x = k) = a^k d^(k(k-1)/2).

Four kinds of data, each with its exact (or, for long requests' totals, normal-approximated)
likelihood; docs/METRICS.md ("Acceptance fitted from measurements") has the derivations:

- "histogram": steps with 0..k accepted, pooled over requests (vLLM's per-position counters, its
  benchmark JSON, its log lines, a per-step CSV without request ids). A pooled step comes from a
  request with probability proportional to its number of steps, about output length / E[tokens
  per step | a]; so the step-level mixture weights the Beta by 1 / T(a), T(a) = E[x | a] + 1.
- "steps": per request, steps with 0..k accepted for each k (a per-step CSV with request ids).
- "totals": per request, steps n, accepted tokens S and k (a per-request CSV, the simulator's
  request table).
- "mean": only the total accepted over n steps (vLLM V0 counters): the mean alone, spread 0.

The mixture over a is integrated by Gauss-Legendre quadrature in the Beta's quantile u (a =
F^-1(u)), which stays accurate however narrow the Beta is, and maps u exactly as the engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from scipy import optimize, special, stats

from models.speculative import acceptance_at_quantile, expected_tokens, sample_accepted

GL_NODES = 64
MIN_DRAFTS = 100  # fewer verification steps than this and a fit means little
EXACT_STEPS = 48  # per-request totals over at most this many steps: exact convolution; beyond: normal
MEAN_BOUNDS = (0.005, 0.995)
REL_SPREAD_MAX = 0.95  # spread as a fraction of the largest a Beta with that mean allows, sqrt(m(1-m))
DECAY_BOUNDS = (0.3, 1.0)
# a parameter whose standard error exceeds this is reported as not identifiable and fixed
MAX_VARIANCE_SE_FRAC = 0.25  # of m(1 - m), the widest variance a rate in [0, 1] with mean m can have
MAX_DECAY_SE = 0.1

Kind = Literal["histogram", "steps", "totals", "mean"]

_U, _W = np.polynomial.legendre.leggauss(GL_NODES)
_U = 0.5 * (_U + 1.0)
_W = 0.5 * _W


@dataclass(frozen=True)
class Observations:
    """What one source says about one traffic class. `k` is the (largest) number of drafted tokens."""

    name: str
    k: int
    kind: Kind
    hist: np.ndarray | None = None  # (k+1,) histogram: steps with 0..k accepted
    steps: np.ndarray | None = None  # (R, k+1, k+1) steps: [request, k of the step, accepted]
    n: np.ndarray | None = None  # (R,) totals: steps per request; mean: (1,) steps in all
    accepted: np.ndarray | None = None  # (R,) totals: accepted tokens per request; mean: (1,) in all
    ks: np.ndarray | None = None  # (R,) totals: drafted tokens per step of each request
    source: str = ""

    @property
    def num_drafts(self) -> int:
        """Verification steps (vLLM's num_drafts) behind the observations."""
        if self.kind == "histogram":
            assert self.hist is not None
            return int(self.hist.sum())
        if self.kind == "steps":
            assert self.steps is not None
            return int(self.steps[:, 1:, :].sum())
        assert self.n is not None
        return int(self.n.sum())

    @property
    def num_requests(self) -> int | None:
        if self.kind == "steps":
            assert self.steps is not None
            return int(self.steps.shape[0])
        if self.kind == "totals":
            assert self.n is not None
            return int(self.n.size)
        return None


def step_log_pmf(a: np.ndarray, k: int, decay: float) -> np.ndarray:
    """log P(x = j | a) for j = 0..k, one row per acceptance in `a` (shape (len(a), k+1))."""
    a = np.asarray(a, dtype=np.float64)[:, None]
    j = np.arange(k + 1, dtype=np.float64)[None, :]
    log_d = np.log(decay)
    log_surv = j * np.log(a) + 0.5 * j * (j - 1.0) * log_d  # log P(x >= j)
    fail = np.log1p(-np.minimum(a * np.exp(j * log_d), 1.0 - 1e-15))  # log(1 - a d^j)
    out = log_surv + fail
    out[:, k] = log_surv[:, k]
    return np.asarray(out)


def quadrature(mean: float, spread: float) -> tuple[np.ndarray, np.ndarray]:
    """Nodes (acceptances) and weights integrating over a ~ Beta(mean, spread) as the engine maps it."""
    u = np.clip(_U, 1e-12, 1 - 1e-12)
    a = acceptance_at_quantile(u, np.full(u.size, mean), np.full(u.size, spread))
    return np.clip(a, 1e-9, 0.999), _W


def step_pmf(mean: float, spread: float, decay: float, k: int) -> np.ndarray:
    """P(x = j), j = 0..k, for a verification step drawn from pooled traffic (step-weighted mixture)."""
    a, w = quadrature(mean, spread)
    p = np.exp(step_log_pmf(a, k, decay))
    ww = w / expected_tokens(a, k, decay)  # a request contributes steps in proportion to 1 / T(a)
    return np.asarray(ww @ p / ww.sum())


def mean_acceptance_length(mean: float, spread: float, decay: float, k: int) -> float:
    """Tokens per verification over pooled steps, accepted + 1 (vLLM's "mean acceptance length")."""
    return float(1.0 + step_pmf(mean, spread, decay, k) @ np.arange(k + 1))


def _logmix(ll: np.ndarray, w: np.ndarray) -> float:
    """sum over requests of log sum_nodes w exp(ll[request, node])."""
    top = ll.max(axis=1, keepdims=True)
    return float((np.log(np.exp(ll - top) @ w) + top[:, 0]).sum())


def loglik(obs: Observations, mean: float, spread: float, decay: float) -> float:
    """Log-likelihood of the observations under the acceptance model."""
    if obs.kind == "histogram":
        assert obs.hist is not None
        p = np.maximum(step_pmf(mean, spread, decay, obs.k), 1e-300)
        return float(obs.hist @ np.log(p))
    if obs.kind == "mean":
        assert obs.n is not None and obs.accepted is not None
        p = step_pmf(mean, 0.0, decay, obs.k)
        j = np.arange(obs.k + 1)
        mu, var = float(p @ j), float(p @ j**2 - (p @ j) ** 2)
        n = float(obs.n[0])
        return -0.5 * n * (float(obs.accepted[0]) / n - mu) ** 2 / max(var, 1e-12)
    a, w = quadrature(mean, spread)
    if obs.kind == "steps":
        assert obs.steps is not None
        ks = _steps_ks(obs.steps)
        flat = np.concatenate([obs.steps[:, kk, : kk + 1] for kk in ks], axis=1)
        logp = np.concatenate([step_log_pmf(a, kk, decay) for kk in ks], axis=1)
        return _logmix(flat @ logp.T, w)
    return _logmix(_totals_ll(obs, a, decay), w)


def _steps_ks(steps: np.ndarray) -> list[int]:
    """The numbers of drafted tokens (k >= 1) that occur in a per-request step-count array."""
    return [kk for kk in range(1, steps.shape[1]) if steps[:, kk, :].any()]


def _totals_ll(obs: Observations, a: np.ndarray, decay: float) -> np.ndarray:
    """log P(S accepted over n steps | a) per request and node: an exact n-fold convolution of the
    step distribution for n <= EXACT_STEPS, a normal density (continuity-corrected) beyond."""
    assert obs.n is not None and obs.accepted is not None and obs.ks is not None
    out = np.zeros((obs.n.size, a.size))
    for kk in np.unique(obs.ks):
        kk = int(kk)
        sel = obs.ks == kk
        idx = np.flatnonzero(sel)
        n, s = obs.n[idx], obs.accepted[idx]
        p = np.exp(step_log_pmf(a, kk, decay))  # (G, kk+1)
        j = np.arange(kk + 1)
        mu, var = p @ j, p @ j**2 - (p @ j) ** 2
        short = n <= EXACT_STEPS
        if short.any():
            n_max = int(n[short].max())
            q = np.zeros((a.size, n_max * kk + 1))
            q[:, 0] = 1.0
            for step in range(1, n_max + 1):
                nxt = np.zeros_like(q)
                width = (step - 1) * kk + 1
                for jj in range(kk + 1):
                    nxt[:, jj: jj + width] += p[:, jj: jj + 1] * q[:, :width]
                q = nxt
                hit = np.flatnonzero(short & (n == step))
                if hit.size:
                    out[idx[hit]] = np.log(np.maximum(q[:, s[hit]].T, 1e-300))
        long = np.flatnonzero(~short)
        if long.size:
            sd = np.sqrt(np.maximum(n[long, None] * var[None, :], 1e-12))
            z_hi = (s[long, None] + 0.5 - n[long, None] * mu[None, :]) / sd
            z_lo = (s[long, None] - 0.5 - n[long, None] * mu[None, :]) / sd
            prob = special.ndtr(z_hi) - special.ndtr(z_lo)
            out[idx[long]] = np.log(np.maximum(prob, 1e-300))
    return out


@dataclass(frozen=True)
class AcceptanceFit:
    """A fitted class: the scenario's acceptance, acceptance_spread and speculative.acceptance_decay,
    their standard errors (NaN where the parameter was fixed), and goodness of fit."""

    name: str
    k: int
    kind: Kind
    mean: float
    spread: float
    decay: float
    mean_se: float
    spread_se: float
    decay_se: float
    num_drafts: int
    num_requests: int | None
    loglik: float
    observed: np.ndarray  # counts per accepted length 0..k (per step; for totals, per request's rounded mean)
    expected: np.ndarray
    chi2: float
    chi2_dof: int
    chi2_p: float
    max_abs_diff: float  # largest |observed - expected| share over the bins
    notes: tuple[str, ...] = field(default=())
    source: str = ""

    def mean_acceptance_length(self, k: int | None = None) -> float:
        return mean_acceptance_length(self.mean, self.spread, self.decay, self.k if k is None else k)

    def as_dict(self) -> dict[str, object]:
        return {"class": self.name, "source": self.source, "kind": self.kind, "k": self.k, "acceptance": self.mean,
                "acceptance_se": self.mean_se, "acceptance_spread": self.spread, "acceptance_spread_se": self.spread_se,
                "acceptance_decay": self.decay, "acceptance_decay_se": self.decay_se, "num_drafts": self.num_drafts,
                "num_requests": self.num_requests, "mean_acceptance_length": self.mean_acceptance_length(),
                "chi2": self.chi2, "chi2_dof": self.chi2_dof, "chi2_p": self.chi2_p, "max_abs_diff": self.max_abs_diff,
                "notes": " | ".join(self.notes)}


def _hessian(f: Callable[[np.ndarray], float], x: np.ndarray, h: np.ndarray, lo: np.ndarray,
             hi: np.ndarray) -> np.ndarray:
    """Central-difference Hessian of f, centred just inside the bounds when x sits on one."""
    c = np.clip(x, lo + 1.01 * h, hi - 1.01 * h)
    n = x.size
    out = np.zeros((n, n))
    f0 = f(c)
    for i in range(n):
        ei = np.zeros(n)
        ei[i] = h[i]
        out[i, i] = (f(c + ei) - 2 * f0 + f(c - ei)) / h[i] ** 2
        for j in range(i):
            ej = np.zeros(n)
            ej[j] = h[j]
            out[i, j] = out[j, i] = (f(c + ei + ej) - f(c + ei - ej) - f(c - ei + ej) + f(c - ei - ej)) / (4 * h[i] * h[j])
    return out


def _initial_mean(obs: Observations, decay: float) -> float:
    """The mean whose zero-spread step distribution has the observed accepted tokens per step."""
    if obs.kind == "histogram":
        assert obs.hist is not None
        target = float(obs.hist @ np.arange(obs.k + 1)) / max(obs.hist.sum(), 1)
    elif obs.kind == "steps":
        assert obs.steps is not None
        tot = obs.steps.sum(axis=0)
        target = float((tot * np.arange(obs.k + 1)[None, :]).sum()) / max(tot[1:].sum(), 1)
    else:
        assert obs.n is not None and obs.accepted is not None
        target = float(obs.accepted.sum()) / max(float(obs.n.sum()), 1.0)
    grid = np.linspace(*MEAN_BOUNDS, 199)
    vals = np.array([step_pmf(m, 0.0, decay, obs.k) @ np.arange(obs.k + 1) for m in grid])
    return float(grid[np.argmin(np.abs(vals - target))])


def fit(obs: Observations, *, decay: float | None = None, min_drafts: int = MIN_DRAFTS) -> AcceptanceFit:
    """Maximum-likelihood (mean, spread, decay) for one class. `decay` given: held fixed at it.
    A parameter the data cannot pin down (standard error above MAX_VARIANCE_SE_FRAC of the widest
    variance, or MAX_DECAY_SE) is fixed (spread 0, decay 1 or the given one) and the fit repeated,
    with a note saying so. Raises ValueError for too few observations."""
    if obs.num_drafts < min_drafts:
        raise ValueError(f"class '{obs.name}': {obs.num_drafts} verification steps, fewer than the {min_drafts} a fit needs")
    notes: list[str] = []
    fit_spread = obs.kind != "mean" and not (obs.kind == "histogram" and obs.k < 2)
    fit_decay = decay is None and obs.k >= 2 and obs.kind != "mean"
    if obs.kind == "mean":
        notes.append("only the total accepted is known (no per-position counts): spread fixed at 0 and decay at "
                     f"{decay or 1.0:g}; the mean alone is fitted")
    elif not fit_spread:
        notes.append("k = 1: one accepted-or-not count per step cannot separate spread from mean; spread fixed at 0")
    if decay is None and not fit_decay and obs.kind != "mean":
        notes.append("k = 1: the decay acts from the second position on; fixed at 1")
    d_fixed = 1.0 if decay is None else float(decay)
    while True:
        res = _maximise(obs, fit_spread, fit_decay, d_fixed)
        m, s, d, se_m, se_v, se_d = res
        s = s if s > 1e-6 else 0.0
        if fit_spread and s > 0 and not se_v <= MAX_VARIANCE_SE_FRAC * m * (1 - m):
            notes.append(f"spread not identifiable from these data (standard error of the variance {se_v:.3g} > "
                         f"{MAX_VARIANCE_SE_FRAC:g} m(1-m) = {MAX_VARIANCE_SE_FRAC * m * (1 - m):.3g}): fitted with "
                         "acceptance_spread = 0")
            fit_spread = False
            continue
        if fit_decay and se_d > MAX_DECAY_SE:
            notes.append(f"decay not identifiable from these data (standard error {se_d:.3g} > {MAX_DECAY_SE:g}): "
                         f"fixed at {d_fixed:g}")
            fit_decay = False
            continue
        break
    spread_se = (se_v / (2 * s) if s > 0 else float("inf")) if fit_spread else float("nan")
    if fit_spread and s == 0:
        bound = f" (95% upper bound about {np.sqrt(1.645 * se_v):.2g})" if np.isfinite(se_v) else ""
        notes.append(f"spread at its lower bound 0{bound}: the data show no spread across requests")
    observed, expected, dof_params = _goodness(obs, m, s, d)
    n_params = 1 + int(fit_spread) + int(fit_decay)
    keep = expected >= 5
    chi2 = float((((observed - expected) ** 2)[keep] / expected[keep]).sum()) if keep.any() else float("nan")
    dof = int(keep.sum()) - 1 - (n_params if dof_params else 0)
    p = float(stats.chi2.sf(chi2, dof)) if dof > 0 and np.isfinite(chi2) else float("nan")
    tot_o, tot_e = observed.sum(), expected.sum()
    mad = float(np.max(np.abs(observed / tot_o - expected / tot_e))) if tot_o > 0 and tot_e > 0 else float("nan")
    return AcceptanceFit(
        name=obs.name, k=obs.k, kind=obs.kind, mean=m, spread=s, decay=d, mean_se=se_m, spread_se=spread_se,
        decay_se=se_d if fit_decay else float("nan"), num_drafts=obs.num_drafts, num_requests=obs.num_requests,
        loglik=loglik(obs, m, s, d), observed=observed, expected=expected, chi2=chi2, chi2_dof=dof, chi2_p=p,
        max_abs_diff=mad, notes=tuple(notes), source=obs.source)


def _maximise(obs: Observations, fit_spread: bool, fit_decay: bool,
              d_fixed: float) -> tuple[float, float, float, float, float, float]:
    """The maximum over the free parameters; returns (mean, spread, decay) and the standard errors of
    the mean, the variance (spread^2) and the decay from the observed information."""

    def unpack(x: np.ndarray) -> tuple[float, float, float]:
        m = float(x[0])
        r = float(x[1]) if fit_spread else 0.0
        d = float(x[1 + int(fit_spread)]) if fit_decay else d_fixed
        return m, r * np.sqrt(m * (1 - m)), d

    def nll(x: np.ndarray) -> float:
        m, s, d = unpack(x)
        return -loglik(obs, m, s, d)

    m0 = _initial_mean(obs, d_fixed if not fit_decay else 0.97)
    lo = [MEAN_BOUNDS[0]] + ([0.0] if fit_spread else []) + ([DECAY_BOUNDS[0]] if fit_decay else [])
    hi = [MEAN_BOUNDS[1]] + ([REL_SPREAD_MAX] if fit_spread else []) + ([DECAY_BOUNDS[1]] if fit_decay else [])
    best = None
    for r0 in ((0.3,) if fit_spread else (0.0,)):
        x0 = [m0] + ([r0] if fit_spread else []) + ([0.97] if fit_decay else [])
        res = optimize.minimize(nll, np.array(x0), method="L-BFGS-B", bounds=list(zip(lo, hi, strict=True)))
        if best is None or res.fun < best.fun:
            best = res
    assert best is not None
    m, s, d = unpack(best.x)

    # standard errors in the natural coordinates (mean, variance, decay)
    def nll_nat(y: np.ndarray) -> float:
        mm = float(y[0])
        vv = float(y[1]) if fit_spread else s * s
        dd = float(y[1 + int(fit_spread)]) if fit_decay else d
        return -loglik(obs, mm, float(np.sqrt(max(vv, 0.0))), dd)

    y = np.array([m] + ([s * s] if fit_spread else []) + ([d] if fit_decay else []))
    vmax = REL_SPREAD_MAX**2 * m * (1 - m)
    lo_n = np.array([MEAN_BOUNDS[0]] + ([0.0] if fit_spread else []) + ([DECAY_BOUNDS[0]] if fit_decay else []))
    hi_n = np.array([MEAN_BOUNDS[1]] + ([vmax] if fit_spread else []) + ([DECAY_BOUNDS[1]] if fit_decay else []))
    h = np.array([1e-3] + ([1e-3 * m * (1 - m)] if fit_spread else []) + ([1e-3] if fit_decay else []))
    hess = _hessian(nll_nat, y, h, lo_n, hi_n)
    try:
        cov = np.linalg.inv(hess)
        var = np.diag(cov)
    except np.linalg.LinAlgError:
        var = np.full(y.size, np.inf)
    se = np.where(var > 0, np.sqrt(np.abs(var)), np.inf)
    se_m = float(se[0])
    se_v = float(se[1]) if fit_spread else float("nan")
    se_d = float(se[1 + int(fit_spread)]) if fit_decay else float("nan")
    return m, s, d, se_m, se_v, se_d


def _goodness(obs: Observations, m: float, s: float, d: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """Observed and fitted counts per accepted length 0..k, and whether the fit's parameters were
    estimated from these same cells (then they cost degrees of freedom)."""
    k = obs.k
    if obs.kind == "histogram":
        assert obs.hist is not None
        return obs.hist.astype(np.float64), obs.hist.sum() * step_pmf(m, s, d, k), True
    if obs.kind == "steps":
        assert obs.steps is not None
        observed = np.zeros(k + 1)
        expected = np.zeros(k + 1)
        a, w = quadrature(m, s)
        for kk in range(1, k + 1):
            c = obs.steps[:, kk, : kk + 1]
            if not c.any():
                continue
            observed[: kk + 1] += c.sum(axis=0)
            # the steps of k = kk under the model: the step-weighted mixture, as for pooled counters
            expected[: kk + 1] += c.sum() * _pooled(np.exp(step_log_pmf(a, kk, d)), w, a, kk, d)
        return observed, expected, True
    if obs.kind == "totals":
        # per request: its mean accepted tokens per step, rounded, against the same statistic drawn
        # from the fitted model for the same requests (steps and k), 8 replicates with a fixed seed
        assert obs.n is not None and obs.accepted is not None and obs.ks is not None
        rng = np.random.default_rng(0)
        counts = np.bincount(np.rint(obs.accepted / np.maximum(obs.n, 1)).astype(np.int64), minlength=k + 1)[: k + 1]
        expected = np.zeros(k + 1)
        reps = 8
        for _ in range(reps):
            a_req = acceptance_at_quantile(rng.random(obs.n.size), np.full(obs.n.size, m), np.full(obs.n.size, s))
            tot = np.zeros(obs.n.size)
            for kk in np.unique(obs.ks):
                sel = np.flatnonzero(obs.ks == kk)
                rep = np.repeat(sel, obs.n[sel])
                acc = sample_accepted(rng, a_req[rep], int(kk), d)
                tot += np.bincount(rep, weights=acc, minlength=obs.n.size)
            expected += np.bincount(np.rint(tot / np.maximum(obs.n, 1)).astype(np.int64), minlength=k + 1)[: k + 1]
        return counts.astype(np.float64), expected / reps, False
    return np.zeros(k + 1), np.zeros(k + 1), False


def _pooled(pk: np.ndarray, w: np.ndarray, a: np.ndarray, k: int, d: float) -> np.ndarray:
    ww = w / expected_tokens(a, k, d)
    return np.asarray(ww @ pk / ww.sum())


def simulate_steps(rng: np.random.Generator, output_tokens: np.ndarray, k: int, mean: float, spread: float,
                   decay: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-step accepted lengths as the engine draws them: each request's acceptance from
    `acceptance_at_quantile` at a uniform quantile, then verification steps (`sample_accepted`, each
    emitting accepted + 1 tokens) until its output is complete (the first token comes from the
    prefill). Returns (request index per step, accepted per step)."""
    out = np.asarray(output_tokens, dtype=np.int64)
    num = out.size
    a_req = acceptance_at_quantile(rng.random(num), np.full(num, mean), np.full(num, spread))
    left = out - 1
    rids, accs = [], []
    active = np.flatnonzero(left > 0)
    while active.size:
        acc = sample_accepted(rng, a_req[active], k, decay)
        rids.append(active)
        accs.append(acc)
        left[active] -= acc + 1
        active = active[left[active] > 0]
    if not rids:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(rids), np.concatenate(accs)
