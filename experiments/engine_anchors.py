"""Whole-system anchors of the engine profiles: published serving benchmarks, each with its setup
and source, as load points to be reproduced by simulating the benchmark (experiments.calibrate).

`FIT` anchors are fitted; `CHECK` anchors are kept as checks of generalisation and never fitted
(shared/reference/README.md: the Llama-3-8B figures of the vLLM v0.6.0 post, and every
speculative-decoding outcome). Request lengths: the benchmarks used ShareGPT, which we do not
ship; each anchor's lengths are drawn from a ShareGPT-like lognormal (prompt p90/median 480/130,
output 400/130, truncated at 1024: shared/reference/README.md) scaled so the means equal the
benchmark's reported average input and output tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from experiments.calibrate import LoadPoint, lengths_from
from sim.scenario import LogNormal
from sim.workload import LengthSampler

SHAREGPT_P90_OVER_MEDIAN = {"prompt_tokens": 480 / 130, "output_tokens": 400 / 130}
SHAREGPT_MAX = 1024
INF = float("inf")


@cache
def sharegpt_like(column: str, mean_tokens: float) -> LogNormal:
    """The ShareGPT-like lognormal of this column whose (rounded, clipped) mean is `mean_tokens`."""
    ratio = SHAREGPT_P90_OVER_MEDIAN[column]
    lo, hi = 1.0, float(SHAREGPT_MAX)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        d = LogNormal(dist="lognormal", median=mid, p90=mid * ratio, max=SHAREGPT_MAX)
        lo, hi = (mid, hi) if LengthSampler(d, column).mean() < mean_tokens else (lo, mid)
    return LogNormal(dist="lognormal", median=lo, p90=lo * ratio, max=SHAREGPT_MAX)


@dataclass(frozen=True)
class Anchor:
    """A published benchmark of one engine on one deployment, at one or more load points."""

    name: str
    profile: str  # the engine profile it anchors
    model: str
    gpu: str
    tp: int
    deployment: dict[str, Any]  # the benchmark's engine settings (overrides of the profile)
    mean_in: float
    mean_out: float
    points: tuple[tuple[str, int, float, dict[str, float]], ...]  # (label, prompts, rate, measured)
    source: str
    note: str = ""
    role: str = "fit"  # "fit" | "check"
    seed: int = 0  # of the drawn lengths
    extra: dict[str, Any] = field(default_factory=dict)

    def load_points(self) -> list[LoadPoint]:
        out = []
        for i, (label, n, rate, measured) in enumerate(self.points):
            p = lengths_from(sharegpt_like("prompt_tokens", self.mean_in), n, self.seed + 2 * i, "prompt_tokens")
            o = lengths_from(sharegpt_like("output_tokens", self.mean_out), n, self.seed + 2 * i + 1, "output_tokens")
            out.append(LoadPoint(f"{self.name}@{label}", p, o, rate, measured=measured, source=self.source))
        return out


_V060_BLOG = "vLLM v0.6.0 performance blog (blog.vllm.ai, 2024-09-05), charts read by eye; shared/reference/README.md"
_SGL_060 = ("sgl-project/sglang benchmark/benchmark_vllm_060/README.md (SGLang 0.3.0 vs vLLM 0.6.0, "
            "sglang.bench_serving ShareGPT, Poisson; medians)")
_B1 = "vllm-project/vllm PR #18566 (2025-05), `vllm bench serve` ShareGPT 1000 prompts, rate inf, server defaults"

ANCHORS: tuple[Anchor, ...] = (
    Anchor("vllm060-blog-70b", "vllm-0.6", "llama-3.1-70b", "h100-sxm", 4,
           # nightly-tests.json of the blog's harness: max_num_seqs 512, num_scheduler_steps 10;
           # Llama-3 (8K context) without chunked prefill: max_num_batched_tokens = max_model_len
           {"max_num_seqs": 512, "scheduler_steps": 10, "max_num_batched_tokens": 8192},
           202, 179,
           (("qps2", 500, 2.0, {"mean_tpot_ms": 22.0}), ("qps8", 500, 8.0, {"mean_tpot_ms": 29.0}),
            ("qps16", 500, 16.0, {"mean_tpot_ms": 40.0}), ("qps32", 500, 32.0, {"mean_tpot_ms": 55.0}),
            ("inf", 500, INF, {"request_throughput": 17.3})),
           _V060_BLOG, "Llama-3-70B BF16 (Llama-3.1-70B's architecture), 500 ShareGPT prompts, avg 202 in / 179 out"),
    Anchor("sglang-readme-vllm060-70b", "vllm-0.6", "llama-3.1-70b", "h100-sxm", 4,
           # --num-scheduler-steps 10 --max_model_len 4096: no chunked prefill, budget 4096, 256 seqs
           {"max_num_seqs": 256, "scheduler_steps": 10, "max_num_batched_tokens": 4096},
           224, 189,
           (("rps4", 1200, 4.0, {"median_tpot_ms": 23.58, "median_ttft_ms": 179.15}),
            ("rps8", 2400, 8.0, {"median_tpot_ms": 29.15, "median_ttft_ms": 207.12}),
            ("inf", 5000, INF, {"request_throughput": 19.04, "output_throughput": 3700.64})),
           _SGL_060, "Llama-3.1-70B-Instruct BF16 TP4; avg lengths 224/189 from the same sglang.bench_serving "
           "ShareGPT sample (SGLang issue #2097); median ITL not used: multi-step streams ~10 tokens per chunk"),
    Anchor("sglang-readme-sglang030-70b", "sglang", "llama-3.1-70b", "h100-sxm", 4,
           {},
           224, 189,
           (("rps4", 1200, 4.0, {"median_tpot_ms": 25.03, "median_ttft_ms": 53.94, "median_itl_ms": 21.67}),
            ("rps8", 2400, 8.0, {"median_tpot_ms": 33.07, "median_ttft_ms": 58.11, "median_itl_ms": 24.45}),
            ("inf", 5000, INF, {"request_throughput": 19.84, "output_throughput": 3856.01})),
           _SGL_060, "SGLang 0.3.0 --disable-radix-cache --tp 4, Llama-3.1-70B-Instruct BF16"),
    Anchor("vllm-v1-8b-sharegpt-inf", "vllm-v1", "llama-3.1-8b", "h100-sxm", 1,
           {},
           230, 203,
           (("inf", 1000, INF, {"request_throughput": 32.42, "output_throughput": 6582.87, "mean_tpot_ms": 77.86,
                                "median_tpot_ms": 48.84, "mean_itl_ms": 38.13, "median_itl_ms": 25.44,
                                "mean_ttft_ms": 9626.13, "median_ttft_ms": 9459.70}),),
           _B1, "Llama-3.1-8B-Instruct, vLLM ~0.9 (V1) defaults; the post does not name the GPU: H100 assumed "
           "(the author's usual machine)"),
    # checks (never fitted): Llama-3.1-8B on one A100 80G, a GPU family with no step-level anchor
    Anchor("sglang-readme-vllm060-8b-a100", "vllm-0.6", "llama-3.1-8b", "a100-80gb", 1,
           {"max_num_seqs": 256, "scheduler_steps": 10, "max_num_batched_tokens": 4096},
           224, 189,
           (("rps4", 1200, 4.0, {"median_tpot_ms": 14.14, "median_ttft_ms": 100.48}),
            ("rps8", 2400, 8.0, {"median_tpot_ms": 17.09, "median_ttft_ms": 120.39}),
            ("inf", 5000, INF, {"request_throughput": 21.27, "output_throughput": 4132.37})),
           _SGL_060, "Llama-3.1-8B on 1x A100 80G: checks generalisation to another model and GPU", role="check"),
    Anchor("sglang-readme-sglang030-8b-a100", "sglang", "llama-3.1-8b", "a100-80gb", 1,
           {},
           224, 189,
           (("rps4", 1200, 4.0, {"median_tpot_ms": 13.17, "median_ttft_ms": 31.98, "median_itl_ms": 11.93}),
            ("rps8", 2400, 8.0, {"median_tpot_ms": 17.85, "median_ttft_ms": 35.68, "median_itl_ms": 14.41}),
            ("inf", 5000, INF, {"request_throughput": 22.03, "output_throughput": 4281.51})),
           _SGL_060, "SGLang 0.3.0 --enable-torch-compile, Llama-3.1-8B on 1x A100 80G", role="check"),
)
