"""Why a speculative speedup changes with load: a run's latency split into the costs it is made of,
and the change of a speedup between two loads attributed to them.

A latency is split from the request and step tables (no extra run):
- `queue`: the time to first token (queueing, the prompt's prefill and the drafter's);
- the decode time (end-to-end less TTFT), split over the steps each decoding sequence sat through,
  by what each step's time was spent on (the step table's columns, weighted by its decoding
  sequences): `target` (the target pass: verification, and the prefill chunks sharing the step),
  `draft` (the drafter's passes and its prefill), `host` (the speculation machinery and the host
  work it serialises: `spec_overhead_s`), and `stall` (prefill-only steps a decoding sequence
  waited through, `chunk_gap_s` beyond the step).

For a latency metric the speedup is S = E_b / E_s (reference over speculative). Between a light
load 0 and a load 1, with E = sum of its parts and L the logarithmic mean of E at the two loads,
    ln S1 - ln S0 = sum over parts of  dE_b,part / L_b  -  dE_s,part / L_s     (exactly)
and each cause is the pair of terms it owns:
- verification compute: the target parts (how much faster the speculative target pass per token
  grew than the reference's);
- drafter compute and host work: the speculative side's draft and host parts (the reference has
  none);
- queueing: the queue and stall parts of both sides;
- drafter KV (fewer admitted): the change of ln E_s at load 1 when the drafter's KV is given back
  (a second run at load 1 without it, `kv_free`), taken out of queueing; zero without that run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.frame import column

if TYPE_CHECKING:
    from sim.frame import Table

PARTS = ("queue", "target", "draft", "host", "stall")
CAUSES = ("verify", "draft", "host", "kv", "queue")
CAUSE_NAMES = {"verify": "verification compute", "draft": "drafter compute", "host": "host work",
               "kv": "drafter KV (fewer admitted)", "queue": "queueing"}
METRICS = ("tpot", "e2e")


def _fsum(x: np.ndarray) -> float:
    """math.fsum of the nonzero terms (the same exactly rounded sum: zeros add nothing, and the
    terms here are never negative, so no -0.0 is lost): a run without drafts, host work or stalls
    sums nothing for them."""
    return math.fsum(x[x != 0.0])


def step_shares(steps: Table, t0: float = -math.inf, t1: float = math.inf) -> dict[str, float]:
    """Shares of the time decoding sequences spent in steps starting in [t0, t1), by what the
    steps did (target, draft, host, stall), each step weighted by its decoding sequences (a
    run-length row counts its every step: its columns hold the run's totals)."""
    start = column(steps, "start_s", np.float64)
    seqs = column(steps, "decode_seqs")
    keep = (start >= t0) & (start < t1) & (seqs > 0)

    def col(name: str) -> np.ndarray:  # (only the columns used, only the rows kept: no copy of the table)
        return column(steps, name, np.float64)[keep]

    n = seqs[keep].astype(np.float64)
    dur = col("duration_s")
    target = col("target_s")
    draft = col("draft_s")
    host = col("spec_overhead_s")
    single = column(steps, "count")[keep] == 1
    stall = np.where(single, np.maximum(col("chunk_gap_s") - dur, 0.0), 0.0)
    # what the step's time holds beyond its priced parts (none today; kept so shares sum to 1)
    rest = np.maximum(dur - target - draft - host, 0.0)
    # exactly rounded sums, so the same steps give the same bits whatever their order
    w = {"target": _fsum(n * (target + rest)), "draft": _fsum(n * draft), "host": _fsum(n * host),
         "stall": _fsum(n * stall)}
    total = sum(w.values())
    if total <= 0:
        return {"target": 1.0, "draft": 0.0, "host": 0.0, "stall": 0.0}
    return {k: v / total for k, v in w.items()}


def latency_parts(requests: Table, steps: Table, metric: str = "tpot", t0: float = -math.inf,
                  t1: float = math.inf, shares: dict[str, float] | None = None) -> dict[str, float]:
    """The mean `metric` ("tpot": time per output token; "e2e": end-to-end latency) of the
    requests that arrived in [t0, t1) and completed, split into PARTS (seconds; they sum to the
    mean). NaN parts when no request qualifies. `shares`: `step_shares(steps, t0, t1)` when
    already computed (a run's summary splits both metrics over the same steps)."""
    if metric not in METRICS:
        raise ValueError(f"latency_parts: metric must be one of {METRICS}, got {metric!r}")
    arrival = column(requests, "arrival_s", np.float64)
    completion = column(requests, "completion_s", np.float64)
    keep = (arrival >= t0) & (arrival < t1) & ~np.isnan(completion)
    out_tok = column(requests, "output_tokens")
    if metric == "tpot":
        keep &= out_tok > 1
    if not keep.any():
        return dict.fromkeys(PARTS, math.nan)
    first = column(requests, "first_token_s", np.float64)[keep]
    ttft = first - arrival[keep]
    decode = completion[keep] - first
    if metric == "tpot":
        queue, dec = 0.0, float(np.mean(decode / (out_tok[keep].astype(np.float64) - 1.0)))
    else:
        queue, dec = float(ttft.mean()), float(decode.mean())
    if shares is None:
        shares = step_shares(steps, t0, t1)
    return {"queue": queue, **{k: dec * v for k, v in shares.items()}}


def _logmean(a: float, b: float) -> float:
    return a if abs(a - b) <= 1e-12 * max(a, b) else (b - a) / (math.log(b) - math.log(a))


def attribute(base0: dict[str, float], spec0: dict[str, float], base1: dict[str, float],
              spec1: dict[str, float], kv_free1: dict[str, float] | None = None) -> dict[str, float]:
    """The change of ln(speedup) from load 0 to load 1 (`dln_speedup`) and each cause's share of
    it (CAUSES, in ln points; they sum to `dln_speedup`), from the latency parts of the reference
    (`base`) and the speculative run (`spec`) at each load, and of the speculative run at load 1
    with the drafter's KV given back (`kv_free1`, optional). The module docstring has the rule."""
    eb0, eb1 = sum(base0.values()), sum(base1.values())
    es0, es1 = sum(spec0.values()), sum(spec1.values())
    if not all(math.isfinite(x) and x > 0 for x in (eb0, eb1, es0, es1)):
        return {"dln_speedup": math.nan, **dict.fromkeys(CAUSES, math.nan)}
    lb, ls = _logmean(eb0, eb1), _logmean(es0, es1)

    def d(p0: dict[str, float], p1: dict[str, float], key: str) -> float:
        return p1.get(key, 0.0) - p0.get(key, 0.0)

    out = {
        "verify": d(base0, base1, "target") / lb - d(spec0, spec1, "target") / ls,
        "draft": -d(spec0, spec1, "draft") / ls + d(base0, base1, "draft") / lb,
        "host": -d(spec0, spec1, "host") / ls + d(base0, base1, "host") / lb,
        "queue": (d(base0, base1, "queue") + d(base0, base1, "stall")) / lb
        - (d(spec0, spec1, "queue") + d(spec0, spec1, "stall")) / ls,
        "kv": 0.0,
    }
    if kv_free1 is not None:
        ek = sum(kv_free1.values())
        if math.isfinite(ek) and ek > 0:
            out["kv"] = math.log(ek / es1)  # < 0 when the drafter's KV cost the speculative run
            out["queue"] -= out["kv"]
    return {"dln_speedup": math.log(eb1 / eb0) - math.log(es1 / es0), **{c: out[c] for c in CAUSES}}


def shares(attr: dict[str, Any], floor: float = 0.02) -> dict[str, float]:
    """Each cause's fraction of the change (summing to 1); NaN when the change is under `floor`
    ln points (about 2%: a fraction of nothing says nothing)."""
    dl = attr.get("dln_speedup", math.nan)
    if not math.isfinite(dl) or abs(dl) < floor:
        return dict.fromkeys(CAUSES, math.nan)
    return {c: attr[c] / dl for c in CAUSES}


def main_cause(attr: dict[str, Any]) -> str:
    """The cause that moved the speedup most in the direction it moved ('' when nothing moved)."""
    dl = attr.get("dln_speedup", math.nan)
    if not math.isfinite(dl) or dl == 0:
        return ""
    best = max(CAUSES, key=lambda c: attr[c] * math.copysign(1.0, dl))
    return CAUSE_NAMES[best]


__all__ = ["CAUSES", "CAUSE_NAMES", "PARTS", "attribute", "latency_parts", "main_cause", "shares", "step_shares"]
