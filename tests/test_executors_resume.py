"""Sweeps on other executors and interrupted sweeps: a real Dask LocalCluster (in-process and via
the CLI's dask-local / dask --scheduler) gives exactly the local process pool's table; a sweep
killed part-way (SIGKILL or Ctrl-C) resumes without recomputing finished points and ends with
exactly the uninterrupted table; a changed scenario never reuses stale points."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from helpers import one_line_error

import experiments.sweep as sweep_mod
from experiments.cli import main
from experiments.sweep import executor_for, load_sweep, plan_points, run_sweep

distributed = pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "experiments" / "scenarios" / "default-mix.toml"
SPECRACK = Path(sys.executable).with_name("specrack")
DRAFT = '{ method = "draft_model", draft_model = "llama-3.2-1b", num_speculative_tokens = 4 }'
KEY_COLS = ["variant", "utilisation", "seed"]
N_POINTS = 8  # 2 variants x 2 utilisation points x 2 seeds
REAL_SIMULATE = sweep_mod.simulate
# a scheduler's HTTP server (/health, /metrics) takes 127.0.0.1:8787 even with dashboard_address=None;
# a second cluster in this process (the module's `cluster` is up) moves to a free port and warns
SECOND_CLUSTER = pytest.mark.filterwarnings("ignore:Port 8787 is already in use:UserWarning")
# the CLI prints a one-line header before it runs anything; errors are one line after it
HEADER = re.compile(r"^sweep '[^']*': \d+ variants x .* runs -> ")


def write_sweep(path: Path, duration_s: int = 40, warmup_s: int = 5) -> Path:
    path.write_text(
        f'name = "exec"\nbase = "{BASE}"\nutilisation = [0.3, 0.6]\nseeds = [1, 2]\nreference = "baseline"\n'
        f'set = {{ "workload.duration_s" = {duration_s}, "workload.warmup_s" = {warmup_s} }}\n\n'
        f'[[variants]]\nname = "baseline"\n\n[[variants]]\nname = "draft"\nset = {{ speculative = {DRAFT} }}\n')
    return path


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(KEY_COLS).reset_index(drop=True)


def assert_same_table(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Exactly the same table: every column, dtype and bit (NaN == NaN)."""
    assert len(a) == N_POINTS and not a.duplicated(KEY_COLS).any()
    a, b = _sorted(a), _sorted(b)
    diff = [c for c in a.columns if c in b.columns and a[c].dtype.kind == "f"
            and not ((a[c] == b[c]) | (a[c].isna() & b[c].isna())).all()]
    assert not diff, f"float columns differ: {diff}"
    pd.testing.assert_frame_equal(a, b, check_exact=True)


def point_files(out: Path) -> dict[str, tuple[int, bytes]]:
    """Finished point files (only *.json) -> (mtime in ns, content)."""
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted((out / "points").glob("*.json"))}




class CountingSimulate:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, sc: Any, seed: int | None = None, **kw: Any) -> Any:
        self.calls.append((sc.key(), seed))
        return REAL_SIMULATE(sc, seed, **kw)


# ----------------------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 8-point sweep (40 s runs), once on the local process pool, in-process and via the CLI."""
    d = tmp_path_factory.mktemp("exec")
    path = write_sweep(d / "small.toml")
    spec = load_sweep(path)
    df, _ = run_sweep(spec, d / "process", jobs=2, executor="process", progress=False)
    assert main(["sweep", str(path), "--out", str(d / "cli-process"), "--executor", "process", "--jobs", "2"]) == 0
    return {"dir": d, "path": path, "spec": spec, "df": df, "cli_out": d / "cli-process",
            "cli_df": pd.read_parquet(d / "cli-process" / "results.parquet")}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A real Dask LocalCluster on loopback: 2 worker processes, 1 thread each, no dashboard."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  scheduler_port=0, dashboard_address=None) as c:
        yield c


# ----------------------------------------------------------------------------- 1. Dask = process pool


def test_small_reference_tables_are_complete(small: dict[str, Any]) -> None:
    for df in (small["df"], small["cli_df"]):
        assert len(df) == N_POINTS and not df.duplicated(KEY_COLS).any()
        assert (df.error == "").all()
    assert len(point_files(small["cli_out"])) == N_POINTS


