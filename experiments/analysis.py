"""Speedups, defined once.

For a variant v and a metric x at load point u (a utilisation, or a closed-loop concurrency) and
seed s, the paired speedup is
    speedup = x(reference, u, s) / x(v, u, s)      for latencies (higher = v is faster)
    speedup = x(v, u, s) / x(reference, u, s)      for throughput
then the mean over seeds and a 95% Student-t confidence interval (scipy). Crossover: the lowest
load point where the mean ITL (TPOT) speedup falls below 1.0, interpolated linearly (in a
concurrency sweep, linearly in the number of clients).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import special

from sim.attribution import CAUSES, PARTS, attribute, main_cause, shares

SPEEDUP_METRICS = {
    "tpot_s_mean": "ITL (TPOT) mean",
    "tpot_s_p99": "ITL (TPOT) p99",
    "e2e_s_p50": "end-to-end p50",
    "e2e_s_p99": "end-to-end p99",
    "ttft_s_p99": "TTFT p99",
    "throughput_tok_s": "throughput",
}
HIGHER_IS_BETTER = {"throughput_tok_s"}
HEADLINE = "tpot_s_mean"


AXES = ("utilisation", "concurrency")


def load_axis(df: pd.DataFrame) -> str:
    """The load axis of a results or speedups table: "concurrency" when it has client counts."""
    return "concurrency" if "concurrency" in df and df.concurrency.notna().any() else "utilisation"


def speedups(df: pd.DataFrame, reference: str = "baseline", x: str = "utilisation") -> pd.DataFrame:
    """Tidy table: variant, x (utilisation or concurrency), metric, mean, ci_low, ci_high, n."""
    if x not in AXES:
        raise ValueError(f"speedups: x must be one of {AXES}, got {x!r}")
    ms = [m for m in SPEEDUP_METRICS if m in df]
    cols = ["variant", x, "seed", *ms]
    ref = df.loc[df.variant == reference, cols[1:]]
    # each row beside the reference's row at the same load point and seed (one merge, not a lookup per group)
    paired = df[cols].merge(ref, on=[x, "seed"], how="inner", suffixes=("", "@ref"))
    t975: dict[int, float] = {}
    rows = []
    for (variant, u), g in paired.groupby(["variant", x], sort=False):
        for m in ms:
            a = g[f"{m}@ref"].to_numpy(float)
            b = g[m].to_numpy(float)
            r = b / a if m in HIGHER_IS_BETTER else a / b
            r = r[np.isfinite(r)]
            if r.size == 0:
                continue
            mean = float(r.mean())
            if r.size > 1 and r.std(ddof=1) > 0:
                if r.size not in t975:
                    t975[r.size] = float(special.stdtrit(r.size - 1, 0.975))  # (Student t quantile: stats.t.ppf)
                half = float(t975[r.size] * r.std(ddof=1) / np.sqrt(r.size))
            else:
                half = 0.0
            rows.append({"variant": variant, x: u, "metric": m, "mean": mean,
                         "ci_low": mean - half, "ci_high": mean + half, "n": int(r.size)})
    return pd.DataFrame(rows, columns=["variant", x, "metric", "mean", "ci_low", "ci_high", "n"])


def crossovers(sp: pd.DataFrame, metric: str = HEADLINE, level: float = 1.0) -> dict[str, float]:
    """Per variant: the load point (utilisation or concurrency, whichever the table has) where the
    mean speedup first falls below `level` (1.0: where it stops paying), interpolated linearly
    between the sweep's points; the lightest point when it is below there already, NaN if never."""
    x = load_axis(sp)
    out: dict[str, float] = {}
    for v, g in sp[sp.metric == metric].groupby("variant", sort=False):
        g = g.sort_values(x)
        u, s = g[x].to_numpy(float), g["mean"].to_numpy(float)
        cross = float("nan")
        for i in range(len(s)):
            if s[i] < level:
                if i == 0:
                    cross = u[0]
                else:
                    cross = float(u[i - 1] + (level - s[i - 1]) * (u[i] - u[i - 1]) / (s[i] - s[i - 1]))
                break
        out[str(v)] = cross
    return out


# the report's families of strategies, in the order it tells them
FAMILIES = ("speculative", "distilled", "quantized", "composition", "other")
FAMILY_TITLES = {"reference": "reference", "speculative": "Speculative decoding", "distilled": "Distilled",
                 "quantized": "Quantized", "composition": "Compositions", "other": "Other deployments"}
FADE_LEVELS = (1.5, 1.0)  # the speedups whose load the report names: where it fades, where it stops paying


