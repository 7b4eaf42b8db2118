"""The capacity planner (`experiments/plan.py`, `specrack plan`): the answer is the smallest rack
that meets the SLO (one replica fewer fails it, checked by simulating it), GPUs needed are
monotone in traffic and in the SLO, the decision map agrees with direct simulations, retraining
cost is linear in the teacher's update cadence, the acceptance shift loses speedup on tail-heavy
traffic, bad plan files give one-line errors, and the command writes its table and report.

Every plan here is small (60 s runs after 10 s of warm-up, one seed, low rates); the expensive
results are computed once per module."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from helpers import capacity, one_line_error

from experiments.cli import main
from experiments.plan import load_plan, run_plan
from experiments.plan_racks import scenario_for
from experiments.plan_search import evaluate, judged_run, min_rack, plan_row
from experiments.plan_spec import PlanSpec
from experiments.plan_studies import (
    CADENCES,
    acceptance_shift,
    capacity_curves,
    decision_map,
    map_tasks,
    retraining_table,
    winners,
)
from experiments.planfile import Strategy, builtin_strategies
from models.errors import ConfigError
from sim.scenario import Scenario, load_scenario
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "experiments" / "scenarios" / "default-mix.toml"
GPU = "h100-sxm"
RATE = 12.0  # baseline 70B on TP4 H100s carries ~7.4 req/s a replica: 12 req/s needs two replicas
SHORT = {"workload.duration_s": 60.0, "workload.warmup_s": 10.0}


def plan_text(*, rate: float = RATE, strategies: tuple[str, ...] = ("baseline", "draft-1b", "distilled-8b"),
              ttft: float = 2.0, tpot: float = 0.2, max_gpus: int = 32, floor: float = 0.9, extra: str = "",
              search: str = "configurations = false") -> str:
    names = ", ".join(f'"{s}"' for s in strategies)
    return textwrap.dedent(f"""\
        name = "tiny"
        base = "{BASE}"
        strategies = [{names}]

        [traffic]
        rate_rps = {rate}

        [slo]
        ttft_p99_s = {ttft}
        tpot_p99_s = {tpot}

        [search]
        gpus = ["{GPU}"]
        usd_per_gpu_hour = {{ {GPU} = 2.5 }}
        max_gpus = {max_gpus}
        duration_s = 60
        warmup_s = 10
        seeds = [1]
        {search}

        [quality]
        floor_tail = {floor}
        teacher_updates_per_month = 1.0

        [analyses]
        curve_multipliers = [0.25, 0.5, 1.0, 2.0]
        map_utilisation = [0.3, 0.8]
        map_acceptance = [0.5, 0.8]
        shift_tail_shares = [0.0, 0.5]
        shift_utilisation = 0.5
        """) + extra


def write_plan(tmp: Path, name: str = "plan.toml", **kw) -> Path:
    p = tmp / name
    p.write_text(plan_text(**kw))
    return p


# ----------------------------------------------------------------------------- shared results


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plan")


@pytest.fixture(scope="module")
def spec(plan_dir: Path) -> PlanSpec:
    return load_plan(write_plan(plan_dir))


@pytest.fixture(scope="module")
def loose_spec(plan_dir: Path) -> PlanSpec:
    return load_plan(write_plan(plan_dir, "loose.toml", ttft=4.0, tpot=0.4))


@pytest.fixture(scope="module")
def answer(spec: PlanSpec) -> pd.DataFrame:
    return run_plan(spec, jobs=2)


@pytest.fixture(scope="module")
def curves(spec: PlanSpec, answer: pd.DataFrame) -> pd.DataFrame:
    return capacity_curves(spec, answer, jobs=2)


@pytest.fixture(scope="module")
def loose_curves(loose_spec: PlanSpec) -> pd.DataFrame:
    return capacity_curves(loose_spec, run_plan(loose_spec, jobs=2), jobs=2)


@pytest.fixture(scope="module")
def map_spec(plan_dir: Path) -> PlanSpec:
    return load_plan(write_plan(plan_dir, "map.toml", strategies=("baseline", "draft-1b", "eagle")))


@pytest.fixture(scope="module")
def cells(map_spec: PlanSpec) -> pd.DataFrame:
    return decision_map(map_spec, jobs=2)


def short_base(ttft: float = 2.0, tpot: float = 0.2) -> Scenario:
    """The base scenario built independently of the planner (same file, same run length and SLO)."""
    return load_scenario(BASE, {**SHORT, "slo.ttft_p99_s": ttft, "slo.tpot_p99_s": tpot})


# ----------------------------------------------------------------------------- the plan file


def test_load_plan_reads_the_example_and_a_tiny_plan(spec: PlanSpec) -> None:
    ex = load_plan(ROOT / "experiments" / "plans" / "chat-70b.toml", quick=True)
    assert ex.rate_rps == 12.0 and ex.max_gpus == 32 and ex.gpus == (GPU,)
    assert [s.name for s in ex.strategies][:2] == ["baseline", "draft-1b"]
    assert ex.base.workload.duration_s == 120 and ex.map_utilisation == (0.3, 0.8)  # the [quick] section applied
    assert load_plan(ROOT / "experiments" / "plans" / "chat-70b.toml").base.workload.duration_s == 150

    assert spec.rate_rps == RATE and spec.seeds == (1,) and spec.prices == {GPU: 2.5}
    assert spec.base.slo.ttft_p99_s == 2.0 and spec.base.slo.tpot_p99_s == 0.2 and spec.base.slo.itl_p99_s is None
    assert spec.base.workload.duration_s == 60 and spec.base.workload.warmup_s == 10
    b = builtin_strategies()
    assert spec.strategies == (b["baseline"], b["draft-1b"], b["distilled-8b"])
    assert isinstance(b["eagle"], Strategy) and b["baseline"].overrides == {}


# ----------------------------------------------------------------------------- minimality


def test_the_answer_is_feasible_and_ranked(answer: pd.DataFrame) -> None:
    by = answer.set_index("strategy")
    assert set(by.index) == {"baseline", "draft-1b", "distilled-8b"}
    assert by.feasible.all()
    # 12 req/s is beyond one TP4 replica of the 70B (the minimality test checks the exact count)
    assert by.loc["baseline", "replicas"] >= 2 and by.loc["baseline", "gpus"] == 4 * by.loc["baseline", "replicas"]
    assert by.loc["draft-1b", "replicas"] >= 2 and by.loc["draft-1b", "gpus"] == 4 * by.loc["draft-1b", "replicas"]
    assert by.loc["distilled-8b", "gpus"] == by.loc["distilled-8b", "replicas"] >= 1
    assert not answer.one_fewer_meets_slo.any()
    assert (answer.ttft_p99_s <= 2.0).all() and (answer.tpot_p99_s <= 0.2).all()
    # every SLO check by name, with the run's verdict and the sample behind it
    assert (answer.slo_ttft_p99_s_value == answer.ttft_p99_s).all() and (answer.slo_ttft_p99_s_target == 2.0).all()
    assert (answer.slo_tpot_p99_s_target == 0.2).all() and answer.slo_tpot_p99_s_met.all()
    assert set(answer.binding_slo) <= {"ttft_p99_s", "tpot_p99_s"} and (answer.verdict == "stable").all()
    assert (answer.judged_requests >= 500).all() and (answer.itl_samples > answer.judged_requests).all()
    assert answer.simulated_rate_rps.between(0.9 * RATE, 1.1 * RATE).all()
    for _, r in answer.iterrows():
        assert r.serving_usd_per_month == pytest.approx(r.gpus * 2.5 * 720.0)
        assert r.total_usd_per_month == pytest.approx(r.serving_usd_per_month + r.retraining_usd_per_month)
    # the distilled 8B keeps ~0.78 of the tail and fails the 0.9 floor: it ranks after every passing option
    assert not by.loc["distilled-8b", "passes_quality_floor"]
    assert by.loc["baseline", "passes_quality_floor"] and by.loc["draft-1b", "passes_quality_floor"]
    assert answer.strategy.iloc[-1] == "distilled-8b"
    passing = answer[answer.passes_quality_floor.astype(bool)]
    assert passing.total_usd_per_month.is_monotonic_increasing


def _check_minimal(base: Scenario, name: str, replicas: int, rate: float) -> None:
    s = builtin_strategies()[name]
    at = evaluate(scenario_for(base, s, GPU, {GPU: 2.5}, replicas, rate, 1.0), (1,))
    fewer = evaluate(scenario_for(base, s, GPU, {GPU: 2.5}, replicas - 1, rate, 1.0), (1,))
    assert at["meets_slo"], (name, replicas, rate)
    assert not fewer["meets_slo"], (name, replicas - 1, rate, fewer["summary"]["ttft_s"], fewer["summary"]["tpot_s"])


def test_the_answer_is_minimal(answer: pd.DataFrame, curves: pd.DataFrame) -> None:
    """Every answer with R > 1 replicas: the same rack with R - 1 replicas, built and simulated
    directly, fails the SLO, and with R it passes."""
    base = short_base()
    checked = []
    rows = pd.concat([answer, curves[curves.traffic_multiplier == 2.0]])  # 12 and 24 req/s
    for _, r in rows[rows.feasible.astype(bool)].iterrows():
        if int(r.replicas) > 1:
            _check_minimal(base, r.strategy, int(r.replicas), float(r.rate_rps))
            checked.append((r.strategy, r.rate_rps, int(r.replicas)))
    assert any(s == "baseline" and rate == RATE for s, rate, _ in checked), checked
    assert any(rate == 2 * RATE and reps >= 3 for _, rate, reps in checked), checked  # a bisected answer


def test_min_rack_started_high_still_finds_the_minimum(spec: PlanSpec, answer: pd.DataFrame) -> None:
    """Started at a generous guess (as the capacity curves do), the search bisects down to the same answer."""
    s = builtin_strategies()["baseline"]
    r = min_rack(spec.base, s, GPU, spec.prices, RATE, spec.max_gpus, spec.seeds, 1.0, start=5)
    want = answer.set_index("strategy").loc["baseline", "replicas"]
    assert r["feasible"] and r["replicas"] == want and r["gpus"] == 4 * want and not r["one_fewer_meets_slo"]
    row = plan_row(spec, s, GPU, RATE, start=8)
    assert row["replicas"] == answer.set_index("strategy").loc["baseline", "replicas"]


def test_min_rack_reports_infeasible_within_max_gpus(spec: PlanSpec) -> None:
    s = builtin_strategies()["baseline"]
    r = min_rack(spec.base, s, GPU, spec.prices, RATE, 4, spec.seeds, 1.0)  # one replica only: too slow
    assert not r["feasible"] and "max_gpus" in r["reason"]
    r = min_rack(spec.base, s, GPU, spec.prices, RATE, 2, spec.seeds, 1.0)  # TP4 does not fit at all
    assert not r["feasible"] and "4 GPUs" in r["reason"]
    row = plan_row(dataclasses.replace(spec, max_gpus=4), s, GPU, RATE)
    assert row["feasible"] is False and row["reason"]


# ----------------------------------------------------------------------------- monotonicity


def _gpus(curves: pd.DataFrame) -> dict[tuple[str, float], int]:
    assert curves.feasible.all(), curves[~curves.feasible.astype(bool)]
    return {(r.strategy, round(r.traffic_multiplier, 6)): int(r.gpus) for _, r in curves.iterrows()}


def test_doubling_traffic_never_reduces_the_gpus_needed(curves: pd.DataFrame, loose_curves: pd.DataFrame,
                                                        answer: pd.DataFrame) -> None:
    for c in (curves, loose_curves):
        g = _gpus(c)
        for s in ("baseline", "draft-1b", "distilled-8b"):
            for m in (0.25, 0.5, 1.0):
                assert g[(s, 2 * m)] >= g[(s, m)], (s, m, g)
        assert g[("baseline", 2.0)] > g[("baseline", 0.25)]  # 3 -> 24 req/s needs more than one replica
    # the curve at multiplier 1 is the plan's answer
    g = _gpus(curves)
    assert g[("baseline", 1.0)] == answer.set_index("strategy").loc["baseline", "gpus"]


def test_a_looser_slo_never_increases_the_gpus_needed(curves: pd.DataFrame, loose_curves: pd.DataFrame) -> None:
    strict, loose = _gpus(curves), _gpus(loose_curves)
    assert strict.keys() == loose.keys()
    for k in strict:
        assert loose[k] <= strict[k], (k, loose[k], strict[k])
    # (whether it helps somewhere depends on what binds: in these 60 s runs the stability verdict,
    # which no latency target loosens, binds most answers)


# ----------------------------------------------------------------------------- decision map


def test_decision_map_covers_every_cell(map_spec: PlanSpec, cells: pd.DataFrame) -> None:
    assert len(cells) == 2 * 2 * 3
    assert set(cells.utilisation) == {0.3, 0.8} and set(cells.acceptance) == {0.5, 0.8}
    assert set(cells.strategy) == {"baseline", "draft-1b", "eagle"}
    win = winners(cells)
    assert len(win) == 4
    known = {"baseline", "draft-1b", "eagle", "none"}
    assert set(win.winner) <= known
    for _, w in win.iterrows():
        g = cells[(cells.utilisation == w.utilisation) & (cells.acceptance == w.acceptance) & cells.feasible]
        if w.winner == "none":  # never painted as a winner: nothing passed there
            assert g.empty or not g.passes_quality_floor.any()
            assert math.isnan(w.total_usd_per_month) and w.rack == ""
        else:  # the cheapest passing rack, named
            assert w.margin >= 0 and w.total_usd_per_month == g.total_usd_per_month.min()
            assert w.rack == f"{int(w.gpus)}x {GPU}"
    # at low load, higher acceptance makes speculation faster
    c = cells.set_index(["utilisation", "acceptance", "strategy"]).tpot_mean_s
    for s in ("draft-1b", "eagle"):
        assert c[(0.3, 0.8, s)] < c[(0.3, 0.5, s)]


def _cell_scenario(base: Scenario, s: Strategy, rate: float, a: float, replicas: int) -> Scenario:
    """A map cell rebuilt from scratch: the base with the strategy's overrides, every class's
    acceptance set to the cell's, the rate offered, the rack sized to `replicas` TP4 replicas."""
    classes = [dict(c.model_dump(mode="json"), acceptance=a) for c in base.workload.classes]
    return base.with_overrides({**s.overrides, "workload.classes": classes, "workload.rate_rps": rate,
                                "rack.num_gpus": 4 * replicas})


