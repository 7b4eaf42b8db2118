"""Engine profiles: what a real serving engine achieves on the hardware, and how it schedules.

A profile is named after the engine and version people run (`vllm-v1`, `vllm-0.6`, `sglang`,
`trtllm`, `trtllm-untuned`). It holds

- the efficiency factors of the step cost model (`Efficiency`): the hardware-side fractions of
  peak (`mfu_max`, `mfu_max_quant`, `bw_eff`, all-reduce latency), shared by every profile and
  fitted to step-level anchors (`models.calibration.fit`), and the software-side fixed costs,
  fitted per profile: once per engine step (`step_overhead_s`), once per layer per forward pass
  (`layer_overhead_s`) and once per running sequence per step (`seq_overhead_s`: host-side
  scheduling, sampling, detokenisation and output processing, which grows with the batch), and
  once per request between the client's send and the engine's queue (`frontend_s`: HTTP,
  tokenisation; it adds to TTFT and E2E, never to throughput), and once per draft forward pass
  (`draft_pass_overhead_s`: a small draft's pass is launch- and sync-bound, not work-bound);
- the scheduling behaviour (`Scheduling`): whether prefills share a step with decodes
  (`"mixed"`, vLLM V1, TensorRT-LLM in-flight batching) or run in steps of their own that come
  first (`"separate"`, vLLM 0.6's default scheduler, SGLang), whether long prompts are chunked,
  and the engine's default `max_num_batched_tokens` and `max_num_seqs`.

The fitted numbers live here, as data both the cost model and the calibrators read (re-derive
them with `python -m models.calibration` and `python -m experiments.calibrate --profiles`; the
tests check they are current). Sources and fit errors: docs/CALIBRATION.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from models.errors import ConfigError, unknown


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak and fixed costs of a real engine on one GPU family."""

    mfu_max: float  # achieved fraction of peak FLOPs at large tokens per step, bf16 weights
    mfu_max_quant: float  # the same for quantised weights, of that format's own (higher) peak
    mfu_half_tokens: float  # tokens per step at which half of mfu_max is reached
    bw_eff: float  # achieved fraction of HBM bandwidth
    step_overhead_s: float  # once per engine step: scheduling, launching the step
    layer_overhead_s: float  # per layer per forward pass: launches and syncs not hidden by graphs
    allreduce_latency_s: float  # fixed latency of one small all-reduce
    comm_eff: float  # achieved fraction of interconnect bandwidth for large all-reduces
    seq_overhead_s: float = 0.0  # per running sequence per engine step: host-side work on its output
    frontend_s: float = 0.0  # per request, from the client's send to the engine's queue (HTTP, tokenisation)
    draft_pass_overhead_s: float = 0.0  # per draft forward pass: its launch, draft sampling, host sync
    # host work per running sequence that an engine can take off the step's critical path:
    # scheduling and input preparation, once per scheduling decision (multi-step amortises it): a
    # fixed part and a part per running sequence
    sched_step_s: float = 0.0
    sched_seq_s: float = 0.0
    output_seq_s: float = 0.0  # output processing (detokenising, stop checks), per step; hidden when overlapped
    source: str = ""


@dataclass(frozen=True)
class Scheduling:
    """How an engine builds each step (see sim/engine.py for the order of work)."""

    prefill: Literal["mixed", "separate"]  # prefill chunks share steps with decodes, or run first, alone
    chunked_prefill: bool  # long prompts split over steps by the token budget (else whole prompts)
    max_num_batched_tokens: int  # the engine's default token budget per step
    max_num_seqs: int  # the engine's default running-sequence limit
    scheduler_steps: int = 1  # decode steps per scheduling decision (vLLM 0.6 --num-scheduler-steps)
    async_output: bool = False  # output processing overlapped with the next step (vLLM 0.6 async output processing)


@dataclass(frozen=True)
class SpecBehaviour:
    """What an engine version does differently when speculative decoding is configured, read from
    its source (`source` names the files and versions)."""

    # how the target scores k drafted tokens: "multi_query" (one sequence of k + 1 query tokens)
    # or "batch_expansion" (k + 1 sequences of one query token each, every one reading its context)
    scoring: Literal["multi_query", "batch_expansion"] = "multi_query"
    serial_output: bool = False  # speculation turns the overlapped output processing off ...
    overlap_kept_for: tuple[str, ...] = ()  # ... except with these methods
    multi_step_refused: str = ""  # where the engine refuses multi-step scheduling with speculation ("": allowed)
    max_num_seqs: int | None = None  # the running-sequence limit a speculating engine defaults to
    per_token_output: bool = False  # output processing runs once per emitted token (up to k + 1 a step)
    source: str = ""


