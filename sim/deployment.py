"""From a validated scenario to the runtime pieces of one replica: cost models, memory plan,
draft, quality and price. Cross-field checks live here (they need the catalogues)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from models.calibration import load_efficiency
from models.catalog import GIB, GPU, LLM, get_gpu, get_model, get_weight_format, weight_bytes
from models.cost import CostModel, Efficiency, check_tp, efficiency_for
from models.engines import SpecBehaviour, get_profile
from models.errors import ConfigError
from models.hf_config import load_config
from models.memory import BLOCK_SIZE, MemoryPlan, plan_memory
from models.quality import Retraining, default_retrain_gpu_hours, distill_quality, quant_quality
from models.speculative import DraftShape, depth_factors
from sim.schema import Empirical, Fixed, LogNormal, Rack, ScenarioSpec
from sim.traces import empirical_lengths, load_rate_csv, load_trace, trace_rate_rps

MAX_MODEL_LEN = 131072  # Llama-3.1 / Qwen2.5 context length; requests longer are rejected


def eagle_head(target: LLM) -> LLM:
    """An EAGLE-style draft head: one decoder layer of the target plus the target's LM head."""
    d, ff, kvd = target.hidden_size, target.intermediate_size, target.num_kv_heads * target.head_dim
    layer = 2 * d * d + 2 * d * kvd + 3 * d * ff + 2 * d + 2 * d * d  # + fc fusing 2d -> d
    params = layer + target.vocab_size * d
    return LLM(f"eagle-head({target.name})", "", 1, d, target.num_heads, target.num_kv_heads, target.head_dim,
               ff, target.vocab_size, True, params, params, target.tokenizer_family,
               source="one decoder layer of the target + LM head (EAGLE, arXiv 2401.15077)")


EAGLE3_DRAFT_VOCAB = 32000  # EAGLE-3 heads predict over a reduced draft vocabulary (config.json draft_vocab_size)


def _layer_params(target: LLM) -> tuple[float, float]:
    """(total, active) parameters of one of the target's decoder layers (embeddings and LM head apart)."""
    emb = target.embedding_params * (1 if target.tie_word_embeddings else 2)
    return (target.params_total - emb) / target.num_layers, (target.params_active - emb) / target.num_layers


def eagle3_head(target: LLM) -> LLM:
    """An EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840; vLLM/SGLang `LlamaForCausalLMEagle3`):
    one decoder layer of the target's width whose attention projections read the concatenation of
    the token embedding and the hidden state (2d inputs), and an LM head over a 32k draft
    vocabulary (`draft_vocab_size` in the released heads' config.json). The fusion FC (3d -> d) of
    the target's low, middle and high-level features runs once per step on the target's features;
    it is a 3d^2 matmul (0.3% of a 70B target's weights) and is not charged."""
    d, ff, kvd = target.hidden_size, target.intermediate_size, target.num_kv_heads * target.head_dim
    layer = 2 * d * d + 2 * (2 * d) * kvd + d * d + 3 * d * ff + 2 * d
    params = layer + EAGLE3_DRAFT_VOCAB * d
    return LLM(f"eagle3-head({target.name})", "", 1, d, target.num_heads, target.num_kv_heads, target.head_dim,
               ff, EAGLE3_DRAFT_VOCAB, True, params, params, target.tokenizer_family,
               source="EAGLE-3 head: one decoder layer with 2d-input attention + 32k draft-vocabulary LM head "
                      "(arXiv 2503.01840)")


def mtp_module(target: LLM) -> LLM:
    """One multi-token-prediction module (DeepSeek-V3 technical report, arXiv 2412.19437, section
    2.2): a projection M (2d -> d) of the normalised hidden state and next-token embedding, one
    transformer block of the target's own architecture (its attention and, for an MoE target, its
    experts), and the shared output head (d x vocabulary) run on its output. The embedding is
    shared with the target."""
    d = target.hidden_size
    total, active = _layer_params(target)
    head = target.vocab_size * d
    return dataclasses.replace(
        target, name=f"mtp-module({target.name})", hf_id="", num_layers=1, tie_word_embeddings=True,
        params_total=int(total + 2 * d * d + head), params_active=int(active + 2 * d * d + head),
        source="one DeepSeek-V3-style MTP module: 2d->d projection + one target block + shared LM head "
               "(arXiv 2412.19437)")


