"""The mechanics behind the speedup curve: how a speculating step's time splits into draft passes,
target verification and machinery overhead as the batch grows, against a plain decode step.
Pure functions of a scenario (the same cost model the engine uses)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from models.speculative import expected_tokens
from sim.deployment import ReplicaRuntime, SpecRuntime, build_runtime
from sim.engine import Replica, Requests, StepLog
from sim.scenario import Scenario
from sim.simulate import baseline_of


def _runtimes(sc: Scenario, who: str) -> tuple[ReplicaRuntime, ReplicaRuntime, SpecRuntime]:
    """(speculating runtime, its baseline's runtime, the speculation runtime) of a scenario."""
    if sc.speculative is None:
        raise ValueError(f"{who} needs a scenario with a [speculative] section")
    rt = build_runtime(sc)
    spec = rt.spec
    assert spec is not None
    return rt, build_runtime(baseline_of(sc)), spec


def step_breakdown(sc: Scenario, batch_sizes: list[int] | np.ndarray, context: int = 1200,
                   acceptance: float = 0.75) -> pd.DataFrame:
    """Per batch size: plain decode step time, and a speculating step's draft / verify / overhead
    time, with the tokens per second each yields at this acceptance (k from the scenario)."""
    rt, base_rt, spec = _runtimes(sc, "step_breakdown")
    if Replica._general(spec):
        # trees, windowed self-drafts, suffix matches: the engine's own step code (fixed_batch_speedup)
        fb = fixed_batch_speedup(sc, batch_sizes, context, acceptance)
        return pd.DataFrame({"batch": fb.batch, "plain_decode_s": fb.plain_decode_s, "verify_s": fb.verify_s,
                             "draft_s": fb.draft_s, "overhead_s": fb.overhead_s, "spec_step_s": fb.spec_step_s,
                             "plain_tok_s": fb.batch / fb.plain_decode_s,
                             "spec_tok_s": fb.batch * fb.tokens_per_seq / fb.spec_step_s,
                             "speedup_at_fixed_batch": fb.speedup})
    k = spec.k
    rows = []
    for b in batch_sizes:
        b = int(b)
        plain = base_rt.cost.uniform(b, context, 1).total_s
        q = k + 1
        verify = rt.cost.uniform(b, context, q).total_s
        if spec.draft_cost is not None:
            mean_ctx = context + (k - 1) / 2.0
            draft = k * spec.draft_cost.uniform(b, int(mean_ctx), 1, step_overhead=False).total_s
        else:
            draft = 0.0
        over = verify * (spec.overhead_frac_at_2 + spec.overhead_frac_per_seq * max(0, b - 2))
        tokens = b * float(expected_tokens(acceptance, k, spec.decay))
        total = verify + draft + over
        rows.append({"batch": b, "plain_decode_s": plain, "verify_s": verify, "draft_s": draft, "overhead_s": over,
                     "spec_step_s": total, "plain_tok_s": b / plain, "spec_tok_s": tokens / total,
                     "speedup_at_fixed_batch": (tokens / total) / (b / plain)})
    return pd.DataFrame(rows)


def breakdown_chart(df: pd.DataFrame) -> go.Figure:
    """Stacked speculating step time vs batch size, with the plain decode step for comparison."""
    fig = go.Figure()
    for col, name in (("verify_s", "target verification (k+1 tokens)"), ("draft_s", "draft passes"),
                      ("overhead_s", "speculation machinery")):
        fig.add_trace(go.Bar(x=df.batch.astype(str), y=df[col] * 1e3, name=name))
    fig.add_trace(go.Scatter(x=df.batch.astype(str), y=df.plain_decode_s * 1e3, name="plain decode step",
                             mode="lines+markers", line={"color": "black"}))
    fig.update_layout(barmode="stack", template="plotly_white", height=460,
                      title="Where a speculating step's time goes, by batch size",
                      xaxis_title="running sequences (batch)", yaxis_title="step time (ms)")
    return fig


def fixed_batch_speedup(sc: Scenario, batch_sizes: list[int] | np.ndarray, context: int,
                        acceptance: float) -> pd.DataFrame:
    """MagicDec's measurement (a static batch of `b` sequences, all decoding at `context` tokens):
    per batch size, the plain decode step, the speculating step of the scenario's method and the
    decode speedup E[tokens] x plain / speculating step. Priced by the engine's own step code
    (`Replica._spec_cost` with the method's verification plan), so it is exactly what a
    simulated step of that batch costs."""
    import simpy

    rt, base_rt, spec = _runtimes(sc, "fixed_batch_speedup")
    k = spec.k
    tokens_per_seq = (spec.shape.expected_tokens(acceptance, k) if spec.shape is not None
                      else float(expected_tokens(acceptance, k, spec.decay)))
    rows = []
    for b in (int(x) for x in batch_sizes):
        import dataclasses

        rt_b = dataclasses.replace(rt, max_num_seqs=max(b, rt.max_num_seqs))
        reqs = Requests(np.zeros(b), np.full(b, context), np.full(b, 10**9), np.full(b, acceptance))
        rep = Replica(simpy.Environment(), 0, rt_b, reqs, np.random.default_rng(0), StepLog(16))
        rep.n_running = b
        rep.rid[:b] = np.arange(b)
        rep.computed[:b] = rep.target[:b] = context
        ctx = float(b * context)
        match = 1.0
        if spec.on_match:
            match = float(sc.workload.classes[0].suffix_match or 0.0)
            reqs.match[:] = match
        plan = (rep._verify_plan(slice(0, b), k, np.full(b, match) if spec.on_match else None)
                if rep._general(spec) else None)
        total_s, target_s, draft_s, over_s, _, _ = rep._spec_cost(b, ctx, k, 0, 0.0, 0.0, 0.0, plan)
        plain = base_rt.cost.decode_s(b, ctx)
        emitted = 1.0 + match * (tokens_per_seq - 1.0)
        rows.append({"batch": b, "context": context, "plain_decode_s": plain, "verify_s": target_s, "draft_s": draft_s,
                     "overhead_s": over_s, "spec_step_s": total_s, "tokens_per_seq": emitted,
                     "speedup": emitted * plain / total_s})
    return pd.DataFrame(rows)
