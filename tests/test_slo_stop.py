"""Stopping a run once its SLO is certain to fail (`[sim] stop_on_slo_fail`, sim.metrics.SloWatch):
the count that makes a percentile fail, against numpy's percentile on random data; runs that stop
fail in full and runs that do not stop are bit for bit the full ones; the planner's verdicts are
the same with and without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import capacity

from experiments.plan_search import evaluate
from sim.metrics import SloWatch, request_latencies, slo_checks
from sim.scenario import load_scenario
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
MIX = ROOT / "experiments" / "scenarios" / "default-mix.toml"


def test_the_failing_count_by_hand() -> None:
    """200 requests arrive in the window (one a second from 10 s; one before it): a p99 fails once
    ceil(200 x 0.01) + 2 = 4 of them are over the target. A figure counts once it is final: TTFT
    from the first token on, TPOT and E2E from the completion on, at or before the check."""
    arrival = np.concatenate([[5.0], 10.0 + np.arange(200.0)])
    out = np.full(201, 11)
    w = SloWatch(arrival, out, warmup_s=10.0, end_s=210.0, targets={"ttft_p99_s": 1.0, "itl_p99_s": 0.1})
    assert w.judged == 200 and w.checks == [("ttft_p99_s", "ttft", 1.0, 4)]  # (ITL is not watched)
    first = arrival + 0.5
    done = arrival + 10.0
    first[0] = 100.0  # before the window: never counted
    first[[1, 2, 3]] = arrival[[1, 2, 3]] + 3.0  # three over the target, known from 13 s on
    assert w.failed(first, done, 50.0) is None and w.progress == pytest.approx(0.75)
    first[150] = arrival[150] + 2.0  # the fourth, its first token at 161 s
    assert w.failed(first, done, 160.0) is None
    got = w.failed(first, done, 161.0)
    assert got == {"at_s": 161.0, "target": "ttft_p99_s", "over": 4, "judged": 200, "needed": 4}
    # TPOT: (E2E - TTFT) / (output - 1), counted once completed
    w = SloWatch(arrival, out, warmup_s=10.0, end_s=210.0, targets={"tpot_p50_s": 1.0})
    assert w.checks == [("tpot_p50_s", "tpot", 1.0, 102)]
    done = first + 20.0  # 2 s a token for everyone
    assert w.failed(first, done, 100.0) is None  # (the ones completed by 100 s: fewer than 102)
    assert w.failed(first, done, 300.0)["over"] == 200


@pytest.mark.parametrize("seed", range(6))
def test_the_watch_never_fires_on_a_run_that_meets_its_percentile(seed: int) -> None:
    """Random latencies and completion times: whenever the watch fires at some time, the
    percentile of the final figures (numpy's, as the summary takes it) misses the target."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n = int(rng.integers(20, 400))
        arrival = np.sort(rng.uniform(0, 100, n))
        out = rng.integers(1, 50, n)
        first = arrival + rng.exponential(rng.uniform(0.2, 2.0), n)
        done = first + out * rng.exponential(0.05, n)
        targets = {f"ttft_p{p}_s": float(rng.uniform(0.5, 4.0)) for p in (50, 90, 99)}
        targets["tpot_p95_s"] = float(rng.uniform(0.01, 0.1))
        targets["e2e_p90_s"] = float(rng.uniform(1.0, 5.0))
        warm, end = 10.0, 90.0
        w = SloWatch(arrival, out, warmup_s=warm, end_s=end, targets=targets)
        req = pd.DataFrame({"arrival_s": arrival, "first_token_s": first, "completion_s": done, "output_tokens": out,
                            "scheduled_s": arrival})
        lat = request_latencies(req).to_pandas()[(arrival >= warm) & (arrival < end)]
        s = {f"{m}_s": {f"p{p}": float(np.percentile(lat[f"{m}_s"].dropna(), p)) for p in (50, 90, 95, 99)}
             for m in ("ttft", "tpot", "e2e")}
        checks = slo_checks(s, targets)
        for now in np.linspace(0.0, float(done.max()) + 1.0, 30):
            got = w.failed(first, done, float(now))
            if got is not None:
                assert not checks[got["target"]]["met"], (got, checks[got["target"]])
                break


def test_a_stopped_run_fails_in_full_and_the_others_are_unchanged() -> None:
    """The default mix (70B, two TP4 replicas) from 0.8x to 1.02x its capacity over 900 s: a run
    that stops on a certain SLO failure fails its SLO when run in full (and its failing count
    holds there); a run that does not stop gives the full run's request and step tables and
    summary bit for bit."""
    sc = load_scenario(MIX, {"slo.ttft_p99_s": 2.0, "slo.tpot_p99_s": 0.2, "workload.duration_s": 900.0,
                             "workload.warmup_s": 100.0})
    cap = capacity(sc).rps
    stopped = kept = 0
    for mult, seed in ((0.8, 1), (0.9, 2), (0.95, 1), (0.98, 2), (1.02, 1)):
        run = sc.with_overrides({"workload.rate_rps": mult * cap})
        full = simulate(run, seed)
        fast = simulate(run.with_overrides({"sim.stop_on_slo_fail": True}), seed)
        early = fast.summary.get("stopped_early")
        if early is not None:
            stopped += 1
            assert not full.summary["slo_met"] and not fast.summary["slo_met"]
            assert fast.summary["verdict"] == "unjudged" and fast.summary["horizon_s"] < full.summary["horizon_s"]
            metric = early["target"].split("_")[0]
            req = full.requests
            judged = (req.arrival_s >= 100.0) & (req.arrival_s < 900.0)
            assert early["judged"] == int(judged.sum())
            over = int((req[f"{metric}_s"][judged] > run.slo.targets()[early["target"]]).sum())
            assert over >= early["over"] >= early["needed"]
            assert not full.summary["slo"][early["target"]]["met"] or not full.summary["stable"]
        else:
            kept += 1
            pd.testing.assert_frame_equal(full.requests, fast.requests)
            pd.testing.assert_frame_equal(full.steps, fast.steps)
            a, b = dict(full.summary), dict(fast.summary)
            a.pop("scenario"), b.pop("scenario")
            assert a == b or repr(a) == repr(b)  # (NaN != NaN)
    assert stopped >= 2 and kept >= 2, (stopped, kept)


def test_the_planner_judges_the_same_with_and_without_stopping() -> None:
    """`evaluate` with the rack's capacity reruns near-capacity racks for as long as their
    lifetimes ask; a rerun that stops on a certain SLO failure gives the verdict of the rerun in
    full, and is flagged (the default mix's two TP4 replicas meet a 1.3 s p99 TTFT at 0.85x
    capacity, 1.16 s, and miss it at 0.93x, 1.42 s over a 3000 s rerun)."""
    sc = load_scenario(MIX, {"slo.ttft_p99_s": 1.3, "slo.tpot_p99_s": 0.2})
    cap = capacity(sc, speculative=True).rps
    flagged = 0
    for mult in (0.85, 0.9, 0.93):
        rack = sc.with_overrides({"workload.rate_rps": mult * cap})
        fast = evaluate(rack, (1,), None, cap)
        full = evaluate(rack, (1,), None, cap, stop_on_fail=False)
        assert fast["meets_slo"] == full["meets_slo"], mult
        if fast["summary"] is not None and "stopped_early" in fast["summary"]:
            flagged += 1
            assert not full["meets_slo"]
    assert flagged >= 1


def test_a_rack_fails_on_its_first_failing_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over three seeds, a rack that fails on the first is not run on the others (the verdict
    is the same as over all three); one that passes runs every seed."""
    import experiments.plan_search as plan_mod

    sc = load_scenario(MIX, {"slo.ttft_p99_s": 2.0, "slo.tpot_p99_s": 0.2, "workload.duration_s": 120.0,
                             "workload.warmup_s": 20.0})
    cap = capacity(sc, speculative=True).rps
    real = plan_mod.summary
    seen: list[int] = []

    def summary(run, seed, points):  # type: ignore[no-untyped-def]
        seen.append(seed)
        return real(run, seed, points)

    monkeypatch.setattr(plan_mod, "summary", summary)
    for mult, passes in ((0.5, True), (0.99, False)):
        rack = sc.with_overrides({"workload.rate_rps": mult * cap, "slo.ttft_p99_s": 2.0 if passes else 0.05})
        seen.clear()
        fast = evaluate(rack, (1, 2, 3), None)
        assert fast["meets_slo"] is passes and sorted(set(seen)) == ([1, 2, 3] if passes else [1])
        full = evaluate(rack, (1, 2, 3), None, stop_on_fail=False)
        assert full["meets_slo"] is passes and sorted(set(seen)) == [1, 2, 3]


def test_the_failing_count_holds_at_its_boundary() -> None:
    """For every window size N up to 300 and every percentile, `need` values one float step over
    the target among n <= N finished values (the rest at the target) put numpy's percentile over
    it: the two values it interpolates between are both over. (A count two lower fails this; one
    lower would still hold: the + 2 keeps a spare against the rounding of numpy's rank.)"""
    for n_judged in range(1, 301):
        arrival = np.arange(float(n_judged))
        for p in (50, 90, 95, 99):
            w = SloWatch(arrival, np.full(n_judged, 10), warmup_s=0.0, end_s=float(n_judged),
                         targets={f"ttft_p{p}_s": 1.0})
            for _, _, target, need in w.checks:
                over = np.nextafter(target, np.inf)
                for n in sorted({need, (need + n_judged) // 2, n_judged}):
                    x = np.array([target] * (n - need) + [over] * need)
                    assert np.percentile(x, p) > target, (n_judged, p, need, n)


def test_a_day_with_autoscaling_keeps_the_stop() -> None:
    """A rate-profile day with an autoscaler (its verdict is the fleet's): a stopped run keeps
    `stopped_early` and the verdict 'unjudged'."""
    sc = load_scenario(ROOT / "experiments" / "scenarios" / "day-diurnal.toml",
                       {"workload.rate_profile.day_s": 3600, "workload.duration_s": 3600, "sim.interval_s": 600,
                        "slo.ttft_p99_s": 0.05, "sim.stop_on_slo_fail": True})
    s = simulate(sc, 1).summary
    assert s["verdict"] == "unjudged" and "stopped_early" in s and not s["slo_met"], s["verdict_reason"]
