"""Hostile input (issue 10, item 7): every input a user can feed (TOML, --set, CLI flags, trace
files, sweep files) gives either correct behaviour or one line on stderr with exit 2 -- never a
traceback, never a silently accepted typo or impossible value. Each case is one the issue's filer
reproduced, or one of the same kind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import one_line_error

from experiments.cli import main
from models.errors import ConfigError
from sim.deployment import build_runtime, check_fits
from sim.scenario import load_scenario, scenario_from_dict
from sim.workload import generate
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "experiments" / "scenarios"
EXAMPLE = SCENARIOS / "llama70b-h100x8.toml"
DRAFT = SCENARIOS / "llama70b-draft1b.toml"
SHORT = ["--set", "workload.duration_s=30", "--set", "workload.warmup_s=5"]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str], ignore: Any = None) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, err


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str, ignore: Any = None) -> str:
    rc, err = _cli(argv, capsys)
    assert rc == 2, err
    line = one_line_error(err, ignore)
    for n in needles:
        assert n in line, line
    return line


# ----------------------------------------------------------------------------- scenario values

BAD_SETS = [
    (["workload.rate_rps=1e12"], ["rate_rps", "10,000,000"]),
    (["workload.rate_rps=20000", "workload.duration_s=1e6"], ["rate_rps", "duration_s"]),
    (["workload.duration_s=inf"], ["workload.duration_s", "finite"]),
    (["workload.utilisation=nan"], ["workload.utilisation", "finite"]),
    (["workload.warmup_s=-inf"], ["workload.warmup_s"]),
    (["rack.usd_per_gpu_hour=inf"], ["rack.usd_per_gpu_hour", "finite"]),
    (["sim.drain_s=nan"], ["sim.drain_s"]),
    (["deployment.efficiency={mfu_max=0.0}"], ["mfu_max", "(0, 1]"]),
    (["deployment.efficiency={bw_eff=0.0}"], ["bw_eff", "(0, 1]"]),
    (["deployment.efficiency={comm_eff=1.5}"], ["comm_eff", "(0, 1]"]),
    (["deployment.efficiency={mfu_max_quant=-0.1}"], ["mfu_max_quant"]),
    (["deployment.efficiency={step_overhead_s=-1.0}"], ["step_overhead_s", ">= 0"]),
    (["deployment.efficiency={bw_eff=true}"], ["bw_eff"]),
    (["deployment.efficiency={bw_eff=inf}"], ["bw_eff"]),
    (["seed=-3"], ["seed", "non-negative integer"]),
    (["seed=1.5"], ["seed", "non-negative integer"]),
    (["seed=true"], ["seed", "non-negative integer"]),
    (["workload.utilisation=true"], ["workload.utilisation", "number"]),
    (["workload.rate_rps=false"], ["workload.rate_rps"]),
    (["workload.utilisation='0.5'"], ["workload.utilisation"]),
    (["deployment.tensor_parallel=true"], ["deployment.tensor_parallel", "integer"]),
    (["deployment.tensor_parallel=4.0"], ["deployment.tensor_parallel", "integer"]),
    (["rack.num_gpus=true"], ["rack.num_gpus"]),
    (["deployment.max_num_seqs=1e12"], ["deployment.max_num_seqs"]),
    (["deployment.max_num_seqs=100000000"], ["deployment.max_num_seqs"]),
    (["rack.num_gpus=1000000"], ["rack.num_gpus"]),
    (["workload.num_requests=1000000000"], ["workload.num_requests"]),
    (["workload.cv=1e9", "workload.arrival='gamma'"], ["workload.cv"]),
    (["workload.classes=[]"], ["workload.classes"]),
    (["name=8"], ["name", "string"]),
    (["rack.num_gpus=10"], ["rack.num_gpus=10", "2 GPU(s) would sit idle", "8 or 12", "allow_idle_gpus"]),
    (["rack.num_gpus=6"], ["num_gpus = 4 or 8"]),
    (['workload.prompt_tokens={dist="fixed", value=600000}'], ["prompt_tokens 600000", "max_model_len", "KV cache"]),
    (['workload.prompt_tokens={dist="lognormal", median=300000, p90=400000, max=1000000}'],
     ["median prompt_tokens", "max_model_len"]),
    (['workload.classes=[{name="a", share=1.0, acceptance=0.9, acceptance_spread=0.4}]'],
     ["acceptance_spread=0.4", "acceptance 0.9", "0.3"]),
    (['workload.classes=[{name="a", share=1.0, acceptance=0.0, acceptance_spread=0.1}]'], ["acceptance_spread"]),
    (['workload.classes=[{name="a", share=true}]'], ["share"]),
    (['workload.classes=[{name="a", share=1.0, tail=1}]'], ["tail"]),
]


@pytest.mark.parametrize(("sets", "needles"), BAD_SETS, ids=[" ".join(s) for s, _ in BAD_SETS])
def test_bad_values_are_one_line_errors(sets: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["validate", str(EXAMPLE)]
    for s in sets:
        argv += ["--set", s]
    _fails(argv, capsys, *needles)


def test_seed_flag_negative(capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["validate", str(EXAMPLE), "--seed", "-1"], capsys, "seed", "non-negative integer")
    _fails(["run", str(EXAMPLE), "--seed", "-1", *SHORT], capsys, "seed", "non-negative integer")


def test_seed_negative_through_the_python_api() -> None:
    sc = load_scenario(EXAMPLE, {"workload.duration_s": 10, "workload.warmup_s": 1, "workload.rate_rps": 1.0})
    with pytest.raises(ConfigError, match="non-negative integer"):
        simulate(sc, -1)


def test_good_neighbours_still_validate(capsys: pytest.CaptureFixture[str]) -> None:
    """The nearest valid values are accepted: integers for floats, idle GPUs when allowed, a spread
    just inside the limit, efficiency factors at 1."""
    for sets in (["workload.utilisation=1"], ["rack.num_gpus=10", "rack.allow_idle_gpus=true"],
                 ['workload.classes=[{name="a", share=1.0, acceptance=0.9, acceptance_spread=0.29}]'],
                 ["deployment.efficiency={bw_eff=1, mfu_half_tokens=0}"], ["seed=0"]):
        argv = ["validate", str(EXAMPLE)]
        for s in sets:
            argv += ["--set", s]
        assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "ok" in out


def test_idle_gpus_are_allowed_only_when_asked() -> None:
    sc = load_scenario(EXAMPLE, {"rack.num_gpus": 10, "rack.allow_idle_gpus": True})
    rt = build_runtime(sc)
    assert rt.num_replicas == 2 and rt.gpus_per_replica == 4


# ----------------------------------------------------------------------------- speculation


def test_dedicated_draft_runs_at_its_own_tp() -> None:
    """A dedicated draft on 2 GPUs runs tensor-parallel over both (it never falls back to TP1
    while its GPUs stay reserved); a draft_gpus that cannot split the draft is an error."""
    sc = load_scenario(DRAFT, {"rack.num_gpus": 12, "speculative.placement": "dedicated", "speculative.draft_gpus": 2})
    rt = build_runtime(sc)
    assert rt.spec is not None and rt.spec.draft_cost is not None
    assert rt.spec.draft_cost.tp == 2
    assert rt.gpus_per_replica == 6 and rt.num_replicas == 2
    with pytest.raises(ConfigError, match="draft_gpus"):
        load_scenario(DRAFT, {"rack.num_gpus": 7, "speculative.placement": "dedicated", "speculative.draft_gpus": 3})
    with pytest.raises(ConfigError, match="only applies with placement = 'dedicated'"):
        load_scenario(DRAFT, {"speculative.draft_gpus": 2})


def test_eagle_without_eagle_acceptance_fails_validation(capsys: pytest.CaptureFixture[str]) -> None:
    """`validate` runs the same check as `run`: a class without an acceptance for the method."""
    classes = '[{name="a", share=1.0, acceptance={draft_model=0.7}}]'
    line = _fails(["validate", str(EXAMPLE), "--set", f"workload.classes={classes}", "--set",
                   'speculative={method="eagle", num_speculative_tokens=3}'], capsys, "eagle", "'a'")
    assert "acceptance" in line


def test_impossible_spread_names_the_maximum() -> None:
    with pytest.raises(ConfigError, match=r"acceptance_spread < 0\.4"):
        scenario_from_dict({"workload": {"rate_rps": 1.0, "classes": [
            {"name": "a", "share": 1.0, "acceptance": {"draft_model": 0.8, "eagle": 0.5}, "acceptance_spread": 0.45}]}})


# ----------------------------------------------------------------------------- lengths vs KV


def test_prompts_too_long_for_the_kv_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every request longer than the KV cache: one line at validation for run, validate and
    capacity (not an IndexError, nor a message blaming the rate, nor capacity `nan`)."""
    long = ["--set", 'workload.prompt_tokens={dist="fixed", value=600000}']
    for cmd in (["validate"], ["capacity"], ["run", "--out", str(tmp_path / "r")]):
        _fails([cmd[0], str(EXAMPLE), *cmd[1:], *long], capsys, "max_model_len", "600000")
    # a trace whose every request is too long
    trace = tmp_path / "long.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,700000,10\n1,800000,10\n")
    _fails(["validate", str(EXAMPLE), "--set", "workload.arrival='trace'", "--set", f"workload.trace='{trace}'"],
           capsys, "every request", "700010", "max_model_len")


