"""`specrack acceptance`: reading vLLM's real formats, recovering known acceptance from logs the
engine's own sampler and the simulator generate, the TOML fragment loading into a scenario, bad
files as one-line errors, and the benchmark-vs-production speedup shift on the default scenario."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import one_line_error

from experiments.acceptance import fit_source, fragment_toml, read_source
from experiments.cli import main
from models.acceptance_fit import Observations, fit, simulate_steps, step_pmf
from sim.scenario import load_scenario, read_toml, scenario_from_dict
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "acceptance"
BEFORE, AFTER = FIX / "vllm-v1-before.prom", FIX / "vllm-v1-after.prom"
BENCH = FIX / "vllm-bench-serve.json"
DEFAULT = ROOT / "experiments" / "scenarios" / "default-mix.toml"


def _within(est: float, se: float, true: float, z: float = 4.0, floor: float = 0.0) -> bool:
    """The estimate lies within z standard errors of the truth (a test that fails about once in
    16,000 runs when the standard error is right)."""
    return abs(est - true) <= z * se + floor


# ------------------------------------------------------------------ real formats

def test_prometheus_scrape_pair_is_differenced_over_engines() -> None:
    (o,) = read_source([str(BEFORE), str(AFTER)], name="production")
    # the window: drafts 5500 - 1500, per position (3425, 2102, 1261) - (1057, 723, 479)
    assert o.kind == "histogram" and o.k == 3
    assert o.hist is not None and list(o.hist) == [4000 - 2368, 2368 - 1379, 1379 - 782, 782]
    (one,) = read_source([str(AFTER)], name="x")  # one scrape: counts since the server started
    assert one.hist is not None and one.hist.sum() == 5500


def test_bench_json_and_log_lines() -> None:
    (b,) = read_source([str(BENCH)], name="benchmark")
    assert b.k == 3 and b.hist is not None and b.hist.sum() == 1500
    accepted = float(b.hist @ np.arange(4))
    assert accepted == pytest.approx(2259, abs=2)  # spec_decode_accepted_tokens, from the rates
    (lg,) = read_source([str(FIX / "vllm-serve.log")], name="log")
    assert lg.k == 3 and lg.hist is not None and lg.hist.sum() == 300 + 304 + 307  # Drafted / k per line
    fits, _ = fit_source([str(BENCH)], name="benchmark")
    f = fits[0]
    assert f.mean_acceptance_length() == pytest.approx(2.506, abs=0.01)  # vLLM's own figure
    assert f.max_abs_diff < 0.01


def test_v0_counters_need_k_and_give_the_mean() -> None:
    with pytest.raises(Exception, match="--k"):
        read_source([str(FIX / "vllm-v0.prom")], name="v0")
    fits, _ = fit_source([str(FIX / "vllm-v0.prom")], name="v0", k=4)
    f = fits[0]
    assert f.kind == "mean" and f.spread == 0
    assert f.mean_acceptance_length() == pytest.approx(17800 / 5000, abs=1e-3)  # emitted / drafts
    assert any("only the total" in n for n in f.notes)


def test_csv_per_step_and_per_request_with_classes() -> None:
    steps = read_source([str(FIX / "steps.csv")], name="x")
    reqs = read_source([str(FIX / "requests.csv")], name="x")
    assert [o.name for o in steps] == [o.name for o in reqs] == ["chat", "code-tail"]
    for s, r in zip(steps, reqs, strict=True):
        assert s.kind == "steps" and r.kind == "totals" and s.num_drafts == r.num_drafts
        assert s.steps is not None and r.accepted is not None
        assert float((s.steps.sum(axis=(0, 1)) * np.arange(5)).sum()) == r.accepted.sum()


def test_fragment_loads_into_a_scenario(tmp_path: Path) -> None:
    fits, _ = fit_source([str(FIX / "steps.csv")], name="x")
    frag = fragment_toml(fits, ["steps.csv"])
    classes = tomllib.loads(frag)["workload"]["classes"]
    assert sum(c["share"] for c in classes) == pytest.approx(1.0, abs=1e-9)
    data = read_toml(DEFAULT, "scenario")
    data["workload"]["classes"] = classes
    sc = scenario_from_dict(data)
    assert [c.name for c in sc.workload.classes] == ["chat", "code-tail"]
    # pasted under a scenario file that has no classes of its own
    text = (ROOT / "experiments" / "scenarios" / "llama70b-h100x8.toml").read_text()
    path = tmp_path / "with-fit.toml"
    path.write_text(text + "\n" + frag)
    sc2 = load_scenario(path)
    assert sc2.workload.classes[0].acceptance == pytest.approx(fits[0].mean, abs=1e-4)


# ------------------------------------------------------------------ recovery

@pytest.mark.parametrize(("mean", "spread", "decay"), [(0.7, 0.12, 0.95), (0.55, 0.15, 1.0)])
def test_recovery_from_the_engines_sampler(mean: float, spread: float, decay: float, tmp_path: Path) -> None:
    """Per-step logs drawn with models.speculative.sample_accepted and acceptance_at_quantile
    (as the engine draws them) give back the parameters within their standard errors."""
    rng = np.random.default_rng(7)
    lengths = np.maximum(2, rng.lognormal(np.log(129), 0.9, 1500).astype(int))
    rid, acc = simulate_steps(rng, lengths, 4, mean, spread, decay)
    path = tmp_path / "steps.csv"
    pd.DataFrame({"request_id": rid, "k": 4, "accepted": acc}).to_csv(path, index=False)
    (f,), _ = fit_source([str(path)], name="c")
    assert f.kind == "steps" and not f.notes
    assert _within(f.mean, f.mean_se, mean), (f.mean, f.mean_se)
    assert _within(f.spread, f.spread_se, spread), (f.spread, f.spread_se)
    assert _within(f.decay, f.decay_se, decay), (f.decay, f.decay_se)
    assert f.mean_se < 0.01 and f.spread_se < 0.01 and f.decay_se < 0.01
    # the same steps pooled (no request ids: vLLM's counters) identify the mean and the decay
    hist = np.bincount(acc, minlength=5).astype(float)
    g = fit(Observations("c", 4, "histogram", hist=hist))
    assert _within(g.mean, g.mean_se, mean, floor=0.005), (g.mean, g.mean_se)
    assert _within(g.decay, g.decay_se, decay, floor=0.005), (g.decay, g.decay_se)


def test_pooled_counters_model_matches_the_sampler() -> None:
    """The step-weighted mixture the counters are fitted with is what pooling the engine's steps gives."""
    rng = np.random.default_rng(3)
    lengths = np.maximum(2, rng.lognormal(np.log(129), 0.9, 4000).astype(int))
    _, acc = simulate_steps(rng, lengths, 4, 0.7, 0.12, 0.95)
    share = np.bincount(acc, minlength=5) / acc.size
    assert np.abs(share - step_pmf(0.7, 0.12, 0.95, 4)).max() < 0.006


