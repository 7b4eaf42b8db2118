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

from dataclasses import dataclass
from functools import cache
from typing import Any

from experiments.calibrate import (
    SOFTWARE_HI,
    SOFTWARE_LO,
    SOFTWARE_SCALE,
    LoadPoint,
    compare,
    lengths_from,
    scenario_for,
    with_factors,
)
from models.calibration import ANCHORS as STEP_ANCHORS
from models.calibration import predict
from models.engines import SOFTWARE_FIELDS, efficiency_for, get_profile
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
    # (label, prompts, rate, measured) or (label, prompts, rate, measured, max_concurrency)
    points: tuple[tuple[Any, ...], ...]
    source: str
    note: str = ""
    role: str = "fit"  # "fit" | "check"
    seed: int = 0  # of the drawn lengths
    same_prompts: bool = False  # every point sends the same prompts (a fixed-seed benchmark sample)

    def load_points(self) -> list[LoadPoint]:
        out = []
        for i, (label, n, rate, measured, *conc) in enumerate(self.points):
            s = self.seed + (0 if self.same_prompts else 2 * i)
            p = lengths_from(sharegpt_like("prompt_tokens", self.mean_in), n, s, "prompt_tokens")
            o = lengths_from(sharegpt_like("output_tokens", self.mean_out), n, s + 1, "output_tokens")
            out.append(LoadPoint(f"{self.name}@{label}", p, o, rate, max_concurrency=conc[0] if conc else None,
                                 measured=measured, source=self.source))
        return out


_V060_BLOG = "vLLM v0.6.0 performance blog (blog.vllm.ai, 2024-09-05), charts read by eye; shared/reference/README.md"
_SGL_060 = ("sgl-project/sglang benchmark/benchmark_vllm_060/README.md (SGLang 0.3.0 vs vLLM 0.6.0, "
            "sglang.bench_serving ShareGPT, Poisson; medians)")
