"""Racks as the user sizes them (issue 38): a dedicated draft (its own GPUs beside each replica's
tensor-parallel group) runs on any whole number of (TP + draft GPUs) replicas. Its speculation-off
reference (what `utilisation` and capacity are relative to) is the same replicas without the draft
GPUs, in `specrack run`, `specrack capacity` and the planner's racks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import capacity, one_line_error

from experiments.cli import main
from experiments.plan_racks import on_base_rack, scenario_for
from experiments.planfile import Strategy
from sim.capacity import baseline_of
from sim.deployment import build_runtime
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
DRAFT = ROOT / "experiments" / "scenarios" / "llama70b-draft1b.toml"  # TP4 + a 1B draft
DEDICATED = ["--set", "speculative.placement=dedicated"]
DEDICATED_SPEC = {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4,
                  "placement": "dedicated", "draft_gpus": 1}


def test_run_on_two_replicas_of_four_plus_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """10 GPUs = 2 x (TP4 + 1 draft GPU) was refused ('use 8 or 12') by the speculation-off
    reference re-validated at 4 GPUs per replica. It runs, offered 0.5 x the reference of the same
    two replicas, whose capacities (off and on) are twice one replica's."""
    out = tmp_path / "run"
    assert main(["run", str(DRAFT), "--out", str(out), *DEDICATED, "--set", "rack.num_gpus=10",
                 "--set", "workload.duration_s=60", "--set", "workload.warmup_s=10"]) == 0
    capsys.readouterr()
    s = json.loads((out / "summary.json").read_text())
    assert s["num_replicas"] == 2
    one_off = capacity(baseline_of(load_scenario(DRAFT, {"rack.num_gpus": 4})))  # one TP4 replica, speculation off
    one_on = capacity(load_scenario(DRAFT, {"rack.num_gpus": 5, "speculative.placement": "dedicated"}), speculative=True)
    assert s["capacity_rps"] == pytest.approx(2 * one_off.rps, rel=1e-12)
    assert s["speculative_capacity_rps"] == pytest.approx(2 * one_on.rps, rel=1e-12)
    assert s["offered_rate_rps"] == pytest.approx(0.5 * s["capacity_rps"], rel=1e-12)


def test_eight_gpus_name_the_whole_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    """8 GPUs hold one 5-GPU replica and 3 idle GPUs: refused, naming what a replica holds."""
    assert main(["capacity", str(DRAFT), *DEDICATED, "--set", "rack.num_gpus=8"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "rack.num_gpus=8 is not a multiple of the 5 GPUs per replica (tensor_parallel=4 + 1 dedicated draft GPU(s))" in line
    assert "use num_gpus = 5 or 10" in line and "allow_idle_gpus" in line


@pytest.mark.parametrize(("gpus", "draft_gpus", "idle", "replicas"),
                         [(5, 1, False, 1), (15, 1, False, 3), (20, 1, False, 4), (12, 1, True, 2), (12, 2, False, 2)])
def test_reference_has_the_same_replicas(gpus: int, draft_gpus: int, idle: bool, replicas: int) -> None:
    """20 GPUs are 4 replicas of 4 + 1, and 5 of TP4 alone: the reference keeps the 4 (the draft
    GPUs left out), so no rack multiple of (TP + draft GPUs) is refused, and none changes its count."""
    sc = load_scenario(DRAFT, {"rack.num_gpus": gpus, "rack.allow_idle_gpus": idle, "speculative.placement": "dedicated",
                               "speculative.draft_gpus": draft_gpus})
    base = baseline_of(sc)
    assert base.speculative is None and base.rack.num_gpus == replicas * 4
    assert build_runtime(sc).num_replicas == build_runtime(base).num_replicas == replicas


def test_planner_racks_follow_the_same_rule() -> None:
    """The planner sizes a dedicated-draft strategy in whole (TP + draft GPUs) replicas, and its
    studies on the base rack (8 GPUs, two TP4 replicas) give each of the two its draft GPU."""
    base = load_scenario(ROOT / "experiments" / "scenarios" / "default-mix.toml")
    s = Strategy("draft-1b-dedicated", {"speculative": DEDICATED_SPEC})
    for replicas in (1, 2, 3):
        sc = scenario_for(base, s, "h100-sxm", {}, replicas, 12.0)
        assert sc.rack.num_gpus == 5 * replicas
        assert build_runtime(sc).num_replicas == build_runtime(baseline_of(sc)).num_replicas == replicas
    on_base = on_base_rack(base, s)
    assert base.rack.num_gpus == 8 and on_base.rack.num_gpus == 10 and baseline_of(on_base).rack == base.rack
    plain = Strategy("draft-1b", {"speculative": {**DEDICATED_SPEC, "placement": "colocated"}})
    assert on_base_rack(base, plain).rack == base.rack