def _judged(sc: Scenario, seed: int = 1) -> dict:
    """The plan's judgement of a rack, rebuilt: the run `judged_run` picks for it (as long as the
    load's relaxation time asks, given the rack's measured capacity) simulated directly here, or
    a failing summary when it is failed unjudged (offered >= capacity)."""
    judged = judged_run(sc, seed, None, _rack_capacity(sc))
    if isinstance(judged, str):
        return {"slo_met": False, "reason": judged}
    return simulate(judged[0], seed).summary


def _rack_capacity(sc: Scenario) -> float:
    """Replicas x the measured capacity of one replica (as configured, speculation included)."""
    per = 4  # the map's racks are TP4 replicas (_cell_scenario)
    replicas = sc.rack.num_gpus // per
    return replicas * capacity(sc.with_overrides({"rack.num_gpus": per}), speculative=True).rps


@pytest.mark.parametrize(("u", "a"), [(0.3, 0.8), (0.8, 0.5)])
def test_decision_map_cells_match_direct_simulations(map_spec: PlanSpec, cells: pd.DataFrame, u: float, a: float) -> None:
    """Every strategy's rack in a cell meets the SLO when simulated directly (identical figures:
    runs are deterministic) and one replica fewer does not; the rate is u x the base rack's
    capacity (speculation off)."""
    base = short_base()
    rate = u * capacity(base).rps
    got = cells[(cells.utilisation == u) & (cells.acceptance == a)].set_index("strategy")
    for s in map_spec.strategies:
        r = got.loc[s.name]
        assert r.rate_rps == pytest.approx(rate, rel=1e-12)
        assert bool(r.feasible), s.name  # 32 GPUs carry 0.8 x one 8-GPU rack's capacity for every strategy
        sm = _judged(_cell_scenario(base, s, rate, a, int(r.replicas)))
        assert sm["slo_met"] and sm["tpot_s"]["mean"] == r.tpot_mean_s, s.name
        if r.replicas > 1:
            assert not _judged(_cell_scenario(base, s, rate, a, int(r.replicas) - 1))["slo_met"], s.name


