"""Metrics as pure functions of the request and step tables. Formulas: docs/METRICS.md.

Names are fixed here, in `summarise`. Warm-up is excluded: request metrics use requests
arriving in [warmup_s, end_s); step metrics use steps starting in that window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

PERCENTILES = (50, 90, 99)


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


def request_latencies(req: pd.DataFrame) -> pd.DataFrame:
    """Per-request TTFT, end-to-end latency, TPOT and queueing delay."""
    ttft = req.first_token_s - req.arrival_s
    e2e = req.completion_s - req.arrival_s
    tpot = (e2e - ttft) / (req.output_tokens - 1).where(req.output_tokens > 1)
    return pd.DataFrame({"ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot, "queue_s": req.scheduled_s - req.arrival_s})


def queue_growth_rps(steps: pd.DataFrame) -> float:
    """Growth rate of the waiting queue (requests/s): least-squares slope per replica, summed."""
    total = 0.0
    for _, g in steps.groupby("replica"):
        x = g.start_s.to_numpy(np.float64)
        y = g.waiting.to_numpy(np.float64)
        if x.size >= 3 and np.ptp(x) > 0:
            dx = x - x.mean()  # closed-form least squares: no LAPACK, so no thread-dependent rounding
            total += float((dx * (y - y.mean())).sum() / (dx * dx).sum())
    return total


def summarise(req: pd.DataFrame, steps: pd.DataFrame, *, warmup_s: float, end_s: float, replicas: int,
              gpus_per_replica: int, peak_flops: float, mem_bw: float, slo_ttft_s: float, slo_itl_s: float,
              truncated: bool, horizon_s: float, max_num_seqs: int = 256) -> dict[str, Any]:
    """The summary of one run (see docs/METRICS.md for every formula)."""
    window = max(end_s - warmup_s, 1e-9)
    lat = request_latencies(req)
    meas = (req.arrival_s >= warmup_s) & (req.arrival_s < end_s)
    done = req.completion_s.notna()
    m = lat[meas & done]
    st = steps[(steps.start_s >= warmup_s) & (steps.start_s < end_s)]
    s: dict[str, Any] = {}
    s["ttft_s"] = dist(m.ttft_s.to_numpy())
    s["tpot_s"] = dist(m.tpot_s.to_numpy())
    # ITL as vLLM's benchmark measures it: the gap between successive streamed chunks of a request;
    # with steps back to back, a decoding sequence waits one step duration per chunk
    s["itl_s"] = dist(st.duration_s.to_numpy(), st.decode_seqs.to_numpy())
    s["e2e_s"] = dist(m.e2e_s.to_numpy())
    s["queue_s"] = dist(m.queue_s.to_numpy())
    offered = int(meas.sum())
    completed_in_window = int(((req.completion_s >= warmup_s) & (req.completion_s < end_s)).sum())
    s["offered_requests"] = offered
    s["completed_requests"] = int((meas & done).sum())
    s["offered_rps"] = offered / window
    s["throughput_rps"] = completed_in_window / window
    s["throughput_tok_s"] = float(st.emitted_tokens.sum()) / window
    good = (m.ttft_s <= slo_ttft_s) & ((m.tpot_s <= slo_itl_s) | m.tpot_s.isna())
    s["goodput_rps"] = float(good.sum()) / window
    s["slo_attainment"] = float(good.mean()) if len(m) else float("nan")
    s["gpu_busy_fraction"] = float(st.duration_s.sum()) / (window * replicas)
    gpu_time = window * replicas * gpus_per_replica  # step FLOPs and bytes are per replica, all its GPUs
    s["mfu"] = float(st.flops.sum()) / (gpu_time * peak_flops)
    s["hbm_bw_utilisation"] = float(st.bytes.sum()) / (gpu_time * mem_bw)
    dur = st.duration_s.to_numpy()
    s["mean_batch_size"] = float((st.batch_size.to_numpy() * dur).sum() / dur.sum()) if dur.sum() > 0 else 0.0
    s["preemptions"] = int(req.preemptions[meas].sum())
    # speculation, over the window like everything else: requests arriving in it, steps starting in it
    rw = req[meas]
    prop = float(rw.draft_proposed.sum())
    s["acceptance_rate"] = float(rw.draft_accepted.sum()) / prop if prop else float("nan")
    vs = float(rw.verify_steps.sum())
    s["tokens_per_step"] = float(rw.verify_emitted.sum()) / vs if vs else 1.0
    busy = float(st.duration_s.sum())
    s["draft_share"] = float(st.draft_s.sum()) / busy if busy else 0.0
    s["spec_overhead_share"] = float(st.spec_overhead_s.sum()) / busy if busy else 0.0
    # stability: no early stop, everything offered finished before the horizon, and the waiting
    # queue did not grow over the window (least-squares slope per replica, summed) by more than a
    # quarter of the rack's batch slots or 5% of the offered requests
    unfinished = int((~done).sum())
    growth = queue_growth_rps(st)
    s["backlog"] = unfinished
    s["queue_growth_rps"] = growth
    limit = max(0.25 * replicas * max_num_seqs, 0.05 * offered)
    s["stable"] = bool(not truncated and unfinished == 0 and growth * window <= limit)
    s["truncated"] = bool(truncated)
    s["horizon_s"] = float(horizon_s)
    return s
