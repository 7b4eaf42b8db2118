"""Loaders for real LLM inference traces in their original formats (Azure 2023 CSV, Mooncake JSONL, plain CSV).

Every loader returns one DataFrame shape -- ``arrival_s`` (float64 s, first request at 0, sorted),
``prompt_tokens`` and ``output_tokens`` (int64, both >= 1) -- so the simulator never sees a format.
Bad input raises ConfigError with one line naming the file, the line, the field and the fix.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from models.errors import ConfigError

if TYPE_CHECKING:
    import pandas as pd

FORMATS = ("azure", "mooncake", "csv")
_HEADERS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "csv": ("arrival_s", "prompt_tokens", "output_tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
}
_ACCEPTED = (
    "accepted formats: azure (CSV header TIMESTAMP,ContextTokens,GeneratedTokens), "
    "mooncake (JSONL objects with timestamp [ms], input_length, output_length), "
    "csv (header arrival_s,prompt_tokens,output_tokens)"
)
_AZURE_TS = r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?"


def _show(value: object) -> str:
    """A bad value as it should appear in a one-line message."""
    text = str(value).replace("\n", " ").replace("\r", " ")
    return "''" if text == "" else (text if len(text) <= 40 else text[:37] + "...")


def _raise_first(name: str, bad: list[tuple[int, str]]) -> None:
    """Raise the problem on the earliest line, if there is one."""
    if bad:
        line, msg = min(bad)
        raise ConfigError(f"{name} line {line}: {msg}")


def _tokens(values: pd.Series, lines: np.ndarray, field: str, bad: list[tuple[int, str]]) -> np.ndarray:
    """Validate token counts given as text: integers >= 1 (an empty prompt or output is not a request)."""
    import pandas as pd  # (heavy: only a trace needs it)

    text = values.astype(str).str.strip()
    digits = text.str.fullmatch(r"\+?\d{1,18}")
    nums = pd.to_numeric(text.where(digits, "0")).to_numpy(np.int64)
    ok = digits.to_numpy(bool) & (nums >= 1)
    if not ok.all():
        i = int(np.argmin(ok))
        bad.append((int(lines[i]), f"{field}={_show(values.iloc[i])} must be an integer >= 1 "
                                   "(prompt and output token counts must both be at least 1); fix or drop that row"))
    return nums


def _seconds(values: pd.Series, lines: np.ndarray, field: str, scale: float, bad: list[tuple[int, str]]) -> np.ndarray:
    """Validate numeric times (any finite number) and convert them to seconds."""
    import pandas as pd  # (heavy: only a trace needs it)

    nums = pd.to_numeric(values.astype(str).str.strip(), errors="coerce").to_numpy(np.float64)
    ok = np.isfinite(nums) & values.map(lambda v: not isinstance(v, bool)).to_numpy(bool)
    if not ok.all():
        i = int(np.argmin(ok))
        bad.append((int(lines[i]), f"{field}={_show(values.iloc[i])} is not a finite number; fix or drop that row"))
    return nums * scale


def _azure_seconds(values: pd.Series, lines: np.ndarray, bad: list[tuple[int, str]]) -> np.ndarray:
    """Parse 'YYYY-MM-DD HH:MM:SS.fffffff' exactly (7 fractional digits defeat %f) into seconds, vectorised."""
    import pandas as pd  # (heavy: only a trace needs it)

    parts = values.astype(str).str.strip().str.extract(f"^{_AZURE_TS}$")
    base = pd.to_datetime(parts[0], format="%Y-%m-%d %H:%M:%S", errors="coerce")
    ok = base.notna().to_numpy(bool)
    if not ok.all():
        i = int(np.argmin(ok))
        bad.append((int(lines[i]), f"TIMESTAMP={_show(values.iloc[i])} is not a time like "
                                   "'2023-11-16 18:15:46.6805900'; fix or drop that row"))
        return np.zeros(len(values))
    frac_ns = parts[1].fillna("").str.ljust(9, "0").astype(np.int64).to_numpy()
    ns = base.to_numpy("datetime64[ns]").astype(np.int64) + frac_ns
    return (ns - ns.min()) / 1e9


def _read_csv(path: Path, name: str, fmt: str) -> pd.DataFrame:
    """Read an Azure or plain CSV trace, keeping each row's 1-based line number in the file."""
    import pandas as pd  # (heavy: only a trace needs it)

    try:
        raw = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{name} line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); "
                          f"a trace is a text file, expected header {','.join(_HEADERS[fmt])}") from None
    numbered = [(n, s) for n, s in enumerate(raw, start=1) if s.strip()]
    if not numbered:
        raise ConfigError(f"{name}: file is empty; expected a header {','.join(_HEADERS[fmt])} and one row per request")
    try:
        table = pd.read_csv(io.StringIO("\n".join(s for _, s in numbered)), dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: not a readable CSV ({str(exc).strip().splitlines()[0]}); "
                          f"expected header {','.join(_HEADERS[fmt])}") from None
    table.columns = [str(c).strip() for c in table.columns]
    for col in _HEADERS[fmt]:
        if col not in table.columns:
            raise ConfigError(f"{name}: missing column '{col}'; expected header {','.join(_HEADERS[fmt])}")
    if table.empty:
        raise ConfigError(f"{name}: trace has a header but no requests; add at least one row")
    lines = np.array([n for n, _ in numbered[1:]], dtype=np.int64)
    table = table.fillna("")
    t_col, p_col, o_col = _HEADERS[fmt]
    bad: list[tuple[int, str]] = []
    if fmt == "azure":
        arrival = _azure_seconds(table[t_col], lines, bad)
    else:
        arrival = _seconds(table[t_col], lines, t_col, 1.0, bad)
    out = pd.DataFrame({"arrival_s": arrival,
                        "prompt_tokens": _tokens(table[p_col], lines, p_col, bad),
                        "output_tokens": _tokens(table[o_col], lines, o_col, bad), "line": lines})
    _raise_first(name, bad)
    return out


