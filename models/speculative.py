"""Speculative decoding, analytically: acceptance, tokens per verification, improvement factor.

With per-token acceptance a (each drafted token accepted independently with probability a, the
first rejection ending the run) and k drafted tokens, a verification emits the accepted prefix
plus one token from the target (the correction, or the bonus token when all k are accepted):

    E[tokens per verify step] = (1 - a^(k+1)) / (1 - a)                    (Leviathan et al. 2023)
    improvement factor        = E[tokens] / (k c + 1)      c = draft pass / target pass

With per-position decay d (position i accepted with a d^(i-1), for draft heads whose later
positions accept less) the survival probabilities are the running products of a d^(i-1).
"""

from __future__ import annotations

import numpy as np


def expected_tokens(a: np.ndarray | float, k: int, decay: float = 1.0) -> np.ndarray:
    """Mean tokens emitted per verification (accepted + 1), elementwise in a."""
    a = np.asarray(a, dtype=np.float64)
    if k <= 0:
        return np.ones_like(a)
    if decay == 1.0:
        out = np.where(np.isclose(a, 1.0), k + 1.0, (1.0 - a ** (k + 1)) / np.where(np.isclose(a, 1.0), 1.0, 1.0 - a))
        return out
    surv = np.ones_like(a)
    total = np.ones_like(a)
    for i in range(k):
        surv = surv * a * decay**i
        total = total + surv
    return total


def expected_tokens_table(a: np.ndarray, k_max: int, decay: float = 1.0) -> np.ndarray:
    """E[tokens] for each sequence (rows) and each k = 0..k_max (columns)."""
    a = np.asarray(a, dtype=np.float64)
    out = np.ones((a.size, k_max + 1))
    surv = np.ones_like(a)
    for i in range(k_max):
        surv = surv * a * decay**i
        out[:, i + 1] = out[:, i] + surv
    return out


def sample_accepted(rng: np.random.Generator, a: np.ndarray, k: int, decay: float = 1.0) -> np.ndarray:
    """Accepted drafted tokens per sequence, each in [0, k]: a truncated geometric draw.

    Vectorised: k uniforms per sequence, accepted = number of leading positions that pass. (The
    engine draws every request's outcomes before a run instead: `acceptance_draws`.)
    """
    a = np.asarray(a, dtype=np.float64)
    if k <= 0 or a.size == 0:
        return np.zeros(a.size, dtype=np.int64)
    p = a[:, None] * (decay ** np.arange(k))[None, :]
    passed = rng.random((a.size, k)) < p
    return leading_passes(passed).astype(np.int64)


def leading_passes(passed: np.ndarray) -> np.ndarray:
    """Per row of a (rows, K) boolean array, the number of leading True (the index of the first
    False, K when all pass), as uint8: a column at a time (`np.logical_and.accumulate` along a
    short row axis is an order of magnitude slower)."""
    cur = passed[:, 0].copy()
    out = cur.astype(np.uint8)
    for i in range(1, passed.shape[1]):
        cur &= passed[:, i]
        out += cur
    return out


# rows of uniforms drawn at once by `acceptance_draws`: small blocks stay in cache (measured: a
# run's draws for 2,000 requests, ~650,000 rows of 4, 12.2 ms in blocks of 2^18 rows, 8.1 ms in
# blocks of 2^13; the same bytes whatever the block)
DRAW_CHUNK_ROWS = 1 << 13


def acceptance_draws(rng: np.random.Generator, probs: np.ndarray, lengths: np.ndarray,
                     chunk_rows: int = DRAW_CHUNK_ROWS) -> tuple[bytes, np.ndarray]:
    """Every request's verification outcomes, drawn before the run: request r (row r of `probs`,
    its per-depth probabilities P_1..P_K of reaching depth i from depth i - 1) gets `lengths[r]`
    verifications, each K uniforms; the outcome is the number of leading depths that pass
    (u_i < P_i), in [0, K]. A verification of depth k <= K accepts min(outcome, k) drafted tokens:
    exactly the truncated draw `sample_accepted` (or `DraftShape.sample`) makes with k uniforms,
    since P_i does not depend on k. Returns the outcomes as bytes (request r's v-th verification
    at offsets[r] + v) and the offsets (n + 1). Drawn request by request in row order, a block of
    rows at a time (memory stays at `chunk_rows` x K uniforms)."""
    p = np.asarray(probs, dtype=np.float64)
    n, k = p.shape if p.ndim == 2 else (p.size, 0)
    lengths = np.asarray(lengths, dtype=np.int64)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    out = np.zeros(int(off[-1]), dtype=np.uint8)
    if k == 0 or n == 0:
        return out.tobytes(), off
    if k > 255:
        raise ValueError("at most 255 drafted tokens per verification")
    i0 = 0
    while i0 < n:  # requests [i0, i1) hold at most chunk_rows rows (at least one request)
        i1 = max(i0 + 1, int(np.searchsorted(off, off[i0] + chunk_rows, side="right")) - 1)
        i1 = min(i1, n)
        rows = np.repeat(p[i0:i1], lengths[i0:i1], axis=0)
        passed = rng.random(rows.shape) < rows
        out[off[i0]: off[i1]] = leading_passes(passed)
        i0 = i1
    return out.tobytes(), off