def layer_skip_draft(target: LLM, fraction: float) -> LLM:
    """The target's first round(fraction x layers) layers and its LM head: a self-speculative draft
    by early exit (LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710; SWIFT, arXiv 2410.06916 skips
    a similar share of intermediate layers). It shares the target's weights and KV cache."""
    n = max(1, round(fraction * target.num_layers))
    total, active = _layer_params(target)
    emb = target.embedding_params * (1 if target.tie_word_embeddings else 2)
    return dataclasses.replace(target, name=f"layer-skip({target.name}, {n}/{target.num_layers})", hf_id="",
                               num_layers=n, params_total=int(emb + n * total), params_active=int(emb + n * active),
                               source=f"the first {n} of {target.num_layers} layers of the target + its LM head")


def catalogue_mtp_depth(target: LLM) -> int:
    """MTP modules the catalogue (or the model's config.json, `num_nextn_predict_layers`) records
    for the target (0 when it records none)."""
    return int(getattr(target, "mtp_layers", 0) or 0)


@dataclass(frozen=True)
class SpecRuntime:
    method: str
    k: int
    policy: str
    disable_batch_size: int
    decay: float
    draft_cost: CostModel | None  # None for ngram/suffix; on its own GPUs (its own TP) when dedicated
    overhead_frac_at_2: float
    overhead_frac_per_seq: float
    # per-depth profile and tree shape (models.speculative.DraftShape); None: the plain chain a x decay^(i-1)
    shape: DraftShape | None = None
    draft_window: int | None = None  # self_spec window: the draft reads at most this many KV tokens per sequence
    host_s_per_seq: float = 0.0  # suffix: CPU lookup time per decoding sequence per step
    on_match: bool = False  # suffix: a sequence drafts only when its suffix tree has a match
    # the engine's scoring: k + 1 one-token sequences per decoding sequence (models.engines.SpecBehaviour)
    batch_expansion: bool = False
    # serial output processing of each drafted token beyond the first (an engine that processes
    # output per token with its overlap turned off by speculation): per decoding sequence per token
    host_s_per_token: float = 0.0

    def verify_tokens(self, k: int) -> int:
        """Tokens per sequence a verification of depth k runs through the target (the last
        emitted token plus the drafted tokens or tree nodes)."""
        return 1 + (self.shape.nodes(k) if self.shape is not None else k)

    def depth_probs(self, a: np.ndarray) -> np.ndarray:
        """(requests, k) probabilities of reaching depth i from depth i - 1 at each request's
        per-token acceptance a: the shape's P_i (a tree's any-of-its-candidates), else the chain's
        a x decay^(i-1)."""
        a = np.asarray(a, dtype=np.float64)
        if self.shape is not None:
            return self.shape.probs(a, self.k)
        return a[:, None] * (self.decay ** np.arange(self.k))[None, :]


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
    prefix_caching: bool = False  # keep and reuse full KV blocks of requests that carry block hashes
    # the host-memory tier behind the prefix cache (deployment.host_kv_gib; 0: none): its capacity in
    # KV blocks of the replica (every GPU's share of a block), and the seconds a block takes to load
    # back (each GPU loads its share over its own host link, in parallel)
    host_kv_blocks: int = 0
    host_load_s_per_block: float = 0.0


def target_model(sc: ScenarioSpec) -> LLM:
    """The deployment's model: from its config.json (`deployment.model_config`, in Python
    `config_json`) or the catalogue."""
    dep = sc.deployment
    return load_config(dep.config_json, dep.model) if dep.config_json else get_model(dep.model)


