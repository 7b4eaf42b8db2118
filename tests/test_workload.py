"""Workload generation: arrival processes, length distributions, class mix and common random
numbers, each checked against its parameters with sampling tolerances."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sim.scenario import Workload
from sim.simulate import capacity_for, offered_rate
from sim.workload import LengthSampler, gamma_arrivals, generate, poisson_arrivals, streams
from specrack import simulate

SHORT = {"dist": "fixed", "value": 8}


def _wl(**kw) -> Workload:
    base = {"rate_rps": 1.0, "prompt_tokens": SHORT, "output_tokens": SHORT, "warmup_s": 0.0}
    return Workload.model_validate({**base, **kw})


@pytest.mark.parametrize("rate", [0.5, 7.0, 250.0])
def test_poisson_interarrival_mean(rate):
    n = 40_000
    gaps = np.diff(generate(_wl(num_requests=n), seed=11, rate_rps=rate).to_pandas().arrival_s.to_numpy(), prepend=0.0)
    assert (gaps > 0).all()
    se = gaps.std(ddof=1) / np.sqrt(n)
    assert abs(gaps.mean() - 1.0 / rate) < 4 * se
    # exponential gaps: CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


def test_poisson_count_over_duration():
    """Over a duration, the number of arrivals is Poisson(rate x duration), all inside [0, duration)."""
    rate, dur = 20.0, 500.0
    counts = []
    for seed in range(10):
        a = generate(_wl(duration_s=dur), seed=seed, rate_rps=rate).to_pandas().arrival_s.to_numpy()
        assert (np.diff(a) > 0).all() and a[0] >= 0 and a[-1] < dur
        counts.append(a.size)
    mean = rate * dur
    assert abs(np.mean(counts) - mean) < 4 * np.sqrt(mean / len(counts))


def test_poisson_arrivals_many_chunks():
    """Arrivals spanning more than one generated chunk stay increasing and unbiased."""
    rng = np.random.default_rng(3)
    a = poisson_arrivals(rng, 1000.0, 5.0, None)
    assert (np.diff(a) > 0).all() and a[-1] < 5.0
    assert abs(a.size - 5000) < 4 * np.sqrt(5000)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_rate_and_cv(cv):
    rate, n = 3.0, 60_000
    gaps = np.diff(generate(_wl(arrival="gamma", cv=cv, num_requests=n), seed=5, rate_rps=rate).to_pandas().arrival_s.to_numpy(),
                   prepend=0.0)
    se = gaps.std(ddof=1) / np.sqrt(n)
    assert abs(gaps.mean() - 1.0 / rate) < 4 * se
    assert gaps.std(ddof=1) / gaps.mean() == pytest.approx(cv, rel=0.06)


def test_gamma_duration_mode():
    rng = np.random.default_rng(9)
    a = gamma_arrivals(rng, 10.0, 2.0, 1000.0, None)
    assert a[-1] < 1000.0 and (np.diff(a) >= 0).all()
    # burstier than Poisson, so a wider band: sd of a renewal count ~ cv sqrt(rate t)
    assert abs(a.size - 10_000) < 5 * 2.0 * np.sqrt(10_000)


@pytest.mark.parametrize(("median", "p90"), [(1020, 2735), (129, 424), (50, 60)])
def test_lognormal_median_and_p90(median, p90):
    n = 50_000
    wl = _wl(num_requests=n, prompt_tokens={"dist": "lognormal", "median": median, "p90": p90, "max": 10**6},
             output_tokens={"dist": "lognormal", "median": median, "p90": p90, "max": 10**6})
    t = generate(wl, seed=2, rate_rps=1.0).to_pandas()
    for col in ("prompt_tokens", "output_tokens"):
        x = t[col].to_numpy()
        assert x.dtype == np.int64 and x.min() >= 1
        assert np.median(x) == pytest.approx(median, rel=0.03)
        assert np.percentile(x, 90) == pytest.approx(p90, rel=0.03)
    # the analytic mean the capacity model uses matches the sample
    mean = LengthSampler(wl.prompt_tokens).mean()
    assert t.prompt_tokens.mean() == pytest.approx(mean, rel=0.03)
    # prompt and output lengths come from separate streams
    assert not np.array_equal(t.prompt_tokens.to_numpy(), t.output_tokens.to_numpy())


def test_lognormal_respects_max():
    wl = _wl(num_requests=20_000, prompt_tokens={"dist": "lognormal", "median": 1000, "p90": 5000, "max": 3000})
    x = generate(wl, seed=1, rate_rps=1.0).to_pandas().prompt_tokens
    assert x.max() == 3000 and x.min() >= 1
    # the mean capacity uses is that of the clipped lengths (1346; the unclipped lognormal's is 2200)
    assert x.mean() == pytest.approx(LengthSampler(wl.prompt_tokens).mean(), rel=0.02)


def test_fixed_lengths():
    t = generate(_wl(num_requests=100, prompt_tokens={"dist": "fixed", "value": 33}), seed=1, rate_rps=1.0).to_pandas()
    assert (t.prompt_tokens == 33).all() and (t.output_tokens == 8).all()


def test_class_shares():
    shares = (0.5, 0.3, 0.15, 0.05)
    n = 40_000
    wl = _wl(num_requests=n, classes=[{"name": f"c{i}", "share": s} for i, s in enumerate(shares)])
    cls = generate(wl, seed=4, rate_rps=1.0).to_pandas().cls.to_numpy()
    counts = np.bincount(cls, minlength=len(shares))
    assert counts.size == len(shares)
    for i, p in enumerate(shares):
        assert abs(counts[i] / n - p) < 4 * np.sqrt(p * (1 - p) / n), (i, counts[i] / n, p)


def test_table_schema_and_streams():
    t = generate(_wl(num_requests=500), seed=1, rate_rps=2.0).to_pandas()
    assert list(t.columns) == ["id", "arrival_s", "prompt_tokens", "output_tokens", "cls", "accept_q"]
    np.testing.assert_array_equal(t.id, np.arange(500))
    assert t.accept_q.between(0, 1).all()
    # same seed, same table; another seed, other arrivals
    pd.testing.assert_frame_equal(t, generate(_wl(num_requests=500), seed=1, rate_rps=2.0).to_pandas())
    assert not np.array_equal(t.arrival_s, generate(_wl(num_requests=500), seed=2, rate_rps=2.0).to_pandas().arrival_s)
    # the named streams are independent generators
    s = streams(1)
    draws = {name: g.random() for name, g in s.items()}
    assert len(set(draws.values())) == len(draws)


def test_common_random_numbers_across_lengths():
    """Changing the length distributions leaves the arrivals and the class/acceptance draws alone."""
    a = generate(_wl(num_requests=300), seed=8, rate_rps=3.0).to_pandas()
    b = generate(_wl(num_requests=300, output_tokens={"dist": "lognormal", "median": 100, "p90": 300}),
                 seed=8, rate_rps=3.0).to_pandas()
    pd.testing.assert_series_equal(a.arrival_s, b.arrival_s)
    pd.testing.assert_series_equal(a.accept_q, b.accept_q)
    pd.testing.assert_series_equal(a.prompt_tokens, b.prompt_tokens)


def test_bad_rate_is_a_config_error():
    from models.errors import ConfigError

    for rate in (None, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="rate"):
            generate(_wl(num_requests=10), seed=1, rate_rps=rate).to_pandas()


def test_arrivals_identical_across_speculative_variants(example_short):
    """Common random numbers: two scenarios differing only in [speculative] see the same requests
    (utilisation is relative to the same baseline capacity)."""
    base = example_short.with_overrides({"workload.duration_s": 30, "workload.warmup_s": 5})
    spec = base.with_overrides({"speculative": {"method": "draft_model", "draft_model": "llama-3.2-1b",
                                                "num_speculative_tokens": 3}})
    eagle = base.with_overrides({"speculative": {"method": "eagle", "num_speculative_tokens": 2}})
    rate = offered_rate(base, capacity_for(base))
    assert offered_rate(spec, capacity_for(spec)) == rate and offered_rate(eagle, capacity_for(eagle)) == rate
    tables = [generate(sc.workload, 3, offered_rate(sc, capacity_for(sc))).to_pandas() for sc in (base, spec, eagle)]
    for t in tables[1:]:
        pd.testing.assert_frame_equal(tables[0], t)
    # and end to end through simulate()
    ra, rb = simulate(base, 3), simulate(spec, 3)
    cols = ["id", "cls", "arrival_s", "prompt_tokens", "output_tokens", "acceptance"]
    pd.testing.assert_frame_equal(ra.requests[cols[:5]], rb.requests[cols[:5]])
    assert rb.summary["acceptance_rate"] > 0  # the variant really speculated