def test_check_fits_at_run_time() -> None:
    sc = load_scenario(EXAMPLE)
    rt = build_runtime(sc)
    check_fits(sc, rt, np.array([10, 10**6]), np.array([10, 10]))  # some fit: fine (the rest are rejected)
    with pytest.raises(ConfigError, match="every request is longer"):
        check_fits(sc, rt, np.array([10**6, 10**6]), np.array([10, 10]))


def test_huge_rate_from_utilisation_is_refused() -> None:
    sc = load_scenario(EXAMPLE, {"workload.duration_s": 600})
    with pytest.raises(ConfigError, match="10,000,000"):
        generate(sc.workload, 1, 1e9).to_pandas()


# ----------------------------------------------------------------------------- traces


def test_garbage_trace_fails_validation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("hello,world\n1,2\n")
    _fails(["validate", str(EXAMPLE), "--set", "workload.arrival='trace'", "--set", f"workload.trace='{trace}'"],
           capsys, "workload.trace", "trace format")
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,ten,5\n")
    _fails(["validate", str(EXAMPLE), "--set", "workload.arrival='trace'", "--set", f"workload.trace='{trace}'"],
           capsys, "workload.trace", "line 3", "prompt_tokens=ten")


def test_mooncake_bad_field_reports_its_own_line(tmp_path: Path) -> None:
    """A float token count on line 3 is reported on line 3 (it used to turn the whole column into
    floats and blame line 1)."""
    from sim.traces import load_trace

    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                     '{"timestamp": 5, "input_length": 12, "output_length": 5}\n'
                     '{"timestamp": 9, "input_length": 10.5, "output_length": 5}\n')
    with pytest.raises(ConfigError, match=r"line 3: input_length=10\.5"):
        load_trace(trace)
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                     '{"timestamp": 5, "input_length": 12, "output_length": true}\n')
    with pytest.raises(ConfigError, match="line 2: output_length"):
        load_trace(trace)


