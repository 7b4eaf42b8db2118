"""Every request counted (issue 39): a closed loop or a `num_requests` run measures all its
requests, a burst trace is measured over its drain, a trace run ends when its last request is
done, no numpy or pandas warning reaches the terminal, and the prefix-cache line keeps the
first admission's hits apart from the prefill redone after preemptions. As users type them:
`specrack run` with `--set`, warnings turned into errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.commands.run import cache_line
from sim.scenario import load_scenario
from sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE_SCENARIO = ROOT / "experiments" / "scenarios" / "traces" / "mooncake-prefix-cache.toml"
MOONCAKE = ROOT.parent / "shared" / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason="the Mooncake trace is not in ../shared/data/traces")

BASE = """name = "counts"
seed = 1
[rack]
gpu = "h100-sxm"
num_gpus = 4
[deployment]
model = "llama-3.1-70b"
tensor_parallel = 4
[workload]
prompt_tokens = { dist = "fixed", value = 512 }
output_tokens = { dist = "fixed", value = 256 }
"""

# every warning an error: a numpy RuntimeWarning or a pandas warning in the run fails the test
pytestmark = pytest.mark.filterwarnings("error")


def _trace(tmp_path: Path, times: list[float]) -> Path:
    p = tmp_path / "trace.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{t:g},512,256\n" for t in times))
    return p


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> tuple[str, dict]:
    sc = tmp_path / "counts.toml"
    sc.write_text(BASE)
    out = tmp_path / "out"
    args = ["run", str(sc), "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    text = capsys.readouterr()
    assert "Warning" not in text.err, text.err
    return text.out, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(("concurrency", "n"), [(1, 8), (4, 96)])
def test_closed_loop_measures_every_request(tmp_path, capsys, concurrency: int, n: int) -> None:
    """The last send was outside the window [warmup_s, last send): 7 of 8, 95 of 96."""
    out, s = _run(tmp_path, capsys, "workload.arrival=closed", f"workload.concurrency={concurrency}",
                  f"workload.num_requests={n}", "workload.warmup_s=0")
    assert out.startswith(f"counts seed 1: {n}/{n} requests, ")
    assert s["offered_requests"] == s["completed_requests"] == s["judged_requests"] == n
    assert s["window_start_s"] == 0.0 and s["window_end_s"] > 0


@pytest.mark.parametrize("gated", [False, True])
def test_num_requests_run_measures_every_request(tmp_path, capsys, gated: bool) -> None:
    """Open loop (and behind max_concurrency, where sends lag their arrivals): all 96."""
    extra = ("workload.max_concurrency=2",) if gated else ()
    out, s = _run(tmp_path, capsys, "workload.rate_rps=2", "workload.num_requests=96", "workload.warmup_s=0", *extra)
    assert "96/96 requests" in out
    assert s["offered_requests"] == 96 and s["offered_rate_rps"] == 2.0


def test_burst_trace_is_measured_over_its_drain(tmp_path, capsys) -> None:
    """Eight requests at t = 0 with the default 60 s warm-up: all eight measured, from 0 to the
    last completion, said in one line; no RuntimeWarning (empty slices, division by zero)."""
    trace = _trace(tmp_path, [0.0] * 8)
    out, s = _run(tmp_path, capsys, "workload.arrival=trace", f"workload.trace={trace}")
    assert "8/8 requests" in out and " 0.00 req/s" not in out
    assert "  a burst: all 8 requests sent at 0 s, measured over their drain [0, " in out
    assert "warmup_s = 60 does not apply" in out
    assert s["window_start_s"] == 0.0 and s["throughput_rps"] > 0
    assert s["window_end_s"] == pytest.approx(s["benchmark"]["duration"])  # the drain: last completion
    assert math.isinf(s["offered_rate_rps"])


def test_closed_loop_burst_is_measured_over_its_drain(tmp_path, capsys) -> None:
    """Eight clients, eight requests: every request is sent at t = 0 (a burst)."""
    out, s = _run(tmp_path, capsys, "workload.arrival=closed", "workload.concurrency=8", "workload.num_requests=8")
    assert "8/8 requests" in out and "a burst: all 8 requests sent at 0 s" in out
    assert s["window_end_s"] == pytest.approx(s["benchmark"]["duration"])


@pytest.mark.parametrize("duration", ["600", "1e9"])
def test_trace_run_ends_with_its_last_request(tmp_path, capsys, time_limit, duration: str) -> None:
    """Eight requests one second apart: the window ends at the last arrival (not duration_s), the
    run when the last request is done, and the offered rate is the trace's own (1 req/s)."""
    trace = _trace(tmp_path, [float(i) for i in range(8)])
    with time_limit(120):  # (1e9 ran for minutes and GBs of intervals)
        out, s = _run(tmp_path, capsys, "workload.arrival=trace", f"workload.trace={trace}", "workload.warmup_s=0",
                      f"workload.duration_s={duration}")
    assert "8/8 requests" in out and " 0.00 req/s offered" not in out
    assert 7.0 < s["window_end_s"] < 7.1  # the last arrival reaches the engine's queue after the frontend's ~50 ms
    assert s["offered_rate_rps"] == pytest.approx(1.0)
    assert s["horizon_s"] < 60


