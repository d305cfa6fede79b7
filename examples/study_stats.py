"""The statistics of ``fine_tune_study.py``: paired comparisons over (initialisation, seed) pairs.

Pure Python (no scipy: the example runs without it; ``tests/integrations/test_study_stats.py``
checks every function against scipy and against hand-computed values).

* :func:`paired_t`: the paired t-interval and two-sided p over all pairs (n − 1 degrees of
  freedom), treating every (initialisation, seed) pair as independent (what :func:`crossed_t`
  reduces to when neither factor's mean square exceeds the residual's).
* :func:`crossed_t`: the interval of the mean under the crossed two-way random-effects model
  (initialisation × seed, both random; Satterthwaite degrees of freedom): the verdicts' test,
  since every initialisation is shared by its seeds and every seed's held-out pool by the
  initialisations.
* :func:`sign_test`: the exact two-sided sign test; ties are counted and reported, and dropped
  from the test.
* :func:`holm`: Holm's step-down adjusted p-values over a family of tests.
* :func:`min_detectable`: the smallest true mean difference a two-sided paired t-test at level
  α detects with the given power (the usual (t₁₋α/₂ + t_power)·sd/√n approximation, on n − 1
  degrees of freedom); :func:`min_detectable_se` the same for a standard error and its df.

No bootstrap: at n ≤ 30 pairs a percentile bootstrap of the mean is too narrow (it uses
√((n−1)/n)·sd and the normal quantile), and the t-interval is exact under normality.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, f = 1e-300, 1.0
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 400):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return f


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), 0 ≤ x ≤ 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf2(t: float, df: float) -> float:
    """Two-sided p of Student's t: P(|T| ≥ |t|) with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t with ``df`` degrees of freedom (bisection, 1e-12)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q == 0.5:
        return 0.0
    upper = q > 0.5
    tail = 2.0 * (1.0 - q if upper else q)  # the two-sided p of the quantile's |t|
    lo, hi = 0.0, 1.0
    while t_sf2(hi, df) > tail:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_sf2(mid, df) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    t = 0.5 * (lo + hi)
    return t if upper else -t


def _mean_sd(values: Sequence[float]) -> tuple:
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return mean, sd


def paired_t(diffs: Sequence[float], level: float = 0.95) -> Dict[str, float]:
    """The paired t-interval of the mean difference over all pairs.

    Returns dict(n, mean, sd, low, high, p): the ``level`` interval on n − 1 degrees of freedom
    and the two-sided p of "mean difference = 0". One pair gives nan interval and p; a zero sd
    gives a zero-width interval and p = 0 (mean ≠ 0) or 1 (mean = 0).
    """
    if len(diffs) == 0:
        raise ValueError("diffs must hold at least one difference")
    n = len(diffs)
    mean, sd = _mean_sd(diffs)
    if n < 2:
        return dict(n=n, mean=mean, sd=sd, low=float("nan"), high=float("nan"), p=float("nan"))
    half = t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    if sd == 0.0:
        p = 1.0 if mean == 0.0 else 0.0
    else:
        p = t_sf2(mean / (sd / math.sqrt(n)), n - 1)
    return dict(n=n, mean=mean, sd=sd, low=mean - half, high=mean + half, p=p)


