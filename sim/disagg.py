"""Disaggregated serving (xPyD): a prefill pool, the KV transfers, a decode pool
(`[disaggregation]`; docs/MODEL.md, 'Disaggregated serving').

A request goes to a prefill replica, which computes its prompt (and the draft's, when the draft's
prefill runs there) and samples one token, which the proxy discards; the request's KV then moves
to a decode replica over the link between them, and the decode replica admits it once the KV has
arrived. It holds the transferred prompt tokens but the last, which it computes itself to sample
the first output token the client sees (vLLM at commit 00024d31: the NixlConnector pulls the
prompt's KV, vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py
`get_num_new_matched_tokens`, and the scheduler sets `num_computed_tokens -= 1` on a full hit,
vllm/v1/core/sched/scheduler.py `_update_waiting_for_remote_kv`; the proxy,
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, sends the prefill with max_tokens = 1
and streams the client's tokens from the decode instance), then decodes, with speculation when
the scenario has it. The draft's KV travels with the target's by default (vLLM's
pd_spec_decode_eagle3_test.sh runs EAGLE-3 on the prefill instance and checks acceptance matches;
SGLang and Dynamo pass the same speculative flags to both workers); `draft_prefill = "recompute"`
runs the draft's prefill on the decode replica instead.

Nothing in the decode pool acts back on the prefill pool (open loop, no autoscaler: checked by
`sim.deployment.check_disaggregation`), so the pools run one after the other, each through the same
engine (`sim.run.run_table`, every step rule stated once): the prefill pool over the requests with
one output token each, the transfers, then the decode pool over the requests as their KV arrives.

Transfers: every GPU of a tensor-parallel group sends (receives) its own KV shard over its own
port, so one transfer takes the larger side's KV bytes per GPU over one port's bandwidth, plus the
link's latency; a prefill replica's transfers go out one after another (FIFO by the end of their
prefills). Not modelled: contention at the receiving decode replica's ports, and the prefill
replica holding the KV blocks until the transfer ends (transfers take milliseconds against
prefills of tens to hundreds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from models.catalog import get_gpu, get_link, get_weight_format, peak_flops
from models.cost import CostModel
from sim.deployment import ReplicaRuntime, build_runtime, draft_has_kv, prefill_pool, rejection_reason
from sim.deployment import fits as request_fits
from sim.frame import Frame, as_pandas, column
from sim.run import RunOutput, run_table
from sim.scenario import Scenario

if TYPE_CHECKING:
    import pandas as pd

    from sim.frame import Table


@dataclass(frozen=True)
class Pools:
    """A disaggregated scenario's two pools: the prefill pool's scenario and runtime, the decode
    pool's runtime (the scenario's own), and the link between them."""

    prefill_sc: Scenario
    prefill: ReplicaRuntime
    decode: ReplicaRuntime
    link: str
    link_bytes_s: float  # one port, one direction
    link_latency_s: float
    draft_transferred: bool  # the draft's KV travels with the target's (its prefill ran in the prefill pool)
    draft_recomputed: bool  # the decode replica recomputes the draft's prefill

    @property
    def gpus(self) -> int:
        return self.prefill.num_replicas * self.prefill.gpus_per_replica + self.decode.num_replicas * self.decode.gpus_per_replica


def pools(sc: Scenario, rt: ReplicaRuntime | None = None) -> Pools:
    """The pools of a disaggregated scenario (`rt`: its decode runtime, when already built)."""
    dis = sc.disaggregation
    assert dis is not None
    psc = cast(Scenario, prefill_pool(sc))
    link = get_link(dis.link)
    bw = dis.link_gbps * 1e9 / 8 if dis.link_gbps is not None else link.bytes_s_per_gpu
    lat = dis.link_latency_us * 1e-6 if dis.link_latency_us is not None else link.latency_s
    drt = rt if rt is not None else build_runtime(sc)
    prt = build_runtime(psc)
    drafts = draft_has_kv(sc)
    transferred = drafts and psc.speculative is not None
    return Pools(psc, prt, drt, link.name, bw, lat, transferred, drafts and not transferred)


def _kv_per_gpu(cost: CostModel, tokens: np.ndarray) -> np.ndarray:
    """KV bytes one GPU of the group holds for sequences of `tokens` tokens (sliding-window layers
    keep at most their window)."""
    t = tokens.astype(np.float64)
    win = np.minimum(t, cost.window) if cost.window else t
    return cost.kv_full_bytes_per_token_gpu * t + cost.kv_win_bytes_per_token_gpu * win


def transfer_bytes_per_gpu(p: Pools, tokens: np.ndarray) -> np.ndarray:
    """Bytes one port carries for each request's transfer of `tokens` KV tokens: the larger of the
    sending and receiving groups' per-GPU shards (target, plus the draft's when it travels)."""
    sides = []
    for rt in (p.prefill, p.decode):
        b = _kv_per_gpu(rt.cost, tokens)
        if p.draft_transferred and rt.spec is not None and rt.spec.draft_cost is not None:
            b = b + _kv_per_gpu(rt.spec.draft_cost, tokens)
        sides.append(b)
    return np.maximum(sides[0], sides[1])


def transfer_bytes(p: Pools, tokens: np.ndarray) -> np.ndarray:
    """Bytes a transfer moves in all (the receiving group's shards, over its GPUs)."""
    rt = p.decode
    b = _kv_per_gpu(rt.cost, tokens) * rt.cost.tp
    if p.draft_transferred and rt.spec is not None and rt.spec.draft_cost is not None:
        b = b + _kv_per_gpu(rt.spec.draft_cost, tokens) * rt.spec.draft_cost.tp
    return b


def link_schedule(done_s: np.ndarray, replica: np.ndarray, port_bytes: np.ndarray, bytes_s: float,
                  latency_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(start, arrival) of each transfer: a prefill replica's ports carry one transfer at a time,
    in the order its prefills ended (ties: table order); each takes its bytes over the bandwidth,
    and arrives the latency after. NaN for a prefill that never ended."""
    n = done_s.size
    start = np.full(n, np.nan)
    arrive = np.full(n, np.nan)
    ok = ~np.isnan(done_s)
    order = np.lexsort((np.arange(n), done_s, replica))  # by replica, then end of prefill, then row
    free: dict[int, float] = {}
    dur = port_bytes / bytes_s
    for i in order[ok[order]].tolist():
        r = int(replica[i])
        s = max(float(done_s[i]), free.get(r, -math.inf))
        e = s + float(dur[i])
        free[r] = e
        start[i] = s
        arrive[i] = e + latency_s
    return start, arrive


def run_disaggregated(sc: Scenario, rt: ReplicaRuntime, table: Table, seed: int, *,
                      backlog_limit: int | None = None, progress: bool = False) -> tuple[RunOutput, Pools]:
    """The prefill pool, the transfers and the decode pool over one request table: one `RunOutput`
    of the whole rack (prefill replicas 0..P-1, decode replicas P..P+D-1 in the step table; each
    request's latencies from its arrival to the decode replica's tokens), and the pools."""
    import pandas as pd  # (heavy: only a disaggregated run needs it)

    table = as_pandas(table)
    p = pools(sc, rt)
    prompt = column(table, "prompt_tokens", np.int64)
    output = column(table, "output_tokens", np.int64)
    # a request the decode replicas cannot hold is rejected before its prefill (as a router would)
    ok_d = request_fits(rt, prompt, output)
    pre_table = table[ok_d].reset_index(drop=True).assign(output_tokens=1)
    out_p = run_table(p.prefill_sc, p.prefill, pre_table, seed, backlog_limit=backlog_limit, progress=progress)
    rp = out_p.requests.to_pandas()
    done = column(rp, "completion_s", np.float64)
    n_prompt = column(rp, "prompt_tokens", np.int64)
    kv_tokens = n_prompt - 1  # the decode replica computes the last prompt token itself
    port = transfer_bytes_per_gpu(p, kv_tokens)
    start, arrive = link_schedule(done, column(rp, "replica", np.int64), port, p.link_bytes_s, p.link_latency_s)
    reached = ~np.isnan(arrive)
    out_of = table.set_index("id")
    dec = rp.loc[reached, ["id", "cls"]].copy()
    ids = column(dec, "id")
    dec["arrival_s"] = arrive[reached]
    dec["prompt_tokens"] = n_prompt[reached]
    dec["output_tokens"] = out_of.output_tokens.reindex(ids).to_numpy(np.int64)
    dec["accept_q"] = out_of.accept_q.reindex(ids).to_numpy(np.float64)
    dec["preloaded_tokens"] = kv_tokens[reached]
    if p.draft_recomputed:
        dec["draft_prefill_tokens"] = kv_tokens[reached]
    for col in ("trace_line", "conversation", "turn"):
        if col in out_of.columns:
            dec[col] = out_of[col].reindex(ids).to_numpy()
    dec = dec.sort_values("arrival_s", kind="stable").reset_index(drop=True)
    if len(dec):
        out_d = run_table(sc, rt, dec, seed, backlog_limit=backlog_limit)
        rd = out_d.requests.to_pandas().set_index("id")
    else:
        out_d = None
        rd = pd.DataFrame()
    req = _merge(rp, rd, out_of, p, done, start, arrive, transfer_bytes(p, kv_tokens))
    steps_p = out_p.steps.to_pandas().assign(emitted_tokens=0.0)  # the prefill's sampled token is discarded
    steps = steps_p
    if out_d is not None:
        steps_d = out_d.steps.to_pandas()
        steps_d = steps_d.assign(replica=steps_d.replica + p.prefill.num_replicas)
        steps = pd.concat([steps_p, steps_d], ignore_index=True).sort_values("start_s", kind="stable")
        steps = steps.reset_index(drop=True)
    n_rej_d = int((~ok_d).sum())
    rej_arr = [column(table, "arrival_s", np.float64)[~ok_d]]
    if out_p.rejected_arrival_s is not None:
        rej_arr.append(out_p.rejected_arrival_s)
    lines: tuple[int, ...] = out_p.rejected_lines
    if n_rej_d and "trace_line" in table.columns:
        lines = tuple(int(x) for x in table.trace_line[~ok_d]) + lines
    reason = "; ".join(r for r in ((rejection_reason(rt) + " (the decode replicas)") if n_rej_d else "",
                                   (out_p.rejected_reason + " (the prefill replicas)") if out_p.rejected else "") if r)
    truncated = out_p.truncated or (out_d is not None and out_d.truncated)
    horizon = max(out_p.horizon_s, out_d.horizon_s if out_d is not None else 0.0)
    out = RunOutput(Frame.from_pandas(req), Frame.from_pandas(steps), truncated, horizon, rejected=n_rej_d + out_p.rejected,
                    rejected_arrival_s=np.concatenate(rej_arr), rejected_reason=reason, rejected_lines=lines)
    return out, p


def _merge(rp: pd.DataFrame, rd: pd.DataFrame, orig: pd.DataFrame, p: Pools, done: np.ndarray, start: np.ndarray,
           arrive: np.ndarray, nbytes: np.ndarray) -> pd.DataFrame:
    """One row per request the prefill pool took: its arrival and prefill from the prefill pool, its
    transfer, and its tokens from the decode pool (NaN where it never got there)."""
    ids = column(rp, "id")
    req = rp.copy()
    req["output_tokens"] = orig.output_tokens.reindex(ids).to_numpy(np.int64)
    req["prefill_replica"] = column(rp, "replica", np.int64)
    req["prefill_done_s"] = done
    req["kv_transfer_start_s"] = start
    req["kv_ready_s"] = arrive
    req["kv_transfer_bytes"] = nbytes
    dec_cols = ("first_token_s", "completion_s", "generated_tokens", "acceptance", "draft_proposed", "draft_accepted",
                "verify_steps", "verify_emitted")
    pre_preempt = column(rp, "preemptions", np.int64)
    if len(rd):
        d = rd.reindex(ids)
        for col in dec_cols:
            req[col] = column(d, col)
        req["replica"] = (column(d, "replica", np.float64) + p.prefill.num_replicas)
        req["decode_scheduled_s"] = column(d, "scheduled_s", np.float64)
        req["preemptions"] = pre_preempt + np.nan_to_num(column(d, "preemptions", np.float64)).astype(np.int64)
    else:
        for col in dec_cols:
            req[col] = np.nan
        req["replica"] = np.nan
        req["decode_scheduled_s"] = np.nan
    reached = ~np.isnan(arrive)
    for col in ("generated_tokens", "draft_proposed", "draft_accepted", "verify_steps", "verify_emitted"):
        req[col] = np.where(reached, np.nan_to_num(column(req, col, np.float64)), 0).astype(np.int64)
    req["replica"] = np.where(np.isnan(column(req, "replica", np.float64)), -1, column(req, "replica", np.float64)).astype(np.int64)
    return req


# A prefill pool steps only while it has prompts to compute, so its busy share is its utilisation:
# busy through (nearly) the whole window, it ran at its capacity, and a backlog may be building
# faster than a short window's trend tests can tell (the 3,000 s run of disagg-70b at 5.6 req/s is
# overloaded, prefill busy 1.00; its 300 s run looked stable). A decode pool steps while any
# sequence runs, so its busy share says nothing of the kind.
PREFILL_SATURATED = 0.98


def saturation(section: dict[str, Any]) -> str:
    """Why the run cannot be called stable from its trend alone (`PREFILL_SATURATED`), or ''."""
    busy = float(section["prefill_busy_fraction"])
    if not busy >= PREFILL_SATURATED:
        return ""
    return (f"the prefill pool was busy {busy:.0%} of the window: at its capacity, where a backlog grows "
            "slower than a short window can show; lengthen duration_s, or add prefill replicas")


@dataclass(frozen=True)
class RackFigures:
    """What the summary divides by: replicas, GPUs, their peak FLOP/s and HBM bandwidth (GPU-weighted
    means over the pools) and the rack's price per GPU-hour (the mean over its GPUs)."""

    replicas: int
    gpus: int
    peak_flops: float
    mem_bw: float
    usd_per_gpu_hour: float


def rack_figures(sc: Scenario, rt: ReplicaRuntime, p: Pools | None) -> RackFigures:
    """The rack's figures: one pool (aggregated), or both (disaggregated)."""
    fmt = get_weight_format(sc.deployment.weights)
    groups = [(rt, rt.num_replicas * rt.gpus_per_replica)]
    if p is not None:
        groups.append((p.prefill, p.prefill.num_replicas * p.prefill.gpus_per_replica))
    gpus = sum(g for _, g in groups)
    w = [g / gpus for _, g in groups]
    return RackFigures(
        replicas=sum(r.num_replicas for r, _ in groups),
        gpus=gpus,
        peak_flops=sum(wi * peak_flops(r.cost.gpu, fmt) for wi, (r, _) in zip(w, groups, strict=True)),
        mem_bw=sum(wi * r.cost.gpu.mem_bw_bytes_s for wi, (r, _) in zip(w, groups, strict=True)),
        usd_per_gpu_hour=sum(wi * r.usd_per_gpu_hour for wi, (r, _) in zip(w, groups, strict=True)))


def disaggregation_section(req: Table, steps: Table, p: Pools, warmup_s: float,
                           end_s: float) -> dict[str, Any]:
    """The summary's `disaggregation` keys (docs/METRICS.md, 'Disaggregated serving'): the pools,
    the link, the transfers of the requests arriving in the window, the parts of their TTFT, and
    each pool's busy share."""
    req, steps = as_pandas(req), as_pandas(steps)
    meas = (req.arrival_s >= warmup_s) & (req.arrival_s < end_s)
    r = req[meas]
    moved = r.kv_ready_s.notna()
    first = r.first_token_s.notna()

    def mean(x: pd.Series) -> float:
        return float(x.mean()) if len(x) else float("nan")

    def pct(x: pd.Series, q: float) -> float:
        return float(np.percentile(x.to_numpy(np.float64), q)) if len(x) else float("nan")

    xfer = (r.kv_ready_s - r.prefill_done_s)[moved]
    wait = (r.kv_transfer_start_s - r.prefill_done_s)[moved]
    window = max(end_s - warmup_s, 1e-9)
    st = steps[(steps.start_s >= warmup_s) & (steps.start_s < end_s)]
    n_p = p.prefill.num_replicas
    busy_p = float(st.duration_s[st.replica < n_p].sum())
    busy_d = float(st.duration_s[st.replica >= n_p].sum())
    gpu = get_gpu(p.prefill_sc.rack.gpu).name
    return {
        "prefill_replicas": n_p, "prefill_gpu": gpu, "prefill_tensor_parallel": p.prefill.cost.tp,
        "prefill_gpus": n_p * p.prefill.gpus_per_replica,
        "decode_replicas": p.decode.num_replicas, "decode_gpus": p.decode.num_replicas * p.decode.gpus_per_replica,
        "link": p.link, "link_gb_s": p.link_bytes_s / 1e9, "link_latency_s": p.link_latency_s,
        "draft_prefill": "transfer" if p.draft_transferred else ("recompute" if p.draft_recomputed else "none"),
        "kv_transfer_bytes_mean": mean(r.kv_transfer_bytes[moved]),
        "kv_transfer_s_mean": mean(xfer), "kv_transfer_s_p99": pct(xfer, 99),
        "kv_link_wait_s_mean": mean(wait),
        # TTFT's parts, over the requests that got their first token: to the end of the prefill, the
        # transfer, and from the KV's arrival to the decode replica's first token
        "ttft_prefill_s_mean": mean((r.prefill_done_s - r.arrival_s)[first]),
        "ttft_transfer_s_mean": mean((r.kv_ready_s - r.prefill_done_s)[first]),
        "ttft_decode_s_mean": mean((r.first_token_s - r.kv_ready_s)[first]),
        "prefill_busy_fraction": busy_p / (window * n_p),
        "decode_busy_fraction": busy_d / (window * p.decode.num_replicas),
    }
