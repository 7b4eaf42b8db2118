"""The main job: the built-in sweep end to end from the command line (run once, shared), paired
speedups, serial = parallel, resume, failed points, and one-line errors for bad sweep files."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import experiments.sweep as sweep_mod
from experiments.analysis import speedups
from experiments.cli import main
from experiments.sweep import load_sweep, plan_points, run_sweep

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "experiments" / "scenarios" / "default-mix.toml"
DRAFT = '{ method = "draft_model", draft_model = "llama-3.2-1b", num_speculative_tokens = 4 }'
QUICK_VARIANTS = ("baseline", "draft-1b", "draft-1b-adaptive", "eagle", "eagle3", "eagle3-tree", "distilled-8b",
                  "distilled-8b+draft-1b", "fp8", "fp8+draft-1b")
KEY_COLS = ["variant", "utilisation", "seed"]
REAL_SIMULATE = sweep_mod.simulate


def write_sweep(path: Path, variants: str, *, header: str | None = None, duration_s: int = 60) -> Path:
    """A small sweep file: 2 utilisation points x 2 seeds over the default mix, short runs."""
    if header is None:
        header = (f'name = "small"\nbase = "{BASE}"\nutilisation = [0.3, 0.6]\nseeds = [1, 2]\nreference = "baseline"\n'
                  f'set = {{ "workload.duration_s" = {duration_s}, "workload.warmup_s" = 10 }}\n')
    path.write_text(header + "\n" + variants)
    return path


SMALL_VARIANTS = f"""
[[variants]]
name = "baseline"

[[variants]]
name = "draft"
set = {{ speculative = {DRAFT} }}

[[variants]]
name = "fp8"
set = {{ "deployment.weights" = "fp8", "deployment.kv_cache" = "fp8" }}
"""


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(KEY_COLS).reset_index(drop=True)


class CountingSimulate:
    """Wraps sim.simulate.simulate as the sweep module sees it; counts (and may break) runs."""

    def __init__(self, fail_if: Any = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail_if = fail_if

    def __call__(self, sc: Any, seed: int | None = None, **kw: Any) -> Any:
        self.calls.append((sc.key(), seed))
        if self.fail_if is not None and self.fail_if(sc):
            raise RuntimeError("boom: injected failure")
        return REAL_SIMULATE(sc, seed, **kw)


# ----------------------------------------------------------------------------- the built-in quick sweep


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`specrack sweep --quick --out DIR`, once for the module (about a minute on 2 cores)."""
    out = tmp_path_factory.mktemp("quick")
    rc = main(["sweep", "--quick", "--out", str(out)])
    return {"rc": rc, "out": out, "df": pd.read_parquet(out / "results.parquet"),
            "sp": pd.read_csv(out / "speedups.csv")}