def test_decision_map_searches_a_plain_strategy_once_per_utilisation(map_spec: PlanSpec, cells: pd.DataFrame) -> None:
    """A strategy that does not speculate runs the same simulations at every acceptance: the map
    searches it once per utilisation and reports that answer in each acceptance's cell (checked
    against direct simulation by test_decision_map_cells_match_direct_simulations); every
    speculating strategy is searched in every cell."""
    tasks, layout = map_tasks(map_spec)
    n_u, n_a = len(map_spec.map_utilisation), len(map_spec.map_acceptance)
    assert n_a > 1 and len(layout) == n_u * n_a * len(map_spec.strategies) == len(cells)
    names = [t[1] for t in tasks]
    assert names.count("baseline") == n_u
    assert names.count("draft-1b") == names.count("eagle") == n_u * n_a
    assert [a for a, _ in layout] == cells.acceptance.tolist()
    plain = cells[cells.strategy == "baseline"]
    for _, g in plain.groupby("utilisation"):
        assert g.drop(columns="acceptance").nunique(dropna=False).max() == 1


def test_a_map_winner_agrees_with_long_runs(map_spec: PlanSpec, cells: pd.DataFrame) -> None:
    """The busiest cell's winner, checked as a planner would: its rack meets the SLO in a run 3x
    as long (another seed), one replica fewer misses it, and no other strategy's passing rack costs less."""
    win = winners(cells).set_index(["utilisation", "acceptance"])
    w = win.loc[(0.8, 0.8)]
    assert w.winner != "none"
    s = next(x for x in map_spec.strategies if x.name == w.winner)
    rate = float(w.rate_rps)

    def long_run(replicas: int) -> dict:
        """3x the run the plan judges this rack on (warm-up and window), on another seed."""
        sc = _cell_scenario(short_base(), s, rate, 0.8, replicas)
        judged = judged_run(sc, 1, None, _rack_capacity(sc))
        if isinstance(judged, str):
            return {"slo_met": False}
        wl = judged[0].workload
        return simulate(sc.with_overrides({"workload.warmup_s": 3 * wl.warmup_s, "workload.duration_s": 3 * wl.duration_s}),
                        2).summary

    assert long_run(int(w.replicas))["slo_met"]
    assert w.replicas > 1
    assert not long_run(int(w.replicas) - 1)["slo_met"]
    others = cells[(cells.utilisation == 0.8) & (cells.acceptance == 0.8) & cells.feasible]
    assert (others.total_usd_per_month >= w.total_usd_per_month).all()


