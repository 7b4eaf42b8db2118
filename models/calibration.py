"""Calibration of the cost model's efficiency factors against published measurements.

`ANCHORS` are the step-level throughput and latency figures of shared/reference/README.md, each
with its setup. `fit()` finds the Hopper hardware factors (shared by every engine profile) and the
software overheads of the two TensorRT-LLM profiles that minimise the squared log error of the
predictions; the result is kept as data in `models.engines` (re-derive it with
`python -m models.calibration`, which also prints the table published in docs/CALIBRATION.md).
The vLLM and SGLang profiles' software factors are fitted by simulating whole benchmarks
(`experiments.calibrate`). Other GPU families have no public anchor in our reference set, so
they reuse the Hopper factors (documented as uncalibrated).

A user can fit their own factors to measured step times with `fit_step_times()`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.analytic import concurrency_limit, decode_itl_s, prefill_s, steady_tok_s
from models.cost import CostModel, Efficiency
from models.engines import DEFAULT_PROFILE, FIXED, HARDWARE, efficiency_for
from models.errors import ConfigError
from models.memory import plan_memory


@dataclass(frozen=True)
class Anchor:
    name: str
    metric: str  # "tok_s" (output tokens/s, whole setup) | "itl_s" | "ttft_s" | "draft_ratio"
    value: float
    model: str
    gpu: str
    num_gpus: int
    tp: int
    weights: str
    kv_cache: str
    isl: int
    osl: int
    concurrency: float | None  # None: limited by memory / max_num_seqs
    max_num_seqs: int
    source: str
    note: str = ""
    draft: str = ""  # for "draft_ratio": the draft model, run at the target's TP and formats
    engine: str = "trtllm"  # the engine profile: "trtllm" (tuned) or "trtllm-untuned" (default settings)


_TRT = "TensorRT-LLM docs"
ANCHORS: tuple[Anchor, ...] = (
    Anchor("mlperf41-h100x8-offline", "tok_s", 24525, "llama-2-70b", "h100-sxm", 8, 2, "fp8", "fp8",
           294, 294, None, 1024,
           "MLPerf Inference v4.1, NVIDIA closed, DGX-H100 llama2-70b-99.9, Offline",
           "FP8 weights and KV as in NVIDIA's submission; TP2 x 4 replicas; OpenOrca mean "
           "ISL/OSL taken as 294/294 (assumed, not in the reference notes)"),
    Anchor("mlperf41-h200x8-offline", "tok_s", 31303, "llama-2-70b", "h200", 8, 1, "fp8", "fp8",
           294, 294, None, 1024,
           "MLPerf Inference v4.1, NVIDIA closed, H200-SXM-141GBx8 llama2-70b-99.9, Offline",
           "FP8; 70B in FP8 fits one 141 GB H200 (TP1 x 8 replicas); same ISL/OSL assumption"),
    Anchor("trtllm-70b-bf16-tp4-b1-itl", "itl_s", 0.031, "llama-3.1-70b", "h100-sxm", 4, 4, "bf16", "bf16",
           2048, 2048, 1, 1, f"{_TRT}, performance-tuning guide (Llama-3.3-70B, TRT-LLM 0.16)",
           "batch 1; Llama-3.3-70B has Llama-3.1-70B's architecture", engine="trtllm-untuned"),
    Anchor("trtllm-70b-bf16-tp4-b1-ttft", "ttft_s", 0.148, "llama-3.1-70b", "h100-sxm", 4, 4, "bf16", "bf16",
           2048, 2048, 1, 1, f"{_TRT}, performance-tuning guide", "prefill of 2048 tokens, batch 1", engine="trtllm-untuned"),
    Anchor("trtllm-70b-bf16-tp4-1000req", "tok_s", 1564, "llama-3.1-70b", "h100-sxm", 4, 4, "bf16", "bf16",
           2048, 2048, 1564 * 0.0313, 1000, f"{_TRT}, fp8-quantization.md (BF16 row)",
           "1000 requests at once; concurrency 49 from Little's law (1564 tok/s x 31.3 ms ITL)", engine="trtllm-untuned"),
    Anchor("trtllm-70b-fp8-tp4-1000req", "tok_s", 6049, "llama-3.1-70b", "h100-sxm", 4, 4, "fp8", "fp8",
           2048, 2048, 6049 * 0.0108, 1000, f"{_TRT}, fp8-quantization.md (tuned FP8 row)",
           "concurrency 65 from Little's law (6049 tok/s x 10.8 ms ITL); tuned FP8 includes FP8 KV"),
    Anchor("trtllm-8b-fp8-h100-128-2048", "tok_s", 22714, "llama-3.1-8b", "h100-sxm", 1, 1, "fp8", "fp8",
           128, 2048, None, 2048, f"{_TRT}, perf-overview (v1.0 era), infinite rate",
           "FP8 KV assumed (perf-overview quantised checkpoints); max batch 2048 assumed"),
    Anchor("trtllm-70b-fp8-tp2-1000-1000", "tok_s", 4205, "llama-3.1-70b", "h100-sxm", 2, 2, "fp8", "fp8",
           1000, 1000, None, 2048, f"{_TRT}, perf-overview (v1.0 era)", "FP8 KV assumed"),
    Anchor("draft-ratio-70b", "draft_ratio", 0.125, "llama-3.1-70b", "h100-sxm", 4, 4, "bf16", "bf16",
           1024, 256, 1, 1, "vLLM 0.10.1 on H100 (SpecDecode-Bench, arXiv 2601.11580; shared/reference/README.md): draft forward / target forward, Llama-3-70B targets",
           "Llama-3.2-1B draft at the target's TP4, batch 1; a draft pass pays no engine-step overhead",
           draft="llama-3.2-1b", engine="vllm-v1"),
    Anchor("draft-ratio-8b", "draft_ratio", 0.375, "llama-3.1-8b", "h100-sxm", 1, 1, "bf16", "bf16",
           1024, 256, 1, 1, "vLLM 0.10.1 on H100 (SpecDecode-Bench, arXiv 2601.11580; shared/reference/README.md): draft forward / target forward, 8B targets",
           "Llama-3.2-1B draft, TP1, batch 1", draft="llama-3.2-1b", engine="vllm-v1"),
)

def predict(anchor: Anchor, eff: Efficiency) -> float:
    """The cost model's prediction of one anchor's published figure."""
    cost = CostModel(anchor.model, anchor.gpu, anchor.tp, anchor.weights, anchor.kv_cache, eff)
    if anchor.metric == "ttft_s":
        return prefill_s(cost, anchor.isl)
    if anchor.metric == "draft_ratio":
        d = CostModel(anchor.draft, anchor.gpu, anchor.tp, anchor.weights, anchor.kv_cache, eff)
        ctx = anchor.isl + anchor.osl // 2
        return d.uniform(1, ctx, 1, step_overhead=False).total_s / decode_itl_s(cost, 1, ctx)
    if anchor.metric == "itl_s":
        return decode_itl_s(cost, 1, anchor.isl + anchor.osl // 2)
    replicas = anchor.num_gpus // anchor.tp
    if anchor.concurrency is not None:
        b = anchor.concurrency
    else:
        plan = plan_memory(cost, max_num_seqs=anchor.max_num_seqs)
        b = concurrency_limit(plan, anchor.isl, anchor.osl, anchor.max_num_seqs)
    return replicas * steady_tok_s(cost, b, anchor.isl, anchor.osl)


# Hardware-side factors, shared by every engine profile (models.engines.HARDWARE):
SHARED = tuple(HARDWARE)
# Software-side factors fitted here, one set per step-level profile (the step anchors have no
# batch spread to separate a per-sequence cost from a per-step one; seq_overhead_s stays 0 there):
PER_ENGINE = ("step_overhead_s", "layer_overhead_s")
ENGINE_PROFILES = ("trtllm-untuned", "trtllm")
_LO = {"mfu_max": 0.15, "mfu_max_quant": 0.15, "bw_eff": 0.3, "allreduce_latency_s": 2e-6,
       "step_overhead_s": 0.0, "layer_overhead_s": 0.0, "seq_overhead_s": 0.0, "frontend_s": 0.0, "draft_pass_overhead_s": 0.0}
_HI = {"mfu_max": 0.95, "mfu_max_quant": 0.95, "bw_eff": 0.95, "allreduce_latency_s": 1e-4,
       "step_overhead_s": 0.02, "layer_overhead_s": 3e-4, "seq_overhead_s": 5e-4, "frontend_s": 1.0, "draft_pass_overhead_s": 0.01}
_SCALE = {"mfu_max": 0.1, "mfu_max_quant": 0.1, "bw_eff": 0.1, "allreduce_latency_s": 1e-5,
          "step_overhead_s": 1e-3, "layer_overhead_s": 1e-5, "seq_overhead_s": 1e-5}
_KEYS = SHARED + tuple(f"{f}@{e}" for e in ENGINE_PROFILES for f in PER_ENGINE)


def _profiles(x: np.ndarray, source: str) -> dict[str, Efficiency]:
    v = dict(zip(_KEYS, map(float, x), strict=True))
    shared = {f: v[f] for f in SHARED}
    return {e: Efficiency(**shared, **{f: v[f"{f}@{e}"] for f in PER_ENGINE}, **FIXED, seq_overhead_s=0.0,
                          frontend_s=0.0, draft_pass_overhead_s=0.0, source=source)
            for e in ENGINE_PROFILES}


def fit(anchors: tuple[Anchor, ...] = ANCHORS, start: dict[str, Efficiency] | None = None) -> dict[str, Efficiency]:
    """Least squares on log(predicted / published) over the anchors (scipy): shared hardware
    factors, and per-engine-profile overheads, from `start` (default: the committed factors).
    Returns {engine profile: Efficiency}."""
    from scipy.optimize import least_squares

    first = start or {e: _committed(e) for e in ENGINE_PROFILES}
    x0 = np.array([getattr(first[k.split("@")[1] if "@" in k else "trtllm"], k.split("@")[0]) for k in _KEYS])
    lo = np.array([_LO[k.split("@")[0]] for k in _KEYS])
    hi = np.array([_HI[k.split("@")[0]] for k in _KEYS])

    # the draft-cost ratios (owned by vllm-v1, whose per-draft-pass overhead is fitted to them by
    # experiments.engine_anchors) also pin the shared hardware factors here, priced with the
    # untuned profile's per-layer launch cost: a small draft's pass is launch-bound in both engines.
    # This keeps the hardware fit independent of the whole-system fits (no loop between the two).
    def resid(x: np.ndarray) -> np.ndarray:
        prof = _profiles(x, "")
        return np.array([np.log(predict(a, prof.get(a.engine, prof["trtllm-untuned"])) / a.value) for a in anchors])

    res = least_squares(resid, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=[_SCALE[k.split("@")[0]] for k in _KEYS])
    return _profiles(res.x, "fit to ANCHORS by models.calibration.fit()")


FIT_FIELDS = ("mfu_max", "mfu_max_quant", "bw_eff", "step_overhead_s", "layer_overhead_s", "seq_overhead_s")


def fit_step_times(
    cost: CostModel,
    batch: np.ndarray,
    context: np.ndarray,
    new_tokens: np.ndarray,
    measured_s: np.ndarray,
    fields: tuple[str, ...] = FIT_FIELDS,
) -> Efficiency:
    """Fit efficiency factors to a user's measured step times of uniform batches
    (columns: batch size, context tokens, new tokens per sequence, seconds)."""
    from scipy.optimize import least_squares

    start = cost.eff
    # only one of mfu_max / mfu_max_quant applies to these weights; the other does not influence
    # the data and must keep its value (left free, the optimiser pushes it to a bound)
    unused = "mfu_max_quant" if cost.weights.name == "bf16" else "mfu_max"
    fields = tuple(f for f in fields if f != unused)
    batch, context, new_tokens, measured_s = map(np.asarray, (batch, context, new_tokens, measured_s))

    def make(x: np.ndarray) -> Efficiency:
        values: dict[str, Any] = dict(zip(fields, map(float, x), strict=True))
        return dataclasses.replace(start, **values)

    def resid(x: np.ndarray) -> np.ndarray:
        cm = CostModel(cost.model, cost.gpu, cost.tp, cost.weights, cost.kv, make(x))
        pred = np.array([cm.uniform(int(b), int(c), int(n)).total_s
                         for b, c, n in zip(batch, context, new_tokens, strict=True)])
        return np.log(pred / measured_s)

    lo = np.array([_LO[f] for f in fields])
    hi = np.array([_HI[f] for f in fields])
    x = np.clip(np.array([getattr(start, f) for f in fields]), lo, hi)
    res = least_squares(resid, x, bounds=(lo, hi), x_scale=[_SCALE[f] for f in fields])
    return dataclasses.replace(make(res.x), source="fit to measured step times")


EFFICIENCY_FIELDS = tuple(f.name for f in dataclasses.fields(Efficiency) if f.name != "source")
# fractions of a peak (FLOPs, bandwidth): divisors in the cost model, so in (0, 1]
EFFICIENCY_FRACTIONS = ("mfu_max", "mfu_max_quant", "bw_eff", "comm_eff")


def check_efficiency(values: dict[str, Any], where: str = "") -> None:
    """Efficiency factors must be known, finite numbers: fractions of peak in (0, 1], the rest
    (token counts, seconds) >= 0. Raises a one-line ConfigError (prefixed with `where`)."""
    pre = f"{where}: " if where else ""
    if not isinstance(values, dict):
        raise ConfigError(f"{pre}expected a table of factors ({', '.join(EFFICIENCY_FIELDS)}), got {values!r}")
    for k, x in values.items():
        if k not in EFFICIENCY_FIELDS:
            raise ConfigError(f"{pre}unknown efficiency factor '{k}' (known: {', '.join(EFFICIENCY_FIELDS)})")
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ConfigError(f"{pre}efficiency factor {k} must be a finite number, got {x!r}")
        if k in EFFICIENCY_FRACTIONS and not 0 < x <= 1:
            raise ConfigError(f"{pre}efficiency factor {k} is a fraction of peak and must be in (0, 1], got {x!r}")
        if x < 0:
            raise ConfigError(f"{pre}efficiency factor {k} must be >= 0, got {x!r}")


def save_efficiency(eff: Efficiency, path: str | Path) -> Path:
    """Write an efficiency profile as JSON (scenarios load it with deployment.efficiency_file)."""
    p = Path(path)
    p.write_text(json.dumps(dataclasses.asdict(eff), indent=2))
    return p


def load_efficiency(path: str | Path, base: Efficiency | None = None) -> Efficiency:
    """Read an efficiency profile written by save_efficiency (missing factors from `base`)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"efficiency file not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8-sig"))  # (a byte-order mark is not JSON)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object of efficiency factors ({', '.join(EFFICIENCY_FIELDS)})")
    unknown_keys = set(data) - set(EFFICIENCY_FIELDS) - {"source"}
    if unknown_keys:
        raise ConfigError(f"{p}: unknown efficiency factor(s) {sorted(unknown_keys)} (known: {', '.join(EFFICIENCY_FIELDS)})")
    check_efficiency({k: v for k, v in data.items() if k != "source"}, str(p))
    start = base or efficiency_for("hopper", DEFAULT_PROFILE)
    values: dict[str, Any] = {k: (str(v) if k == "source" else float(v)) for k, v in data.items()}
    return dataclasses.replace(start, **values)


