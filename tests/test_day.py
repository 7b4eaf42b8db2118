"""A day of traffic: rate profiles (non-homogeneous Poisson), the intervals table, autoscaling
against fixed racks, and speculation that follows the load (issue 15, items 2-3).

Days are compressed (`day_s` of 10-15 minutes) on Llama-3.1-70B TP4 with fixed lengths, so every
run takes a few seconds; the shape of the day is what matters, not its length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from helpers import capacity
from scipy import stats

from models.errors import ConfigError
from sim.scenario import scenario_from_dict
from sim.workload import generate, profile_integral, profile_rate
from specrack import simulate

DAY_S = 600.0


def _base(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "rack": {"gpu": "h100-sxm", "num_gpus": 4},
        "deployment": {"model": "llama-3.1-70b", "tensor_parallel": 4, "max_num_seqs": 128},
        "workload": {"rate_rps": 1.0, "duration_s": DAY_S, "warmup_s": 0.0,
                     "prompt_tokens": {"dist": "fixed", "value": 512}, "output_tokens": {"dist": "fixed", "value": 128},
                     "classes": [{"name": "chat", "share": 1.0, "acceptance": 0.6}]},
        "sim": {"interval_s": DAY_S / 12},
        "slo": {"ttft_p99_s": 1.0, "tpot_p99_s": 0.06},
    }
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    return data


@pytest.fixture(scope="module")
def replica_cap() -> float:
    """The speculation-off capacity of one replica of the base deployment (req/s)."""
    return capacity(scenario_from_dict(_base())).rps


def _day(peak: float, trough: float, **over: Any) -> dict[str, Any]:
    """The base on a diurnal day (peak at mid-day); `over` merged last (a workload.rate_profile in
    it replaces the diurnal one)."""
    prof = {"shape": "diurnal", "peak_rps": peak, "trough_rps": trough, "day_s": DAY_S, "peak_hour": 12.0}
    wl_over = over.pop("workload", {})
    data = _base(**over)
    wl = {k: v for k, v in data["workload"].items() if k != "rate_rps"}
    data["workload"] = {**wl, "rate_profile": prof, **wl_over}
    return data


# --------------------------------------------------------------------------- arrivals


def test_nhpp_counts_per_interval_match_the_integrated_rate(tmp_path: Path) -> None:
    """Counts per interval are Poisson with mean Lambda(b) - Lambda(a) (the closed-form integral,
    not the generator): a chi-square over 12 intervals x 20 seeds at p = 0.001, for a diurnal and a
    step (CSV) profile; and the diurnal integral is the numerical integral of its rate."""
    csv = tmp_path / "rates.csv"
    csv.write_text("start_s,rate_rps\n0,2\n100,8\n250,0\n300,5.5\n")
    profiles = [{"shape": "diurnal", "peak_rps": 12.0, "trough_rps": 1.5, "day_s": 600.0, "peak_hour": 9.0},
                {"shape": "csv", "file": str(csv), "scale": 2.0}]
    edges = np.linspace(0.0, 600.0, 13)
    for prof in profiles:
        sc = scenario_from_dict(_day(1, 1, workload={"rate_profile": prof}))
        p = sc.workload.rate_profile
        assert p is not None
        expected = profile_integral(p, edges[:-1], edges[1:])
        if prof["shape"] == "diurnal":
            fine = np.linspace(0.0, 600.0, 600_001)
            numeric = np.trapezoid(profile_rate(p, fine), fine)
            assert float(profile_integral(p, 0.0, 600.0)) == pytest.approx(numeric, rel=1e-9)
        else:
            assert expected[5] == pytest.approx(0.0)  # [250, 300) has rate 0
        chi2 = 0.0
        dof = 0
        for seed in range(20):
            t = generate(sc.workload, seed, None).to_pandas().arrival_s.to_numpy()
            assert (np.diff(t) >= 0).all() and t.min() >= 0 and t.max() < 600.0
            counts = np.histogram(t, bins=edges)[0]
            pos = expected > 0
            assert counts[~pos].sum() == 0  # nothing arrives where the rate is 0
            chi2 += float(((counts[pos] - expected[pos]) ** 2 / expected[pos]).sum())
            dof += int(pos.sum())
        assert chi2 < stats.chi2.ppf(0.999, dof), (prof["shape"], chi2, dof)
        assert chi2 > stats.chi2.ppf(0.001, dof)  # not suspiciously regular either


def test_same_seed_same_day_and_strategies_share_arrivals() -> None:
    a = generate(scenario_from_dict(_day(10, 2)).workload, 3, None).to_pandas()
    b = generate(scenario_from_dict(_day(10, 2, speculative={"method": "draft_model",
                                                             "draft_model": "llama-3.2-1b"})).workload, 3, None).to_pandas()
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize(("over", "needle"), [
    ({"workload": {"rate_profile": {"shape": "diurnal", "peak_rps": 2, "trough_rps": 3}}}, "trough_rps"),
    ({"workload": {"rate_profile": {"shape": "diurnal", "peak_rps": 2, "trough_rps": 1}, "rate_rps": 3}}, "rate_rps"),
    ({"workload": {"rate_profile": {"shape": "weekly", "peak_rps": 2}}}, "rate_profile"),
    ({"workload": {"rate_profile": "diurnal"}}, "must be a table"),
    ({"autoscale": {"policy": "target_utilisation", "target": 1.5}}, "fraction of capacity"),
    ({"autoscale": {"policy": "queue", "target": 8, "max_replicas": 3}}, "autoscale.max_replicas=3 exceeds"),
    ({"autoscale": {"policy": "queue", "target": 8, "min_replicas": 2, "max_replicas": 1}}, "max_replicas"),
    ({"autoscale": {"policy": "queue", "target": 8, "taget": 8}}, "unknown field"),
    ({"speculative": {"draft_model": "llama-3.2-1b", "policy": "follow_load", "load_on_below": 0.9,
                      "load_off_above": 0.8}}, "load_on_below"),
])
def test_bad_day_configs_are_one_line_errors(over: dict[str, Any], needle: str) -> None:
    data = _base()
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v}
    if "rate_profile" in data["workload"] and "rate_rps" not in over.get("workload", {}):
        data["workload"].pop("rate_rps")
    with pytest.raises(ConfigError) as err:
        scenario_from_dict(data)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("text", "needle"), [
    ("start,rate\n0,1\n", "line 1: expected the header"),
    ("start_s,rate_rps\n5,1\n", "line 2: the first interval must start at start_s = 0"),
    ("start_s,rate_rps\n0,1\n10,2\n10,3\n", "line 4: start_s=10 must be after"),
    ("start_s,rate_rps\n0,1\n10,-2\n", "line 3"),
    ("start_s,rate_rps\n0,0\n", "every rate_rps is 0"),
])
def test_bad_rate_csv_names_the_line(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "r.csv"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle) as err:  # at validation, naming the field
        scenario_from_dict(_day(1, 1, workload={"rate_profile": {"shape": "csv", "file": str(f)}}))
    assert str(err.value).startswith("workload.rate_profile.file: ") and "\n" not in str(err.value)


# --------------------------------------------------------------------------- intervals, exactness


def test_autoscaled_day_is_exact_under_fusion_and_deterministic(replica_cap: float) -> None:
    """Fused and unfused runs of an autoscaled day give the same requests and intervals (the
    fleet's changes and the interval ends are fusion cuts), and a rerun gives the same result."""
    data = _day(1.6 * replica_cap, 0.2 * replica_cap, rack={"num_gpus": 8},
                workload={"duration_s": 300.0, "rate_profile": {"shape": "diurnal", "peak_rps": 1.6 * replica_cap,
                                                                "trough_rps": 0.2 * replica_cap, "day_s": 300.0}},
                autoscale={"policy": "target_utilisation", "target": 0.8, "interval_s": 15.0,
                           "replica_warmup_s": 20.0, "scale_down_window_s": 30.0},
                sim={"interval_s": 30.0})
    fused = simulate(scenario_from_dict(data), 2)
    plain = simulate(scenario_from_dict({**data, "sim": {**data["sim"], "fuse_steps": False}}), 2)
    again = simulate(scenario_from_dict(data), 2)
    assert int((fused.steps["count"] > 1).sum()) > 0  # fusion did happen
    assert fused.summary["replicas_peak"] == 2 and fused.summary["replicas_mean"] < 2
    cols = ["arrival_s", "first_token_s", "completion_s", "replica"]
    pd.testing.assert_frame_equal(fused.requests[cols], plain.requests[cols], check_exact=True)
    pd.testing.assert_frame_equal(fused.intervals, plain.intervals, check_exact=False, rtol=1e-9)
    pd.testing.assert_frame_equal(fused.requests, again.requests)
    # GPU-hours are the replicas running integrated over the day, interval by interval
    assert fused.intervals.gpu_hours.sum() == pytest.approx(fused.summary["gpu_hours"], rel=1e-12)
    # the router never sent to a replica that was not live
    tl = pd.DataFrame(fused.run.fleet, columns=["t", "replica", "state"])
    for _, r in fused.requests.sample(300, random_state=0).iterrows():
        ch = tl[(tl.replica == r.replica) & (tl.t <= r.arrival_s)]
        assert ch.state.iloc[-1] in (2, 3)  # live then (a draining one got it before it drained)


def test_an_autoscaled_days_backlog_stop_from_the_bound_is_the_exact_sums_stop(replica_cap: float, monkeypatch) -> None:
    """The arrival process keeps its upper bound on the backlog over every replica of the fleet,
    live or not (the sum it stops on is over the live ones, which change): an overloaded
    autoscaled day stops at the same arrival, with the same requests, as summing the live queues
    after every arrival."""
    from sim import run as run_mod

    data = _day(4.0 * replica_cap, 0.5 * replica_cap, rack={"num_gpus": 8},
                workload={"duration_s": 300.0, "rate_profile": {"shape": "diurnal", "peak_rps": 4.0 * replica_cap,
                                                                "trough_rps": 0.5 * replica_cap, "day_s": 300.0}},
                autoscale={"policy": "target_utilisation", "target": 0.8, "interval_s": 15.0,
                           "replica_warmup_s": 20.0, "scale_down_window_s": 30.0},
                sim={"interval_s": 30.0, "backlog_limit": 40})
    fast = simulate(scenario_from_dict(data), 2)
    inner = run_mod._arrivals
    monkeypatch.setattr(run_mod, "_arrivals", lambda *a, **k: inner(*a, **{**k, "every": True}))
    every = simulate(scenario_from_dict(data), 2)
    assert fast.summary["truncated"] is True
    assert fast.summary["horizon_s"] == every.summary["horizon_s"]
    pd.testing.assert_frame_equal(fast.requests, every.requests)


# --------------------------------------------------------------------------- autoscaling vs fixed racks


def test_autoscaled_day_against_racks_sized_for_the_peak_and_the_mean(replica_cap: float) -> None:
    """A diurnal day peaking at 1.7 replicas' capacity: the rack sized for the peak (2 replicas)
    meets the SLO in every interval; the one sized for the mean (1) misses it at the peak; the
    autoscaled fleet (1-2 replicas) costs GPU-hours between the two, meets the SLO and
    keeps the peak rack's latency (TTFT p99 within 1.5x or 0.1 s of it) in every interval away from
    a warm-up."""
    peak, trough = 1.7 * replica_cap, 0.25 * replica_cap
    day = _day(peak, trough, rack={"num_gpus": 8})
    fixed_peak = simulate(scenario_from_dict(day), 1)
    fixed_mean = simulate(scenario_from_dict({**day, "rack": {"gpu": "h100-sxm", "num_gpus": 4}}), 1)
    auto = simulate(scenario_from_dict({**day, "autoscale": {
        "policy": "target_utilisation", "target": 0.85, "interval_s": 20.0, "replica_warmup_s": 30.0,
        "scale_down_window_s": 60.0}}), 1)
    fp, fm, au = fixed_peak.summary, fixed_mean.summary, auto.summary
    assert fp["slo_met"] and fixed_peak.intervals.slo_met.all()
    assert not fm["slo_met"]
    at_peak = fixed_mean.intervals.offered_rps.idxmax()
    assert not fixed_mean.intervals.slo_met[at_peak]
    assert fixed_mean.intervals.slo_met.iloc[0]  # the morning trough is fine on one replica (the evening still drains the peak)
    assert fm["gpu_hours"] < au["gpu_hours"] < fp["gpu_hours"]
    assert au["replicas_peak"] == 2
    iv, ref = auto.intervals, fixed_peak.intervals
    warming = ((iv.replicas_running - iv.replicas_live) > 1e-9).to_numpy()
    # the queue builds from the interval before a replica's warm-up (the autoscaler reacts to the
    # last interval's rate) until it is live: those intervals are excluded from the latency match
    around = warming | np.append(warming[1:], False)
    steady = ~around
    assert steady.sum() >= 6
    ok = (iv.ttft_s_p99 <= np.maximum(1.5 * ref.ttft_s_p99, ref.ttft_s_p99 + 0.1)).to_numpy()
    assert ok[steady].all(), iv.loc[steady & ~ok, ["start_s", "ttft_s_p99"]]
    assert iv.slo_met[steady].all()  # (around the first warm-up the ramp outruns one replica: SLO missed there)
    # the autoscaled fleet follows the day: fewer replicas at the trough than at the peak
    assert iv.replicas_running.iloc[0] < iv.replicas_running[at_peak]


def test_queue_policy_scales_up_and_drains(replica_cap: float) -> None:
    """Knative-style concurrency target: the fleet grows with requests in system and drains back."""
    res = simulate(scenario_from_dict(_day(1.7 * replica_cap, 0.2 * replica_cap, rack={"num_gpus": 8}, autoscale={
        "policy": "queue", "target": 48, "interval_s": 20.0, "replica_warmup_s": 30.0,
        "scale_down_window_s": 40.0})), 1)
    states = [s for _, _, s in res.run.fleet]
    assert 1 in states and 3 in states and 0 in states[2:]  # warmed up, drained, left
    assert res.summary["verdict"] == "stable" and res.requests.completion_s.notna().all()


# --------------------------------------------------------------------------- speculation follows load


def test_follow_load_is_never_much_worse_than_the_better_of_always_and_never(replica_cap: float) -> None:
    """Over a day from 5% to 95% of capacity, per interval, the follow-load policy's mean TPOT is
    within 20% of the better of speculation always on and never (tolerance: the off state still
    prefills the draft and keeps its KV reserved, and an interval holding a switch mixes the two
    regimes); and it beats each of them somewhere, since each loses at one end of the day."""
    day = _day(0.95 * replica_cap, 0.05 * replica_cap)
    spec = {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4}
    runs = {}
    for name, sp in (("never", None), ("always", {**spec, "policy": "fixed"}),
                     ("follow", {**spec, "policy": "follow_load", "load_off_above": 0.85, "load_on_below": 0.75,
                                 "load_interval_s": 30.0})):
        data = {**day, "speculative": sp} if sp else day
        runs[name] = simulate(scenario_from_dict(data), 1)
    tp = pd.DataFrame({k: r.intervals.tpot_s_mean for k, r in runs.items()})
    best = tp[["never", "always"]].min(axis=1)
    assert (tp.follow <= 1.2 * best).all(), tp
    assert (tp.always > 1.1 * tp.never).any() and (tp.never > 1.1 * tp.always).any()  # each loses somewhere
    assert (tp.follow < tp.always).any() and (tp.follow < tp.never).any()
    share = runs["follow"].intervals.speculating_share
    assert share.iloc[0] == 1.0 and share.iloc[-1] == 1.0 and (share == 0.0).any()  # on at the troughs, off at the peak
    assert 2 <= runs["follow"].summary["follow_load_switches"] <= 4  # hysteresis: no flapping


def test_specrack_run_writes_the_intervals_and_their_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.cli import main

    scenario = tmp_path / "day.toml"
    scenario.write_text("""
[rack]
gpu = "h100-sxm"
num_gpus = 8
[deployment]
model = "llama-3.1-70b"
tensor_parallel = 4
max_num_seqs = 128
[workload]
duration_s = 240
warmup_s = 0
prompt_tokens = { dist = "fixed", value = 512 }
output_tokens = { dist = "fixed", value = 128 }
rate_profile = { shape = "diurnal", peak_rps = 20, trough_rps = 3, day_s = 240 }
[sim]
interval_s = 60
[autoscale]
policy = "target_utilisation"
target = 0.8
interval_s = 10
replica_warmup_s = 10
""")
    out_dir = tmp_path / "out"
    assert main(["run", str(scenario), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "4 intervals of 60 s" in out and "GPU-hours" in out
    iv = pd.read_csv(out_dir / "intervals.csv")
    assert len(iv) == 4 and iv.offered_requests.sum() == len(pd.read_parquet(out_dir / "requests.parquet"))
    assert "plotly" in (out_dir / "intervals.html").read_text()
    assert main(["run", str(scenario), "--out", str(out_dir), "--set", "autoscale.policy=busy"]) == 2
    assert "autoscale.policy" in capsys.readouterr().err


def test_round_robin_queue_autoscaling_is_exact_under_fusion(replica_cap: float) -> None:
    """Round robin over a changing live set, the queue policy, ticks and warm-ups off the interval grid."""
    data = _day(1.6 * replica_cap, 0.2 * replica_cap, rack={"num_gpus": 12}, deployment={"router": "round_robin"},
                workload={"duration_s": 200.0, "rate_profile": {"shape": "diurnal", "peak_rps": 2.2 * replica_cap,
                                                                "trough_rps": 0.2 * replica_cap, "day_s": 200.0}},
                autoscale={"policy": "queue", "target": 40, "interval_s": 7.0, "replica_warmup_s": 11.0,
                           "scale_down_window_s": 14.0},
                sim={"interval_s": 25.0})
    fused = simulate(scenario_from_dict(data), 3)
    plain = simulate(scenario_from_dict({**data, "sim": {**data["sim"], "fuse_steps": False}}), 3)
    assert int((fused.steps["count"] > 1).sum()) > 0 and fused.summary["replicas_peak"] >= 2
    cols = ["arrival_s", "first_token_s", "completion_s", "replica"]
    pd.testing.assert_frame_equal(fused.requests[cols], plain.requests[cols], check_exact=True)
    pd.testing.assert_frame_equal(fused.intervals, plain.intervals, check_exact=False, rtol=1e-9)