def test_recovery_from_the_simulator(make_scenario, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A real run's request table (draft_proposed, draft_accepted, verify_steps) as the per-request
    CSV: the fit recovers the scenario's acceptance and spread."""
    sc = make_scenario(
        speculative={"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4},
        workload={"rate_rps": 3.0, "duration_s": 300.0, "warmup_s": 0.0,
                  "classes": [{"name": "chat", "share": 1.0, "acceptance": 0.75, "acceptance_spread": 0.1}]})
    req = simulate(sc, 1).requests
    path = tmp_path / "requests.csv"
    req.assign(**{"class": "chat"})[["id", "class", "verify_steps", "draft_proposed", "draft_accepted"]].to_csv(path, index=False)
    (f,), _ = fit_source([str(path)], name="x")
    assert f.kind == "totals" and f.num_requests is not None and f.num_requests > 500
    assert _within(f.mean, f.mean_se, 0.75), (f.mean, f.mean_se)
    assert _within(f.spread, f.spread_se, 0.1), (f.spread, f.spread_se)
    assert f.mean_se < 0.015


# ------------------------------------------------------------------ bad files

def _bad(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(("files", "needle"), [
    (lambda t: [str(AFTER), str(BEFORE)], "goes backwards"),
    (lambda t: [_bad(t, "m.prom", "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n")],
     "no speculative-decoding metrics"),
    (lambda t: [_bad(t, "g.prom", "vllm:spec_decode_draft_acceptance_rate 0.7\nvllm:spec_decode_efficiency 0.6\n")],
     "no speculative-decoding"),
    (lambda t: [_bad(t, "b.json", '{"spec_decode_num_drafts": 40, "spec_decode_per_position_acceptance_rates": [0.7, 0.5]}')],
     "fewer than the 100"),
    (lambda t: [_bad(t, "n.json", '{"completed": 10, "mean_ttft_ms": 50.0}')], "no speculative-decoding figures"),
    (lambda t: [_bad(t, "s.csv", "request_id,accepted\n" + "r1,2\n" * 200)], "add a k column or pass --k"),
    (lambda t: [_bad(t, "x.csv", "request_id,k,accepted\n" + "r1,4,5\n" * 200)], "exceeds k"),
    (lambda t: [_bad(t, "w.txt", "hello there\nthis is not data\n")], "not a format"),
    (lambda t: [_bad(t, "j.json", "{not json")], "invalid JSON"),
    (lambda t: [str(FIX / "nope.prom")], "file not found"),
    (lambda t: [_bad(t, "two.prom", AFTER.read_text() + AFTER.read_text().replace("Llama-3.1-70B", "Llama-3.1-8B"))],
     "--model"),
])
def test_bad_files_are_one_line_errors(files, needle: str, tmp_path: Path,  # type: ignore[no-untyped-def]
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["acceptance", *files(tmp_path), "--out", str(tmp_path / "out")]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert needle in line, line


# ------------------------------------------------------------------ benchmark vs production

def test_benchmark_vs_production_shift_on_the_default_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shift"
    assert main(["acceptance", str(BENCH), "--label", "benchmark", "--against", str(BEFORE), str(AFTER),
                 "--against-label", "production", "--quick", "--jobs", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "speculative @ benchmark" in text and "speculative @ production" in text
    shift = pd.read_csv(out / "shift.csv").set_index("source")
    bench, prod = shift.loc["benchmark"], shift.loc["production"]
    assert prod.acceptance < bench.acceptance - 0.05  # production accepts less
    assert prod.tokens_per_verification_k4 < bench.tokens_per_verification_k4
    # lower acceptance: speculation stops paying at a lower utilisation (or never pays)
    assert not prod.crossover_utilisation > bench.crossover_utilisation
    sp = pd.read_csv(out / "speedups.csv")
    assert {"speculative @ benchmark", "speculative @ production"} <= set(sp.variant)
    html = (out / "report.html").read_text()
    assert "<script src=\"http" not in html and "plotly" in html.lower()
    for name in ("benchmark.toml", "production.toml", "fit.csv"):
        assert (out / name).is_file()
