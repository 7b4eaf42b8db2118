"""A run's lifecycle: the summary assembled from sections that own disjoint keys, and the capacity
a run needs passed in (measured before it, visibly), never measured inside it."""

from __future__ import annotations

import json
import math

import pytest

import specrack
from sim.capacity import CapacityStore, capacity_for, capacity_key, needs_capacity
from sim.metrics import RELAX_EVIDENCE, RELAX_WARMUP, RELAX_WINDOW, Stability
from sim.run import RunOutput
from sim.scenario import Scenario, scenario_from_dict
from sim.simulate import simulate
from sim.summary import ORDER, assemble, slo_section, verdict_section


def test_a_key_written_by_two_sections_raises() -> None:
    with pytest.raises(ValueError, match="'verdict' written by two sections, 'verdict' and 'stability'"):
        assemble({"verdict": {"verdict": "stable"}, "stability": {"verdict": "overloaded"}})


def test_a_section_writes_only_the_keys_the_layout_gives_it() -> None:
    with pytest.raises(ValueError, match="'slo_met' from section 'fleet': LAYOUT gives it to 'verdict'"):
        assemble({"fleet": {"slo_met": True}})
    with pytest.raises(ValueError, match=r"'no_such_key' .* no section"):
        assemble({"run": {"no_such_key": 1}})


def test_the_summary_follows_the_layout_whatever_order_the_sections_come_in() -> None:
    got = assemble({"provenance": {"seed": 3}, "verdict": {"slo_met": True, "verdict": "stable"},
                    "throughput": {"ttft_s": {}}})
    assert list(got) == ["ttft_s", "verdict", "slo_met", "seed"]
    # a real run's summary is assembled in that order too (nothing added outside the layout)
    summary = simulate(_small(rate_rps=2.0), 1).summary
    assert list(summary) == [k for k in ORDER if k in summary]


def test_the_verdict_is_decided_once_from_all_its_inputs() -> None:
    """The stability test's verdict, unless the rate varies on purpose (then the work left
    unfinished decides), unless the run stopped on a certain SLO failure (then 'unjudged', failed)."""
    judged = Stability({"backlog": 0, "judged_requests": 500}, "overloaded", ["TTFT grew by 3.00 s over the window"])
    slo = {"ttft_p99_s": {"target": 2.0, "value": 1.0, "met": True}}
    v = verdict_section(judged, slo, truncated=False, time_varying_open=False, stopped_early=None)
    assert {k: v[k] for k in ("verdict", "verdict_reason", "stable", "slo_met")} == {
        "verdict": "overloaded", "verdict_reason": "TTFT grew by 3.00 s over the window", "stable": False,
        "slo_met": False}
    assert v["judged_utilisation"] != v["judged_utilisation"]  # no capacity given: NaN
    v = verdict_section(judged, slo, truncated=False, time_varying_open=True, stopped_early=None)
    assert v["verdict"] == "stable" and v["slo_met"] and v["verdict_reason"].startswith("time-varying")
    v = verdict_section(judged, slo, truncated=True, time_varying_open=True, stopped_early=None)
    assert v["verdict"] == "overloaded" and v["verdict_reason"].startswith("stopped at the backlog limit")
    early = {"at_s": 300.0, "target": "ttft_p99_s", "over": 12, "judged": 900, "needed": 11}
    v = verdict_section(judged, slo, truncated=False, time_varying_open=True, stopped_early=early)
    assert (v["verdict"], v["stable"], v["slo_met"]) == ("unjudged", False, False)
    assert v["verdict_reason"].startswith("stopped at 300 s: 12 of the window's 900 requests already miss ttft_p99_s")
    # the stopped target's figure was never reached: NaN, unmet
    checks = slo_section({"ttft_s": {"p99": 1.0}}, {"ttft_p99_s": 2.0}, early)["slo"]
    assert checks["ttft_p99_s"]["met"] is False and checks["ttft_p99_s"]["value"] != checks["ttft_p99_s"]["value"]