def _read_mooncake(path: Path, name: str) -> pd.DataFrame:
    """Read a Mooncake JSONL trace (timestamp in ms, hash_ids = 512-token prefix-block hashes)."""
    import pandas as pd  # (heavy: only a trace needs it)

    rows: list[dict] = []
    lines: list[int] = []
    with path.open("rb") as fh:
        for n, b in enumerate(fh, start=1):
            try:
                s = b.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{name} line {n}: not UTF-8 text; each line must be one JSON object") from None
            if not s.strip():
                continue
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{name} line {n}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{name} line {n}: expected a JSON object like "
                                  '{"timestamp": 0, "input_length": 6758, "output_length": 500}')
            for key in _HEADERS["mooncake"]:
                if key not in obj:
                    raise ConfigError(f"{name} line {n}: missing field '{key}'; each object needs "
                                      f"{', '.join(_HEADERS['mooncake'])} (hash_ids optional)")
            hashes = obj.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
                raise ConfigError(f"{name} line {n}: hash_ids={_show(hashes)} must be a list of integers "
                                  "(one prefix-block hash per 512 prompt tokens); fix or drop that row")
            rows.append({**obj, "hash_ids": " ".join(str(h) for h in hashes)})
            lines.append(n)
    if not rows:
        raise ConfigError(f"{name}: trace has no requests (empty file); expected one JSON object per line")
    # object columns keep each value as written (a float in one row must not turn every row's
    # integers into floats, which would blame the first line)
    table = pd.DataFrame({key: pd.Series([r[key] for r in rows], dtype=object) for key in (*_HEADERS["mooncake"], "hash_ids")})
    at = np.array(lines, dtype=np.int64)
    bad: list[tuple[int, str]] = []
    out = pd.DataFrame({"arrival_s": _seconds(table["timestamp"], at, "timestamp", 1e-3, bad),
                        "prompt_tokens": _tokens(table["input_length"], at, "input_length", bad),
                        "output_tokens": _tokens(table["output_length"], at, "output_length", bad),
                        "hash_ids": table["hash_ids"].astype(str), "line": at})
    _raise_first(name, bad)
    return out