def test_headroom_agrees_with_long_runs(spec: PlanSpec, answer: pd.DataFrame) -> None:
    """Headroom (the highest rate the chosen rack serves within the SLO) checked by runs 3x as
    long on another seed: 10% under it the rack passes, 15% over the first failing rate it fails."""
    r = answer[answer.strategy == "baseline"].iloc[0]
    assert r.rate_rps < r.headroom_rps < r.headroom_fail_rps <= r.headroom_rps * 1.04
    long = short_base().with_overrides({"workload.duration_s": 180.0, "workload.warmup_s": 20.0})
    s = spec.strategies[0]
    under = scenario_for(long, s, GPU, {GPU: 2.5}, int(r.replicas), 0.9 * r.headroom_rps, 1.0)
    over = scenario_for(long, s, GPU, {GPU: 2.5}, int(r.replicas), 1.15 * r.headroom_fail_rps, 1.0)
    assert simulate(under, 2).summary["slo_met"]
    assert not simulate(over, 2).summary["slo_met"]


# ----------------------------------------------------------------------------- retraining


def test_retraining_is_zero_without_teacher_updates_and_linear_in_cadence(spec: PlanSpec, answer: pd.DataFrame) -> None:
    rt = retraining_table(spec, answer)
    assert set(rt.cadence) == set(CADENCES)
    assert len(rt) == len(answer) * len(CADENCES)
    d = rt[rt.strategy == "distilled-8b"].set_index("cadence").retraining_usd_per_month
    assert d["never"] == 0.0
    assert d["monthly"] > 0
    assert d["weekly"] / d["monthly"] == pytest.approx(52.0 / 12.0, rel=1e-12)
    assert d["quarterly"] / d["monthly"] == pytest.approx(1.0 / 3.0, rel=1e-12)
    # the planned row (1 update a month) carries the same retraining cost as the table's monthly row
    planned = answer.set_index("strategy").loc["distilled-8b", "retraining_usd_per_month"]
    assert planned == pytest.approx(d["monthly"])
    for s in ("baseline", "draft-1b"):
        assert (rt[rt.strategy == s].retraining_usd_per_month == 0.0).all(), s
    for _, r in rt.iterrows():
        assert r.total_usd_per_month == pytest.approx(r.serving_usd_per_month + r.retraining_usd_per_month)


