"""From a validated scenario to the runtime pieces of one replica: cost models, memory plan,
draft, quality and price. Cross-field checks live here (they need the catalogues)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from models.calibration import load_efficiency
from models.catalog import LLM, get_gpu, get_model, get_weight_format, weight_bytes
from models.cost import CostModel, check_tp, efficiency_for
from models.errors import ConfigError
from models.memory import MemoryPlan, plan_memory
from models.quality import Retraining, default_retrain_gpu_hours, distill_quality, quant_quality

if TYPE_CHECKING:
    from sim.scenario import Scenario

MAX_MODEL_LEN = 131072  # Llama-3.1 / Qwen2.5 context length; requests longer are rejected


def eagle_head(target: LLM) -> LLM:
    """An EAGLE-style draft head: one decoder layer of the target plus the target's LM head."""
    d, ff, kvd = target.hidden_size, target.intermediate_size, target.num_kv_heads * target.head_dim
    layer = 2 * d * d + 2 * d * kvd + 3 * d * ff + 2 * d + 2 * d * d  # + fc fusing 2d -> d
    params = layer + target.vocab_size * d
    return LLM(f"eagle-head({target.name})", "", 1, d, target.num_heads, target.num_kv_heads, target.head_dim,
               ff, target.vocab_size, True, params, params, target.tokenizer_family,
               source="one decoder layer of the target + LM head (EAGLE, arXiv 2401.15077)")


@dataclass(frozen=True)
class SpecRuntime:
    method: str
    k: int
    policy: str
    disable_batch_size: int
    decay: float
    draft_cost: CostModel | None  # None for ngram; on its own GPUs (its own TP) when dedicated
    overhead_frac_at_2: float
    overhead_frac_per_seq: float


@dataclass(frozen=True)
class ReplicaRuntime:
    """Everything one replica's engine needs, shared by all replicas of a scenario."""

    cost: CostModel
    plan: MemoryPlan
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill: str  # "mixed" | "separate" (models.engines.Scheduling)
    chunked_prefill: bool
    scheduler_steps: int  # decode steps per scheduling decision (separate prefill)
    engine: str  # the engine profile's name
    spec: SpecRuntime | None
    num_replicas: int
    gpus_per_replica: int
    max_model_len: int
    quality: tuple[float, float]  # (in-distribution, tail), relative to the full-precision teacher
    retraining: Retraining | None
    usd_per_gpu_hour: float


def _draft_model(sc: Scenario) -> LLM | None:
    spec = sc.speculative
    if spec is None or spec.method == "ngram":
        return None
    target = get_model(sc.deployment.model)
    if spec.method == "eagle":
        return eagle_head(target)
    assert spec.draft_model is not None
    return get_model(spec.draft_model)


def gpus_per_replica(sc: Scenario) -> int:
    """GPUs one replica takes: its tensor-parallel group plus a dedicated draft's GPUs."""
    spec = sc.speculative
    draft = spec.draft_gpus if spec is not None and spec.placement == "dedicated" else 0
    return sc.deployment.tensor_parallel + draft


