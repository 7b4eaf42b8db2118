"""Trace loaders: the three original formats, auto-detection, one-line errors with line numbers, rate scaling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from models.errors import ConfigError
from sim.traces import detect_format, empirical_lengths, load_trace, scale_to_rate, trace_rate_rps

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
AZURE_CONV = TRACES / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = TRACES / "azure2023" / "AzureLLMInferenceTrace_code.csv"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"

AZURE_TEXT = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:47.1805900,396,109\n"
    "2023-11-16 18:15:49,879,7\n"
)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _mooncake(path: Path, rows: list[dict]) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _check_shape(df: pd.DataFrame) -> None:
    assert list(df.columns[:3]) == ["arrival_s", "prompt_tokens", "output_tokens"]
    assert df["arrival_s"].dtype == np.float64
    assert df["prompt_tokens"].dtype == np.int64
    assert df["output_tokens"].dtype == np.int64
    assert df["arrival_s"].iloc[0] == 0.0
    assert df["arrival_s"].is_monotonic_increasing


def _error(path: Path, fmt: str = "auto") -> str:
    with pytest.raises(ConfigError) as info:
        load_trace(path, fmt)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_azure_loads_exactly(tmp_path: Path) -> None:
    df = load_trace(_write(tmp_path / "az.csv", AZURE_TEXT), "azure")
    _check_shape(df)
    assert df["arrival_s"].tolist() == [0.0, 0.5, pytest.approx(2.31941)]
    assert df["prompt_tokens"].tolist() == [374, 396, 879]
    assert df["output_tokens"].tolist() == [44, 109, 7]


def test_mooncake_loads_ms_as_seconds(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 3000, "input_length": 10, "output_length": 2, "hash_ids": [0, 5]},
        {"timestamp": 1000, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 7, "output_length": 3, "hash_ids": []},
    ]
    df = load_trace(_mooncake(tmp_path / "mc.jsonl", rows), "mooncake")
    _check_shape(df)
    assert df["arrival_s"].tolist() == [0.0, 0.0, 2.0]
    assert df["prompt_tokens"].tolist() == [6758, 7, 10]  # stable sort keeps file order on ties
    assert df["output_tokens"].tolist() == [500, 3, 2]
    assert df["hash_ids"].tolist() == ["0 1 2", "", "0 5"]


def test_plain_csv_loads_and_ignores_extra_columns(tmp_path: Path) -> None:
    text = "arrival_s,prompt_tokens,output_tokens,note\n10.25,5,6,x\n10.0,1,1,y\n\n12.0,3,4,z\n"
    df = load_trace(_write(tmp_path / "t.csv", text), "csv")
    _check_shape(df)
    assert df["arrival_s"].tolist() == [0.0, 0.25, 2.0]
    assert df["prompt_tokens"].tolist() == [1, 5, 3]
    assert df["output_tokens"].tolist() == [1, 6, 4]


def test_auto_detection(tmp_path: Path) -> None:
    az = _write(tmp_path / "a.csv", AZURE_TEXT)
    mc = _mooncake(tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 1, "output_length": 1}])
    pl = _write(tmp_path / "p.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,1\n")
    assert [detect_format(p) for p in (az, mc, pl)] == ["azure", "mooncake", "csv"]
    assert len(load_trace(az)) == 3 and len(load_trace(mc)) == 1 and len(load_trace(pl)) == 1
    msg = _error(_write(tmp_path / "odd.txt", "time,in,out\n0,1,1\n"))
    assert "odd.txt" in msg and "azure" in msg and "mooncake" in msg and "csv" in msg


@pytest.mark.parametrize(
    ("text", "line", "snippet"),
    [
        ("arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,-3,5\n", 3, "prompt_tokens=-3"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,5,5\n\n2,5,0\n", 5, "output_tokens=0"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,5\nsoon,5,5\n", 3, "arrival_s=soon"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,2.5\n", 2, "output_tokens=2.5"),
        (AZURE_TEXT + "2023-11-16 25:99:00.1,1,1\n", 5, "TIMESTAMP=2023-11-16 25:99:00.1"),
        (AZURE_TEXT.replace(",879,", ",abc,"), 4, "ContextTokens=abc"),
    ],
)
def test_bad_csv_rows_name_file_and_line(tmp_path: Path, text: str, line: int, snippet: str) -> None:
    msg = _error(_write(tmp_path / "trace.csv", text))
    assert "trace.csv" in msg and f"line {line}:" in msg and snippet in msg


def test_bad_mooncake_rows_name_file_and_line(tmp_path: Path) -> None:
    good = {"timestamp": 0, "input_length": 5, "output_length": 5}
    path = _mooncake(tmp_path / "m.jsonl", [good, good, {**good, "input_length": -3}])
    msg = _error(path)
    assert "m.jsonl line 3:" in msg and "input_length=-3" in msg
    path = _mooncake(tmp_path / "n.jsonl", [good, {**good, "timestamp": "noon"}])
    assert "n.jsonl line 2:" in _error(path)
    path = _write(tmp_path / "o.jsonl", json.dumps(good) + "\n{broken\n")
    assert "o.jsonl line 2:" in _error(path, "mooncake")
    path = _mooncake(tmp_path / "q.jsonl", [good, {"timestamp": 1, "input_length": 5}])
    msg = _error(path)
    assert "q.jsonl line 2:" in msg and "output_length" in msg


def test_missing_file_column_and_empty(tmp_path: Path) -> None:
    msg = _error(tmp_path / "nope.csv")
    assert "not found" in msg and "nope.csv" in msg
    msg = _error(_write(tmp_path / "c.csv", "arrival_s,prompt_tokens\n0,5\n"))
    assert "'output_tokens'" in msg and "arrival_s,prompt_tokens,output_tokens" in msg
    msg = _error(_write(tmp_path / "z.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,5\n"))
    assert "'GeneratedTokens'" in msg
    assert "empty" in _error(_write(tmp_path / "e.csv", ""))
    assert "no requests" in _error(_write(tmp_path / "h.csv", "arrival_s,prompt_tokens,output_tokens\n"))
    assert "e.jsonl" in _error(_write(tmp_path / "e.jsonl", "\n\n"), "mooncake")
    assert "format" in _error(_write(tmp_path / "f.csv", "arrival_s\n"), "parquet")


def test_scale_to_rate(tmp_path: Path) -> None:
    df = load_trace(_write(tmp_path / "t.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,2\n1,3,4\n1,5,6\n4,7,8\n"))
    assert trace_rate_rps(df) == pytest.approx(0.75)
    fast = scale_to_rate(df, 3.0)
    assert trace_rate_rps(fast) == pytest.approx(3.0)
    assert fast["arrival_s"].tolist() == pytest.approx([0.0, 0.25, 0.25, 1.0])
    assert fast[["prompt_tokens", "output_tokens"]].equals(df[["prompt_tokens", "output_tokens"]])
    assert df["arrival_s"].tolist() == [0.0, 1.0, 1.0, 4.0]  # input untouched
    for rate in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            scale_to_rate(df, rate)
    with pytest.raises(ConfigError):
        scale_to_rate(df.iloc[:1], 1.0)
    with pytest.raises(ConfigError):
        trace_rate_rps(df.iloc[1:3])


def test_empirical_lengths(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.csv", AZURE_TEXT)
    assert empirical_lengths(path, "output_tokens").tolist() == [44, 109, 7]
    assert empirical_lengths(path, "prompt_tokens").dtype == np.int64
    with pytest.raises(ConfigError):
        empirical_lengths(path, "arrival_s")


def _real(path: Path) -> pd.DataFrame:
    if not path.is_file():
        pytest.skip(f"real trace not present: {path}")
    df = load_trace(path)
    _check_shape(df)
    assert (df["prompt_tokens"] >= 1).all() and (df["output_tokens"] >= 1).all()
    return df


def test_real_azure_conv() -> None:
    df = _real(AZURE_CONV)
    assert len(df) == 19366
    p = np.percentile(df["prompt_tokens"], [50, 90])
    o = np.percentile(df["output_tokens"], [50, 90])
    assert p == pytest.approx([1020, 2735], rel=0.03)
    assert o == pytest.approx([129, 424], rel=0.03)
    assert df["arrival_s"].iloc[-1] == pytest.approx(3501.72, abs=0.01)


def test_real_azure_code() -> None:
    df = _real(AZURE_CODE)
    assert len(df) == 8819
    assert np.median(df["prompt_tokens"]) == pytest.approx(1469, rel=0.03)


def test_real_mooncake() -> None:
    df = _real(MOONCAKE)
    assert len(df) == 12031
    assert df["arrival_s"].iloc[-1] == pytest.approx(3537.0)
    assert df["hash_ids"].str.len().gt(0).all()
