"""Metrics as pure functions of the request and step tables. Formulas: docs/METRICS.md.

Names are fixed here, in `summarise`. Warm-up is excluded: request metrics use requests
arriving in [warmup_s, end_s); step metrics use steps starting in that window.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sim.frame import Frame, as_frame, column

if TYPE_CHECKING:
    from sim.frame import Table

PERCENTILES = (50, 90, 95, 99)
# stability verdict (docs/METRICS.md, 'Stability'): too few measured requests to judge below this
MIN_JUDGED_REQUESTS = 100
TREND_BATCHES = 10  # batch means over the window for the trend tests
TREND_T = 4.0  # t statistic of the slope a trend must exceed
TREND_REL = 0.5  # ... and growth over the window as a share of the first half's mean
SETTLE_LIFETIMES = 3.0  # requests in system are judged from 3 mean request lifetimes after the start on
JUDGE_LIFETIMES = 5.0  # ... over at least 5 lifetimes
RAMP_NOTE = "95% of its steady rate"  # sim.workload.RAMP_SHARE, in words


def dist(x: np.ndarray, w: np.ndarray | None = None) -> dict[str, float]:
    """Mean and percentiles (optionally weighted); NaN when empty."""
    x = np.asarray(x, dtype=np.float64)
    if w is not None:
        w = np.asarray(w, dtype=np.float64)
        keep = np.isfinite(x) & (w > 0)
        x, w = x[keep], w[keep]
    else:
        x = x[np.isfinite(x)]
    if x.size == 0:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    if w is None:
        pct = np.percentile(x, PERCENTILES)
        return {"mean": float(x.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)}}
    order = np.argsort(x, kind="stable")
    xs, ws = x[order], w[order]
    cum = np.cumsum(ws) / ws.sum()
    out = {"mean": float((xs * ws).sum() / ws.sum())}  # no BLAS dot: summation order must not depend on threads
    for p in PERCENTILES:
        out[f"p{p}"] = float(xs[min(int(np.searchsorted(cum, p / 100.0)), xs.size - 1)])
    return out


def _counts(steps: Table) -> np.ndarray:
    """Engine steps behind each step row: 1, or n for a run-length row of n fused decode steps."""
    return column(steps, "count", np.int64) if "count" in steps else np.ones(len(steps), dtype=np.int64)


def _run_index(cnt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, j) of every engine step: the row it is in and its index inside that row."""
    rows = np.repeat(np.arange(cnt.size), cnt)
    return rows, np.arange(rows.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)


def step_gaps(steps: Table) -> tuple[np.ndarray, np.ndarray]:
    """Every engine step's chunk gap and its weight (decoding sequences), run-length rows
    expanded: step j of a fused run lasted chunk_gap_s + j x gap_step_s (its durations are affine
    in the context, which grows by decode_seqs tokens a step)."""
    cnt = _counts(steps)
    gap = column(steps, "chunk_gap_s", np.float64)
    w = column(steps, "decode_seqs", np.float64)
    if (cnt == 1).all():
        return gap, w
    # expanded in place: each step's gap, its index in its run times the run's slope added
    out = np.repeat(gap, cnt)
    j = np.arange(out.size, dtype=np.float64)
    j -= np.repeat((np.cumsum(cnt) - cnt).astype(np.float64), cnt)
    j *= np.repeat(column(steps, "gap_step_s", np.float64), cnt)
    out += j
    return out, np.repeat(w, cnt)


def _pct_hit(cum: np.ndarray, total: float, p: float) -> int:
    """The first index where the cumulative weight reaches the share p (as `dist` finds it)."""
    return min(int(np.searchsorted(cum / total, p)), cum.size - 1)


def gap_dist(steps: Table) -> dict[str, float]:
    """`dist(*step_gaps(steps))` without expanding the run-length rows: the same mean (to
    rounding) and the same weighted percentiles (exactly: the same value is picked)."""
    mean, _, pct = gap_moments(steps, tuple(p / 100.0 for p in PERCENTILES))
    return {"mean": mean, **{f"p{p}": v for p, v in zip(PERCENTILES, pct, strict=True)}}