def test_point_key_hashes_trace_contents(tmp_path: Path) -> None:
    """An edited trace (same path) gives a new point key, so a resumed sweep never reuses stale points."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,200,20\n2,100,10\n")
    over = {"workload.arrival": "trace", "workload.trace": str(trace), "workload.rate_rps": None}
    k1 = load_scenario(EXAMPLE, over).key()
    assert load_scenario(EXAMPLE, over).key() == k1
    time.sleep(0.01)
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,200,20\n2,300,10\n")
    os.utime(trace, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert load_scenario(EXAMPLE, over).key() != k1


def test_bad_efficiency_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for text, needle in (('{"bw_eff": 0}', "bw_eff"), ('[1, 2]', "JSON object"), ('{"bw_eff": "x"}', "bw_eff"),
                         ('{"mfu_max": NaN}', "mfu_max")):
        f = tmp_path / "eff.json"
        f.write_text(text)
        _fails(["validate", str(EXAMPLE), "--set", f"deployment.efficiency_file='{f}'"], capsys, needle)


# ----------------------------------------------------------------------------- run / CLI


def test_out_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    _fails(["run", str(EXAMPLE), *SHORT, "--out", str(f)], capsys, "--out", "not a folder")


def test_unexpected_exception_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The last resort: an unforeseen exception is one line (exit 1), not a traceback."""
    import experiments.commands.common as common

    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(common, "load_scenario", boom)  # (the CLI reads scenarios through it)
    rc, err = _cli(["validate", str(EXAMPLE)], capsys)
    assert rc == 1
    assert err.strip() == err.strip().splitlines()[0]
    assert err.startswith("specrack: internal error: RuntimeError: boom") and "Traceback" not in err