def check_scenario(sc: Scenario) -> None:
    """Cross-field checks that need the catalogues; raises ValueError (shown with its field)."""
    dep = sc.deployment
    target = get_model(dep.model)
    gpu = get_gpu(sc.rack.gpu)
    if get_weight_format(dep.weights).compute == "fp8" and gpu.fp8_flops is None:
        raise ValueError(f"deployment.weights 'fp8' needs FP8 tensor cores, which {gpu.name} lacks; use 'int8' or 'int4'")
    try:
        check_tp(target, dep.tensor_parallel)
    except ConfigError as err:
        raise ValueError(f"deployment.{err}") from None
    spec = sc.speculative
    if spec is not None:
        if spec.method == "draft_model":
            draft = get_model(spec.draft_model or "")
            if draft.tokenizer_family != target.tokenizer_family:
                raise ValueError(
                    f"speculative.draft_model '{draft.name}' uses the {draft.tokenizer_family} tokenizer, "
                    f"target '{target.name}' the {target.tokenizer_family} one; pick a draft of the same family"
                )
            if draft.params_total >= target.params_total:
                raise ValueError(f"speculative.draft_model '{draft.name}' is not smaller than the target '{target.name}'")
        if spec.placement == "dedicated" and spec.method == "ngram":
            raise ValueError("speculative.placement 'dedicated' makes no sense for 'ngram' (no draft model)")
        dm = _draft_model(sc)
        if spec.placement == "dedicated" and dm is not None:
            try:  # a dedicated draft runs tensor-parallel over its own draft_gpus
                check_tp(dm, spec.draft_gpus)
            except ConfigError as err:
                raise ValueError(f"speculative.draft_gpus: the dedicated draft runs at {err}") from None
        for c in sc.workload.classes:  # the same check the run makes, at validation
            try:
                c.acceptance_for(spec.method)
            except ConfigError as err:
                raise ValueError(f"{err}; add {spec.method} = <rate> to its acceptance table") from None
    per_replica = gpus_per_replica(sc)
    if per_replica > sc.rack.num_gpus:
        draft_gpus = per_replica - dep.tensor_parallel
        what = f" + {draft_gpus} dedicated draft GPU(s)" if draft_gpus else ""
        raise ValueError(
            f"rack.num_gpus={sc.rack.num_gpus} cannot hold one replica of tensor_parallel={dep.tensor_parallel}{what}; "
            f"use num_gpus >= {per_replica}"
        )
    idle = sc.rack.num_gpus % per_replica
    if idle and not sc.rack.allow_idle_gpus:
        lo, hi = sc.rack.num_gpus - idle, sc.rack.num_gpus - idle + per_replica
        raise ValueError(
            f"rack.num_gpus={sc.rack.num_gpus} is not a multiple of the {per_replica} GPUs per replica: {idle} GPU(s) "
            f"would sit idle and still be billed; use num_gpus = {lo} or {hi}, or set rack.allow_idle_gpus = true"
        )
    prof = sc.workload.rate_profile
    if prof is not None and getattr(prof, "file", None):  # a CSV profile: read (and checked) at validation
        from sim.traces import load_rate_csv

        try:
            load_rate_csv(prof.file)  # type: ignore[union-attr]
        except ConfigError as err:
            raise ValueError(f"workload.rate_profile.file: {err}") from None
    auto = sc.autoscale
    if auto is not None:
        replicas = sc.rack.num_gpus // per_replica
        if sc.workload.closed or sc.workload.max_concurrency is not None:
            raise ValueError("autoscale: scales an open-loop stream; remove [autoscale] or max_concurrency / "
                             "arrival = 'closed'")
        for key in ("max_replicas", "min_replicas", "initial_replicas"):
            v = getattr(auto, key)
            if v is not None and v > replicas:
                raise ValueError(f"autoscale.{key}={v} exceeds the rack's {replicas} replicas (rack.num_gpus="
                                 f"{sc.rack.num_gpus} / {per_replica} GPUs per replica); raise rack.num_gpus to "
                                 f"{v * per_replica} or lower {key}")
    if dep.distilled_from:
        teacher = get_model(dep.distilled_from)
        if teacher.params_total <= target.params_total:
            raise ValueError(f"deployment.distilled_from '{teacher.name}' must be larger than the student '{target.name}'")
    # memory must fit (a ConfigError with the shortfall)
    try:
        rt = build_runtime(sc)
    except ConfigError as err:
        raise ValueError(f"deployment (model, tensor_parallel, weights): {err}") from None
    check_lengths(sc, rt)


def _length_limit(rt: ReplicaRuntime) -> str:
    return (f"max_model_len={rt.max_model_len} tokens (the KV cache holds {rt.plan.kv_capacity_tokens} tokens per "
            f"replica, the model's context is {MAX_MODEL_LEN}); shorten the requests or give the KV cache more room "
            "(more GPUs per replica, fp8 KV, higher gpu_memory_utilization)")


def check_lengths(sc: Scenario, rt: ReplicaRuntime) -> None:
    """Requests longer than max_model_len are rejected at run time (as vLLM does); a workload
    whose typical request (fixed or median lengths, or every request of a trace) is too long
    would measure nothing, so it is an error at validation. Raises ValueError."""
    from sim.scenario import Empirical, Fixed, LogNormal
    from sim.traces import load_trace

    wl = sc.workload
    if wl.replays_trace and wl.trace:
        try:
            table = load_trace(wl.trace, wl.trace_format)
        except ConfigError as err:
            raise ValueError(f"workload.trace: {err}") from None
        if wl.rate_rps is not None:
            from sim.traces import trace_rate_rps

            try:
                trace_rate_rps(table)
            except ConfigError as err:
                raise ValueError(f"workload.rate_rps: cannot rescale the trace, {err}; remove rate_rps to replay "
                                 "its own timing") from None
        total = table.prompt_tokens + table.output_tokens
        if int(total.min()) > rt.max_model_len:
            raise ValueError(f"workload.trace: every request is longer than the deployment accepts (shortest "
                             f"prompt + output = {int(total.min())} tokens) > {_length_limit(rt)}")
        return
    typical = []
    for name, d in (("prompt_tokens", wl.prompt_tokens), ("output_tokens", wl.output_tokens)):
        if isinstance(d, Fixed):
            typical.append((name, "", float(d.value)))
        elif isinstance(d, LogNormal):
            typical.append((name, "median ", min(d.median, float(d.max))))
        elif isinstance(d, Empirical):
            from sim.traces import empirical_lengths

            try:
                values = empirical_lengths(d.trace, name, d.format)
            except ConfigError as err:
                raise ValueError(f"workload.{name}: {err}") from None
            typical.append((name, "median ", float(np.median(values))))
    total_len = sum(v for _, _, v in typical)
    if total_len > rt.max_model_len:
        what = " + ".join(f"{how}{name} {v:g}" for name, how, v in typical)
        raise ValueError(f"workload: requests are longer than the deployment accepts ({what} = {total_len:g} "
                         f"tokens) > {_length_limit(rt)}")


