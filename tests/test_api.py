"""The Python API, `import specrack`: cheap to import, every public name resolves, a run through
it, `Result.table()`, the per-request latency columns, and `specrack list`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import specrack
from experiments.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = {"rack": {"gpu": "h100-sxm", "num_gpus": 1}, "deployment": {"model": "llama-3.1-8b", "tensor_parallel": 1},
        "workload": {"rate_rps": 3.0, "duration_s": 30.0, "warmup_s": 5.0}}


@pytest.fixture(scope="module")
def tiny_result() -> specrack.Result:
    from sim.scenario import scenario_from_dict

    return specrack.simulate(scenario_from_dict(TINY), 1)


def test_import_in_a_fresh_interpreter_is_cheap_and_every_name_resolves() -> None:
    code = ("import sys, specrack\n"
            "heavy = [m for m in ('pandas', 'numpy', 'simpy', 'plotly', 'sim', 'models', 'experiments') if m in sys.modules]\n"
            "print('heavy', heavy)\n"
            "missing = [n for n in specrack.__all__ if getattr(specrack, n, None) is None]\n"
            "print('missing', missing)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    assert "heavy []" in out.stdout and "missing []" in out.stdout, out.stdout


def test_all_names_resolve_with_docstrings() -> None:
    expected = {"load_scenario", "simulate", "capacity", "sweep", "plan", "calibrate", "fit_acceptance", "Result",
                "Scenario", "Capacity", "CapacityStore", "ConfigError", "GPUS", "MODELS", "PROFILES", "builtin_strategies",
                "flatten"}
    assert set(specrack.__all__) == expected
    for name in specrack.__all__:
        obj = getattr(specrack, name)
        if isinstance(obj, dict):
            assert obj, name
        else:
            assert callable(obj) and (obj.__doc__ or "").strip(), f"{name} has no docstring"
    assert specrack.ConfigError is __import__("models.errors").errors.ConfigError
    assert "h100-sxm" in specrack.GPUS and "llama-3.1-70b" in specrack.MODELS and "vllm-v1" in specrack.PROFILES
    assert "baseline" in specrack.builtin_strategies()
    with pytest.raises(AttributeError):
        _ = specrack.no_such_name  # type: ignore[attr-defined]
    assert set(specrack.__all__) <= set(dir(specrack))


def test_load_scenario_and_bad_input_through_the_front_door(tmp_path: Path) -> None:
    sc = specrack.load_scenario(ROOT / "experiments" / "scenarios" / "llama70b-h100x8.toml", {"workload.duration_s": 120})
    assert isinstance(sc, specrack.Scenario) and sc.workload.duration_s == 120
    with pytest.raises(specrack.ConfigError):
        specrack.load_scenario(ROOT / "experiments" / "scenarios" / "llama70b-h100x8.toml", {"rack.gpu": "h1000"})


def test_simulate_and_one_row_table(tiny_result: specrack.Result) -> None:
    res = tiny_result
    assert isinstance(res, specrack.Result)
    t = res.table()
    assert isinstance(t, pd.DataFrame) and len(t) == 1
    flat = specrack.flatten(res.summary)
    assert list(t.columns) == list(flat)
    assert "scenario" not in t and "versions" not in t
    for key in ("ttft_s_p99", "tpot_s_mean", "throughput_tok_s", "slo_ttft_p99_s_met", "engine_profile", "seed"):
        assert key in t
    assert t.ttft_s_p99.iloc[0] == res.summary["ttft_s"]["p99"]
    assert t.seed.iloc[0] == 1 and t.engine_profile.iloc[0] == "vllm-v1"


def test_requests_latency_columns_are_the_summary_percentiles_sources(tiny_result: specrack.Result) -> None:
    req, s = tiny_result.requests, tiny_result.summary
    np.testing.assert_allclose(req.ttft_s, req.first_token_s - req.arrival_s)
    np.testing.assert_allclose(req.e2e_s, req.completion_s - req.arrival_s)
    np.testing.assert_allclose(req.tpot_s, (req.e2e_s - req.ttft_s) / (req.output_tokens - 1))
    warm, end = tiny_result.scenario.workload.warmup_s, s["window_end_s"]
    m = req[(req.arrival_s >= warm) & (req.arrival_s < end) & req.completion_s.notna()]
    assert len(m) > 20
    for col in ("ttft_s", "tpot_s", "e2e_s"):
        x = m[col].dropna().to_numpy()
        assert s[col]["mean"] == pytest.approx(x.mean(), rel=1e-12)
        for p in (50, 90, 99):
            assert s[col][f"p{p}"] == pytest.approx(np.percentile(x, p), rel=1e-12)


def test_written_requests_carry_the_latency_columns(tiny_result: specrack.Result, tmp_path: Path) -> None:
    tiny_result.write(tmp_path)
    back = pd.read_parquet(tmp_path / "requests.parquet")
    assert {"ttft_s", "tpot_s", "e2e_s"} <= set(back.columns)


@pytest.mark.parametrize(("kind", "must"), [
    ("gpus", ["h100-sxm", "TDP W", "700", "$/GPU-h", "2.69", "hardware.csv"]),
    ("models", ["llama-3.1-70b", "layers", "80", "params B", "70.6"]),
    ("strategies", ["baseline", "draft-1b", "speculative.method=draft_model", "fp8"]),
    ("profiles", ["vllm-v1 (default)", "sglang", "trtllm", "separate", "mixed", "TensorRT-LLM"]),
])
def test_list_prints_a_readable_table(kind: str, must: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", kind]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert set(lines[1].replace(" ", "")) == {"-"}  # a heading, a rule, then one line per entry
    for text in must:
        assert text in out, text


def test_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "gpus", "--json"]) == 0
    gpus = {g["name"]: g for g in json.loads(capsys.readouterr().out)}
    assert set(gpus) == set(specrack.GPUS)
    assert gpus["b200"]["tdp_w"] == 1000 and gpus["h100-sxm"]["usd_per_gpu_hour"] == 2.69 and gpus["h100-sxm"]["source"]
    assert main(["list", "models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert models["llama-3.1-70b"]["layers"] == 80
    assert main(["list", "strategies", "--json"]) == 0
    strategies = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
    assert set(strategies) == set(specrack.builtin_strategies())
    assert strategies["fp8"]["set"]["deployment.weights"] == "fp8"
    assert main(["list", "profiles", "--json"]) == 0
    profiles = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert set(profiles) == set(specrack.PROFILES)
    assert profiles["sglang"]["prefill"] == "separate" and profiles["trtllm"]["aliases"] == ["tuned"]


def test_list_unknown_catalogue_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["list", "gpu"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


BASE_TOML = """name = "tiny"
[rack]
gpu = "h100-sxm"
num_gpus = 1
[deployment]
model = "llama-3.1-8b"
tensor_parallel = 1
[workload]
utilisation = 0.5
duration_s = 20.0
warmup_s = 4.0
"""


def test_sweep_wrapper_runs_a_sweep_file_and_writes_its_tables(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(BASE_TOML)
    (tmp_path / "sweep.toml").write_text('name = "tiny"\nbase = "base.toml"\nutilisation = [0.3, 0.6]\nseeds = [1]\n'
                                         'reference = "baseline"\n[[variants]]\nname = "baseline"\n[[variants]]\n'
                                         'name = "fp8"\nset = { "deployment.weights" = "fp8" }\n')
    df = specrack.sweep(tmp_path / "sweep.toml", tmp_path / "out", jobs=1)
    assert len(df) == 4 and set(df.variant) == {"baseline", "fp8"} and (df.error == "").all()
    assert {"tpot_s_mean", "ttft_s_p99", "throughput_tok_s", "capacity_rps", "engine_profile"} <= set(df.columns)
    assert len(pd.read_parquet(tmp_path / "out" / "results.parquet")) == 4
    assert len(list((tmp_path / "out" / "points").glob("*.json"))) == 4  # a rerun resumes from them
    with pytest.raises(specrack.ConfigError):
        specrack.sweep(tmp_path / "base.toml")


def test_plan_wrapper_returns_the_ranked_table(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(BASE_TOML)
    (tmp_path / "plan.toml").write_text('name = "tiny-plan"\nbase = "base.toml"\nstrategies = ["baseline", "fp8"]\n'
                                        '[traffic]\nrate_rps = 4.0\n[search]\ngpus = ["h100-sxm"]\nmax_gpus = 2\n'
                                        'duration_s = 40\nwarmup_s = 5\nseeds = [1]\n')
    df = specrack.plan(tmp_path / "plan.toml", jobs=1)
    assert set(df.strategy) == {"baseline", "fp8"}
    assert df.feasible.all() and (df.gpus == 1).all() and df.binding_slo.notna().all()
    assert df.total_usd_per_month.is_monotonic_increasing