@dataclass(frozen=True)
class EngineProfile:
    name: str
    engine: str  # the engine and version, in words
    scheduling: Scheduling
    software: dict[str, float]  # the SOFTWARE_FIELDS
    fitted_to: str  # what the software factors were fitted to
    note: str = ""
    spec: SpecBehaviour = SpecBehaviour()


# Hardware-side factors of the Hopper family, fitted to the step-level anchors by
# models.calibration.fit() (docs/CALIBRATION.md); shared by every profile.
HARDWARE: dict[str, float] = dict(mfu_max=0.6312, mfu_max_quant=0.4988, bw_eff=0.9264, allreduce_latency_s=2e-6)
# Held fixed (orientation values, docs/CALIBRATION.md)
FIXED: dict[str, float] = dict(mfu_half_tokens=24.0, comm_eff=0.7)
SOFTWARE_FIELDS = ("step_overhead_s", "layer_overhead_s", "seq_overhead_s", "frontend_s", "draft_pass_overhead_s",
                   "sched_step_s", "sched_seq_s", "output_seq_s")

PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        EngineProfile(
            "vllm-v1", "vLLM V1 engine (vLLM 0.8 and later; the only engine from 0.11), fitted on vLLM 0.11",
            # chunked prefill always on; defaults for the OpenAI server on >= 70 GiB GPUs
            # (vllm/engine/arg_utils.py, default_max_num_batched_tokens / default_max_num_seqs)
            Scheduling("mixed", True, 8192, 1024),
            dict(step_overhead_s=0.0, layer_overhead_s=5.470e-5, seq_overhead_s=4.141e-5, frontend_s=5.114e-2,
                 draft_pass_overhead_s=9.031e-4),
            "vLLM 0.11.0's concurrency curve of Qwen3-8B on 1x H100 (GPUStack) by simulating the benchmark, "
            "with the per-draft-pass overhead fitted to the draft-cost ratios measured on vLLM 0.10.1"),
        EngineProfile(
            "vllm-0.6", "vLLM 0.6.x (V0 engine, default scheduler: prefills first, no chunking)",
            # async output processing on by default (vllm/config.py, ModelConfig.verify_async_output_proc)
            Scheduling("separate", False, 8192, 256, async_output=True),
            dict(step_overhead_s=0.0, layer_overhead_s=1.152e-4, seq_overhead_s=5.21e-5, frontend_s=5.077e-2,
                 draft_pass_overhead_s=6.295e-4, sched_seq_s=2.875e-5, output_seq_s=2.671e-6),
            "vLLM 0.6.0 load curves of Llama-3-70B on 4x H100 (the v0.6.0 blog; SGLang's vLLM 0.6.0 benchmark), "
            "by simulating each benchmark, with the multi-step and async-output gains the v0.6.0 blog reports; "
            "per-draft-pass overhead from the vLLM 0.10.1 draft-cost ratios as fitted with vLLM 0.6's other fixed costs",
            spec=SpecBehaviour(
                "batch_expansion", serial_output=True, per_token_output=True,
                multi_step_refused="vllm/engine/arg_utils.py, EngineArgs.create_engine_config",
                source="vLLM 0.6.0-0.6.6: vllm/engine/arg_utils.py (multi-step refused with speculation), vllm/config.py "
                       "ModelConfig.verify_async_output_proc (async output processing off), vllm/spec_decode/"
                       "spec_decode_worker.py create_worker (MQA scoring only under enforce_eager: batch expansion with "
                       "CUDA graphs), vllm/engine/output_processor/interfaces.py (lookahead slots: the multi-token "
                       "output processor)")),
        EngineProfile(
            "sglang", "SGLang 0.3 (prefill batches first, chunked at 8192 tokens; streaming breaks its multi-decode loop)",
            Scheduling("separate", True, 8192, 1024),
            dict(step_overhead_s=0.0, layer_overhead_s=1.070e-4, seq_overhead_s=8.185e-5, frontend_s=1.805e-2,
                 draft_pass_overhead_s=6.295e-4),
            "SGLang 0.3.0 load curves of Llama-3.1-70B on 4x H100 (SGLang's vLLM 0.6.0 benchmark), by simulating "
            "each benchmark; per-draft-pass overhead from the vLLM 0.10.1 draft-cost ratios as fitted with "
            "vLLM 0.6's other fixed costs"),
        EngineProfile(
            "sglang-0.5", "SGLang 0.5.3 (overlap scheduler; prefill batches first, chunked at 8192 tokens)",
            # the overlap scheduler runs the host work of step i + 1 during step i: its per-sequence
            # host cost is off the critical path (`output_seq_s`, overlapped) until speculation turns it off
            Scheduling("separate", True, 8192, 1024, async_output=True),
            dict(step_overhead_s=0.0, layer_overhead_s=4.897e-5, seq_overhead_s=0.0, frontend_s=1.430e-2,
                 draft_pass_overhead_s=6.295e-4, output_seq_s=8.185e-5),
            "SGLang 0.5.3's Qwen3-8B point on 1x H100 at concurrency 4 (GPUStack) by simulating the benchmark; "
            "the host cost per sequence the overlap scheduler hides is SGLang 0.3's, which had none (sglang profile)",
            spec=SpecBehaviour(
                serial_output=True, max_num_seqs=48,
                source="SGLang 0.4.6-0.5.6: python/sglang/srt/server_args.py (_handle_speculative_decoding: "
                       "disable_overlap_schedule, max_running_requests 48, no mixed chunks for EAGLE, EAGLE3, STANDALONE)")),
        EngineProfile(
            "trtllm-1.2", "TensorRT-LLM 1.2 PyTorch backend (overlap scheduler, in-flight batching)",
            Scheduling("mixed", False, 8192, 2048, async_output=True),
            dict(step_overhead_s=0.0, layer_overhead_s=6.444e-5, seq_overhead_s=0.0, frontend_s=3.826e-2,
                 draft_pass_overhead_s=6.295e-4),
            "TensorRT-LLM 1.2.0rc1's Qwen3-8B point on 1x H100 at concurrency 4 (GPUStack) by simulating the "
            "benchmark; no measured host cost per sequence (none charged, overlapped or not)",
            spec=SpecBehaviour(
                serial_output=True, overlap_kept_for=("mtp", "eagle3"),
                source="TensorRT-LLM 1.0-era tensorrt_llm/_torch/pyexecutor/py_executor_creator.py and "
                       "_torch/speculative/interface.py support_overlap_scheduler (MTP and one-model EAGLE3 keep it)")),
        EngineProfile(
            "trtllm", "TensorRT-LLM, tuned (in-flight batching: whole context requests mixed with generation)",
            Scheduling("mixed", False, 8192, 2048),
            dict(step_overhead_s=1.161e-3, layer_overhead_s=0.0, seq_overhead_s=0.0, frontend_s=0.0, draft_pass_overhead_s=0.0),
            "step-level anchors of tuned TensorRT-LLM (MLPerf v4.1, perf-overview, tuned FP8)"),
        EngineProfile(
            "trtllm-untuned", "TensorRT-LLM 0.16 at default build settings, BF16 (the performance-tuning guide's start)",
            Scheduling("mixed", False, 8192, 256),
            dict(step_overhead_s=0.0, layer_overhead_s=2.174e-4, seq_overhead_s=0.0, frontend_s=0.0, draft_pass_overhead_s=0.0),
            "step-level anchors of untuned BF16 TensorRT-LLM (performance-tuning guide, FP8 guide BF16 row); with them the draft-cost ratios pin the shared hardware factors"),
    )
}
# Names of earlier releases: `baseline` was fitted to untuned TensorRT-LLM, `tuned` to tuned TensorRT-LLM.
ALIASES = {"baseline": "trtllm-untuned", "tuned": "trtllm"}
# What most planners run today (vLLM V1 is vLLM's only engine since 0.11): docs/CALIBRATION.md
DEFAULT_PROFILE = "vllm-v1"
PROFILE_NAMES = tuple(PROFILES) + tuple(ALIASES)