def check_fits(sc: Scenario, rt: ReplicaRuntime, prompt: np.ndarray, output: np.ndarray) -> None:
    """At run time: when every request of the table is too long, a one-line ConfigError
    (nothing would be measured)."""
    total = np.asarray(prompt) + np.asarray(output)
    if total.size and int(total.min()) > rt.max_model_len:
        raise ConfigError(f"{sc.name}: every request is longer than the deployment accepts (shortest prompt + output "
                          f"= {int(total.min())} tokens) > {_length_limit(rt)}")


def build_runtime(sc: Scenario) -> ReplicaRuntime:
    dep = sc.deployment
    gpu = get_gpu(sc.rack.gpu)
    eff = efficiency_for(gpu, dep.engine)
    if dep.efficiency_file:
        eff = load_efficiency(dep.efficiency_file, eff)
    if dep.efficiency:
        eff = dataclasses.replace(eff, **dep.efficiency, source=f"{eff.source}; overridden in scenario")
    cost = CostModel(dep.model, gpu, dep.tensor_parallel, dep.weights, dep.kv_cache, eff)
    spec_rt = None
    extra_bytes = 0.0
    extra_kv = 0.0
    dm = _draft_model(sc)
    spec = sc.speculative
    if spec is not None:
        draft_cost = None
        if dm is not None:
            if spec.placement == "dedicated":
                tp_d = spec.draft_gpus  # check_scenario made sure it divides the draft's heads
                draft_cost = CostModel(dm, gpu, tp_d, dep.weights, dep.kv_cache, eff)
            else:
                draft_cost = CostModel(dm, gpu, dep.tensor_parallel, dep.weights, dep.kv_cache, eff)
                extra_bytes = weight_bytes(dm, get_weight_format(dep.weights)) / dep.tensor_parallel
                extra_kv = draft_cost.kv_bytes_per_token_gpu
        spec_rt = SpecRuntime(spec.method, spec.num_speculative_tokens, spec.policy, spec.disable_batch_size,
                              spec.acceptance_decay, draft_cost, spec.overhead_frac_at_2, spec.overhead_frac_per_seq)
    sched = dep.scheduling()
    plan = plan_memory(cost, gpu_memory_utilization=dep.gpu_memory_utilization,
                       max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
                       extra_bytes=extra_bytes, extra_kv_bytes_per_token=extra_kv)
    per_replica = gpus_per_replica(sc)
    replicas = sc.rack.num_gpus // per_replica
    price = sc.rack.usd_per_gpu_hour if sc.rack.usd_per_gpu_hour is not None else gpu.usd_per_gpu_hour

    q_in, q_tail = quant_quality(dep.weights, dep.kv_cache)
    retraining = None
    if dep.distilled_from:
        d_in, d_tail = distill_quality(dep.model, dep.distilled_from)
        dist = dep.distillation
        d_in = dist.quality_in_distribution or d_in
        d_tail = dist.quality_tail or d_tail
        q_in, q_tail = q_in * d_in, q_tail * d_tail
        # re-distillation runs on its own training GPU at its own price, apart from the serving rack
        train_gpu = get_gpu(dist.training_gpu)
        hours = dist.gpu_hours_per_run  # hours on the training GPU
        if hours is None:
            hours = default_retrain_gpu_hours(get_model(dep.model).params_total,
                                              get_model(dep.distilled_from).params_total,
                                              peak_flops=train_gpu.bf16_flops)
        train_price = (dist.training_usd_per_gpu_hour if dist.training_usd_per_gpu_hour is not None
                       else train_gpu.usd_per_gpu_hour)
        retraining = Retraining(dist.teacher_updates_per_month, hours, train_price, dist.stale_days,
                                dist.stale_quality_loss, train_gpu.name)
    if dep.quality_in_distribution is not None:
        q_in = dep.quality_in_distribution
    if dep.quality_tail is not None:
        q_tail = dep.quality_tail
    return ReplicaRuntime(
        cost=cost, plan=plan, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
        prefill=sched.prefill, chunked_prefill=sched.chunked_prefill, scheduler_steps=sched.scheduler_steps,
        engine=dep.engine,
        spec=spec_rt, num_replicas=replicas, gpus_per_replica=per_replica,
        max_model_len=min(MAX_MODEL_LEN, plan.kv_capacity_tokens), quality=(q_in, q_tail),
        retraining=retraining, usd_per_gpu_hour=price,
    )