def test_quick_sweep_writes_everything(quick: dict[str, Any]) -> None:
    out, df = quick["out"], quick["df"]
    assert quick["rc"] == 0
    for name in ("results.parquet", "results.csv", "speedups.csv", "report.html"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    spec = load_sweep(quick=True)
    n = len(spec.variants) * len(spec.utilisation) * len(spec.seeds)
    assert len(df) == n == 60
    assert len(list((out / "points").glob("*.json"))) == n
    assert tuple(dict.fromkeys(df.variant)) == QUICK_VARIANTS
    assert (df.error == "").all()
    assert sorted(df.utilisation.unique()) == [0.30, 0.60, 0.85]
    csv = pd.read_csv(out / "results.csv")
    assert len(csv) == n and list(csv.columns) == list(df.columns)
    # every variant at a point faces the same offered rate: utilisation x the reference capacity
    per_point = df.groupby(["utilisation", "seed"]).offered_rate_rps.nunique()
    assert (per_point == 1).all()
    ref = df.reference_capacity_rps.iloc[0]
    np.testing.assert_allclose(df.offered_rate_rps, df.utilisation * ref, rtol=1e-12)
    assert (df.capacity_rps > 0).all()
    # speedups: every variant x utilisation x metric, paired over both seeds
    sp = quick["sp"]
    head = sp[sp.metric == "tpot_s_mean"]
    assert len(head) == len(QUICK_VARIANTS) * 3
    assert (head.n == 2).all()
    np.testing.assert_array_equal(sp[sp.variant == "baseline"]["mean"], 1.0)


def test_quick_report_is_self_contained(quick: dict[str, Any]) -> None:
    html = (quick["out"] / "report.html").read_text()
    assert not re.search(r"<script[^>]+src=[\"']?https?:", html), "report loads a script from the network"
    assert html.count("plotly.js v") >= 1 or "Plotly" in html
    assert len(html) > 3_000_000  # the plotly.js bundle is inline
    assert html.count('id="chart-headline"') == 1
    m = re.search(r'<section id="headline">(.*?)</section>', html, re.S)
    assert m is not None
    headline = m.group(1)
    for v in QUICK_VARIANTS:
        assert f'"name":"{v}"' in headline.replace(": ", ":"), v
    for chart in ("latency", "cost", "quality", "utilisation", "why"):
        assert f'id="chart-{chart}"' in html
    # where and why each speculative strategy's speedup fades (issue 37): draft-1b's, over the baseline,
    # in the collapsible details under the findings
    details = re.search(r'<details id="details">(.*?)</details>', html, re.S)
    assert details is not None
    assert re.search(r"<li>draft-1b: ITL \(TPOT\) speedup [^<]*moves -\d+%, mostly verification compute",
                     details.group(1))
    why = pd.read_csv(quick["out"] / "attribution.csv")
    assert set(why.variant) >= {"draft-1b", "eagle", "fp8+draft-1b"}
    assert (why[why.variant == "fp8+draft-1b"].against == "fp8").all()
    assert '<ul id="summary"><li>' in html
    assert "engine profile vllm-v1" in html  # the report names the engine profile
    assert (quick["df"].engine_profile == "vllm-v1").all()  # and so does every row


def test_points_too_short_for_their_load_are_flagged(quick: dict[str, Any]) -> None:
    """A run starts empty; near capacity its load settles over many lifetimes (docs/METRICS.md,
    'Planner run length'). The quick sweep's 120 s runs settle at 0.3 but not at 0.85 (baseline:
    relaxation time ~90 s), and the report says which points understate their latencies."""
    df = quick["df"]
    base = df[df.variant == "baseline"]
    np.testing.assert_allclose(base.own_utilisation, base.offered_rps / base.capacity_rps)
    np.testing.assert_allclose(base.relaxation_s, base.e2e_s_mean / (1 - base.own_utilisation))
    assert base[base.utilisation == 0.30].settled.all()
    assert not base[base.utilisation == 0.85].settled.any()
    assert (base[base.utilisation == 0.85].relaxation_s > 40).all()
    html = (quick["out"] / "report.html").read_text()
    assert re.search(r"too short for their load to settle[^<]*from u=0\.(60|85): [^<;]*\bbaseline\b", html)


def test_draft_speeds_up_tpot_but_not_ttft_at_low_load(quick: dict[str, Any]) -> None:
    """At the lowest utilisation the 1B draft is faster per token (TPOT speedup > 1) while its
    mean TTFT is not better than baseline's: the draft's prefill adds time."""
    df, sp = quick["df"], quick["sp"]
    lo = df.utilisation.min()
    row = sp[(sp.variant == "draft-1b") & (sp.utilisation == lo) & (sp.metric == "tpot_s_mean")]
    assert len(row) == 1 and float(row["mean"].iloc[0]) > 1.2
    b = df[(df.variant == "baseline") & (df.utilisation == lo)].set_index("seed")
    d = df[(df.variant == "draft-1b") & (df.utilisation == lo)].set_index("seed")
    ttft_speedup = b.ttft_s_mean / d.ttft_s_mean
    assert (ttft_speedup <= 1.0).all(), ttft_speedup
    assert (b.tpot_s_mean / d.tpot_s_mean > 1.0).all()


# ----------------------------------------------------------------------------- the report answers first


def figures_of(html: str) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Each chart of a report page as plotly draws it: div id -> (traces, layout), read from the
    page's `Plotly.newPlot(id, traces, layout, ...)` calls."""
    dec = json.JSONDecoder()
    out = {}
    for m in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', html):
        traces, end = dec.raw_decode(html, m.end())
        layout, _ = dec.raw_decode(html, end + len(re.match(r"\s*,\s*", html[end:]).group(0)))
        out[m.group(1)] = (traces, layout)
    return out


def panels_of(traces: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The traces of each panel (its x and y axes)."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in traces:
        out.setdefault((t.get("xaxis", "x"), t.get("yaxis", "y")), []).append(t)
    return out


def colours_by_name(html: str, chart: str = "chart-headline") -> dict[str, str]:
    traces, _ = figures_of(html)[chart]
    out: dict[str, str] = {}
    for t in traces:
        out.setdefault(t["name"], t["line"]["color"])
        assert out[t["name"]] == t["line"]["color"], f"{t['name']} has two colours in {chart}"
    return out


def test_report_opens_with_the_answer_per_family(quick: dict[str, Any]) -> None:
    """The top of the report is the project's question, then one paragraph per family of
    strategies with where its TPOT speedup falls below 1.5x and 1.0x (interpolated), why, and the
    cheapest option per million tokens at each load; the findings come after."""
    from experiments.analysis import crossovers

    html = (quick["out"] / "report.html").read_text()
    body = html[html.index("</h1>"):]
    paras = re.findall(r'<p id="([^"]+)" class="[^"]+">(.*?)</p>', body[:body.index("<h2>What this run found")], re.S)
    assert [p for p, _ in paras] == ["lead", "family-speculative", "family-distilled", "family-quantized",
                                     "family-composition"]
    assert re.match(r'</h1>\s*<div id="answer"><p id="lead"', body)
    assert dict(paras)["lead"].startswith("Where does each strategy&#x27;s speedup fade, and by how much, compared with the "
                           "distilled and quantized options?")
    text = {p: t.replace("&#x27;", "'") for p, t in paras}
    for fam, title, members in (
            ("speculative", "Speculative decoding", ("draft-1b", "draft-1b-adaptive", "eagle", "eagle3", "eagle3-tree")),
            ("distilled", "Distilled", ("distilled-8b",)), ("quantized", "Quantized", ("fp8",)),
            ("composition", "Compositions", ("distilled-8b+draft-1b", "fp8+draft-1b"))):
        t = text[f"family-{fam}"]
        assert t.startswith(f"<b>{title}.</b> TPOT speedup u=0.30 → u=0.85: "), t[:80]
        for v in members:
            assert re.search(rf"[ ;:]{re.escape(v)} \d+\.\d\dx → \d+\.\d\dx", t), (fam, v)
        assert "Cheapest per million output tokens of these and baseline: " in t
    # where each fades, as speedups.csv interpolates it, is in its family's paragraph
    sp = quick["sp"]
    spec_text = text["family-speculative"]
    for level in (1.5, 1.0):
        for v, u in crossovers(sp, level=level).items():
            if np.isfinite(u) and u > sp.utilisation.min():
                t = next(t for p, t in text.items() if p != "lead" and re.search(rf"[ ;:]{re.escape(v)} \d", t))
                assert re.search(rf"{re.escape(v)} [^;]*below {level:.1f}x from u≈{u:.2f}", t), (v, level, u)
    assert "below 1.0x from u≈" in spec_text  # eagle3-tree stops paying inside the quick sweep
    assert "mostly through verification compute" in spec_text  # why, from the attribution
    assert re.search(r"distilled-8b's own capacity is \d+\.\d\dx the baseline's", text["family-distilled"])
    # the cheapest option at each load, from the sized cost the cost chart draws
    assert re.search(r"Cheapest per million output tokens \(rack sized to each option's own capacity; baseline "
                     r"\$\d+\.\d\d → \$\d+\.\d\d\): distilled-8b at every load", text["lead"])


def test_report_findings_are_six_bullets_at_most(quick: dict[str, Any]) -> None:
    html = (quick["out"] / "report.html").read_text()
    found = re.search(r'<ul id="summary">(.*?)</ul>', html, re.S)
    assert found is not None
    assert 1 <= found.group(1).count("<li>") <= 6
    details = re.search(r'<details id="details"><summary>Details: (\d+) more findings[^<]*</summary><ul>(.*?)</ul>'
                        r"</details>", html, re.S)
    assert details is not None and int(details.group(1)) == details.group(2).count("<li>") > 6


def test_report_panels_hold_six_lines_at_most_in_distinct_colours(quick: dict[str, Any]) -> None:
    """Every panel of every chart draws at most six traces, the reference's among them, each
    variant in its own colour; the ten strategies of the quick sweep all appear."""
    from experiments.report import MIN_DISTANCE, colour_distance

    html = (quick["out"] / "report.html").read_text()
    figs = figures_of(html)
    assert {"chart-headline", "chart-latency", "chart-cost", "chart-quality", "chart-utilisation",
            "chart-capacity", "chart-why"} <= set(figs)
    for chart, (traces, _) in figs.items():
        for axes, ts in panels_of(traces).items():
            assert len(ts) <= 6, (chart, axes, [t.get("name") for t in ts])
            if chart != "chart-why":  # a line per variant: distinct colours, the baseline in each
                colours = [t["line"]["color"] for t in ts]
                assert len(set(colours)) == len(colours), (chart, axes, colours)
                assert "baseline" in {t["name"] for t in ts}, (chart, axes)
    headline = {t["name"] for t in figs["chart-headline"][0]}
    assert headline == set(QUICK_VARIANTS)
    colours = colours_by_name(html)
    assert colour_distance(colours["eagle3"], colours["eagle3-tree"]) >= MIN_DISTANCE  # once two near pinks
    assert all(colour_distance(a, b) >= MIN_DISTANCE for a, b in itertools.combinations(colours.values(), 2))


def test_strategy_colours_are_fixed_across_reports(quick: dict[str, Any], tmp_path: Path) -> None:
    """A strategy has the same colour in two reports of different variants, in any order; a name
    outside the built-in table keeps a colour too."""
    from experiments.report import write_report

    df, sp = quick["df"], quick["sp"]
    first = colours_by_name((quick["out"] / "report.html").read_text())
    keep = ["baseline", "fp8+draft-1b", "eagle3-tree", "draft-1b"]
    sub = df[df.variant.isin(keep[1:])].iloc[::-1]  # another set, in another order
    renamed = df[df.variant == "eagle"].assign(variant="my-head")
    two = pd.concat([df[df.variant == "baseline"], sub, renamed])
    sp2 = speedups(two, "baseline")
    page = write_report(two, sp2, tmp_path / "two").read_text()
    second = colours_by_name(page)
    assert set(second) == {*keep, "my-head"}
    for v in keep:
        assert second[v] == first[v], v
    page3 = write_report(pd.concat([renamed, df[df.variant == "baseline"]]), sp2, tmp_path / "three").read_text()
    assert colours_by_name(page3)["my-head"] == second["my-head"]
    assert sp.variant.nunique() == len(QUICK_VARIANTS)


def test_facets_put_the_reference_in_every_row_and_six_lines_at_most() -> None:
    from experiments.report import MAX_LINES, facet_groups

    names = ["base", *[f"spec-{i}" for i in range(12)], "dist", "q8"]
    fams = {"base": "reference", "dist": "distilled", "q8": "quantized", **{f"spec-{i}": "speculative" for i in range(12)}}
    rows = facet_groups(names, fams, "base")
    assert all(r[0] == "base" and len(r) <= MAX_LINES for _, r in rows)
    assert sorted(v for _, r in rows for v in r[1:]) == sorted(names[1:])  # every variant once
    assert [t for t, _ in rows] == ["Speculative decoding (1/3)", "Speculative decoding (2/3)",
                                    "Speculative decoding (3/3), distilled and quantized"]
    assert facet_groups(["a", "b"], None, None) == [("", ["a", "b"])]  # no families, no reference: one row


def test_panel_colours_resolve_a_hash_clash_the_same_way_in_any_order() -> None:
    from experiments.report import (
        MIN_DISTANCE,
        OTHER_COLOURS,
        STRATEGY_COLOURS,
        colour_distance,
        colour_of,
        panel_colours,
    )

    # the built-in strategies told apart at a glance, wherever they meet
    assert all(colour_distance(a, b) >= MIN_DISTANCE for a, b in itertools.combinations(STRATEGY_COLOURS.values(), 2))
    assert not set(OTHER_COLOURS) & set(STRATEGY_COLOURS.values())
    names = [f"s{i}" for i in range(40)]
    a, b = next((a, b) for i, a in enumerate(names) for b in names[i + 1:] if colour_of(a) == colour_of(b))
    one = panel_colours(["baseline", a, b])
    other = panel_colours([b, "baseline", a])
    assert one == other and all(colour_distance(x, y) >= MIN_DISTANCE for x, y in itertools.combinations(one.values(), 2))
    assert one["baseline"] == STRATEGY_COLOURS["baseline"] and one[min(a, b)] == colour_of(min(a, b))


# ----------------------------------------------------------------------------- a small sweep, shared


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 3 variants x 2 utilisation points x 2 seeds sweep, run serially once."""
    d = tmp_path_factory.mktemp("small")
    path = write_sweep(d / "small.toml", SMALL_VARIANTS)
    spec = load_sweep(path)
    df, caps = run_sweep(spec, d / "serial", executor="serial", progress=False)
    return {"path": path, "spec": spec, "df": df, "caps": caps, "out": d / "serial"}


def test_small_sweep_table(small: dict[str, Any]) -> None:
    df = small["df"]
    assert len(df) == 12
    assert set(df.variant) == {"baseline", "draft", "fp8"}
    assert (df.error == "").all()
    assert df.point_key.is_unique
    assert set(small["caps"]) == {"baseline", "draft", "fp8"}
    # capacities: the draft's own is below the reference, fp8's above
    caps = small["caps"]
    assert caps["draft"]["capacity_rps"] < caps["baseline"]["capacity_rps"] < caps["fp8"]["capacity_rps"]
    assert caps["baseline"]["capacity_rps"] == caps["baseline"]["reference_capacity_rps"]


def test_serial_and_parallel_tables_identical(small: dict[str, Any], tmp_path: Path) -> None:
    par, _ = run_sweep(small["spec"], tmp_path / "par", jobs=2, executor="process", progress=False)
    a, b = _sorted(small["df"]), _sorted(par)
    assert list(a.columns) == list(b.columns)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    with cf.ThreadPoolExecutor(max_workers=2) as ex:  # any Executor works too
        thr, _ = run_sweep(small["spec"], tmp_path / "thr", executor=ex, progress=False)
    pd.testing.assert_frame_equal(a, _sorted(thr), check_exact=True)


def test_resume_recomputes_only_missing_points(small: dict[str, Any], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "resume"
    shutil.copytree(small["out"], out)
    points = sorted((out / "points").glob("*.json"))
    assert len(points) == 12
    gone = points[5]
    gone.unlink()
    counter = CountingSimulate()
    monkeypatch.setattr(sweep_mod, "simulate", counter)
    df, _ = run_sweep(small["spec"], out, executor="serial", progress=False)
    assert len(counter.calls) == 1
    key, seed = counter.calls[0]
    assert gone.name == f"{key}-{seed}.json"
    assert gone.is_file()
    pd.testing.assert_frame_equal(_sorted(df), _sorted(small["df"]), check_exact=True)
    # nothing missing: a re-run computes nothing
    run_sweep(small["spec"], out, executor="serial", progress=False)
    assert len(counter.calls) == 1


def test_changed_scenario_never_reuses_stale_points(small: dict[str, Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "changed"
    shutil.copytree(small["out"], out)
    old_keys = {t["key"] for t in plan_points(small["spec"])[0]}
    changed = load_sweep(write_sweep(tmp_path / "changed.toml", SMALL_VARIANTS, duration_s=30))
    new_tasks = plan_points(changed)[0]
    assert old_keys.isdisjoint({t["key"] for t in new_tasks})
    counter = CountingSimulate()
    monkeypatch.setattr(sweep_mod, "simulate", counter)
    df, _ = run_sweep(changed, out, executor="serial", progress=False)
    assert len(counter.calls) == len(new_tasks) == 12
    assert set(df.point_key) == {t["key"] for t in new_tasks}
    assert (df.horizon_s > 0).all() and not df.point_key.isin(old_keys).any()


def test_failed_point_is_reported_and_others_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = write_sweep(tmp_path / "s.toml", SMALL_VARIANTS)
    out = tmp_path / "out"
    counter = CountingSimulate(fail_if=lambda sc: sc.speculative is not None)
    monkeypatch.setattr(sweep_mod, "simulate", counter)
    rc = main(["sweep", str(path), "--out", str(out), "--executor", "serial"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("point failed: variant=draft") == 4
    assert "RuntimeError: boom: injected failure" in err
    assert "Traceback" not in err
    assert "4 point(s) failed" in err
    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == 12
    bad = df[df.variant == "draft"]
    assert (bad.error.str.startswith("RuntimeError: boom")).all()
    assert (df[df.variant != "draft"].error == "").all()
    assert len(list((out / "points").glob("*.json"))) == 8  # the good points were written
    assert (out / "report.html").is_file() and (out / "speedups.csv").is_file()
    sp = pd.read_csv(out / "speedups.csv")
    assert set(sp.variant) == {"baseline", "fp8"}
    # failed points are not cached: a clean re-run computes exactly those
    fixed = CountingSimulate()
    monkeypatch.setattr(sweep_mod, "simulate", fixed)
    assert main(["sweep", str(path), "--out", str(out), "--executor", "serial"]) == 0
    assert len(fixed.calls) == 4
    assert (pd.read_parquet(out / "results.parquet").error == "").all()


# ----------------------------------------------------------------------------- paired speedups


def test_renamed_copy_of_baseline_has_speedup_exactly_one(tmp_path: Path) -> None:
    """A variant that changes nothing that matters (only the scenario's name): the same seed
    gives the same run, so every paired speedup is exactly 1.0 with a zero-width interval."""
    variants = '[[variants]]\nname = "baseline"\n\n[[variants]]\nname = "copy"\nset = { name = "copy" }\n'
    spec = load_sweep(write_sweep(tmp_path / "s.toml", variants))
    df, _ = run_sweep(spec, tmp_path / "out", executor="serial", progress=False)
    assert len(df) == 8
    sp = speedups(df, "baseline")
    c = sp[sp.variant == "copy"]
    assert len(c) == 2 * 6
    np.testing.assert_array_equal(c["mean"], 1.0)
    np.testing.assert_array_equal(c.ci_low, 1.0)
    np.testing.assert_array_equal(c.ci_high, 1.0)


def test_variant_identical_to_baseline_has_speedup_exactly_one(tmp_path: Path) -> None:
    variants = '[[variants]]\nname = "baseline"\n\n[[variants]]\nname = "same"\n'
    spec = load_sweep(write_sweep(tmp_path / "s.toml", variants))
    df, _ = run_sweep(spec, tmp_path / "out", executor="serial", progress=False)
    assert sorted(set(df.variant)) == ["baseline", "same"]
    assert len(df) == 8
    sp = speedups(df, "baseline")
    s = sp[sp.variant == "same"]
    assert len(s) == 2 * 6
    np.testing.assert_array_equal(s["mean"], 1.0)


def test_renamed_variant_resumes_under_its_new_name(small: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "renamed"
    shutil.copytree(small["out"], out)
    renamed = load_sweep(write_sweep(tmp_path / "renamed.toml", SMALL_VARIANTS.replace('name = "fp8"', 'name = "fp8-w8a8"')))
    df, _ = run_sweep(renamed, out, executor="serial", progress=False)
    assert set(df.variant) == {"baseline", "draft", "fp8-w8a8"}


# ----------------------------------------------------------------------------- bad sweep files


def _header(**fields: str | None) -> str:
    base = {"name": '"bad"', "base": f'"{BASE}"', "utilisation": "[0.3]", "seeds": "[1]", "reference": '"baseline"'}
    base.update(fields)
    return "".join(f"{k} = {v}\n" for k, v in base.items() if v is not None)


VARIANTS_OK = '[[variants]]\nname = "baseline"\n'


@pytest.mark.parametrize(
    ("header", "variants", "needle"),
    [
        (_header(base=None), VARIANTS_OK, "missing 'base'"),
        (_header(), VARIANTS_OK + '\n[[variants]]\nname = "x"\nset = { "deployment.bogus" = 1 }\n', "deployment.bogus"),
        (_header(), VARIANTS_OK + '\n[[variants]]\nname = "x"\nset = { speculative = { method = "draft_model", '
         'draft_model = "qwen2.5-0.5b" } }\n', "tokenizer"),
        (_header(reference='"nope"'), VARIANTS_OK, "reference 'nope' is not a variant"),
        (_header(utilisation="[0.3, -1]"), VARIANTS_OK, "utilisation"),
        (_header(seeds="[1.5]"), VARIANTS_OK, "seeds"),
        (_header(colour='"red"'), VARIANTS_OK, "unknown field"),
        (_header(base='"/nonexistent/base.toml"'), VARIANTS_OK, "not found"),
        (_header(), VARIANTS_OK + VARIANTS_OK, "distinct"),
        (_header(), VARIANTS_OK + "[[variants]]\nset = {}\n", "needs a name"),
        ("name = \n", VARIANTS_OK, "invalid TOML"),
    ],
    ids=["missing-base", "unknown-variant-key", "variant-bad-draft", "reference-not-variant", "bad-utilisation",
         "bad-seeds", "unknown-top-field", "base-not-found", "duplicate-variant", "variant-without-name", "bad-toml"],
)
def test_bad_sweep_file_exits_2_with_one_line(header: str, variants: str, needle: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(header + "\n" + variants)
    rc = main(["sweep", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specrack: error: ")
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "out" / "results.parquet").exists()


def test_missing_sweep_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sweep", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("specrack: error: sweep file not found") and err.count("\n") == 1


def test_unknown_key_in_a_variant_table_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_sweep(tmp_path / "typo.toml", VARIANTS_OK + f'\n[[variants]]\nname = "draft"\nsett = {{ speculative = {DRAFT} }}\n')
    rc = main(["sweep", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("specrack: error: ") and "sett" in err and err.count("\n") == 1


REJUDGED = {"verdict", "verdict_reason", "stable", "slo_met", "judged_utilisation"}


def test_point_rows_round_trip_through_json(small: dict[str, Any]) -> None:
    """Each point file holds exactly its table row (what a resumed sweep reads back)."""
    df = small["df"]
    for f in (small["out"] / "points").glob("*.json"):
        row = json.loads(f.read_text())
        match = df[df.point_key == row["point_key"]]
        assert len(match) == 1
        got = match.iloc[0]
        for k, v in row.items():
            if k in REJUDGED:  # judged again against the variant's capacity once it is measured
                continue
            if isinstance(v, float) and np.isnan(v):
                assert np.isnan(got[k]), k
            else:
                assert got[k] == v, k
