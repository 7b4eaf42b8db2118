"""What a plain run costs: `import specrack` and `specrack --help` load no heavy library, a run
loads neither pandas nor plotly nor scipy.stats, measures its capacity only when its output needs it, keeps
it in the capacity cache (reused by the next process, keyed by everything it depends on) and
writes the interval chart only on request (docs/PERFORMANCE.md, "What a run costs")."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.cli import main
from sim.capacity import CapacityStore, cache_digest, capacity_key, default_cache_dir
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "experiments" / "scenarios" / "reference-70b.toml"
SMALL = ["--set", "workload.num_requests=300"]
HEAVY = ("plotly", "scipy.stats", "pandas", "pyarrow", "numpy")


def _modules_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter holds after running `code` (in the repository root)."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr
    return set(json.loads(p.stdout.strip().splitlines()[-1]))


def test_import_specrack_and_help_load_no_heavy_library() -> None:
    for code in ("import specrack",
                 "from experiments.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"):
        mods = _modules_after(code)
        assert not {m for m in mods if m.split(".")[0] in HEAVY or m == "scipy.stats"}, code
    assert "experiments.commands.run" not in _modules_after("import specrack")


def test_a_run_loads_neither_pandas_nor_plotly_nor_scipy_stats(tmp_path: Path) -> None:
    # (its tables are numpy columns, `sim.frame.Frame`, written by pyarrow; pandas is a third of the process)
    for i, extra in enumerate(([], ["--capacity", "--no-cache"])):
        out = tmp_path / str(i)
        code = (f"from experiments.cli import main\n"
                f"assert main(['run', {str(REFERENCE)!r}, '--out', {str(out)!r}, *{[*SMALL, *extra]!r}]) == 0")
        mods = _modules_after(code)
        assert "sim.simulate" in mods and (out / "requests.parquet").exists()  # (it ran)
        assert not {m for m in mods if m.startswith(("plotly", "scipy.stats", "pandas"))}, extra
        assert not (out / "intervals.html").exists()
    # the user's DataFrames are made when asked for
    mods = _modules_after(f"from sim.simulate import simulate\nfrom sim.scenario import load_scenario\n"
                          f"res = simulate(load_scenario({str(REFERENCE)!r}, {{'workload.num_requests': 50}}))\n"
                          f"assert len(res.requests) == 50")
    assert "pandas" in mods


def test_capacity_only_when_asked_and_cached_between_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECRACK_CAPACITY_CACHE", str(cache))
    assert main(["run", str(REFERENCE), "--out", str(tmp_path / "a"), *SMALL]) == 0
    assert "\n  capacity " not in capsys.readouterr().out
    assert "capacity_rps" not in json.loads((tmp_path / "a" / "summary.json").read_text())
    assert not cache.exists()  # nothing measured, nothing kept
    assert main(["run", str(REFERENCE), "--out", str(tmp_path / "b"), "--capacity", *SMALL]) == 0
    assert "\n  capacity " in capsys.readouterr().out
    files = list(cache.glob("*.json"))
    assert len(files) == 1
    first = json.loads((tmp_path / "b" / "summary.json").read_text())
    # a second process reads it (a poisoned entry shows it was read, not measured again)
    entry = json.loads(files[0].read_text())
    entry["capacity"]["rps"] = 123.0
    files[0].write_text(json.dumps(entry))
    p = subprocess.run([sys.executable, "-m", "experiments.cli", "run", str(REFERENCE), "--out", str(tmp_path / "c"),
                        "--capacity", *SMALL], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "SPECRACK_CAPACITY_CACHE": str(cache)})
    assert p.returncode == 0, p.stderr
    assert "capacity 123.00 req/s" in p.stdout
    # --no-cache measures anew: the same figures as the first measurement, bit for bit
    assert main(["run", str(REFERENCE), "--out", str(tmp_path / "d"), "--capacity", "--no-cache", *SMALL]) == 0
    again = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert again["capacity_rps"] == first["capacity_rps"] and again["capacity_curve"] == first["capacity_curve"]
    # a load given as a utilisation reports the capacity it is relative to
    capsys.readouterr()
    by_load = tmp_path / "by-load.toml"
    by_load.write_text(REFERENCE.read_text().replace("rate_rps = 2.0", "utilisation = 0.3"))
    assert main(["run", str(by_load), "--out", str(tmp_path / "e"), *SMALL]) == 0
    assert "capacity 123.00 req/s" in capsys.readouterr().out


def test_a_corrupt_or_unwritable_cache_is_measured_anew(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = load_scenario(REFERENCE, {"workload.num_requests": 300})
    store = CapacityStore(tmp_path)
    cap = store.capacity(sc)
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    fresh = CapacityStore(tmp_path)
    assert fresh.capacity(sc) == cap and fresh.disk_hits == 0
    assert CapacityStore(tmp_path).capacity(sc) == cap  # (rewritten whole)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    store = CapacityStore(blocked / "cache")
    assert store.capacity(sc) == cap and store.write_error is not None
    args = ["run", str(REFERENCE), "--out", str(tmp_path / "r"), "--capacity", *SMALL]
    os.environ["SPECRACK_CAPACITY_CACHE"] = str(blocked / "cache")
    try:
        assert main(args) == 0
    finally:
        os.environ["SPECRACK_CAPACITY_CACHE"] = "off"
    assert "note: capacity not cached" in capsys.readouterr().out


def test_a_collapsed_ladder_is_kept_on_disk_until_refined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sim.capacity as capacity_module

    sc = load_scenario(REFERENCE, {"workload.num_requests": 300})
    real = capacity_module.measure_ladder(sc, sc.seed)
    collapsed = dataclasses.replace(real, collapse=True, rps=real.rps * 1.2)
    calls: list[int] = []

    def measure(s: object, seed: int) -> object:
        calls.append(seed)
        return collapsed

    monkeypatch.setattr(capacity_module, "measure_ladder", measure)
    assert CapacityStore(tmp_path).ladder(sc) == collapsed and len(calls) == 1
    assert len(list(tmp_path.glob("*.ladder.json"))) == 1
    fresh = CapacityStore(tmp_path)  # another process: read, not measured
    assert fresh.ladder(sc) == collapsed and len(calls) == 1 and fresh.disk_hits == 1
    # the refined capacity, once kept, is what a ladder is answered with
    monkeypatch.setattr(capacity_module, "refine", lambda s, seed, lad: real)
    assert fresh.capacity(sc) == real
    assert CapacityStore(tmp_path).ladder(sc) == real and len(calls) == 1
    assert not list(tmp_path.glob("*.ladder.json"))  # (superseded, removed)


def test_the_cache_key_holds_what_a_capacity_depends_on(tmp_path: Path) -> None:
    sc = load_scenario(REFERENCE)
    key = capacity_key(sc)
    assert capacity_key(sc.with_overrides({"workload.rate_rps": 7.0, "workload.num_requests": 10})) == key
    for change in ({"deployment.max_num_seqs": 64}, {"seed": 2}, {"rack.gpu": "h200"},
                   {"workload.output_tokens": {"dist": "fixed", "value": 300}}, {"sim.draft_kv_free": True}):
        assert capacity_key(sc.with_overrides(change)) != key, change
    # a file the scenario names counts by its content, not its path
    trace = tmp_path / "lengths.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,20\n")
    over = {"workload.prompt_tokens": {"dist": "empirical", "trace": str(trace)}}
    k = capacity_key(sc.with_overrides(over))
    before = cache_digest(k)
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,21\n")
    assert cache_digest(k) != before


def test_cache_folder_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECRACK_CAPACITY_CACHE", "off")
    assert default_cache_dir() is None
    monkeypatch.setenv("SPECRACK_CAPACITY_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SPECRACK_CAPACITY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "specrack" / "capacity"


def test_chart_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(REFERENCE), "--set", "workload.num_requests=1200"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert not (tmp_path / "a" / "intervals.html").exists() and (tmp_path / "a" / "intervals.csv").is_file()
    assert main([*args, "--out", str(tmp_path / "b"), "--chart"]) == 0
    assert "plotly" in (tmp_path / "b" / "intervals.html").read_text()
    assert main([*args, "--out", str(tmp_path / "c"), "--set", "sim.interval_s=120"]) == 0  # intervals asked for
    assert (tmp_path / "c" / "intervals.html").is_file()
    capsys.readouterr()
    assert main(["run", str(REFERENCE), *SMALL, "--out", str(tmp_path / "d"), "--chart"]) == 0
    assert "no intervals.html" in capsys.readouterr().out


def test_beta_quantile_is_scipy_stats_bit_for_bit() -> None:
    from scipy import stats

    from models.speculative import beta_ppf

    q = np.random.default_rng(0).random(20_000)
    q[:2] = (0.0, 1.0)
    for a, b in ((0.5, 0.7), (3.2, 1.1), (20.0, 5.0), (0.05, 0.02), (100.0, 300.0), (7.3, 0.3)):
        np.testing.assert_array_equal(beta_ppf(q, a, b), stats.beta.ppf(q, a, b))