def detect_format(path: str | Path) -> str:
    """The trace format, judged from the first non-blank line of the file."""
    with Path(path).open(encoding="utf-8-sig", errors="replace") as fh:
        first = next((s.strip() for s in fh if s.strip()), "")
    if not first:
        raise ConfigError(f"{path}: file is empty; a trace needs a header or JSON lines ({_ACCEPTED})")
    header = [c.strip() for c in first.split(",")]
    if first.startswith("{"):
        return "mooncake"
    if "TIMESTAMP" in header:
        return "azure"
    if "arrival_s" in header:
        return "csv"
    raise ConfigError(f"{path}: cannot detect the trace format from its first line '{_show(first)}'; "
                      f"{_ACCEPTED}; fix the header or pass fmt=")


def load_trace(path: str | Path, fmt: str = "auto") -> pd.DataFrame:
    """Load a trace as arrival_s (s from the first request, sorted), prompt_tokens, output_tokens
    and `line`, each row's 1-based line number in the file (to name rows in messages)."""
    p = Path(path)
    name = str(path)
    if not p.is_file():
        raise ConfigError(f"trace file not found: {p.resolve()}; check the path")
    if fmt not in (*FORMATS, "auto"):
        raise ConfigError(f"unknown trace format '{fmt}'; use auto or one of {', '.join(FORMATS)}")
    st = p.stat()
    return _parse(name, fmt, st.st_mtime_ns, st.st_size).copy()


@functools.lru_cache(maxsize=8)
def _parse(name: str, fmt: str, mtime_ns: int, size: int) -> pd.DataFrame:
    """Parse a trace once per process (sweeps replay the same file for every point); keyed by the
    file's modification time and size so an edited file is read again. Callers get copies."""
    p = Path(name)
    kind = detect_format(p) if fmt == "auto" else fmt
    df = _read_mooncake(p, name) if kind == "mooncake" else _read_csv(p, name, kind)
    df = df.sort_values("arrival_s", kind="stable", ignore_index=True)
    df["arrival_s"] = (df["arrival_s"] - df["arrival_s"].iloc[0]).astype(np.float64)
    return df


def trace_rate_rps(df: pd.DataFrame) -> float:
    """Mean arrival rate (n-1)/(last - first arrival), the rate a trace replays at unscaled."""
    span = float(df["arrival_s"].max() - df["arrival_s"].min()) if len(df) else 0.0
    if len(df) < 2 or span <= 0:
        raise ConfigError(f"trace spans zero time ({len(df)} requests); a rate needs >= 2 requests at distinct times")
    return (len(df) - 1) / span


