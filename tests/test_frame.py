"""The engine's tables as numpy columns (`sim.frame.Frame`): the files they write are the files
pandas writes (CSV byte for byte, Parquet value for value, NaN as null), rows and columns behave
as a DataFrame's, and a bad column is refused with its name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from sim.frame import Frame, as_frame, as_pandas, column, object_column


def _table() -> Frame:
    rng = np.random.default_rng(3)
    x = rng.normal(size=7) * 10.0 ** rng.integers(-8, 9, 7)
    x[[1, 4]] = np.nan
    return Frame({"id": np.arange(7, dtype=np.int64), "x": x, "big": np.array([1e16, 1e-5, 0.1, 2.0, -0.0, 3e300, 5.5]),
                  "ok": np.array([True, False, True, True, False, False, True]), "n": rng.integers(0, 10**12, 7)})


def test_files_are_what_pandas_writes(tmp_path: Path) -> None:
    t = _table()
    df = t.to_pandas()
    t.write_csv(tmp_path / "a.csv")
    df.to_csv(tmp_path / "b.csv", index=False)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    t.write_parquet(tmp_path / "a.parquet")
    df.to_parquet(tmp_path / "b.parquet", index=False)
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert a.schema.remove_metadata().equals(b.schema.remove_metadata())
    assert a.equals(b)  # NaN as null, as pandas writes it
    assert a.column("x").null_count == 2
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a.parquet"), df)


def test_rows_and_columns() -> None:
    t = _table()
    assert len(t) == 7 and t.columns == ["id", "x", "big", "ok", "n"] and "x" in t and "y" not in t
    picked = t.rows(t["ok"])
    assert picked["id"].tolist() == [0, 2, 3, 6]
    assert t.rows(np.array([6, 0]))["id"].tolist() == [6, 0]
    assert t.rows(slice(2, 4))["id"].tolist() == [2, 3]
    wider = t.with_columns(y=np.ones(7))
    assert "y" in wider and "y" not in t and wider["x"] is t["x"]
    t.attrs["runs_out"] = True
    assert t.rows(slice(None)).attrs == {"runs_out": True} and t.to_pandas().attrs == {"runs_out": True}
    back = Frame.from_pandas(t.to_pandas())
    assert back.columns == t.columns and all(np.array_equal(back[c], t[c], equal_nan=True) for c in t)
    assert as_frame(t) is t and isinstance(as_frame(t.to_pandas()), Frame)
    assert isinstance(as_pandas(t), pd.DataFrame)
    for table in (t, t.to_pandas()):  # the readers take either
        assert column(table, "n", np.float64).dtype == np.float64


def test_a_bad_column_is_refused_with_its_name() -> None:
    t = _table()
    with pytest.raises(ValueError, match="column 'z': 3 values for a table of 7 rows"):
        t["z"] = np.zeros(3)
    with pytest.raises(ValueError, match="column 'z': one value per row"):
        t["z"] = np.zeros((7, 2))
    with pytest.raises(KeyError, match="no column 'nope'"):
        t["nope"]


def test_a_column_of_arrays_stays_one_object_per_row() -> None:
    units = [np.arange(3), np.arange(3), np.arange(3)]  # (equal lengths: numpy would make a 3x3 array)
    col = object_column(units)
    assert col.shape == (3,) and col.dtype == object and col[1] is units[1]
    assert len(Frame({"unit_keys": col})) == 3


def test_a_users_dataframe_is_its_own(tmp_path: Path) -> None:
    # a table read from pandas holds read-only views (pandas 3): the DataFrame a user gets back is writable,
    # and editing it leaves the run's table (and the files `Result.write` writes) as they were
    t = Frame.from_pandas(_table().to_pandas())
    assert not t["x"].flags.writeable
    df = t.to_pandas()
    df.loc[0, "x"] = 123.0
    assert t["x"][0] != 123.0 and df.loc[0, "x"] == 123.0


def test_other_dtypes_are_written_as_pandas_writes_them(tmp_path: Path) -> None:
    t = Frame({"f32": np.array([0.1, np.nan, 2.5], dtype=np.float32), "name": np.array(["a", None, "c"], dtype=object),
               "w": np.array([1.5, np.nan, 3.0], dtype=object)})
    df = t.to_pandas()
    t.write_csv(tmp_path / "a.csv")
    df.to_csv(tmp_path / "b.csv", index=False)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    t.write_parquet(tmp_path / "a.parquet")
    assert pq.read_table(tmp_path / "a.parquet").column("w").null_count == 1  # NaN as null in an object column too
