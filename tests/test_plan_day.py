"""`[day]` in a plan file (experiments/plan_day.py): the fixed rack sized for the day's peak, and
the day replayed on an autoscaled fleet per strategy (peak GPUs, GPU-hours and cost per day)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.plan import load_plan, run_search
from experiments.plan_day import run_day
from models.errors import ConfigError

BASE = """
name = "day-base"
[rack]
gpu = "h100-sxm"
num_gpus = 4
usd_per_gpu_hour = 2.5
[deployment]
model = "llama-3.1-70b"
tensor_parallel = 4
max_num_seqs = 128
[workload]
rate_rps = 1.0
duration_s = 60
warmup_s = 10
prompt_tokens = { dist = "fixed", value = 512 }
output_tokens = { dist = "fixed", value = 128 }
[[workload.classes]]
name = "chat"
share = 1.0
acceptance = 0.6
"""

PLAN = """
name = "tiny-day"
base = "base.toml"
strategies = ["baseline"]
[day]
rate_profile = { shape = "diurnal", peak_rps = 26.0, trough_rps = 4.0, peak_hour = 12.0, day_s = 600 }
autoscale = { policy = "target_utilisation", target = 0.85, interval_s = 20, replica_warmup_s = 30, scale_down_window_s = 60 }
interval_s = 50
[slo]
ttft_p99_s = 1.0
tpot_p99_s = 0.06
[search]
gpus = ["h100-sxm"]
usd_per_gpu_hour = { h100-sxm = 2.5 }
max_gpus = 16
configurations = false
duration_s = 90
warmup_s = 15
"""


def _write(tmp_path: Path, plan: str = PLAN) -> Path:
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "plan.toml").write_text(plan)
    return tmp_path / "plan.toml"


def test_day_plan_sizes_for_the_peak_and_autoscales_below_it(tmp_path: Path) -> None:
    spec = load_plan(_write(tmp_path))
    assert spec.day is not None and spec.rate_rps == pytest.approx(26.0)  # the fixed rack: the day's peak
    assert spec.day.mean_rps == pytest.approx(15.0) and "peak 26.00 req/s" in spec.inputs()["day"]
    answer, _ = run_search(spec, jobs=2)
    table, iv = run_day(spec, answer, tmp_path)
    r = table.iloc[0]
    assert r.fixed_replicas == 2  # 26 req/s needs two TP4 replicas of ~16 req/s each
    assert r.fixed_usd_per_day == pytest.approx(8 * 24 * 2.5)
    assert r.peak_gpus == 8 and r.gpu_hours_per_day < 0.9 * r.fixed_gpu_hours_per_day  # the trough runs one replica
    assert r.usd_per_day == pytest.approx(r.gpu_hours_per_day * 2.5) and r.saving_vs_fixed > 0.1
    assert r.day_verdict == "stable" and r.intervals_slo_met_share >= 0.75
    assert len(iv) == 12 and set(iv.strategy) == {"baseline"}
    assert (tmp_path / "day.csv").is_file() and (tmp_path / "day_intervals.csv").is_file()
    assert "plotly" in (tmp_path / "day.html").read_text()


@pytest.mark.parametrize(("edit", "needle"), [
    (("[day]", "[traffic]\nrate_rps = 3\n[day]"), "traffic: a plan with [day] is sized for the day's peak"),
    (("rate_profile =", "rate_profle ="), "did you mean 'rate_profile'"),
    (("interval_s = 20,", "interval_s = 20, taget = 3,"), "day.autoscale.taget: unknown field"),
    (("trough_rps = 4.0", "trough_rps = 40.0"), "day.rate_profile"),
    (("interval_s = 50", "interval_s = 0"), "day.interval_s"),
])
def test_bad_day_tables_are_one_line_errors(tmp_path: Path, edit: tuple[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_plan(_write(tmp_path, PLAN.replace(*edit)))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bundled_day_plan_loads_both_modes() -> None:
    from experiments import bundled_plan

    full, quick = load_plan(bundled_plan("day-70b")), load_plan(bundled_plan("day-70b"), quick=True)
    assert full.day is not None and quick.day is not None
    assert full.day.duration_s == 86400 and quick.day.duration_s == 7200  # the same day, compressed
    assert full.rate_rps == quick.rate_rps == 12.0 and [s.name for s in full.strategies][-1] == "draft-1b-follow-load"
