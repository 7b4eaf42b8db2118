"""The bundled buy-mode plan (experiments/plans/assistant-8b-buy.toml, written from scratch as a
buyer would: Llama-3.1-8B on L40S or A100-80GB, bought in 8-GPU nodes, N+1) reads as it says and
prices a rack as a hand calculation does. Quick: capacities are stubbed (no simulation); the
simulated answer and its long-run check are in the closing note of the issue that added it."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import plan_store
from experiments.plan import load_plan
from experiments.plan_cost import monthly_cost
from experiments.plan_search import replica_bounds
from models.catalog import get_gpu
from sim.capacity import Capacity

PLAN = Path(__file__).resolve().parents[1] / "experiments" / "plans" / "assistant-8b-buy.toml"


@pytest.fixture()
def stub_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_store.STORE, "capacity", lambda sc, speculative=False: Capacity(rps=5.0, tok_s=1000.0))


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_the_bundled_buy_plan_reads_as_written(stub_capacity: None, quick: bool) -> None:
    spec = load_plan(PLAN, quick=quick)
    b = spec.base
    assert (b.deployment.model, b.deployment.tensor_parallel, b.rack.gpu) == ("llama-3.1-8b", 1, "l40s")
    assert spec.gpus == ("l40s", "a100-80gb") and spec.rate_rps == 40.0
    assert spec.cost.mode == "buy" and spec.cost.capex_usd_per_gpu == {"l40s": 8500.0, "a100-80gb": 14000.0}
    assert (spec.search.redundancy, spec.search.min_replicas, spec.search.gpus_per_node) == ("n+1", 2, 8)
    assert spec.search.configurations is not quick
    assert [s.name for s in spec.strategies] == ["baseline", "draft-1b", "eagle", "fp8", "ngram"]
    assert ("fp8", "a100-80gb") in spec.not_applicable and "FP8 tensor cores" in spec.not_applicable[("fp8", "a100-80gb")]
    assert spec.expected_requests >= 500  # enough requests behind each p99
    inputs = spec.inputs()
    assert "n+1" in inputs["rack rules"] and "whole nodes of 8 GPUs" in inputs["rack rules"]
    assert inputs["cost"].startswith("buy: capex per GPU l40s $8,500, a100-80gb $14,000, per node $30,000")


def test_a_bundled_plan_rack_priced_by_hand(stub_capacity: None) -> None:
    """10 L40S replicas (9 to carry 40 req/s at 5 req/s each: 8 would be offered exactly their
    capacity; + 1 for n+1) fill two 8-GPU nodes."""
    spec = load_plan(PLAN)
    floor, bound = replica_bounds(spec, 5.0, spec.rate_rps)
    assert (floor, bound) == (2, 9)  # more than 40 / 5 = 8; min_replicas 2
    c = monthly_cost(spec.cost, "l40s", 0.0, bound + 1, 1, 8, busy_fraction=0.5)
    months = 12 * 4
    serving = 16 * 8500 / months + 2 * (30000 / months + 1500)
    draw = 10 * (0.3 + 0.7 * 0.5) + 6 * 0.3  # busy GPUs and the idle ones the two nodes hold, in TDPs
    power = get_gpu("l40s").tdp_w * draw * 1.35 * 720 / 1000 * 0.12
    assert (c["nodes"], c["billed_gpus"]) == (2, 16)
    assert c["serving_usd_per_month"] == pytest.approx(serving) and c["power_usd_per_month"] == pytest.approx(power)