def test_dask_local_cluster_table_identical_to_process_pool(small: dict[str, Any], cluster: Any,
                                                             tmp_path: Path) -> None:
    assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    assert len(cluster.workers) == 2
    with distributed.Client(cluster) as client:
        assert all(w["nthreads"] == 1 for w in client.scheduler_info()["workers"].values())
        df, _ = run_sweep(small["spec"], tmp_path / "dask", executor=client.get_executor(), progress=False)
    assert_same_table(df, small["df"])
    assert len(point_files(tmp_path / "dask")) == N_POINTS


@SECOND_CLUSTER
def test_executor_for_dask_local_is_loopback_only(small: dict[str, Any], tmp_path: Path) -> None:
    """`executor_for("dask-local")`: 2 single-threaded worker processes, everything on 127.0.0.1
    (the scheduler's HTTP server for /health and /metrics still starts, also on loopback)."""
    with executor_for("dask-local", jobs=2) as ex:
        client = ex._client
        cluster = client.cluster
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        workers = client.scheduler_info()["workers"]
        assert len(workers) == 2 and all(w["nthreads"] == 1 for w in workers.values())
        assert all(a.startswith("tcp://127.0.0.1:") for a in workers)
        assert cluster.scheduler.http_server.address == "127.0.0.1"
        url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
        assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
        with pytest.raises(urllib.error.HTTPError, match="404"):  # no dashboard
            urllib.request.urlopen(f"{url}/status", timeout=10)
        df, _ = run_sweep(small["spec"], tmp_path / "dask", executor=ex, progress=False)
    assert_same_table(df, small["df"])