def _draft_model(sc: ScenarioSpec) -> LLM | None:
    """The model each draft pass runs (None when nothing is drafted on the GPU)."""
    spec = sc.speculative
    if spec is None or spec.method in ("ngram", "suffix"):
        return None
    target = target_model(sc)
    kind = spec.tree_drafter if spec.method == "tree" else spec.method
    if kind == "eagle":
        return eagle_head(target)
    if kind == "eagle3":
        return eagle3_head(target)
    if kind == "mtp":
        return mtp_module(target)
    if kind == "self_spec":
        return target if spec.self_spec_mode == "window" else layer_skip_draft(target, spec.self_spec_layer_fraction)
    if spec.draft_model_config:
        return load_config(spec.draft_model_config, spec.draft_model)
    assert spec.draft_model is not None
    return get_model(spec.draft_model)


def _shares_target(sc: ScenarioSpec) -> bool:
    """Self-speculation drafts with the target's own weights and KV cache: no extra memory."""
    return sc.speculative is not None and sc.speculative.method == "self_spec"


def _draft_shape(sc: ScenarioSpec) -> DraftShape | None:
    spec = sc.speculative
    assert spec is not None
    if spec.acceptance_profile is None and spec.method != "tree":
        return None  # the plain chain: a x decay^(i-1), the original formulas
    factors = depth_factors(spec.num_speculative_tokens, spec.acceptance_decay, spec.acceptance_profile)
    branching = spec.tree_branching[: spec.num_speculative_tokens] if spec.tree_branching is not None else None
    return DraftShape(factors, branching, spec.tree_rank_decay)


def _cost(sc: ScenarioSpec, model: LLM, gpu: GPU, tp: int, eff: Efficiency, *, target: bool) -> CostModel:
    """A cost model with the deployment's formats and MoE settings (expert parallelism: the target's)."""
    dep = sc.deployment
    return CostModel(model, gpu, tp, dep.weights, dep.kv_cache, eff, moe_routing_skew=dep.moe_routing_skew,
                     expert_parallel=target and dep.expert_parallel)


def draft_tp(sc: ScenarioSpec) -> int:
    """The tensor-parallel degree a draft model runs at: its dedicated GPUs, else its colocated
    `draft_tensor_parallel` (default the target's)."""
    spec = sc.speculative
    assert spec is not None
    if spec.placement == "dedicated":
        return spec.draft_gpus
    return spec.draft_tensor_parallel or sc.deployment.tensor_parallel


def gpus_per_replica(sc: ScenarioSpec) -> int:
    """GPUs one replica takes: its tensor-parallel group plus a dedicated draft's GPUs."""
    spec = sc.speculative
    draft = spec.draft_gpus if spec is not None and spec.placement == "dedicated" else 0
    return sc.deployment.tensor_parallel + draft


def draft_has_kv(sc: ScenarioSpec) -> bool:
    """Whether speculation runs a draft with KV of its own, which a disaggregated rack transfers or
    recomputes (a self-draft's KV is the target's own; n-gram and suffix draft nothing)."""
    spec = sc.speculative
    return spec is not None and spec.method != "self_spec" and _draft_model(sc) is not None


def prefill_pool(sc: ScenarioSpec) -> ScenarioSpec:
    """A disaggregated scenario's prefill pool as a scenario of its own: its replicas of the same
    model, formats and engine at their tensor parallelism on their GPU. It carries the
    [speculative] table when the draft's prefill runs there (`draft_prefill = "transfer"` and a
    draft with KV of its own), so that its steps price the draft's prefill and hold its weights."""
    dis = sc.disaggregation
    assert dis is not None
    gpu = dis.prefill_gpu or sc.rack.gpu
    tp = dis.prefill_tensor_parallel or sc.deployment.tensor_parallel
    spec = sc.speculative if dis.draft_prefill != "recompute" and draft_has_kv(sc) else None
    price = dis.prefill_usd_per_gpu_hour
    if price is None and gpu == sc.rack.gpu:
        price = sc.rack.usd_per_gpu_hour
    dep = sc.deployment.model_copy(update={"tensor_parallel": tp})
    draft = spec.draft_gpus if spec is not None and spec.placement == "dedicated" else 0
    rack = Rack(gpu=gpu, num_gpus=dis.prefill_replicas * (tp + draft), usd_per_gpu_hour=price)
    return sc.model_copy(update={"rack": rack, "deployment": dep, "speculative": spec, "disaggregation": None,
                                 "autoscale": None})


