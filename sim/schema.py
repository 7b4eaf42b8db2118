"""The scenario's schema: its sections (rack, deployment, speculative, workload, SLO, sim,
autoscale) as typed, frozen pydantic models with their field-level checks, and `ScenarioSpec`,
their composition before the cross-field checks that need the runtime (a memory plan, the
catalogues' tokenizers: `sim.deployment.check_scenario`). `sim.scenario.Scenario` adds those;
the runtime (`sim.deployment`) reads a scenario through these types, so the import graph runs
schema <- deployment <- scenario, without a circle."""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from models.calibration import check_efficiency
from models.catalog import GPUS, KV_FORMATS, LINKS, MODELS, WEIGHT_FORMATS
from models.engines import DEFAULT_PROFILE, Scheduling, get_profile, resolve
from models.errors import ConfigError, unknown
from models.hf_config import config_file, default_name, load_config
from sim.traces import file_digest, load_trace

# At most this many requests in one run: a bigger table would not fit in memory, nor finish.
MAX_REQUESTS = 10_000_000
MAX_CLIENTS = 1_000_000  # closed-loop clients (concurrency, max_concurrency)


def gpu_name(v: str) -> str:
    """A catalogue GPU name, lower-cased; an unknown one is an error with the nearest name."""
    if v.lower() not in GPUS:
        raise unknown("gpu", v, tuple(GPUS))
    return v.lower()


