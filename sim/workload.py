"""Workloads, generated before the run as a table, from named random streams of one seed.

Streams (numpy SeedSequence.spawn, in this fixed order): arrivals, prompt lengths, output lengths,
traffic classes, acceptance quantiles, engine (acceptance draws), think (closed-loop think times;
last, so that adding it left every other stream's values as they were); multi-turn conversations
use one more, `conversation_stream` (child CONVERSATION_STREAM of the same SeedSequence).

Requests that carry block hashes (a Mooncake trace's `hash_ids`, synthetic conversations) get
two object columns, `unit_keys` and `unit_blocks`: their prefix-cache units (sim/prefix_cache.py). Changing the strategy
never perturbs the arrivals: every strategy at a load point sees the same requests.

A closed loop (`arrival = "closed"`) has no arrival times before the run: its table holds the
requests the clients send, in order (arrival_s NaN, written by the run as they are sent), and
with a think-time distribution a `think_s` column: the wait after the i-th completion.

A request's acceptance rate is stored as a quantile u ~ U(0,1); the engine maps it through the
Beta distribution of its class and method, so variants with different methods still share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from models.errors import ConfigError
from models.memory import BLOCK_SIZE
from sim.frame import Frame, column, object_column
from sim.scenario import (
    MAX_REQUESTS,
    Conversations,
    CsvProfile,
    DiurnalProfile,
    Empirical,
    ExponentialThink,
    Fixed,
    FixedThink,
    LogNormal,
    Workload,
    check_request_count,
)
from sim.traces import empirical_lengths, hash_units, load_rate_csv, load_trace, scale_to_rate, trace_rate_rps

STREAMS = ("arrivals", "prompt", "output", "classes", "acceptance", "engine", "think", "verify")
# multi-turn conversations draw growth and turn gaps from a stream of their own, child 100 of the
# seed's SeedSequence (far past STREAMS, so streams appended there never coincide with it)
CONVERSATION_STREAM = 100
Z90 = 1.2815515655446004  # standard normal 90th percentile
MEAN_QUANTILES = 20_000  # midpoint quantiles that integrate a rounded, clipped lognormal's mean


def conversation_stream(seed: int) -> np.random.Generator:
    """The conversations' generator (growth tokens, turn gaps), independent of every named stream."""
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(CONVERSATION_STREAM,)))