def improvement_factor(a: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected walltime improvement of speculative over plain decoding."""
    return float(expected_tokens(a, k)) / (k * c + 1.0)


def beta_params(mean: np.ndarray | float, spread: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """Beta(alpha, beta) with this mean and standard deviation `spread`; a spread too wide for a
    Beta (spread^2 >= m(1-m)) is narrowed to just inside the limit."""
    m = np.asarray(mean, dtype=np.float64)
    var = np.minimum(np.asarray(spread, dtype=np.float64) ** 2, 0.999 * m * (1.0 - m))
    common = m * (1.0 - m) / var - 1.0
    return m * common, (1.0 - m) * common


def acceptance_at_quantile(q: np.ndarray, mean: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per-request acceptance rates: each class's Beta distribution at the request's own quantile
    q ~ U(0,1) (common random numbers: every method maps the same q). Spread 0 gives the mean."""
    m = np.asarray(mean, dtype=np.float64)
    s = np.asarray(spread, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    out = m.copy()
    draw = (s > 0) & (m > 0) & (m < 1)
    if draw.any():
        pairs = np.unique(m[draw] + 1j * s[draw])  # the distinct (mean, spread), as complex numbers
        if len(pairs) <= PPF_MEMO_PAIRS:  # a few classes: each class's values kept (`_class_ppf`)
            for pm, ps in zip(pairs.real.tolist(), pairs.imag.tolist(), strict=True):
                sel = draw & (m == pm) & (s == ps)
                out[sel] = _class_ppf(q[sel], pm, ps)
        else:
            a, b = beta_params(m[draw], s[draw])
            out[draw] = beta_ppf(q[draw], a, b)
    return np.clip(out, 0.0, 0.999)


def beta_ppf(q: np.ndarray, a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """The Beta(a, b) quantile function at q, elementwise: `scipy.special.betaincinv`, the Boost
    `ibeta_inv` that `scipy.stats.beta.ppf` calls, the same values bit for bit (tested), without
    importing scipy.stats (half a second); 0 at q = 0 and 1 at q = 1."""
    from scipy.special import betaincinv  # (heavy: loaded only when a spread is drawn)

    return np.asarray(betaincinv(a, b, q), dtype=np.float64)


PPF_MEMO_PAIRS = 16  # classes (mean, spread) whose quantile values are kept (`_class_ppf`)
PPF_MEMO_STREAMS = 64  # (class, stream of quantiles) entries kept at most
PPF_MEMO_SIZE = 1 << 18  # values kept per entry at most
_PPF_MEMO: dict[tuple[float, float, float], tuple[np.ndarray, np.ndarray]] = {}


def _class_ppf(q: np.ndarray, mean: float, spread: float) -> np.ndarray:
    """One class's Beta quantiles at q, the values of a previous call with the same class reused
    where its quantiles are a prefix of these (or these of its): a sweep's or a plan's runs of
    one seed draw the same quantiles for their requests in the same order (common random
    numbers), at every load and for every strategy of the same acceptance, and inverting the
    Beta function is most of what a run's set-up costs. Each stream of quantiles (its first
    value names it: a seed's) is kept apart, so a sweep's seeds, taken in turn, do not evict
    each other. Elementwise, so the values are those of one call over the whole array."""
    key = (mean, spread, float(q[0]) if q.size else -1.0)
    hit = _PPF_MEMO.get(key)
    known = np.empty(0)  # the values of a prefix of q already computed
    if hit is not None:
        cq, cv = hit
        n = min(cq.size, q.size)
        if np.array_equal(cq[:n], q[:n]):
            if q.size <= cq.size:
                return cv[: q.size].copy()
            known = cv
    a, b = beta_params(mean, spread)
    vals = np.concatenate([known, beta_ppf(q[known.size:], a, b)])
    if q.size <= PPF_MEMO_SIZE:
        if len(_PPF_MEMO) >= PPF_MEMO_STREAMS and key not in _PPF_MEMO:
            _PPF_MEMO.clear()
        _PPF_MEMO[key] = (q.copy(), vals.copy())
    return vals


def sample_acceptance(rng: np.random.Generator, mean: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per-request acceptance rates drawn from each class's Beta distribution."""
    return acceptance_at_quantile(rng.random(np.asarray(mean).size), mean, spread)


# ----------------------------------------------------------------------------- per-depth shapes and trees


class DraftShape:
    """Per-depth acceptance of a speculation method and the shape of what it drafts.

    Depth i (1-based) of a verification has a top-1 candidate accepted with probability
    p_i = a x f_i, where a is the request's acceptance and f_i the method's depth profile
    (f_i = decay^(i-1), or an explicit list). A token tree (Medusa, EAGLE-2/3, SpecInfer) gives
    every node of depth i-1 `branching[i]` children, the top-b candidates of the drafter.
    Under Sequoia's positional-acceptance model (Chen et al. 2024, arXiv 2402.12374) the r-th
    ranked child is accepted, given the higher-ranked ones were rejected, with probability
    p_i x g^(r-1) (g = `rank_decay`), so depth i is reached from depth i-1 with probability

        P_i = 1 - prod_{r=1..b_i} (1 - p_i g^(r-1))            (P_i = p_i for a chain, b_i = 1)

    and a verification emits 1 + sum_{i<=k} prod_{j<=i} P_j tokens (the accepted path plus the
    target's own token). The tree verifies every node: 1 + sum_{i<=k} N_i tokens per sequence,
    N_i = b_1 ... b_i nodes at depth i. A chain (every b_i = 1) is the plain case."""

    def __init__(self, factors: tuple[float, ...], branching: tuple[int, ...] | None = None,
                 rank_decay: float = 1.0) -> None:
        self.factors = np.asarray(factors, dtype=np.float64)
        k_max = self.factors.size
        self.branching = np.ones(k_max, dtype=np.int64) if branching is None else np.asarray(branching, dtype=np.int64)
        if self.branching.size != k_max:
            raise ValueError("branching needs one entry per depth")
        self.rank_decay = float(rank_decay)
        self.chain = bool((self.branching == 1).all())
        self.per_depth = np.cumprod(self.branching)  # N_i, nodes at depth i
        self.cum_nodes = np.concatenate([[0], np.cumsum(self.per_depth)])  # nodes in depths 1..k

    @property
    def k_max(self) -> int:
        return int(self.factors.size)

    def nodes(self, k: int) -> int:
        """Drafted tokens per sequence for depth k (tree nodes; k for a chain)."""
        return int(self.cum_nodes[k])

    def parents(self, k: int) -> np.ndarray:
        """Tokens the drafter runs on at each depth 1..k: the nodes of the depth above (1 at the root)."""
        return np.concatenate([[1], self.per_depth[: max(0, k - 1)]])[:k].astype(np.float64)

    def probs(self, a: np.ndarray, k: int) -> np.ndarray:
        """(sequences, k) probabilities P_i of reaching depth i from depth i - 1."""
        a = np.asarray(a, dtype=np.float64)
        p = np.minimum(a[:, None] * self.factors[None, :k], 1.0)
        if self.chain:
            return p
        out = np.ones_like(p)
        for i in range(k):
            b = int(self.branching[i])
            ranks = self.rank_decay ** np.arange(b)
            out[:, i] = 1.0 - np.prod(1.0 - np.minimum(p[:, i : i + 1] * ranks[None, :], 1.0), axis=1)
        return out

    def expected_tokens_table(self, a: np.ndarray, k_max: int | None = None) -> np.ndarray:
        """E[tokens per verification] for each sequence (rows) and each depth k = 0..k_max."""
        k_max = self.k_max if k_max is None else k_max
        a = np.asarray(a, dtype=np.float64)
        surv = np.cumprod(self.probs(a, k_max), axis=1)
        return np.concatenate([np.ones((a.size, 1)), 1.0 + np.cumsum(surv, axis=1)], axis=1)

    def expected_tokens(self, a: float, k: int | None = None) -> float:
        k = self.k_max if k is None else k
        return float(self.expected_tokens_table(np.array([a]), k)[0, k])

    def sample(self, rng: np.random.Generator, a: np.ndarray, k: int) -> np.ndarray:
        """Accepted depth per sequence, in [0, k]: depth i is reached with probability P_i."""
        a = np.asarray(a, dtype=np.float64)
        if k <= 0 or a.size == 0:
            return np.zeros(a.size, dtype=np.int64)
        passed = rng.random((a.size, k)) < self.probs(a, k)
        return np.where(passed.all(axis=1), k, np.argmin(passed, axis=1)).astype(np.int64)


def depth_factors(k_max: int, decay: float = 1.0, profile: tuple[float, ...] | None = None) -> tuple[float, ...]:
    """Per-depth factors f_1..f_k_max: an explicit profile (relative to depth 1), else decay^(i-1)."""
    if profile is not None:
        return tuple(float(x) for x in profile[:k_max])
    return tuple(float(x) for x in decay ** np.arange(k_max))