class _Strict(BaseModel):
    """Unknown keys, booleans or strings given for numbers, floats given for integers, and
    non-finite numbers (TOML's inf, nan) are all errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Fixed(_Strict):
    dist: Literal["fixed"]
    value: Annotated[int, Field(ge=1)]


class LogNormal(_Strict):
    dist: Literal["lognormal"]
    median: Annotated[float, Field(gt=0)]
    p90: Annotated[float, Field(gt=0)]
    max: Annotated[int, Field(ge=1)] = 32768

    @model_validator(mode="after")
    def _p90_above_median(self) -> LogNormal:
        if self.p90 <= self.median:
            raise ValueError(f"p90 ({self.p90}) must be greater than median ({self.median})")
        return self


class Empirical(_Strict):
    dist: Literal["empirical"]
    trace: str  # a trace file in any supported format; its column of the same name is sampled
    format: Literal["auto", "azure", "mooncake", "csv"] = "auto"


LengthDist = Annotated[Fixed | LogNormal | Empirical, Field(discriminator="dist")]


class TrafficClass(_Strict):
    name: str
    share: Annotated[float, Field(gt=0, le=1)]
    acceptance: Annotated[float, Field(ge=0, lt=1)] | dict[str, Annotated[float, Field(ge=0, lt=1)]] = 0.8
    acceptance_spread: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    tail: bool = False  # counts towards "tail" quality (hard, off-distribution traffic)
    # suffix decoding: probability that the suffix tree (prompt + earlier outputs) holds a match to
    # propose from at a decoding step; the repetition in this class's traffic (required for 'suffix')
    suffix_match: Annotated[float, Field(ge=0, le=1)] | None = None

    @model_validator(mode="after")
    def _spread_fits(self) -> TrafficClass:
        """A Beta distribution with mean m has a standard deviation below sqrt(m (1 - m)); a wider
        spread is impossible (it would silently become a 0-or-1 distribution)."""
        means = self.acceptance.values() if isinstance(self.acceptance, dict) else (self.acceptance,)
        for m in means:
            limit = (m * (1.0 - m)) ** 0.5
            if self.acceptance_spread > 0 and self.acceptance_spread >= limit:
                raise ValueError(
                    f"class '{self.name}': acceptance_spread={self.acceptance_spread:g} is impossible for acceptance "
                    f"{m:g} (a distribution of rates in [0, 1] with mean {m:g} has a spread below "
                    f"sqrt(m(1-m)) = {limit:.3g}); use acceptance_spread < {limit:.3g}"
                )
        return self

    def acceptance_for(self, method: str) -> float:
        if isinstance(self.acceptance, dict):
            if method not in self.acceptance:
                raise ConfigError(
                    f"workload.classes '{self.name}': acceptance has no entry for method '{method}' "
                    f"(has: {', '.join(self.acceptance)})"
                )
            return self.acceptance[method]
        return self.acceptance


class Rack(_Strict):
    gpu: str = "h100-sxm"
    num_gpus: Annotated[int, Field(ge=1, le=4096)] = 8
    usd_per_gpu_hour: Annotated[float, Field(ge=0)] | None = None  # default: the catalogue's
    # GPUs left over when num_gpus is not a multiple of a replica's GPUs are billed but serve
    # nothing: an error unless this is set
    allow_idle_gpus: bool = False

    _gpu = field_validator("gpu")(staticmethod(gpu_name))


class Distillation(_Strict):
    teacher_updates_per_month: Annotated[float, Field(ge=0)] = 1.0
    gpu_hours_per_run: Annotated[float, Field(ge=0)] | None = None  # default from models.quality
    stale_days: Annotated[float, Field(ge=0)] = 7.0
    stale_quality_loss: Annotated[float, Field(ge=0, le=1)] = 0.05
    quality_in_distribution: Annotated[float, Field(gt=0, le=1)] | None = None
    quality_tail: Annotated[float, Field(gt=0, le=1)] | None = None
    # re-distillation runs on a training GPU of its own, priced apart from the serving rack
    training_gpu: str = "h100-sxm"
    training_usd_per_gpu_hour: Annotated[float, Field(ge=0)] | None = None  # default: the catalogue's

    _training_gpu = field_validator("training_gpu")(staticmethod(gpu_name))


def not_found(what: str, path: str) -> str:
    """The one-line message for a file a scenario names that is not there: the path looked at,
    and what a relative path is relative to."""
    return (f"{what} not found: '{Path(path).resolve()}' (a relative path in a scenario file is relative to its folder; "
            "one given with --set or in a sweep's or plan's set tables, to the working directory)")


def _config_field(v: str | None) -> str | None:
    """A config.json path (`deployment.model_config`, `speculative.draft_model_config`) must load;
    a model folder holding one stands for its config.json."""
    if v is not None:
        if not Path(v).exists():
            raise ValueError(not_found("config.json", v))
        try:
            load_config(v)
            return str(config_file(v))
        except ConfigError as err:
            raise ValueError(str(err)) from None
    return v


def _name_from_config(data: Any, name_key: str, config_key: str) -> Any:
    """A model defined by a config.json is named after its folder (or file) unless named."""
    if isinstance(data, dict) and isinstance(data.get(config_key), str) and not data.get(name_key):
        data = {**data, name_key: default_name(data[config_key])}
    return data


class Deployment(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              validate_by_alias=True, serialize_by_alias=True)
    # `model_config` in files: the target from a Hugging Face config.json (relative to the scenario
    # file) instead of the catalogue; `model` is then its name (default: the config's folder name).
    # models.hf_config. (In Python `config_json`: pydantic reserves the name model_config.)
    config_json: str | None = Field(default=None, alias="model_config")
    model: str = "llama-3.1-70b"
    tensor_parallel: Annotated[int, Field(ge=1)] = 4
    weights: str = "bf16"
    kv_cache: str = "bf16"
    # scheduling: unset, the engine profile's defaults (models.engines); set, they override it
    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=16, le=1_048_576)] | None = None
    prefill: Literal["mixed", "separate"] | None = None
    chunked_prefill: bool | None = None
    scheduler_steps: Annotated[int, Field(ge=1, le=64)] | None = None  # vLLM 0.6 --num-scheduler-steps
    # output processing overlapped with the next step (vLLM 0.6 async output processing; False is
    # --disable-async-output-proc); unset, the engine profile's
    async_output: bool | None = None
    router: Literal["round_robin", "least_outstanding", "prefix_affinity"] = "least_outstanding"
    # automatic prefix caching (vLLM V1's and SGLang's default): full KV blocks of requests that
    # carry block hashes (a Mooncake trace's hash_ids, [workload] conversations) are kept and
    # reused; requests without hashes are unaffected (docs/MODEL.md, 'Prefix caching')
    prefix_caching: bool = True
    # a host-memory tier behind each replica's prefix cache (GiB of CPU memory per replica; 0: none):
    # blocks evicted from HBM are kept there and loaded back over the host link on a hit (docs/MODEL.md,
    # 'Prefix caching'); at most the GPU's host memory x the replica's GPUs (models.catalog.GPU.host_mem_gib)
    host_kv_gib: Annotated[float, Field(ge=0)] = 0.0
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    engine: str = DEFAULT_PROFILE  # an engine profile (models.engines): vllm-v1, vllm-0.6, sglang, trtllm, ...
    distilled_from: str | None = None
    distillation: Distillation = Distillation()
    quality_in_distribution: Annotated[float, Field(gt=0, le=1)] | None = None  # override defaults
    quality_tail: Annotated[float, Field(gt=0, le=1)] | None = None
    # calibrated efficiency: a JSON file written by models.calibration.save_efficiency, and/or
    # individual factors (mfu_max, bw_eff, step_overhead_s, ...) overriding the engine profile
    efficiency_file: str | None = None
    efficiency: dict[str, float] | None = None
    # mixture of experts (models.cost.expected_experts): Zipf exponent of expert popularity (0:
    # uniform routing), and experts placed whole on the GPUs (E / tensor_parallel each, all-to-all
    # dispatch and combine) instead of every expert sliced over them
    moe_routing_skew: Annotated[float, Field(ge=0, le=4)] = 0.0
    expert_parallel: bool = False

    _model_config = field_validator("config_json")(staticmethod(_config_field))

    @model_validator(mode="before")
    @classmethod
    def _config_name(cls, data: Any) -> Any:
        return _name_from_config(data, "model", "model_config")

    @field_validator("efficiency")
    @classmethod
    def _eff(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        try:
            check_efficiency(v or {})
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return v

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        return resolve(v)  # aliases (baseline, tuned) resolve to the profile they name

    def scheduling(self) -> Scheduling:
        """The engine profile's scheduling with this deployment's overrides."""
        s = get_profile(self.engine).scheduling
        return Scheduling(
            prefill=self.prefill or s.prefill,
            chunked_prefill=s.chunked_prefill if self.chunked_prefill is None else self.chunked_prefill,
            max_num_batched_tokens=self.max_num_batched_tokens or s.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs or s.max_num_seqs,
            scheduler_steps=self.scheduler_steps or s.scheduler_steps,
            async_output=s.async_output if self.async_output is None else self.async_output)

    @field_validator("model", "distilled_from")
    @classmethod
    def _model(cls, v: str | None, info: ValidationInfo) -> str | None:
        if info.field_name == "model" and info.data.get("config_json"):
            return v  # a name for the config.json's model
        if v is not None and v.lower() not in MODELS:
            raise unknown("model", v, tuple(MODELS))
        return v.lower() if v else v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: str) -> str:
        if v.lower() not in WEIGHT_FORMATS:
            raise unknown("weights format", v, tuple(WEIGHT_FORMATS))
        return v.lower()

    @field_validator("kv_cache")
    @classmethod
    def _kv(cls, v: str) -> str:
        if v.lower() not in KV_FORMATS:
            raise unknown("kv_cache format", v, tuple(KV_FORMATS))
        return v.lower()


SPEC_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "tree", "self_spec", "ngram", "suffix")
# [speculative] keys that belong to one method, policy or self_spec mode: (field, value) pairs that
# must all hold for the key to act (draft_model: `spec_key_unused`)
SPEC_KEY_OWNERS: dict[str, tuple[tuple[str, str], ...]] = {
    "mtp_depth": (("method", "mtp"),),
    "tree_branching": (("method", "tree"),), "tree_drafter": (("method", "tree"),),
    "tree_rank_decay": (("method", "tree"),),
    "self_spec_mode": (("method", "self_spec"),),
    "self_spec_window": (("method", "self_spec"), ("self_spec_mode", "window")),
    "self_spec_layer_fraction": (("method", "self_spec"), ("self_spec_mode", "layer_skip")),
    "suffix_host_s": (("method", "suffix"),),
    "disable_batch_size": (("policy", "disable_above_batch"),),
    "load_off_above": (("policy", "follow_load"),), "load_on_below": (("policy", "follow_load"),),
    "load_interval_s": (("policy", "follow_load"),),
}
SPEC_OWNED_KEYS = ("draft_model", *SPEC_KEY_OWNERS)
# methods whose drafter is a head on the target's hidden states (or the target itself): colocated only
_COLOCATED_ONLY = ("eagle3", "mtp", "tree", "self_spec", "suffix")


class Speculative(_Strict):
    """Speculative decoding: the method, how many tokens it drafts, the policy, and each
    method's own inputs (docs/MODEL.md has the physics and sources of every one)."""

    method: Literal["draft_model", "eagle", "eagle3", "mtp", "tree", "self_spec", "ngram", "suffix"] = "draft_model"
    # the draft from a Hugging Face config.json (relative to the scenario file); draft_model names it
    draft_model_config: str | None = None
    draft_model: str | None = None  # required for method = "draft_model" (or draft_model_config; and tree_drafter = "draft_model")
    num_speculative_tokens: Annotated[int, Field(ge=0, le=16)] = 4  # the depth of a tree
    placement: Literal["colocated", "dedicated"] = "colocated"
    draft_gpus: Annotated[int, Field(ge=1)] = 1  # GPUs per replica's draft when dedicated
    # colocated: the GPUs of the target's tensor-parallel group a draft model runs over (vLLM 0.6
    # `speculative_draft_tensor_parallel_size`, vllm/spec_decode/smaller_tp_proposer_worker.py; default
    # the target's TP); the others wait while it drafts
    draft_tensor_parallel: Annotated[int, Field(ge=1, le=64)] | None = None
    policy: Literal["fixed", "disable_above_batch", "adaptive", "follow_load"] = "fixed"
    disable_batch_size: Annotated[int, Field(ge=1)] = 32
    # follow_load: speculate while the load (offered rate over the last load_interval_s as a share
    # of the live replicas' speculation-off capacity) is below load_off_above; once off, again
    # only when it falls below load_on_below (hysteresis)
    load_off_above: Annotated[float, Field(gt=0, le=5)] = 0.6
    load_on_below: Annotated[float, Field(gt=0, le=5)] = 0.5
    load_interval_s: Annotated[float, Field(gt=0)] = 60.0
    acceptance_decay: Annotated[float, Field(gt=0, le=1)] = 1.0
    # per-depth acceptance relative to depth 1 (f_1 = 1), one entry per drafted position (>= k; the
    # first k are used); replaces the decay
    acceptance_profile: Annotated[tuple[Annotated[float, Field(gt=0, le=1)], ...], Field(strict=False)] | None = None
    # mtp: the target's multi-token-prediction modules (DeepSeek-V3: 1), when the catalogue does not say
    mtp_depth: Annotated[int, Field(ge=1, le=16)] | None = None
    # tree: children per node at each depth (>= num_speculative_tokens entries; the tree is cut at
    # depth num_speculative_tokens), the drafter, and the
    # acceptance of the r-th ranked candidate relative to the top one (g^(r-1))
    tree_branching: Annotated[tuple[Annotated[int, Field(ge=1, le=16)], ...], Field(strict=False)] | None = None
    tree_drafter: Literal["eagle3", "eagle", "draft_model"] = "eagle3"
    tree_rank_decay: Annotated[float, Field(gt=0, le=1)] = 0.5
    # self_spec: the target drafts for itself with a KV window (StreamingLLM/MagicDec) or a share of its layers
    self_spec_mode: Literal["window", "layer_skip"] = "window"
    self_spec_window: Annotated[int, Field(ge=16, le=131072)] = 512  # KV tokens the draft reads (sinks + recent)
    self_spec_layer_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.5
    # suffix: host (CPU) time of the suffix-tree lookup per decoding sequence per step
    suffix_host_s: Annotated[float, Field(ge=0, le=0.01)] = 0.0
    # machinery overhead, as a fraction of the target pass: f0 + f1 x (running sequences - 2);
    # vLLM issue 49548: +6.6% TPOT at 2 concurrent requests, +21.6% at 189
    overhead_frac_at_2: Annotated[float, Field(ge=0)] = 0.066
    overhead_frac_per_seq: Annotated[float, Field(ge=0)] = (0.216 - 0.066) / 187.0

    _draft_config = field_validator("draft_model_config")(staticmethod(_config_field))

    @model_validator(mode="before")
    @classmethod
    def _config_name(cls, data: Any) -> Any:
        return _name_from_config(data, "draft_model", "draft_model_config")

    @field_validator("draft_model")
    @classmethod
    def _draft(cls, v: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("draft_model_config"):
            return v
        if v is not None and v.lower() not in MODELS:
            raise unknown("draft model", v, tuple(MODELS))
        return v.lower() if v else v

    @property
    def acceptance_key(self) -> str:
        """The traffic classes' acceptance entry this method reads: a tree's top-1 candidates are
        its drafter's, so a tree reads the drafter's entry."""
        return self.tree_drafter if self.method == "tree" else self.method

    @property
    def needs_draft_model(self) -> bool:
        return self.method == "draft_model" or (self.method == "tree" and self.tree_drafter == "draft_model")

    def _check_method_keys(self) -> None:
        """Keys that belong to one method, policy or self_spec mode are errors with another (they
        would be silently ignored). A key counts as given when it differs from its default (a
        dumped and re-read scenario holds every default)."""
        values = {f: getattr(self, f) for f in ("method", "policy", "self_spec_mode", "tree_drafter")}
        fields = type(self).model_fields
        for key in SPEC_OWNED_KEYS:
            if getattr(self, key) != fields[key].default and (why := spec_key_unused(key, values)):
                raise ValueError(why)

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        if self.draft_model_config and self.method != "draft_model":
            raise ValueError(f"draft_model_config defines a draft model; it needs method = 'draft_model' "
                             f"(got '{self.method}'), or remove it")
        self._check_method_keys()
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("method 'draft_model' needs draft_model = '<catalogue model>' (or draft_model_config = "
                             "'<path to its config.json>')")
        if self.method == "tree" and self.tree_drafter == "draft_model" and not self.draft_model:
            raise ValueError("tree_drafter 'draft_model' needs draft_model = '<catalogue model>'")
        if self.placement == "colocated" and self.draft_gpus != 1:
            raise ValueError(f"draft_gpus={self.draft_gpus} only applies with placement = 'dedicated' "
                             "(a colocated draft shares the target's GPUs); remove it or set placement = 'dedicated'")
        if self.draft_tensor_parallel is not None and (self.placement != "colocated" or not self.needs_draft_model):
            raise ValueError("draft_tensor_parallel applies to a colocated draft model (method 'draft_model'); a "
                             "dedicated draft runs over its draft_gpus, a head at the target's TP: remove it")
        if self.placement == "dedicated" and self.method in _COLOCATED_ONLY:
            raise ValueError(f"placement 'dedicated' is not possible for method '{self.method}' (its drafter reads "
                             "the target's hidden states or KV, or has no model); use placement = 'colocated'")
        if self.load_on_below > self.load_off_above:
            raise ValueError(f"load_on_below ({self.load_on_below:g}) must not exceed load_off_above "
                             f"({self.load_off_above:g}): speculation turns back on below the level it turned off at")
        if self.policy != "adaptive" and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with policy '{self.policy}' (at 0 it never drafts "
                             "yet pays the speculation machinery); set num_speculative_tokens >= 1, remove "
                             "[speculative] to run without speculation, or use policy 'adaptive' to allow 0")
        k = self.num_speculative_tokens
        if self.acceptance_profile is not None:
            if len(self.acceptance_profile) < k:
                raise ValueError(f"acceptance_profile has {len(self.acceptance_profile)} entries; it needs one per "
                                 f"drafted position (num_speculative_tokens = {k}), e.g. [1.0, 0.9, 0.85, 0.8] for 4")
            if self.acceptance_profile and self.acceptance_profile[0] != 1.0:
                raise ValueError(f"acceptance_profile is relative to depth 1, so its first entry must be 1.0 "
                                 f"(got {self.acceptance_profile[0]:g}); the class's acceptance sets depth 1")
            if self.acceptance_decay != 1.0:
                raise ValueError("set either acceptance_decay or acceptance_profile, not both")
        if self.method == "tree":
            if self.tree_branching is None:
                raise ValueError(f"method 'tree' needs tree_branching = [children per node at each depth], one entry "
                                 f"per depth (num_speculative_tokens = {k}), e.g. [2, 2, 1, 1]")
            if len(self.tree_branching) < k:
                raise ValueError(f"tree_branching has {len(self.tree_branching)} entries; it needs one per depth "
                                 f"(num_speculative_tokens = {k})")
            nodes, width = 0, 1
            for b in self.tree_branching[:k]:  # a longer list is cut at depth k (a planner's k grid varies it)
                width *= b
                nodes += width
            if nodes > 256:
                raise ValueError(f"tree_branching {list(self.tree_branching)} makes a tree of {nodes} tokens per "
                                 "sequence; at most 256 (engines verify 8-64), use smaller branching factors")
        if self.method == "mtp" and self.mtp_depth is not None and k > self.mtp_depth:
            raise ValueError(f"num_speculative_tokens={k} exceeds mtp_depth={self.mtp_depth} (each drafted token "
                             f"needs its own MTP module); use num_speculative_tokens <= {self.mtp_depth}")
        return self


def spec_key_unused(key: str, spec: dict[str, Any]) -> str | None:
    """Why a [speculative] key of one method, policy or self_spec mode (SPEC_OWNED_KEYS) does
    nothing under `spec`'s (a table; missing entries take their defaults): the one-line message
    naming the key, what it needs and the fix; None when it applies."""
    fields = Speculative.model_fields

    def get(name: str) -> Any:
        return spec.get(name, fields[name].default)

    if key == "draft_model":
        if get("method") == "draft_model" or (get("method") == "tree" and get("tree_drafter") == "draft_model"):
            return None
        now = f"method is '{get('method')}'" + (f" with tree_drafter '{get('tree_drafter')}'" if get("method") == "tree" else "")
        return (f"draft_model only applies to method 'draft_model' (or 'tree' with tree_drafter = 'draft_model'); "
                f"{now}: remove draft_model, or set method = 'draft_model'")
    for field, value in SPEC_KEY_OWNERS[key]:
        if get(field) != value:
            return (f"{key} only applies to {field.replace('_', ' ')} '{value}' ({field} is '{get(field)}'); "
                    f"remove it, or set {field} = '{value}'")
    return None


class FixedThink(_Strict):
    """A think time of exactly `value` seconds."""

    dist: Literal["fixed"]
    value: Annotated[float, Field(ge=0, le=86400)]


class ExponentialThink(_Strict):
    """Exponential think times of mean `mean` seconds (memoryless users)."""

    dist: Literal["exponential"]
    mean: Annotated[float, Field(gt=0, le=86400)]


ThinkTime = Annotated[FixedThink | ExponentialThink, Field(discriminator="dist")]


class Conversations(_Strict):
    """Synthetic multi-turn conversations: each conversation has `turns` requests; turn 1's
    prompt and every turn's output come from the workload's `prompt_tokens` / `output_tokens`;
    turn t+1's prompt is turn t's prompt + its output + `growth_tokens` new user tokens, so it
    shares turn t's whole token stream as a prefix. Open loop: conversations start at
    rate_rps / turns (Poisson or gamma), and turn t+1 is sent `turn_gap_s` after turn t was sent
    (the gap holds the answer's generation and the user's reading and typing)."""

    turns: Annotated[int, Field(ge=1, le=1000)]
    turn_gap_s: ThinkTime
    growth_tokens: LengthDist = LogNormal(dist="lognormal", median=100, p90=400, max=4096)

    @field_validator("turn_gap_s", mode="before")
    @classmethod
    def _gap_table(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            raise ValueError(f"must be a table such as {{ dist = \"exponential\", mean = 60.0 }} or "
                             f"{{ dist = \"fixed\", value = 30.0 }} (seconds between a conversation's turns), got {v!r}")
        return v


class DiurnalProfile(_Strict):
    """A day's swing of the Poisson rate: lambda(t) = trough + (peak - trough) (1 + cos(2 pi (t /
    day_s - peak_hour / 24))) / 2, t = 0 being midnight; `day_s` compresses the day (a 2-hour
    day for a quick look keeps the shape, 12x faster)."""

    shape: Literal["diurnal"]
    peak_rps: Annotated[float, Field(gt=0)]
    trough_rps: Annotated[float, Field(ge=0)]
    peak_hour: Annotated[float, Field(ge=0, lt=24)] = 14.0
    day_s: Annotated[float, Field(gt=0)] = 86400.0

    @model_validator(mode="after")
    def _order(self) -> DiurnalProfile:
        if self.trough_rps > self.peak_rps:
            raise ValueError(f"trough_rps ({self.trough_rps:g}) must not exceed peak_rps ({self.peak_rps:g})")
        return self


class CsvProfile(_Strict):
    """A rate per interval from a CSV file `start_s,rate_rps` (piecewise constant: each rate holds
    from its start to the next row's, the last to the end of the run; the first start is 0)."""

    shape: Literal["csv"]
    file: str
    scale: Annotated[float, Field(gt=0)] = 1.0  # multiplies every rate (traffic growth)

    @model_validator(mode="after")
    def _exists(self) -> CsvProfile:
        if not Path(self.file).is_file():
            raise ValueError(not_found("file", self.file))
        return self


RateProfile = Annotated[DiurnalProfile | CsvProfile, Field(discriminator="shape")]


class Workload(_Strict):
    """Arrivals: open loop (`poisson`, `gamma`, `trace`: requests arrive at their own times,
    `max_concurrency` optionally caps how many are in flight, as `vllm bench serve --request-rate R
    --max-concurrency N`), or closed loop (`closed`: `concurrency` clients, each sending its next
    request when the previous one completed, after an optional `think_time_s`). A closed loop with
    `trace` takes the trace's lengths in order and ignores its timing."""

    arrival: Literal["poisson", "gamma", "trace", "closed"] = "poisson"
    utilisation: Annotated[float, Field(gt=0, le=5)] | None = None
    rate_rps: Annotated[float, Field(gt=0)] | None = None
    cv: Annotated[float, Field(gt=0, le=20)] = 2.0  # gamma inter-arrival coefficient of variation
    duration_s: Annotated[float, Field(gt=0)] = 600.0
    warmup_s: Annotated[float, Field(ge=0)] = 60.0
    num_requests: Annotated[int, Field(ge=1, le=MAX_REQUESTS)] | None = None  # instead of duration_s
    prompt_tokens: LengthDist = LogNormal(dist="lognormal", median=1020, p90=2735)
    output_tokens: LengthDist = LogNormal(dist="lognormal", median=129, p90=424)
    trace: str | None = None
    trace_format: Literal["auto", "azure", "mooncake", "csv"] = "auto"
    # replay only the trace's requests arriving in [trace_start_s, trace_end_s) of its own clock
    # (before rate scaling), shifted to start at 0; rate_rps still scales by the whole trace's rate
    trace_start_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    trace_end_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    classes: Annotated[tuple[TrafficClass, ...], Field(strict=False, min_length=1)] = (
        TrafficClass(name="default", share=1.0),)
    # closed loop (arrival = "closed"): clients, and the time each waits after a completion
    concurrency: Annotated[int, Field(ge=1, le=MAX_CLIENTS)] | None = None
    think_time_s: ThinkTime | None = None
    # open loop behind a cap of requests in flight (vllm bench serve --max-concurrency)
    max_concurrency: Annotated[int, Field(ge=1, le=MAX_CLIENTS)] | None = None
    # synthetic multi-turn conversations sharing prefixes (Conversations; needs rate_rps)
    conversations: Conversations | None = None
    # a non-homogeneous Poisson stream: the rate follows a profile over time (arrival = "poisson")
    rate_profile: RateProfile | None = None

    @field_validator("rate_profile", mode="before")
    @classmethod
    def _profile_table(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"must be a table such as {{ shape = \"diurnal\", peak_rps = 20, trough_rps = 4 }} or "
                             f"{{ shape = \"csv\", file = \"rates.csv\" }}, got {v!r}")
        return v

    @field_validator("think_time_s", mode="before")
    @classmethod
    def _think_table(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"must be a table such as {{ dist = \"fixed\", value = 0.5 }} or "
                             f"{{ dist = \"exponential\", mean = 2.0 }} (seconds), got {v!r}")
        return v

    def _check_conversations(self) -> None:
        if self.conversations is None:
            return
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"conversations: need arrival = 'poisson' or 'gamma' (conversations start open loop), "
                             f"got arrival '{self.arrival}'; remove conversations or change arrival")
        if self.rate_rps is None:
            raise ValueError("conversations: give rate_rps = <requests/s, all turns counted> instead of utilisation "
                             "(utilisation refers to the capacity at single-turn lengths without caching)")
        if self.max_concurrency is not None:
            raise ValueError("conversations: max_concurrency is not supported with conversations; remove one of them")

    @property
    def closed(self) -> bool:
        return self.arrival == "closed"

    @property
    def replays_trace(self) -> bool:
        """Whether request lengths come from `trace` in order (arrival 'trace', or 'closed' with a trace)."""
        return self.trace is not None and self.arrival in ("trace", "closed")

    def _check_loop(self) -> None:
        if self.closed:
            if self.concurrency is None:
                raise ValueError("concurrency: arrival 'closed' needs concurrency = <number of clients>, e.g. 16")
            for key in ("utilisation", "rate_rps"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: a closed loop sets its own rate (concurrency clients, each sending "
                                     f"when its previous request completes); remove {key} or use an open-loop arrival")
            if self.max_concurrency is not None:
                raise ValueError("max_concurrency: caps an open-loop stream; a closed loop's cap is concurrency")
            return
        if self.concurrency is not None:
            raise ValueError(f"concurrency: needs arrival = 'closed' (got arrival '{self.arrival}'); to cap an "
                             "open-loop stream use max_concurrency")
        if self.think_time_s is not None:
            raise ValueError(f"think_time_s: needs arrival = 'closed' (got arrival '{self.arrival}')")

    def _check_profile(self) -> None:
        if self.rate_profile is None:
            return
        if self.arrival != "poisson":
            raise ValueError(f"rate_profile: drives a Poisson stream; use arrival = 'poisson' (got '{self.arrival}')")
        for key in ("utilisation", "rate_rps", "num_requests", "max_concurrency"):
            if getattr(self, key) is not None:
                raise ValueError(f"{key}: the rate comes from rate_profile (and the length from duration_s); "
                                 f"remove {key}")
        if isinstance(self.rate_profile, DiurnalProfile):
            check_request_count(self.rate_profile.peak_rps, self.duration_s, "rate_profile.peak_rps")

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        self._check_loop()
        self._check_conversations()
        self._check_profile()
        if self.arrival == "trace" and not self.trace:
            raise ValueError("arrival 'trace' needs trace = '<path to a trace file>'")
        for key in WORKLOAD_ARRIVAL_KEYS:
            if getattr(self, key) != type(self).model_fields[key].default and (why := workload_key_unused(key, self.arrival)):
                raise ValueError(why)
        if (self.trace_start_s is not None or self.trace_end_s is not None) and not self.replays_trace:
            raise ValueError("trace_start_s / trace_end_s select a window of a trace; they need arrival = 'trace' "
                             "(or 'closed' with a trace)")
        if self.trace_end_s is not None and self.trace_end_s <= (self.trace_start_s or 0.0):
            raise ValueError(f"trace_end_s ({self.trace_end_s}) must be after trace_start_s ({self.trace_start_s or 0.0})")
        if self.replays_trace and self.trace and not Path(self.trace).is_file():
            raise ValueError(not_found("trace file", self.trace))
        growth = self.conversations.growth_tokens if self.conversations is not None else None
        for name, d in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens),
                        ("conversations.growth_tokens", growth)):
            if isinstance(d, Empirical) and not Path(d.trace).is_file():
                raise ValueError(f"{name}: {not_found('trace file', d.trace)}")
        if (self.arrival not in ("trace", "closed") and self.utilisation is None and self.rate_rps is None
                and self.rate_profile is None):
            raise ValueError("set utilisation = <fraction of capacity>, rate_rps = <requests/s> or rate_profile")
        if self.utilisation is not None and self.rate_rps is not None:
            raise ValueError(f"utilisation = {self.utilisation:g} and rate_rps = {self.rate_rps:g} are both set; they are "
                             "two ways to give one offered load: keep one of them")
        if self.rate_rps is not None and self.num_requests is None and self.arrival != "trace":
            check_request_count(self.rate_rps, self.duration_s, "rate_rps")
        if self.warmup_s >= self.duration_s and self.num_requests is None:
            raise ValueError(f"warmup_s ({self.warmup_s}) must be shorter than duration_s ({self.duration_s})")
        total = sum(c.share for c in self.classes)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"classes' shares must add up to 1, got {total:g}")
        if len({c.name for c in self.classes}) != len(self.classes):
            raise ValueError("classes must have distinct names")
        return self