@SECOND_CLUSTER
def test_cli_dask_local_identical_to_cli_process(small: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dask-local"
    rc = main(["sweep", str(small["path"]), "--out", str(out), "--executor", "dask-local", "--jobs", "2"])
    assert rc == 0, capsys.readouterr().err
    assert_same_table(pd.read_parquet(out / "results.parquet"), small["cli_df"])
    assert point_files(out).keys() == point_files(small["cli_out"]).keys()


# ----------------------------------------------------------------------------- 2. --executor dask --scheduler


def test_cli_dask_with_scheduler_identical_to_cli_process(small: dict[str, Any], cluster: Any, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dask-sched"
    rc = main(["sweep", str(small["path"]), "--out", str(out), "--executor", "dask",
               "--scheduler", cluster.scheduler_address])
    assert rc == 0, capsys.readouterr().err
    assert_same_table(pd.read_parquet(out / "results.parquet"), small["cli_df"])


def test_cli_dask_without_scheduler_exits_2_with_one_line(small: dict[str, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "no-sched"
    assert main(["sweep", str(small["path"]), "--out", str(out), "--executor", "dask"]) == 2
    line = one_line_error(capsys.readouterr().err, HEADER)
    assert "--scheduler" in line and "dask-local" in line
    assert not (out / "points").exists() or not any((out / "points").iterdir())


def test_cli_dask_unreachable_scheduler_exits_2_with_one_line(small: dict[str, Any], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "unreachable"
    t0 = time.perf_counter()
    rc = main(["sweep", str(small["path"]), "--out", str(out), "--executor", "dask", "--scheduler", "tcp://127.0.0.1:1",
               "--scheduler-timeout", "3"])
    elapsed = time.perf_counter() - t0
    assert rc == 2
    line = one_line_error(capsys.readouterr().err, HEADER)
    assert "tcp://127.0.0.1:1" in line and "cannot connect" in line
    assert elapsed < 20


# ----------------------------------------------------------------------------- 3. killed part-way, resumed


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Longer runs (about 1 s a point) so that a serial sweep can be stopped part-way; and its
    uninterrupted results.parquet, from the CLI on the process pool."""
    d = tmp_path_factory.mktemp("slow")
    path = write_sweep(d / "slow.toml", duration_s=500, warmup_s=20)
    spec = load_sweep(path)
    keys = [t["key"] for t in plan_points(spec)[0]]
    assert len(set(keys)) == N_POINTS
    assert main(["sweep", str(path), "--out", str(d / "full"), "--executor", "process", "--jobs", "2"]) == 0
    return {"path": path, "keys": keys, "full": pd.read_parquet(d / "full" / "results.parquet")}


def _start(path: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([str(SPECRACK), "sweep", str(path), "--out", str(out), "--executor", "serial"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_interrupted_sweep_resumes_to_the_uninterrupted_table(slow: dict[str, Any], tmp_path: Path,
                                                              sig: signal.Signals) -> None:
    out = tmp_path / "out"
    proc = _start(slow["path"], out)
    try:
        deadline = time.monotonic() + 120
        while len(list((out / "points").glob("*.json"))) < 2:
            assert proc.poll() is None, f"sweep ended (rc {proc.returncode}) before 2 points were written"
            assert time.monotonic() < deadline, "no 2 finished points within 120 s"
            time.sleep(0.02)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130, err
        assert "interrupted" in err and "resume" in err and "Traceback" not in err
    assert not (out / "results.parquet").exists()

    # only whole points were kept: *.json files are complete, valid, finished rows; temp files
    # (<key>.json.tmp<pid>) are the only other thing allowed
    finished = point_files(out)
    assert 2 <= len(finished) < N_POINTS, f"{len(finished)} points finished before the kill"
    for name, (_, data) in finished.items():
        row = json.loads(data)
        assert name == f"{row['point_key']}.json" and row["point_key"] in slow["keys"] and row["error"] == ""
    others = [p.name for p in (out / "points").iterdir() if p.suffix != ".json"]
    assert all(re.fullmatch(r"[0-9a-f]+-\d+\.json\.tmp\d+", n) for n in others), others

    # a leftover temp file of an unfinished point (as SIGKILL mid-write leaves) is never read as a point
    missing = [k for k in slow["keys"] if f"{k}.json" not in finished]
    fake = json.loads(next(iter(finished.values()))[1])
    fake.update(point_key=missing[0], ttft_s_p99=123.0)
    (out / "points" / f"{missing[0]}.json.tmp999999").write_text(json.dumps(fake))
    (out / "points" / f"{missing[-1]}.json.tmp999998").write_text('{"variant": "base')  # a torn write

    time.sleep(0.05)  # mtimes of rewritten files would differ
    rerun = subprocess.run([str(SPECRACK), "sweep", str(slow["path"]), "--out", str(out), "--executor", "serial"],
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{N_POINTS - len(finished)}/{N_POINTS - len(finished)}" in rerun.stderr  # only the missing points ran
    after = point_files(out)
    assert after.keys() == {f"{k}.json" for k in slow["keys"]}
    for name, (mtime, data) in finished.items():
        assert after[name] == (mtime, data), f"{name} was recomputed"

    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == N_POINTS and not df.duplicated(KEY_COLS).any()
    assert (df.ttft_s_p99 != 123.0).all()
    pd.testing.assert_frame_equal(df, slow["full"], check_exact=True)  # same order, too


# ----------------------------------------------------------------------------- 4. changed scenario


def test_changed_base_set_recomputes_every_point(small: dict[str, Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    shutil.copytree(small["cli_out"], out)
    old_points = point_files(out)
    old = _sorted(pd.read_parquet(out / "results.parquet"))

    changed = load_sweep(write_sweep(tmp_path / "changed.toml", duration_s=41))
    counter = CountingSimulate()
    monkeypatch.setattr(sweep_mod, "simulate", counter)
    new, _ = run_sweep(changed, out, executor="serial", progress=False)
    new = _sorted(new)

    assert len(counter.calls) == N_POINTS  # nothing reused
    assert set(new.point_key).isdisjoint(old.point_key)
    after = point_files(out)
    assert len(after) == 2 * N_POINTS
    assert {n: after[n] for n in old_points} == old_points  # old points left as they were
    assert (new[KEY_COLS] == old[KEY_COLS]).all().all()
    assert (new.offered_requests != old.offered_requests).any()
    assert (new.ttft_s_p99 != old.ttft_s_p99).any()


def test_torn_point_file_is_recomputed_not_fatal(small: dict[str, Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    shutil.copytree(small["cli_out"], out)
    torn = sorted((out / "points").glob("*.json"))[0]
    torn.write_text("")
    counter = CountingSimulate()
    monkeypatch.setattr(sweep_mod, "simulate", counter)
    df, _ = run_sweep(small["spec"], out, executor="serial", progress=False)
    assert len(counter.calls) == 1
    assert_same_table(df, small["df"])
    assert json.loads(torn.read_text())["point_key"] == torn.stem
