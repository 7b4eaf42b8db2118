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
from scipy import stats

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
                    t975[r.size] = float(stats.t.ppf(0.975, r.size - 1))
                half = float(t975[r.size] * r.std(ddof=1) / np.sqrt(r.size))
            else:
                half = 0.0
            rows.append({"variant": variant, x: u, "metric": m, "mean": mean,
                         "ci_low": mean - half, "ci_high": mean + half, "n": int(r.size)})
    return pd.DataFrame(rows, columns=["variant", x, "metric", "mean", "ci_low", "ci_high", "n"])


def crossovers(sp: pd.DataFrame, metric: str = HEADLINE) -> dict[str, float]:
    """Per variant: the load point (utilisation or concurrency, whichever the table has) where the
    mean speedup first falls below 1.0 (NaN if never)."""
    x = load_axis(sp)
    out: dict[str, float] = {}
    for v, g in sp[sp.metric == metric].groupby("variant", sort=False):
        g = g.sort_values(x)
        u, s = g[x].to_numpy(float), g["mean"].to_numpy(float)
        cross = float("nan")
        for i in range(len(s)):
            if s[i] < 1.0:
                if i == 0:
                    cross = u[0]
                else:
                    cross = float(u[i - 1] + (1.0 - s[i - 1]) * (u[i] - u[i - 1]) / (s[i] - s[i - 1]))
                break
        out[str(v)] = cross
    return out
