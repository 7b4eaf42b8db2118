"""The planner's answer where no rack passes: for an option (strategy x GPU type) with no rack
within max_gpus meeting the SLO, its closest rack (the largest one tried, or the configuration
that came closest), the constraint that binds there (an SLO target by name, stability, the
rack's capacity, memory, max_gpus), how far it misses (value against target), and the cheapest
change that would pass: more GPUs than max_gpus (estimated from the capacity per replica where
throughput binds), a looser target (the value that rack achieves) or another GPU type of the
plan that passes. Also the requests a run rejected (longer than max_model_len), with the fix.

Columns (plan.csv; NaN on rows that pass): `closest_replicas`, `closest_gpus`, `miss_constraint`,
`miss_value`, `miss_target`, `miss_ratio` (value / target: how many times over), `miss_detail`,
`fix_max_gpus`, `fix_slo`, `fix_gpu`, `fix`; on every simulated row `rejected_requests`,
`sent_requests`, `rejected_share`, `rejected_reason`."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from sim.deployment import build_runtime, rejection_fix, rejection_reason
from sim.scenario import Scenario

REJECTED_WARN = 0.01  # a plan says so in one line when a run rejects more than this share of its requests
LATENCY_BOUND_UTILISATION = 0.5  # below it a rack's latency is its service time: more replicas barely move it


def _ms(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.2g} ms"


def _label(key: str) -> str:
    """'ttft_p99_s' -> 'p99 TTFT'."""
    parts = key.removesuffix("_s").split("_")
    return f"{parts[1]} {parts[0].upper()}" if len(parts) == 2 and parts[1].startswith("p") else key


def _ceil3(x: float) -> float:
    """x rounded up to three significant digits (a target that the value meets)."""
    if not x > 0 or not math.isfinite(x):
        return x
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return math.ceil(x / step - 1e-9) * step


def slo_misses(sm: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(check, value, target) of every SLO check a run misses, worst (value / target) first."""
    out = [(k, float(c["value"]), float(c["target"])) for k, c in sm.get("slo", {}).items() if not c["met"]]
    return sorted(out, key=lambda m: -(m[1] / m[2]) if m[1] == m[1] else -math.inf)


def run_miss(ev: dict[str, Any], rate: float, rack_capacity: float | None) -> dict[str, Any]:
    """What binds on one evaluated rack (`plan_search.evaluate`'s answer) that fails: the
    constraint, its value, target and ratio, and a line saying so."""
    rho = rate / rack_capacity if rack_capacity else float("nan")
    sm = ev.get("summary")
    if sm is None:  # failed unrun (offered its capacity or more) or too close to it to settle
        return {"miss_constraint": "capacity", "miss_value": rate, "miss_target": rack_capacity, "miss_ratio": rho,
                "miss_detail": f"{rate:.2f} req/s offered against a capacity of {rack_capacity:.2f} req/s ({rho:.0%}): "
                               f"{ev.get('reason', '')}"}
    if not sm.get("stable", sm.get("verdict") == "stable") and sm.get("verdict") != "unjudged":
        why = sm.get("verdict_reason") or sm.get("verdict", "")
        return {"miss_constraint": "stability", "miss_value": rate, "miss_target": rack_capacity, "miss_ratio": rho,
                "miss_detail": f"not stable at {rho:.0%} of its capacity ({why})"}
    misses = slo_misses(sm)
    if not misses:  # (a fail with every target met: unjudged otherwise)
        return {"miss_constraint": "stability", "miss_value": rate, "miss_target": rack_capacity, "miss_ratio": rho,
                "miss_detail": str(sm.get("verdict_reason", "not judged stable"))}
    k, v, t = misses[0]
    others = ", ".join(f"{_label(k2)} {_ms(v2)} vs {_ms(t2)}" for k2, v2, t2 in misses[1:] if v2 == v2)
    detail = (f"{_label(k)} {_ms(v)} vs a target of {_ms(t)} ({v / t:.3g}x)" if v == v
              else f"{_label(k)} over its target of {_ms(t)} (the run stopped once that was certain)")
    return {"miss_constraint": k, "miss_value": v, "miss_target": t, "miss_ratio": v / t if v == v else float("nan"),
            "miss_detail": detail + (f"; also {others}" if others else "")}