def streams(seed: int) -> dict[str, np.random.Generator]:
    """One independent generator per named stream, all from one seed (a non-negative integer)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer (0, 1, 2, ...), got {seed!r}")
    children = np.random.SeedSequence(int(seed)).spawn(len(STREAMS))
    return {name: np.random.default_rng(s) for name, s in zip(STREAMS, children, strict=True)}


@dataclass(frozen=True)
class LengthSampler:
    """A length distribution that knows the mean of what it samples."""

    dist: Fixed | LogNormal | Empirical
    column: str = "prompt_tokens"  # the trace column an empirical distribution samples

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        d = self.dist
        if isinstance(d, Fixed):
            return np.full(n, d.value, dtype=np.int64)
        if isinstance(d, LogNormal):
            sigma = np.log(d.p90 / d.median) / Z90
            x = rng.lognormal(np.log(d.median), sigma, n)
            return np.clip(np.rint(x), 1, d.max).astype(np.int64)
        values = empirical_lengths(d.trace, self.column, d.format)
        return rng.choice(values, size=n, replace=True).astype(np.int64)

    def mean(self) -> float:
        d = self.dist
        if isinstance(d, Fixed):
            return float(d.value)
        if isinstance(d, LogNormal):  # of the lengths as sampled, rounded and clipped to [1, max]
            from scipy.special import ndtri  # (heavy: loaded only when a mean is asked for)
            sigma = np.log(d.p90 / d.median) / Z90
            q = (np.arange(MEAN_QUANTILES) + 0.5) / MEAN_QUANTILES
            return float(np.clip(np.rint(d.median * np.exp(sigma * ndtri(q))), 1, d.max).mean())
        return float(np.mean(empirical_lengths(d.trace, self.column, d.format)))


def _renewal(draw, duration_s: float | None, n: int | None, rate: float) -> np.ndarray:
    """Arrival times from i.i.d. inter-arrival gaps `draw(size)`: n of them, or all in [0, duration)."""
    if n is not None:
        return np.cumsum(draw(n))
    assert duration_s is not None
    out: list[np.ndarray] = []
    t = 0.0
    chunk = max(16, int(rate * duration_s * 1.1) + 16)
    while t < duration_s:
        a = t + np.cumsum(draw(chunk))
        out.append(a)
        t = a[-1]
    arr = np.concatenate(out)
    return arr[arr < duration_s]


def poisson_arrivals(rng: np.random.Generator, rate: float, duration_s: float | None, n: int | None) -> np.ndarray:
    """Arrival times of a Poisson process over [0, duration) or for n requests."""
    return _renewal(lambda size: rng.exponential(1.0 / rate, size), duration_s, n, rate)


def gamma_arrivals(rng: np.random.Generator, rate: float, cv: float, duration_s: float | None, n: int | None) -> np.ndarray:
    """Renewal process with gamma inter-arrivals of mean 1/rate and coefficient of variation cv
    (cv > 1: bursts; cv = 1: Poisson)."""
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    return _renewal(lambda size: rng.gamma(shape, scale, size), duration_s, n, rate)


def _steps(profile: CsvProfile) -> tuple[np.ndarray, np.ndarray]:
    starts, rates = load_rate_csv(profile.file)
    return starts, rates * profile.scale


def profile_rate(profile: DiurnalProfile | CsvProfile, t: np.ndarray | float) -> np.ndarray:
    """The rate lambda(t) (requests/s) of a rate profile at times t (s from the start of the run)."""
    t = np.asarray(t, dtype=np.float64)
    if isinstance(profile, DiurnalProfile):
        phase = 2.0 * np.pi * (t / profile.day_s - profile.peak_hour / 24.0)
        return profile.trough_rps + (profile.peak_rps - profile.trough_rps) * 0.5 * (1.0 + np.cos(phase))
    starts, rates = _steps(profile)
    return rates[np.searchsorted(starts, t, side="right") - 1]


def profile_integral(profile: DiurnalProfile | CsvProfile, a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """Lambda(b) - Lambda(a): the expected number of arrivals in [a, b), in closed form (the
    cosine's antiderivative; the sum of whole and partial intervals of a step profile)."""
    return _cumulative(profile, np.asarray(b, dtype=np.float64)) - _cumulative(profile, np.asarray(a, dtype=np.float64))


def _cumulative(profile: DiurnalProfile | CsvProfile, t: np.ndarray) -> np.ndarray:
    if isinstance(profile, DiurnalProfile):
        amp = profile.peak_rps - profile.trough_rps
        w = 2.0 * np.pi / profile.day_s
        phi = 2.0 * np.pi * profile.peak_hour / 24.0
        return profile.trough_rps * t + 0.5 * amp * (t + (np.sin(w * t - phi) + np.sin(phi)) / w)
    starts, rates = _steps(profile)
    ends = np.append(starts[1:], np.inf)
    widths = np.clip(t[..., None] - starts, 0.0, ends - starts)
    return (widths * rates).sum(axis=-1)


def profile_peak_rps(profile: DiurnalProfile | CsvProfile, duration_s: float) -> float:
    """The highest rate the profile reaches over [0, duration_s)."""
    if isinstance(profile, DiurnalProfile):
        return profile.peak_rps if duration_s >= profile.day_s else float(
            profile_rate(profile, np.linspace(0.0, duration_s, 4097)).max())
    starts, rates = _steps(profile)
    return float(rates[starts < duration_s].max())


def profile_arrivals(rng: np.random.Generator, profile: DiurnalProfile | CsvProfile, duration_s: float) -> np.ndarray:
    """Arrival times of a non-homogeneous Poisson process of rate lambda(t) over [0, duration) by
    thinning (Lewis and Shedler 1979, exact): a homogeneous stream at lambda_max, each candidate
    kept with probability lambda(t) / lambda_max."""
    top = profile_peak_rps(profile, duration_s)
    if top <= 0:
        raise ConfigError("workload.rate_profile: the rate is 0 over the whole run; no request arrives")
    try:
        check_request_count(top, duration_s, "workload.rate_profile (its peak rate)")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cand = poisson_arrivals(rng, top, duration_s, None)
    keep = rng.random(cand.size) * top < profile_rate(profile, cand)
    return cand[keep]


def think_times(think: FixedThink | ExponentialThink, rng: np.random.Generator, n: int) -> np.ndarray:
    """n think times (seconds) from their distribution."""
    if isinstance(think, FixedThink):
        return np.full(n, think.value, dtype=np.float64)
    return rng.exponential(think.mean, n)


def think_mean(think: FixedThink | ExponentialThink | None) -> float:
    """The mean think time (0 without one)."""
    if think is None:
        return 0.0
    return think.value if isinstance(think, FixedThink) else think.mean


RAMP_SHARE = 0.95  # a conversation workload has ramped up once its rate reaches 95% of the steady rate


def conversation_ramp_s(conv: Conversations) -> float:
    """When the expected arrival rate of conversations reaches RAMP_SHARE of its steady value.

    Conversations start at a constant rate from t = 0 and turn k + 1 is sent k turn gaps after
    turn 1, so the rate at t is (rate / turns) x sum over k < turns of P(S_k <= t), S_k the sum of
    k gaps: it ramps from rate / turns up to rate over a few gaps x turns. A verdict judged over
    that ramp sees requests in system grow at any load (`sim.metrics.stability` is judged after
    it). Exponential gaps: S_k is Erlang, P(S_k <= t) = P(Poisson(t / mean) >= k); fixed gaps:
    P = 1 once t >= k x value."""
    turns = conv.turns
    need = RAMP_SHARE * turns  # sum over k of P(S_k <= t) to reach
    gap = conv.turn_gap_s
    if turns == 1:
        return 0.0
    if isinstance(gap, FixedThink):
        return float(math.ceil(need - 1.0 - 1e-12) * gap.value)
    ks = np.arange(turns, dtype=np.float64)
    lg = np.array([math.lgamma(k + 1.0) for k in range(turns)])

    def reached(t: float) -> float:
        if t <= 0.0:
            return 1.0
        x = t / gap.mean
        pmf = np.exp(-x + ks * math.log(x) - lg)
        below = np.concatenate(([0.0], np.cumsum(pmf)[:-1]))  # P(Poisson(x) <= k - 1)
        return float(np.clip(1.0 - below, 0.0, 1.0).sum())

    lo, hi = 0.0, gap.mean * (turns + 10.0 * math.sqrt(turns) + 10.0)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if reached(mid) < need else (lo, mid)
    return hi


def conversations(conv: Conversations, wl: Workload, rs: dict[str, np.random.Generator], rate_rps: float,
                  rc: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Multi-turn conversations, open loop: (arrival, prompt, output, conversation, turn) per request,
    sorted by arrival. Conversations start at rate_rps / turns (the workload's arrival process);
    turn 1's prompt and every output come from the workload's length distributions; turn t + 1
    is sent a `turn_gap_s` after turn t, its prompt turn t's prompt + output + growth_tokens. With
    num_requests n: ceil(n / turns) conversations, and their first n turns by arrival."""
    t = conv.turns
    rate_c = rate_rps / t
    n_c = None if wl.num_requests is None else -(-wl.num_requests // t)
    if wl.arrival == "poisson":
        start = poisson_arrivals(rs["arrivals"], rate_c, wl.duration_s if n_c is None else None, n_c)
    else:
        start = gamma_arrivals(rs["arrivals"], rate_c, wl.cv, wl.duration_s if n_c is None else None, n_c)
    m = start.size
    first = LengthSampler(wl.prompt_tokens, "prompt_tokens").sample(rs["prompt"], m)
    output = LengthSampler(wl.output_tokens, "output_tokens").sample(rs["output"], m * t).reshape(m, t)
    # growth and gaps from two children of the stream, row by row: conversation i's draws do not
    # depend on how many conversations there are (a longer run starts with the same ones)
    rc_growth, rc_gap = rc.spawn(2)
    growth = LengthSampler(conv.growth_tokens, "prompt_tokens").sample(rc_growth, m * (t - 1)).reshape(m, t - 1)
    gaps = think_times(conv.turn_gap_s, rc_gap, m * (t - 1)).reshape(m, t - 1)
    prompt = np.empty((m, t), dtype=np.int64)
    arrival = np.empty((m, t), dtype=np.float64)
    prompt[:, 0], arrival[:, 0] = first, start
    for j in range(1, t):
        prompt[:, j] = prompt[:, j - 1] + output[:, j - 1] + growth[:, j - 1]
        arrival[:, j] = arrival[:, j - 1] + gaps[:, j - 1]
    conv_id = np.repeat(np.arange(m, dtype=np.int64), t)
    turn = np.tile(np.arange(1, t + 1, dtype=np.int64), m)
    order = np.argsort(arrival.ravel(), kind="stable")
    a, p, o = arrival.ravel()[order], prompt.ravel()[order], output.ravel()[order]
    c, tn = conv_id[order], turn[order]
    keep = slice(0, wl.num_requests) if wl.num_requests is not None else a < wl.duration_s
    return a[keep], p[keep], o[keep], c[keep], tn[keep]


def conversation_units(prompt: np.ndarray, output: np.ndarray, conv: np.ndarray,
                       ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prefix-cache units of conversation turns: one per full KV block of the turn's token stream
    (prompt and output). A conversation is one growing stream, so block j of every turn of
    conversation c is the same content: key = c's first key + j (conversations never share keys)."""
    blocks = (prompt + output) // BLOCK_SIZE
    span = np.zeros(int(conv.max()) + 1 if conv.size else 0, dtype=np.int64)
    np.maximum.at(span, conv, blocks)
    base = np.concatenate([[0], np.cumsum(span)])[:-1]
    keys = [np.arange(base[c], base[c] + b, dtype=np.int64) for c, b in zip(conv.tolist(), blocks.tolist(), strict=True)]
    return keys, [np.ones(k.size, dtype=np.int64) for k in keys]


def generate(wl: Workload, seed: int, rate_rps: float | None, *, pool: int | None = None) -> Frame:
    """The request table: id, arrival_s, prompt_tokens, output_tokens, cls, accept_q (and think_s
    for a closed loop with think times).

    `rate_rps` is the offered rate (None keeps a trace's own timing; ignored by a closed loop).
    A closed loop holds `num_requests` requests, or `pool` when sized by duration_s (the run
    sends from it until duration_s); with a trace, its requests' lengths in order, at most that many.
    A Frame (`sim.frame`; `.to_pandas()` for a DataFrame). `table.attrs["runs_out"]`: whether
    the arrivals end with the table's (num_requests, or a trace that ends before duration_s)
    rather than at duration_s."""
    rs = streams(seed)
    n = wl.num_requests
    units: tuple[list[np.ndarray], list[np.ndarray]] | None = None
    conv_id = turn = trace_line = None
    runs_out = n is not None
    if wl.closed:
        n = n if n is not None else pool
        if n is None or n < 1:
            raise ConfigError("workload: a closed loop sized by duration_s needs a pool of requests to send (pool >= 1)")
        if n > MAX_REQUESTS:
            raise ConfigError(f"workload: a closed loop of {n:,} requests; one run holds at most {MAX_REQUESTS:,} "
                              "(lower num_requests or duration_s)")
    if wl.replays_trace:
        assert wl.trace is not None
        full = load_trace(wl.trace, wl.trace_format)
        df = scale_to_rate(full, rate_rps) if rate_rps is not None else full
        if wl.trace_start_s is not None or wl.trace_end_s is not None:  # a window of the trace's own clock
            lo = wl.trace_start_s or 0.0
            hi = wl.trace_end_s if wl.trace_end_s is not None else np.inf
            keep = ((full.arrival_s >= lo) & (full.arrival_s < hi)).to_numpy()
            factor = trace_rate_rps(full) / rate_rps if rate_rps is not None else 1.0
            df = df[keep].reset_index(drop=True)
            df["arrival_s"] = df.arrival_s - lo * factor
        if n is not None:
            df = df.iloc[:n]
        else:
            within = df.arrival_s < wl.duration_s
            runs_out = bool(within.all())
            df = df[within]
        arrival = column(df, "arrival_s", np.float64) if not wl.closed else np.full(len(df), np.nan)
        prompt = column(df, "prompt_tokens", np.int64)
        output = column(df, "output_tokens", np.int64)
        trace_line = column(df, "line", np.int64)
        if "hash_ids" in df.columns and (df.hash_ids.str.len() > 0).any():  # Mooncake's prefix-block hashes
            units = hash_units(df.hash_ids.to_list(), prompt, BLOCK_SIZE)
    elif wl.conversations is not None:
        assert rate_rps is not None
        arrival, prompt, output, conv_id, turn = conversations(wl.conversations, wl, rs, rate_rps,
                                                               conversation_stream(seed))
        units = conversation_units(prompt, output, conv_id)
    else:
        if wl.closed:
            assert n is not None
            arrival = np.full(n, np.nan)  # sent by the clients during the run
        elif wl.rate_profile is not None:
            arrival = profile_arrivals(rs["arrivals"], wl.rate_profile, wl.duration_s)
        elif rate_rps is None or not np.isfinite(rate_rps) or rate_rps <= 0:
            raise ConfigError(f"workload: offered rate must be a positive number of requests/s, got {rate_rps}")
        else:
            if n is None:
                try:
                    check_request_count(rate_rps, wl.duration_s, "workload: offered rate")
                except ValueError as err:
                    raise ConfigError(str(err)) from None
            if wl.arrival == "poisson":
                arrival = poisson_arrivals(rs["arrivals"], rate_rps, wl.duration_s, n)
            else:
                arrival = gamma_arrivals(rs["arrivals"], rate_rps, wl.cv, wl.duration_s, n)
        m = arrival.size
        prompt = LengthSampler(wl.prompt_tokens, "prompt_tokens").sample(rs["prompt"], m)
        output = LengthSampler(wl.output_tokens, "output_tokens").sample(rs["output"], m)
    m = arrival.size
    if m == 0:
        raise ConfigError("workload: no request arrives within duration_s; raise duration_s or the rate")
    shares = np.array([c.share for c in wl.classes])
    cls = rs["classes"].choice(len(shares), size=m, p=shares / shares.sum()) if len(shares) > 1 else np.zeros(m, np.int64)
    accept_q = rs["acceptance"].random(m)
    table = Frame({
        "id": np.arange(m, dtype=np.int64),
        "arrival_s": arrival,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cls": cls.astype(np.int64),
        "accept_q": accept_q,
    })
    if wl.closed and wl.think_time_s is not None:
        table["think_s"] = think_times(wl.think_time_s, rs["think"], m)
    if trace_line is not None:  # each request's line in the trace file, to name rows in messages
        table["trace_line"] = trace_line
    if conv_id is not None and turn is not None:
        table["conversation"] = conv_id
        table["turn"] = turn
    if units is not None:
        table["unit_keys"] = object_column(units[0])
        table["unit_blocks"] = object_column(units[1])
    table.attrs["runs_out"] = runs_out
    return table
