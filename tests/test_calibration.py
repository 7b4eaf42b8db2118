"""Calibration: anchors, the committed efficiency profiles, and fitting to measured step times."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import models.calibration as cal
from models.cost import CostModel, Efficiency
from models.engines import efficiency_for

COMMITTED = {e: efficiency_for("hopper", e) for e in cal.ENGINE_PROFILES}


def test_every_anchor_within_25_percent() -> None:
    rows = cal.table()
    assert len(rows) == len(cal.ANCHORS)
    for r in rows:
        assert r["predicted"] == pytest.approx(r["published"] * (1 + r["error_pct"] / 100), rel=1e-9)
        assert abs(r["error_pct"]) <= 25.0, r


def _spread(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] / b[k] - 1.0) for k in a)


def _predictions(profiles: dict[str, Efficiency]) -> dict[str, float]:
    """Predictions of the anchors this step-level fit owns (the vLLM draft ratios are fitted with
    the vllm-v1 profile by experiments.calibrate)."""
    return {a.name: cal.predict(a, profiles[a.engine]) for a in cal.ANCHORS if a.engine in profiles}


def test_committed_profiles_are_current() -> None:
    """Re-fitting reproduces the committed profiles' predictions. The constants are printed to 4
    significant digits (~1e-4 relative); 2% leaves room for another scipy's stopping point but
    not for a stale fit after an anchor, a catalogue entry or the cost model changed."""
    refit = cal.fit()
    assert _spread(_predictions(refit), _predictions(COMMITTED)) < 0.02


def test_fit_converges_from_a_perturbed_start() -> None:
    """fit() starts from the committed factors; starting elsewhere must reach the same
    predictions, or the check above only shows that the optimiser stops where it starts."""
    moved = {k: dataclasses.replace(v, mfu_max=0.8 * v.mfu_max, mfu_max_quant=min(0.95, 1.25 * v.mfu_max_quant),
                                    bw_eff=0.75 * v.bw_eff, step_overhead_s=v.step_overhead_s + 5e-4,
                                    layer_overhead_s=1.25 * v.layer_overhead_s + 2e-5)
             for k, v in COMMITTED.items()}
    assert _spread(_predictions(cal.fit(start=moved)), _predictions(COMMITTED)) < 0.02


def test_engine_profiles_share_hardware_factors() -> None:
    b, t = COMMITTED["trtllm-untuned"], COMMITTED["trtllm"]
    for f in cal.SHARED:
        assert getattr(b, f) == getattr(t, f), f
    for e in COMMITTED.values():
        for f in cal.SHARED + cal.PER_ENGINE:
            assert cal._LO[f] <= getattr(e, f) <= cal._HI[f], f


# ---------------------------------------------------------------- fit_step_times

LAYERS = 80  # Llama-3.1-70B


def _overhead(e: Efficiency) -> float:
    """Per-step overhead of one forward pass: the step and per-layer parts are both constant per
    step, so only their sum is identifiable from step times."""
    return e.step_overhead_s + LAYERS * e.layer_overhead_s


def _synthetic(truth: Efficiency, weights: str, seed: int, sigma: float, n: int = 40):
    rng = np.random.default_rng(seed)
    batch = np.round(np.exp(rng.uniform(0.0, np.log(256), n))).astype(int)
    context = np.round(np.exp(rng.uniform(np.log(128), np.log(8192), n))).astype(int)
    new = np.round(np.exp(rng.uniform(0.0, np.log(512), n))).astype(int)
    gen = CostModel("llama-3.1-70b", "h100-sxm", 4, weights, "bf16", truth)
    t = np.array([gen.uniform(int(b), int(c), int(k)).total_s for b, c, k in zip(batch, context, new, strict=True)])
    return batch, context, new, t * np.exp(rng.normal(0.0, sigma, n))


START = COMMITTED["trtllm-untuned"]
TRUTH = dataclasses.replace(START, mfu_max=0.5, mfu_max_quant=0.4, bw_eff=0.8,
                            step_overhead_s=3e-3, layer_overhead_s=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_step_times_recovers_bf16_factors(seed: int) -> None:
    """40 points, 3% lognormal noise. Each identifiable factor's standard error is about
    3% / sqrt(points that depend on it) ~ 1-2%; a 10% (15% for the overhead sum, pinned only by the
    few small steps) tolerance is several standard errors yet catches a fit that stays at START
    (mfu_max 0.63 vs 0.5, bw_eff 0.93 vs 0.8, overhead 17 ms vs 11 ms)."""
    start_cost = CostModel("llama-3.1-70b", "h100-sxm", 4, "bf16", "bf16", START)
    fitted = cal.fit_step_times(start_cost, *_synthetic(TRUTH, "bf16", seed, 0.03))
    assert fitted.mfu_max == pytest.approx(TRUTH.mfu_max, rel=0.10)
    assert fitted.bw_eff == pytest.approx(TRUTH.bw_eff, rel=0.10)
    assert _overhead(fitted) == pytest.approx(_overhead(TRUTH), rel=0.15)
    # bf16 data say nothing about the quantised peak: it must keep its start value
    assert fitted.mfu_max_quant == START.mfu_max_quant
    assert fitted.source == "fit to measured step times"


def test_fit_step_times_recovers_fp8_factors() -> None:
    start_cost = CostModel("llama-3.1-70b", "h100-sxm", 4, "fp8", "bf16", START)
    fitted = cal.fit_step_times(start_cost, *_synthetic(TRUTH, "fp8", 7, 0.03))
    assert fitted.mfu_max_quant == pytest.approx(TRUTH.mfu_max_quant, rel=0.10)
    assert fitted.bw_eff == pytest.approx(TRUTH.bw_eff, rel=0.10)
    assert _overhead(fitted) == pytest.approx(_overhead(TRUTH), rel=0.15)
    assert fitted.mfu_max == START.mfu_max


def test_fit_step_times_exact_without_noise() -> None:
    """Noise-free data generated by the model itself: the identifiable factors come back to well
    under 1% (least squares stops at its default tolerances, not at zero)."""
    start_cost = CostModel("llama-3.1-70b", "h100-sxm", 4, "bf16", "bf16", START)
    fitted = cal.fit_step_times(start_cost, *_synthetic(TRUTH, "bf16", 3, 0.0))
    assert fitted.mfu_max == pytest.approx(TRUTH.mfu_max, rel=0.01)
    assert fitted.bw_eff == pytest.approx(TRUTH.bw_eff, rel=0.01)
    assert _overhead(fitted) == pytest.approx(_overhead(TRUTH), rel=0.01)
