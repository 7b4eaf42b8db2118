"""The bundled MoE-vs-dense sweep (experiments/sweeps/moe-vs-dense.toml) in quick mode: its
report's pairs section states what the simulation shows, and that agrees with the step physics
(tests/test_moe.py): speculation costs the MoE target at batch 1 and pays on it at a large
batch, where the dense target's speedup has faded."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.pairs import fading_point, pair_lines, pair_speedups
from experiments.report import write_report
from experiments.sweep import load_sweep, run_sweep
from models.errors import ConfigError

SWEEP = Path(__file__).resolve().parents[1] / "experiments" / "sweeps" / "moe-vs-dense.toml"
PAIRS = [("moe+draft", "moe"), ("dense+draft", "dense")]


def test_moe_vs_dense_quick(tmp_path: Path) -> None:
    spec = load_sweep(SWEEP, quick=True)
    assert spec.pairs == tuple(PAIRS) and spec.concurrency == (1, 16, 96)
    df, caps = run_sweep(spec, tmp_path / "out", executor="serial", progress=False)
    assert not df.error.astype(bool).any()
    sp = pair_speedups(df, spec.pairs, "concurrency")
    s = sp[sp.metric == "tpot_s_mean"].set_index(["variant", "concurrency"])["mean"]
    assert s["moe+draft", 1] < 1.0 < s["dense+draft", 1]  # batch 1: the verified tokens touch 4-5x the experts
    assert s["moe+draft", 96] > 1.0 > s["dense+draft", 96]  # large batch: every expert read anyway
    assert fading_point(df, "dense+draft", "dense", "concurrency") == 96
    lines = pair_lines(df, spec.pairs, "concurrency")
    assert lines[0].startswith("moe+draft over moe") and "best" in lines[0]
    assert "the peaks differ" in lines[-1]
    page = write_report(df, pair_speedups(df, spec.pairs, "concurrency"), tmp_path / "out", spec=spec,
                        capacities=caps).read_text()
    assert "Speculation within each model" in page and 'id="pairs"' in page


@pytest.mark.parametrize(("pairs", "msg"), [
    ('[["moe+draft", "nope"]]', "'nope' is not a variant"),
    ('[["moe", "moe"]]', "two different variant names"),
    ('"moe"', "must be a list"),
])
def test_bad_pairs_are_one_line_errors(tmp_path: Path, pairs: str, msg: str) -> None:
    text = SWEEP.read_text().replace('pairs = [["moe+draft", "moe"], ["dense+draft", "dense"]]', f"pairs = {pairs}")
    text = text.replace('base = "../scenarios/qwen3-moe-h200.toml"',
                        f'base = "{(SWEEP.parent.parent / "scenarios" / "qwen3-moe-h200.toml").as_posix()}"')
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg) as e:
        load_sweep(p)
    assert "\n" not in str(e.value)