# ----------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize("over", [{"workload.num_requests": 1, "workload.rate_rps": 1.0},
                                  {"workload.duration_s": 10, "workload.warmup_s": 9.99, "workload.rate_rps": 0.05}],
                         ids=["one-request", "all-in-warmup"])
def test_runs_that_measure_nothing_are_insufficient(over: dict[str, Any]) -> None:
    sc = load_scenario(EXAMPLE, over)
    s = simulate(sc, seed=3).summary
    assert s["verdict"] == "insufficient"
    assert s["stable"] is False


# ----------------------------------------------------------------------------- sweeps


def _sweep_file(tmp_path: Path, body: str, head: str | None = None) -> Path:
    head = head if head is not None else (
        'utilisation = [0.5]\nseeds = [1]\n'
        'set = { "workload.duration_s" = 20, "workload.warmup_s" = 2, "deployment.max_num_seqs" = 16 }\n')
    f = tmp_path / "sweep.toml"
    f.write_text(f'name = "tiny"\nbase = "{EXAMPLE}"\n{head}{body}')
    return f


BASELINE = '[[variants]]\nname = "baseline"\n'
BAD_SWEEPS = [
    ("", "variants = []\n", ["variants", "non-empty list"]),
    ("", '[[variants]]\nname = "fp8"\nset = "fp8"\n', ["set", "table"]),
    ("", '[[variants]]\nname = 8\n', ["name", "string"]),
    ("", 'variants = "baseline"\n', ["variants"]),
    ('utilisation = [0.5, 0.5]\n', BASELINE, ["utilisation", "more than once"]),
    ('utilisation = [0.5]\nseeds = [1, 1]\n', BASELINE, ["seeds", "more than once"]),
    ('utilisation = [true]\n', BASELINE, ["utilisation"]),
    ('utilisation = 0.5\n', BASELINE, ["utilisation", "list"]),
    ('utilisation = [inf]\n', BASELINE, ["utilisation"]),
    ('utilisation = [1e9]\n', BASELINE, ["utilisation"]),
    ('utilisation = [0.5]\nseeds = [-1]\n', BASELINE, ["seeds", "non-negative"]),
    ('utilisation = [0.5]\nseeds = [true]\n', BASELINE, ["seeds"]),
    ('utilisation = [0.5]\nset = "x"\n', BASELINE, ["set", "table"]),
    ('utilisation = [0.5]\nreference = 3\n', BASELINE, ["reference"]),
    ('utilisation = [0.5]\n[quick]\nutilsation = [0.3]\n', BASELINE, ["quick", "utilsation"]),
    ("", '[[variants]]\nname = "v"\nset = { "workload.utilisation" = 0.9 }\n', ["workload.utilisation", "ignored"]),
    ('utilisation = [0.5]\nset = { workload = { rate_rps = 3.0 } }\n', BASELINE, ["workload.rate_rps", "ignored"]),
    ("", '[[variants]]\nname = "v"\nset = { "deployment.modle" = "x" }\n', ["variant 'v'", "modle"]),
    ("", '[[variants]]\nname = "v"\nextra = 1\n', ["extra"]),
]