def gap_moments(steps: Table, shares: tuple[float, ...]) -> tuple[float, float, list[float]]:
    """(mean, standard deviation, weighted quantiles at `shares`) of every engine step's chunk gap
    weighted by its decoding sequences, from run-length rows without expanding them.

    Row r holds the values v_rj = g_r + j s_r, j = 0..n_r - 1 (g = chunk_gap_s, s = gap_step_s,
    both computed as the expansion computes them), each of weight w_r (decoding sequences). The
    weighted p-quantile x* (the smallest value whose cumulative weight reaches p) lies between two
    bounds read off the rows' ranges [lo_r, hi_r], sorted: x_low, the smallest lo at which the
    weight of the rows starting at or below it reaches p, and x_up, the smallest hi at which the
    weight of the rows ending at or below it does. Only the values inside [x_low, x_up] are
    expanded (from the rows overlapping it) and searched, with the weight below x_low counted in
    closed form (values grow with j, so a run's values below x_low are a prefix)."""
    cnt = _counts(steps).astype(np.float64)
    g = column(steps, "chunk_gap_s", np.float64)
    s = column(steps, "gap_step_s", np.float64) * (cnt > 1)
    w = column(steps, "decode_seqs", np.float64)
    keep = np.isfinite(g) & (w > 0)
    if not keep.all():
        cnt, g, s, w = cnt[keep], g[keep], s[keep], w[keep]
    if (s < 0).any():  # durations never fall along a run; expand any that would, to stay exact
        neg = s < 0
        j = _run_index(cnt[neg].astype(np.int64))[1]
        rows = np.repeat(np.flatnonzero(neg), cnt[neg].astype(np.int64))
        g = np.concatenate([g[~neg], g[rows] + j * s[rows]])
        w = np.concatenate([w[~neg], w[rows]])
        cnt = np.concatenate([cnt[~neg], np.ones(rows.size)])
        s = np.concatenate([s[~neg], np.zeros(rows.size)])
    if g.size == 0:
        return float("nan"), float("nan"), [float("nan")] * len(shares)
    wr = w * cnt
    total = float(wr.sum())
    s1 = cnt * (cnt - 1.0) / 2.0  # sum of j, and of j^2, over a run's steps j = 0..n-1
    s2 = (cnt - 1.0) * cnt * (2.0 * cnt - 1.0) / 6.0
    mean = float((w * (cnt * g + s * s1)).sum() / total)
    u = g - mean
    var = float((w * (cnt * u * u + 2.0 * u * s * s1 + s * s * s2)).sum() / total)
    out: list[float] = []
    lo = g
    hi = g + (cnt - 1.0) * s
    # (unstable sorts: the weights are whole numbers of sequences, so every cumulative weight is
    # exact and the value picked does not depend on the order of equal values)
    o_lo = np.argsort(lo)
    c_lo = np.cumsum(wr[o_lo])
    if (s == 0).all():  # every row one value (single steps, as a speculative run's): hi is lo, sorted once
        o_hi, c_hi = o_lo, c_lo
    else:
        o_hi = np.argsort(hi)
        c_hi = np.cumsum(wr[o_hi])
    for t in shares:
        x_low = lo[o_lo[_pct_hit(c_lo, total, t)]]
        x_up = hi[o_hi[_pct_hit(c_hi, total, t)]]
        below = float(wr[hi < x_low].sum())  # rows wholly below the window
        r = np.flatnonzero((lo <= x_up) & (hi >= x_low))
        gr, sr, nr, wv = g[r], s[r], cnt[r], w[r]
        flat = sr == 0
        # runs of one value (or of one step): one candidate of the run's whole weight
        vals = [gr[flat]]
        wts = [wv[flat] * nr[flat]]
        below += float((wv[flat] * nr[flat])[gr[flat] < x_low].sum())
        if not flat.all():
            gs, ss, ns, ws = gr[~flat], sr[~flat], nr[~flat], wv[~flat]
            # the runs' j inside the window, one either side for rounding (then filtered exactly)
            j0 = np.clip(np.floor((x_low - gs) / ss) - 1.0, 0.0, ns - 1.0)
            j1 = np.clip(np.ceil((x_up - gs) / ss) + 1.0, 0.0, ns - 1.0)
            below += float((ws * j0).sum())  # values before j0 are below x_low
            k = (j1 - j0 + 1.0).astype(np.int64)
            rows = np.repeat(np.arange(gs.size), k)
            jj = np.repeat(j0, k) + _run_index(k)[1]
            v = gs[rows] + jj * ss[rows]
            vw = ws[rows]
            under = v < x_low
            below += float(vw[under].sum())
            vals.append(v[~under])
            wts.append(vw[~under])
        x = np.concatenate(vals)
        xw = np.concatenate(wts)
        inside = (x >= x_low) & (x <= x_up)
        x, xw = x[inside], xw[inside]
        order = np.argsort(x)
        cum = below + np.cumsum(xw[order])
        out.append(float(x[order][_pct_hit(cum, total, t)]))
    return mean, float(np.sqrt(max(var, 0.0))), out


def step_starts(steps: Table) -> tuple[np.ndarray, np.ndarray]:
    """(rows, start_s) of every engine step, run-length rows expanded: step j of a fused run
    starts at start_s + j d0 + slope j (j - 1) / 2 (d0 = chunk_gap_s, slope = gap_step_s)."""
    cnt = _counts(steps)
    start = column(steps, "start_s", np.float64)
    if (cnt == 1).all():
        return np.arange(cnt.size), start
    rows, j = _run_index(cnt)
    d0 = column(steps, "chunk_gap_s", np.float64)[rows]
    slope = column(steps, "gap_step_s", np.float64)[rows]
    return rows, start[rows] + j * d0 + slope * (j * (j - 1) / 2.0)


def expand_steps(steps: Table) -> Frame:
    """One row per engine step (`specrack run --steps full`): each run-length row of n fused
    decode steps becomes n rows with their own start, duration and chunk gap (closed form, as
    the unfused engine computes them to rounding), tokens per step (the row's totals / n), and
    FLOPs and bytes per step as the run's mean (their sums are exact; per step they grow
    slightly with the context). kv_blocks_used repeats the run's last step (after its
    completions); waiting is the same at every step of a run. Rows come in the order the steps
    ended, as the unfused engine logs them."""
    steps = as_frame(steps)
    cnt = _counts(steps)
    if (cnt == 1).all():  # (nothing fused: the table as it is, with the run-length columns it may lack)
        return steps if "count" in steps else steps.with_columns(count=cnt, gap_step_s=np.zeros(len(steps)))
    rows, x = step_starts(steps)
    _, j = _run_index(cnt)
    out = steps.rows(rows)
    fused = cnt[rows] > 1
    n = cnt[rows].astype(np.float64)
    d = out["chunk_gap_s"] + j * out["gap_step_s"]
    out["start_s"] = x
    for c in ("duration_s", "target_s"):
        out[c] = np.where(fused, d, out[c])
    for c in ("decode_tokens", "emitted_tokens", "flops", "bytes"):
        out[c] = out[c] / n
    out["chunk_gap_s"] = np.where(fused, d, out["chunk_gap_s"])
    out["count"] = np.ones(len(out), dtype=np.int64)
    out["gap_step_s"] = np.zeros(len(out))
    # in the order the unfused engine logs steps: by the time each ended
    order = np.argsort(out["start_s"] + out["duration_s"], kind="stable")
    return out.rows(order)


def request_latencies(req: Table) -> Frame:
    """Per-request TTFT, end-to-end latency, TPOT and queueing delay."""
    arr = column(req, "arrival_s", np.float64)
    ttft = column(req, "first_token_s", np.float64) - arr
    e2e = column(req, "completion_s", np.float64) - arr
    out = column(req, "output_tokens")
    with np.errstate(invalid="ignore"):
        tpot = (e2e - ttft) / np.where(out > 1, out - 1.0, np.nan)
    return Frame({"ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot, "queue_s": column(req, "scheduled_s", np.float64) - arr})


def queue_growth_rps(steps: Table) -> float:
    """Growth rate of the waiting queue (requests/s): least-squares slope per replica over every
    engine step's (start, waiting), summed. Run-length rows in closed form (`_run_moments`)."""
    total = 0.0
    cnt = _counts(steps)
    fused = bool((cnt > 1).any())
    rep = column(steps, "replica")
    # each replica's rows in table order (a stable sort by replica, as groupby keeps them), sliced
    order = np.argsort(rep, kind="stable")
    cuts = np.flatnonzero(np.diff(rep[order])) + 1
    cols = ("start_s", "waiting", "count", "chunk_gap_s", "gap_step_s") if fused else ("start_s", "waiting")
    sorted_cols = {c: column(steps, c, np.float64)[order] for c in cols}
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), rep.size], strict=True):
        g = {c: v[lo:hi] for c, v in sorted_cols.items()}
        if fused:
            total += _run_slope(g)
            continue
        x, y = g["start_s"], g["waiting"]
        if x.size >= 3 and np.ptp(x) > 0:
            dx = x - x.mean()  # closed-form least squares: no LAPACK, so no thread-dependent rounding
            total += float((dx * (y - y.mean())).sum() / (dx * dx).sum())
    return total


