"""Plan inputs: strict plan files (every table, did-you-mean, one-line errors with exit 2), trace
plans that replay the window they claim at the stated growth, --quick refusing to judge other
traffic, strategies not applicable on one GPU type, and retraining priced on its own training GPU.

Everything here is fast: errors are raised while the plan file is read (before any search), and
the few simulations use a synthetic trace of short requests or a TP1 8B model."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import one_line_error

from experiments.cli import main
from experiments.plan import load_plan
from experiments.plan_racks import scenario_for
from experiments.plan_search import evaluate, plan_row
from experiments.planfile import Strategy, builtin_strategies
from models.catalog import GPUS
from models.errors import ConfigError
from models.quality import H100_BF16_FLOPS
from sim.deployment import build_runtime
from sim.scenario import load_scenario
from sim.workload import generate
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "experiments" / "scenarios" / "default-mix.toml"
REAL_TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"


def synthetic_trace(path: Path) -> Path:
    """1000 s of short requests: 1 req/s, with a busy 100 s (4 req/s) from t = 500 s."""
    rng = np.random.default_rng(7)
    calm = np.sort(rng.uniform(0, 1000, 1000))
    busy = np.sort(rng.uniform(500, 600, 300))
    t = np.sort(np.concatenate([[0.0], calm, busy]))
    n = t.size
    lines = ["arrival_s,prompt_tokens,output_tokens"] + [f"{x:.4f},{rng.integers(50, 300)},{rng.integers(10, 60)}"
                                                         for x in t]
    path.write_text("\n".join(lines) + "\n")
    assert n > 1000
    return path


def rate_plan(extra: str = "", *, traffic: str = "rate_rps = 6.0", search: str = "duration_s = 60\nwarmup_s = 10",
              quality: str = "floor_tail = 0.9", strategies: str = '["baseline", "draft-1b"]',
              gpus: str = '["h100-sxm"]', prices: str = "{ h100-sxm = 2.5 }", head: str = "") -> str:
    return textwrap.dedent(f"""\
        name = "hostile"
        base = "{BASE}"
        strategies = {strategies}
        {head}
        [traffic]
        {traffic}

        [slo]
        ttft_p99_s = 2.0
        tpot_p99_s = 0.2

        [search]
        gpus = {gpus}
        usd_per_gpu_hour = {prices}
        max_gpus = 16
        {search}
        seeds = [1]

        [quality]
        {quality}
        """) + extra


# --------------------------------------------------------------------------- hostile plan files

TRACE = "@TRACE@"  # replaced by the synthetic trace's path

HOSTILE: dict[str, tuple[str, tuple[str, ...]]] = {
    "tail_floor-typo": (rate_plan(quality="tail_floor = 0.9"), ("quality", "tail_floor", "did you mean 'floor_tail'")),
    "rate-typo": (rate_plan(traffic="rate_rsp = 6.0"), ("traffic", "did you mean 'rate_rps'")),
    "slo-typo": (rate_plan().replace("tpot_p99_s = 0.2", "tpot_p99 = 0.2"), ("slo.tpot_p99", "did you mean 'tpot_p99_s'")),
    "gpus-typo": (rate_plan().replace("gpus = [", "gpu = ["), ("search", "did you mean 'gpus'")),
    "analyses-typo": (rate_plan("[analyses]\nmap_utilization = [0.5]\n"), ("did you mean 'map_utilisation'",)),
    "quick-typo": (rate_plan("[quick]\nsearch = { duration = 30 }\n"), ("quick.search", "did you mean 'duration_s'")),
    "quick-unknown-section": (rate_plan("[quick]\nsearh = { duration_s = 30 }\n"), ("quick", "searh")),
    "top-level-typo": (rate_plan(head="strategy = 1"), ("unknown key 'strategy'", "did you mean 'strategies'")),
    "strategies-under-search": (rate_plan(search='duration_s = 60\nwarmup_s = 10\nstrategies = ["baseline"]'),
                                ("search.strategies", "top level")),
    "floor-under-search": (rate_plan(search="duration_s = 60\nwarmup_s = 10\nfloor_tail = 0.5"),
                           ("search.floor_tail", "[quality]")),
    "search-not-a-table": (rate_plan().replace("[search]\n", "[searchx]\n") + "", ("unknown key 'searchx'",)),
    "gpus-a-string": (rate_plan(gpus='"h100-sxm"'), ("search.gpus", "must be a list")),
    "price-for-gpu-not-searched": (rate_plan(prices="{ h100-sxm = 2.5, h200 = 3.6 }"),
                                   ("usd_per_gpu_hour.h200", "not in search.gpus")),
    "price-gpu-misspelt": (rate_plan(prices="{ h100 = 2.5 }"), ("usd_per_gpu_hour.h100", "did you mean 'h100-sxm'")),
    "price-negative": (rate_plan(prices="{ h100-sxm = -2.5 }"), ("usd_per_gpu_hour.h100-sxm", "positive")),
    "price-a-number": (rate_plan(prices="2.5"), ("search.usd_per_gpu_hour", "table")),
    "unknown-gpu": (rate_plan(gpus='["h100-sx"]', prices="{}"), ("unknown gpu 'h100-sx'", "h100-sxm")),
    "max-gpus-boolean": (rate_plan(search="duration_s = 60\nwarmup_s = 10\nmax_gpus = true").replace("max_gpus = 16\n", ""),
                         ("search.max_gpus", "integer")),
    "growth-negative": (rate_plan(traffic="rate_rps = 6.0\ngrowth = -1.0"), ("traffic.growth", "positive")),
    "growth-zero": (rate_plan(traffic="rate_rps = 6.0\ngrowth = 0"), ("traffic.growth", "positive")),
    "rate-nan": (rate_plan(traffic="rate_rps = nan"), ("traffic.rate_rps", "positive")),
    "rate-a-string": (rate_plan(traffic='rate_rps = "12"'), ("traffic.rate_rps",)),
    "rate-boolean": (rate_plan(traffic="rate_rps = true"), ("traffic.rate_rps",)),
    "duration-inf": (rate_plan(search="duration_s = inf\nwarmup_s = 10"), ("search.duration_s", "finite")),
    "warmup-longer-than-run": (rate_plan(search="duration_s = 60\nwarmup_s = 60"), ("warmup_s", "shorter")),
    "seeds-negative": (rate_plan().replace("seeds = [1]", "seeds = [-1]"), ("search.seeds",)),
    "seeds-twice": (rate_plan().replace("seeds = [1]", "seeds = [1, 1]"), ("search.seeds", "twice")),
    "floor-nan": (rate_plan(quality="floor_tail = nan"), ("quality.floor_tail",)),
    "no-traffic": (rate_plan(traffic=""), ("traffic", "rate_rps", "trace")),
    "missing-base": (rate_plan().replace(f'base = "{BASE}"\n', ""), ("missing 'base'",)),
    "base-a-number": (rate_plan().replace(f'base = "{BASE}"', "base = 5"), ("base", "string")),
    "base-set-typo": (rate_plan(head='base_set = { "deployment.max_num_batched_token" = 2048 }'),
                      ("base_set", "max_num_batched_token")),
    "unknown-strategy": (rate_plan(strategies='["baseline", "draft-2b"]'), ("unknown strategy 'draft-2b'", "draft-1b")),
    "strategy-set-a-string": (rate_plan(strategies='[{ name = "mine", set = "fp8" }]'), ("strategies[0].set", "table")),
    "strategy-name-a-number": (rate_plan(strategies='[{ name = 8, set = {} }]'), ("strategies[0].name", "string")),
    "strategy-key-typo": (rate_plan(strategies='[{ name = "mine", sets = {} }]'), ("strategies[0]", "did you mean 'set'")),
    "strategy-twice": (rate_plan(strategies='["baseline", "baseline"]'), ("strategies", "twice")),
    "strategy-impossible": (rate_plan(strategies='[{ name = "typo", set = { "deployment.wieghts" = "fp8" } }]'),
                            ("strategy 'typo'", "wieghts")),
    "training-gpu-unknown": (rate_plan(quality='floor_tail = 0.9\ntraining_gpu = "h100"'), ("unknown gpu 'h100'", "h100-sxm")),
    "training-price-zero": (rate_plan(quality="floor_tail = 0.9\ntraining_usd_per_gpu_hour = 0"),
                            ("quality.training_usd_per_gpu_hour", "positive")),
    "rate-with-trace": (rate_plan(traffic=f'rate_rps = 6.0\ntrace = "{TRACE}"', search="warmup_s = 10"),
                        ("rate_rps or trace, not both",)),
    "window-without-trace": (rate_plan(traffic='rate_rps = 6.0\nwindow = "peak-1h"'), ("traffic.window", "trace")),
    "window-longer-than-trace": (rate_plan(traffic=f'trace = "{TRACE}"\nwindow = "peak-2h"', search="warmup_s = 10"),
                                 ("peak-2h", "longer than the trace")),
    "window-garbage": (rate_plan(traffic=f'trace = "{TRACE}"\nwindow = "busiest"', search="warmup_s = 10"),
                       ("traffic.window", "busiest")),
    "window-and-start": (rate_plan(traffic=f'trace = "{TRACE}"\nwindow = "peak-1m"\nstart_s = 5', search="warmup_s = 10"),
                         ("window or start_s/end_s",)),
    "start-past-the-trace": (rate_plan(traffic=f'trace = "{TRACE}"\nstart_s = 5000', search="warmup_s = 10"),
                             ("traffic.start_s", "past")),
    "end-before-start": (rate_plan(traffic=f'trace = "{TRACE}"\nstart_s = 500\nend_s = 400', search="warmup_s = 10"),
                         ("traffic.end_s", "after")),
    "duration-with-trace": (rate_plan(traffic=f'trace = "{TRACE}"'), ("search.duration_s", "window")),
    "trace-missing": (rate_plan(traffic='trace = "no-such-trace.csv"', search="warmup_s = 10"), ("not found",)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_plan_files_give_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    text, words = HOSTILE[case]
    text = text.replace(TRACE, str(synthetic_trace(tmp_path / "trace.csv")))
    p = tmp_path / "plan.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_plan(p)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (case, w, msg)
    capsys.readouterr()
    assert main(["plan", str(p), "--out", str(tmp_path / "out"), "--no-analyses", "--jobs", "1"]) == 2
    assert one_line_error(capsys.readouterr().err) == f"specrack: error: {msg}"
    assert not (tmp_path / "out").exists()


def test_a_table_that_is_not_a_table(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text(f'base = "{BASE}"\nsearch = 5\n[traffic]\nrate_rps = 6.0\n')
    with pytest.raises(ConfigError, match=r"^search: must be a table"):
        load_plan(p)
    p.write_text(f'base = "{BASE}"\nquick = 5\n[traffic]\nrate_rps = 6.0\n')
    with pytest.raises(ConfigError, match=r"^quick: must be a table"):
        load_plan(p)


def test_out_naming_a_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "plan.toml"
    p.write_text(rate_plan(strategies='["baseline"]'))
    (tmp_path / "out").write_text("x")
    assert main(["plan", str(p), "--out", str(tmp_path / "out"), "--no-analyses", "--jobs", "1"]) == 2
    assert "--out" in one_line_error(capsys.readouterr().err, ignore=__import__("re").compile(r"^(plan |  )"))


# --------------------------------------------------------------------------- strategies per GPU


def test_a_strategy_that_cannot_run_on_one_gpu_is_marked_not_applicable(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text(rate_plan(strategies='["baseline", "fp8"]', gpus='["h100-sxm", "a100-80gb"]',
                           prices="{ h100-sxm = 2.5, a100-80gb = 1.8 }"))
    spec = load_plan(p)
    assert set(spec.not_applicable) == {("fp8", "a100-80gb")}
    assert "FP8" in spec.not_applicable[("fp8", "a100-80gb")]
    row = plan_row(spec, builtin_strategies()["fp8"], "a100-80gb", spec.rate_rps)
    assert row["feasible"] is False and row["reason"].startswith("not applicable:") and row["evaluations"] == 0


def test_no_strategy_able_to_run_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text(rate_plan(strategies='["fp8"]', gpus='["a100-80gb"]', prices="{}"))
    with pytest.raises(ConfigError, match="no strategy can run on a100-80gb"):
        load_plan(p)


# --------------------------------------------------------------------------- effective inputs


def test_the_effective_inputs_are_echoed(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text(rate_plan(quality='floor_tail = 0.85\ntraining_gpu = "b200"', head='base_set = { "deployment.max_num_batched_tokens" = 2048 }'))
    spec = load_plan(p)
    inputs = spec.inputs()
    assert "llama-3.1-70b, TP4, weights bf16" in inputs["model"] and "max_num_batched_tokens 2048" in inputs["engine"]
    assert "8x h100-sxm" in inputs["base rack"]
    assert inputs["SLO"].startswith("p99 TTFT <= 2 s, p99 TPOT <= 200 ms")
    assert inputs["tail-quality floor"] == "0.85"
    assert "h100-sxm $2.5/h" in inputs["prices"]
    assert "b200" in inputs["retraining"] and f"${GPUS['b200'].usd_per_gpu_hour:g}/h" in inputs["retraining"]
    assert "6.00 req/s" in inputs["traffic"] and "60 s per run" in inputs["simulated"]


def test_few_judged_requests_warn(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text(rate_plan(traffic="rate_rps = 2.0"))  # 2 req/s x 50 s = 100 requests
    spec = load_plan(p)
    assert spec.expected_requests == 100
    assert spec.warnings and "WARNING" in spec.warnings[0] and "100" in spec.warnings[0]


# --------------------------------------------------------------------------- trace plans


def trace_plan(tmp: Path, traffic: str, quick: str = "") -> Path:
    tr = synthetic_trace(tmp / "trace.csv")
    p = tmp / "trace-plan.toml"
    p.write_text(rate_plan(traffic=f'trace = "{tr}"\n' + traffic, search="warmup_s = 10",
                           strategies='["baseline"]') + quick)
    return p


@pytest.mark.parametrize(("window", "lo", "hi"), [
    ('window = "whole"', 0.0, None),
    ('window = "peak-100s"', 500.0, 600.0),
    ("start_s = 200\nend_s = 800", 200.0, 800.0),
])
def test_a_trace_plan_simulates_the_window_it_claims(tmp_path: Path, window: str, lo: float, hi: float | None) -> None:
    """The planned runs offer the headline rate (within 10%) and replay exactly the window's requests
    (plus a lead-in of warm-up before it), time-compressed by the growth factor."""
    spec = load_plan(trace_plan(tmp_path, "growth = 1.5\n" + window))
    tr = spec.traffic
    assert tr is not None and tr.kind == "trace" and tr.growth == 1.5
    if hi is not None:
        assert tr.lo_s == pytest.approx(lo, abs=2.0) and tr.hi_s == pytest.approx(hi, abs=2.0)
    sc = scenario_for(spec.base, builtin_strategies()["baseline"], "h100-sxm", spec.prices, 1, spec.rate_rps, traffic=tr)
    wl = sc.workload
    trace = np.loadtxt(tmp_path / "trace.csv", delimiter=",", skiprows=1)[:, 0]
    table = generate(wl, 1, sc.workload.rate_rps).to_pandas()
    start = wl.trace_start_s or 0.0
    in_window = trace[(trace >= start) & (trace < tr.hi_s)]
    assert len(table) == len(in_window)  # exactly the window (and its lead-in), nothing beyond it
    assert table.arrival_s.max() * 1.5 == pytest.approx(in_window.max() - start, rel=1e-9)
    assert wl.duration_s == pytest.approx((tr.hi_s - start) / 1.5)
    res = evaluate(sc, (1,))["summary"]
    assert res["offered_rps"] == pytest.approx(spec.rate_rps, rel=0.10), (res["offered_rps"], spec.rate_rps)
    if lo > 10 * 1.5:  # enough trace before the window for the whole lead-in: the measured window is the window
        assert res["offered_requests"] == int(((trace >= tr.lo_s) & (trace < tr.hi_s)).sum())
    # the rate the plan announces is the window's own rate times the growth
    n = len(trace) - 1 if hi is None else int(((trace >= tr.lo_s) & (trace < tr.hi_s)).sum())
    span = trace.max() if hi is None else tr.hi_s - tr.lo_s
    assert spec.rate_rps == pytest.approx(n / span * 1.5, rel=1e-9)


def test_the_peak_window_is_the_busiest(tmp_path: Path) -> None:
    peak = load_plan(trace_plan(tmp_path, 'window = "peak-100s"'))
    whole = load_plan(trace_plan(tmp_path, 'window = "whole"'))
    assert peak.rate_rps > 3 * whole.rate_rps / 1.5  # ~4.3 req/s in the busy 100 s vs ~1.3 over the whole trace
    assert 490 <= peak.traffic.lo_s <= 510


def test_quick_refuses_to_judge_other_traffic(tmp_path: Path) -> None:
    """A [quick] window whose rate is more than 10% off the plan's: one line, exit 2."""
    p = trace_plan(tmp_path, 'window = "whole"', quick='\n[quick]\ntraffic = { window = "peak-100s" }\n')
    with pytest.raises(ConfigError, match=r"--quick would simulate .*more than 10%"):
        load_plan(p, quick=True)
    assert load_plan(p).traffic.window == "whole"  # the full plan is fine
    ok = trace_plan(tmp_path, 'window = "peak-100s"', quick='\n[quick]\ntraffic = { window = "peak-90s" }\n')
    assert load_plan(ok, quick=True).traffic.window == "peak-90s"