def table(profiles: dict[str, Efficiency] | None = None) -> list[dict[str, object]]:
    """Anchor, published figure, prediction and error: the table of docs/CALIBRATION.md."""
    profiles = {e: _committed(e) for e in {a.engine for a in ANCHORS}} | (profiles or {})
    rows = []
    for a in ANCHORS:
        p = predict(a, profiles[a.engine])
        rows.append(dict(anchor=a.name, engine=a.engine, metric=a.metric, published=a.value, predicted=p,
                         error_pct=100.0 * (p / a.value - 1.0), setup=a.note, source=a.source))
    return rows


def _committed(profile: str) -> Efficiency:
    """The committed (models.engines) Hopper factors of a step-level profile."""
    return efficiency_for("hopper", profile)


def _main() -> None:
    prof = fit()
    for e, eff in prof.items():
        print(f"{e}:", {f: float(f"{getattr(eff, f):.4g}") for f in SHARED + PER_ENGINE})
    print("| anchor | engine | metric | published | predicted | error |")
    print("|---|---|---|---|---|---|")
    for r in table(prof):
        print(f"| {r['anchor']} | {r['engine']} | {r['metric']} | {r['published']:.4g} | {r['predicted']:.4g} | {r['error_pct']:+.1f}% |")
    sys.stdout.flush()


if __name__ == "__main__":
    _main()
