"""Speculation policies: how many tokens to draft (k) at a step, one function per policy, called
by every path that takes a step (the ordinary step, fused runs, the rack planner).

- fixed: always `num_speculative_tokens`;
- follow_load: k while the fleet's load controller has speculation on (`sim.fleet.FollowLoad`), else 0;
- disable_above_batch: 0 once more than `disable_batch_size` sequences run (vLLM's
  `speculative_disable_by_batch_size`), else k;
- adaptive: the k = 0..k_max maximising expected emitted tokens per second of step time, each
  sequence's acceptance estimated from its own drafts accepted and proposed (prior 0.7, weight 4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import numpy as np

from models.speculative import expected_tokens_table
from sim.pricing import StepPricer, needs_general
from sim.tables import add_reduce

if TYPE_CHECKING:
    from sim.deployment import SpecRuntime
    from sim.state import ReplicaState

ADAPTIVE_SCALAR_SEQS: Final = 40  # the adaptive policy weighs a larger batch's acceptance estimates with numpy

# whether this module runs compiled (mypyc: a shared object, not this source): over a large batch the
# adaptive policy's sums then run in compiled scalars, where the interpreter hands them to numpy (the
# same figures bit for bit either way: tests/test_speculative_math.py)
COMPILED = not __file__.endswith(".py")


def expected_sums(n: int, acc: list[int], prop: list[int], dp: list[float]) -> list[float]:
    """The adaptive policy's expected tokens of a step at each k = 0..k_max, summed over the
    decoding sequences: n + the sum over them of their first k survival products, each
    sequence's acceptance estimated as (accepted + 2.8) / (proposed + 4), sequence by sequence
    (each sequence's running sum of survival products added to each depth's total). Up to 6
    depths the totals are local variables, written out depth by depth (compiled: C doubles, not
    a list's boxed floats; 2.6-4.3x faster at 40 sequences), with the same operations in the
    same order as the loop beyond."""
    nf = float(n)
    k_max = len(dp)
    if not k_max:
        return [nf]
    if k_max <= 6:
        d = dp + [0.0] * (6 - k_max)
        d0, d1, d2, d3, d4, d5 = d[0], d[1], d[2], d[3], d[4], d[5]
        e1 = e2 = e3 = e4 = e5 = e6 = nf
        for j in range(len(acc)):
            a = (acc[j] + 2.8) / (prop[j] + 4.0)
            s = a * d0
            t = s
            e1 += t
            if k_max == 1:
                continue
            s *= a * d1
            t += s
            e2 += t
            if k_max == 2:
                continue
            s *= a * d2
            t += s
            e3 += t
            if k_max == 3:
                continue
            s *= a * d3
            t += s
            e4 += t
            if k_max == 4:
                continue
            s *= a * d4
            t += s
            e5 += t
            if k_max == 5:
                continue
            s *= a * d5
            t += s
            e6 += t
        return [nf, e1, e2, e3, e4, e5, e6][:k_max + 1]
    e = [nf] * (k_max + 1)
    for j in range(len(acc)):
        a = (acc[j] + 2.8) / (prop[j] + 4.0)
        s = a * dp[0]
        t = s
        e[1] = e[1] + t  # (a list item's `+=` compiles to generic object arithmetic)
        for i in range(1, k_max):
            s *= a * dp[i]
            t += s
            e[i + 1] = e[i + 1] + t
    return e


def expected_sums_by_depth(n: int, acc: list[int], prop: list[int], dp: list[float]) -> list[float]:
    """The same expected tokens summed as numpy sums a large batch's (`adaptive_choice`,
    k_max >= 2): each depth's survival products over the sequences in order (numpy's sum over
    the rows of a (sequences x depths) array adds row by row), cumulated over the depths, plus n;
    bit for bit numpy's figures, in scalars (what the compiled build runs). Up to 6 depths the
    sums are local variables (compiled: C doubles, not a list's boxed floats; a sum starts at 0.0,
    and 0.0 + s is s: the survival products are positive)."""
    k_max = len(dp)
    if 0 < k_max <= 6:
        d = dp + [0.0] * (6 - k_max)
        d0, d1, d2, d3, d4, d5 = d[0], d[1], d[2], d[3], d[4], d[5]
        s0 = s1 = s2 = s3 = s4 = s5 = 0.0
        for j in range(len(acc)):
            a = (acc[j] + 2.8) / (prop[j] + 4.0)
            s = a * d0
            s0 += s
            if k_max == 1:
                continue
            s = s * (a * d1)
            s1 += s
            if k_max == 2:
                continue
            s = s * (a * d2)
            s2 += s
            if k_max == 3:
                continue
            s = s * (a * d3)
            s3 += s
            if k_max == 4:
                continue
            s = s * (a * d4)
            s4 += s
            if k_max == 5:
                continue
            s = s * (a * d5)
            s5 += s
        S = [s0, s1, s2, s3, s4, s5][:k_max]
    else:
        S = _depth_sums(acc, prop, dp)
    out = [float(n)]
    c = 0.0
    for i in range(k_max):
        c = S[i] if i == 0 else c + S[i]
        out.append(n + c)
    return out


def _depth_sums(acc: list[int], prop: list[int], dp: list[float]) -> list[float]:
    """`expected_sums_by_depth`'s sums over the sequences, depth by depth, for any depth."""
    k_max = len(dp)
    S = [0.0] * k_max
    for j in range(len(acc)):
        a = (acc[j] + 2.8) / (prop[j] + 4.0)
        s = a * dp[0]
        S[0] = s if j == 0 else S[0] + s
        for i in range(1, k_max):
            s = s * (a * dp[i])
            S[i] = s if j == 0 else S[i] + s
    return S