@pytest.mark.parametrize(("head", "body", "needles"), BAD_SWEEPS, ids=[f"{h}{b}".replace("\n", " ") for h, b, _ in BAD_SWEEPS])
def test_bad_sweep_files(head: str, body: str, needles: list[str], tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    f = _sweep_file(tmp_path, body, head or None)
    _fails(["sweep", str(f), "--out", str(tmp_path / "out")], capsys, *needles, ignore=None)


@pytest.mark.parametrize("jobs", ["-1", "0"])
def test_sweep_jobs_must_be_positive(jobs: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _sweep_file(tmp_path, BASELINE)
    _fails(["sweep", str(f), "--jobs", jobs, "--out", str(tmp_path / "out")], capsys, "--jobs")


def test_sweep_out_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _sweep_file(tmp_path, BASELINE)
    (tmp_path / "file").write_text("x")
    _fails(["sweep", str(f), "--out", str(tmp_path / "file")], capsys, "not a folder")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "points").write_text("x")
    _fails(["sweep", str(f), "--out", str(tmp_path / "out")], capsys, "points", "not a folder")


def test_sweep_where_every_point_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import experiments.sweep as sweep

    def fail(*a: Any, **k: Any) -> Any:
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(sweep, "simulate", fail)
    f = _sweep_file(tmp_path, BASELINE)
    rc, err = _cli(["sweep", str(f), "--executor", "serial", "--out", str(tmp_path / "out")], capsys)
    assert rc == 2, err
    assert "Traceback" not in err
    assert "point failed" in err  # each failure reported first
    last = err.strip().splitlines()[-1]
    assert last.startswith("specrack: error: every point of the sweep failed (1 of 1") and "engine exploded" in last


def test_incomplete_point_file_is_recomputed(tmp_path: Path) -> None:
    from experiments.sweep import _read_point

    p = tmp_path / "abc-1.json"
    p.write_text(json.dumps({"point_key": "abc-1"}))
    assert _read_point(p) is None
    p.write_text('{"point_key": "abc-1", "error": ""')  # truncated
    assert _read_point(p) is None


def test_resume_ignores_incomplete_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A finished sweep's point file cut down to valid-but-incomplete JSON is recomputed on resume."""
    f = _sweep_file(tmp_path, BASELINE)
    out = tmp_path / "out"
    assert main(["sweep", str(f), "--executor", "serial", "--out", str(out)]) == 0
    (pt,) = (out / "points").glob("*.json")
    full = json.loads(pt.read_text())
    pt.write_text(json.dumps({"point_key": full["point_key"], "variant": "baseline"}))
    assert main(["sweep", str(f), "--executor", "serial", "--out", str(out)]) == 0
    assert "1/1" in capsys.readouterr().err  # recomputed
    assert json.loads(pt.read_text()).keys() == full.keys()


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_sweep_leaves_no_workers(tmp_path: Path) -> None:
    """SIGKILL the sweep's main process while its pool runs: every worker ends within seconds."""
    f = _sweep_file(tmp_path, BASELINE + '[[variants]]\nname = "b2"\nset = { "deployment.max_num_seqs" = 15 }\n',
                    'utilisation = [0.5, 0.6]\nseeds = [1, 2]\n'
                    'set = { "workload.duration_s" = 600, "workload.warmup_s" = 2, "deployment.max_num_seqs" = 16 }\n')
    exe = Path(sys.executable).parent / "specrack"
    proc = subprocess.Popen([str(exe), "sweep", str(f), "--jobs", "2", "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids: list[int] = []
    try:
        deadline = time.time() + 90
        while time.time() < deadline and len(kids) < 2:
            time.sleep(0.2)
            kids = _children(proc.pid)
            assert proc.poll() is None, "the sweep ended before its workers started"
        assert kids, "no worker process appeared"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.1)
        left = [k for k in kids if _alive(k)]
        assert not left, f"workers survived their parent: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:  # only this test's own workers, should any have survived
            if _alive(k):
                os.kill(k, signal.SIGKILL)


@pytest.mark.parametrize(("name", "data", "needles"), [
    ("bad.csv", b"arrival_s,prompt_tokens,output_tokens\n0,10,5\n\xff\xfe,1,1\n", ["line 3", "UTF-8"]),
    ("bad.jsonl", b'{"timestamp": 0, "input_length": 10, "output_length": 5}\n\xff\n', ["line 2", "UTF-8"]),
    ("one.csv", b"arrival_s,prompt_tokens,output_tokens\n0,10,5\n", ["workload.rate_rps", "zero time"]),
])
def test_undecodable_or_unscalable_traces(name: str, data: bytes, needles: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / name
    trace.write_bytes(data)
    _fails(["validate", str(EXAMPLE), "--set", "workload.arrival='trace'", "--set", f"workload.trace='{trace}'",
            "--set", "workload.rate_rps=2"], capsys, *needles)