def crossed_t(diffs: Dict[tuple, float], level: float = 0.95) -> Dict[str, float]:
    """The interval of the grand mean under the crossed two-way random-effects model.

    ``diffs`` maps every (initialisation, seed) cell of a complete I × S design to its difference
    d_is = μ + a_i + b_s + e_is, with a_i ~ N(0, σ_a²) (the initialisation: shared by its seeds),
    b_s ~ N(0, σ_b²) (the seed: its held-out pool, and in runs before version 5 its training
    pool and batch order, shared by every initialisation) and e_is ~ N(0, σ_e²). The variance of
    the mean of d is σ_a²/I + σ_b²/S + σ_e²/(IS); the components are the balanced ANOVA (method
    of moments) estimates, which equal REML's (statsmodels ``MixedLM`` with variance components)
    when they are positive. A component whose mean square falls below the residual's is set to
    0 and its sum of squares pooled into the residual (as REML's boundary fit does). The degrees
    of freedom are Satterthwaite's for the mean squares that make up the variance.

    Returns dict(n, mean, se, df, low, high, p, sd_init, sd_seed, sd_cell): the ``level``
    t-interval on ``df`` degrees of freedom and its two-sided p. A zero ``se`` gives a
    zero-width interval and p = 0 (mean ≠ 0) or 1 (mean = 0). One initialisation or one seed
    leaves one factor, whose cells are independent: :func:`paired_t` over them (sd_init and
    sd_seed nan: not separable from the cell's). Raises ValueError unless the cells form a
    complete I × S grid.
    """
    inits = sorted({k[0] for k in diffs})
    seeds = sorted({k[1] for k in diffs})
    n_i, n_s = len(inits), len(seeds)
    if not diffs or len(diffs) != n_i * n_s or any((i, s) not in diffs for i in inits for s in seeds):
        raise ValueError("diffs must map every (initialisation, seed) of a complete grid of cells")
    n = n_i * n_s
    if n_i == 1 or n_s == 1:
        t = paired_t(list(diffs.values()), level)
        se = t["sd"] / math.sqrt(n) if n > 1 else float("nan")
        nan = float("nan")
        return dict(
            n=n,
            mean=t["mean"],
            se=se,
            df=float(n - 1),
            low=t["low"],
            high=t["high"],
            p=t["p"],
            sd_init=nan,
            sd_seed=nan,
            sd_cell=t["sd"],
        )
    grand = math.fsum(diffs.values()) / n
    row = {i: math.fsum(diffs[(i, s)] for s in seeds) / n_s for i in inits}
    col = {s: math.fsum(diffs[(i, s)] for i in inits) / n_i for s in seeds}
    ss = dict(
        init=n_s * math.fsum((row[i] - grand) ** 2 for i in inits),
        seed=n_i * math.fsum((col[s] - grand) ** 2 for s in seeds),
        cell=math.fsum((diffs[(i, s)] - row[i] - col[s] + grand) ** 2 for i in inits for s in seeds),
    )
    df = dict(init=n_i - 1, seed=n_s - 1, cell=(n_i - 1) * (n_s - 1))
    kept = ["init", "seed"]
    while True:  # pool a factor whose mean square is below the residual's (its component estimated as 0)
        resid_ss = ss["cell"] + math.fsum(ss[f] for f in ("init", "seed") if f not in kept)
        resid_df = df["cell"] + sum(df[f] for f in ("init", "seed") if f not in kept)
        ms_resid = resid_ss / resid_df
        low_f = [f for f in kept if ss[f] / df[f] < ms_resid]
        if not low_f:
            break
        kept.remove(min(low_f, key=lambda f: ss[f] / df[f]))
    ms = {f: ss[f] / df[f] for f in kept}
    # n·Var(mean) = Σ_kept MS_f + (1 − #kept)·MS_resid; Satterthwaite over those mean squares
    terms = [(ms[f], df[f]) for f in kept] + [((1 - len(kept)) * ms_resid, resid_df)]
    var_n = math.fsum(t for t, _ in terms)
    se = math.sqrt(max(0.0, var_n) / n)
    denom = math.fsum(t * t / d for t, d in terms)
    dof = var_n * var_n / denom if denom > 0 else float(resid_df)
    sd = dict(
        sd_init=math.sqrt((ms["init"] - ms_resid) / n_s) if "init" in kept else 0.0,
        sd_seed=math.sqrt((ms["seed"] - ms_resid) / n_i) if "seed" in kept else 0.0,
        sd_cell=math.sqrt(ms_resid),
    )
    if se == 0.0:
        return dict(n=n, mean=grand, se=0.0, df=dof, low=grand, high=grand, p=1.0 if grand == 0.0 else 0.0, **sd)
    half = t_ppf(0.5 + level / 2.0, dof) * se
    return dict(n=n, mean=grand, se=se, df=dof, low=grand - half, high=grand + half, p=t_sf2(grand / se, dof), **sd)


def sign_test(diffs: Sequence[float]) -> Dict[str, float]:
    """The exact two-sided sign test of "positive and negative differences equally likely".

    Returns dict(wins, losses, ties, p): ties (difference exactly 0) are counted and dropped
    from the test; p = 1 when every difference is a tie.
    """
    wins = sum(d > 0 for d in diffs)
    losses = sum(d < 0 for d in diffs)
    ties = len(diffs) - wins - losses
    n = wins + losses
    if n == 0:
        return dict(wins=0, losses=0, ties=ties, p=1.0)
    tail = math.fsum(math.comb(n, j) for j in range(min(wins, losses) + 1)) / 2.0**n
    return dict(wins=wins, losses=losses, ties=ties, p=min(1.0, 2.0 * tail))


def holm(pvalues: Sequence[float]) -> List[float]:
    """Holm's step-down adjusted p-values, in the input's order (nan stays nan, outside the family)."""
    index = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    for i in index:
        if not 0.0 <= pvalues[i] <= 1.0:
            raise ValueError(f"pvalues must lie in [0, 1], got {pvalues[i]}")
    m = len(index)
    out = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(index, key=lambda j: pvalues[j])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def min_detectable(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest |mean difference| a two-sided paired t-test at ``alpha`` detects with ``power``.

    (t_{1−α/2, n−1} + t_{power, n−1}) · sd / √n, the usual approximation of the noncentral t
    (a little optimistic at very small n). nan for n < 2.
    """
    if n < 2:
        return float("nan")
    return min_detectable_se(sd / math.sqrt(n), n - 1, alpha, power)


def min_detectable_se(se: float, df: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest |mean| a two-sided t-test at ``alpha`` on ``df`` degrees of freedom detects with ``power``.

    (t_{1−α/2, df} + t_{power, df}) · se: :func:`min_detectable` for an estimate of standard
    error ``se`` (e.g. :func:`crossed_t`'s, with its Satterthwaite df). nan for df ≤ 0 or a nan se.
    """
    if not df > 0 or math.isnan(se):
        return float("nan")
    return (t_ppf(1.0 - alpha / 2.0, df) + t_ppf(power, df)) * se
