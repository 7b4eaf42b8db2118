"""Trace replay end to end: a scenario whose arrivals (and lengths) come from a trace file in its
original format, optionally time-scaled to a target rate; empirical length distributions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from models.errors import ConfigError
from sim.scenario import load_scenario
from sim.workload import generate
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "experiments" / "scenarios" / "llama70b-h100x8.toml"
REAL_CONV = ROOT.parent / "shared" / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def _azure(path: Path, n: int = 400, gap_s: float = 0.25, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        t = i * gap_s
        lines.append(f"2023-11-16 18:{15 + int(t // 60):02d}:{t % 60:010.7f},{rng.integers(50, 800)},{rng.integers(5, 200)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_replay_keeps_its_own_timing_and_lengths(tmp_path: Path) -> None:
    trace = _azure(tmp_path / "t.csv")
    sc = load_scenario(EXAMPLE, {"workload.arrival": "trace", "workload.trace": str(trace), "workload.utilisation": None,
                                 "workload.duration_s": 90, "workload.warmup_s": 10})
    table = generate(sc.workload, 1, None).to_pandas()
    assert len(table) == 360  # arrivals in [0, 90) at 4 per second
    np.testing.assert_allclose(np.diff(table.arrival_s), 0.25, atol=1e-6)
    res = simulate(sc)
    assert res.summary["stable"] and res.summary["completed_requests"] == res.summary["offered_requests"]
    assert res.requests.prompt_tokens.tolist() == table.prompt_tokens.tolist()


def test_trace_time_scaled_to_a_target_rate(tmp_path: Path) -> None:
    trace = _azure(tmp_path / "t.csv")
    sc = load_scenario(EXAMPLE, {"workload.arrival": "trace", "workload.trace": str(trace), "workload.rate_rps": 2.0,
                                 "workload.duration_s": 1000, "workload.warmup_s": 10})
    table = generate(sc.workload, 1, 2.0).to_pandas()
    assert len(table) == 400
    rate = (len(table) - 1) / (table.arrival_s.iloc[-1] - table.arrival_s.iloc[0])
    assert rate == pytest.approx(2.0, rel=1e-9)


def test_empirical_lengths_from_a_trace(tmp_path: Path) -> None:
    trace = _azure(tmp_path / "t.csv")
    emp = {"dist": "empirical", "trace": str(trace)}
    sc = load_scenario(EXAMPLE, {"workload.prompt_tokens": emp, "workload.output_tokens": emp,
                                 "workload.num_requests": 3000, "workload.rate_rps": 1.0})
    table = generate(sc.workload, 1, 1.0).to_pandas()
    from sim.traces import load_trace

    src = load_trace(trace)
    assert set(table.prompt_tokens) <= set(src.prompt_tokens)
    assert table.output_tokens.mean() == pytest.approx(src.output_tokens.mean(), rel=0.05)


def test_missing_trace_file_is_a_one_line_error_at_validation(tmp_path: Path) -> None:
    for over in ({"workload.arrival": "trace", "workload.trace": str(tmp_path / "nope.csv"), "workload.utilisation": None},
                 {"workload.prompt_tokens": {"dist": "empirical", "trace": str(tmp_path / "nope.csv")}}):
        with pytest.raises(ConfigError) as err:
            load_scenario(EXAMPLE, over)
        assert "\n" not in str(err.value) and "nope.csv" in str(err.value) and "workload" in str(err.value)


@pytest.mark.skipif(not REAL_CONV.is_file(), reason="the real Azure trace is not beside the project")
def test_real_azure_trace_replays(tmp_path: Path) -> None:
    sc = load_scenario(EXAMPLE, {"workload.arrival": "trace", "workload.trace": str(REAL_CONV), "workload.utilisation": None,
                                 "workload.duration_s": 120, "workload.warmup_s": 20})
    res = simulate(sc)
    s = res.summary
    assert s["offered_requests"] > 0 and s["completed_requests"] == s["offered_requests"]
    assert s["offered_rps"] == pytest.approx(len(res.requests[(res.requests.arrival_s >= 20) & (res.requests.arrival_s < 120)]) / 100)