@pytest.mark.skipif(not REAL_TRACE.is_file(), reason="the Azure 2023 code trace is not in ../shared/data/traces")
def test_the_bundled_trace_plan_headline_and_quick_agree() -> None:
    plan = ROOT / "experiments" / "plans" / "code-assistant-trace.toml"
    full, quick = load_plan(plan), load_plan(plan, quick=True)
    assert full.traffic.window == "peak-10m" and quick.traffic.window == "peak-5m"
    assert quick.rate_rps == pytest.approx(full.rate_rps, rel=0.10)
    assert full.expected_requests >= 500 and quick.expected_requests >= 500 and not quick.warnings


# --------------------------------------------------------------------------- retraining


def _distilled(**over: object):
    sc = load_scenario(BASE, {"workload.duration_s": 30.0, "workload.warmup_s": 5.0, "workload.utilisation": None,
                              "workload.rate_rps": 2.0, **over})
    return sc.with_overrides(builtin_strategies()["distilled-8b"].overrides | {"rack.num_gpus": 1})


def test_retraining_is_priced_on_its_training_gpu_not_the_serving_rack() -> None:
    cheap = simulate(_distilled(**{"rack.usd_per_gpu_hour": 0.5}), 1).summary
    dear = simulate(_distilled(**{"rack.usd_per_gpu_hour": 9.0}), 1).summary
    assert cheap["retraining_usd_per_month"] == dear["retraining_usd_per_month"] > 0
    assert cheap["serving_usd_per_month"] < dear["serving_usd_per_month"]
    # the default: an H100 at its catalogue price
    rt = build_runtime(_distilled())
    assert rt.retraining is not None and rt.retraining.training_gpu == "h100-sxm"
    assert rt.retraining.usd_per_gpu_hour == GPUS["h100-sxm"].usd_per_gpu_hour
    # another training GPU: hours scale by the ratio of dense BF16 peaks, its own price applies
    a100 = build_runtime(_distilled(**{"deployment.distillation.training_gpu": "a100-80gb",
                                       "deployment.distillation.training_usd_per_gpu_hour": 1.5})).retraining
    assert a100 is not None
    assert a100.gpu_hours_per_run == pytest.approx(rt.retraining.gpu_hours_per_run * H100_BF16_FLOPS / GPUS["a100-80gb"].bf16_flops)
    assert a100.usd_per_month == pytest.approx(1.0 * a100.gpu_hours_per_run * 1.5)


def test_a_plans_quality_table_sets_the_training_gpu(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text(rate_plan(quality='floor_tail = 0.9\ntraining_gpu = "h200"\ntraining_usd_per_gpu_hour = 4.0',
                           strategies='["baseline", "distilled-8b"]'))
    spec = load_plan(p)
    s: Strategy = builtin_strategies()["distilled-8b"]
    bills = set()
    for price in (1.0, 2.5, 7.0):
        sc = scenario_for(spec.base, s, "h100-sxm", {"h100-sxm": price}, 1, 2.0)
        rt = build_runtime(sc)
        assert rt.retraining is not None and rt.retraining.training_gpu == "h200"
        assert rt.retraining.usd_per_gpu_hour == 4.0
        bills.add(rt.retraining.usd_per_month)
    assert len(bills) == 1