_GPUSTACK = ("GPUStack performance lab, docs/performance-lab/qwen3-8b/h100-latency.md (gpustack/gpustack): "
             "`vllm bench serve` ShareGPT, 100 prompts, --max-concurrency N; shared/reference/README.md. "
             "`vllm bench serve` samples its prompts with a fixed seed, so every concurrency and engine sends the same "
             "100; seed 84 draws 100 whose means are within 2% of the published ones")
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
    # the blog's gains of its two host-overlap features on this deployment, each as the anchor above
    # without it: "[multi-step scheduling] improves the throughput of running Llama 70B models on
    # 4xH100 by 28%"; "[asynchronous output processing] improves the time-per-output-token of
    # running Llama 70B models on 4xH100 by 8.7%" (read at the blog's TPOT load, QPS 32); each draws
    # the same prompts as the anchor's point it varies (`seed`)
    Anchor("vllm060-blog-70b-no-multistep", "vllm-0.6", "llama-3.1-70b", "h100-sxm", 4,
           {"max_num_seqs": 512, "scheduler_steps": 1, "max_num_batched_tokens": 8192},
           202, 179,
           (("inf", 500, INF, {"request_throughput": 17.3 / 1.28}),),
           _V060_BLOG, "saturation throughput without multi-step scheduling: 17.3 req/s / 1.28", seed=8),
    Anchor("vllm060-blog-70b-no-async-output", "vllm-0.6", "llama-3.1-70b", "h100-sxm", 4,
           {"max_num_seqs": 512, "scheduler_steps": 10, "max_num_batched_tokens": 8192, "async_output": False},
           202, 179,
           (("qps32", 500, 32.0, {"mean_tpot_ms": 55.0 / (1.0 - 0.087)}),),
           _V060_BLOG, "mean TPOT at QPS 32 without async output processing: 55 ms / (1 - 0.087)", seed=8),
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
    Anchor("gpustack-vllm011-qwen3-8b", "vllm-v1", "qwen3-8b", "h100-sxm", 1,
           {},
           233, 221,
           (("c1", 100, INF, {"mean_tpot_ms": 7.28, "mean_ttft_ms": 59.0, "output_throughput": 132.9}, 1),
            ("c2", 100, INF, {"mean_tpot_ms": 7.37, "mean_ttft_ms": 63.8, "output_throughput": 257.2}, 2),
            ("c4", 100, INF, {"mean_tpot_ms": 7.38, "mean_ttft_ms": 64.0, "output_throughput": 496.9}, 4),
            ("c8", 100, INF, {"mean_tpot_ms": 7.71, "mean_ttft_ms": 74.6, "output_throughput": 917.3}, 8)),
           _GPUSTACK, "vLLM 0.11.0 (V1), Qwen3-8B BF16 on 1x H100 SXM, ShareGPT ~233 in / ~221 out", seed=84, same_prompts=True),
    Anchor("gpustack-sglang053-qwen3-8b", "sglang-0.5", "qwen3-8b", "h100-sxm", 1,
           {},
           233, 221,
           (("c4", 100, INF, {"mean_tpot_ms": 7.19, "mean_ttft_ms": 27.7, "output_throughput": 525.6}, 4),),
           _GPUSTACK, "SGLang 0.5.3.post3, Qwen3-8B BF16 on 1x H100 SXM, ShareGPT ~233 in / ~221 out", seed=84, same_prompts=True),
    Anchor("gpustack-trtllm12-qwen3-8b", "trtllm-1.2", "qwen3-8b", "h100-sxm", 1,
           {},
           233, 221,
           (("c4", 100, INF, {"mean_tpot_ms": 7.67, "mean_ttft_ms": 51.6, "output_throughput": 487.4}, 4),),
           _GPUSTACK, "TensorRT-LLM 1.2.0rc1, Qwen3-8B BF16 on 1x H100 SXM, ShareGPT ~233 in / ~221 out", seed=84, same_prompts=True),
    Anchor("vllm-v1-8b-sharegpt-inf", "vllm-v1", "llama-3.1-8b", "h100-sxm", 1,
           {},
           230, 203,
           (("inf", 1000, INF, {"request_throughput": 32.42, "output_throughput": 6582.87, "mean_tpot_ms": 77.86,
                                "median_tpot_ms": 48.84, "mean_itl_ms": 38.13, "median_itl_ms": 25.44}),),
           _B1, "Llama-3.1-8B-Instruct, vLLM ~0.9 (V1) defaults. Its TTFT (mean 9626 ms, median 9460 ms, p99 12667 ms: every request "
           "waits ~9.5 s, while the whole batch is prefilled in ~2 s of engine time) is a client or frontend "
           "backlog of the chat endpoint, not engine physics: not fitted). The post does not name the GPU; its "
           "median ITL (25 ms at ~800 running sequences) is below what an A100 needs just to read the weights "
           "and KV cache of such a step (~35 ms), so it ran on an H100-class GPU: H100 assumed. A check, not fitted: "
           "the same client backlog spreads the 'all at once' sends over seconds", role="check"),
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


# software factors fitted per profile, in FIT_ORDER. The fixed GPU-side cost of a pass is fitted
# per layer (graph replays, launches and tensor-parallel syncs happen per layer, so a model with
# fewer layers pays less), the host cost per running sequence, and the frontend latency; the
# per-step constant is held at 0 (on one model it cannot be told apart from the per-layer one).
# vllm-v1 fits its own to vLLM 0.11's concurrency curve (GPUStack) together with its per-draft-pass
# overhead, to the draft-cost ratios measured on vLLM 0.10.1. vllm-0.6 and sglang (anchors without
# drafts) keep the per-draft-pass overhead those ratios gave before vllm-v1 had its own fixed costs
# (models.engines: a profile stays as it was fitted).
FIT_FIELDS = {"vllm-0.6": ("layer_overhead_s", "seq_overhead_s", "frontend_s", "sched_seq_s", "output_seq_s"),
              "sglang": ("layer_overhead_s", "seq_overhead_s", "frontend_s"),
              "vllm-v1": ("layer_overhead_s", "seq_overhead_s", "frontend_s", "draft_pass_overhead_s"),
              # one concurrency point each: the fixed cost per layer and the frontend
              "sglang-0.5": ("layer_overhead_s", "frontend_s"), "trtllm-1.2": ("layer_overhead_s", "frontend_s")}
