"""`specrack acceptance`: acceptance measured on your own traffic.

Reads what a team running speculation already has, fits the engine's acceptance model per
traffic class (models.acceptance_fit), prints the fit and its goodness, and writes a TOML
fragment of `[[workload.classes]]` entries. With `--against`, a second source (say production
next to a benchmark) is fitted too and the scenario is swept at both acceptances.

Formats, with the names as vLLM writes them (checked against its source):

- Prometheus text exposition of vLLM V1's spec-decode counters (vllm/v1/spec_decode/metrics.py,
  `SpecDecodingProm`; labels model_name and engine from vllm/v1/metrics/loggers.py):
  `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total` and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0".."k-1"}`; a draft's accepted
  tokens are a prefix (`SpecDecodingStats.observe_draft` counts positions 0..n-1), so the
  per-position counters give the whole accepted-length histogram. One scrape (counts since the
  server started) or two (differenced: the window between them). vLLM V0's counters
  (`vllm:spec_decode_num_draft_tokens_total`, `..._num_emitted_tokens_total`; the
  `..._draft_acceptance_rate` and `..._efficiency` gauges cannot be fitted) give the mean only and
  need --k (vllm/model_executor/layers/rejection_sampler.py: emitted = accepted prefix + 1 per step).
- `vllm bench serve` result JSON (vllm/benchmarks/serve.py): `spec_decode_num_drafts`,
  `spec_decode_draft_tokens`, `spec_decode_accepted_tokens`, `spec_decode_acceptance_rate` (%),
  `spec_decode_acceptance_length` and `spec_decode_per_position_acceptance_rates` (the
  per-position counters' deltas over the run, divided by the drafts).
- vLLM's log lines `SpecDecoding metrics: ... Accepted: N tokens, Drafted: N tokens,
  Per-position acceptance rate: r1, r2, ...` (SpecDecodingLogging.log), summed over lines.
- CSV, per step `request_id,class,step,k,accepted` (request_id, class, step optional; k a column
  or --k), or per request `request_id,class,num_drafts,num_draft_tokens,num_accepted_tokens`
  (the simulator's request-table names verify_steps, draft_proposed, draft_accepted also work).
"""

from __future__ import annotations

import html
import json
import math
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.analysis import crossovers, speedups
from experiments.report import speedup_chart
from experiments.sweep import SweepSpec, Variant, run_sweep
from models.acceptance_fit import MIN_DRAFTS, AcceptanceFit, Observations, fit
from models.errors import ConfigError
from models.speculative import beta_params
from sim.scenario import load_scenario, parse_set

V1 = "vllm:spec_decode_num_drafts"
V1_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
V0_EMITTED = "vllm:spec_decode_num_emitted_tokens"
GAUGES = ("vllm:spec_decode_draft_acceptance_rate", "vllm:spec_decode_efficiency")
BENCH_KEYS = ("spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
              "spec_decode_per_position_acceptance_rates")
