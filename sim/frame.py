"""The engine's tables as named numpy columns of one length (`Frame`): the request table a
workload generates, and the request and step tables a run returns. A run's path never imports
pandas (about 0.3 s of a process on 2 cores); a user gets DataFrames from `Frame.to_pandas`
(`sim.simulate.Result.requests`, `.steps`, `.intervals`).

The functions that read these tables (`sim.metrics`, `sim.attribution`, `sim.summary`) read a
column as `column(t, name)`, so that they take a Frame or a DataFrame alike.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


class Frame:
    """Named 1-D numpy columns of one length, in order. `attrs`: facts about the table as a
    whole (as a DataFrame's `attrs`: the workload's `runs_out`)."""

    __slots__ = ("_cols", "_n", "attrs")

    def __init__(self, cols: Mapping[str, Any], attrs: dict[str, Any] | None = None) -> None:
        self._cols: dict[str, np.ndarray] = {}
        self._n = -1
        for name, values in cols.items():
            self[name] = values
        if self._n < 0:
            self._n = 0
        self.attrs: dict[str, Any] = dict(attrs or {})

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._cols[name]
        except KeyError:
            raise KeyError(f"no column {name!r} (columns: {', '.join(self._cols)})") from None

    def __setitem__(self, name: str, values: Any) -> None:
        a = values if isinstance(values, np.ndarray) else _array(values)
        if a.ndim != 1:
            raise ValueError(f"column {name!r}: one value per row, got an array of shape {a.shape}")
        if self._n >= 0 and a.size != self._n:
            raise ValueError(f"column {name!r}: {a.size} values for a table of {self._n} rows")
        self._n = a.size
        self._cols[name] = a

    def __contains__(self, name: object) -> bool:
        return name in self._cols

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols)

    def __repr__(self) -> str:
        return f"Frame({self._n} rows: {', '.join(self._cols)})"

    @property
    def columns(self) -> list[str]:
        return list(self._cols)

    def rows(self, which: np.ndarray | slice) -> Frame:
        """The rows a boolean mask, an index array or a slice picks, in that order (copies, but a
        slice's views)."""
        return Frame({c: a[which] for c, a in self._cols.items()}, self.attrs)

    def with_columns(self, **cols: Any) -> Frame:
        """A new Frame with these columns added or replaced (the arrays shared, not copied)."""
        return Frame({**self._cols, **cols}, self.attrs)

    def to_pandas(self) -> pd.DataFrame:
        """The table as a DataFrame of its own (the columns copied: edit it freely; pandas imported
        now: heavy, so only when asked for)."""
        import pandas as pd  # (heavy: only a user's DataFrame needs it)

        df = pd.DataFrame(self._cols, copy=True) if self._cols else pd.DataFrame(index=range(self._n))
        df.attrs.update(self.attrs)
        return df

    @classmethod
    def from_pandas(cls, df: pd.DataFrame) -> Frame:
        """A DataFrame's columns as arrays (its index dropped)."""
        return cls({str(c): df[c].to_numpy() for c in df.columns}, dict(df.attrs))

    def write_parquet(self, path: str | Path) -> None:
        """Parquet, plain encoding: dictionary encoding (the default) takes twice the time for
        about as big a file (float columns of distinct values; docs/PERFORMANCE.md, "What a run
        costs"). NaN is written as null, as pandas' `to_parquet` writes it."""
        import pyarrow as pa  # (heavy: only a written table needs it)
        import pyarrow.parquet as pq

        table = pa.Table.from_arrays([_arrow(a) for a in self._cols.values()], names=list(self._cols))
        pq.write_table(table, str(path), use_dictionary=False)

    def write_csv(self, path: str | Path) -> None:
        """CSV as pandas' `to_csv(index=False)` writes it: a header, each float at its shortest
        exact form, NaN as an empty field."""
        cells = [[_cell(x) for x in (a.tolist() if a.dtype != np.float32 else list(a))]  # (float32 scalars: "0.1")
                 for a in self._cols.values()]
        with open(path, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(self._cols)
            w.writerows(zip(*cells, strict=True))


def column(table: Frame | pd.DataFrame, name: str, dtype: Any = None) -> np.ndarray:
    """One column of a Frame or a DataFrame as a numpy array (no copy when it has that dtype)."""
    return np.asarray(table[name], dtype=dtype)


def object_column(values: list[Any]) -> np.ndarray:
    """A column of one object per row (an array of prefix-cache units per request), never
    broadcast into a 2-D array."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _array(values: Any) -> np.ndarray:
    if hasattr(values, "to_numpy"):  # (a pandas Series or Index)
        return np.asarray(values.to_numpy())
    return np.asarray(values)


def _arrow(a: np.ndarray) -> Any:
    """A column as an Arrow array, numbers and booleans from their buffers (`pa.array` on a numpy
    array imports pandas, to check whether it is a pandas object: a third of a run's time)."""
    import pyarrow as pa

    if a.dtype.kind in "iuf":
        a = np.ascontiguousarray(a)
        valid = None
        nulls = 0
        if a.dtype.kind == "f":
            missing = np.isnan(a)
            nulls = int(missing.sum())
            if nulls:
                valid = pa.py_buffer(np.packbits(~missing, bitorder="little"))
        return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [valid, pa.py_buffer(a)], null_count=nulls)
    if a.dtype.kind == "b":
        return pa.Array.from_buffers(pa.bool_(), a.size, [None, pa.py_buffer(np.packbits(a, bitorder="little"))])
    return pa.array(a.tolist(), from_pandas=True)  # (NaN as null, as pandas writes it)


def _cell(x: Any) -> Any:
    if isinstance(x, float | np.floating):
        return "" if math.isnan(x) else str(x)
    return x


def as_pandas(table: Frame | pd.DataFrame) -> pd.DataFrame:
    """A DataFrame as it is, a Frame as a DataFrame."""
    return table.to_pandas() if isinstance(table, Frame) else table


def as_frame(table: Frame | pd.DataFrame) -> Frame:
    """A Frame as it is, a DataFrame's columns as a Frame."""
    return table if isinstance(table, Frame) else Frame.from_pandas(table)


if TYPE_CHECKING:
    Table = Frame | pd.DataFrame  # what the readers of the tables take