def test_retraining_in_a_distilled_scenarios_summary(spec: PlanSpec) -> None:
    s = builtin_strategies()["distilled-8b"]
    cost = {}
    for tu in (0.0, 1.0, 52.0 / 12.0):
        sc = scenario_for(spec.base, s, GPU, spec.prices, 1, 3.0, teacher_updates=tu)
        cost[tu] = simulate(sc, 1).summary["retraining_usd_per_month"]
    assert cost[0.0] == 0.0
    assert cost[1.0] > 0
    assert cost[52.0 / 12.0] / cost[1.0] == pytest.approx(52.0 / 12.0, rel=1e-12)
    row = plan_row(spec, s, GPU, 3.0, teacher_updates=0.0)
    assert row["retraining_usd_per_month"] == 0.0
    assert row["total_usd_per_month"] == row["serving_usd_per_month"]
    # a non-distilled strategy ignores the teacher cadence
    b = builtin_strategies()["baseline"]
    sc = scenario_for(spec.base, b, GPU, spec.prices, 1, 3.0, teacher_updates=52.0 / 12.0)
    assert simulate(sc, 1).summary["retraining_usd_per_month"] == 0.0


# ----------------------------------------------------------------------------- acceptance shift


def test_acceptance_shift_loses_speedup_on_tail_traffic(map_spec: PlanSpec) -> None:
    shift = acceptance_shift(map_spec, jobs=2)
    assert len(shift) == 2 * 3
    sp = shift.set_index(["strategy", "tail_share"]).speedup
    assert sp[("baseline", 0.0)] == 1.0 and sp[("baseline", 0.5)] == 1.0
    for s in ("draft-1b", "eagle"):
        assert sp[(s, 0.0)] >= sp[(s, 0.5)], (s, sp[(s, 0.0)], sp[(s, 0.5)])
        assert sp[(s, 0.0)] > 1.0  # speculation pays on benchmark-like traffic at half load
    acc = shift.set_index(["strategy", "tail_share"]).acceptance_rate
    for s in ("draft-1b", "eagle"):
        assert acc[(s, 0.0)] > acc[(s, 0.5)]