LOG_MARK = "SpecDecoding metrics:"
DEFAULT_SPECULATIVE = {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


# ---------------------------------------------------------------------------- reading

def _kind_of(path: Path, text: str) -> str:
    """prometheus | bench | log | csv, from the content (the extension only breaks ties)."""
    head = text.lstrip()[:1]
    if head in ("{", "["):
        return "bench"
    if LOG_MARK in text:
        return "log"
    if re.search(r"^(# (HELP|TYPE) |vllm:)", text, re.M):
        return "prometheus"
    first = text.strip().splitlines()[0] if text.strip() else ""
    if path.suffix.lower() == ".csv" or "," in first:
        return "csv"
    raise ConfigError(f"{path}: not a format specrack acceptance reads (a Prometheus scrape of vLLM's /metrics, a "
                      "vllm bench serve result JSON, vLLM log lines with 'SpecDecoding metrics:', or a CSV of accepted "
                      "lengths); see `specrack acceptance --help`")


def parse_prometheus(path: Path, text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a text exposition: (name, sorted labels) -> value. Comment lines are skipped;
    a file whose non-comment lines mostly do not parse is not a scrape."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    bad = 0
    for ln in lines:
        m = _SAMPLE.match(ln)
        if not m:
            bad += 1
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            bad += 1
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = value
    if not lines:
        raise ConfigError(f"{path}: a Prometheus file with no samples (only comments or blank lines); save vLLM's "
                          "/metrics page while the server runs with speculative decoding, e.g. "
                          "curl -s http://HOST:8000/metrics > scrape.prom")
    if not out or bad > len(lines) / 2:
        raise ConfigError(f"{path}: not a Prometheus text exposition ({bad} of {len(lines)} sample lines unreadable); "
                          "save vLLM's /metrics page as it is, e.g. curl -s http://HOST:8000/metrics > scrape.prom")
    return out


def _spec_series(path: Path, samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
                 model: str | None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The spec-decode counters (names normalised without `_total`), for one model_name."""
    series = {}
    for (name, labels), v in samples.items():
        if not name.startswith("vllm:spec_decode") or name.endswith("_created"):
            continue
        base = name.removesuffix("_total")
        if base in GAUGES:
            continue
        series[(base, labels)] = v
    models = sorted({dict(lb).get("model_name", "") for _, lb in series})
    if model is not None:
        series = {key: v for key, v in series.items() if dict(key[1]).get("model_name", "") == model}
        if not series:
            raise ConfigError(f"{path}: no spec-decode counters for --model {model} (models in the scrape: "
                              f"{', '.join(m for m in models if m) or 'none'})")
    elif len(models) > 1:
        raise ConfigError(f"{path}: spec-decode counters for several models ({', '.join(models)}); pick one with --model NAME")
    return series


def _observations_from_counters(where: str, series: dict[tuple[str, tuple[tuple[str, str], ...]], float],
                                k_flag: int | None, name: str, notes: list[str]) -> Observations:
    def total(metric: str) -> float | None:
        vals = [v for (m, _), v in series.items() if m == metric]
        return float(sum(vals)) if vals else None

    drafts = total(V1)
    per_pos: dict[int, float] = {}
    for (m, labels), v in series.items():
        if m == V1_POS:
            pos = dict(labels).get("position")
            if pos is None or not pos.isdigit():
                raise ConfigError(f"{where}: {V1_POS}_total without a numeric position label")
            per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + v
    if drafts is not None and per_pos:
        k = max(per_pos) + 1
        if k_flag is not None and k_flag != k:
            raise ConfigError(f"{where}: the counters have {k} draft positions but --k {k_flag} was given; drop --k")
        acc = np.array([per_pos.get(i, 0.0) for i in range(k)])
        if np.any(np.diff(acc) > 0.5) or acc[0] > drafts + 0.5:
            raise ConfigError(f"{where}: accepted tokens per position must not rise with the position nor exceed the "
                              f"drafts ({drafts:.0f} drafts, per position {', '.join(f'{x:.0f}' for x in acc)}); are these "
                              "counters from one server?")
        hist = np.empty(k + 1)
        hist[0] = drafts - acc[0]
        hist[1:k] = acc[:-1] - acc[1:]
        hist[k] = acc[-1]
        dt = total(DRAFT_TOKENS)
        if dt is not None and drafts > 0 and dt < 0.99 * k * drafts:
            notes.append(f"{where}: {dt:.0f} draft tokens over {drafts:.0f} drafts is fewer than k = {k} per draft (n-gram or "
                         "length-capped drafts); the fit counts the missing positions as rejected")
        return Observations(name, k, "histogram", hist=np.rint(hist), source=where)
    emitted, dt = total(V0_EMITTED), total(DRAFT_TOKENS)
    if emitted is not None and dt is not None:
        if k_flag is None:
            raise ConfigError(f"{where}: vLLM V0 counters do not say how many tokens each draft has; pass --k "
                              "(the server's num_speculative_tokens)")
        n = dt / k_flag
        if emitted < n - 0.5:
            raise ConfigError(f"{where}: {emitted:.0f} emitted tokens is fewer than the {n:.0f} drafts (= draft tokens / --k "
                              f"{k_flag}) each of which emits at least one; is --k right?")
        return Observations(name, k_flag, "mean", n=np.array([round(n)]), accepted=np.array([round(emitted - n)]),
                            source=where)
    raise ConfigError(f"{where}: no speculative-decoding counters (vllm:spec_decode_num_drafts_total and "
                      "vllm:spec_decode_num_accepted_tokens_per_pos_total, or V0's num_draft_tokens and num_emitted_tokens); "
                      "was the server started with --speculative-config?")


def _read_prometheus(paths: list[Path], k_flag: int | None, name: str, model: str | None,
                     notes: list[str]) -> Observations:
    if len(paths) > 2:
        raise ConfigError(f"{paths[2]}: at most two Prometheus scrapes per source (before and after; counters are differenced)")
    scrapes = [_spec_series(p, parse_prometheus(p, p.read_text(encoding="utf-8-sig", errors="replace")), model) for p in paths]
    where = str(paths[0]) if len(paths) == 1 else f"{paths[0]} -> {paths[1]}"
    for p, s in zip(paths, scrapes, strict=True):
        if not s:
            raise ConfigError(f"{p}: no speculative-decoding metrics (vllm:spec_decode_*) in this scrape; was the server "
                              "started with --speculative-config?")
    series = scrapes[0]
    if len(scrapes) == 2:
        before, after = scrapes
        series = {}
        for key, v in after.items():
            v0 = before.get(key, 0.0)
            if v < v0:
                labels = ",".join(f'{a}="{b}"' for a, b in key[1])
                raise ConfigError(f"{where}: counter {key[0]}_total{{{labels}}} goes backwards ({v0:g} -> {v:g}): the server "
                                  "restarted between the scrapes or they are in the wrong order; give the earlier scrape first")
            series[key] = v - v0
    return _observations_from_counters(where, series, k_flag, name, notes)


def _hist_from_rates(where: str, drafts: float, rates: list[float]) -> np.ndarray:
    k = len(rates)
    acc = np.minimum.accumulate(np.rint(np.asarray(rates, dtype=np.float64) * drafts))
    if np.any(acc < 0) or acc[0] > drafts:
        raise ConfigError(f"{where}: per-position acceptance rates must lie in [0, 1], got {rates}")
    hist = np.empty(k + 1)
    hist[0] = drafts - acc[0]
    hist[1:k] = acc[:-1] - acc[1:]
    hist[k] = acc[-1]
    return hist


def _read_bench(path: Path, text: str, k_flag: int | None, name: str) -> Observations:
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{path}: invalid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected one vllm bench serve result (a JSON object), got a {type(data).__name__}")
    if "spec_decode_num_drafts" not in data:
        raise ConfigError(f"{path}: no speculative-decoding figures (spec_decode_num_drafts, "
                          "spec_decode_per_position_acceptance_rates, ...); vllm bench serve writes them when the server "
                          "speculates")
    try:
        drafts = float(data["spec_decode_num_drafts"])
        rates = [float(r) for r in data.get("spec_decode_per_position_acceptance_rates") or []]
        accepted = float(data.get("spec_decode_accepted_tokens", float("nan")))
        draft_tokens = float(data.get("spec_decode_draft_tokens", float("nan")))
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: spec_decode_* values must be numbers (and a list of numbers for the "
                          "per-position rates)") from None
    if rates:
        if k_flag is not None and k_flag != len(rates):
            raise ConfigError(f"{path}: {len(rates)} per-position rates but --k {k_flag}; drop --k")
        return Observations(name, len(rates), "histogram", hist=_hist_from_rates(str(path), drafts, rates), source=str(path))
    k = k_flag or (round(draft_tokens / drafts) if drafts > 0 and math.isfinite(draft_tokens) else None)
    if not k or not math.isfinite(accepted):
        raise ConfigError(f"{path}: no per-position rates and no draft/accepted token counts to fit; pass --k and check "
                          "the file holds spec_decode_accepted_tokens")
    return Observations(name, int(k), "mean", n=np.array([round(drafts)]), accepted=np.array([round(accepted)]),
                        source=str(path))


def _read_log(path: Path, text: str, name: str) -> Observations:
    total: np.ndarray | None = None
    for ln in text.splitlines():
        if LOG_MARK not in ln:
            continue
        drafted = re.search(r"Drafted: (\d+) tokens", ln)
        rates_m = re.search(r"Per-position acceptance rate: ([0-9.]+(?:, [0-9.]+)*)", ln)
        if not drafted or not rates_m:
            raise ConfigError(f"{path}: a '{LOG_MARK}' line without 'Drafted: N tokens' and 'Per-position acceptance "
                              f"rate: ...' (vLLM V1's format): {ln.strip()[:120]}")
        rates = [float(r) for r in rates_m.group(1).split(",")]
        hist = _hist_from_rates(str(path), int(drafted.group(1)) / len(rates), rates)
        if total is not None and total.size != hist.size:
            raise ConfigError(f"{path}: log lines with different numbers of draft positions ({total.size - 1} and "
                              f"{hist.size - 1}); one server's log at a time")
        total = hist if total is None else total + hist
    assert total is not None
    return Observations(name, total.size - 1, "histogram", hist=total, source=str(path))


_ALIASES = {"verify_steps": "num_drafts", "draft_proposed": "num_draft_tokens", "draft_accepted": "num_accepted_tokens",
            "id": "request_id", "cls": "class", "traffic_class": "class", "num_accepted": "accepted"}


def _int_column(path: Path, df: pd.DataFrame, col: str) -> np.ndarray:
    v = pd.to_numeric(df[col], errors="coerce").to_numpy(np.float64)
    if np.any(~np.isfinite(v)) or np.any(v < 0) or np.any(v != np.rint(v)):
        row = int(np.flatnonzero(~np.isfinite(v) | (v < 0) | (v != np.rint(v)))[0])
        raise ConfigError(f"{path}: column {col} must hold non-negative integers; row {row + 2} has {df[col].iloc[row]!r}")
    return v.astype(np.int64)


def _read_csv(path: Path, k_flag: int | None, name: str) -> list[Observations]:
    try:
        df = pd.read_csv(path)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not a readable CSV ({(str(err).splitlines() or [''])[0]})") from None
    df.columns = [str(c).strip().lower() for c in df.columns]
    df = df.rename(columns={a: b for a, b in _ALIASES.items() if a in df.columns and b not in df.columns})
    classes = df["class"].astype(str).to_numpy() if "class" in df.columns else np.full(len(df), name)
    if "accepted" in df.columns:
        acc = _int_column(path, df, "accepted")
        if "k" in df.columns:
            k = _int_column(path, df, "k")
        elif k_flag is not None:
            k = np.full(len(df), k_flag)
        else:
            raise ConfigError(f"{path}: per-step rows need the number of drafted tokens: add a k column or pass --k")
        if np.any(acc > k):
            row = int(np.flatnonzero(acc > k)[0])
            raise ConfigError(f"{path}: row {row + 2}: accepted {acc[row]} exceeds k {k[row]}")
        out = []
        for c in dict.fromkeys(classes):
            sel = classes == c
            kmax = int(k[sel].max())
            if "request_id" in df.columns:
                rid, _ = pd.factorize(df["request_id"][sel])
                steps = np.zeros((int(rid.max()) + 1, kmax + 1, kmax + 1))
                np.add.at(steps, (rid, k[sel], acc[sel]), 1.0)
                steps[:, 0, :] = 0.0  # k = 0 steps verify nothing
                out.append(Observations(str(c), kmax, "steps", steps=steps, source=str(path)))
            else:
                if np.unique(k[sel & (k > 0)]).size > 1:
                    raise ConfigError(f"{path}: steps with different k need a request_id column (per-request fit)")
                hist = np.bincount(acc[sel & (k > 0)], minlength=kmax + 1).astype(np.float64)
                out.append(Observations(str(c), kmax, "histogram", hist=hist, source=str(path)))
        return out
    if "num_drafts" in df.columns and "num_accepted_tokens" in df.columns:
        n = _int_column(path, df, "num_drafts")
        s = _int_column(path, df, "num_accepted_tokens")
        if "num_draft_tokens" in df.columns:
            dt = _int_column(path, df, "num_draft_tokens")
            ok = n > 0
            if np.any(dt[ok] % n[ok]):
                row = int(np.flatnonzero(ok & (dt % np.maximum(n, 1) != 0))[0])
                raise ConfigError(f"{path}: row {row + 2}: {dt[row]} draft tokens over {n[row]} drafts is not a whole k per "
                                  "draft; per-request totals need a constant k (use per-step rows otherwise)")
            k = np.where(ok, dt // np.maximum(n, 1), 0)
        elif "k" in df.columns:
            k = _int_column(path, df, "k")
        elif k_flag is not None:
            k = np.full(len(df), k_flag)
        else:
            raise ConfigError(f"{path}: per-request rows need the drafted tokens: a num_draft_tokens or k column, or --k")
        if np.any(s > n * k):
            row = int(np.flatnonzero(s > n * k)[0])
            raise ConfigError(f"{path}: row {row + 2}: {s[row]} accepted tokens exceed num_drafts x k = {n[row] * k[row]}")
        out = []
        for c in dict.fromkeys(classes):
            sel = (classes == c) & (n > 0) & (k > 0)
            if not sel.any():
                continue
            out.append(Observations(str(c), int(k[sel].max()), "totals", n=n[sel], accepted=s[sel], ks=k[sel],
                                    source=str(path)))
        return out
    raise ConfigError(f"{path}: CSV columns {list(df.columns)} are neither per-step (accepted, with k or --k; optional "
                      "request_id, class) nor per-request (num_drafts, num_accepted_tokens, num_draft_tokens; optional "
                      "request_id, class)")


def _merge(a: Observations, b: Observations) -> Observations:
    if a.kind != b.kind or a.k != b.k or a.kind == "mean":
        raise ConfigError(f"{b.source}: class '{b.name}' is also in {a.source} with other data ({a.kind}, k = {a.k} vs "
                          f"{b.kind}, k = {b.k}); give each source files of one kind")
    if a.kind == "histogram":
        assert a.hist is not None and b.hist is not None
        return Observations(a.name, a.k, a.kind, hist=a.hist + b.hist, source=f"{a.source}, {b.source}")
    if a.kind == "steps":
        assert a.steps is not None and b.steps is not None
        return Observations(a.name, a.k, a.kind, steps=np.concatenate([a.steps, b.steps]), source=f"{a.source}, {b.source}")
    assert a.n is not None and b.n is not None and a.accepted is not None and b.accepted is not None
    assert a.ks is not None and b.ks is not None
    return Observations(a.name, a.k, a.kind, n=np.concatenate([a.n, b.n]), accepted=np.concatenate([a.accepted, b.accepted]),
                        ks=np.concatenate([a.ks, b.ks]), source=f"{a.source}, {b.source}")


def read_source(files: list[str], *, name: str, k: int | None = None, model: str | None = None,
                notes: list[str] | None = None) -> list[Observations]:
    """One source's files as observations per class (classes from a CSV class column; otherwise `name`)."""
    notes = notes if notes is not None else []
    if k is not None and k < 1:
        raise ConfigError(f"--k must be a positive number of drafted tokens per step, got {k}")
    proms: list[Path] = []
    obs: dict[str, Observations] = {}
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise ConfigError(f"{p}: file not found")
        try:  # utf-8-sig: a byte-order mark is not content
            text = p.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a text file (a Prometheus scrape, bench JSON, log or CSV)") from None
        if not text.strip():
            raise ConfigError(f"{p}: empty file")
        kind = _kind_of(p, text)
        if kind == "prometheus":
            proms.append(p)
            continue
        got = ([_read_bench(p, text, k, name)] if kind == "bench" else [_read_log(p, text, name)] if kind == "log"
               else _read_csv(p, k, name))
        for o in got:
            obs[o.name] = _merge(obs[o.name], o) if o.name in obs else o
    if proms:
        o = _read_prometheus(proms, k, name, model, notes)
        obs[o.name] = _merge(obs[o.name], o) if o.name in obs else o
    if not obs:
        raise ConfigError(f"{', '.join(files)}: no verification steps to fit")
    return list(obs.values())


def fit_source(files: list[str], *, name: str, k: int | None = None, model: str | None = None,
               decay: float | None = None, min_drafts: int = MIN_DRAFTS) -> tuple[list[AcceptanceFit], list[str]]:
    """Read and fit one source; returns the fits per class and notes about the data."""
    if decay is not None and not 0 < decay <= 1:
        raise ConfigError(f"--decay must be in (0, 1], got {decay}")
    notes: list[str] = []
    fits = []
    for o in read_source(files, name=name, k=k, model=model, notes=notes):
        try:
            fits.append(fit(o, decay=decay, min_drafts=min_drafts))
        except ValueError as err:
            raise ConfigError(f"{o.source}: {err}; measure over a longer window (or more requests)") from None
    return fits, notes


# ---------------------------------------------------------------------------- output

def _shares(fits: list[AcceptanceFit]) -> list[float]:
    w = np.array([float(f.num_requests) if f.num_requests is not None else float(f.num_drafts) for f in fits])
    raw = w / w.sum()
    shares = [round(float(x), 4) for x in raw]
    shares[-1] = round(1.0 - sum(shares[:-1]), 4)  # sums to exactly 1 as the scenario demands
    return shares


def source_decay(fits: list[AcceptanceFit]) -> float:
    """One decay for the scenario's speculative table: the classes' decays weighted by drafts."""
    w = np.array([f.num_drafts for f in fits], dtype=np.float64)
    return float(np.average([f.decay for f in fits], weights=w))


def class_entries(fits: list[AcceptanceFit]) -> list[dict[str, Any]]:
    """The fitted classes as scenario `workload.classes` tables."""
    return [{"name": f.name, "share": sh, "acceptance": round(f.mean, 4), "acceptance_spread": round(f.spread, 4)}
            for f, sh in zip(fits, _shares(fits), strict=True)]


def fragment_toml(fits: list[AcceptanceFit], files: list[str]) -> str:
    """A `[[workload.classes]]` fragment to paste into (or merge with) a scenario."""
    drafts = sum(f.num_drafts for f in fits)
    ks = sorted({f.k for f in fits})
    lines = [f"# fitted by specrack acceptance from {', '.join(files)} ({drafts} drafts, k={'/'.join(map(str, ks))})",
             "# per-token acceptance a ~ Beta(acceptance, acceptance_spread) per request; position i accepted with "
             "a * decay^(i-1)"]
    for f, e in zip(fits, class_entries(fits), strict=True):
        se = f"+- {f.mean_se:.3g}" if np.isfinite(f.mean_se) else ""
        lines += ["", "[[workload.classes]]", f"name = {json.dumps(e['name'])}", f"share = {e['share']}",
                  f"acceptance = {e['acceptance']}  # {se} (standard error)".replace("#  (", "# ("),
                  f"acceptance_spread = {e['acceptance_spread']}",
                  f"# speculative.acceptance_decay = {f.decay:.4f}  (this class)"]
        lines += [f"# note: {n}" for n in f.notes]
    if len(fits) > 1:
        lines += ["", f"# speculative.acceptance_decay = {source_decay(fits):.4f}  (all classes, weighted by drafts)"]
    return "\n".join(lines) + "\n"


def _fmt_se(v: float) -> str:
    return f"{v:.3g}" if np.isfinite(v) else ("fixed" if v != v else "unbounded")


def report_lines(label: str, fits: list[AcceptanceFit]) -> list[str]:
    out = []
    for f in fits:
        req = f", {f.num_requests} requests" if f.num_requests is not None else ""
        out.append(f"{label} / class '{f.name}' ({f.kind}, k = {f.k}, {f.num_drafts} drafts{req}):")
        out.append(f"  acceptance {f.mean:.4f} +- {_fmt_se(f.mean_se)}   spread {f.spread:.4f} +- {_fmt_se(f.spread_se)}   "
                   f"decay {f.decay:.4f} +- {_fmt_se(f.decay_se)}   mean acceptance length {f.mean_acceptance_length():.3f}")
        if f.kind == "mean":
            out.append("  fit: one total, no histogram to compare (as many parameters as numbers)")
            out += [f"  WARNING: {n}" for n in f.notes]
            continue
        obs = " ".join(f"{x:.0f}" for x in f.observed)
        exp = " ".join(f"{x:.0f}" for x in f.expected)
        what = "requests by rounded accepted/step" if f.kind == "totals" else "steps by accepted length"
        out.append(f"  fit ({what} 0..{f.k}): observed {obs} | model {exp}")
        chi = (f"chi-square {f.chi2:.2f} on {f.chi2_dof} dof (p = {f.chi2_p:.3g})" if f.chi2_dof > 0 else
               "chi-square: no degrees of freedom")
        out.append(f"  {chi}; largest share difference {f.max_abs_diff:.4f}")
        out += [f"  WARNING: {n}" for n in f.notes]
    return out


# ---------------------------------------------------------------------------- side by side

def default_scenario_path() -> Path:
    return Path(str(resources.files("experiments") / "scenarios" / "default-mix.toml"))


QUICK: dict[str, Any] = {"utilisation": (0.3, 0.6, 0.9), "seeds": (1,),
                         "set": {"workload.duration_s": 120, "workload.warmup_s": 20}}
FULL: dict[str, Any] = {"utilisation": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), "seeds": (1, 2, 3)}


def shift_sweep(base: Any, sources: list[tuple[str, list[AcceptanceFit]]], out: Path, *, quick: bool,
                jobs: int | None) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float], dict[str, Any]]:
    """The scenario swept over utilisation with speculation at each source's fitted acceptance, and
    without (the reference), through the project's sweep machinery. Returns the runs, the
    speedups, each variant's crossover utilisation and the speculative table used."""
    if quick:
        base = base.with_overrides(QUICK["set"])
    spec_tbl = base.speculative.model_dump(mode="json", exclude_none=True) if base.speculative else dict(DEFAULT_SPECULATIVE)
    variants = [Variant("baseline", {"speculative": None})]
    for label, fits in sources:
        variants.append(Variant(f"speculative @ {label}", {
            "speculative": {**spec_tbl, "acceptance_decay": round(source_decay(fits), 4)},
            "workload.classes": class_entries(fits)}))
    grid = QUICK if quick else FULL
    try:
        for v in variants:
            base.with_overrides(v.overrides)
    except ConfigError as err:
        raise ConfigError(f"--scenario: the fitted acceptance does not fit the scenario: {err}") from None
    spec = SweepSpec("acceptance-shift", base, tuple(grid["utilisation"]), tuple(grid["seeds"]), tuple(variants), "baseline")
    df, _ = run_sweep(spec, out / "sweep", jobs=jobs, progress=True)
    ok = df[df.error == ""] if "error" in df else df
    if ok.empty:
        raise ConfigError(f"every run of the shift sweep failed; first error: {df.error.iloc[0]}")
    sp = speedups(ok, "baseline")
    return ok, sp, crossovers(sp), spec_tbl


