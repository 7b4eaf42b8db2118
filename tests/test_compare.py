"""`specrack compare`: two sweep folders (written by the sweep's own writers from real simulate()
rows of a tiny deployment) and two plan folders side by side, the line naming what differs, the
HTML, static images (the error without Kaleido), and one-line errors for folders of neither kind."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
from helpers import one_line_error

from experiments.analysis import speedups
from experiments.cli import main
from experiments.plan_search import rank
from experiments.sweep import run_point, write_tables
from sim.scenario import scenario_from_dict

TINY = {"rack": {"gpu": "h100-sxm", "num_gpus": 1}, "deployment": {"model": "llama-3.1-8b", "tensor_parallel": 1},
        "workload": {"rate_rps": 2.0, "duration_s": 20.0, "warmup_s": 4.0}}
VARIANTS = {"baseline": {}, "fp8": {"deployment.weights": "fp8", "deployment.kv_cache": "fp8"}}
LOADS = {0.3: 2.0, 0.6: 4.0}  # utilisation label -> rate (a stand-in for u x capacity)


def _sweep_folder(out: Path, base_set: dict[str, object]) -> Path:
    """A sweep output folder as `specrack sweep` writes it: results.parquet/csv and speedups.csv."""
    base = scenario_from_dict(TINY).with_overrides(base_set)
    rows = []
    for name, over in VARIANTS.items():
        for u, rate in LOADS.items():
            sc = base.with_overrides({**over, "workload.rate_rps": rate})
            rows.append(run_point({"variant": name, "utilisation": u, "concurrency": None, "seed": 1,
                                   "key": f"{sc.key()}-1", "scenario": sc.model_dump(mode="json")}))
    df = pd.DataFrame(rows)
    assert (df.error == "").all(), df.error.tolist()
    write_tables(df, out)
    speedups(df, "baseline").to_csv(out / "speedups.csv", index=False)
    return out


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sweeps")
    a = _sweep_folder(root / "vllm", {})
    b = _sweep_folder(root / "sglang-pricier", {"deployment.engine": "sglang", "rack.usd_per_gpu_hour": 4.5})
    return a, b


def _plan_folder(out: Path, price: float, gpus: int) -> Path:
    """plan.csv with the columns experiments.plan.plan_row writes, ranked as `specrack plan` ranks it."""
    common = {"engine_profile": "vllm-v1", "rate_rps": 10.0, "evaluations": 3, "verdict": "stable",
              "slo_ttft_p99_s_target": 2.0, "slo_tpot_p99_s_target": 0.2, "retraining_usd_per_month": 0.0,
              "quality_in_distribution": 0.8, "quality_tail": 0.7, "passes_quality_floor": True}
    rows = [
        {**common, "strategy": "baseline", "gpu": "h100-sxm", "feasible": True, "replicas": gpus // 4, "gpus": gpus,
         "usd_per_gpu_hour": price, "slo_ttft_p99_s_value": 0.9, "slo_tpot_p99_s_value": 0.05,
         "slo_ttft_p99_s_met": True, "slo_tpot_p99_s_met": True, "binding_slo": "ttft_p99_s",
         "serving_usd_per_month": gpus * price * 720},
        {**common, "strategy": "draft-1b", "gpu": "h100-sxm", "feasible": True, "replicas": 1, "gpus": 4,
         "usd_per_gpu_hour": price, "slo_ttft_p99_s_value": 0.5, "slo_tpot_p99_s_value": 0.15,
         "slo_ttft_p99_s_met": True, "slo_tpot_p99_s_met": True, "binding_slo": "tpot_p99_s",
         "serving_usd_per_month": 4 * price * 720},
        {**common, "strategy": "fp8", "gpu": "h100-sxm", "feasible": False, "reason": "no rack up to 64 GPUs meets the SLO"},
    ]
    df = pd.DataFrame(rows)
    df["total_usd_per_month"] = df.serving_usd_per_month + df.retraining_usd_per_month
    out.mkdir(parents=True)
    rank(df).to_csv(out / "plan.csv", index=False)
    return out


def test_compare_two_sweeps(sweeps: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = sweeps
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tpot_s_mean [vllm]" in text and "tpot_s_mean [sglang-pricier]" in text
    differs = next(ln for ln in text.splitlines() if ln.startswith("inputs differ:"))
    assert "engine_profile: vllm=vllm-v1; sglang-pricier=sglang" in differs
    assert "usd_per_gpu_hour: vllm=2.69; sglang-pricier=4.5" in differs
    assert "weights" not in differs  # the same variants in both
    table = pd.read_csv(out / "compare.csv")
    assert len(table) == len(VARIANTS) * len(LOADS)
    assert set(table.variant) == set(VARIANTS) and set(table.load) == set(LOADS)
    res = pd.read_parquet(a / "results.parquet")
    row = table[(table.variant == "fp8") & (table.load == 0.6)].iloc[0]
    want = res[(res.variant == "fp8") & (res.utilisation == 0.6)]
    assert row["tpot_s_mean [vllm]"] == pytest.approx(want.tpot_s_mean.mean())
    assert row["ttft_s_p99 [vllm]"] == pytest.approx(want.ttft_s_p99.mean())
    assert row["throughput_tok_s [vllm]"] == pytest.approx(want.throughput_tok_s.mean())
    sp = pd.read_csv(a / "speedups.csv")
    want_sp = sp[(sp.variant == "fp8") & (sp.utilisation == 0.6) & (sp.metric == "tpot_s_mean")]["mean"].iloc[0]
    assert row["speedup_tpot_s_mean [vllm]"] == pytest.approx(want_sp)
    assert (table[table.variant == "baseline"]["speedup_tpot_s_mean [sglang-pricier]"] == 1.0).all()
    page = (out / "compare.html").read_text()
    assert not re.search(r"<script[^>]*\ssrc=", page, re.IGNORECASE)  # self-contained: nothing fetched
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js itself is inlined
    assert "engine_profile: vllm=vllm-v1; sglang-pricier=sglang" in page and "sglang-pricier" in page


def test_compare_two_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _plan_folder(tmp_path / "runpod", 2.69, 8)
    b = _plan_folder(tmp_path / "aws", 6.88, 12)
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "usd_per_gpu_hour: runpod=2.69; aws=6.88" in text
    table = pd.read_csv(out / "compare.csv")
    assert list(table.strategy) == ["draft-1b", "baseline", "fp8"]  # the first run's ranking
    base = table[table.strategy == "baseline"].iloc[0]
    assert base["gpus [runpod]"] == 8 and base["gpus [aws]"] == 12
    assert base["total_usd_per_month [aws]"] == pytest.approx(12 * 6.88 * 720)
    assert base["binding_slo [runpod]"] == "ttft_p99_s"
    assert not table[table.strategy == "fp8"]["feasible [aws]"].iloc[0]
    assert "chart-total_usd_per_month" in (out / "compare.html").read_text()


def test_compare_sweep_folder_from_csv_only(sweeps: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """results.csv alone (no parquet, no speedups) still compares: that run's speedups are blank."""
    b = tmp_path / "csv-only"
    b.mkdir()
    (b / "results.csv").write_text((sweeps[0] / "results.csv").read_text())
    assert main(["compare", str(sweeps[0]), str(b), "--out", str(tmp_path / "o")]) == 0
    table = pd.read_csv(tmp_path / "o" / "compare.csv")
    assert table["speedup_tpot_s_mean [csv-only]"].isna().all()
    pd.testing.assert_series_equal(table["tpot_s_mean [csv-only]"], table["tpot_s_mean [vllm]"], check_names=False)
    assert "nothing in the recorded inputs" in capsys.readouterr().out


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    return one_line_error(capsys.readouterr().err)