def gpus_fix(miss: dict[str, Any], *, rate: float, cap_rps: float | None, per: int, replicas: int, extra: int,
             max_gpus: int) -> tuple[float, str, str]:
    """More GPUs than max_gpus: (GPUs estimated to pass, NaN when not estimated; the change in
    words; or, where a latency target binds, a note on whether more GPUs would help), estimated
    from the capacity per replica where throughput or stability binds."""
    c = miss["miss_constraint"]
    if c == "capacity" and cap_rps:
        need = math.floor(rate / cap_rps + 1e-9) + 1 + extra  # no rack carries its capacity or more
        gpus = max(need, replicas + 1 + extra) * per
        return float(gpus), (f"more GPUs: at least {gpus} ({gpus // per} replicas x {cap_rps:.2f} req/s > {rate:.2f} req/s; "
                             f"raise search.max_gpus from {max_gpus})"), ""
    if c == "stability":
        gpus = (replicas + 1 + extra) * per
        return float(gpus), f"more GPUs: at least {gpus} (one replica more than the largest tried; raise search.max_gpus from {max_gpus})", ""
    rho = rate / (replicas * cap_rps) if cap_rps else float("nan")
    if rho == rho and rho < LATENCY_BOUND_UTILISATION:
        return float("nan"), "", (f"more GPUs are unlikely to help: the rack runs at {rho:.0%} of its capacity, so its "
                                  f"{_label(c)} is service time, not queueing")
    return float("nan"), "", "more GPUs may help (not estimated where a latency target binds)"


def slo_fix(sm: dict[str, Any] | None) -> str:
    """The looser targets the rack passes with ('slo.ttft_p99_s = 0.353, ...'), when it is stable
    and every missed value is known; '' otherwise."""
    if sm is None or not sm.get("stable", False):
        return ""
    misses = slo_misses(sm)
    if not misses or any(v != v for _, v, _ in misses):
        return ""
    return ", ".join(f"slo.{k} = {_ceil3(v):g}" for k, v, _ in misses)


def closest_columns(ev: dict[str, Any], *, rate: float, cap_rps: float | None, per: int, replicas: int,
                    extra: int, max_gpus: int) -> dict[str, Any]:
    """The miss columns of an option whose closest rack is `replicas` replicas (`ev`: its
    evaluation, run in full)."""
    miss = run_miss(ev, rate, replicas * cap_rps if cap_rps else None)
    gpus, more, note = gpus_fix(miss, rate=rate, cap_rps=cap_rps, per=per, replicas=replicas, extra=extra,
                                max_gpus=max_gpus)
    target = slo_fix(ev.get("summary"))
    fix = "; or ".join(f for f in (f"{target} (the value this rack achieves)" if target else "", more) if f)
    return {"closest_replicas": replicas + extra, "closest_gpus": (replicas + extra) * per, **miss,
            "fix_max_gpus": gpus, "fix_slo": target, "fix": "; ".join(f for f in (fix, note) if f)}


def rack_rules_columns(reason: str, gpus: int, max_gpus: int) -> dict[str, Any]:
    """The miss columns of an option whose smallest allowed rack (one replica, or the rules'
    floor) needs `gpus` GPUs > max_gpus."""
    return {"miss_constraint": "max_gpus", "miss_value": float(gpus), "miss_target": float(max_gpus),
            "miss_ratio": gpus / max_gpus, "miss_detail": reason, "fix_max_gpus": float(gpus),
            "fix": f"more GPUs: search.max_gpus = {gpus}"}


def pruned_columns(*, rate: float, cap_rps: float, per: int, lb: int, max_gpus: int, bound: bool) -> dict[str, Any]:
    """The miss columns of a configuration pruned because its lower bound of `lb` replicas of
    capacity `cap_rps` needs more GPUs than max_gpus."""
    most = max_gpus // per
    carried = most * cap_rps
    peak = " (a closed-loop peak, an upper bound)" if bound else ""
    return {"closest_replicas": most, "closest_gpus": most * per, "miss_constraint": "capacity", "miss_value": rate,
            "miss_target": carried, "miss_ratio": rate / carried if carried > 0 else math.inf,
            "miss_detail": f"{most} replicas x {cap_rps:.2f} req/s{peak} = {carried:.2f} req/s < {rate:.2f} req/s offered",
            "fix_max_gpus": float(lb * per),
            "fix": f"more GPUs: at least {lb * per} ({lb} replicas; raise search.max_gpus from {max_gpus})"}