def families(df: pd.DataFrame, reference: str) -> dict[str, str]:
    """Each variant's family, from its results columns: "reference"; "speculative" (speculation on
    the reference's deployment); "distilled" (`distilled_from` set, no speculation); "quantized"
    (the reference's model with other weights or KV precision, no speculation); "composition"
    (speculation on any other deployment: a distilled or quantized model with a draft); "other"
    (another model, GPU or rack without speculation)."""
    first = df.groupby("variant", sort=False).first()
    ref = first.loc[reference] if reference in first.index else None

    def differs(r: pd.Series, cols: tuple[str, ...]) -> bool:
        return ref is not None and any(c in first and r[c] != ref[c] and not (pd.isna(r[c]) and pd.isna(ref[c]))
                                       for c in cols)

    out: dict[str, str] = {}
    for v, r in first.iterrows():
        spec = str(r.get("speculative_method", "none") or "none") != "none"
        distilled = "distilled_from" in first and pd.notna(r.distilled_from) and str(r.distilled_from) != ""
        same = not distilled and not differs(r, SAME_DEPLOYMENT)
        if v == reference:
            fam = "reference"
        elif spec:
            fam = "speculative" if same else "composition"
        elif distilled:
            fam = "distilled"
        elif differs(r, ("weights", "kv_cache")) and not differs(r, ("model", "tensor_parallel", "gpu", "num_gpus")):
            fam = "quantized"
        else:
            fam = "other"
        out[str(v)] = fam
    return out


def cost_column(df: pd.DataFrame) -> str:
    """The cost per million output tokens the report compares options by: with the rack sized to
    each variant's own capacity at each utilisation (`usd_per_mtok_sized`) where capacity was
    measured, else this rack at this load (`usd_per_mtok`: a concurrency sweep)."""
    return "usd_per_mtok_sized" if "usd_per_mtok_sized" in df and df.usd_per_mtok_sized.notna().any() else "usd_per_mtok"


def cheapest(df: pd.DataFrame, variants: list[str], x: str, column: str) -> pd.DataFrame:
    """Per load point: the cheapest of `variants` by `column` (mean over seeds): x, variant, usd
    (empty when the table has no such column)."""
    if column not in df:
        return pd.DataFrame(columns=[x, "variant", "usd"])
    d = df[df.variant.isin(variants)].groupby([x, "variant"], sort=False)[column].mean().dropna().reset_index()
    if d.empty:
        return pd.DataFrame(columns=[x, "variant", "usd"])
    best = d.loc[d.groupby(x)[column].idxmin()].sort_values(x)
    return best.rename(columns={column: "usd"})[[x, "variant", "usd"]].reset_index(drop=True)


# what makes two variants the same deployment but for speculation (results columns)
SAME_DEPLOYMENT = ("model", "weights", "kv_cache", "tensor_parallel", "gpu", "num_gpus", "engine_profile",
                   "distilled_from")


def own_references(df: pd.DataFrame, reference: str,
                   pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]] = ()) -> dict[str, str]:
    """Each speculative variant's reference for its speculation's speedup: its pair's when given,
    else the variant without speculation on the same deployment (`SAME_DEPLOYMENT`), the sweep's
    reference first, else the sweep's reference."""
    out = dict(pairs)
    if "speculative_method" not in df:
        return out
    keys = [c for c in SAME_DEPLOYMENT if c in df]
    first = df.groupby("variant", sort=False)[[*keys, "speculative_method"]].first()
    plain = first[first.speculative_method == "none"]
    for v, row in first[first.speculative_method != "none"].iterrows():
        if v in out:
            continue
        same = [str(p) for p, r in plain.iterrows() if all(r[k] == row[k] or (r[k] != r[k] and row[k] != row[k])
                                                           for k in keys)]
        out[str(v)] = reference if reference in same or not same else same[0]
    return out


def attributions(df: pd.DataFrame, reference: str = "baseline", x: str = "utilisation", metric: str = "tpot",
                 pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]] = ()) -> pd.DataFrame:
    """Why each speculative variant's speedup over its own reference (`own_references`: a
    drafted FP8 model against FP8 undrafted) changes from the lightest load point to each other
    one (`sim.attribution.attribute`), from the runs' latency parts (summary `latency_parts`, of
    mean TPOT, or of mean E2E with metric="e2e"; mean over seeds): per variant and load point,
    the reference (`against`), the change of ln(speedup) (`dln_speedup`), each cause's part of it
    (`why_<cause>`, ln points), its share (`attr_<cause>`, summing to 1; NaN for a change under
    2%) and the main cause in words."""
    cols = [f"latency_parts_{metric}_{p}" for p in PARTS]
    out_cols = ["variant", x, "against", "dln_speedup", *[f"why_{c}" for c in CAUSES],
                *[f"attr_{c}" for c in CAUSES], "main_cause"]
    if not set(cols) <= set(df.columns):
        return pd.DataFrame(columns=out_cols)
    means = df.groupby(["variant", x], sort=False)[cols].mean()
    have = set(means.index.get_level_values(0))
    rows = []
    for v, r in own_references(df, reference, pairs).items():
        if v not in have or r not in have:
            continue
        g, ref = means.loc[v], means.loc[r]
        loads = sorted(set(g.index) & set(ref.index))
        if not loads:
            continue
        u0 = loads[0]

        def parts(t: pd.DataFrame, u: float) -> dict[str, float]:
            return dict(zip(PARTS, (float(t.loc[u, c]) for c in cols), strict=True))

        for u in loads:
            a = attribute(parts(ref, u0), parts(g, u0), parts(ref, u), parts(g, u))
            sh = shares(a)
            rows.append({"variant": v, x: u, "against": r, "dln_speedup": a["dln_speedup"],
                         **{f"why_{c}": a[c] for c in CAUSES}, **{f"attr_{c}": sh[c] for c in CAUSES},
                         "main_cause": main_cause(a) if u != u0 else ""})
    return pd.DataFrame(rows, columns=out_cols)
