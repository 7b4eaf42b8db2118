"""Paired speedups inside one sweep: each `pairs = [[variant, reference], ...]` entry puts a
variant against its own reference (a drafted model against the same model undrafted), where the
sweep's single `reference` cannot (experiments/sweeps/moe-vs-dense.toml holds two models). The
report's "Speculation within each model" section: a chart and sentences stating where each
variant pays, from the rows themselves."""

from __future__ import annotations

import numpy as np
import pandas as pd

from experiments.analysis import HEADLINE, speedups


def pair_speedups(df: pd.DataFrame, pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]], x: str) -> pd.DataFrame:
    """The speedups table (experiments.analysis.speedups) of each pair's variant over its own reference."""
    parts = [speedups(df[df.variant.isin([v, r])], reference=r, x=x).query("variant == @v") for v, r in pairs]
    return pd.concat(parts, ignore_index=True) if parts else speedups(df.iloc[:0], x=x)


def pair_lines(df: pd.DataFrame, pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]], x: str) -> list[str]:
    """One sentence per pair (its TPOT speedup at the ends, its best point, where it pays), then one
    comparing where each pair's speedup peaks."""
    sp = pair_speedups(df, pairs, x)
    head = sp[sp.metric == HEADLINE]
    fmt = (lambda u: f"N={u:g}") if x == "concurrency" else (lambda u: f"u={u:.2f}")
    lines, best = [], {}
    for v, r in pairs:
        g = head[head.variant == v].set_index(x)["mean"].sort_index()
        if g.empty:
            continue
        pays = [u for u, s in g.items() if s > 1.0]
        where = (f"pays (speedup > 1) at {', '.join(fmt(u) for u in pays)}" if pays else "never pays over the sweep")
        best[v] = (float(g.idxmax()), float(g.max()))
        lines.append(f"{v} over {r}: TPOT speedup {g.iloc[0]:.2f}x at {fmt(g.index[0])}, {g.iloc[-1]:.2f}x at "
                     f"{fmt(g.index[-1])}, best {g.max():.2f}x at {fmt(g.idxmax())}; {where}.")
    if len(best) > 1:
        order = sorted(best.items(), key=lambda kv: kv[1][0])
        lines.append("Speculation's best point: " + ", ".join(f"{v} at {fmt(u)} ({s:.2f}x)" for v, (u, s) in order)
                     + ("; the peaks differ along the load axis." if len({u for _, (u, _) in order}) > 1 else "."))
    return lines


def fading_point(df: pd.DataFrame, variant: str, reference: str, x: str) -> float:
    """The first load point past the variant's best at which its TPOT speedup over `reference`
    is below 1 (NaN when it stays above): where speculation stops paying as the batch grows."""
    g = pair_speedups(df, [(variant, reference)], x)
    g = g[g.metric == HEADLINE].set_index(x)["mean"].sort_index()
    after = g[g.index >= g.idxmax()]
    below = after[after < 1.0]
    return float(below.index[0]) if len(below) else float(np.nan)
