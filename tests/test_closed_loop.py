"""Closed-loop workloads (`arrival = "closed"`, `concurrency`, `think_time_s`) and open-loop
arrivals behind a cap (`max_concurrency`), scenario to summary: the operational laws over seeds,
trace and every length distribution, the gate, the benchmark block, hostile inputs through the
CLI, and the bundled concurrency sweep."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import one_line_error

import sim.simulate as simulate_mod
from experiments.cli import main
from sim.metrics import bench_metrics, in_system
from sim.workload import STREAMS, generate, streams
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
CONC_SWEEP = ROOT / "experiments" / "sweeps" / "concurrency.toml"
LENGTHS = {"prompt_tokens": {"dist": "fixed", "value": 256},
           "output_tokens": {"dist": "lognormal", "median": 64, "p90": 200}}


def _closed(make_scenario, **wl):
    return make_scenario(workload={"arrival": "closed", "rate_rps": None, "warmup_s": 20.0, **LENGTHS, **wl})


def _window_laws(res) -> tuple[float, float]:
    """(throughput X, mean response time R) over the summary's measured window."""
    s = res.summary
    return s["throughput_rps"], s["e2e_s"]["mean"]


def test_zero_think_time_holds_exactly_n_in_system_littles_law(make_scenario) -> None:
    """N clients, no think time: exactly N requests in system from the first send to the last,
    and Little's law N = X R over the measured window, within 4% per seed and 2% pooled over 5 seeds."""
    n = 16
    ratios = []
    for seed in range(5):
        res = simulate(_closed(make_scenario, concurrency=n, num_requests=2000), seed)
        req = res.requests
        assert req.completion_s.notna().all() and res.summary["verdict"] == "stable"
        last_send = float(req.arrival_s.max())
        ts = np.linspace(1e-6, last_send - 1e-6, 200)
        assert (in_system(req, ts) == n).all()
        x, r = _window_laws(res)
        ratios.append(x * r / n)
        assert x * r == pytest.approx(n, rel=0.04), (seed, x, r)
    assert np.mean(ratios) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("think", [{"dist": "exponential", "mean": 2.0}, {"dist": "fixed", "value": 1.0}])
def test_think_time_obeys_the_response_time_law(make_scenario, think) -> None:
    """Interactive response-time law X = N / (R + Z), Z the think time's mean: within 6% per seed
    and 3% pooled over 3 seeds; fewer than N requests are in system on average."""
    n, z = 16, think.get("mean", think.get("value"))
    ratios = []
    for seed in range(3):
        res = simulate(_closed(make_scenario, concurrency=n, duration_s=240.0, think_time_s=think), seed)
        x, r = _window_laws(res)
        ratios.append(x * (r + z) / n)
        assert x == pytest.approx(n / (r + z), rel=0.06), (seed, x, r)
        assert res.summary["in_system_mean"] < n
    assert np.mean(ratios) == pytest.approx(1.0, abs=0.03)


def test_think_times_have_their_own_stream_and_leave_the_others_alone(make_scenario) -> None:
    """Streams are appended ('think' after the first six, then 'verify'): every earlier stream keeps
    the value it had with six streams, and a closed loop with think times shares its lengths and
    classes with one without."""
    assert STREAMS[6:] == ("think", "verify") and STREAMS[:6] == ("arrivals", "prompt", "output", "classes",
                                                                 "acceptance", "engine")
    old = [np.random.default_rng(c).random() for c in np.random.SeedSequence(7).spawn(7)]
    assert [streams(7)[name].random() for name in STREAMS[:7]] == old
    plain = generate(_closed(make_scenario, concurrency=4, num_requests=300).workload, 3, None).to_pandas()
    thinking = generate(_closed(make_scenario, concurrency=4, num_requests=300,
                                think_time_s={"dist": "exponential", "mean": 2.0}).workload, 3, None).to_pandas()
    pd.testing.assert_frame_equal(plain, thinking.drop(columns="think_s"))
    assert plain.arrival_s.isna().all()  # nothing arrives before the run: the clients send
    assert thinking.think_s.mean() == pytest.approx(2.0, rel=0.15)