def check_disaggregation(sc: ScenarioSpec) -> None:
    """What a disaggregated scenario cannot be: the pools are run one after the other (the prefill
    pool, the transfers, then the decode pool), so nothing may react to a completion across them."""
    dis = sc.disaggregation
    if dis is None:
        return
    wl = sc.workload
    if wl.closed or wl.max_concurrency is not None:
        raise ValueError("disaggregation: runs an open-loop stream (poisson, gamma or a trace at its own timing); "
                         "closed loops and max_concurrency send on completions across both pools: remove them")
    if sc.autoscale is not None:
        raise ValueError("disaggregation: each pool has a fixed replica count (prefill_replicas, rack.num_gpus); "
                         "remove [autoscale]")
    spec = sc.speculative
    if spec is not None and spec.policy == "follow_load":
        raise ValueError("disaggregation: speculation policy 'follow_load' switches on the aggregated rack's load; "
                         "use policy 'fixed', 'disable_above_batch' or 'adaptive'")
    if dis.draft_prefill is not None and not draft_has_kv(sc):
        what = "no [speculative] table" if spec is None else f"method '{spec.method}' has no draft model with KV of its own"
        raise ValueError(f"disaggregation.draft_prefill: {what}, so there is no draft prefill to place; remove it")
    try:
        check_scenario(prefill_pool(sc))
    except ValueError as err:
        raise ValueError(f"disaggregation (the prefill pool: prefill_gpu, prefill_tensor_parallel): {err}") from None


