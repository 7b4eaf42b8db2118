"""The shipped examples stay usable: every scenario validates, every plan and sweep file loads,
and the experiment scripts answer --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bundled_plan, bundled_scenario
from experiments.plan import load_plan
from experiments.sweep import load_sweep
from models.errors import ConfigError
from sim.deployment import build_runtime
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "experiments" / "scenarios").glob("*.toml"))
TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_scenario_validates(path: Path) -> None:
    sc = load_scenario(path)
    rt = build_runtime(sc)
    assert rt.num_replicas >= 1 and rt.plan.kv_capacity_tokens > 0


def test_bundled_lookup_suggests() -> None:
    assert bundled_scenario("llama70b-h100x8").is_file()
    with pytest.raises(ConfigError, match="did you mean"):
        bundled_scenario("llama70b-h100x")


def test_default_sweep_loads_both_modes() -> None:
    full, quick = load_sweep(None), load_sweep(None, quick=True)
    assert len(full.utilisation) == 13 and full.utilisation[0] == 0.30 and full.utilisation[-1] == 0.90
    assert len(full.seeds) == 3 and len(full.variants) == 10
    assert len(quick.utilisation) < len(full.utilisation)


def test_chat_plan_loads() -> None:
    spec = load_plan(bundled_plan("chat-70b"), quick=True)
    assert spec.rate_rps == 12.0 and spec.quality_floor_tail == 0.9 and len(spec.strategies) >= 5


@pytest.mark.skipif(not TRACE.is_file(), reason="the real Azure trace is not beside the project")
def test_trace_plan_loads_with_real_trace() -> None:
    spec = load_plan(bundled_plan("code-assistant-trace"), quick=True)
    full = load_plan(bundled_plan("code-assistant-trace"))
    assert full.rate_rps == pytest.approx(2737 / 600 * 1.5, rel=0.01)  # the busiest 10 minutes' rate x growth
    assert spec.rate_rps == pytest.approx(full.rate_rps, rel=0.10)  # --quick judges the same traffic
    assert spec.base.workload.arrival == "trace"


@pytest.mark.parametrize("script", ["utilisation_sweep.py", "plan_analyses.py"])
def test_experiment_scripts_help(script: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    assert "usage" in out.stdout