def scale_to_rate(df: pd.DataFrame, rate_rps: float) -> pd.DataFrame:
    """A copy with arrivals stretched by one constant so the mean rate is rate_rps (order and lengths kept)."""
    if not (isinstance(rate_rps, int | float) and math.isfinite(rate_rps) and rate_rps > 0):
        raise ConfigError(f"rate_rps={rate_rps} must be a finite number > 0 (requests per second)")
    out = df.copy()
    out["arrival_s"] = df["arrival_s"] * (trace_rate_rps(df) / float(rate_rps))
    return out


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (cached by path, modification time and size); '' when unreadable."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return ""
    return _digest(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _digest(name: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    try:
        with open(name, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return ""
    return h.hexdigest()


def empirical_lengths(path: str | Path, column: str, fmt: str = "auto") -> np.ndarray:
    """The prompt_tokens or output_tokens of a trace file (any format), for an empirical length distribution."""
    if column not in ("prompt_tokens", "output_tokens"):
        raise ConfigError(f"column='{column}' is not a length column; use prompt_tokens or output_tokens")
    return load_trace(path, fmt)[column].to_numpy(np.int64)


MOONCAKE_HASH_TOKENS = 512  # tokens per Mooncake hash id (FAST'25 trace README: "block size 512")


def hash_units(hash_ids: list[str], prompt_tokens: np.ndarray, kv_block: int,
               tokens_per_hash: int = MOONCAKE_HASH_TOKENS) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prefix-cache units of trace requests from their hash ids (space-separated strings, one id per
    `tokens_per_hash` prompt tokens, as Mooncake's `hash_ids`): per request, unit keys and the full
    KV blocks of `kv_block` tokens each unit covers.

    Hash id p of a request covers prompt tokens [p x 512, min((p + 1) x 512, prompt)): its unit
    holds that span's full engine blocks (32 of 16 tokens; fewer for a partial last span, whose
    trailing partial block is never cached). A unit's key is a chain hash, interned as an integer:
    (the parent unit's key, the id, its blocks), so equal keys mean an equal whole prefix, whatever
    the trace's ids promise. Ids beyond the prompt's length are ignored; the units stop at the
    first span without a full block."""
    if tokens_per_hash % kv_block:
        raise ConfigError(f"trace hash blocks of {tokens_per_hash} tokens are not whole KV blocks of {kv_block}")
    per = tokens_per_hash // kv_block
    intern: dict[tuple[int, int, int], int] = {}
    keys: list[np.ndarray] = []
    blocks: list[np.ndarray] = []
    for text, tokens in zip(hash_ids, prompt_tokens.tolist(), strict=True):
        ids = text.split()
        n = min(len(ids), -(-int(tokens) // tokens_per_hash))
        ks: list[int] = []
        bs: list[int] = []
        parent = -1
        for p in range(n):
            nb = min(per, (int(tokens) - p * tokens_per_hash) // kv_block)
            if nb <= 0:
                break
            parent = intern.setdefault((parent, int(ids[p]), nb), len(intern))  # ids: integers (the loader checked)
            ks.append(parent)
            bs.append(nb)
            if nb < per:
                break
        keys.append(np.asarray(ks, dtype=np.int64))
        blocks.append(np.asarray(bs, dtype=np.int64))
    return keys, blocks


def load_rate_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A rate profile file: header `start_s,rate_rps`, one row per interval (the rate holds from
    its start to the next row's start). Returns (starts, rates); the first start must be 0, starts
    strictly increasing, rates finite and >= 0, not all 0. Errors name the line and the fix."""
    p = Path(path)
    name = str(path)
    if not p.is_file():
        raise ConfigError(f"rate profile file not found: {p.resolve()}; check the path")
    st = p.stat()
    starts, rates = _rate_csv(name, st.st_mtime_ns, st.st_size)
    return starts.copy(), rates.copy()


@functools.lru_cache(maxsize=8)
def _rate_csv(name: str, mtime_ns: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    header = "start_s,rate_rps"
    try:
        raw = Path(name).read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not UTF-8 text; a rate profile is a CSV with header {header}") from None
    rows = [(n, s.strip()) for n, s in enumerate(raw, start=1) if s.strip()]
    if not rows or [c.strip() for c in rows[0][1].split(",")] != ["start_s", "rate_rps"]:
        raise ConfigError(f"{name} line 1: expected the header {header}, one row per interval")
    if len(rows) < 2:
        raise ConfigError(f"{name}: no intervals after the header; add rows such as 0,12.5")
    starts: list[float] = []
    rates: list[float] = []
    for n, line in rows[1:]:
        parts = [c.strip() for c in line.split(",")]
        if len(parts) != 2:
            raise ConfigError(f"{name} line {n}: expected two values start_s,rate_rps, got '{_show(line)}'")
        try:
            t, r = float(parts[0]), float(parts[1])
        except ValueError:
            raise ConfigError(f"{name} line {n}: '{_show(line)}' is not two numbers start_s,rate_rps") from None
        if not (math.isfinite(t) and math.isfinite(r)) or r < 0:
            raise ConfigError(f"{name} line {n}: start_s and rate_rps must be finite and rate_rps >= 0, got '{_show(line)}'")
        if starts and t <= starts[-1]:
            raise ConfigError(f"{name} line {n}: start_s={t:g} must be after the previous row's {starts[-1]:g}")
        if not starts and t != 0:
            raise ConfigError(f"{name} line {n}: the first interval must start at start_s = 0, got {t:g}")
        starts.append(t)
        rates.append(r)
    if max(rates) <= 0:
        raise ConfigError(f"{name}: every rate_rps is 0; no request would arrive")
    return np.array(starts, dtype=np.float64), np.array(rates, dtype=np.float64)