def check_scenario(sc: ScenarioSpec) -> None:
    """Cross-field checks that need the catalogues; raises ValueError (shown with its field)."""
    dep = sc.deployment
    target = target_model(sc)
    gpu = get_gpu(sc.rack.gpu)
    if get_weight_format(dep.weights).compute == "fp8" and gpu.fp8_flops is None:
        raise ValueError(f"deployment.weights 'fp8' needs FP8 tensor cores, which {gpu.name} lacks; use 'int8' or 'int4'")
    try:
        check_tp(target, dep.tensor_parallel)
    except ConfigError as err:
        raise ValueError(f"deployment.{err}") from None
    if dep.expert_parallel:
        if not target.num_experts:
            raise ValueError(f"deployment.expert_parallel: '{target.name}' is a dense model (no experts to place); "
                             "remove expert_parallel")
        if target.num_experts % dep.tensor_parallel:
            raise ValueError(f"deployment.expert_parallel: {target.num_experts} experts do not split evenly over "
                             f"tensor_parallel={dep.tensor_parallel} GPUs; use a tensor_parallel that divides "
                             f"{target.num_experts}, or remove expert_parallel")
    spec = sc.speculative
    if spec is not None:
        behaviour = get_profile(dep.engine).spec
        if behaviour.multi_step_refused and dep.scheduling().scheduler_steps > 1:
            raise ValueError(f"deployment.scheduler_steps={dep.scheduling().scheduler_steps}: engine '{dep.engine}' "
                             f"refuses speculative decoding with multi-step scheduling ({behaviour.multi_step_refused}); "
                             "use scheduler_steps = 1")
        if behaviour.scoring == "batch_expansion" and (spec.method in ("tree", "self_spec", "suffix", "mtp")
                                                       or spec.tree_branching is not None):
            raise ValueError(f"speculative.method '{spec.method}': engine '{dep.engine}' has no such method (it "
                             "scores chains of drafted tokens by batch expansion); use a current engine profile")
        if spec.method == "mtp":
            depth = spec.mtp_depth or catalogue_mtp_depth(target)
            if not depth:
                raise ValueError(f"speculative.mtp_depth: the catalogue records no multi-token-prediction modules for "
                                 f"'{target.name}'; set mtp_depth = <its MTP modules> (DeepSeek-V3: 1) if it has them")
            if spec.num_speculative_tokens > depth:
                raise ValueError(f"speculative.num_speculative_tokens={spec.num_speculative_tokens} exceeds the "
                                 f"{depth} MTP module(s) of '{target.name}'; use num_speculative_tokens <= {depth}")
        if spec.method == "suffix":
            missing = [c.name for c in sc.workload.classes if c.suffix_match is None]
            if missing:
                raise ValueError(f"workload.classes '{missing[0]}': method 'suffix' needs suffix_match = <probability "
                                 "that the suffix tree has a match at a decoding step> for every class")
        if spec.needs_draft_model:
            draft = get_model(spec.draft_model) if spec.method == "tree" and spec.draft_model else _draft_model(sc)
            assert draft is not None
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
        if spec.placement == "colocated" and dm is not None and not _shares_target(sc):
            tp_d = draft_tp(sc)
            if dep.tensor_parallel % tp_d:
                raise ValueError(f"speculative.draft_tensor_parallel={tp_d} must divide the target's "
                                 f"tensor_parallel={dep.tensor_parallel} (the draft runs on some of its GPUs)")
            try:
                check_tp(dm, tp_d)
            except ConfigError as err:
                hint = "" if spec.draft_tensor_parallel else "; set speculative.draft_tensor_parallel (vLLM's draft TP)"
                raise ValueError(f"speculative: the colocated draft runs at {err}{hint}") from None
        if spec.placement == "dedicated" and dm is not None:
            try:  # a dedicated draft runs tensor-parallel over its own draft_gpus
                check_tp(dm, spec.draft_gpus)
            except ConfigError as err:
                raise ValueError(f"speculative.draft_gpus: the dedicated draft runs at {err}") from None
        for c in sc.workload.classes:  # the same check the run makes, at validation
            try:
                c.acceptance_for(spec.acceptance_key)
            except ConfigError as err:
                raise ValueError(f"{err}; add {spec.acceptance_key} = <rate> to its acceptance table") from None
    if dep.router == "prefix_affinity" and not dep.prefix_caching:
        raise ValueError("deployment.router 'prefix_affinity' routes by the replicas' prefix caches; set "
                         "deployment.prefix_caching = true or use router 'least_outstanding'")
    per_replica = gpus_per_replica(sc)
    if dep.host_kv_gib > 0:
        if not dep.prefix_caching:
            raise ValueError(f"deployment.host_kv_gib={dep.host_kv_gib:g} keeps blocks evicted from the prefix "
                             "cache, which is off; set deployment.prefix_caching = true or host_kv_gib = 0")
        limit = gpu.host_mem_gib * per_replica
        if dep.host_kv_gib > limit:
            raise ValueError(f"deployment.host_kv_gib={dep.host_kv_gib:g} exceeds the replica's share of host "
                             f"memory, {limit:g} GiB ({gpu.host_mem_gib:g} GiB per {gpu.name} x {per_replica} "
                             f"GPUs per replica); use host_kv_gib <= {limit:g}")
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
        draft_gpus = per_replica - dep.tensor_parallel
        parts = f" (tensor_parallel={dep.tensor_parallel} + {draft_gpus} dedicated draft GPU(s))" if draft_gpus else ""
        raise ValueError(
            f"rack.num_gpus={sc.rack.num_gpus} is not a multiple of the {per_replica} GPUs per replica{parts}: {idle} "
            f"GPU(s) would sit idle and still be billed; use num_gpus = {lo} or {hi}, or set rack.allow_idle_gpus = true"
        )
    prof = sc.workload.rate_profile
    if prof is not None and getattr(prof, "file", None):  # a CSV profile: read (and checked) at validation
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
    check_disaggregation(sc)
    # memory must fit (a ConfigError with the shortfall)
    try:
        rt = build_runtime(sc)
    except ConfigError as err:
        raise ValueError(f"deployment (model, tensor_parallel, weights): {err}") from None
    if dep.host_kv_gib > 0 and rt.host_kv_blocks == 0:
        need = rt.plan.kv_bytes_per_token * BLOCK_SIZE * rt.cost.tp / GIB
        raise ValueError(f"deployment.host_kv_gib={dep.host_kv_gib:g} holds no KV block of the replica "
                         f"({need:.4g} GiB each); use host_kv_gib >= {need:.4g} or 0")
    check_lengths(sc, rt)


