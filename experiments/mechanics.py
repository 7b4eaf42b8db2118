"""The mechanics behind the speedup curve: how a speculating step's time splits into draft passes,
target verification and machinery overhead as the batch grows, against a plain decode step.
Pure functions of a scenario (the same cost model the engine uses)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from models.speculative import expected_tokens
from sim.deployment import build_runtime
from sim.scenario import Scenario
from sim.simulate import baseline_of


def step_breakdown(sc: Scenario, batch_sizes: list[int] | np.ndarray, context: int = 1200,
                   acceptance: float = 0.75) -> pd.DataFrame:
    """Per batch size: plain decode step time, and a speculating step's draft / verify / overhead
    time, with the tokens per second each yields at this acceptance (k from the scenario)."""
    if sc.speculative is None:
        raise ValueError("step_breakdown needs a scenario with a [speculative] section")
    rt = build_runtime(sc)
    base_rt = build_runtime(baseline_of(sc))
    spec = rt.spec
    assert spec is not None
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