ADAPTIVE: Final = -1  # `policy_k`'s answer for the adaptive policy: k is weighed from acceptance estimates


def fixed(spec: SpecRuntime, n_running: int, speculating: bool) -> int:
    """Always k (`num_speculative_tokens`)."""
    return spec.k


def follow_load(spec: SpecRuntime, n_running: int, speculating: bool) -> int:
    """k while the fleet's load controller has speculation on, else 0."""
    return spec.k if speculating else 0


def disable_above_batch(spec: SpecRuntime, n_running: int, speculating: bool) -> int:
    """0 once more than `disable_batch_size` sequences run, else k."""
    return 0 if n_running > spec.disable_batch_size else spec.k


def policy_k(spec: SpecRuntime, n_running: int, speculating: bool) -> int:
    """The step's k under a policy that does not weigh acceptance (`fixed`, `follow_load`,
    `disable_above_batch`), from the sequences running and whether speculation is on; ADAPTIVE
    under the adaptive policy (`adaptive_k`, `adaptive_pick`). Every path that takes a step asks it."""
    policy = spec.policy
    if policy == "fixed":
        return fixed(spec, n_running, speculating)
    if policy == "follow_load":
        return follow_load(spec, n_running, speculating)
    if policy == "disable_above_batch":
        return disable_above_batch(spec, n_running, speculating)
    return ADAPTIVE


def choose_k(rep: ReplicaState, dec: np.ndarray) -> int:
    """The ordinary step's k: the policy's (`policy_k`), or the adaptive one's over the decoding
    sequences `dec` (`adaptive_k`); 0 without speculation."""
    spec = rep.rt.spec
    if spec is None:
        return 0
    k = policy_k(spec, rep.n_running, rep.price.speculating)
    return k if k != ADAPTIVE else adaptive_k(rep, dec)


def adaptive_k(rep: ReplicaState, dec: np.ndarray) -> int:
    """The adaptive policy's k for the decoding sequences `dec` (booleans over the running ones):
    maximise expected emitted tokens per second of step time, k = 0..k_max, each request's
    acceptance estimated from what it has had accepted (prior 0.7, weight 4). In scalars for the
    plain chain when steps are priced in scalars (`adaptive_pick`), else over arrays."""
    spec = rep.rt.spec
    assert spec is not None
    if not dec.any():
        return 0
    n = rep.n_running
    if rep.scalar_steps and spec.shape is None:
        return adaptive_pick(rep.price, rep.n_acc[:n][dec].tolist(), rep.n_prop[:n][dec].tolist(),
                             float(add_reduce(rep.computed[:n][dec])))
    est = (rep.n_acc[:n][dec] + 0.7 * 4.0) / (rep.n_prop[:n][dec] + 4.0)
    if needs_general(spec):
        return choose_k_general(rep, dec, est)
    ctx = float(add_reduce(rep.computed[:n][dec]))
    return int(adaptive_k_many(rep.price, est[None, :], np.array([ctx]), int(add_reduce(dec)))[0])


def adaptive_pick(price: StepPricer, acc: list[int], prop: list[int], ctx: float) -> int:
    """The adaptive policy's k for one step of the plain chain (`adaptive_choice`)."""
    return adaptive_choice(price, acc, prop, ctx)[0]


