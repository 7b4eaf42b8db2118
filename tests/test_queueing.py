"""The engine against queueing theory.

With one replica, max_num_seqs = 1, one output token and a short prompt, every request is exactly one
engine step (one prefill that samples the only token), so a replica whose steps last a given
service time (`ServiceTimeCost`) is a FCFS single-server queue fed by Poisson arrivals:

    M/D/1 (constant service S):     Wq = rho S / (2 (1 - rho))      (Pollaczek-Khinchine)
    M/M/1 (exponential service S):  Wq = rho S / (1 - rho)

Statistical checks pool >= 10 independent seeds and compare the pooled mean with the theory within
3 standard errors of the across-seed spread (which accounts for the strong autocorrelation of
waiting times near saturation) plus a small allowance for the start-empty transient.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from models.cost import ServiceTimeCost
from sim.deployment import build_runtime
from sim.simulate import run_table
from sim.workload import generate
from specrack import simulate

SERVICE_S = 0.5
SEEDS = range(10)
NO_BACKLOG_LIMIT = 10**9  # the default (20 x max_num_seqs waiting) would end rho = 0.8 runs early


@pytest.fixture(scope="module")
def single_server(make_scenario):
    def make(num_requests: int):
        sc = make_scenario(
            deployment={"max_num_seqs": 1},
            workload={"rate_rps": 1.0, "num_requests": num_requests, "warmup_s": 0.0,
                      "prompt_tokens": {"dist": "fixed", "value": 16},
                      "output_tokens": {"dist": "fixed", "value": 1}},
        )
        rt = build_runtime(sc)
        assert rt.num_replicas == 1
        return sc, rt

    return make


def _run(sc, rt, rate: float, dist: str, seed: int):
    cost = ServiceTimeCost(rt.cost, SERVICE_S, dist, np.random.default_rng([seed, 7]))
    table = generate(sc.workload, seed, rate).to_pandas()
    out = run_table(sc, dataclasses.replace(rt, cost=cost), table, seed,
                    backlog_limit=NO_BACKLOG_LIMIT)
    req, steps, truncated = out.requests.to_pandas(), out.steps.to_pandas(), out.truncated
    assert not truncated
    assert req.completion_s.notna().all()
    return table, req, steps


@pytest.mark.parametrize("dist", ["constant", "exponential"])
def test_engine_is_a_fcfs_single_server(single_server, dist):
    """Per request, the simulated waiting time equals Lindley's recursion
    W[n+1] = max(0, W[n] + S[n] - (A[n+1] - A[n])) on the same arrivals and service times."""
    sc, rt = single_server(1500)
    table, req, steps = _run(sc, rt, 0.8 / SERVICE_S, dist, seed=3)
    assert len(steps) == len(req)  # one step per request
    assert (steps.batch_size == 1).all()
    a = table.arrival_s.to_numpy()
    s = steps.duration_s.to_numpy()  # FCFS: the n-th step serves the n-th request
    w = np.zeros(a.size)
    for i in range(1, a.size):
        w[i] = max(0.0, w[i - 1] + s[i - 1] - (a[i] - a[i - 1]))
    wait = (req.scheduled_s - req.arrival_s).to_numpy()
    np.testing.assert_allclose(wait, w, rtol=0, atol=1e-9)
    # the only token comes at the end of the request's single step
    np.testing.assert_allclose(req.first_token_s - req.arrival_s - wait, s, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(req.completion_s, req.first_token_s)


@pytest.mark.parametrize(
    ("dist", "rho", "num_requests"),
    [
        ("constant", 0.5, 1500),
        ("constant", 0.8, 3000),
        ("exponential", 0.5, 1500),
        ("exponential", 0.8, 3000),
    ],
)
def test_pollaczek_khinchine(single_server, dist, rho, num_requests):
    """Pooled mean waiting time over 10 seeds matches M/D/1 or M/M/1 within 3 standard errors + 3%."""
    sc, rt = single_server(num_requests)
    warm = num_requests // 10  # drop the start-empty transient
    means = []
    for seed in SEEDS:
        _, req, _ = _run(sc, rt, rho / SERVICE_S, dist, seed)
        wait = (req.scheduled_s - req.arrival_s).to_numpy()
        if dist == "constant":  # the same from the token timestamps
            np.testing.assert_allclose(req.first_token_s - req.arrival_s - SERVICE_S, wait, atol=1e-9)
        means.append(wait[warm:].mean())
    means = np.asarray(means)
    pooled = means.mean()
    se = means.std(ddof=1) / np.sqrt(means.size)
    factor = 2.0 if dist == "constant" else 1.0
    theory = rho * SERVICE_S / (factor * (1.0 - rho))
    assert abs(pooled - theory) < 3.0 * se + 0.03 * theory, (
        f"{dist} rho={rho}: simulated Wq {pooled:.4f} +- {se:.4f} s, theory {theory:.4f} s")


def _littles_law(req, t0: float, t1: float) -> tuple[float, float]:
    """(time-average number in system over [t0, t1), arrival rate x mean time in system of the
    requests arriving in [t0, t1))."""
    a = req.arrival_s.to_numpy()
    c = req.completion_s.to_numpy()
    in_window = np.clip(np.minimum(c, t1) - np.maximum(a, t0), 0.0, None)
    big_l = in_window.sum() / (t1 - t0)
    m = (a >= t0) & (a < t1)
    lam = m.sum() / (t1 - t0)
    return big_l, lam * float((c - a)[m].mean())


def test_littles_law(example_short):
    """L = lambda W on an ordinary run of the example scenario (two replicas, lognormal lengths)."""
    res = simulate(example_short, seed=1)
    s = res.summary
    assert s["stable"] and s["backlog"] == 0
    wl = example_short.workload
    big_l, lam_w = _littles_law(res.requests, wl.warmup_s, wl.duration_s)
    assert big_l > 5  # a busy system, not a trivial one
    assert lam_w == pytest.approx(big_l, rel=0.05)
    # the same with the summary's throughput and mean end-to-end latency
    assert s["throughput_rps"] * s["e2e_s"]["mean"] == pytest.approx(big_l, rel=0.05)