# [workload] keys that act with some arrivals only (the others: `Workload._check_loop`)
WORKLOAD_ARRIVAL_KEYS = {"trace": ("trace", "closed"), "trace_format": ("trace", "closed"), "cv": ("gamma",)}


def workload_key_unused(key: str, arrival: str) -> str | None:
    """Why a [workload] key of WORKLOAD_ARRIVAL_KEYS does nothing with `arrival` (the one-line
    message with the fix), or None when it acts."""
    if arrival in WORKLOAD_ARRIVAL_KEYS[key]:
        return None
    if key == "cv":
        return (f"cv: the coefficient of variation of gamma inter-arrival times needs arrival = 'gamma' "
                f"(arrival is '{arrival}'); remove cv, or set arrival = 'gamma'")
    return (f"{key}: a trace is replayed only with arrival = 'trace' (or 'closed': its lengths in order); arrival "
            f"is '{arrival}': set arrival = 'trace', or remove {key} (to draw lengths from a trace, use "
            "prompt_tokens = { dist = \"empirical\", trace = \"...\" })")


def check_request_count(rate_rps: float, duration_s: float, field: str) -> None:
    """Refuse a run expected to hold more than MAX_REQUESTS requests (ValueError naming `field`)."""
    expected = rate_rps * duration_s
    if expected > MAX_REQUESTS:
        raise ValueError(
            f"{field}={rate_rps:g} req/s over duration_s={duration_s:g} s is about {expected:.3g} requests; "
            f"one run holds at most {MAX_REQUESTS:,} (lower {field} or duration_s)"
        )


