"""Multi-turn conversations judged as a long run would: their arrival rate ramps up from the
start (conversations accumulate turns), so the verdict is judged after the ramp
(`sim.workload.conversation_ramp_s`), and a run that ends inside it says how long to run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from experiments.cli import main
from sim.capacity import CapacityStore, capacity_for
from sim.scenario import load_scenario
from sim.schema import Conversations
from sim.simulate import simulate
from sim.workload import RAMP_SHARE, conversation_ramp_s

CHAT = Path(__file__).resolve().parents[1] / "experiments" / "scenarios" / "chat-conversations.toml"


@pytest.mark.parametrize("gap", [{"dist": "exponential", "mean": 30.0}, {"dist": "fixed", "value": 30.0}])
def test_the_ramp_is_where_the_expected_rate_reaches_its_share(gap: dict[str, object]) -> None:
    """The expected rate (rate / turns) x sum_k P(S_k <= t) reaches RAMP_SHARE of the steady rate
    at the ramp's end, checked against sampled turn times."""
    conv = Conversations.model_validate({"turns": 4, "turn_gap_s": gap})
    ramp = conversation_ramp_s(conv)
    rng = np.random.default_rng(1)
    n = 200_000
    draws = (rng.exponential(30.0, (n, 3)) if gap["dist"] == "exponential" else np.full((n, 3), 30.0))
    sent = np.concatenate([np.zeros((n, 1)), np.cumsum(draws, axis=1)], axis=1)
    share = lambda t: float((sent <= t).mean())  # noqa: E731 (the expected rate's share at t)
    assert share(ramp + 1e-9) >= RAMP_SHARE - 0.005
    assert share(ramp * 0.9) < RAMP_SHARE
    one = Conversations.model_validate({"turns": 1, "turn_gap_s": gap})
    assert conversation_ramp_s(one) == 0.0


def test_a_short_conversation_run_says_too_short_not_overloaded(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's command: 120 s at about 17% of capacity used to read the ramp as overload."""
    code = main(["run", str(CHAT), "--set", "workload.duration_s=120", "--set", "workload.warmup_s=20",
                 "--out", str(tmp_path / "o")])
    line = capsys.readouterr().out.splitlines()[0]
    assert code == 0
    assert "OVERLOADED" not in line and "INSUFFICIENT TO JUDGE" in line
    assert "arrival rate ramps up until 144 s" in line and "lengthen duration_s to at least 290" in line


@pytest.mark.parametrize("seed", [1, 2])
def test_conversation_verdicts_agree_with_4x_longer_runs(seed: int) -> None:
    """Past the ramp, a 300 s run at the scenario's own 6 req/s and a 1,200 s one agree (stable,
    SLO met), and so do both at 1.2x the deployment's capacity for this traffic (overloaded)."""
    store = CapacityStore()
    base = load_scenario(CHAT, {"workload.warmup_s": 20.0})
    cap = capacity_for(base, with_capacity=True, store=store)
    assert cap is not None

    def judged(rate: float, duration: float) -> dict[str, object]:
        sc = base.with_overrides({"workload.rate_rps": rate, "workload.duration_s": duration})
        return simulate(sc, seed, capacity=cap, with_capacity=True).summary

    for duration in (300.0, 1200.0):
        s = judged(6.0, duration)
        assert s["verdict"] == "stable" and s["slo_met"], (duration, s["verdict_reason"])
        assert "after the conversations' arrival rate ramps up" in str(s["verdict_reason"])
    for duration in (300.0, 1200.0):
        s = judged(1.2 * cap.baseline.rps, duration)
        assert s["verdict"] == "overloaded", (duration, s["verdict_reason"])
