"""The `specrack` command line: the what-if cost calculator, run / validate / capacity on the
example scenario, overload, and one-line errors (exit 2, no traceback) for bad input. Some tests
go through the installed entry point in a subprocess, the user's real path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers import one_line_error

from experiments.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "experiments" / "scenarios"
EXAMPLE = SCENARIOS / "llama70b-h100x8.toml"
DRAFT_SCENARIO = SCENARIOS / "llama70b-draft1b.toml"
SHORT = ["--set", "workload.duration_s=60", "--set", "workload.warmup_s=10"]


def _entry_point() -> str:
    exe = Path(sys.executable).parent / "specrack"
    if exe.is_file():
        return str(exe)
    found = shutil.which("specrack")
    if found is None:  # pragma: no cover - the package is installed with `pip install -e .`
        pytest.skip("the specrack entry point is not installed")
    return found


def specrack(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_entry_point(), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)




@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_that_leaves_is_not_an_error(unbuffered: str, tmp_path: Path) -> None:
    """`specrack run ... | head`: the reader closes the pipe; the run ends as a shell tool ends on
    SIGPIPE (exit 141), with nothing on stderr, whether its output was flushed line by line or at exit."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    for cmd in ([_entry_point()], [sys.executable, "-m", "experiments.cli"]):
        p = subprocess.Popen([*cmd, "run", str(EXAMPLE), "--out", str(tmp_path), *SHORT], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # (before a line is read: every write finds the pipe closed)
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and err == "", (cmd, err)
        assert (tmp_path / "summary.json").is_file()  # (it ran)


# ----------------------------------------------------------------------------- cost


COST_KEYS = ("total_s", "compute_s", "memory_s", "comm_s", "overhead_s", "flops", "bytes", "kv_capacity_tokens",
             "max_num_seqs_at_context")


def test_cost_json_through_the_entry_point() -> None:
    """Llama-3.1-70B BF16 on 4x H100, batch 1 at context 2048, on the untuned TensorRT-LLM profile
    (the anchor's): one JSON object, ~31 ms a step."""
    p = specrack("cost", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--tp", "4", "--batch", "1",
                 "--context", "2048", "--engine", "trtllm-untuned", "--json")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    out = json.loads(p.stdout)  # the whole of stdout is one JSON object
    assert isinstance(out, dict)
    for k in COST_KEYS:
        assert isinstance(out[k], (int, float)) and out[k] >= 0, k
    assert out["total_s"] == pytest.approx(0.031, rel=0.25)
    # batch 1 decode streams the weights: memory dominates compute, and the parts bound the total
    assert out["memory_s"] > out["compute_s"]
    assert out["total_s"] >= max(out["memory_s"], out["compute_s"]) + out["comm_s"] + out["overhead_s"] - 1e-12
    assert out["comm_s"] > 0  # TP4 all-reduces
    assert out["kv_capacity_tokens"] > 100_000
    assert out["max_num_seqs_at_context"] >= 1
    assert out["tp"] == 4 and out["model"] == "llama-3.1-70b" and out["gpu"] == "h100-sxm"


def test_cost_scales_and_prices_a_draft(capsys: pytest.CaptureFixture[str]) -> None:
    def cost(*args: str) -> dict:
        assert main(["cost", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    one, big = cost("--batch", "1"), cost("--batch", "64")
    assert big["total_s"] > one["total_s"]
    assert big["tokens_per_s"] > 10 * one["tokens_per_s"]
    assert big["max_num_seqs_at_context"] == one["max_num_seqs_at_context"]
    fp8 = cost("--weights", "fp8", "--kv-cache", "fp8")
    assert fp8["total_s"] < one["total_s"] and fp8["kv_capacity_tokens"] > one["kv_capacity_tokens"]
    d = cost("--draft", "llama-3.2-1b")
    assert 0 < d["draft_cost_ratio"] < 0.5 and d["draft_pass_s"] > 0


def test_cost_human_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--batch", "8", "--context", "1024", "--draft", "llama-3.2-1b"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-70b on 4x h100-sxm" in out
    for word in ("step time", "compute", "memory", "comm", "overhead", "KV pool", "cost ratio c ="):
        assert word in out, word


# ----------------------------------------------------------------------------- bad input


BAD_INPUT = [
    (["cost", "--gpu", "h10-sxm"], ["unknown gpu 'h10-sxm'", "did you mean 'h100-sxm'"]),
    (["cost", "--model", "llama-3.1-70", "--tp", "4"], ["unknown model 'llama-3.1-70'", "did you mean 'llama-3.1-70"]),
    (["cost", "--weights", "fp9"], ["unknown weights format", "did you mean 'fp8'"]),
    (["cost", "--tp", "3"], ["tensor_parallel=3", "64 attention heads", "[1, 2, 4, 8, 16]"]),
    (["cost", "--tp", "0"], ["tensor_parallel"]),
    (["cost", "--batch", "0"], ["--batch must be >= 1"]),
    (["cost", "--context", "-5"], ["--context must be >= 0"]),
    (["cost", "--new-tokens", "0"], ["--new-tokens must be >= 1"]),
    (["cost", "--draft", "qwen2.5-0.5b"], ["--draft qwen2.5-0.5b", "tokenizer"]),
    (["cost", "--model", "llama-3.1-405b", "--tp", "1"], ["does not fit", "short by"]),
    (["validate", "/nonexistent/scenario.toml"], ["scenario file not found"]),
    (["validate", str(EXAMPLE), "--set", "workload.bogus=1"], ["workload.bogus", "unknown field"]),
    (["validate", str(EXAMPLE), "--set", "bogus"], ["--set 'bogus'", "key=value"]),
    (["validate", str(EXAMPLE), "--set", "rack.gpu=h100"], ["did you mean 'h100-sxm'"]),
    (["validate", str(EXAMPLE), "--set", "deployment.tensor_parallel=3"], ["tensor_parallel=3"]),
    (["run", str(EXAMPLE), "--set", "workload.utilisation=-1"], ["workload.utilisation", "greater than 0"]),
    (["capacity", str(DRAFT_SCENARIO), "--set", "speculative.draft_model=qwen2.5-1.5b"], ["tokenizer"]),
    (["capacity", str(EXAMPLE), "--set", "workload.utilisation.x=1"], ["not a table"]),
]


@pytest.mark.parametrize(("argv", "needles"), BAD_INPUT, ids=[" ".join(a[:1] + a[-1:]) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2(argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    cap = capsys.readouterr()
    line = one_line_error(cap.err)
    for n in needles:
        assert n in line, (n, line)
    assert cap.out == ""


@pytest.mark.parametrize("text", ["name = \n", "[rack]\ngpu = \"h100-sxm\"\ncolour = 1\n",
                                  "[workload]\nutilisation = 0.5\nduration_s = 10\nwarmup_s = 20\n"],
                         ids=["invalid-toml", "unknown-field", "warmup-too-long"])
def test_bad_scenario_file(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    for cmd in ("validate", "run", "capacity"):
        assert main([cmd, str(path)]) == 2
        line = one_line_error(capsys.readouterr().err)
        assert "bad.toml" in line


def test_bad_input_through_the_entry_point(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[deployment]\nmodel = \"llama-3.1-70b\"\ntensor_parallel = 3\n")
    for args in (["cost", "--gpu", "h100"], ["cost", "--draft", "qwen2.5-0.5b"], ["validate", str(bad)],
                 ["run", str(EXAMPLE), "--set", "workload.nope=1"]):
        p = specrack(*args)
        assert p.returncode == 2, (args, p.stderr)
        one_line_error(p.stderr)
        assert p.stdout == ""


def test_argparse_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["cost", "--batch", "x"], ["nosuchcommand"], ["run"]):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- run, validate, capacity


def test_run_writes_tables_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = specrack("run", str(EXAMPLE), "--out", str(out), *SHORT)
    assert p.returncode == 0, p.stderr
    assert "requests" in p.stdout and str(out) in p.stdout  # 60 s is too short to judge stability: verdict named
    for name in ("requests.parquet", "steps.parquet", "summary.json"):
        assert (out / name).is_file(), name
    s = json.loads((out / "summary.json").read_text())
    for lat in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(s[lat]) >= {"mean", "p50", "p90", "p99"}, lat
        assert 0 < s[lat]["p50"] <= s[lat]["p90"] <= s[lat]["p99"], lat
    assert s["scenario"]["name"] == "llama70b-h100x8"
    assert s["scenario"]["workload"]["duration_s"] == 60
    assert s["seed"] == 1
    assert s["versions"]["specrack"] and s["versions"]["python"]
    assert s["verdict"] in ("stable", "insufficient") and s["backlog"] == 0
    req = pd.read_parquet(out / "requests.parquet")
    steps = pd.read_parquet(out / "steps.parquet")
    assert {"arrival_s", "first_token_s", "completion_s", "output_tokens", "generated_tokens"} <= set(req.columns)
    assert {"start_s", "duration_s", "batch_size", "emitted_tokens", "target_s", "draft_s"} <= set(steps.columns)
    assert int(steps.emitted_tokens.sum()) == int(req.generated_tokens.sum())


def test_run_seed_flag_changes_the_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", str(EXAMPLE), "--out", str(a), "--seed", "7", *SHORT]) == 0
    assert main(["run", str(EXAMPLE), "--out", str(b), "--seed", "8", *SHORT]) == 0
    capsys.readouterr()
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert (sa["seed"], sb["seed"]) == (7, 8)
    assert sa["ttft_s"] != sb["ttft_s"]


def test_validate_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{EXAMPLE}: ok") and "2 replica(s)" in out


def test_capacity_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", str(EXAMPLE), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["scenario"] == "llama70b-h100x8"
    assert c["capacity_rps"] > 0 and c["capacity_tok_s"] > c["capacity_rps"]
    assert "speculative_capacity_rps" not in c
    assert main(["capacity", str(DRAFT_SCENARIO), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # utilisation is anchored to the deployment with speculation off: the same capacity as the example
    assert d["capacity_rps"] == pytest.approx(c["capacity_rps"], rel=1e-12)
    assert 0 < d["speculative_capacity_rps"] < d["capacity_rps"]
    assert main(["capacity", str(DRAFT_SCENARIO)]) == 0
    assert "with speculation" in capsys.readouterr().out


def test_overload_via_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "over"
    rc = main(["run", str(EXAMPLE), "--out", str(out), "--set", "workload.utilisation=1.6",
               "--set", "workload.duration_s=60", "--set", "workload.warmup_s=10"])
    assert rc == 0
    assert "OVERLOADED" in capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    assert s["stable"] is False
    # the queue grew over the window; the default drain (duration_s) then works most of it off
    assert s["queue_growth_rps"] > 0
    assert s["queue_s"]["p99"] > 1.0  # seconds of queueing, against ~0.1 s at moderate load
    assert s["throughput_rps"] < s["offered_rps"]
    # with a short drain the backlog is still there when the run ends
    short = tmp_path / "short"
    assert main(["run", str(EXAMPLE), "--out", str(short), "--set", "workload.utilisation=1.6",
                 "--set", "workload.duration_s=60", "--set", "workload.warmup_s=10", "--set", "sim.drain_s=5"]) == 0
    s = json.loads((short / "summary.json").read_text())
    assert s["stable"] is False and s["backlog"] > 0


def test_run_stopped_on_a_certain_slo_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`[sim] stop_on_slo_fail` on a run that misses a 50 ms p99 TTFT: it stops, says so on the
    terminal and in summary.json (figures over the window up to the stop), and exits 0."""
    out = tmp_path / "stopped"
    args = ["run", str(EXAMPLE), "--out", str(out), "--set", "slo.ttft_p99_s=0.05", "--set", "sim.stop_on_slo_fail=true",
            "--set", "workload.duration_s=300"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "STOPPED: SLO CERTAIN TO FAIL" in text and "ttft_p99_s" in text
    s = json.loads((out / "summary.json").read_text())
    early = s["stopped_early"]
    assert s["verdict"] == "unjudged" and not s["slo_met"] and early["over"] >= early["needed"]
    assert s["window_end_s"] == early["at_s"] < 300 and s["throughput_rps"] > 0
    assert s["offered_rps"] == pytest.approx(s["offered_rate_rps"], rel=0.4)  # (a rate over the part simulated)