# ----------------------------------------------------------------------------- bad plan files


def _bad(tmp: Path, text: str) -> Path:
    p = tmp / "bad.toml"
    p.write_text(text)
    return p




def _replace(old: str, new: str) -> Callable[[], str]:
    def make() -> str:
        t = plan_text(strategies=("baseline",))
        assert old in t
        return t.replace(old, new)

    return make


BAD_PLANS: dict[str, tuple[Callable[[], str], tuple[str, ...]]] = {
    "zero-slo": (_replace("ttft_p99_s = 2.0", "ttft_p99_s = 0"), ("slo.ttft_p99_s", "positive")),
    "unknown-strategy": (lambda: plan_text(strategies=("baseline", "draft-2b")),
                         ("unknown strategy 'draft-2b'", "did you mean 'draft-1b'")),
    "unreachable-traffic": (lambda: plan_text(strategies=("baseline",), rate=5000, max_gpus=8),
                            ("5000", "max_gpus", "rate_rps")),
    "missing-base": (_replace(f'base = "{BASE}"\n', ""), ("missing 'base'",)),
    "unknown-field": (_replace('name = "tiny"\n', 'name = "tiny"\ncolour = "red"\n'), ("unknown key", "colour")),
    "floor-above-one": (_replace("floor_tail = 0.9", "floor_tail = 1.5"), ("quality.floor_tail", "[0, 1]")),
    "base-not-found": (_replace(f'base = "{BASE}"', 'base = "no-such-scenario.toml"'), ("not found",)),
    "unknown-gpu": (_replace(f'gpus = ["{GPU}"]', 'gpus = ["h100-sx"]'), ("unknown gpu 'h100-sx'", "h100-sxm")),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_files_give_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    make, words = BAD_PLANS[case]
    p = _bad(tmp_path, make())
    with pytest.raises(ConfigError) as err:
        load_plan(p)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)
    capsys.readouterr()
    assert main(["plan", str(p), "--out", str(tmp_path / "out"), "--quick", "--jobs", "1"]) == 2
    cap = capsys.readouterr()
    assert one_line_error(cap.err) == f"specrack: error: {msg}"
    assert not (tmp_path / "out" / "plan.csv").exists()