def _run_slope(g: dict[str, np.ndarray]) -> float:
    """The least-squares slope of waiting on step start over one replica's steps (its columns),
    with each run-length row's n steps at x_j = s + a j + b j (j - 1) / 2 (a = chunk_gap_s,
    b = gap_step_s, the same waiting y): the centred sums from power sums of j, without
    expanding the run."""
    n = g["count"]
    if n.sum() < 3:
        return 0.0
    s = g["start_s"]
    a = g["chunk_gap_s"] * (n > 1)
    b = g["gap_step_s"] * (n > 1)
    y = g["waiting"]
    m = n - 1.0
    s1 = m * n / 2.0  # sum of j over j = 0..n-1
    s2 = m * n * (2.0 * m + 1.0) / 6.0
    s3 = s1 * s1
    s4 = m * n * (2.0 * m + 1.0) * (3.0 * m * m + 3.0 * m - 1.0) / 30.0
    q1, jq, qq = (s2 - s1) / 2.0, (s3 - s2) / 2.0, (s4 - 2.0 * s3 + s2) / 4.0  # q_j = j (j - 1) / 2
    total_n = float(n.sum())
    x_mean = float((n * s + a * s1 + b * q1).sum()) / total_n
    y_mean = float((n * y).sum()) / total_n
    last = s + a * m + b * m * (m - 1.0) / 2.0
    if not float(last.max()) > float(s.min()):
        return 0.0
    u = s - x_mean
    sx = n * u + a * s1 + b * q1  # per row: sum of (x_j - mean)
    sxx = n * u * u + 2.0 * u * (a * s1 + b * q1) + a * a * s2 + 2.0 * a * b * jq + b * b * qq
    return float((sx * (y - y_mean)).sum() / sxx.sum())


