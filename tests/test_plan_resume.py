"""`specrack plan` is resumable and shows progress: every finished simulation and capacity is
kept in OUT/points, so a plan killed part-way (SIGKILL: nothing can be flushed) and rerun gives the
uninterrupted plan's table exactly, with fewer simulations; progress with an ETA goes to stderr.

A small plan (one strategy, 60 s runs, no analyses): a few seconds of CPU a full run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "experiments" / "scenarios" / "default-mix.toml"
RAN = re.compile(r"simulations and capacity measurements: (\d+) run now, (\d+) reused")


def _plan(tmp: Path) -> Path:
    p = tmp / "plan.toml"
    p.write_text(textwrap.dedent(f"""\
        name = "resume"
        base = "{BASE}"
        strategies = ["baseline"]
        [traffic]
        rate_rps = 9.0
        [slo]
        ttft_p99_s = 2.0
        tpot_p99_s = 0.2
        [search]
        gpus = ["h100-sxm"]
        max_gpus = 16
        duration_s = 60
        warmup_s = 10
        configurations = false
        """))
    return p


def _cmd(plan: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "experiments.cli", "plan", str(plan), "--out", str(out), "--jobs", "1", "--no-analyses"]


def _run(plan: Path, out: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(_cmd(plan, out), capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return r


def _counts(err: str) -> tuple[int, int]:
    m = RAN.search(err)
    assert m, err
    return int(m.group(1)), int(m.group(2))


def test_a_killed_plan_resumes_to_the_same_answer_with_fewer_simulations(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    full = _run(plan, tmp_path / "full")
    ran_full, reused_full = _counts(full.stderr)
    assert reused_full == 0 and ran_full >= 6
    # progress with elapsed time and an ETA, on stderr (not stdout)
    assert re.search(r"search \(1 strategy x GPU\) \[#+ *\] 1/1 +\d+s elapsed, ~ *\d+s left", full.stderr)
    assert "elapsed" not in full.stdout

    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(plan, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list((out / "points").glob("run-*.json"))) < 3:
            assert proc.poll() is None, f"the plan ended (rc {proc.returncode}) before 3 runs were kept"
            assert time.monotonic() < deadline, "no 3 finished runs within 120 s"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "plan.csv").exists()
    kept = len(list((out / "points").glob("*.json")))
    assert 3 <= kept < ran_full

    (out / "points" / "run-deadbeef-1.json.tmp12345").write_text('{"summary": {"slo_met"')  # a torn write
    again = _run(plan, out)
    ran, reused = _counts(again.stderr)
    assert reused == kept and ran == ran_full - kept  # only what had not finished was simulated
    assert "resuming" in again.stderr
    assert not list((out / "points").glob("*.tmp*"))
    pd.testing.assert_frame_equal(pd.read_csv(out / "plan.csv"), pd.read_csv(tmp_path / "full" / "plan.csv"))