def _azure(path: Path, n: int = 300) -> Path:
    rng = np.random.default_rng(5)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):  # one request every 7 s: a timing the closed loop must ignore
        t = i * 7.0
        lines.append(f"2023-11-16 {18 + int(t // 3600):02d}:{int(t % 3600 // 60):02d}:{t % 60:010.7f},"
                     f"{rng.integers(50, 800)},{rng.integers(5, 200)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_closed_loop_over_a_trace_sends_its_lengths_in_order_ignoring_its_timing(make_scenario, tmp_path) -> None:
    trace = _azure(tmp_path / "t.csv")
    from sim.traces import load_trace

    full = load_trace(str(trace))
    sc = _closed(make_scenario, concurrency=8, num_requests=200, trace=str(trace))
    res = simulate(sc, 1)
    req = res.requests.sort_values("id")
    assert req.prompt_tokens.tolist() == full.prompt_tokens.iloc[:200].tolist()
    assert req.output_tokens.tolist() == full.output_tokens.iloc[:200].tolist()
    sends = np.sort(req.arrival_s.to_numpy())
    assert (sends[:8] == 0.0).all() and sends[-1] < 7.0 * 199  # sent as clients free up, not every 7 s
    # a trace shorter than a duration-sized run sends each request once; the window ends as the last
    # send reaches the engine (after the frontend's latency), included
    short_sc = _closed(make_scenario, concurrency=8, duration_s=3000.0, trace=str(trace))
    short = simulate(short_sc, 1)
    frontend = simulate_mod.build_runtime(short_sc).cost.eff.frontend_s
    assert len(short.requests) == 300 and frontend > 0
    assert short.summary["window_end_s"] == np.nextafter(short.requests.arrival_s.max() + frontend, np.inf)


@pytest.mark.parametrize("kind", ["fixed", "lognormal", "empirical"])
def test_closed_loop_with_every_length_distribution(make_scenario, tmp_path, kind) -> None:
    trace = _azure(tmp_path / "lengths.csv")
    dist = {"fixed": {"dist": "fixed", "value": 300},
            "lognormal": {"dist": "lognormal", "median": 300, "p90": 900},
            "empirical": {"dist": "empirical", "trace": str(trace)}}[kind]
    sc = make_scenario(workload={"arrival": "closed", "rate_rps": None, "concurrency": 8, "num_requests": 150,
                                 "warmup_s": 5.0, "prompt_tokens": dist, "output_tokens": {"dist": "fixed", "value": 32}})
    res = simulate(sc, 2)
    req = res.requests
    assert len(req) == 150 and req.completion_s.notna().all() and (req.generated_tokens == 32).all()
    if kind == "fixed":
        assert (req.prompt_tokens == 300).all()
    elif kind == "empirical":
        from sim.traces import empirical_lengths

        assert set(req.prompt_tokens) <= set(empirical_lengths(str(trace), "prompt_tokens", "auto").tolist())
    else:
        assert req.prompt_tokens.nunique() > 50
    assert res.summary["loop"] == "closed" and res.summary["concurrency"] == 8


def test_duration_sized_closed_loop_does_not_depend_on_the_pool_guess(make_scenario, monkeypatch) -> None:
    """Sent until duration_s and no later; the window ends at duration_s; a pool guessed far too
    small is doubled until the clients never run dry, and gives the very same run."""
    sc = _closed(make_scenario, concurrency=12, duration_s=120.0)
    res = simulate(sc, 4)
    req = res.requests
    assert req.arrival_s.max() < 120.0 and req.completion_s.notna().all()
    assert res.summary["window_end_s"] == 120.0 and res.summary["verdict"] == "stable"
    monkeypatch.setattr(simulate_mod, "closed_pool", lambda sc, rt: 5)
    tiny = simulate(sc, 4)
    pd.testing.assert_frame_equal(req, tiny.requests)


def test_benchmark_block_is_vllm_bench_over_the_whole_run(make_scenario) -> None:
    res = simulate(_closed(make_scenario, concurrency=8, num_requests=200), 1)
    b = res.summary["benchmark"]
    assert {k: v for k, v in b.items() if k not in ("max_concurrency", "request_rate")} == \
        bench_metrics(res.requests, res.steps)
    assert b["completed"] == 200 and b["max_concurrency"] == 8 and b["request_rate"] == float("inf")
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert np.isfinite(b[f"{stat}_{name}_ms"])
    assert b["median_tpot_ms"] == pytest.approx(np.median(
        (res.requests.completion_s - res.requests.first_token_s) / (res.requests.output_tokens - 1)) * 1e3, rel=0.02)
    # the whole run includes the start-up burst and the drain tail, so it is slower than the window
    assert b["request_throughput"] < res.summary["throughput_rps"]
    # open-loop runs carry the block too
    open_b = simulate(make_scenario(workload={"rate_rps": 1.0, "duration_s": 60.0}), 1).summary["benchmark"]
    assert open_b["request_rate"] == 1.0 and open_b["max_concurrency"] is None and open_b["completed"] > 30


def test_too_few_requests_is_insufficient(make_scenario) -> None:
    s = simulate(_closed(make_scenario, concurrency=4, num_requests=60, warmup_s=0.0), 1).summary
    assert s["verdict"] == "insufficient" and "requests measured" in s["verdict_reason"]


@pytest.mark.parametrize("rate", [1.0, 10.0])  # 8 clients carry about 6 req/s here
def test_max_concurrency_gate(make_scenario, rate) -> None:
    """Open-loop arrivals behind N clients: never more than N in system, never sent before the
    arrival time; below what N clients carry, sends are mostly on time (stable); above it the wait
    for a client grows and the run is overloaded."""
    n = 8
    sc = make_scenario(workload={"rate_rps": rate, "duration_s": 240.0, "warmup_s": 20.0, "max_concurrency": n, **LENGTHS})
    res = simulate(sc, 1)
    req = res.requests
    due = generate(sc.workload, 1, rate).to_pandas().set_index("id").arrival_s.reindex(req.id).to_numpy()
    sent = req.arrival_s.to_numpy()
    assert (sent >= due - 1e-12).all()
    events = np.unique(np.concatenate([sent, req.completion_s.to_numpy()]))
    assert in_system(req, events).max() <= n
    s = res.summary
    assert s["loop"] == "gated" and s["benchmark"]["max_concurrency"] == n
    if rate == 1.0:
        assert np.mean(sent - due < 1e-9) > 0.5 and s["verdict"] == "stable", s["verdict_reason"]
    else:
        assert s["verdict"] == "overloaded" and "free client" in s["verdict_reason"]


HOSTILE = [
    ({"workload.concurrency": 0}, "workload.concurrency"),
    ({"workload.arrival": "poisson", "workload.rate_rps": 1.0}, "concurrency: needs arrival = 'closed'"),
    ({"workload.think_time_s": 0.5}, "workload.think_time_s"),
    ({"workload.think_time_s": {"dist": "gauss", "mean": 1.0}}, "workload.think_time_s"),
    ({"workload.think_time_s": {"dist": "exponential", "mean": -1.0}}, "workload.think_time_s"),
    ({"workload.think_time_s": {"dist": "fixed"}}, "workload.think_time_s.fixed.value"),
    ({"workload.think_time_s": {"dist": "fixed", "value": 1, "scale": 2}}, "workload.think_time_s"),
    ({"workload.utilisation": 0.5}, "utilisation: a closed loop sets its own rate"),
    ({"workload.rate_rps": 2.0}, "rate_rps: a closed loop sets its own rate"),
    ({"workload.max_concurrency": 4}, "max_concurrency"),
    ({"workload.concurrency": 1.5}, "workload.concurrency"),
]


@pytest.mark.parametrize(("over", "needle"), HOSTILE, ids=[str(o) for o, _ in HOSTILE])
def test_hostile_closed_loop_inputs_are_one_line_errors(tmp_path, capsys, over, needle) -> None:
    base = {"workload.arrival": "closed", "workload.concurrency": 4}
    lines = ['[rack]\ngpu = "h100-sxm"\nnum_gpus = 4\n[deployment]\nmodel = "llama-3.1-70b"\ntensor_parallel = 4\n[workload]']
    for key, value in {**base, **over}.items():
        field = key.split(".", 1)[1]
        if isinstance(value, dict):
            value = "{ " + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in value.items()) + " }"
        elif isinstance(value, str):
            value = f'"{value}"'
        lines.append(f"{field} = {value}")
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines) + "\n")
    assert main(["validate", str(path)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert needle in line, line
    # without the hostile key the same file is valid
    good = tmp_path / "good.toml"
    good.write_text("\n".join([lines[0], 'arrival = "closed"', "concurrency = 4"]) + "\n")
    assert main(["validate", str(good)]) == 0
    capsys.readouterr()


def test_concurrency_wanted_with_closed_and_max_concurrency_with_open(make_scenario) -> None:
    from models.errors import ConfigError

    with pytest.raises(ConfigError, match="needs concurrency"):
        _closed(make_scenario)
    with pytest.raises(ConfigError, match="think_time_s: needs arrival = 'closed'"):
        make_scenario(workload={"think_time_s": {"dist": "fixed", "value": 1.0}})


def test_run_prints_the_vllm_headline_figures(tmp_path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text('name = "c"\n[rack]\ngpu = "h100-sxm"\nnum_gpus = 4\n[deployment]\nmodel = "llama-3.1-70b"\n'
                    'tensor_parallel = 4\n[workload]\narrival = "closed"\nconcurrency = 8\nnum_requests = 150\n'
                    'warmup_s = 5\nprompt_tokens = { dist = "fixed", value = 256 }\n'
                    'output_tokens = { dist = "fixed", value = 64 }\n')
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    for label in ("Request throughput (req/s)", "Output token throughput (tok/s)", "TTFT mean / median / p99 (ms)",
                  "TPOT mean / median / p99 (ms)", "ITL  mean / median / p99 (ms)", "8 clients"):
        assert label in out, out
    import json

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["benchmark"]["completed"] == 150 and summary["loop"] == "closed"


def test_concurrency_sweep_quick(tmp_path, capsys) -> None:
    """The bundled concurrency sweep in --quick mode: rows per (variant, concurrency, seed), paired
    speedups along concurrency, the report, within 40 s."""
    t0 = time.perf_counter()
    rc = main(["sweep", str(CONC_SWEEP), "--quick", "--out", str(tmp_path), "--jobs", "2"])
    took = time.perf_counter() - t0
    assert rc == 0
    assert took < 40, f"quick concurrency sweep took {took:.0f} s"
    df = pd.read_parquet(tmp_path / "results.parquet")
    assert sorted(df.concurrency.unique()) == [4, 32, 128] and set(df.variant) == {"baseline", "draft-1b"}
    assert (df.loop == "closed").all() and df.utilisation.isna().all()
    assert "benchmark_request_throughput" in df and "benchmark_median_ttft_ms" in df
    base = df[df.variant == "baseline"].sort_values("concurrency")
    assert base.throughput_rps.is_monotonic_increasing  # more clients, more throughput (below full batch)
    sp = pd.read_csv(tmp_path / "speedups.csv")
    assert "concurrency" in sp and "utilisation" not in sp
    tpot = sp[(sp.metric == "tpot_s_mean") & (sp.variant == "draft-1b")].sort_values("concurrency")
    assert (tpot["mean"] > 1.0).all() and tpot["mean"].iloc[0] > tpot["mean"].iloc[-1]  # pays less as the batch fills
    html = (tmp_path / "report.html").read_text()
    assert "concurrency (closed-loop clients)" in html and "Throughput vs concurrency" in html
    capsys.readouterr()


@pytest.mark.parametrize(("body", "needle"), [
    ("utilisation = [0.3]\nconcurrency = [4]", "exactly one load axis"),
    ("", "exactly one load axis"),
    ("concurrency = [0, 4]", "concurrency must be a list of integers >= 1"),
    ("concurrency = [4, 4]", "more than once"),
    ('concurrency = [4]\nset = { "workload.concurrency" = 8 }', "workload.concurrency would be ignored"),
])
def test_bad_concurrency_sweep_files(tmp_path, capsys, body, needle) -> None:
    base = ROOT / "experiments" / "scenarios" / "default-mix.toml"
    path = tmp_path / "s.toml"
    path.write_text(f'base = "{base}"\n{body}\n[[variants]]\nname = "baseline"\n')
    assert main(["sweep", str(path), "--out", str(tmp_path / "o")]) == 2
    line = one_line_error(capsys.readouterr().err, re.compile(r"^sweep "))
    assert needle in line, line
