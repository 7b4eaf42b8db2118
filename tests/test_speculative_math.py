"""Speculative decoding math: closed forms against Monte Carlo, and the samplers' ranges."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.speculative import (
    DRAW_CHUNK_ROWS,
    DraftShape,
    acceptance_draws,
    beta_params,
    expected_tokens,
    expected_tokens_table,
    improvement_factor,
    sample_acceptance,
    sample_accepted,
)

N = 200_000
Z999 = 3.2905  # two-sided 99.9% normal quantile


def _pmf(a: float, k: int, decay: float = 1.0) -> np.ndarray:
    """P(accepted = j), j = 0..k, from first principles: position i (1-based) passes with
    a * decay^(i-1); the first failure stops the run."""
    p = np.zeros(k + 1)
    surv = 1.0
    for j in range(k):
        q = a * decay**j
        p[j] = surv * (1.0 - q)
        surv *= q
    p[k] = surv
    return p


@pytest.mark.parametrize("k", [0, 1, 3, 5, 8])
@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.8, 0.95])
def test_expected_tokens_closed_form(a: float, k: int) -> None:
    assert float(expected_tokens(a, k)) == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=1e-12)
    assert float(expected_tokens(a, k)) == pytest.approx(float(_pmf(a, k) @ (np.arange(k + 1) + 1)), rel=1e-12)


def test_expected_tokens_limits() -> None:
    assert float(expected_tokens(1.0, 4)) == 5.0  # every draft accepted, plus the bonus token
    assert float(expected_tokens(0.0, 4)) == 1.0  # only the target's own token
    np.testing.assert_allclose(expected_tokens(np.array([0.3, 0.8]), 3), [(1 - 0.3**4) / 0.7, (1 - 0.8**4) / 0.2])


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("a", [0.3, 0.6, 0.8, 0.95])
def test_sampled_mean_matches_expected_tokens(a: float, k: int) -> None:
    rng = np.random.default_rng(1000 * k + int(100 * a))
    acc = sample_accepted(rng, np.full(N, a), k)
    assert acc.min() >= 0
    assert acc.max() <= k
    p = _pmf(a, k)
    j = np.arange(k + 1) + 1.0
    mean = float(expected_tokens(a, k))
    sd = float(np.sqrt(p @ (j - mean) ** 2))
    half = Z999 * sd / np.sqrt(N)  # 99.9% CI of the mean of N draws
    assert abs((acc + 1).mean() - mean) < half, (acc.mean() + 1, mean, half)
    # the whole distribution, not only its mean: every P(j) within its own 99.9% CI
    freq = np.bincount(acc, minlength=k + 1) / N
    assert np.all(np.abs(freq - p) < Z999 * np.sqrt(p * (1 - p) / N) + 1e-12), (freq, p)


@pytest.mark.parametrize(("a", "k", "decay"), [(0.8, 5, 0.9), (0.95, 4, 0.7), (0.6, 3, 0.5)])
def test_sampled_mean_with_decay(a: float, k: int, decay: float) -> None:
    rng = np.random.default_rng(7)
    acc = sample_accepted(rng, np.full(N, a), k, decay)
    assert acc.min() >= 0 and acc.max() <= k
    mean = float(expected_tokens(a, k, decay))
    p = _pmf(a, k, decay)
    j = np.arange(k + 1) + 1.0
    assert mean == pytest.approx(float(p @ j), rel=1e-12)
    assert mean < float(expected_tokens(a, k))  # decay only removes acceptance
    half = Z999 * float(np.sqrt(p @ (j - mean) ** 2)) / np.sqrt(N)
    assert abs((acc + 1).mean() - mean) < half


def test_sample_accepted_mixed_rates_and_edge_cases() -> None:
    rng = np.random.default_rng(3)
    a = np.array([0.0, 1.0, 0.0, 1.0])
    np.testing.assert_array_equal(sample_accepted(rng, a, 4), [0, 4, 0, 4])
    assert sample_accepted(rng, np.array([0.5, 0.9]), 0).tolist() == [0, 0]
    assert sample_accepted(rng, np.array([]), 3).size == 0


@pytest.mark.parametrize(("a", "k_max", "decay"), [(0.8, 4, 1.0), (0.55, 5, 0.9), (0.95, 3, 1.0), (0.3, 6, 0.8)])
def test_drawn_outcomes_at_every_depth_follow_the_truncated_geometric(a: float, k_max: int, decay: float) -> None:
    """The outcomes drawn before a run (`acceptance_draws`: leading depths passed out of k_max)
    read at depth k <= k_max, min(outcome, k), have the pmf of k drafted tokens accepted one by
    one until the first rejection (chi-square at 99.9%), so any k the engine picks per step draws
    what `sample_accepted` draws with k uniforms."""
    from scipy import stats

    probs = np.full((4, k_max), a) * decay ** np.arange(k_max)
    lead, off = acceptance_draws(np.random.default_rng(12), probs, np.full(4, N // 4))
    assert off.tolist() == [0, N // 4, N // 2, 3 * N // 4, N]
    out = np.frombuffer(lead, dtype=np.uint8)
    assert out.size == N and out.max() <= k_max
    for k in range(k_max + 1):
        counts = np.bincount(np.minimum(out, k), minlength=k + 1)
        expected = _pmf(a, k, decay) * N
        keep = expected > 5
        chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
        assert chi2 < stats.chi2.ppf(0.999, max(1, int(keep.sum()) - 1)), (k, counts, expected)


def test_drawn_outcomes_of_a_tree_reach_each_depth_with_its_probability() -> None:
    """For a token tree the outcome passes depth i with the tree's P_i (any of its candidates
    accepted): P(outcome >= i) = P_1 ... P_i, and the mean at depth k is the tree's closed form."""
    shape = DraftShape((1.0, 1.0, 1.0, 1.0), (2, 2, 1, 1), 0.9)
    a = np.array([0.6, 0.8])
    probs = shape.probs(a, 4)
    lead, off = acceptance_draws(np.random.default_rng(3), probs, np.array([N, N]))
    out = np.frombuffer(lead, dtype=np.uint8)
    for r in range(2):
        x = out[off[r]: off[r + 1]]
        surv = np.cumprod(probs[r])
        for i in range(1, 5):
            p = float((x >= i).mean())
            assert abs(p - surv[i - 1]) < Z999 * np.sqrt(surv[i - 1] * (1 - surv[i - 1]) / N) + 1e-12
        for k in range(5):
            y = np.minimum(x, k) + 1.0
            assert abs(y.mean() - shape.expected_tokens(float(a[r]), k)) < Z999 * y.std() / np.sqrt(N) + 1e-12


