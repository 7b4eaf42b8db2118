"""The planner's configuration search and total cost of ownership (`experiments/plan.py`,
`experiments/plan_cost.py`): the search finds a cheaper configuration when there is one, its
analytical pruning never drops the configuration an exhaustive search picks, the rack rules
(n+1, min_replicas, max_utilisation, whole nodes) are honoured, buy-mode costs match a hand
calculation, and bad [search]/[cost] keys give one-line errors.

Small plans only: Llama-3.1-70B at 6 req/s, 60 s runs after 10 s of warm-up, one seed."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
from test_plan import GPU, plan_text

from experiments.plan import load_plan, run_search
from experiments.plan_cost import CostSpec, monthly_cost
from experiments.plan_racks import scenario_for
from experiments.plan_search import evaluate, pareto, plan_row
from experiments.plan_spec import PlanSpec
from experiments.planfile import SearchSpec, builtin_strategies
from models.catalog import get_gpu
from models.errors import ConfigError

RATE = 6.0  # 70B: one TP4 H100 replica passes here (judged on a long enough run)
# on H200 (capacity per replica ~4.6 req/s at TP2, ~8.1 at TP4) 8.5 req/s needs 3 x TP2 = 6 GPUs (2 x TP2 run at
# 0.93x capacity miss p99 TPOT) or 2 x TP4 = 8 (one TP4 replica is offered more than its capacity)
H200_RATE = 8.5
TWO = 9.0  # above one TP4 H100 replica's capacity (~7.9 req/s): two replicas needed


def h200_text(search: str) -> str:
    return (plan_text(rate=H200_RATE, strategies=("baseline",), search=search)
            .replace(f'gpus = ["{GPU}"]', 'gpus = ["h200"]').replace(f"{{ {GPU} = 2.5 }}", "{ h200 = 3.5 }"))


@pytest.fixture(scope="module")
def h200(tmp_path_factory: pytest.TempPathFactory) -> PlanSpec:
    p = tmp_path_factory.mktemp("search") / "h200.toml"
    p.write_text(h200_text("tp = [2, 4, 8]\nmax_num_batched_tokens = [2048]"))
    return load_plan(p)


@pytest.fixture(scope="module")
def searched(h200: PlanSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    return run_search(h200, jobs=2)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> PlanSpec:
    """One configuration (TP4, the base's), for the rack rules."""
    p = tmp_path_factory.mktemp("rules") / "single.toml"
    p.write_text(plan_text(rate=RATE, strategies=("baseline",)))
    return load_plan(p)


def test_the_search_finds_the_cheaper_tp(searched: tuple[pd.DataFrame, pd.DataFrame]) -> None:
    answer, configs = searched
    row = answer.iloc[0]
    assert bool(row.feasible) and int(row.tp) == 2  # 3 x TP2 = 6 H200s beats 2 x TP4 = 8
    tp4 = configs[configs.tp == 4].iloc[0]
    # TP4's lower bound (offered load over one replica's capacity): with vLLM 0.11's fixed costs one
    # TP4 replica may carry the load, but its rack (if it passes) still costs more than the TP2 answer
    assert tp4.lower_bound_replicas >= 1 and tp4.status in ("passes", "pruned")
    assert row.total_usd_per_month < (tp4.total_usd_per_month if tp4.status == "passes" else tp4.lower_bound_usd_per_month)
    assert row.total_usd_per_month == pytest.approx(row.gpus * 3.5 * 720)
    # the TP8 rack's cheapest possible cost (one replica, 8 GPUs) is above the TP2 answer: pruned
    tp8 = configs[configs.tp == 8].iloc[0]
    assert tp8.status == "pruned" and tp8.lower_bound_usd_per_month > row.total_usd_per_month
    assert {"tp", "max_num_batched_tokens", "max_num_seqs", "k", "cost_mode", "serving_usd_per_month",
            "power_usd_per_month", "retraining_usd_per_month", "total_usd_per_month", "usd_per_mtok_at_slo"} <= set(answer)
    assert {"capacity_rps", "total_usd_per_month", "pareto", "status"} <= set(configs)


def test_pruning_keeps_the_exhaustive_answer(h200: PlanSpec, searched: tuple[pd.DataFrame, pd.DataFrame]) -> None:
    pruned, pc = searched
    full, fc = run_search(h200, jobs=2, prune=False)
    keys = ["tp", "max_num_batched_tokens", "max_num_seqs", "replicas", "total_usd_per_month"]
    assert pruned[keys].iloc[0].tolist() == full[keys].iloc[0].tolist()
    assert (pc.status == "pruned").sum() >= 1 and (fc.status == "pruned").sum() == 0
    # every configuration the pruned search skipped costs at least the answer when simulated
    for _, c in pc[pc.status == "pruned"].iterrows():
        hit = fc[fc.tp == c.tp].iloc[0]
        assert hit.status != "passes" or hit.total_usd_per_month >= pruned.total_usd_per_month.iloc[0]


def test_an_upper_bound_prunes_before_the_capacity_is_measured(h200: PlanSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a configuration's throughput collapses at full load, its closed-loop peak (an upper
    bound on its capacity) prunes first: a configuration the bound prunes is never measured
    further; one it does not prune gets its capacity measured and is pruned or simulated on that.
    Here TP8's ladder is made to report a collapse with the real capacity as its peak: pruned on
    the bound alone (one replica, 8 GPUs, costs more than 3 x TP2), and the answer is unchanged."""
    import experiments.plan_search as plan_mod
    from sim.capacity import Capacity

    real_ladder, real_cap = plan_mod.ladder_of, plan_mod.capacity_of
    measured: list[int] = []

    def ladder_of(one, points, speculative=False):  # type: ignore[no-untyped-def]
        lad = real_ladder(one, points, speculative=speculative)
        if one.deployment.tensor_parallel == 8:  # a collapse: the peak bounds the capacity from above
            return Capacity(rps=lad.rps, tok_s=lad.tok_s, full_batch_rps=0.5 * lad.rps, full_batch_tok_s=0.5 * lad.tok_s,
                            peak_rps=lad.rps, peak_concurrency=64, collapse=True, curve=lad.curve)
        return lad

    def capacity_of(one, points, speculative=False):  # type: ignore[no-untyped-def]
        measured.append(one.deployment.tensor_parallel)
        return real_cap(one, points, speculative=speculative)

    monkeypatch.setattr(plan_mod, "ladder_of", ladder_of)
    monkeypatch.setattr(plan_mod, "capacity_of", capacity_of)
    found = plan_mod.search_row(h200, h200.strategies[0], "h200", H200_RATE)
    configs = pd.DataFrame(found["configs"])
    tp8 = configs[configs.tp == 8].iloc[0]
    assert tp8.status == "pruned" and "upper bound" in tp8.reason and tp8.capacity_bound_rps > 0
    assert 8 not in measured
    row = found["row"]
    assert bool(row["feasible"]) and int(row["tp"]) == 2 and int(row["gpus"]) == 6


def test_each_configuration_is_checked_on_its_own_lower_bound(h200: PlanSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 10 req/s on H200 TP2 needs at least 3 replicas (6 GPUs) and TP4 at least 2 (8 GPUs).
    Searched as tp = [4, 2] within 8 GPUs, exhaustively, both are simulated: TP4 is not pruned
    on TP2's bound (3 x 4 GPUs > 8), which the search once read for every configuration after
    the grid's last. (The simulations are stubbed: only the pruning is under test.)"""
    import experiments.plan_search as plan_mod

    spec = dataclasses.replace(h200, search=dataclasses.replace(h200.search, tp=(4, 2)), max_gpus=8)
    simulated: list[int] = []

    def plan_row(spec, s, gpu, rate, cap_rps=None, explain=False):  # type: ignore[no-untyped-def]
        simulated.append(int(s.overrides["deployment.tensor_parallel"]))
        return {"feasible": False, "reason": "not simulated here", "evaluations": 0}

    monkeypatch.setattr(plan_mod, "plan_row", plan_row)
    configs = pd.DataFrame(plan_mod.search_row(spec, spec.strategies[0], "h200", 10.0, prune=False)["configs"])
    by_tp = configs.set_index("tp")
    assert by_tp.loc[2, "lower_bound_replicas"] == 3 and by_tp.loc[4, "lower_bound_replicas"] == 2
    assert sorted(simulated) == [2, 4] and set(configs.status) == {"fails"}


def test_pareto_frontier() -> None:
    df = pd.DataFrame({"status": ["passes", "passes", "passes", "fails"], "total_usd_per_month": [10.0, 20.0, 20.0, 1.0],
                       "capacity_rps": [5.0, 4.0, 9.0, 100.0]})
    assert pareto(df).tolist() == [True, False, True, False]


def _rules(spec: PlanSpec, **kw: object) -> PlanSpec:
    return dataclasses.replace(spec, search=dataclasses.replace(spec.search, **kw))


def test_n_plus_1_adds_one_replica_and_one_fewer_still_passes(single: PlanSpec) -> None:
    s = builtin_strategies()["baseline"]
    plain = plan_row(single, s, GPU, TWO)
    row = plan_row(_rules(single, redundancy="n+1"), s, GPU, TWO)
    assert plain["replicas"] == 2
    assert row["replicas"] == plain["replicas"] + 1 and row["minimal_replicas"] == plain["replicas"]
    down = scenario_for(single.base, s, GPU, single.prices, row["replicas"] - 1, TWO, traffic=single.traffic)
    assert evaluate(down, single.seeds)["meets_slo"]
    assert row["total_usd_per_month"] == pytest.approx(3 * 4 * 2.5 * 720)


def test_min_replicas_and_max_utilisation_are_honoured(single: PlanSpec) -> None:
    s = builtin_strategies()["baseline"]
    assert plan_row(_rules(single, min_replicas=3), s, GPU, RATE)["replicas"] == 3
    row = plan_row(_rules(single, max_utilisation=0.3), s, GPU, RATE)
    cap = row["capacity_per_replica_rps"]
    assert row["replicas"] == math.ceil(RATE / (0.3 * cap))
    assert RATE / row["capacity_rps"] <= 0.3 and RATE / ((row["replicas"] - 1) * cap) > 0.3


def test_gpus_per_node_rounds_up_and_refuses_straddling(single: PlanSpec) -> None:
    s = builtin_strategies()["baseline"]
    row = plan_row(_rules(single, gpus_per_node=6), s, GPU, TWO)  # one TP4 replica per 6-GPU node
    assert row["replicas"] == 2 and row["nodes"] == 2 and row["billed_gpus"] == 12
    assert row["serving_usd_per_month"] == pytest.approx(12 * 2.5 * 720)
    bad = plan_row(_rules(single, gpus_per_node=2), s, GPU, RATE)
    assert not bad["feasible"] and "straddles" in bad["reason"]


def test_buy_mode_cost_by_hand(tmp_path: Path) -> None:
    cost = '[cost]\nmode = "buy"\ncapex_usd_per_gpu = 30000\ncapex_usd_per_node = 48000\nhosting_usd_per_node_month = 1500\n'
    p = tmp_path / "buy.toml"
    p.write_text(plan_text(rate=TWO, strategies=("baseline",), search="configurations = false\ngpus_per_node = 8") + cost)
    spec = load_plan(p)
    assert spec.cost.mode == "buy" and spec.cost.amortisation_years == 4.0 and spec.cost.pue == 1.3
    row = plan_row(spec, builtin_strategies()["baseline"], GPU, TWO)
    assert row["replicas"] == 2 and row["nodes"] == 1 and row["billed_gpus"] == 8 and row["cost_mode"] == "buy"
    months = 12 * 4.0
    assert row["serving_usd_per_month"] == pytest.approx(8 * 30000 / months + 48000 / months + 1500)
    busy = min(row["gpu_busy_fraction"], 1.0)  # steps straddling the window edge can push it a hair over 1
    kwh = 700 * 8 * (0.3 + 0.7 * busy) * 1.3 * 720 / 1000
    assert row["power_usd_per_month"] == pytest.approx(kwh * 0.10)
    assert row["total_usd_per_month"] == pytest.approx(row["serving_usd_per_month"] + row["power_usd_per_month"])
    mtok = row["throughput_tok_s"] * 720 * 3600 / 1e6
    assert row["usd_per_mtok_at_slo"] == pytest.approx(row["total_usd_per_month"] / mtok)


def test_idle_node_gpus_draw_idle_power() -> None:
    c = CostSpec("buy", {"h100-sxm": 1.0}, idle_power_fraction=0.25)
    out = monthly_cost(c, "h100-sxm", 0.0, 1, 4, 8, 1.0)  # 4 busy GPUs + 4 idle in one node
    tdp = get_gpu("h100-sxm").tdp_w
    assert out["power_usd_per_month"] == pytest.approx(tdp * (4 * 1.0 + 4 * 0.25) * 1.3 * 720 / 1000 * 0.10)


HOSTILE = {
    "search-typo": ("tpp = [2]", "did you mean 'tp'"),
    "redundancy": ('redundancy = "n+2"', "search.redundancy"),
    "utilisation": ("max_utilisation = 1.5", "search.max_utilisation"),
    "min-replicas": ("min_replicas = 0", "search.min_replicas"),
    "grid-not-list": ("max_num_batched_tokens = 2048", "search.max_num_batched_tokens"),
    "node": ("gpus_per_node = 2.5", "search.gpus_per_node"),
    "cost-mode": ('configurations = false\n[cost]\nmode = "lease"', "cost.mode"),
    "cost-typo": ('configurations = false\n[cost]\nmode = "buy"\ncapx_usd_per_gpu = 1', "did you mean 'capex_usd_per_gpu'"),
    "buy-key-in-rent": ("configurations = false\n[cost]\npue = 1.2", "only used with cost.mode = 'buy'"),
    "buy-no-capex": ('configurations = false\n[cost]\nmode = "buy"', "cost.capex_usd_per_gpu: missing"),
    "node-cost-no-node": ('configurations = false\n[cost]\nmode = "buy"\ncapex_usd_per_gpu = 1\nhosting_usd_per_node_month = 5',
                          "search.gpus_per_node"),
    "pue": ('configurations = false\n[cost]\nmode = "buy"\ncapex_usd_per_gpu = 1\npue = 0.5', "cost.pue"),
    "grid-without-search": ("configurations = false\ntp = [4]", "search.tp"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_search_and_cost_keys(tmp_path: Path, case: str) -> None:
    text, expect = HOSTILE[case]
    p = tmp_path / "bad.toml"
    p.write_text(plan_text(rate=RATE, strategies=("baseline",), search=text))
    with pytest.raises(ConfigError) as err:
        load_plan(p)
    msg = str(err.value)
    assert expect in msg and "\n" not in msg, msg


def test_search_inputs_are_shown(single: PlanSpec, h200: PlanSpec) -> None:
    got = h200.inputs()
    assert "TP [2, 4, 8]" in got["configuration search"] and "pruned by capacity" in got["configuration search"]
    assert got["rack rules"].startswith("min_replicas 1, redundancy none")
    assert got["cost"].startswith("rent")
    assert single.inputs()["configuration search"].startswith("off")
    assert isinstance(SearchSpec().describe(), str)


def test_the_grid_applies_k_and_skips_what_does_not_fit(h200: PlanSpec) -> None:
    """No simulation: the grid's k reaches the speculative table, TP1 70B does not fit an H100."""
    from experiments.plan_racks import configured
    from experiments.plan_search import grid, one_replica, search_row

    spec = dataclasses.replace(h200, search=dataclasses.replace(h200.search, tp=(4,), k=(2, 3)))
    s = builtin_strategies()["draft-1b"]
    cfgs = grid(spec, s, "h200", RATE)
    assert sorted(c["k"] for c in cfgs) == [2, 3] and all(c["tp"] == 4 for c in cfgs)
    sc = one_replica(spec, configured(s, spec.base, {"k": 3, "max_num_batched_tokens": 4096}), "h200", RATE)
    assert sc.speculative is not None and sc.speculative.num_speculative_tokens == 3
    assert sc.deployment.max_num_batched_tokens == 4096 and sc.speculative.draft_model == "llama-3.2-1b"
    assert all(c["k"] is None for c in grid(spec, builtin_strategies()["baseline"], "h200", RATE))  # no speculation, no k
    tiny = dataclasses.replace(h200, gpus=(GPU,), search=dataclasses.replace(h200.search, tp=(1,)))
    out = search_row(tiny, builtin_strategies()["baseline"], GPU, RATE)
    assert [c["status"] for c in out["configs"]] == ["not applicable"]
    assert not out["row"]["feasible"] and out["row"]["reason"].startswith("not applicable")


def test_a_strategy_no_configuration_can_run_is_not_applicable(h200: PlanSpec) -> None:
    from experiments.plan_search import search_row

    spec = dataclasses.replace(h200, search=dataclasses.replace(h200.search, tp=(4, 8)))
    out = search_row(spec, builtin_strategies()["fp8"], "a100-80gb", RATE)  # no FP8 tensor cores at any TP
    assert [c["status"] for c in out["configs"]] == ["not applicable"] * 2
    assert not out["row"]["feasible"] and "FP8" in out["row"]["reason"] and out["row"]["evaluations"] == 0