# factors held from another profile's: field -> "profile" (the same field) or "profile.field".
# sglang-0.5's overlapped host cost per sequence is SGLang 0.3's serial one (it had no overlap
# scheduler); its per-draft-pass overhead is the sglang profile's
HELD_FROM: dict[str, dict[str, str]] = {
    "sglang-0.5": {"output_seq_s": "sglang.seq_overhead_s", "draft_pass_overhead_s": "sglang"},
    "trtllm-1.2": {"draft_pass_overhead_s": "sglang"},
}


def held_source(field: str, src: str) -> tuple[str, str]:
    """(profile, field) a held factor comes from (`HELD_FROM`)."""
    prof, _, name = src.partition(".")
    return prof, name or field
FIT_ORDER = ("vllm-0.6", "sglang", "vllm-v1", "sglang-0.5", "trtllm-1.2")
FIT_FIGURES = ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "median_itl_ms", "mean_ttft_ms", "median_ttft_ms",
               "request_throughput", "output_throughput")


def anchors_of(profile: str, role: str = "fit") -> list[Anchor]:
    return [a for a in ANCHORS if a.profile == profile and a.role == role]


def step_anchors_of(profile: str) -> list[Any]:
    """The step-level anchors (models.calibration.ANCHORS) that belong to this profile."""
    return [a for a in STEP_ANCHORS if a.engine == profile]


def _groups(anchors: list[Anchor]) -> list[tuple[Any, list[LoadPoint]]]:
    return [(scenario_for(a.profile, a.model, a.gpu, a.tp, **a.deployment), a.load_points()) for a in anchors]


def evaluate(profile: str, factors: dict[str, float], *, leave_out: str | None = None,
             anchors: list[Anchor] | None = None) -> list[dict[str, Any]]:
    """Rows (anchor point, figure, measured, simulated, error) for a profile at these software
    factors: its whole-system anchors simulated, and its step-level anchors predicted."""
    import dataclasses

    rows: list[dict[str, Any]] = []
    for sc, pts in _groups(anchors if anchors is not None else anchors_of(profile)):
        keep = [p for p in pts if p.name != leave_out]
        rows += compare(with_factors(sc, factors), keep, metrics=FIT_FIGURES)
    eff = dataclasses.replace(efficiency_for("hopper", profile), **factors)  # type: ignore[arg-type]
    for a in step_anchors_of(profile):
        if a.name != leave_out:
            p = predict(a, eff)
            rows.append(dict(point=a.name, load="step-level", metric=a.metric, measured=a.value, simulated=p,
                             error_pct=100.0 * (p / a.value - 1.0)))
    return rows


def current(profile: str) -> dict[str, float]:
    """The profile's committed software factors (held ones taken from their source profile)."""
    soft = {**dict.fromkeys(SOFTWARE_FIELDS, 0.0), **get_profile(profile).software}
    for f, src in HELD_FROM.get(profile, {}).items():
        prof, name = held_source(f, src)
        soft[f] = get_profile(prof).software[name]
    return soft


