"""Measured benchmark files as load points (experiments.calibrate.LoadPoint).

Two formats are read:

- **vLLM's result JSON**, as `vllm bench serve --save-result --save-detailed` (vLLM 0.11,
  vllm/benchmarks/serve.py) and the older `benchmarks/benchmark_serving.py` write it: the load
  (`request_rate`, a number or "inf"; `burstiness`; `max_concurrency`), `duration` (s),
  `completed`, the per-request arrays `input_lens`, `output_lens`, `ttfts` (s), `itls` (one list
  of streamed-chunk gaps per request, s) and `errors`, and the aggregate figures
  `mean_/median_/std_/p<P>_<m>_ms` (m = ttft, tpot, itl, e2el; ms) and throughputs. A file
  written with `--append-result` (one JSON object per line) holds one load point per object.
  Without `--save-detailed` the file has no per-request lengths and cannot be simulated: rerun
  the benchmark with `--save-detailed`.
- **a plain CSV** of per-request measurements, one row per successful request in sending order,
  with the columns `prompt_tokens`, `output_tokens`, `ttft_s` (first token - send), and
  `e2e_s` (last token - send) or `tpot_s`; optionally `itl_s` (that request's chunk gaps in
  seconds, separated by spaces or semicolons), `send_s` (send time from the benchmark's start:
  gives the duration, hence the throughputs) and the load as constant columns `request_rate`
  ("inf" for all at once), `max_concurrency`, `burstiness` (or given as arguments, which win).

The measured figures use vLLM's names and are computed as vLLM computes them (calculate_metrics
in vllm/benchmarks/serve.py), over the successful requests: TTFT per request, TPOT per request
with more than one output token ((latency - TTFT) / (output - 1), latency = TTFT + the sum of its
chunk gaps), ITL pooled over every chunk gap, E2E latency; mean, median, std (population) and
p90/p99 (numpy's linear interpolation) in ms; request/output/total-token throughput over the
duration. A vLLM file's own aggregate figures, when present, take precedence over the ones
recomputed from its arrays (they are what the benchmark reported).

Every problem with a file is a one-line ConfigError naming the file and the fix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.calibrate import LoadPoint, simulate_tables
from models.catalog import MODELS
from models.errors import ConfigError
from sim.metrics import bench_metrics

# keys every vLLM result file has (vllm/benchmarks/serve.py and benchmarks/benchmark_serving.py)
VLLM_KEYS = ("request_rate", "duration", "completed")
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")
PERCENTILES = (90.0, 99.0)  # besides the median
_AGGREGATE = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
CSV_REQUIRED = ("prompt_tokens", "output_tokens", "ttft_s")
CSV_OPTIONAL = ("e2e_s", "tpot_s", "itl_s", "send_s", "request_rate", "max_concurrency", "burstiness")


def latency_stats(name: str, seconds: Sequence[float] | np.ndarray,
                  percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """mean/median/std/p<P> in ms of one latency, named and computed as vLLM's benchmark does
    (numpy mean, population std, median and linear-interpolation percentiles); none when empty."""
    x = np.asarray(seconds, dtype=np.float64)
    if x.size == 0:
        return {}
    out = {f"mean_{name}_ms": float(x.mean() * 1e3), f"median_{name}_ms": float(np.median(x) * 1e3),
           f"std_{name}_ms": float(x.std() * 1e3)}
    for p in percentiles:
        word = str(int(p)) if float(p).is_integer() else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(x, p) * 1e3)
    return out


def vllm_figures(prompt: np.ndarray, output: np.ndarray, ttft_s: np.ndarray, e2e_s: np.ndarray,
                 itl_s: list[np.ndarray] | None, duration_s: float | None) -> dict[str, float]:
    """vLLM's figures of successful requests (see the module docstring)."""
    out: dict[str, float] = {}
    out.update(latency_stats("ttft", ttft_s))
    many = output > 1
    out.update(latency_stats("tpot", (e2e_s[many] - ttft_s[many]) / (output[many] - 1)))
    out.update(latency_stats("e2el", e2e_s))
    if itl_s is not None:
        out.update(latency_stats("itl", np.concatenate(itl_s) if itl_s else np.zeros(0)))
    if duration_s is not None and duration_s > 0:
        out.update(request_throughput=len(output) / duration_s, output_throughput=float(output.sum()) / duration_s,
                   total_token_throughput=float(output.sum() + prompt.sum()) / duration_s)
    return out


