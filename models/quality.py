"""Quality and retraining: what distillation and quantization charge, as documented defaults.

Quality is the expected share of requests that pass a task rubric, relative to the full-precision
teacher (1.0 = the teacher's pass rate). Speculative decoding is lossless: 1.0 everywhere.
Defaults come from shared/reference/README.md and are meant to be overridden per deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

# Quantization: average accuracy recovery on Llama-3.1 (Kurtic et al., arXiv 2411.02355):
# W8A8 99.75%, W4A16 99.36% of BF16. The tail (reasoning, code, long context) loses more; we take
# 3x the average loss there, a documented assumption to override with your own evaluation.
QUANT_RECOVERY = {"bf16": 1.0, "fp8": 0.9975, "int8": 0.9975, "int4": 0.9936}
TAIL_LOSS_MULTIPLIER = 3.0

# Distillation: Llama-3.2 model card, instruct models vs Llama-3.1-8B instruct.
# In-distribution ~ MMLU ratio, tail ~ MGSM/GSM8K ratio (multi-step reasoning, other languages).
# 3B: MMLU 63.4/69.4 = 0.914, MGSM 58.2/68.9 = 0.845; 1B: 49.3/69.4 = 0.710, 24.5/68.9 = 0.356.
# For an 8B student of a 70B teacher we use the same parameter ratio logic: Llama-3.1 8B vs 70B
# instruct MMLU 69.4/83.6 = 0.83, MGSM 68.9/86.9 = 0.79 (Llama 3.1 model card).
DISTILL_QUALITY: dict[tuple[str, str], tuple[float, float]] = {
    ("llama-3.1-8b", "llama-3.1-70b"): (0.83, 0.79),
    ("llama-3.2-3b", "llama-3.1-8b"): (0.914, 0.845),
    ("llama-3.2-1b", "llama-3.1-8b"): (0.710, 0.356),
    ("llama-3.2-3b", "llama-3.1-70b"): (0.76, 0.67),
    ("llama-3.2-1b", "llama-3.1-70b"): (0.59, 0.28),
}
# GPU-hours of one re-distillation run after a teacher update. Llama-3.2 1B/3B cost 370k/460k
# H100-hours of pretraining plus distillation, with 86k of teacher logit generation (model card):
# that is a from-scratch build, an upper bound. A re-distillation of an existing student is
# priced from FLOPs instead: teacher forward passes (2 x P_teacher per token) to make logits and
# student training (6 x P_student per token) over REDISTILL_TOKENS tokens, at REDISTILL_MFU of an
# H100's dense BF16 peak. 10B tokens is our documented default (a task-focused distillation set,
# about 1/1000 of Llama-3.2's pretraining corpus); override per deployment.
REDISTILL_TOKENS = 10e9
REDISTILL_MFU = 0.40
H100_BF16_FLOPS = 989.4e12


def quant_quality(weights: str, kv_cache: str = "bf16") -> tuple[float, float]:
    """(in-distribution, tail) quality of a quantized model relative to bf16."""
    r = QUANT_RECOVERY.get(weights, 1.0)
    if kv_cache == "fp8":
        r *= 0.999  # FP8 KV: small extra loss (long-context retrieval); assumption
    tail = 1.0 - TAIL_LOSS_MULTIPLIER * (1.0 - r)
    return r, tail


def distill_quality(student: str, teacher: str) -> tuple[float, float]:
    """(in-distribution, tail) quality of a distilled student relative to its teacher."""
    return DISTILL_QUALITY.get((student, teacher), (0.85, 0.70))


def default_retrain_gpu_hours(student_params: float, teacher_params: float, tokens: float = REDISTILL_TOKENS,
                              peak_flops: float = H100_BF16_FLOPS) -> float:
    """GPU-hours of one re-distillation run, from FLOPs (see REDISTILL_TOKENS), on a training GPU of
    dense BF16 peak `peak_flops` (default an H100). Assumption: training reaches the same
    REDISTILL_MFU on every GPU, so the hours scale with the ratio of dense BF16 peaks."""
    flops = (2.0 * teacher_params + 6.0 * student_params) * tokens
    return flops / (peak_flops * REDISTILL_MFU) / 3600.0


@dataclass(frozen=True)
class Retraining:
    """The recurring obligation of a distilled model."""

    teacher_updates_per_month: float
    gpu_hours_per_run: float
    usd_per_gpu_hour: float
    stale_days: float  # days from a teacher update until the new student ships
    stale_quality_loss: float  # extra relative quality lost while stale
    training_gpu: str = "h100-sxm"  # the GPU the runs train on; usd_per_gpu_hour is its price

    @property
    def usd_per_month(self) -> float:
        return self.teacher_updates_per_month * self.gpu_hours_per_run * self.usd_per_gpu_hour

    @property
    def stale_fraction(self) -> float:
        """Share of the month the student lags its teacher."""
        return min(1.0, self.teacher_updates_per_month * self.stale_days / 30.0)

    def effective_quality(self, q: float) -> float:
        return q * (1.0 - self.stale_fraction * self.stale_quality_loss)