def fit_profile(profile: str, *, leave_out: str | None = None, start: dict[str, float] | None = None,
                held: dict[str, float] | None = None, max_nfev: int = 30) -> tuple[dict[str, float], float]:
    """Fit a profile's software factors (FIT_FIELDS) to its anchors (every load point of every
    whole-system anchor, each on its own deployment, and its step-level anchors), optionally
    leaving one point (or step anchor) out. Returns the factors (fitted and held) and the MAPE."""
    import math

    import numpy as np
    from scipy.optimize import least_squares

    fields = FIT_FIELDS[profile]
    base = {**current(profile), **(held or {})}
    x0 = np.array([(start or base)[f] for f in fields])
    lo, hi = np.array([SOFTWARE_LO[f] for f in fields]), np.array([SOFTWARE_HI[f] for f in fields])

    def factors(x: np.ndarray) -> dict[str, float]:
        return {**base, **dict(zip(fields, map(float, x), strict=True))}

    def resid(x: np.ndarray) -> np.ndarray:
        return np.array([math.log(max(r["simulated"], 1e-12) / r["measured"])
                         for r in evaluate(profile, factors(x), leave_out=leave_out)])

    res = least_squares(resid, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=[SOFTWARE_SCALE[f] for f in fields],
                        diff_step=0.05, max_nfev=max_nfev)
    final = evaluate(profile, factors(res.x), leave_out=leave_out)
    return factors(res.x), float(np.mean([abs(r["error_pct"]) for r in final]))


def loo_rows(profile: str, factors: dict[str, float]) -> list[dict[str, Any]]:
    """Leave-one-out: each load point (and step anchor) of the profile predicted by a fit to the
    others (warm-started from `factors`)."""
    names = [p.name for a in anchors_of(profile) for p in a.load_points()] + [a.name for a in step_anchors_of(profile)]
    out: list[dict[str, Any]] = []
    if len(names) < 2:
        return out
    for name in names:
        f, _ = fit_profile(profile, leave_out=name, start=factors, max_nfev=15)
        out += [{**r, "loo": True} for r in evaluate(profile, f) if r["point"] == name]
    return out


def table_rows(loo: bool = False) -> list[dict[str, Any]]:
    """Every anchor of every fitted profile at the committed factors (checks included), with the
    leave-one-out prediction of each fitted figure when `loo`."""
    rows: list[dict[str, Any]] = []
    for prof in FIT_ORDER:
        fac = current(prof)
        mine = evaluate(prof, fac, anchors=[a for a in ANCHORS if a.profile == prof])
        loo_by = {(r["point"], r["metric"]): r for r in (loo_rows(prof, fac) if loo else [])}
        roles = {p.name: a.role for a in ANCHORS if a.profile == prof for p in a.load_points()}
        for r in mine:
            lr = loo_by.get((r["point"], r["metric"]))
            rows.append({"profile": prof, "role": roles.get(r["point"], "fit"), **r,
                         "loo_error_pct": lr["error_pct"] if lr else float("nan")})
    return rows


def _main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="refit the engine profiles' software factors to their anchors")
    ap.add_argument("--loo", action="store_true", help="also leave-one-out errors (slow)")
    ap.add_argument("--fit", action="store_true", help="refit (else: evaluate the committed factors)")
    a = ap.parse_args()
    if a.fit:
        held: dict[str, dict[str, float]] = {}
        for prof in FIT_ORDER:
            src = {f: held[p][n] for f, s in HELD_FROM.get(prof, {}).items()
                   for p, n in [held_source(f, s)] if p in held}
            f, mape = fit_profile(prof, held=src)
            held[prof] = f
            print(f"{prof}: {json.dumps({k: float(f'{v:.4g}') for k, v in f.items()})} (MAPE {mape:.1f}%)", flush=True)
    print("| profile | anchor | load | figure | published | simulated | error | leave-one-out |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table_rows(loo=a.loo):
        loo = "" if r["loo_error_pct"] != r["loo_error_pct"] else f"{r['loo_error_pct']:+.1f}%"
        role = " (check)" if r["role"] == "check" else ""
        print(f"| {r['profile']} | {r['point'].split('@')[0]}{role} | {r['point'].split('@')[-1]} | {r['metric']} | "
              f"{r['measured']:.4g} | {r['simulated']:.4g} | {r['error_pct']:+.1f}% | {loo} |")


if __name__ == "__main__":
    _main()