# SLO targets, named like vLLM's goodput: a latency metric, a percentile, seconds
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
SLO_PERCENTILES = ("p50", "p90", "p95", "p99")
SLO_KEYS = tuple(f"{m}_{p}_s" for m in SLO_METRICS for p in SLO_PERCENTILES)
# without an [slo] table: MLPerf Inference's server constraints for Llama-2-70B (TTFT 2 s, TPOT 200 ms)
DEFAULT_SLO = {"ttft_p99_s": 2.0, "tpot_p99_s": 0.2}


class SLO(_Strict):
    """Latency targets, each `<metric>_<percentile>_s` (metric: ttft, tpot, itl, e2e; percentile:
    p50, p90, p95, p99). ITL is the gap between streamed chunks, TPOT the per-request mean time per
    output token (docs/METRICS.md). A scenario without an [slo] table gets DEFAULT_SLO; a table
    that is given holds exactly its own targets."""

    ttft_p50_s: Annotated[float, Field(gt=0)] | None = None
    ttft_p90_s: Annotated[float, Field(gt=0)] | None = None
    ttft_p95_s: Annotated[float, Field(gt=0)] | None = None
    ttft_p99_s: Annotated[float, Field(gt=0)] | None = None
    tpot_p50_s: Annotated[float, Field(gt=0)] | None = None
    tpot_p90_s: Annotated[float, Field(gt=0)] | None = None
    tpot_p95_s: Annotated[float, Field(gt=0)] | None = None
    tpot_p99_s: Annotated[float, Field(gt=0)] | None = None
    itl_p50_s: Annotated[float, Field(gt=0)] | None = None
    itl_p90_s: Annotated[float, Field(gt=0)] | None = None
    itl_p95_s: Annotated[float, Field(gt=0)] | None = None
    itl_p99_s: Annotated[float, Field(gt=0)] | None = None
    e2e_p50_s: Annotated[float, Field(gt=0)] | None = None
    e2e_p90_s: Annotated[float, Field(gt=0)] | None = None
    e2e_p95_s: Annotated[float, Field(gt=0)] | None = None
    e2e_p99_s: Annotated[float, Field(gt=0)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"must be a table of targets such as ttft_p99_s = 2.0, got {data!r}")
        for key in data:
            if key not in SLO_KEYS:
                raise ValueError(slo_key_hint(str(key)))
        return data

    def targets(self) -> dict[str, float]:
        """The targets that are set, by name (`ttft_p99_s`: 2.0, ...), in SLO_KEYS order."""
        got = {k: getattr(self, k) for k in SLO_KEYS if getattr(self, k) is not None}
        return got

    def describe(self) -> str:
        """`p99 TTFT <= 2 s, p99 TPOT <= 200 ms` (empty SLO: 'no latency targets')."""
        parts = []
        for k, v in self.targets().items():
            metric, pct, _ = k.split("_")
            val = f"{v:g} s" if v >= 1 else f"{v * 1e3:g} ms"
            parts.append(f"{pct} {metric.upper()} <= {val}")
        return ", ".join(parts) or "no latency targets"