def test_a_verdict_given_its_capacity_is_judged_against_it() -> None:
    """At or above its own capacity a run is never 'stable'; below it, a trend over a window
    shorter than RELAX_EVIDENCE relaxation times is 'insufficient' and names the run that would
    settle it; the same trend over a long enough window stays 'overloaded'; a backlog left at
    the horizon is overload whatever the window."""
    slo = {"ttft_p99_s": {"target": 2.0, "value": 1.0, "met": True}}
    stable = Stability({"backlog": 0, "judged_requests": 500, "trend_only": False}, "stable", [])
    v = verdict_section(stable, slo, truncated=False, time_varying_open=False, stopped_early=None, own_rho=1.05,
                        e2e_mean_s=8.0, window_s=100.0)
    assert (v["verdict"], v["stable"], v["slo_met"]) == ("overloaded", False, False)
    assert v["verdict_reason"].startswith("offered 1.05x the deployment's own measured capacity")
    trend = Stability({"backlog": 0, "judged_requests": 500, "trend_only": True}, "overloaded",
                      ["requests in system grew by 59 over the window (mean 90 in its first half)"])
    relax = 8.0 / (1 - 0.9)  # 80 s
    short = verdict_section(trend, slo, truncated=False, time_varying_open=False, stopped_early=None, own_rho=0.9,
                            e2e_mean_s=8.0, window_s=(RELAX_EVIDENCE - 1) * relax)
    assert short["verdict"] == "insufficient" and not short["stable"] and short["judged_utilisation"] == 0.9
    assert f"a run of at least {math.ceil((RELAX_WARMUP + RELAX_WINDOW) * relax / 10) * 10} s" in short["verdict_reason"]
    long = verdict_section(trend, slo, truncated=False, time_varying_open=False, stopped_early=None, own_rho=0.9,
                           e2e_mean_s=8.0, window_s=(RELAX_EVIDENCE + 1) * relax)
    assert long["verdict"] == "overloaded"
    backlog = Stability({"backlog": 7, "judged_requests": 500, "trend_only": False}, "overloaded",
                        ["7 requests unfinished at the horizon"])
    v = verdict_section(backlog, slo, truncated=False, time_varying_open=False, stopped_early=None, own_rho=0.9,
                        e2e_mean_s=8.0, window_s=100.0)
    assert v["verdict"] == "overloaded"


def _small(**workload: object) -> Scenario:
    """One small replica (an 8B model, 8 batch slots, short fixed lengths): capacity in seconds."""
    return scenario_from_dict({
        "rack": {"gpu": "h100-sxm", "num_gpus": 1},
        "deployment": {"model": "llama-3.1-8b", "tensor_parallel": 1, "max_num_seqs": 8},
        "workload": {"duration_s": 40.0, "warmup_s": 5.0, "prompt_tokens": {"dist": "fixed", "value": 64},
                     "output_tokens": {"dist": "fixed", "value": 16}, **workload},
    })


def test_a_utilisation_run_takes_its_capacity_as_an_input() -> None:
    """Without the capacity it needs, `sim.simulate.simulate` measures nothing: a one-line error
    names the fix. `capacity_for` measures it (into the caller's store; there is no process default),
    and the front door `specrack.simulate` does that step itself: the same summary."""
    sc = _small(utilisation=0.5)
    assert needs_capacity(sc) == "workload.utilisation = 0.5"
    with pytest.raises(ValueError, match=r"workload.utilisation = 0.5 needs .* pass capacity=capacity_for\(sc\)") as err:
        simulate(sc, 1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"capacity_for\(sc, with_capacity=True\)"):
        simulate(sc.with_overrides({"workload.rate_rps": 1.0}), 1, with_capacity=True)
    store = CapacityStore()
    cap = capacity_for(sc, store=store)
    assert cap is not None and cap.speculative is None
    assert store.capacities[capacity_key(sc)] is cap.baseline
    res = simulate(sc, 1, capacity=cap)
    assert res.summary["offered_rate_rps"] == 0.5 * cap.baseline.rps
    assert isinstance(res.run, RunOutput) and res.run.requests is res.request_table and res.run.fleet is None
    front = specrack.simulate(sc, 1, store=store)
    assert json.dumps(front.summary, default=float) == json.dumps(res.summary, default=float)
    # a load set as a rate needs none: nothing is measured
    assert capacity_for(sc.with_overrides({"workload.rate_rps": 1.0}), store=CapacityStore()) is None