def test_drawn_outcomes_do_not_depend_on_how_many_rows_are_drawn_at_once() -> None:
    """The draws go request by request in row order, whatever the block size: the same bytes."""
    rng_probs = np.random.default_rng(1)
    probs = rng_probs.uniform(0.2, 0.95, (50, 4))
    lengths = rng_probs.integers(0, 300, 50)
    whole = acceptance_draws(np.random.default_rng(8), probs, lengths, chunk_rows=1 << 30)
    for chunk in (1, 7, 299, 1000, DRAW_CHUNK_ROWS):
        part = acceptance_draws(np.random.default_rng(8), probs, lengths, chunk_rows=chunk)
        assert part[0] == whole[0]
        np.testing.assert_array_equal(part[1], whole[1])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 0.999), min_size=1, max_size=8), st.integers(0, 8),
       st.sampled_from([1.0, 0.9, 0.6]))
def test_table_agrees_with_expected_tokens(a: list[float], k_max: int, decay: float) -> None:
    tab = expected_tokens_table(np.array(a), k_max, decay)
    assert tab.shape == (len(a), k_max + 1)
    for k in range(k_max + 1):
        np.testing.assert_allclose(tab[:, k], expected_tokens(np.array(a), k, decay), rtol=1e-9)
    assert np.all(np.diff(tab, axis=1) >= 0)  # one more draft never emits fewer tokens
    assert np.all(tab <= np.arange(k_max + 1) + 1)


@pytest.mark.parametrize(("a", "k", "c"), [(0.8, 4, 0.05), (0.6, 3, 0.125), (0.95, 7, 0.375), (0.3, 1, 0.0)])
def test_improvement_factor_formula(a: float, k: int, c: float) -> None:
    assert improvement_factor(a, k, c) == pytest.approx((1 - a ** (k + 1)) / (1 - a) / (k * c + 1), rel=1e-12)


def test_improvement_factor_below_one_for_bad_drafts() -> None:
    # a poor, expensive draft slows decoding down; a good cheap one speeds it up
    assert improvement_factor(0.3, 5, 0.4) < 1.0
    assert improvement_factor(0.9, 5, 0.05) > 3.0


def test_sample_acceptance_mean_and_range() -> None:
    rng = np.random.default_rng(11)
    mean, spread = 0.7, 0.1
    draws = sample_acceptance(rng, np.full(N, mean), np.full(N, spread))
    assert draws.min() >= 0.0 and draws.max() <= 0.999
    # Beta(alpha, beta) with this mean and sd: the sample mean within its 99.9% CI, sd within 2%
    assert abs(draws.mean() - mean) < Z999 * spread / np.sqrt(N)
    assert draws.std() == pytest.approx(spread, rel=0.02)
    al, be = beta_params(mean, spread)
    assert al / (al + be) == pytest.approx(mean, rel=1e-12)
    # spread 0: the class mean itself, no randomness
    np.testing.assert_array_equal(sample_acceptance(rng, np.array([0.2, 0.5]), np.array([0.0, 0.0])), [0.2, 0.5])
    # a spread too wide for a Beta is clipped rather than failing
    wide = sample_acceptance(rng, np.full(1000, 0.5), np.full(1000, 0.9))
    assert np.all((wide >= 0.0) & (wide <= 0.999))