def test_hostile_folders_are_one_line_errors(sweeps: tuple[Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    good = str(sweeps[0])
    out = ["--out", str(tmp_path / "o")]
    assert "no such folder" in _err(capsys, ["compare", good, str(tmp_path / "missing"), *out])
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert "is a file" in _err(capsys, ["compare", good, str(f), *out])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "neither a sweep output" in _err(capsys, ["compare", good, str(empty), *out])
    assert "two or more" in _err(capsys, ["compare", good, *out])
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "results.parquet").write_bytes(b"not parquet at all")
    assert "cannot be read" in _err(capsys, ["compare", good, str(bad), *out])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.csv").write_text("a,b\n1,2\n")
    assert "lacks the column(s) variant" in _err(capsys, ["compare", good, str(foreign), *out])
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "plan.csv").write_text("")
    assert "empty file" in _err(capsys, ["compare", good, str(blank), *out])
    plan = _plan_folder(tmp_path / "plan", 2.69, 8)
    assert "cannot compare sweeps with plans" in _err(capsys, ["compare", good, str(plan), *out])
    assert "exists and is not a folder" in _err(capsys, ["compare", good, good, "--out", str(f)])


def test_png_without_kaleido_names_the_extra(sweeps: tuple[Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "kaleido", None)  # as if not installed: import raises ImportError
    line = _err(capsys, ["compare", str(sweeps[0]), str(sweeps[1]), "--png", "--out", str(tmp_path / "o")])
    assert "pip install -e '.[images]'" in line
    assert not (tmp_path / "o").exists()  # refused before any work


def test_png_and_svg_with_kaleido(sweeps: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("kaleido")
    out = tmp_path / "o"
    try:
        code = main(["compare", str(sweeps[0]), str(sweeps[1]), "--png", "--svg", "--out", str(out)])
    except SystemExit:  # pragma: no cover
        raise
    if code == 2:  # Kaleido installed but unable to run here (e.g. no browser for Kaleido 1.x)
        pytest.skip("Kaleido cannot export in this environment")
    assert (out / "compare-sweep.png").stat().st_size > 0 and (out / "compare-sweep.svg").stat().st_size > 0


@pytest.mark.parametrize("argv", [["sweep", "--quick"], ["plan", "experiments/plans/chat-70b.toml", "--quick"]])
def test_sweep_and_plan_images_without_kaleido_refuse_before_running(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "kaleido", None)
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    line = _err(capsys, [*argv, "--svg", "--out", str(tmp_path / "o")])
    assert "pip install -e '.[images]'" in line and not (tmp_path / "o").exists()


def test_sweep_png_with_kaleido(tmp_path: Path) -> None:
    pytest.importorskip("kaleido")
    (tmp_path / "base.toml").write_text(
        '[rack]\ngpu = "h100-sxm"\nnum_gpus = 1\n[deployment]\nmodel = "llama-3.1-8b"\ntensor_parallel = 1\n'
        '[workload]\nutilisation = 0.5\nduration_s = 20.0\nwarmup_s = 4.0\n')
    (tmp_path / "sweep.toml").write_text('base = "base.toml"\nutilisation = [0.3, 0.6]\nseeds = [1]\n'
                                         '[[variants]]\nname = "baseline"\n[[variants]]\nname = "fp8"\n'
                                         'set = { "deployment.weights" = "fp8" }\n')
    out = tmp_path / "o"
    code = main(["sweep", str(tmp_path / "sweep.toml"), "--jobs", "1", "--png", "--out", str(out)])
    if code == 2:  # pragma: no cover - Kaleido installed but unable to run here
        pytest.skip("Kaleido cannot export in this environment")
    assert code == 0 and (out / "report-headline.png").stat().st_size > 0 and (out / "report-latency.png").is_file()


def test_summary_scenario_differences_are_named(sweeps: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A folder that also holds a summary.json (as `specrack run` writes it) adds its scenario's
    fields to the inputs compared."""
    import json
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    for dst, over in ((a, {}), (b, {"workload.duration_s": 25.0})):
        shutil.copytree(sweeps[0], dst)
        sc = scenario_from_dict(TINY).with_overrides(over)
        (dst / "summary.json").write_text(json.dumps({"scenario": sc.model_dump(mode="json")}))
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "o")]) == 0
    differs = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("inputs differ:"))
    assert "workload.duration_s: a=20.0; b=25.0" in differs and "engine_profile" not in differs