# ----------------------------------------------------------------------------- reading


def read_benchmarks(path: str | Path, *, request_rate: float | None = None, max_concurrency: int | None = None,
                    burstiness: float | None = None) -> list[LoadPoint]:
    """The load points of one benchmark file: vLLM result JSON (one per JSON object) or a
    per-request CSV (one; its load from the arguments or its columns)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p}: is a folder; name a benchmark file (vLLM result JSON or a per-request CSV)")
    if not p.is_file():
        raise ConfigError(f"benchmark file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # (a byte-order mark is not content)
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file; expected vLLM result JSON or a per-request CSV") from None
    if not text.strip():
        raise ConfigError(f"{p}: empty file; expected vLLM result JSON or a per-request CSV")
    if p.suffix.lower() == ".json" or (p.suffix.lower() != ".csv" and text.lstrip().startswith(("{", "["))):
        return _read_json(p, text)
    return [_read_csv(p, request_rate, max_concurrency, burstiness)]


def read_benchmark(path: str | Path, **load: Any) -> LoadPoint:
    """The one load point of a benchmark file (see read_benchmarks)."""
    points = read_benchmarks(path, **load)
    if len(points) != 1:
        raise ConfigError(f"{path}: holds {len(points)} benchmark results (--append-result); read it with read_benchmarks")
    return points[0]


def _json_objects(p: Path, text: str) -> list[Any]:
    """One JSON document, or several concatenated (vLLM's --append-result writes one per line)."""
    dec = json.JSONDecoder()
    objs: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return objs
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{p}: not valid JSON ({err}); expected vLLM's `bench serve --save-result` file") from None
        objs.append(obj)


def _read_json(p: Path, text: str) -> list[LoadPoint]:
    objs = _json_objects(p, text)
    points = []
    for k, obj in enumerate(objs):
        where = f"{p}" if len(objs) == 1 else f"{p} (result {k + 1})"
        name = p.stem if len(objs) == 1 else f"{p.stem}#{k + 1}"
        points.append(_vllm_point(obj, where, name, str(p)))
    return points


def _num(v: Any, where: str, key: str, *, positive: bool = False, allow_inf: bool = False) -> float:
    """A finite number >= 0 (> 0 if positive; +inf if allow_inf), or a one-line error."""
    if allow_inf and isinstance(v, str) and v.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
    x = float(v)
    if math.isnan(x) or (math.isinf(x) and not (allow_inf and x > 0)):
        raise ConfigError(f"{where}: {key} must be a finite number, got {v!r}")
    if x < 0 or (positive and x == 0):
        raise ConfigError(f"{where}: {key} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return x


def _array(obj: dict[str, Any], key: str, n: int, where: str) -> list[Any]:
    v = obj[key]
    if not isinstance(v, list):
        raise ConfigError(f"{where}: {key} must be a list (one entry per request), got {type(v).__name__}")
    if len(v) != n:
        raise ConfigError(f"{where}: {key} has {len(v)} entries but input_lens has {n}; the per-request arrays must align")
    return v


def _load(where: str, rate: Any, conc: Any, burst: Any) -> tuple[float, int | None, float]:
    r = _num(rate, where, "request_rate", positive=True, allow_inf=True)
    c = None
    if conc is not None:
        cf = _num(conc, where, "max_concurrency", positive=True)
        if not cf.is_integer():
            raise ConfigError(f"{where}: max_concurrency must be a whole number of clients, got {conc!r}")
        c = int(cf)
    b = 1.0 if burst is None else _num(burst, where, "burstiness", positive=True)
    return r, c, b


def _vllm_point(obj: Any, where: str, name: str, source: str) -> LoadPoint:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object (vLLM's `bench serve --save-result` file), got {type(obj).__name__}")
    missing = [k for k in VLLM_KEYS if k not in obj]
    if missing:
        raise ConfigError(f"{where}: not a vLLM benchmark result (missing {', '.join(missing)}); expected the JSON "
                          "of `vllm bench serve --save-result --save-detailed`, or a per-request CSV")
    absent = [k for k in DETAILED_KEYS if k not in obj]
    if absent:
        raise ConfigError(f"{where}: no per-request lengths ({', '.join(absent)} missing): the benchmark cannot be "
                          "simulated from its aggregates alone; rerun `vllm bench serve` with --save-detailed")
    if obj.get("ramp_up_strategy"):
        raise ConfigError(f"{where}: ramp_up_strategy '{obj['ramp_up_strategy']}' (a request rate that changes over "
                          "the run) is not simulated; calibrate on runs at a fixed --request-rate")
    rate, conc, burst = _load(where, obj["request_rate"], obj.get("max_concurrency"), obj.get("burstiness"))
    duration = _num(obj["duration"], where, "duration", positive=True)
    lens_in = obj["input_lens"]
    if not isinstance(lens_in, list):
        raise ConfigError(f"{where}: input_lens must be a list (one entry per request), got {type(lens_in).__name__}")
    n = len(lens_in)
    lens_out = _array(obj, "output_lens", n, where)
    ttfts = _array(obj, "ttfts", n, where)
    itls = _array(obj, "itls", n, where) if "itls" in obj else None
    errors = _array(obj, "errors", n, where) if "errors" in obj else [""] * n
    prompt, output, ttft, e2e, gaps = [], [], [], [], []
    for i in range(n):
        if errors[i] not in ("", None):
            continue  # a failed request (vLLM records ttft 0 and no output)
        t = _num(ttfts[i], where, f"ttfts[{i}]")
        o = _num(lens_out[i], where, f"output_lens[{i}]")
        if t <= 0 or o < 1:
            continue
        pr = _num(lens_in[i], where, f"input_lens[{i}]", positive=True)
        if not (pr.is_integer() and o.is_integer()):
            raise ConfigError(f"{where}: request {i}: token counts must be whole numbers (input {lens_in[i]!r}, "
                              f"output {lens_out[i]!r})")
        g = np.zeros(0)
        if itls is not None:
            row = itls[i]
            if not isinstance(row, list):
                raise ConfigError(f"{where}: itls[{i}] must be a list of chunk gaps in seconds, got {row!r}")
            g = np.array([_num(x, where, f"itls[{i}][{j}]") for j, x in enumerate(row)], dtype=np.float64)
        prompt.append(int(pr))
        output.append(int(o))
        ttft.append(t)
        e2e.append(t + float(g.sum()))
        gaps.append(g)
    if not prompt:
        raise ConfigError(f"{where}: no successful request (every request has an error, ttft 0 or no output); "
                          "nothing to calibrate against")
    po, oo = np.array(prompt), np.array(output)
    measured = vllm_figures(po, oo, np.array(ttft), np.array(e2e), gaps if itls is not None else None, duration)
    if itls is None:  # latencies after the first token are unknown per request
        measured = {k: v for k, v in measured.items() if "_tpot_" not in k and "_e2el_" not in k}
    for key, v in obj.items():  # the benchmark's own aggregates win
        if _AGGREGATE.match(key) or key in THROUGHPUTS:
            if v is None:
                continue
            measured[key] = _num(v, where, key)
    for m in LATENCIES:  # vLLM may report the median as p50 only
        if f"median_{m}_ms" not in measured and f"p50_{m}_ms" in measured:
            measured[f"median_{m}_ms"] = measured[f"p50_{m}_ms"]
    return LoadPoint(name, tuple(prompt), tuple(output), rate, conc, burst, measured, source)


def _read_csv(p: Path, rate: float | None, conc: int | None, burst: float | None) -> LoadPoint:
    try:
        df = pd.read_csv(p, dtype={"itl_s": str}, skipinitialspace=True)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{p}: not a readable CSV ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in CSV_REQUIRED if c not in df.columns]
    if missing or not ({"e2e_s", "tpot_s"} & set(df.columns)):
        need = missing + ([] if {"e2e_s", "tpot_s"} & set(df.columns) else ["e2e_s (or tpot_s)"])
        raise ConfigError(f"{p}: missing column(s) {', '.join(need)}; a per-request CSV needs "
                          f"{', '.join(CSV_REQUIRED)}, e2e_s or tpot_s (optional: itl_s, send_s, request_rate, "
                          "max_concurrency, burstiness); or give vLLM's result JSON")
    unknown = [c for c in df.columns if c not in CSV_REQUIRED + CSV_OPTIONAL]
    if unknown:
        raise ConfigError(f"{p}: unknown column(s) {', '.join(unknown)} (known: {', '.join(CSV_REQUIRED + CSV_OPTIONAL)})")
    if df.empty:
        raise ConfigError(f"{p}: no requests (a header and no rows); nothing to calibrate against")

    def col(name: str, *, positive: bool = False) -> np.ndarray:
        x = pd.to_numeric(df[name], errors="coerce").to_numpy(np.float64)
        bad = np.flatnonzero(~np.isfinite(x) | (x < 0) | ((x == 0) if positive else False))
        if bad.size:
            i = int(bad[0])
            raise ConfigError(f"{p}: row {i + 2}: {name} must be a finite number {'> 0' if positive else '>= 0'}, "
                              f"got {df[name].iloc[i]!r}")
        return x

    prompt, output = col("prompt_tokens", positive=True), col("output_tokens", positive=True)
    for name, x in (("prompt_tokens", prompt), ("output_tokens", output)):
        frac = np.flatnonzero(x != np.round(x))
        if frac.size:
            raise ConfigError(f"{p}: row {int(frac[0]) + 2}: {name} must be a whole number, got {x[frac[0]]!r}")
    ttft = col("ttft_s", positive=True)
    if "e2e_s" in df.columns:
        e2e = col("e2e_s")
        short = np.flatnonzero(e2e < ttft)
        if short.size:
            i = int(short[0])
            raise ConfigError(f"{p}: row {i + 2}: e2e_s {e2e[i]!r} is before the first token (ttft_s {ttft[i]!r})")
    else:
        e2e = ttft + col("tpot_s") * np.maximum(output - 1, 0)
    gaps = None
    if "itl_s" in df.columns:
        gaps = []
        for i, cell in enumerate(df["itl_s"].fillna("")):
            parts = [s for s in re.split(r"[\s;,]+", str(cell).strip().strip("[]")) if s]
            try:
                g = np.array([float(s) for s in parts], dtype=np.float64)
            except ValueError:
                raise ConfigError(f"{p}: row {i + 2}: itl_s must be chunk gaps in seconds separated by spaces or "
                                  f"semicolons, got {cell!r}") from None
            if not np.isfinite(g).all() or (g < 0).any():
                raise ConfigError(f"{p}: row {i + 2}: itl_s gaps must be finite and >= 0, got {cell!r}")
            gaps.append(g)
    duration = None
    if "send_s" in df.columns:
        send = col("send_s")
        duration = float((send + e2e).max() - send.min())

    def const(name: str) -> Any:
        if name not in df.columns:
            return None
        vals = df[name].dropna().unique()
        if len(vals) > 1:
            raise ConfigError(f"{p}: column {name} must hold one value for the whole file (one load point per file), "
                              f"got {len(vals)} different ones")
        v = vals[0] if len(vals) else None
        return str(v) if isinstance(v, str) else (None if v is None else float(v))

    r = rate if rate is not None else const("request_rate")
    c = conc if conc is not None else const("max_concurrency")
    b = burst if burst is not None else const("burstiness")
    if r is None and c is None:
        raise ConfigError(f"{p}: no load: give --request-rate R (inf: all at once) and/or --max-concurrency N, "
                          "or add request_rate / max_concurrency columns")
    r_, c_, b_ = _load(str(p), "inf" if r is None else r, c, b)
    measured = vllm_figures(prompt.astype(np.int64), output.astype(np.int64), ttft, e2e, gaps, duration)
    return LoadPoint(p.stem, tuple(int(x) for x in prompt), tuple(int(x) for x in output), r_, c_, b_, measured, str(p))


# ----------------------------------------------------------------------------- model names


def guess_model(model_id: str) -> str | None:
    """The catalogue model a benchmark's `model_id` names (a Hugging Face id or a local path:
    'meta-llama/Llama-3.1-8B-Instruct' -> 'llama-3.1-8b'), or None."""
    base = str(model_id).rstrip("/").split("/")[-1].lower()
    base = re.sub(r"^meta-", "", base)
    for suffix in ("-instruct", "-chat", "-hf", "-it", "-base"):
        base = base.removesuffix(suffix)
    for name, m in MODELS.items():
        if base in (name, m.hf_id.split("/")[-1].lower()):
            return name
    return None


def model_ids(paths: Sequence[str | Path]) -> list[str]:
    """The distinct `model_id`s named by these vLLM result files (CSV files name none)."""
    out: list[str] = []
    for path in paths:
        p = Path(path)
        if not p.is_file() or p.suffix.lower() == ".csv":
            continue
        try:
            objs = _json_objects(p, p.read_text(encoding="utf-8-sig"))
        except (ConfigError, UnicodeDecodeError):
            continue  # read_benchmarks reports it
        for obj in objs:
            mid = obj.get("model_id") if isinstance(obj, dict) else None
            if isinstance(mid, str) and mid not in out:
                out.append(mid)
    return out


# ----------------------------------------------------------------------------- writing (synthetic files)


def simulated_result(sc: Any, point: LoadPoint, seed: int = 1, noise: float = 0.0, noise_seed: int = 0,
                     model_id: str = "") -> dict[str, Any]:
    """A vLLM result JSON (as `bench serve --save-result --save-detailed` writes it) of the
    benchmark `point` simulated on scenario `sc`: for tests and examples, a file of known truth.

    With `noise`, each request's TTFT and decode time (latency - TTFT) are multiplied by
    independent lognormal factors of that sigma, and the ITL figures by one more. The simulator records no
    per-request chunk times, so each request's `itls` is its TPOT repeated (their sum is its
    latency after the first token, as in a real file), and the ITL aggregates are the
    simulator's pooled chunk gaps (bench_metrics); read back, a file's aggregates win, so the
    ITL figures a fit sees are the simulated ones."""
    req, steps = simulate_tables(sc, point, seed)
    rng = np.random.default_rng(noise_seed)
    req = req.to_pandas().sort_values("id")
    done = req.completion_s.notna().to_numpy()
    n = len(req)
    ttft = (req.first_token_s - req.arrival_s).to_numpy(np.float64)
    decode = (req.completion_s - req.first_token_s).to_numpy(np.float64)
    if noise:
        ttft = ttft * rng.lognormal(0.0, noise, n)
        decode = decode * rng.lognormal(0.0, noise, n)
    out_tok = req.output_tokens.to_numpy(np.int64)
    prompt = req.prompt_tokens.to_numpy(np.int64)
    itls = [[float(decode[i] / (out_tok[i] - 1))] * int(out_tok[i] - 1) if done[i] and out_tok[i] > 1 else []
            for i in range(n)]
    arrival = req.arrival_s.to_numpy(np.float64)
    end = arrival + ttft + decode
    duration = float(np.nanmax(end[done]) - np.nanmin(arrival))
    ok = done
    figs = vllm_figures(prompt[ok], out_tok[ok], ttft[ok], (ttft + decode)[ok], None, duration)
    sim = bench_metrics(req, steps)
    itl_factor = float(rng.lognormal(0.0, noise)) if noise else 1.0  # one for all: percentiles stay in order
    for k, v in sim.items():
        if "_itl_" in k:
            figs[k] = float(v * itl_factor)
    figs.pop("p90_e2el_ms", None)
    figs.pop("p99_e2el_ms", None)
    result: dict[str, Any] = {
        "date": "20250101-000000", "endpoint_type": "openai", "backend": "vllm", "label": None,
        "model_id": model_id, "tokenizer_id": model_id, "num_prompts": n,
        "request_rate": point.request_rate if math.isfinite(point.request_rate) else "inf",
        "burstiness": point.burstiness, "max_concurrency": point.max_concurrency,
        "duration": duration, "completed": int(ok.sum()),
        "total_input_tokens": int(prompt[ok].sum()), "total_output_tokens": int(out_tok[ok].sum()),
        "request_goodput": None,
    }
    result.update({k: v for k, v in figs.items() if "_e2el_" not in k})
    result.update(input_lens=[int(x) for x in prompt], output_lens=[int(x) if ok[i] else 0 for i, x in enumerate(out_tok)],
                  ttfts=[float(t) if ok[i] else 0.0 for i, t in enumerate(ttft)], itls=itls,
                  generated_texts=[""] * n, errors=["" if d else "not completed" for d in done])
    return result


__all__ = ["CSV_OPTIONAL", "CSV_REQUIRED", "guess_model", "latency_stats", "model_ids", "read_benchmark",
           "read_benchmarks", "simulated_result", "vllm_figures"]