def _beta_chart(sources: list[tuple[str, list[AcceptanceFit]]]) -> Any:
    import plotly.graph_objects as go
    from scipy import stats

    fig = go.Figure()
    x = np.linspace(0.001, 0.999, 400)
    dash = ("solid", "dash", "dot", "dashdot")
    for i, (label, fits) in enumerate(sources):
        for j, f in enumerate(fits):
            name = f"{label}: {f.name} (mean {f.mean:.3f}, spread {f.spread:.3f})"
            if f.spread > 1e-4:
                a, b = beta_params(f.mean, f.spread)
                fig.add_trace(go.Scatter(x=x, y=stats.beta.pdf(x, a, b), mode="lines", name=name,
                                         line={"dash": dash[j % 4], "color": ("#1f77b4", "#d62728")[i % 2]}))
            else:
                fig.add_trace(go.Scatter(x=[f.mean, f.mean], y=[0, 1], mode="lines", name=name + " (no spread)",
                                         line={"dash": dash[j % 4], "color": ("#1f77b4", "#d62728")[i % 2], "width": 3}))
    fig.update_layout(template="plotly_white", height=420, title="Fitted per-request acceptance distributions",
                      xaxis_title="per-token acceptance a", yaxis_title="density")
    return fig


def write_shift_report(out: Path, sources: list[tuple[str, list[AcceptanceFit]]], shift: pd.DataFrame,
                       sp: pd.DataFrame, scenario_name: str, k: int) -> Path:
    import plotly.io as pio

    figs = [("acceptance", _beta_chart(sources)), ("speedup", speedup_chart(sp))]
    parts = [f'<section id="{n}">' + pio.to_html(f, include_plotlyjs=(i == 0), full_html=False, div_id=f"chart-{n}")
             + "</section>" for i, (n, f) in enumerate(figs)]
    table = shift.to_html(index=False, float_format=lambda v: f"{v:.4g}", classes="shift", border=0)
    fit_lines = "".join(f"<li>{html.escape(s)}</li>" for label, fits in sources for s in report_lines(label, fits))
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>specrack acceptance: {html.escape(' vs '.join(s for s, _ in sources))}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}}
table.shift td,table.shift th{{padding:4px 8px;border-bottom:1px solid #ddd;text-align:right}}</style>
</head><body>
<h1>Acceptance shift: {html.escape(' vs '.join(s for s, _ in sources))}</h1>
<p>Scenario {html.escape(scenario_name)} swept with speculation (k = {k}) at each source's fitted acceptance;
speedup = baseline / speculative TPOT, paired by seed. Crossover: the utilisation where the speedup falls below 1.</p>
<h2>Shift</h2>{table}
<h2>Fits</h2><ul>{fit_lines}</ul>
{''.join(parts)}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc)
    return path


def shift_table(sources: list[tuple[str, list[AcceptanceFit]]], cross: dict[str, float], k: int) -> pd.DataFrame:
    rows = []
    for label, fits in sources:
        shares = _shares(fits)
        for f, sh in zip(fits, shares, strict=True):
            rows.append({"source": label, "class": f.name, "share": sh, "acceptance": f.mean, "acceptance_spread": f.spread,
                         "acceptance_decay": f.decay, f"tokens_per_verification_k{k}": f.mean_acceptance_length(k),
                         "crossover_utilisation": cross.get(f"speculative @ {label}", float("nan"))})
    df = pd.DataFrame(rows)
    if len(sources) == 2:
        a, b = (df[df.source == s] for s, _ in sources)
        col = f"tokens_per_verification_k{k}"
        mix = [float(np.average(g[col], weights=g.share)) for g in (a, b)]
        acc = [float(np.average(g.acceptance, weights=g.share)) for g in (a, b)]
        df = pd.concat([df, pd.DataFrame([{
            "source": f"shift ({sources[1][0]} - {sources[0][0]})", "class": "all", "share": 1.0,
            "acceptance": acc[1] - acc[0],
            "acceptance_spread": float(np.average(b.acceptance_spread, weights=b.share) - np.average(a.acceptance_spread, weights=a.share)),
            "acceptance_decay": float(np.average(b.acceptance_decay, weights=b.share) - np.average(a.acceptance_decay, weights=a.share)),
            col: mix[1] - mix[0],
            "crossover_utilisation": cross.get(f"speculative @ {sources[1][0]}", float("nan"))
            - cross.get(f"speculative @ {sources[0][0]}", float("nan"))}])], ignore_index=True)
    return df


# ---------------------------------------------------------------------------- command

def _label(files: list[str], given: str | None) -> str:
    return given or Path(files[0]).stem


def main_acceptance(a: Any) -> int:
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; name a folder (it is created if missing)")
    if a.min_drafts < 1:
        raise ConfigError(f"--min-drafts must be >= 1, got {a.min_drafts}")
    labels = [_label(a.files, a.label)]
    groups = [a.files]
    if a.against:
        lab = _label(a.against, a.against_label)
        if lab == labels[0]:
            lab = f"{lab} (against)"
        labels.append(lab)
        groups.append(a.against)
    elif a.scenario:
        raise ConfigError("--scenario is for the side-by-side sweep; give the second source with --against FILE...")
    sources: list[tuple[str, list[AcceptanceFit]]] = []
    for label, files in zip(labels, groups, strict=True):
        fits, notes = fit_source(files, name=a.class_name or label, k=a.k, model=a.model, decay=a.decay,
                                 min_drafts=a.min_drafts)
        sources.append((label, fits))
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
    base = None
    if a.against:  # the scenario is checked before anything is written
        base = load_scenario(a.scenario or default_scenario_path(), parse_set(a.set or []))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for (label, fits), files in zip(sources, groups, strict=True):
        for line in report_lines(label, fits):
            print(line)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        path = out / f"{name}.toml"
        path.write_text(fragment_toml(fits, files))
        print(f"  -> {path}")
        rows += [{"source": label, **f.as_dict()} for f in fits]
    pd.DataFrame(rows).to_csv(out / "fit.csv", index=False)
    if base is None:
        print(f"wrote {out / 'fit.csv'}")
        return 0
    if base.speculative is None:
        print(f"note: scenario {base.name} has no [speculative] table; speculating with {DEFAULT_SPECULATIVE}", file=sys.stderr)
    print(f"sweeping {base.name} at both acceptances{' (quick)' if a.quick else ''}...", file=sys.stderr)
    runs, sp, cross, spec_tbl = shift_sweep(base, sources, out, quick=a.quick, jobs=a.jobs)
    runs.to_csv(out / "runs.csv", index=False)
    k = int(spec_tbl.get("num_speculative_tokens", 4))
    shift = shift_table(sources, cross, k)
    shift.to_csv(out / "shift.csv", index=False)
    sp.to_csv(out / "speedups.csv", index=False)
    report = write_shift_report(out, sources, shift, sp, base.name, k)
    for label, _ in sources:
        u = cross.get(f"speculative @ {label}", float("nan"))
        where = f"crosses 1.0 at utilisation {u:.2f}" if np.isfinite(u) else "stays above 1.0 over the sweep"
        print(f"  speculative @ {label}: TPOT speedup {where}")
    print(f"wrote {out / 'fit.csv'}, {out / 'shift.csv'}, {out / 'speedups.csv'}, {out / 'runs.csv'}, {report}")
    return 0