def slo_key_hint(key: str) -> str:
    """The one-line message for an unknown SLO key, with the nearest valid name."""
    near = difflib.get_close_matches(key, SLO_KEYS, n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return (f"unknown SLO target '{key}'{hint} (targets are <metric>_<percentile>_s with metric ttft, tpot, itl "
            f"or e2e and percentile p50, p90, p95 or p99, e.g. ttft_p99_s = 2.0)")


class SimSettings(_Strict):
    drain_s: Annotated[float, Field(ge=0)] | None = None  # default: max(duration_s, 600)
    backlog_limit: Annotated[int, Field(ge=1)] | None = None  # waiting requests per replica
    # advance runs of pure decode steps in one event (exact: docs/PERFORMANCE.md); false: one event per step
    fuse_steps: bool = True
    # the length of each row of the intervals table (per-interval latencies, throughput, replicas)
    interval_s: Annotated[float, Field(gt=0)] = 300.0
    # end an open-loop run as soon as its SLO is certain to fail (a percentile target on TTFT,
    # TPOT or E2E already missed by enough of the window's requests: sim.metrics.SloWatch); its
    # summary then says so (`stopped_early`) and judges nothing else. The planner's long reruns use it.
    # Closed loops and max_concurrency runs ignore it (they run as given)
    stop_on_slo_fail: bool = False
    # a counterfactual for attribution (sim.attribution): the drafter's KV cache takes no room in
    # the pool, so the run shows what the drafter's KV cost in admitted sequences
    draft_kv_free: bool = False


class Autoscale(_Strict):
    """A replica-count policy over time (docs/METRICS.md, 'Autoscaling'). Every `interval_s` the
    policy sees the last interval: `target_utilisation` sizes the live replicas so that the
    offered rate is `target` of their capacity (the speculation-off capacity per replica, the
    reference of workload.utilisation); `queue` so that the requests in system per replica are at
    most `target` (Knative's concurrency target: desired = ceil(in system / target)). A new
    replica serves after `replica_warmup_s` (billed meanwhile); a replica removed drains: it gets
    no new requests and leaves when empty. Scale-down takes the highest recommendation of the
    last `scale_down_window_s` (Kubernetes HPA's downscale stabilisation, default 300 s)."""

    policy: Literal["target_utilisation", "queue"]
    target: Annotated[float, Field(gt=0)]
    interval_s: Annotated[float, Field(gt=0)] = 60.0
    # default: the replica's weights read at 5 GB/s (local NVMe) + 60 s of engine start-up
    # (torch.compile, CUDA-graph capture), sim.deployment.default_warmup_s
    replica_warmup_s: Annotated[float, Field(ge=0)] | None = None
    min_replicas: Annotated[int, Field(ge=1)] = 1
    max_replicas: Annotated[int, Field(ge=1)] | None = None  # default: the rack's replicas
    initial_replicas: Annotated[int, Field(ge=1)] | None = None  # default: min_replicas
    scale_down_window_s: Annotated[float, Field(ge=0)] = 300.0

    @model_validator(mode="after")
    def _bounds(self) -> Autoscale:
        if self.policy == "target_utilisation" and self.target > 1:
            raise ValueError(f"target={self.target:g}: with policy 'target_utilisation' it is a fraction of capacity "
                             "in (0, 1], e.g. 0.7")
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        init = self.initial_replicas
        if init is not None and (init < self.min_replicas or (self.max_replicas is not None and init > self.max_replicas)):
            raise ValueError(f"initial_replicas ({init}) must lie in [min_replicas, max_replicas]")
        return self


class Disaggregation(_Strict):
    """Prefill and decode on separate pools (xPyD; docs/MODEL.md, 'Disaggregated serving'). The
    decode pool is the scenario's [rack] and [deployment] (with [speculative]); the prefill pool is
    `prefill_replicas` replicas of the same model at `prefill_tensor_parallel` on `prefill_gpu`. Each
    finished prefill's KV moves to a decode replica over `link`, priced by bytes over bandwidth plus
    latency; the decode replica admits the request once its KV has arrived."""

    prefill_replicas: Annotated[int, Field(ge=1, le=4096)]
    prefill_gpu: str | None = None  # default: rack.gpu
    prefill_tensor_parallel: Annotated[int, Field(ge=1)] | None = None  # default: deployment.tensor_parallel
    prefill_usd_per_gpu_hour: Annotated[float, Field(ge=0)] | None = None  # default: as [rack] prices its GPU
    link: str = "infiniband-ndr"  # the KV fabric, from the catalogue (models.catalog.LINKS)
    link_gbps: Annotated[float, Field(gt=0)] | None = None  # override: Gbit/s per GPU, one direction
    link_latency_us: Annotated[float, Field(ge=0)] | None = None  # override: one transfer's fixed latency
    # the draft's prefill (speculation in the decode pool): run in the prefill pool and its KV sent
    # with the target's ("transfer", the default where the draft has KV), or recomputed by the decode
    # replica at admission ("recompute")
    draft_prefill: Literal["transfer", "recompute"] | None = None

    _gpu = field_validator("prefill_gpu")(staticmethod(lambda v: None if v is None else gpu_name(v)))

    @field_validator("link")
    @classmethod
    def _link(cls, v: str) -> str:
        if v.lower() not in LINKS:
            raise unknown("link", v, tuple(LINKS))
        return v.lower()


class ScenarioSpec(_Strict):
    """One experiment's sections, each validated on its own: the rack, the deployment on it,
    optional speculative decoding, the workload, the SLO and simulator settings (immutable). The
    cross-field checks are `sim.scenario.Scenario`'s, which every loaded scenario is."""

    name: str = "scenario"
    seed: int = 1
    rack: Rack = Rack()
    deployment: Deployment = Deployment()
    speculative: Speculative | None = None
    workload: Workload = Workload(utilisation=0.5)
    slo: SLO = SLO(**DEFAULT_SLO)
    sim: SimSettings = SimSettings()
    autoscale: Autoscale | None = None
    disaggregation: Disaggregation | None = None

    @field_validator("seed", mode="before")
    @classmethod
    def _seed(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"must be a non-negative integer (0, 1, 2, ...), got {v!r}")
        return v

    @model_validator(mode="after")
    def _affinity_has_hashes(self) -> ScenarioSpec:
        """prefix_affinity routes by the replicas' cached prefixes, which only requests carrying
        block hashes fill (a trace's hash_ids, conversations): without any, it is least
        outstanding under another name, and the run reports no cache figures."""
        dep, wl = self.deployment, self.workload
        if dep.router != "prefix_affinity" or not dep.prefix_caching or wl.conversations is not None:
            return self
        fix = ("replay a trace with hash_ids (Mooncake JSONL), use [workload] conversations, or set "
               "deployment.router = 'least_outstanding'")
        if wl.replays_trace and wl.trace:
            try:
                table = load_trace(wl.trace, wl.trace_format)
            except ConfigError:
                return self  # (the trace's own error comes from the deployment's checks)
            if "hash_ids" in table.columns and bool((table["hash_ids"].str.len() > 0).any()):
                return self
            raise ValueError(f"deployment.router 'prefix_affinity' routes by cached prefixes, but the trace "
                             f"{Path(wl.trace).name} has no hash_ids (no request carries block hashes, so "
                             f"nothing is cached); {fix}")
        raise ValueError("deployment.router 'prefix_affinity' routes by cached prefixes, but the workload's requests "
                         "carry no block hashes (synthetic single-turn requests: nothing is cached); " + fix)

    def key(self) -> str:
        """Content hash of the scenario and of the files it reads (traces, efficiency file), for
        caching and resumable sweeps: an edited trace never reuses stale points."""
        wl, dep = self.workload, self.deployment
        files = [wl.trace if wl.replays_trace else None, dep.efficiency_file, dep.config_json,
                 self.speculative.draft_model_config if self.speculative else None]
        if isinstance(wl.rate_profile, CsvProfile):
            files.append(wl.rate_profile.file)
        growth = wl.conversations.growth_tokens if wl.conversations is not None else None
        files += [d.trace for d in (wl.prompt_tokens, wl.output_tokens, growth) if isinstance(d, Empirical)]
        digests = {f: file_digest(f) for f in files if f}
        data: dict[str, Any] = self.model_dump(mode="json")
        if not data["sim"]["stop_on_slo_fail"]:  # (off: the keys, and the points kept under them, of before it)
            del data["sim"]["stop_on_slo_fail"]
        blob = json.dumps({"scenario": data, "files": digests} if digests else data, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