def not_applicable_columns(reason: str) -> dict[str, Any]:
    """The miss columns of an option that cannot run on its GPU type: memory when the model (or
    its KV cache) does not fit, else the hardware."""
    low = reason.lower()
    memory = any(w in low for w in ("memory", "fit", "kv cache", "hbm", "gib"))
    return {"miss_constraint": "memory" if memory else "not applicable", "miss_detail": reason,
            "fix": "another GPU type (more memory) or a wider TP" if memory else "another GPU type"}


def another_gpu(ranked: pd.DataFrame) -> pd.DataFrame:
    """Each failing row's first change in `fix`: the cheapest passing option of the same strategy
    on another GPU type of the plan ("another GPU", named in `fix_gpu`), else the plan's cheapest
    passing option ("another option"). An option that cannot run on its GPU type has that change
    alone where there is one."""
    if "feasible" not in ranked or ranked.feasible.astype(bool).all():
        return ranked
    ok = ranked[ranked.feasible.astype(bool)]
    out = ranked.copy()
    for col in ("fix_gpu", "fix"):
        out[col] = (out[col] if col in out else pd.Series("", index=out.index)).astype(object)
    for i, r in ranked.iterrows():
        if bool(r.feasible) or not len(ok):
            continue
        same = ok[(ok.gpu != r.gpu) & (ok.strategy == r.strategy)]
        b = (same if len(same) else ok).iloc[0]  # (ranked: the cheapest first)
        what = "another GPU" if len(same) else "another option"
        text = f"{what}: {b.strategy} on {int(b.gpus)}x {b.gpu} passes (${float(b.total_usd_per_month):,.0f}/month)"
        old = r.get("fix")
        keep = isinstance(old, str) and old and r.get("miss_constraint") not in ("memory", "not applicable")
        if len(same):
            out.at[i, "fix_gpu"] = str(b.gpu)
        out.at[i, "fix"] = text + (f"; or {old}" if keep else "")
    return out


def rejection_columns(sm: dict[str, Any], one: Scenario) -> dict[str, Any]:
    """A run's rejected requests (longer than max_model_len: prompt + output, as vLLM rejects
    them), out of those it sent, with the reason (`one`: a replica of the rack)."""
    n = int(sm.get("rejected_requests", 0) or 0)
    done = float(sm.get("benchmark", {}).get("completed", sm.get("completed_requests", 0)) or 0)
    sent = n + int(done)
    out: dict[str, Any] = {"rejected_requests": n, "sent_requests": sent, "rejected_share": n / sent if sent else 0.0,
                           "rejected_reason": str(sm.get("rejected_reason", "") or "")}
    if n and not out["rejected_reason"]:  # a summary stored before the run gave its reason
        out["rejected_reason"] = rejection_reason(build_runtime(one))
    return out


def rejection_line(plan: pd.DataFrame) -> str:
    """One line when any option's run rejects more than REJECTED_WARN of its requests (the worst
    named, the others counted); '' when none does."""
    if "rejected_share" not in plan:
        return ""
    bad = plan[plan.rejected_share.fillna(0.0) > REJECTED_WARN].sort_values("rejected_share", ascending=False)
    if not len(bad):
        return ""
    r = bad.iloc[0]
    more = f" (and {len(bad) - 1} more of the plan's options)" if len(bad) > 1 else ""
    return (f"{int(r.rejected_requests)} of {int(r.sent_requests)} requests ({float(r.rejected_share):.0%}) rejected in "
            f"the run of {r.strategy} on {r.gpu}{more}: {r.rejected_reason}; its figures cover only the requests served: "
            f"{rejection_fix(str(r.rejected_reason))}")