def _length_limit(rt: ReplicaRuntime) -> str:
    return (f"max_model_len={rt.max_model_len} tokens (the KV cache holds {rt.plan.kv_capacity_tokens} tokens per "
            f"replica, the model's context is {MAX_MODEL_LEN}); shorten the requests or give the KV cache more room "
            "(more GPUs per replica, fp8 KV, higher gpu_memory_utilization)")


def check_lengths(sc: ScenarioSpec, rt: ReplicaRuntime) -> None:
    """Requests longer than max_model_len are rejected at run time (as vLLM does); a workload
    whose typical request (fixed or median lengths, or every request of a trace) is too long
    would measure nothing, so it is an error at validation. Raises ValueError."""
    wl = sc.workload
    if wl.replays_trace and wl.trace:
        try:
            table = load_trace(wl.trace, wl.trace_format)
        except ConfigError as err:
            raise ValueError(f"workload.trace: {err}") from None
        if wl.rate_rps is not None:
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


def rejection_reason(rt: ReplicaRuntime) -> str:
    """Why a request is rejected, in words: longer than max_model_len, and what bounds it."""
    bound = ("the model's context length" if rt.max_model_len >= MAX_MODEL_LEN
             else f"the KV cache of one replica ({rt.plan.kv_capacity_tokens:,} tokens)")
    return f"prompt + output longer than max_model_len = {rt.max_model_len:,} tokens ({bound})"


def rejection_fix(reason: str) -> str:
    """What serves the rejected requests of a `rejection_reason`: room in the KV cache where it
    is the bound, else shorter requests."""
    if "KV cache" in reason:
        return ("give the KV cache more room (more GPUs per replica, fp8 KV cache, higher gpu_memory_utilization) "
                "or cap the lengths (the workload's prompt_tokens / output_tokens max, or drop those rows)")
    return "cap the lengths (the workload's prompt_tokens / output_tokens max, fewer turns per conversation, or drop those rows)"