def test_a_bad_plan_through_the_entry_point(tmp_path: Path) -> None:
    p = _bad(tmp_path, BAD_PLANS["zero-slo"][0]())
    exe = Path(sys.executable).parent / "specrack"
    if not exe.is_file():  # pragma: no cover - installed with `pip install -e .`
        pytest.skip("the specrack entry point is not installed")
    r = subprocess.run([str(exe), "plan", str(p), "--out", str(tmp_path / "out"), "--quick"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert "slo.ttft_p99_s" in one_line_error(r.stderr)


BUG_NON_NUMERIC = ("load_plan converts search.max_gpus / search.duration_s / quality.floor_tail with bare "
                   "int()/float(), so a non-numeric value raises ValueError (a traceback from the CLI) instead of a ConfigError")


@pytest.mark.parametrize(("old", "new"), [
    pytest.param("floor_tail = 0.9", 'floor_tail = "high"', id="floor-tail-text"),
    pytest.param("max_gpus = 32", 'max_gpus = "many"', id="max-gpus-text"),
    pytest.param("duration_s = 60", 'duration_s = "long"', id="duration-text"),
])
def test_non_numeric_fields_give_config_errors(tmp_path: Path, old: str, new: str) -> None:
    with pytest.raises(ConfigError):
        load_plan(_bad(tmp_path, _replace(old, new)()))


def test_empty_seeds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="seeds"):
        load_plan(_bad(tmp_path, _replace("seeds = [1]", "seeds = []")()))


def test_strategies_must_be_a_list(tmp_path: Path) -> None:
    text = plan_text(strategies=("baseline",)).replace('strategies = ["baseline"]', 'strategies = "baseline"')
    with pytest.raises(ConfigError, match="strategies") as err:
        load_plan(_bad(tmp_path, text))
    assert "'b'" not in str(err.value)


def test_analyses_values_are_validated_up_front(tmp_path: Path) -> None:
    text = plan_text(strategies=("baseline",)).replace("map_acceptance = [0.5, 0.8]", "map_acceptance = [2.0]")
    with pytest.raises(ConfigError, match="map_acceptance"):
        load_plan(_bad(tmp_path, text))


# ----------------------------------------------------------------------------- the command


def test_plan_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    quick = textwrap.dedent("""
        [quick]
        search = { duration_s = 150, warmup_s = 20 }
        analyses = { curve_multipliers = [1.0, 2.0], map_utilisation = [0.5], map_acceptance = [0.6], shift_tail_shares = [0.0, 0.5] }
        """)
    p = write_plan(tmp_path, rate=6.0, strategies=("baseline", "draft-1b"), max_gpus=16, extra=quick)
    out = tmp_path / "out"
    assert main(["plan", str(p), "--out", str(out), "--quick", "--jobs", "1"]) == 0
    cap = capsys.readouterr()
    for f in ("plan.csv", "configs.csv", "report.html", "curves.csv", "map.csv", "map_cells.csv", "shift.csv", "retraining.csv"):
        assert (out / f).is_file(), f
    plan = pd.read_csv(out / "plan.csv")
    assert list(plan.strategy) in (["baseline", "draft-1b"], ["draft-1b", "baseline"])
    assert plan.feasible.all() and (plan.gpus == 4).all()  # 6 req/s fits one TP4 replica
    assert plan.total_usd_per_month.is_monotonic_increasing
    # the ranked table on stdout, in the csv's order
    lines = cap.out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["rank", "strategy", "gpu"])
    ranked = [ln.split() for ln in lines[header + 1:header + 1 + len(plan)]]
    assert [r[1] for r in ranked] == list(plan.strategy)
    assert [r[0] for r in ranked] == ["1", "2"]
    assert all(r[2] == GPU and r[3] == "4" and r[8] == "4" for r in ranked)  # TP4, 4 GPUs
    assert "report.html" in lines[-1]
    assert "tiny" in cap.err and "Traceback" not in cap.err
    # each SLO target's value on the terminal, the binding check named; every check by name in the csv
    assert lines[header].split()[3:9] == ["TP", "MBT", "seqs", "k", "reps", "GPUs"]
    assert lines[header].split()[9:13] == ["TTFT", "p99", "TPOT", "p99"] and "binding" in lines[header]
    assert all(ln.split()[-4] in ("ttft_p99_s", "tpot_p99_s") for ln in lines[header + 1:header + 1 + len(plan)])
    for key in ("ttft_p99_s", "tpot_p99_s"):
        assert {f"slo_{key}_value", f"slo_{key}_target", f"slo_{key}_met"} <= set(plan.columns)
    assert {"simulated_rate_rps", "judged_requests", "itl_samples", "verdict", "binding_slo"} <= set(plan.columns)
    assert (plan.engine_profile == "vllm-v1").all()  # every row names the engine profile it was planned on
    # the effective inputs echoed on stderr, and a loud warning: 6 req/s x 35 s measured is ~210 requests
    for word in ("model: llama-3.1-70b, TP4", "SLO: p99 TTFT <= 2 s, p99 TPOT <= 200 ms", "tail-quality floor: 0.9",
                 "prices: h100-sxm $2.5/h", "traffic: 6.00 req/s", "simulated: 150 s per run"):
        assert word in cap.err, word
    assert "measured requests per run" in cap.err  # the effective inputs, echoed
    # the report is self-contained: plotly inline, nothing fetched
    html = (out / "report.html").read_text()
    assert not re.search(r"<script[^>]*\ssrc=", html, re.IGNORECASE), "report loads a script file"
    assert not re.search(r"<link[^>]+href=[\"']?https?:", html, re.IGNORECASE), "report loads a stylesheet"
    assert "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js itself is inlined
    assert 'id="inputs"' in html and "p99 TPOT &lt;= 200 ms" in html
    # decision-grade: what was planned named up front, human headers with units, no raw column names
    # and no 3-decimal dollars in the ranked table, the headroom and the binding constraint
    for word in ("<th>model</th><td>llama-3.1-70b</td>", "<th>engine profile</th><td>vllm-v1</td>",
                 "<th>tensor parallel (base)</th><td>TP4</td>", "<th>base rack</th><td>8x h100-sxm</td>",
                 "<th>trace window</th>", "TTFT p50 / p99", "headroom: max req/s at the SLO", "binding constraint",
                 "cost ($/month)", "$/Mtok at the SLO", 'id="verdict"', "Recommended:"):
        assert word in html, word
    ranked = html[html.index("table class='plan ranked'"):]
    ranked = ranked[:ranked.index("</table>")]
    assert "slo_" not in ranked and "usd_per" not in ranked and "_s<" not in ranked
    assert not re.search(r"\$[\d,]+\.\d{3}", ranked) and re.search(r"\$[\d,]+ \(rent\)|\$[\d,]+</b> \(rent\)", ranked)
    plan_hr = pd.read_csv(out / "plan.csv")
    assert (plan_hr.headroom_rps > plan_hr.rate_rps).all()
    for f in ("sensitivity.csv",):
        assert (out / f).is_file(), f
    sens = pd.read_csv(out / "sensitivity.csv")
    assert set(sens.factor) == {"acceptance", "traffic growth", "GPU price"} and set(sens.strategy) == set(plan_hr.strategy)
    assert not math.isnan(pd.read_csv(out / "shift.csv").speedup.iloc[0])
