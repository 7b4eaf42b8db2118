"""Verdicts judged as a long run would: capacity against long open-loop runs, the stability
verdict on overloaded and healthy runs, closed-loop clients against the response-time law, and
the SLO vocabulary (each target checked on its own metric)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import capacity, ladder

import sim.capacity as cap_mod
from experiments.cli import main
from models.errors import ConfigError
from sim.capacity import closed_loop_throughput, measure_capacity
from sim.deployment import build_runtime
from sim.scenario import load_scenario
from sim.simulate import run_table
from sim.workload import generate
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
MIX = ROOT / "experiments" / "scenarios" / "default-mix.toml"
DRAFT = ROOT / "experiments" / "scenarios" / "llama70b-draft1b.toml"


@pytest.mark.parametrize("path", [MIX, DRAFT], ids=["baseline", "draft-1b-fixed-k"])
def test_capacity_agrees_with_long_open_loop_runs(path: Path) -> None:
    """At 0.93x the measured capacity a 2400 s open-loop run is healthy and stable; at 1.07x it is
    overloaded and not stable (the issue's acceptance check, on two seeds)."""
    sc = load_scenario(path)
    cap = capacity(sc, speculative=True)
    assert cap.full_batch_rps <= cap.peak_rps + 1e-9 and cap.rps <= cap.peak_rps + 1e-9
    for seed in (1, 2):
        below = simulate(sc.with_overrides({"workload.rate_rps": 0.93 * cap.rps, "workload.duration_s": 2400}), seed).summary
        assert below["verdict"] == "stable", below["verdict_reason"]
        assert below["throughput_rps"] == pytest.approx(below["offered_rps"], rel=0.02)
        above = simulate(sc.with_overrides({"workload.rate_rps": 1.07 * cap.rps, "workload.duration_s": 2400}), seed).summary
        assert above["verdict"] == "overloaded" and not above["stable"] and not above["slo_met"]
        assert above["throughput_rps"] < 0.97 * above["offered_rps"]


def test_baseline_capacity_is_the_full_batch_plateau() -> None:
    """Without speculation throughput rises with the population up to the full batch: the curve
    is non-decreasing (within measurement noise) and capacity is its top."""
    cap = capacity(load_scenario(MIX))
    rps = [r[1] for r in cap.curve]
    assert all(b >= a * 0.98 for a, b in itertools.pairwise(rps))
    assert not cap.collapse
    assert cap.rps == pytest.approx(cap.full_batch_rps, rel=0.03)
    # the old backlog measure said 14.64 req/s; long runs saturate near 16.5
    assert 15.8 < cap.rps < 17.2


def test_collapse_is_reported_where_speculation_fills_the_batch() -> None:
    """The speculation machinery's overhead is a fraction of the plain decode pass that grows with
    the decoding sequences (vLLM #49548), so a speculating step grows faster than linearly in the
    batch. With that slope at 0.02 per sequence (25x the measured 0.0008; charged on the decode
    pass only, not on prefill chunks, a collapse needs a steep slope) throughput peaks at a
    moderate population and falls at full batch (vllm-v1: peak 5.51 req/s at 128 in system, 5.09
    at full batch): a collapse. Load between the two is metastable, so the capacity is the
    full-batch figure: an open-loop run below it is stable, and one 7% above it (still below the
    peak) is overloaded within 1200 s."""
    sc = load_scenario(DRAFT, {"rack.num_gpus": 4, "speculative.overhead_frac_per_seq": 0.02})
    cap = measure_capacity(sc, 1)
    assert cap.collapse and cap.full_batch_rps < 0.95 * cap.peak_rps
    assert cap.peak_concurrency < 256 and cap.method.startswith("closed-loop full load")
    assert cap.rps == cap.full_batch_rps and cap.kv_sequences > cap.slots
    assert 1.07 * cap.rps < cap.peak_rps
    below = simulate(sc.with_overrides({"workload.rate_rps": 0.93 * cap.rps, "workload.duration_s": 1200}), 1).summary
    assert below["stable"], below["verdict_reason"]
    above = simulate(sc.with_overrides({"workload.rate_rps": 1.07 * cap.rps, "workload.duration_s": 1200}), 1).summary
    assert above["verdict"] == "overloaded"


def test_capacity_where_the_kv_cache_runs_out_agrees_with_long_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-3.1-70B on two H100s (TP2) keeps ~29k tokens of KV: 18 sequences of the default
    mix's mean length, against 256 batch slots. The closed-loop curve is taken over what the KV
    holds (9, 14, 18 clients) and at full load (320): it peaks near 14 (1.51 req/s) and falls to
    1.02 at full load, where sequences are preempted and recomputed every few steps. The rate
    between is metastable, so the capacity is the full-load figure; a ladder over the slots only
    saw the thrash and, from a shorter window, said 1.066 req/s, at 0.97x of which a 3000 s run
    (seed 2) was overloaded. Now 0.97x is stable and 1.07x overloaded, on two seeds."""
    sc = load_scenario(MIX, {"rack.num_gpus": 2, "deployment.tensor_parallel": 2,
                             "deployment.max_num_batched_tokens": 2048})
    lad = ladder(sc)  # the curve alone: its peak, an upper bound, for a planner to prune with
    assert lad.upper_bound and lad.rps == lad.peak_rps
    windows = []
    real = cap_mod.closed_loop_throughput
    monkeypatch.setattr(cap_mod, "closed_loop_throughput", lambda *a, **k: windows.append(a[1]) or real(*a, **k))
    cap = capacity(sc)  # the ladder kept, only the full-load window measured (4x as long)
    assert windows == [320] and not cap.upper_bound and cap.rps < lad.rps
    assert cap.kv_sequences < 64 < cap.slots
    assert cap.collapse and cap.peak_concurrency <= cap.kv_sequences and cap.rps == cap.full_batch_rps
    assert cap.peak_rps > 1.3 * cap.rps
    for seed in (2, 3):
        run = {"workload.duration_s": 3000, "workload.warmup_s": 300}
        below = simulate(sc.with_overrides({**run, "workload.rate_rps": 0.97 * cap.rps}), seed).summary
        assert below["verdict"] == "stable", below["verdict_reason"]
        above = simulate(sc.with_overrides({**run, "workload.rate_rps": 1.07 * cap.rps}), seed).summary
        assert above["verdict"] == "overloaded"


def test_overload_hidden_in_the_running_set_is_not_stable() -> None:
    """One replica at 8.5 req/s for 60 s served about 6 req/s, and the old rule (waiting queue only)
    called it stable and SLO-met. 60 s is under five request lifetimes after the ramp from an empty
    system, so now it is 'insufficient'; run long enough, the same overload (1.1x one replica's
    capacity, the batch filling before any request waits) is 'overloaded'."""
    short = load_scenario(MIX, {"rack.num_gpus": 4, "workload.rate_rps": 8.5, "workload.duration_s": 60,
                                "workload.warmup_s": 0})
    s = simulate(short).summary
    assert s["verdict"] == "insufficient" and not s["stable"] and not s["slo_met"]
    assert "too short" in s["verdict_reason"]
    one = capacity(load_scenario(MIX, {"rack.num_gpus": 4})).rps
    long = simulate(short.with_overrides({"workload.rate_rps": 1.1 * one, "workload.duration_s": 600})).summary
    assert long["verdict"] == "overloaded" and not long["slo_met"]


def test_ramp_up_from_empty_is_not_overload() -> None:
    """Requests in system rise for a few request lifetimes after the start at any load: a healthy
    run (0.7x capacity) with a short warm-up is judged on the settled stretch only."""
    sc = load_scenario(MIX, {"workload.utilisation": 0.7, "workload.duration_s": 300, "workload.warmup_s": 5})
    s = simulate(sc).summary
    assert s["verdict"] == "stable", s["verdict_reason"]
    assert s["settle_s"] > 5


def test_too_few_requests_is_insufficient_not_stable(make_scenario) -> None:
    sc = make_scenario(workload={"rate_rps": 1.0, "duration_s": 50.0, "warmup_s": 0.0})
    s = simulate(sc).summary
    assert s["verdict"] == "insufficient" and s["stable"] is False and s["slo_met"] is False
    assert "requests measured" in s["verdict_reason"] or "too short" in s["verdict_reason"]


def test_closed_loop_holds_the_population_and_obeys_the_response_time_law(make_scenario) -> None:
    """N clients with think time Z: throughput X = N / (R + Z) (the interactive response-time law),
    and with Z = 0 exactly N requests are in the system after the start."""
    sc = make_scenario(workload={"rate_rps": 1.0, "num_requests": 600, "warmup_s": 0.0,
                                 "prompt_tokens": {"dist": "fixed", "value": 256},
                                 "output_tokens": {"dist": "lognormal", "median": 64, "p90": 200}})
    rt = build_runtime(sc)
    table = generate(sc.workload, 3, 1.0).to_pandas()
    think = np.random.default_rng(0).exponential(2.0, len(table))
    req = run_table(sc, rt, table, 3, concurrency=16, think_s=think, horizon_s=1e9).requests.to_pandas()
    assert req.completion_s.notna().all()
    a, c = req.arrival_s.to_numpy(), req.completion_s.to_numpy()
    t0, t1 = np.sort(c)[100], np.nanmax(a)
    inside = (c > t0) & (c <= t1)
    x = inside.sum() / (t1 - t0)
    r = float((c - a)[inside].mean())
    assert x == pytest.approx(16 / (r + 2.0), rel=0.06)
    req0 = run_table(sc, rt, table, 3, concurrency=16, horizon_s=1e9).requests.to_pandas()
    a0, c0 = req0.arrival_s.to_numpy(), req0.completion_s.to_numpy()
    ts = np.linspace(1.0, float(np.nanmax(a0)) - 1e-6, 50)
    in_sys = (a0[None, :] <= ts[:, None]).sum(1) - (c0[None, :] <= ts[:, None]).sum(1)
    assert (in_sys == 16).all()


def test_closed_loop_throughput_rises_with_population(make_scenario) -> None:
    sc = make_scenario()
    low = closed_loop_throughput(sc, 8, 1, completions=800)
    high = closed_loop_throughput(sc, 64, 1, completions=800)
    assert high[0] > 2 * low[0] and high[2] == pytest.approx(64, rel=0.05)


def test_each_slo_target_is_checked_on_its_own_metric(make_scenario) -> None:
    sc = make_scenario(workload={"rate_rps": 2.0, "duration_s": 120.0, "warmup_s": 10.0},
                       slo={"ttft_p95_s": 5.0, "tpot_p99_s": 1.0, "itl_p99_s": 0.001, "e2e_p50_s": 100.0})
    s = simulate(sc).summary
    assert set(s["slo"]) == {"ttft_p95_s", "tpot_p99_s", "itl_p99_s", "e2e_p50_s"}
    assert s["slo"]["itl_p99_s"]["value"] == s["itl_s"]["p99"] and not s["slo"]["itl_p99_s"]["met"]
    assert s["slo"]["tpot_p99_s"]["value"] == s["tpot_s"]["p99"] and s["slo"]["tpot_p99_s"]["met"]
    assert s["slo"]["ttft_p95_s"]["value"] == s["ttft_s"]["p95"]
    assert s["stable"] and not s["slo_met"]  # ITL fails alone: the run misses its SLO


def test_slo_defaults_and_unknown_names(make_scenario) -> None:
    assert make_scenario().slo.targets() == {"ttft_p99_s": 2.0, "tpot_p99_s": 0.2}
    with pytest.raises(ConfigError, match="did you mean 'itl_p99_s'"):
        make_scenario(slo={"itl_p99": 0.2})
    with pytest.raises(ConfigError, match="slo"):
        make_scenario(slo={"ttft_p99_s": 0.0})


def test_planner_slo_verdict_agrees_with_long_runs() -> None:
    """The planner's 'meets the SLO' is what a long run shows. One TP4 70B replica on the default
    mix (capacity ~7.9 req/s; SLO p99 TTFT 2 s, p99 TPOT 0.2 s), plan runs of 150 s: the old
    verdict passed it at 8.04 req/s (above its capacity) while 3000 s runs fail at 7.64. Now the
    highest passing rate the planner finds by bisection is within 3% of where 3000 s runs (other
    seeds) switch: just below it they pass, just above the first failing rate they fail; a rate
    at or above the capacity fails unsimulated, and one within a few % of it fails (unjudged, or
    on a rerun stopped once its SLO was certain to fail)."""
    from experiments.plan_search import MAX_RUN_S, evaluate

    base = load_scenario(MIX, {"rack.num_gpus": 4, "workload.duration_s": 150.0, "workload.warmup_s": 30.0,
                               "workload.utilisation": None, "workload.rate_rps": 1.0})
    cap = capacity(base, speculative=True).rps

    def ev(rate: float) -> dict:
        return evaluate(base.with_overrides({"workload.rate_rps": rate}), (1,), None, cap)

    over = ev(1.01 * cap)
    assert not over["meets_slo"] and over["summary"] is None and "capacity" in over["reason"]
    close = ev(0.97 * cap)  # unjudged (its rerun would need over MAX_RUN_S), or a rerun that stopped failing
    assert not close["meets_slo"]
    assert f"{MAX_RUN_S:.0f} s" in close.get("reason", "") or "stopped_early" in close["summary"]
    lo, hi = 0.5 * cap, 0.97 * cap
    assert ev(lo)["meets_slo"]
    while hi / lo > 1.03:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ev(mid)["meets_slo"] else (lo, mid)
    assert 0.8 * cap < lo < 0.95 * cap  # the SLO binds below capacity, not at it

    def long_run(rate: float, seed: int) -> dict:
        over = {"workload.rate_rps": rate, "workload.duration_s": 3000.0, "workload.warmup_s": 300.0}
        return simulate(base.with_overrides(over), seed).summary

    for seed in (2, 3):
        below = long_run(0.97 * lo, seed)
        assert below["slo_met"], (lo, below["verdict_reason"], below["slo"])
        above = long_run(1.03 * hi, seed)
        assert not above["slo_met"], (hi, above["slo"])


def test_a_rerun_is_padded_and_the_judged_run_lasts_what_it_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`judged_run` near capacity (one TP4 70B replica at 0.8x its capacity, 150 s plan runs):
    each rerun lasts RELAX_PAD x the warm-up and window the run before it asked for
    (`judged_length`); the run judged asks for at most 5% more than it lasts (the rule is the
    unpadded one); and here the padded rerun is judged as it is, where unpadded reruns take a
    third run (the second asked for ~17% more)."""
    import experiments.plan_search as plan

    base = load_scenario(MIX, {"rack.num_gpus": 4, "workload.duration_s": 150.0, "workload.warmup_s": 30.0,
                               "workload.utilisation": None, "workload.rate_rps": 1.0})
    cap = capacity(base, speculative=True).rps
    sc = base.with_overrides({"workload.rate_rps": 0.8 * cap})
    real = plan.summary
    runs: list[tuple] = []

    def spy(s, seed, points):  # type: ignore[no-untyped-def]
        sm = real(s, seed, points)
        runs.append((s, sm))
        return sm

    monkeypatch.setattr(plan, "summary", spy)

    def judged() -> list[tuple]:
        runs.clear()
        got = plan.judged_run(sc, 1, None, cap)
        assert not isinstance(got, str) and got[0] == runs[-1][0]
        return runs[:]

    padded = judged()
    assert len(padded) == 2
    for (prev, sm), (nxt, _) in itertools.pairwise(padded):
        warm, window = plan.judged_length(prev, sm, cap)
        wl = nxt.workload
        assert wl.warmup_s == pytest.approx(plan.RELAX_PAD * warm, rel=1e-12)
        assert wl.duration_s - wl.warmup_s == pytest.approx(plan.RELAX_PAD * window, rel=1e-12)
    last, sm = padded[-1]
    warm, window = plan.judged_length(last, sm, cap)
    assert warm <= 1.05 * last.workload.warmup_s and window <= 1.05 * (last.workload.duration_s - last.workload.warmup_s)
    assert sm["slo_met"]
    monkeypatch.setattr(plan, "RELAX_PAD", 1.0)
    unpadded = judged()
    assert len(unpadded) == 3
    assert unpadded[-1][0].workload.duration_s < last.workload.duration_s


def test_a_collapse_is_explained_by_its_cause() -> None:
    """The report and `specrack capacity` say why throughput collapses: the KV holding fewer
    sequences than the slots (preemption), or else speculation's overhead growing with the batch."""
    from experiments.report import collapse_cause

    kv = {"collapse": True, "kv_sequences": 18, "batch_slots": 256}
    assert "18 sequences" in collapse_cause(kv) and "preempted" in collapse_cause(kv)
    assert "speculation" in collapse_cause({**kv, "kv_sequences": 600})
    assert "speculation" in collapse_cause({"collapse": True})  # a sweep row from before kv_sequences


def test_a_plain_run_judges_a_trend_only_overload_against_its_own_capacity(tmp_path: Path) -> None:
    # issue 39: default-mix at 0.85 of its capacity, 120 s, seed 2: the run alone reads "overloaded"
    # from requests in system growing over a window far shorter than its relaxation time; `specrack
    # run` measures the capacity then (not asked for) and says insufficient, as a long run would not
    # call it overloaded
    sets = ["--set", "workload.rate_rps=14.29", "--set", "workload.duration_s=120", "--set", "workload.warmup_s=20"]
    alone = simulate(load_scenario("experiments/scenarios/default-mix.toml",
                                   {"workload.rate_rps": 14.29, "workload.duration_s": 120, "workload.warmup_s": 20}),
                     seed=2).summary
    assert alone["verdict"] == "overloaded" and alone["trend_only"]
    assert main(["run", "experiments/scenarios/default-mix.toml", "--seed", "2", *sets, "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["verdict"] == "insufficient" and 0.8 < s["judged_utilisation"] < 0.9
    assert "capacity_rps" in s
