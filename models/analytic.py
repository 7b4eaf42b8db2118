"""Closed-form steady states of one replica, used to calibrate the cost model and to check the
simulator (no queueing here: these are the engine's rates at a fixed concurrency).

Continuous batching at concurrency B with prompts of `isl` and outputs of `osl` tokens: every
engine step decodes B tokens, at an average context of isl + osl/2, and carries B x isl/osl
prefill tokens (each new request's prompt is spread over the steps of one generation), whose
queries attend to isl/2 keys on average. Output throughput is B per step.
"""

from __future__ import annotations

from models.cost import CostModel, StepCost
from models.memory import MemoryPlan


def mixed_step(cost: CostModel, batch: float, isl: float, osl: float) -> StepCost:
    """The average engine step of a replica holding `batch` sequences in steady state."""
    ctx = isl + osl / 2.0
    prefill_tokens = batch * isl / max(osl, 1.0)
    tokens = batch + prefill_tokens
    pairs = batch * (ctx + 1.0) + prefill_tokens * (isl / 2.0)
    return cost.step_sums(int(batch), tokens, batch * ctx, pairs)


def concurrency_limit(plan: MemoryPlan, isl: float, osl: float, max_num_seqs: int) -> float:
    """Sequences a replica holds at once: max_num_seqs, or what paged KV fits at the average
    occupancy of isl + osl/2 tokens per sequence."""
    return float(min(max_num_seqs, plan.kv_capacity_tokens / (isl + osl / 2.0)))


def steady_tok_s(cost: CostModel, batch: float, isl: float, osl: float) -> float:
    """Output tokens per second of one replica holding `batch` sequences (use concurrency_limit
    for the most it can hold, i.e. its saturation throughput)."""
    return batch / mixed_step(cost, batch, isl, osl).total_s


def decode_itl_s(cost: CostModel, batch: int, context: int) -> float:
    """Inter-token latency of plain decode at this batch and context (no prefill in the step)."""
    return cost.uniform(batch, context, 1).total_s


def prefill_s(cost: CostModel, prompt_tokens: int) -> float:
    """Time to prefill one prompt in one step (time to first token of an idle replica)."""
    return cost.uniform(1, 0, prompt_tokens).total_s