def test_trace_cut_by_duration_keeps_its_window(tmp_path, capsys) -> None:
    """A trace longer than duration_s: cut there, and its window ends at duration_s."""
    trace = _trace(tmp_path, [float(i) for i in range(8)])
    out, s = _run(tmp_path, capsys, "workload.arrival=trace", f"workload.trace={trace}", "workload.warmup_s=0",
                  "workload.duration_s=4.5")
    assert "5/5 requests" in out and s["window_end_s"] == 4.5


def test_warmup_holding_every_request_names_the_fix(tmp_path, capsys) -> None:
    trace = _trace(tmp_path, [float(i) for i in range(8)])
    out, s = _run(tmp_path, capsys, "workload.arrival=trace", f"workload.trace={trace}")
    assert "0/0 requests" in out and s["window_end_s"] < s["window_start_s"] == 60
    assert ("  no request measured: warmup_s = 60 s ends after the last arrival (7.0 s); lower it, e.g. "
            "--set workload.warmup_s=0") in out.splitlines()


def _cache_keys_add_up(s: dict, req) -> None:
    m = req[req.prefill_tokens > 0]
    assert s["prefill_tokens_saved"] == m.cached_tokens.sum()
    assert s["prefill_tokens_saved"] + s["prefill_tokens_cached_after_preemption"] == m.prefill_cached_tokens.sum()
    assert (m.prompt_tokens.sum() - s["prefill_tokens_saved"] + s["prefill_tokens_after_preemption"]
            - s["prefill_tokens_cached_after_preemption"]) == s["prefill_tokens_computed"]
    assert s["preempted_requests"] == (m.preemptions > 0).sum()


def test_cache_line_without_preemption(make_scenario) -> None:
    res = simulate(make_scenario(workload={"rate_rps": 2.0, "duration_s": 60.0,
                                           "conversations": {"turns": 4, "turn_gap_s": {"dist": "fixed", "value": 5.0}}}), 1)
    s = res.summary
    assert s["preemptions"] == s["preempted_requests"] == s["prefill_tokens_after_preemption"] == 0
    _cache_keys_add_up(s, res.requests)
    line = cache_line(s)
    assert "cached at first admission" in line and "preemption" not in line


@needs_mooncake
def test_overloaded_mooncake_replay_separates_recomputation() -> None:
    """One 8B replica under the Mooncake trace's first 30 s: overloaded, requests preempted again
    and again, each re-admission finding its own blocks. 'Saved' is the first admission's hits
    only; the prefill redone after preemptions is on its own, with the preemptions."""
    sc = load_scenario(MOONCAKE_SCENARIO, {"rack.num_gpus": 1, "workload.trace_end_s": 30, "workload.duration_s": 30,
                                           "workload.warmup_s": 0})
    res = simulate(sc, 1)
    s = res.summary
    assert s["preemptions"] > 100 and s["preempted_requests"] > 0
    _cache_keys_add_up(s, res.requests)
    # the re-admissions' hits dwarf the first admissions' (the figure that read as 'saved' before)
    assert s["prefill_tokens_cached_after_preemption"] > 10 * s["prefill_tokens_saved"]
    assert s["prefill_tokens_saved"] < s["cache_hit_rate"] * 1.01 * res.requests.prompt_tokens.sum()
    line = cache_line(s)
    assert f"{s['prefill_tokens_saved']:,} prefill tokens saved there" in line
    assert (f"{s['preemptions']:,} preemptions of {s['preempted_requests']:,} requests: "
            f"{s['prefill_tokens_after_preemption']:,} tokens prefilled again, "
            f"{s['prefill_tokens_cached_after_preemption']:,} of them from the cache") in line