def get_profile(name: str) -> EngineProfile:
    """The profile of this name (or alias); an unknown name is a one-line error."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in PROFILES:
        raise unknown("engine profile", name, PROFILE_NAMES)
    return PROFILES[key]


def resolve(name: str) -> str:
    """The canonical profile name (aliases resolved)."""
    return get_profile(name).name


_FAMILIES_UNCALIBRATED = ("ampere", "blackwell", "ada", "cdna3")


def efficiency_for(gpu_family: str, engine: str = DEFAULT_PROFILE) -> Efficiency:
    """The calibrated efficiency of this GPU family under an engine profile. Only Hopper has
    anchors; other families reuse its factors and say so in `source`."""
    p = get_profile(engine)
    src = f"{p.name}: {p.fitted_to} (docs/CALIBRATION.md)"
    if gpu_family != "hopper":
        src = f"uncalibrated on {gpu_family}: Hopper's factors; {src}"
    return Efficiency(**HARDWARE, **FIXED, **p.software, source=src)


def with_software(profile: str, software: dict[str, float]) -> EngineProfile:
    """A copy of the profile with other software factors (for fitting)."""
    bad = set(software) - set(SOFTWARE_FIELDS)
    if bad:
        raise ConfigError(f"unknown software factor(s) {sorted(bad)} (known: {', '.join(SOFTWARE_FIELDS)})")
    p = get_profile(profile)
    return dataclasses.replace(p, software={**p.software, **software})