def fits(rt: ReplicaRuntime, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Which requests the deployment accepts (prompt + output <= max_model_len), as vLLM admits."""
    return (np.asarray(prompt, dtype=np.int64) + np.asarray(output, dtype=np.int64)) <= rt.max_model_len


def check_fits(sc: ScenarioSpec, rt: ReplicaRuntime, prompt: np.ndarray, output: np.ndarray) -> None:
    """At run time: when every request of the table is too long, a one-line ConfigError
    (nothing would be measured)."""
    total = np.asarray(prompt) + np.asarray(output)
    if total.size and int(total.min()) > rt.max_model_len:
        raise ConfigError(f"{sc.name}: every request is longer than the deployment accepts (shortest prompt + output "
                          f"= {int(total.min())} tokens) > {_length_limit(rt)}")


def build_runtime(sc: ScenarioSpec) -> ReplicaRuntime:
    dep = sc.deployment
    gpu = get_gpu(sc.rack.gpu)
    eff = efficiency_for(gpu, dep.engine)
    if dep.efficiency_file:
        eff = load_efficiency(dep.efficiency_file, eff)
    if dep.efficiency:
        eff = dataclasses.replace(eff, **dep.efficiency, source=f"{eff.source}; overridden in scenario")
    target = target_model(sc)
    sched = dep.scheduling()
    spec = sc.speculative
    behaviour = get_profile(dep.engine).spec if spec is not None else SpecBehaviour()
    # the host work per running sequence on a step's critical path: what is always serial, the
    # scheduling spread over the steps one decision covers, and the output processing unless the
    # engine overlaps it with the next step (which speculation may turn off: models.engines)
    serial_output = not sched.async_output or (behaviour.serial_output and spec is not None
                                                and spec.method not in behaviour.overlap_kept_for)
    eff = dataclasses.replace(eff, step_overhead_s=eff.step_overhead_s + eff.sched_step_s / sched.scheduler_steps,
                              seq_overhead_s=eff.seq_overhead_s + eff.sched_seq_s / sched.scheduler_steps
                              + (eff.output_seq_s if serial_output else 0.0))
    cost = _cost(sc, target, gpu, dep.tensor_parallel, eff, target=True)
    spec_rt = None
    extra_bytes = 0.0
    extra_kv = 0.0
    dm = _draft_model(sc)
    if spec is not None:
        draft_cost = None
        if dm is not None:
            # check_scenario made sure its TP divides the draft's heads
            draft_cost = _cost(sc, dm, gpu, draft_tp(sc) if not _shares_target(sc) else dep.tensor_parallel,
                               eff, target=False)
            if spec.placement != "dedicated" and not _shares_target(sc):
                # MTP: every module's weights and KV are resident (one module runs per drafted token)
                copies, resident = 1, weight_bytes(dm, get_weight_format(dep.weights))
                if spec.method == "mtp":  # the output head is the target's own (shared), not resident twice
                    copies = spec.mtp_depth or catalogue_mtp_depth(target)
                    resident -= dm.embedding_params * 2.0
                # on the GPUs that hold it (a draft at a smaller TP loads its share on each of
                # them; the KV pool is the least any GPU of the group has left)
                extra_bytes = copies * resident / draft_cost.tp
                extra_kv = 0.0 if sc.sim.draft_kv_free else copies * draft_cost.kv_bytes_per_token_gpu
        window = spec.self_spec_window if spec.method == "self_spec" and spec.self_spec_mode == "window" else None
        spec_rt = SpecRuntime(spec.method, spec.num_speculative_tokens, spec.policy, spec.disable_batch_size,
                              spec.acceptance_decay, draft_cost, spec.overhead_frac_at_2, spec.overhead_frac_per_seq,
                              shape=_draft_shape(sc), draft_window=window, host_s_per_seq=spec.suffix_host_s,
                              on_match=spec.method == "suffix", batch_expansion=behaviour.scoring == "batch_expansion",
                              host_s_per_token=eff.output_seq_s if serial_output and behaviour.per_token_output else 0.0)
    max_num_seqs = sched.max_num_seqs
    if behaviour.max_num_seqs is not None and dep.max_num_seqs is None:
        max_num_seqs = min(max_num_seqs, behaviour.max_num_seqs)  # the engine's default when speculating
        sched = dataclasses.replace(sched, max_num_seqs=max_num_seqs)
    if extra_kv and spec_rt is not None and spec_rt.draft_cost is not None:  # a colocated draft's windowed layers
        extra_bytes += spec_rt.draft_cost.window_kv_bytes(sched.max_num_seqs)
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
            hours = default_retrain_gpu_hours(target.params_total,
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
    # the host tier: a KV block of the replica is every GPU's share of it (plan.kv_bytes_per_token is
    # per GPU), and each GPU loads its share over its own host link
    block_bytes_gpu = plan.kv_bytes_per_token * BLOCK_SIZE
    host_kv_blocks = int(dep.host_kv_gib * GIB // (block_bytes_gpu * cost.tp))
    return ReplicaRuntime(
        cost=cost, plan=plan, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
        prefill=sched.prefill, chunked_prefill=sched.chunked_prefill, scheduler_steps=sched.scheduler_steps,
        engine=dep.engine,
        spec=spec_rt, num_replicas=replicas, gpus_per_replica=per_replica,
        max_model_len=min(MAX_MODEL_LEN, plan.kv_capacity_tokens), quality=(q_in, q_tail),
        retraining=retraining, usd_per_gpu_hour=price, prefix_caching=dep.prefix_caching,
        host_kv_blocks=host_kv_blocks,
        host_load_s_per_block=block_bytes_gpu / gpu.host_link_bytes_s if host_kv_blocks else 0.0,
    )