def relaxation_s(e2e_mean_s: Any, rho: Any) -> Any:
    """The relaxation time of requests in system at utilisation rho (offered / capacity) with
    mean time in system `e2e_mean_s`: tau / (1 - rho), inf at rho >= 1 (docs/METRICS.md,
    'Planner run length'). Scalars or arrays."""
    tau, r = np.asarray(e2e_mean_s, dtype=np.float64), np.asarray(rho, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(r < 1.0, tau / (1.0 - np.minimum(r, 1.0)), np.inf)
    return float(t) if t.ndim == 0 else t


def in_system(req: Table, times: np.ndarray) -> np.ndarray:
    """Requests in the system (arrived, not completed: waiting or running) at each time."""
    arr = np.sort(column(req, "arrival_s", np.float64))
    comp = np.sort(column(req, "completion_s", np.float64))  # NaN (never completed) sorts last
    comp = comp[np.isfinite(comp)]
    return np.searchsorted(arr, times, "right") - np.searchsorted(comp, times, "right")


def trend(batch_means: np.ndarray) -> tuple[float, float, float]:
    """(growth, t, first-half mean) of a series of batch means: least-squares slope times the
    span, its t statistic (slope over its standard error), and the mean of the first half."""
    y = np.asarray(batch_means, dtype=np.float64)
    b = y.size
    first = float(y[: b // 2].mean()) if b >= 2 else float("nan")
    if b < 3:
        return 0.0, 0.0, first
    x = np.arange(b, dtype=np.float64)
    dx = x - x.mean()
    sxx = float((dx * dx).sum())
    slope = float((dx * (y - y.mean())).sum() / sxx)
    resid = y - y.mean() - slope * dx
    se = float(np.sqrt((resid * resid).sum() / (b - 2) / sxx))
    t = slope / se if se > 0 else (np.inf if slope > 0 else 0.0)
    return slope * (b - 1), float(t), first


def _in_system_trend(req: Table, start_s: float, end_s: float) -> tuple[float, float, float]:
    """Trend (growth, t, first-half mean) of requests in system over [start_s, end_s), sampled
    40 times per batch."""
    k = TREND_BATCHES * 40
    times = start_s + (np.arange(k) + 0.5) * (end_s - start_s) / k
    return trend(in_system(req, times).reshape(TREND_BATCHES, 40).mean(axis=1))


def _ttft_trend(m: Table, start_s: float, end_s: float) -> tuple[float, float, float]:
    """Trend of mean TTFT by arrival time over [start_s, end_s); NaNs when a batch is empty."""
    nan = (float("nan"),) * 3
    if len(m) < 2 * TREND_BATCHES:
        return nan
    ttft = column(m, "first_token_s", np.float64) - column(m, "arrival_s", np.float64)
    which = ((column(m, "arrival_s") - start_s) / (end_s - start_s) * TREND_BATCHES).astype(np.int64)
    which = np.minimum(which, TREND_BATCHES - 1)
    counts = np.bincount(which, minlength=TREND_BATCHES)
    if not (counts > 0).all():
        return nan
    return trend(np.bincount(which, weights=ttft, minlength=TREND_BATCHES) / counts)


class Stability(NamedTuple):
    """A stability test's outcome: its figures (the summary's stability keys: backlog, judged
    requests, the trend statistics), and the verdict they give with the reasons behind it (the
    summary's verdict is decided from it in `sim.summary.verdict_section`, with what else the
    run knows: stopped early, a rate that varies on purpose)."""

    figures: dict[str, Any]
    verdict: str
    reasons: list[str]


def stability(req: Table, *, warmup_s: float, end_s: float, truncated: bool,
              ramp_s: float = 0.0) -> Stability:
    """The stability verdict of a run: 'stable', 'overloaded' or 'insufficient' (docs/METRICS.md).

    Overloaded: stopped early on the backlog limit, requests left unfinished at the horizon, or a
    significant upward trend in requests in system (waiting + running, from the request table)
    or in TTFT (by arrival time). A trend is significant when the least-squares slope over
    TREND_BATCHES batch means has t > TREND_T and grows by more than TREND_REL of the first half's
    mean (plus a small absolute floor); neither bound grows with the window. The system starts
    empty, so requests in system ramp up over a few request lifetimes at any load: their trend is
    judged from SETTLE_LIFETIMES mean service lifetimes (scheduled to completion, so queueing in an
    overload does not stretch them) on, over at least JUDGE_LIFETIMES of them, else the run is too
    short. TTFT (queueing) does not ramp up that way and is judged over the whole window.
    An arrival process whose own rate ramps up from the start (`ramp_s`: conversations,
    `sim.workload.conversation_ramp_s`) makes requests in system and the turn mix grow at any
    load: both trends are then judged from the end of the ramp on, and a run that ends too soon
    after it is too short.
    Insufficient: too short, or fewer than MIN_JUDGED_REQUESTS requests measured."""
    completion = column(req, "completion_s", np.float64)
    arrival = column(req, "arrival_s", np.float64)
    done = ~np.isnan(completion)
    keep = done & (arrival >= warmup_s) & (arrival < end_s)
    # the measured, completed requests' columns used here (from the arrays: no copy of the table)
    m = Frame({"arrival_s": arrival[keep], "first_token_s": column(req, "first_token_s", np.float64)[keep],
               "completion_s": completion[keep], "scheduled_s": column(req, "scheduled_s", np.float64)[keep]})
    tau = float((m["completion_s"] - m["scheduled_s"]).mean()) if len(m) else 0.0
    settle = max(warmup_s, SETTLE_LIFETIMES * tau, ramp_s)
    short = end_s - settle < JUDGE_LIFETIMES * tau
    nan = (float("nan"),) * 3
    growth_l, t_l, mean_l = _in_system_trend(req, settle, end_s) if end_s > warmup_s and not short else nan
    t0 = max(warmup_s, ramp_s)
    m_t = m if t0 == warmup_s else m.rows(m["arrival_s"] >= t0)
    growth_t, t_t, mean_t = _ttft_trend(m_t, t0, end_s) if end_s > t0 and not (short and ramp_s > warmup_s) else nan
    over_l = t_l > TREND_T and growth_l > max(TREND_REL * mean_l, 2.0)  # NaN compares False
    over_t = t_t > TREND_T and growth_t > max(TREND_REL * mean_t, 0.25)
    backlog = int((~done).sum())
    reasons = unfinished(truncated, backlog)
    if over_l:
        reasons.append(f"requests in system grew by {growth_l:.0f} over the window (mean {mean_l:.0f} in its first half)")
    if over_t:
        reasons.append(f"TTFT grew by {growth_t:.2f} s over the window (mean {mean_t:.2f} s in its first half)")
    if reasons:
        verdict = "overloaded"
    elif short and len(m) and ramp_s > warmup_s:
        verdict = "insufficient"
        need = max(2.0 * ramp_s, ramp_s + JUDGE_LIFETIMES * tau)  # half the run judged, past the ramp
        reasons.append(f"run too short to judge: the conversations' arrival rate ramps up until {ramp_s:.0f} s "
                       f"({RAMP_NOTE}), and the window ends {max(end_s - ramp_s, 0.0):.0f} s after it; "
                       f"lengthen duration_s to at least {math.ceil(need / 10.0) * 10:.0f}")
    elif short and len(m):
        verdict = "insufficient"
        reasons.append(f"run too short to judge: {end_s - settle:.0f} s after settling ({settle:.0f} s) is under "
                       f"{JUDGE_LIFETIMES:g} request lifetimes ({tau:.1f} s each); lengthen duration_s")
    elif len(m) < MIN_JUDGED_REQUESTS:
        verdict = "insufficient"
        reasons.append(f"only {len(m)} requests measured (at least {MIN_JUDGED_REQUESTS} needed to judge)")
    else:
        verdict = "stable"
        if ramp_s > warmup_s:
            reasons.append(f"judged from {settle:.0f} s, after the conversations' arrival rate ramps up ({RAMP_NOTE})")
    trend_only = verdict == "overloaded" and not truncated and not backlog
    return Stability({"backlog": backlog, "judged_requests": len(m), "settle_s": settle, "ramp_s": ramp_s,
                      "trend_only": trend_only, "lifetime_s": tau, "in_system_mean": mean_l,
                      "in_system_growth": growth_l, "in_system_trend_t": t_l, "ttft_growth_s": growth_t,
                      "ttft_trend_t": t_t}, verdict, reasons)


RELAX_EVIDENCE = 10.0  # a trend is evidence of overload only over a window of 10 relaxation times (the planner's judged window)
RELAX_WARMUP, RELAX_WINDOW = 3.0, 10.0  # what settles it: 3 relaxation times of warm-up, 10 of window


def against_capacity(verdict: str, reasons: list[str], *, trend_only: bool, rho: float, e2e_mean_s: float,
                     window_s: float) -> tuple[str, list[str]]:
    """An open-loop stationary run's verdict, judged again once its offered load is known as a
    share rho of the deployment's own measured capacity (speculation as configured).

    - rho >= 1: 'overloaded' whatever a short run saw (capacity is the rate a long run sustains).
    - An 'overloaded' that rests only on a trend (no backlog left, not stopped) over a window
      shorter than RELAX_EVIDENCE relaxation times (`relaxation_s`: mean time in system / (1 -
      rho)) is 'insufficient': a load below capacity swings on that time scale, and a short
      window of a swing looks like growth. The reason says how long a run would settle it (the
      planner's rule: RELAX_WARMUP relaxation times of warm-up, RELAX_WINDOW of window).
    Anything else is left as it was (rho NaN: capacity unknown)."""
    if verdict == "unjudged" or rho != rho:
        return verdict, reasons
    if rho >= 1.0:
        why = (f"offered {rho:.2f}x the deployment's own measured capacity: a long run overloads "
               "(capacity is the rate a long run sustains)")
        return "overloaded", [why, *(r for r in reasons if verdict == "overloaded")]
    relax = float(relaxation_s(e2e_mean_s, rho))
    if verdict == "overloaded" and trend_only and window_s < RELAX_EVIDENCE * relax:
        need = (RELAX_WARMUP + RELAX_WINDOW) * relax
        return "insufficient", [*reasons, (
            f"but the window ({window_s:.0f} s) is under {RELAX_EVIDENCE:g} relaxation times of this load "
            f"({relax:.0f} s each at {rho:.2f} of capacity), over which a load below capacity swings as much; "
            f"a run of at least {math.ceil(need / 10.0) * 10:.0f} s ({RELAX_WARMUP:g} relaxation times of warm-up, "
            f"{RELAX_WINDOW:g} of window) would settle it")]
    return verdict, reasons


def unfinished(truncated: bool, backlog: int) -> list[str]:
    """The overload reasons every verdict shares: stopped at the backlog limit, work left over."""
    reasons = ["stopped at the backlog limit"] if truncated else []
    if backlog:
        reasons.append(f"{backlog} requests unfinished at the horizon")
    return reasons


def closed_loop_stability(req: Table, *, warmup_s: float, end_s: float, truncated: bool,
                          concurrency: int, send_lag_s: np.ndarray | None = None) -> Stability:
    """The verdict of a run whose clients cap the requests in system at `concurrency` (a closed
    loop, or an open-loop stream behind max_concurrency), with the figures of `stability` and the
    wait for a free client's trend.

    The server's queue cannot grow: requests in system never exceed `concurrency`, so the
    open-loop trend tests have nothing to find. A closed loop is 'stable' (it measures what N
    clients get) unless fewer than MIN_JUDGED_REQUESTS requests were measured, or the window is
    empty ('insufficient'), or requests were left unfinished ('overloaded'). Behind max_concurrency
    the overload shows in the clients instead: it is 'overloaded' when the wait for a free client
    (`send_lag_s`: send time minus due arrival time) trends up over the window (the same trend
    test as TTFT's, by send time), i.e. the offered rate outruns what N clients can send."""
    done = ~np.isnan(column(req, "completion_s", np.float64))
    arrival = column(req, "arrival_s", np.float64)
    meas = (arrival >= warmup_s) & (arrival < end_s)
    sent = arrival[meas & done]
    nan = float("nan")
    mean_l = float(in_system(req, warmup_s + (np.arange(400) + 0.5) * (end_s - warmup_s) / 400).mean()) \
        if end_s > warmup_s else nan
    growth_g, t_g, mean_g = (nan,) * 3
    if send_lag_s is not None and sent.size >= 2 * TREND_BATCHES and end_s > warmup_s:
        lag = np.asarray(send_lag_s, dtype=np.float64)[meas & done]
        which = np.clip(((sent - warmup_s) / (end_s - warmup_s) * TREND_BATCHES).astype(np.int64), 0, TREND_BATCHES - 1)
        counts = np.bincount(which, minlength=TREND_BATCHES)
        if (counts > 0).all():
            growth_g, t_g, mean_g = trend(np.bincount(which, weights=lag, minlength=TREND_BATCHES) / counts)
    backlog = int((~done).sum())
    reasons = unfinished(truncated, backlog)
    if t_g > TREND_T and growth_g > max(TREND_REL * mean_g, 0.25):  # NaN compares False
        reasons.append(f"the wait for a free client (max_concurrency {concurrency}) grew by {growth_g:.2f} s over "
                       f"the window (mean {mean_g:.2f} s in its first half): the offered rate outruns the clients")
    if reasons:
        verdict = "overloaded"
    elif sent.size < MIN_JUDGED_REQUESTS:
        verdict = "insufficient"
        reasons.append(f"only {sent.size} requests measured (at least {MIN_JUDGED_REQUESTS} needed to judge)"
                       + ("; the window [warmup_s, end) is empty" if end_s <= warmup_s else ""))
    else:
        verdict = "stable"
        reasons.append(f"at most {concurrency} requests in system by construction (mean {mean_l:.1f} over the "
                       "window): the queue cannot grow" + ("; the wait for a free client shows no upward trend"
                                                           if send_lag_s is not None else ""))
    return Stability({"backlog": backlog, "judged_requests": int(sent.size), "settle_s": warmup_s, "in_system_mean": mean_l,
                      "in_system_growth": nan, "in_system_trend_t": nan, "ttft_growth_s": nan, "ttft_trend_t": nan,
                      "client_wait_growth_s": growth_g, "client_wait_trend_t": t_g}, verdict, reasons)


def slo_checks(s: dict[str, Any], targets: dict[str, float]) -> dict[str, dict[str, float | bool]]:
    """Each SLO target (`ttft_p99_s`: 2.0, ...) against the run's figure: target, value, met."""
    out: dict[str, dict[str, float | bool]] = {}
    for key, target in targets.items():
        metric, pct, _ = key.split("_")
        value = float(s[f"{metric}_s"][pct])
        out[key] = {"target": float(target), "value": value, "met": bool(value <= target)}  # NaN never meets
    return out


class SloWatch:
    """Whether a run's SLO verdict is already certain to fail, from what has happened so far
    (`[sim] stop_on_slo_fail`: the planner's long reruns end there; docs/METRICS.md, 'Stopping
    on a certain SLO failure').

    Each percentile target on a per-request figure (TTFT, TPOT, E2E) is judged over the requests
    arriving in the window [warmup_s, end_s) that complete: at most N of them, N known before the
    run. The run's p-th percentile (numpy's linear interpolation over n <= N values) exceeds the
    target once c >= N (1 - p/100) + 2 of those requests have a figure over it (then the two
    values it interpolates between are both over it). A figure is counted only once it is final:
    TTFT once the first token was emitted (it is never rewritten), TPOT and E2E once the request
    completed, each at or before the time of the check, computed as `request_latencies` computes
    it. A request counted that never completes leaves work unfinished at the horizon, which fails
    the run as overloaded. So when the watch fires, the whole run fails its SLO; ITL (a per-step
    figure whose sample count is not known before the run) and mean targets are not watched."""

    def __init__(self, arrival: np.ndarray, output_tokens: np.ndarray, *, warmup_s: float, end_s: float,
                 targets: dict[str, float]) -> None:
        arrival = np.asarray(arrival, dtype=np.float64)
        idx = np.flatnonzero((arrival >= warmup_s) & (arrival < end_s))
        self.idx = idx[np.argsort(arrival[idx], kind="stable")]  # by arrival: a check reads those arrived
        self.arrival = arrival[self.idx]
        out = np.asarray(output_tokens)[self.idx]
        self.per_token = np.where(out > 1, out - 1.0, np.nan)
        n = int(self.idx.size)
        self.judged = n
        self.progress = 0.0
        self.checks: list[tuple[str, str, float, int]] = []  # (target's name, metric, target, requests over it that fail it)
        for key, target in targets.items():
            metric, pct, _ = key.split("_")
            if metric in ("ttft", "tpot", "e2e") and pct.startswith("p"):
                need = math.ceil(n * (100.0 - float(pct[1:])) / 100.0) + 2
                if need <= n:
                    self.checks.append((key, metric, float(target), need))

    def failed(self, first_token: np.ndarray, completion: np.ndarray, now: float) -> dict[str, Any] | None:
        """None, or what makes the SLO fail for certain at simulated time `now`: the target's
        name, the requests already over it, the judged requests and how many over it fail it.
        `progress` keeps, for the last check, the largest share of its count any target reached."""
        k = int(np.searchsorted(self.arrival, now, side="right"))  # (the others have no figure yet)
        f = first_token[self.idx[:k]]
        c = completion[self.idx[:k]]
        self.progress = 0.0
        with np.errstate(invalid="ignore"):
            ttft = f - self.arrival[:k]
            e2e = c - self.arrival[:k]
            done = c <= now
            final = {"ttft": f <= now, "e2e": done, "tpot": done}
            for key, metric, target, need in self.checks:
                x = ttft if metric == "ttft" else e2e if metric == "e2e" else (e2e - ttft) / self.per_token[:k]
                over = int((final[metric] & (x > target)).sum())
                if over >= need:
                    return {"at_s": float(now), "target": key, "over": over, "judged": self.judged, "needed": need}
                self.progress = max(self.progress, over / need)
        return None


def summarise(req: Table, steps: Table, *, warmup_s: float, end_s: float, replicas: int,
              gpus_per_replica: float, peak_flops: float, mem_bw: float, slo: dict[str, float],
              busy_scale: float | None = None, rejected_arrival_s: np.ndarray | None = None,
              host_evicted_blocks: int | None = None) -> dict[str, Any]:
    """The latency and throughput section of a run's summary (see docs/METRICS.md for every
    formula): latencies, throughput, goodput, GPU busy share, MFU and HBM bandwidth use, batch,
    speculation and prefix-caching figures over the window [warmup_s, end_s). Requests the
    deployment rejected (`rejected_arrival_s`: their arrival times) count as offered, never as
    completed. `host_evicted_blocks`: the host tier's evictions over the run (`RunOutput`). `busy_scale`: the
    busy shares' correction when fewer replicas ran than the rack holds (an autoscaled run:
    `sim.summary.fleet_section`), None for every replica running throughout."""
    window = max(end_s - warmup_s, 1e-9)
    lat = request_latencies(req)
    # the request columns as arrays (pandas' per-operation cost is most of a short run's summary)
    arrival = column(req, "arrival_s", np.float64)
    completion = column(req, "completion_s", np.float64)
    meas = (arrival >= warmup_s) & (arrival < end_s)
    md = meas & ~np.isnan(completion)  # measured and completed
    m = {c: column(lat, c, np.float64)[md] for c in ("ttft_s", "tpot_s", "e2e_s", "queue_s")}
    # the steps starting in the window, only the columns each figure needs (a copy of the whole
    # table filtered would be its largest allocation on a long run)
    start_s = column(steps, "start_s", np.float64)
    in_win = (start_s >= warmup_s) & (start_s < end_s)
    whole = bool(in_win.all())

    def st_col(col: str) -> np.ndarray:
        x = column(steps, col)
        return x if whole else x[in_win]

    def st_cols(*cols: str) -> Frame:  # (from the columns' arrays: a masked `loc` copies every column)
        return Frame({c: st_col(c) for c in cols})

    st = st_cols(*(c for c in ("count", "chunk_gap_s", "gap_step_s", "decode_seqs") if c in steps.columns))
    s: dict[str, Any] = {}
    s["ttft_s"] = dist(m["ttft_s"])
    s["tpot_s"] = dist(m["tpot_s"])
    # ITL as vLLM's benchmark measures it: the gap between successive streamed chunks of a request;
    # with steps back to back, a decoding sequence waits one step per chunk, plus the prefill-only
    # steps that ran meanwhile (separate prefill): the step table's chunk_gap_s
    s["itl_s"] = gap_dist(st)
    s["itl_samples"] = int((st["decode_seqs"] * _counts(st)).sum())
    del st  # streamed-chunk gaps behind those percentiles
    s["e2e_s"] = dist(m["e2e_s"])
    s["queue_s"] = dist(m["queue_s"])
    offered = int(meas.sum())
    if rejected_arrival_s is not None and rejected_arrival_s.size:
        offered += int(((rejected_arrival_s >= warmup_s) & (rejected_arrival_s < end_s)).sum())
    completed_in_window = int(((completion >= warmup_s) & (completion < end_s)).sum())
    s["offered_requests"] = offered
    s["completed_requests"] = int(md.sum())
    s["offered_rps"] = offered / window
    s["throughput_rps"] = completed_in_window / window
    s["throughput_tok_s"] = float(st_col("emitted_tokens").sum()) / window
    # goodput as vLLM's benchmark defines it: requests meeting every per-request target (TTFT, TPOT,
    # E2E; the loosest percentile's value when several are set); ITL is a per-chunk figure
    good = np.ones(int(md.sum()), dtype=bool)
    for metric in ("ttft", "tpot", "e2e"):
        bounds = [v for k, v in slo.items() if k.startswith(metric + "_")]
        if bounds:
            col = m[f"{metric}_s"]
            good &= (col <= max(bounds)) | np.isnan(col)
    s["goodput_rps"] = float(good.sum()) / window
    s["slo_attainment"] = float(good.mean()) if good.size else float("nan")
    dur = st_col("duration_s")
    busy = float(dur.sum())
    s["gpu_busy_fraction"] = busy / (window * replicas)
    gpu_time = window * replicas * gpus_per_replica  # step FLOPs and bytes are per replica, all its GPUs
    s["mfu"] = float(st_col("flops").sum()) / (gpu_time * peak_flops)
    s["hbm_bw_utilisation"] = float(st_col("bytes").sum()) / (gpu_time * mem_bw)
    if busy_scale is not None:  # over the replicas actually running in the window
        for key in ("gpu_busy_fraction", "mfu", "hbm_bw_utilisation"):
            s[key] = s[key] * busy_scale
    s["mean_batch_size"] = float((st_col("batch_size") * dur).sum() / dur.sum()) if dur.sum() > 0 else 0.0
    del dur
    def req_sum(col: str) -> float:  # (NaN skipped, as pandas' sum skips it)
        return float(np.nansum(column(req, col)[meas]))

    s["preemptions"] = int(req_sum("preemptions"))
    # speculation, over the window like everything else: requests arriving in it, steps starting in it
    prop = req_sum("draft_proposed")
    s["acceptance_rate"] = req_sum("draft_accepted") / prop if prop else float("nan")
    vs = req_sum("verify_steps")
    s["tokens_per_step"] = req_sum("verify_emitted") / vs if vs else 1.0
    s["draft_share"] = float(st_col("draft_s").sum()) / busy if busy else 0.0
    s["spec_overhead_share"] = float(st_col("spec_overhead_s").sum()) / busy if busy else 0.0
    s["queue_growth_rps"] = queue_growth_rps(st_cols(*(c for c in ("replica", "start_s", "waiting", "count", "chunk_gap_s",
                                                                   "gap_step_s") if c in steps.columns)))
    if "cached_tokens" in req.columns:
        s.update(prefix_cache_metrics(as_frame(req).rows(meas), lat.rows(meas), host_evicted_blocks))
    return s


def prefix_cache_metrics(req: Table, lat: Table, host_evicted_blocks: int | None = None) -> dict[str, Any]:
    """Prefix caching over the measured requests that were admitted (docs/METRICS.md, 'Prefix
    caching'): the token hit rate (prompt tokens found cached at the first admission / prompt
    tokens, what a trace's hash arithmetic counts), the share of requests that hit, the prefill
    tokens saved at first admission and computed (all admissions), the prefill redone after
    preemptions (what the re-admissions prefilled beyond the prompt's first prefill, and how much
    of it the cache served again), the requests preempted, and TTFT split by hit (some prompt
    tokens cached) and miss. With a host tier (a `host_cached_tokens` column), the hit rate by
    tier, TTFT by the tier a hit reached (HBM only, or some tokens loaded from the host tier), and
    `host_evicted_blocks`, the blocks the host tier dropped over the whole run."""
    admitted = column(req, "prefill_tokens") > 0
    cached = column(req, "cached_tokens", np.int64)[admitted]
    prompt = column(req, "prompt_tokens", np.int64)[admitted]
    hit = cached > 0
    ttft = column(lat, "ttft_s", np.float64)[admitted]
    prompt_sum = int(prompt.sum())
    # a preempted request prefills again: prefill_tokens - prompt_tokens beyond its first prefill,
    # prefill_cached_tokens - cached_tokens of it from the cache (both 0 for one never preempted)
    again = int(column(req, "prefill_tokens", np.int64)[admitted].sum()) - prompt_sum
    again_cached = int(column(req, "prefill_cached_tokens", np.int64)[admitted].sum()) - int(cached.sum())
    out = {
        "cache_hit_rate": float(cached.sum()) / prompt_sum if prompt_sum else float("nan"),
        "cache_request_hit_rate": float(hit.mean()) if hit.size else float("nan"),
        "prefill_tokens_saved": int(cached.sum()),
        "prefill_tokens_computed": int(column(req, "prefill_computed_tokens", np.int64)[admitted].sum()),
        "prefill_tokens_after_preemption": again,
        "prefill_tokens_cached_after_preemption": again_cached,
        "preempted_requests": int((column(req, "preemptions")[admitted] > 0).sum()),
        "ttft_hit_s": dist(ttft[hit]),
        "ttft_miss_s": dist(ttft[~hit]),
    }
    if "host_cached_tokens" in req.columns:
        host = column(req, "host_cached_tokens", np.int64)[admitted]
        from_host = host > 0
        out.update({
            "cache_hbm_hit_rate": float((cached - host).sum()) / prompt_sum if prompt_sum else float("nan"),
            "cache_host_hit_rate": float(host.sum()) / prompt_sum if prompt_sum else float("nan"),
            "ttft_hbm_hit_s": dist(ttft[hit & ~from_host]),
            "ttft_host_hit_s": dist(ttft[from_host]),
            "host_evicted_blocks": host_evicted_blocks,
        })
    return out


def bench_metrics(req: Table, steps: Table) -> dict[str, float]:
    """A benchmark's figures as `vllm bench serve` names and computes them (vllm/benchmarks/serve.py):
    duration from the first send to the last completion, request/output/total-token throughput
    over it, and mean/median/std/p90/p99 in ms of TTFT (from the send), TPOT (per request with
    more than one output token: (latency - TTFT) / (output - 1)), ITL (every streamed-chunk gap,
    pooled) and E2E latency (`e2el`). Over the whole tables (a benchmark has no warm-up)."""
    completion = column(req, "completion_s", np.float64)
    ok = ~np.isnan(completion)  # the completed requests (from the columns' arrays: no table copy)
    n_done = int(ok.sum())
    if not n_done:
        return {"completed": 0.0}
    arrival = column(req, "arrival_s", np.float64)
    start = float(np.nanmin(arrival))
    duration = float(completion[ok].max()) - start
    ttft = column(req, "first_token_s", np.float64)[ok] - arrival[ok]
    e2el = completion[ok] - arrival[ok]
    out_tok = column(req, "output_tokens")[ok]
    prompt_tok = column(req, "prompt_tokens")[ok]
    many = out_tok > 1
    tpot = (e2el[many] - ttft[many]) / (out_tok[many] - 1)
    out: dict[str, float] = {
        "completed": float(n_done), "duration": duration,
        "total_input_tokens": float(prompt_tok.sum()), "total_output_tokens": float(out_tok.sum()),
        "request_throughput": n_done / duration, "output_throughput": float(out_tok.sum()) / duration,
        "total_token_throughput": float(out_tok.sum() + prompt_tok.sum()) / duration,
    }
    for name, x in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        out.update(_stats(name, x, None))
    # ITL pooled over every streamed-chunk gap: each decoding sequence of a step waited chunk_gap_s
    # (run-length rows in closed form: `gap_moments`, the same percentiles as expanding them)
    mean, std, (p50, p90, p99) = gap_moments(steps, (0.5, 0.9, 0.99))
    out.update({"mean_itl_ms": mean * 1e3, "median_itl_ms": p50 * 1e3, "std_itl_ms": std * 1e3,
                "p90_itl_ms": p90 * 1e3, "p99_itl_ms": p99 * 1e3})
    return out


def _stats(name: str, x: np.ndarray, w: np.ndarray | None) -> dict[str, float]:
    """mean/median/std/p90/p99 in ms, as vLLM's `process_one_metric` names them."""
    x = np.asarray(x, dtype=np.float64) * 1e3
    unweighted = w is None
    if w is None:
        w = np.ones_like(x)
    keep = np.isfinite(x) & (w > 0)
    x, w = x[keep], np.asarray(w, dtype=np.float64)[keep]
    if x.size == 0:
        return {f"{s}_{name}_ms": float("nan") for s in ("mean", "median", "std", "p90", "p99")}
    if unweighted:  # equal weights: the sorted values are all the order is needed for
        xs, cum = np.sort(x), np.cumsum(w) / w.sum()
    else:
        order = np.argsort(x, kind="stable")
        xs, cum = x[order], np.cumsum(w[order]) / w.sum()
    mean = float((x * w).sum() / w.sum())

    def pct(p: float) -> float:
        return float(xs[min(int(np.searchsorted(cum, p)), xs.size - 1)])

    return {f"mean_{name}_ms": mean, f"median_{name}_ms": pct(0.5),
            f"std_{name}_ms": float(np.sqrt((w * (x - mean) ** 2).sum() / w.sum())),
            f"p90_{name}_ms": pct(0.9), f"p99_{name}_ms": pct(0.99)}


def replica_counts(timeline: list[tuple[float, int, int]] | None, replicas: int,
                   billed: tuple[int, ...] = (1, 2, 3)) -> tuple[np.ndarray, np.ndarray]:
    """(knots t, F(t)): the integral over [0, t] of the number of replicas whose state code is in
    `billed` (sim.fleet: 0 off, 1 warming, 2 live, 3 draining), at every change, as a piecewise
    linear function to interpolate (np.interp is exact on it). Without a timeline every replica
    counts from 0 on."""
    if not timeline:
        return np.array([0.0, 1.0]), np.array([0.0, float(replicas)])
    state = np.zeros(replicas, dtype=np.int64)
    times: list[float] = []
    counts: list[int] = []
    events = sorted(timeline, key=lambda e: e[0])  # stable: same-time changes in the order they happened
    i = 0
    while i < len(events):
        t = events[i][0]
        while i < len(events) and events[i][0] == t:
            state[events[i][1]] = events[i][2]
            i += 1
        times.append(t)
        counts.append(int(np.isin(state, billed).sum()))
    if times[0] > 0:
        times.insert(0, 0.0)
        counts.insert(0, 0)
    t_arr = np.array([*times, times[-1] + 1.0])
    c_arr = np.array(counts, dtype=np.float64)
    f = np.concatenate([[0.0], np.cumsum(np.diff(t_arr) * c_arr)])
    return t_arr, f


def replica_seconds(knots: tuple[np.ndarray, np.ndarray], a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """Replica-seconds over [a, b) from `replica_counts` (the count after the last change holds on)."""
    t, f = knots
    slope = (f[-1] - f[-2]) / (t[-1] - t[-2])

    def at(x: np.ndarray) -> np.ndarray:
        return np.where(x <= t[-1], np.interp(x, t, f), f[-1] + slope * (x - t[-1]))

    return at(np.asarray(b, dtype=np.float64)) - at(np.asarray(a, dtype=np.float64))


INTERVAL_PERCENTILES = ("mean", "p50", "p90", "p99")


def intervals(req: Table, steps: Table, *, interval_s: float, end_s: float, replicas: int,
              gpus_per_replica: float, timeline: list[tuple[float, int, int]] | None = None,
              replica_capacity_rps: float = float("nan"), slo: dict[str, float] | None = None) -> Frame:
    """One row per interval [k interval_s, (k + 1) interval_s) of [0, end_s) (docs/METRICS.md,
    'Intervals'): request latencies of the requests arriving in it, ITL, throughput and busy time
    of the engine steps starting in it (exact: fused runs never straddle an interval's end),
    replicas running (billed: warming, live or draining) and live as time means, GPU-hours, the
    load (offered rate over the live replicas' speculation-off capacity), the share of decode
    work done speculating, and each SLO target checked on the interval's own percentiles."""
    n = max(1, int(np.ceil(end_s / interval_s - 1e-9)))
    edges = np.minimum(np.arange(n + 1) * interval_s, end_s)
    edges[-1] = end_s
    a, b = edges[:-1], edges[1:]
    width = b - a
    lat = request_latencies(req)
    arr = column(req, "arrival_s", np.float64)
    which = np.searchsorted(edges, arr, "right") - 1
    done = ~np.isnan(column(req, "completion_s", np.float64))
    s_start = column(steps, "start_s", np.float64)
    s_which = np.searchsorted(edges, s_start, "right") - 1
    # the step rows of each interval, contiguous once sorted (a run-length row lies wholly inside
    # one interval: fused runs never straddle an interval's end), so an interval's ITL comes from
    # its rows without expanding them (`gap_dist`) and no per-interval mask covers the whole table
    s_order = np.argsort(s_which, kind="stable")
    s_bounds = np.searchsorted(s_which[s_order], np.arange(n + 1), "left")
    cols = [c for c in steps.columns if c in ("duration_s", "emitted_tokens", "decode_tokens", "k", "count",
                                                 "chunk_gap_s", "gap_step_s", "decode_seqs")]
    sub = Frame({c: column(steps, c)[s_order] for c in cols})  # sorted by interval once: an interval's rows are a slice
    billed = replica_counts(timeline, replicas)
    live = replica_counts(timeline, replicas, billed=(2,))
    run_s = replica_seconds(billed, a, b)
    live_s = replica_seconds(live, a, b)
    lat_np = {name: column(lat, name) for name in lat.columns}
    completion = column(req, "completion_s", np.float64)
    rows = []
    for i in range(n):
        here = which == i
        m = here & done
        st = sub.rows(slice(s_bounds[i], s_bounds[i + 1]))
        itl = gap_dist(st) if len(st) else None
        row: dict[str, Any] = {"start_s": float(a[i]), "end_s": float(b[i])}
        row["offered_requests"] = int(here.sum())
        row["offered_rps"] = row["offered_requests"] / width[i]
        row["completed_requests"] = int(m.sum())
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            d = dist(lat_np[name][m])
            for p in INTERVAL_PERCENTILES:
                row[f"{name}_{p}"] = d[p]
        for p in INTERVAL_PERCENTILES:
            row[f"itl_s_{p}"] = itl[p] if itl is not None else float("nan")
        busy = float(st["duration_s"].sum())
        row["throughput_tok_s"] = float(st["emitted_tokens"].sum()) / width[i]
        row["throughput_rps"] = float(((completion >= a[i]) & (completion < b[i])).sum()) / width[i]
        row["replicas_running"] = float(run_s[i]) / width[i]
        row["replicas_live"] = float(live_s[i]) / width[i]
        row["gpu_hours"] = float(run_s[i]) * gpus_per_replica / 3600.0
        row["gpu_busy_fraction"] = busy / float(run_s[i]) if run_s[i] > 0 else float("nan")
        row["load_utilisation"] = (row["offered_rps"] / (row["replicas_live"] * replica_capacity_rps)
                                   if row["replicas_live"] > 0 and replica_capacity_rps > 0 else float("nan"))
        dec = column(st, "decode_tokens", np.float64)
        row["speculating_share"] = float(dec[column(st, "k") > 0].sum() / dec.sum()) if dec.sum() > 0 else 0.0
        met = True
        for key, target in (slo or {}).items():
            metric, pct, _ = key.split("_")
            if pct in INTERVAL_PERCENTILES:
                value = row[f"{metric}_s_{pct}"]
            elif metric == "itl":
                value = itl[pct] if itl is not None else float("nan")
            else:
                value = float(dist(lat_np[f"{metric}_s"][m])[pct])
            ok = bool(value <= target) or row["completed_requests"] == 0
            row[f"slo_{key}_met"] = ok
            met &= ok
        row["slo_met"] = met
        rows.append(row)
    return Frame({k: np.array([r[k] for r in rows]) for k in rows[0]})