def test_adaptive_expected_sums_are_the_loop_bit_for_bit() -> None:
    """The adaptive policy's expected-token sums (written out depth by depth up to 6 depths, a
    loop beyond) equal the plain depth loop exactly, for every k_max, decay and batch."""
    import random

    from sim.policies import expected_sums

    rnd = random.Random(3)
    for k in range(0, 8):
        for decay in (1.0, 0.93):
            dp = [decay**i for i in range(k)]
            for _ in range(50):
                n = rnd.randint(1, 40)
                acc = [rnd.randint(0, 400) for _ in range(n)]
                prop = [a + rnd.randint(0, 120) for a in acc]
                exp = [float(n)] * (k + 1)
                for a_i, p_i in zip(acc, prop, strict=True):
                    a, surv, tot = (a_i + 2.8) / (p_i + 4.0), 1.0, 0.0
                    for i in range(k):
                        surv *= a * dp[i]
                        tot += surv
                        exp[i + 1] += tot
                assert expected_sums(n, acc, prop, dp) == exp


def test_adaptive_sums_by_depth_are_numpys_bit_for_bit() -> None:
    """Over a batch of more than ADAPTIVE_SCALAR_SEQS sequences the adaptive policy sums with
    numpy in the interpreter and in scalars compiled (`expected_sums_by_depth`, k_max >= 2): the
    same figures exactly, for every k_max, decay and batch. (At k_max = 1 numpy sums the single
    column pairwise: the compiled build keeps numpy there.)"""
    import random

    from sim.policies import ADAPTIVE_SCALAR_SEQS, expected_sums_by_depth

    rnd = random.Random(5)
    for k in range(2, 9):
        for decay in (1.0, 0.93):
            dp = [decay**i for i in range(k)]
            for _ in range(40):
                n = rnd.randint(ADAPTIVE_SCALAR_SEQS + 1, 300)
                acc = [rnd.randint(0, 2000) for _ in range(n)]
                prop = [a + rnd.randint(0, 2000) for a in acc]
                a_arr = (np.array(acc, dtype=np.float64) + 2.8) / (np.array(prop, dtype=np.float64) + 4.0)
                surv = np.cumprod(a_arr[:, None] * np.array(dp)[None, :], axis=1)
                assert expected_sums_by_depth(n, acc, prop, dp) == [float(n), *(n + np.cumsum(surv.sum(axis=0))).tolist()]


def test_acceptance_quantiles_kept_per_class_are_the_direct_inversion() -> None:
    """Per-request acceptance at its quantile, with each class's values kept and reused where the
    quantiles extend a previous call's (common random numbers across a sweep's loads), equals the
    Beta inversion over the whole array in one call, exactly: longer, shorter and unrelated
    quantile arrays, a class without spread, and more classes than are kept."""
    from scipy import stats

    from models.speculative import acceptance_at_quantile, beta_params

    def direct(q: np.ndarray, m: np.ndarray, s: np.ndarray) -> np.ndarray:
        out = m.copy()
        draw = (s > 0) & (m > 0) & (m < 1)
        a, b = beta_params(m[draw], s[draw])
        out[draw] = stats.beta.ppf(q[draw], a, b)
        return np.clip(out, 0.0, 0.999)

    rng = np.random.default_rng(5)
    qq, cc = rng.random(4000), (rng.random(4000) < 0.3).astype(int)
    for trial in range(40):
        n = int(rng.integers(1, 4000))
        means, spreads = np.array([0.75, 0.45, 0.6]), np.array([0.12, 0.15, 0.0])
        c = cc[:n].copy()
        c[rng.random(n) < 0.05] = 2
        q = qq[:n] if trial % 3 else rng.random(n)
        assert np.array_equal(acceptance_at_quantile(q, means[c], spreads[c]), direct(q, means[c], spreads[c]))
    m, s, q = rng.uniform(0.2, 0.9, 300), np.full(300, 0.1), rng.random(300)  # one class per request
    assert np.array_equal(acceptance_at_quantile(q, m, s), direct(q, m, s))


def test_acceptance_quantile_streams_are_kept_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep takes its seeds in turn (seed 1, 2, 3 at one load, then at the next): each seed's
    stream of quantiles keeps its own values, so at the next load only the quantiles beyond the
    previous ones are inverted, and the values are the direct inversion's."""
    import models.speculative as spec

    inverted: list[int] = []
    real = spec.beta_ppf

    def counting(q: np.ndarray, a: Any, b: Any) -> np.ndarray:
        inverted.append(q.size)
        return real(q, a, b)

    monkeypatch.setattr(spec, "beta_ppf", counting)
    monkeypatch.setattr(spec, "_PPF_MEMO", {})
    streams = [np.random.default_rng(seed).random(3000) for seed in (1, 2, 3)]
    for n in (1000, 2000, 3000):  # three loads, each longer
        for q in streams:
            m, s = np.full(n, 0.7), np.full(n, 0.15)
            got = spec.acceptance_at_quantile(q[:n], m, s)
            a, b = spec.beta_params(0.7, 0.15)
            assert np.array_equal(got, np.clip(real(q[:n], a, b), 0.0, 0.999))
    assert inverted == [1000] * 3 + [1000] * 6  # after the first load, only the new quantiles