def adaptive_choice(price: StepPricer, acc: list[int], prop: list[int], ctx: float
                     ) -> tuple[int, tuple[float, float, float, float, float, float]]:
    """The adaptive policy's k for one step of the plain chain, in scalars, and that step's
    `StepPricer.spec_step` figures: each decoding sequence's acceptance estimated from its drafts
    accepted and proposed so far (prior 0.7, weight 4), the expected tokens of each k =
    0..k_max summed over them, each k priced as the step itself would be (`StepPricer.spec_step`), and
    the smallest k within rounding of the best rate. The unfused step and the fused planner
    both choose with it (one code path: the same k)."""
    spec = price.rt.spec
    assert spec is not None
    k_max = spec.k
    n = len(acc)
    dp = price.decay_pows
    if n > ADAPTIVE_SCALAR_SEQS and COMPILED and k_max >= 2:  # (numpy's figures, in compiled scalars)
        exp = expected_sums_by_depth(n, acc, prop, dp)
    elif n > ADAPTIVE_SCALAR_SEQS:  # (numpy over a large batch: the same choice wherever it is made)
        a_arr = (np.array(acc, dtype=np.float64) + 2.8) / (np.array(prop, dtype=np.float64) + 4.0)
        surv_arr = np.cumprod(a_arr[:, None] * np.array(dp)[None, :], axis=1)
        exp = [float(n), *(n + np.cumsum(surv_arr.sum(axis=0))).tolist()]
    else:
        exp = expected_sums(n, acc, prop, dp)
    costs = [price.spec_step(n, ctx, k) for k in range(k_max + 1)]
    rates = [exp[k] / costs[k][0] for k in range(k_max + 1)]
    top = max(rates) * (1.0 - 1e-9)
    for k, r in enumerate(rates):
        if r >= top:
            return k, costs[k]
    return 0, costs[0]


def adaptive_k_many(price: StepPricer, est: np.ndarray, ctx: np.ndarray, n_dec: int) -> np.ndarray:
    """The adaptive policy's k for each of m steps (rows): the decoding sequences' acceptance
    estimates `est` (m, n_dec) and their context sums `ctx` (m,). One row is one step's
    choice (`choose_k`); a fused run evaluates every step of the run in one call."""
    spec = price.rt.spec
    assert spec is not None
    m = est.shape[0]
    exp_tokens = expected_tokens_table(est.ravel(), spec.k, spec.decay).reshape(m, -1, spec.k + 1).sum(axis=1)
    c = ctx[:, None]
    # every k = 0..k_max priced in one vectorised call per model (the same formulas as a step)
    k = np.arange(spec.k + 1, dtype=np.float64)
    q = k + 1.0
    if spec.batch_expansion:  # k + 1 one-token sequences per decoding sequence (`StepPricer.spec_cost`)
        target = price.rt.cost.total_s_many(n_dec * q, n_dec * q, c * q + n_dec * q * (q - 1) / 2.0,  # type: ignore[arg-type]
                                            c * q + n_dec * q * (q + 1) / 2.0)
    else:
        target = price.rt.cost.total_s_many(n_dec, n_dec * q, c + 0.0 * k, c * q + n_dec * q * (q + 1) / 2.0)
    # machinery: a fraction of the plain decode pass, and the host work (`StepPricer.host_s`)
    total = target + target[:, :1] * price.overhead_frac(n_dec) + price.host_s(n_dec, k)
    if spec.draft_cost is not None:
        mean_ctx = c + n_dec * (k - 1) / 2.0
        one = spec.draft_cost.total_s_many(n_dec, np.full_like(k, n_dec), mean_ctx, mean_ctx + n_dec,
                                           step_overhead=False)
        total = total + k * one
    rate = exp_tokens / total
    # the smallest k within rounding of the best
    return np.argmax(rate >= rate.max(axis=1, keepdims=True) * (1.0 - 1e-9), axis=1)


def choose_k_general(rep: ReplicaState, dec: np.ndarray, est: np.ndarray) -> int:
    """The adaptive policy for the general methods: each k = 0..k_max priced by `StepPricer.spec_cost`
    itself (the step's own formulas), expected tokens from the method's closed form."""
    spec = rep.rt.spec
    assert spec is not None
    n = rep.n_running
    ds = dec.nonzero()[0]
    table = (spec.shape.expected_tokens_table(est, spec.k) if spec.shape is not None
             else expected_tokens_table(est, spec.k, spec.decay))
    m = rep.reqs.match[rep.rid[:n][dec]] if spec.on_match else None
    exp_tokens = (table.sum(axis=0) if m is None else add_reduce(dec) + (m[:, None] * (table - 1.0)).sum(axis=0))
    n_dec = int(ds.size)
    ctx_dec = float(add_reduce(rep.computed[ds]))
    rate = np.zeros(spec.k + 1)
    for k in range(spec.k + 1):
        plan = rep.price.verify_plan(rep.computed[ds], k, None if m is None else m) if k else None
        rate[k] = exp_tokens[k] / rep.price.spec_cost(n_dec, ctx_dec, k, 0, 0.0, 0.0, 0.0, plan)[0]
    return int(np.argmax(rate >= rate.max() * (1.0 - 1e-9)))
