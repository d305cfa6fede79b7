"""The statistics of ``fine_tune_study.py``: paired comparisons over (initialisation, seed) pairs.

Pure Python (no scipy: the example runs without it; ``tests/integrations/test_study_stats.py``
checks every function against scipy and against hand-computed values).

* :func:`paired_t`: the paired t-interval and two-sided p over all pairs (n − 1 degrees of
  freedom), treating every (initialisation, seed) pair as independent.
* :func:`cluster_t`: the same over the initialisations' mean differences (k − 1 degrees of
  freedom). With the same number of seeds per initialisation this is the interval of the
  one-way random-effects model (initialisation random): the variance of the grand mean is
  MS_between / (k·m) = var(cluster means) / k, so it carries the initialisations' variance.
* :func:`sign_test`: the exact two-sided sign test; ties are counted and reported, and dropped
  from the test.
* :func:`holm`: Holm's step-down adjusted p-values over a family of tests.
* :func:`min_detectable`: the smallest true mean difference a two-sided paired t-test at level
  α detects with the given power (the usual (t₁₋α/₂ + t_power)·sd/√n approximation, on n − 1
  degrees of freedom).

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


def cluster_t(diffs_by_cluster: Dict[object, Sequence[float]], level: float = 0.95) -> Dict[str, float]:
    """The t-interval over the clusters' (initialisations') mean differences, k − 1 degrees of freedom.

    Returns :func:`paired_t` of the cluster means (n is then k, the number of clusters) plus
    ``sd_between`` and ``sd_within``, the one-way random-effects variance components' square
    roots (method of moments, between clipped at 0; nan where undefined).
    """
    if not diffs_by_cluster or any(len(v) == 0 for v in diffs_by_cluster.values()):
        raise ValueError("diffs_by_cluster must map each cluster to at least one difference")
    means = [math.fsum(v) / len(v) for v in diffs_by_cluster.values()]
    out = paired_t(means, level)
    sizes = [len(v) for v in diffs_by_cluster.values()]
    k, total = len(sizes), sum(sizes)
    if k > 1 and total > k and len(set(sizes)) == 1:
        m = sizes[0]
        grand = math.fsum(means) / k
        ms_between = m * math.fsum((x - grand) ** 2 for x in means) / (k - 1)
        ms_within = math.fsum((d - mu) ** 2 for v, mu in zip(diffs_by_cluster.values(), means) for d in v) / (total - k)
        out.update(sd_between=math.sqrt(max(0.0, (ms_between - ms_within) / m)), sd_within=math.sqrt(ms_within))
    else:
        out.update(sd_between=float("nan"), sd_within=float("nan"))
    return out


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
    return (t_ppf(1.0 - alpha / 2.0, n - 1) + t_ppf(power, n - 1)) * sd / math.sqrt(n)
