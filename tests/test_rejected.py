"""Requests the deployment rejects (longer than max_model_len) are counted everywhere, with
their reason, and never enter capacity: the terminal line, the summary, `validate`, capacity."""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pytest

from experiments.cli import main
from sim.scenario import load_scenario
from sim.simulate import capacity, simulate

SCENARIO = """name = "rejects"
[rack]
gpu = "h100-sxm"
num_gpus = 4
[deployment]
model = "llama-3.1-70b"
tensor_parallel = 4
[workload]
{workload}
"""


def _trace(path: Path, bad_rows: tuple[int, ...]) -> None:
    """An Azure-format trace of 300 rows, those at `bad_rows` (0-based) 1e15 prompt tokens."""
    rng = np.random.default_rng(1)
    t0 = datetime.datetime(2023, 11, 16, 18, 0, 0)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i, x in enumerate(np.cumsum(rng.exponential(0.5, 300))):
        p = 10**15 if i in bad_rows else int(rng.lognormal(7, 0.8)) + 1
        ts = (t0 + datetime.timedelta(seconds=float(x))).strftime("%Y-%m-%d %H:%M:%S.%f")
        rows.append(f"{ts},{p},{int(rng.lognormal(5, 0.8)) + 1}")
    path.write_text("\n".join(rows) + "\n")


@pytest.fixture
def bad_trace(tmp_path: Path) -> Path:
    _trace(tmp_path / "trace.csv", (40, 200))
    sc = tmp_path / "sc.toml"
    sc.write_text(SCENARIO.format(workload=f'arrival = "trace"\ntrace = "{tmp_path / "trace.csv"}"\n'
                                           "duration_s = 400\nwarmup_s = 10"))
    return sc


def test_bad_trace_rows_are_named_by_line_and_never_enter_capacity(bad_trace: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Two rows of 1e15 tokens (file lines 42 and 202: header on line 1) used to enter the
    capacity measurement (1.6e-9 req/s) and vanish from the run without a word."""
    assert main(["validate", str(bad_trace)]) == 0
    out = capsys.readouterr().out
    assert "2 of 300 requests (0.7%) would be rejected" in out and "trace lines 42, 202" in out
    sc = load_scenario(bad_trace)
    clean = capacity(sc).rps
    assert clean > 1.0  # the served mix's capacity, not 1e-9
    s = simulate(sc.with_overrides({"workload.rate_rps": 1.0})).summary
    assert s["rejected_requests"] == 2 and s["rejected_lines"] == "42, 202"
    assert "longer than max_model_len = 131,072 tokens (the model's context length)" in s["rejected_reason"]
    assert s["offered_requests"] == s["completed_requests"] + 2  # both arrived in the window


def test_a_run_rejecting_over_one_percent_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Prompts of median 120k tokens: a third or so exceed the model's context. The terminal line
    counts them, a WARNING line gives the share and the fix, and the offered rate is the one
    configured (rejected requests are offered, not served)."""
    sc = tmp_path / "long.toml"
    sc.write_text(SCENARIO.format(workload='rate_rps = 0.5\nduration_s = 400\nwarmup_s = 20\n'
                                           'prompt_tokens = { dist = "lognormal", median = 120000, p90 = 200000, max = 400000 }\n'
                                           'output_tokens = { dist = "fixed", value = 64 }'))
    assert main(["run", str(sc), "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert " rejected), " in lines[0]
    warn = [x for x in lines if "WARNING:" in x]
    assert len(warn) == 1 and "longer than max_model_len" in warn[0] and "cap the lengths" in warn[0]
    s = simulate(load_scenario(sc)).summary
    assert 0.2 < s["rejected_share"] < 0.6
    assert s["offered_rps"] == pytest.approx(0.5, rel=0.25)
