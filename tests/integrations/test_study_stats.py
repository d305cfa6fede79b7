"""examples/study_stats.py on known data: hand-computed values, and scipy where it is installed
(the test extra installs it)."""

import math

import pytest
import study_stats as st

NAN = float("nan")


# ---------------------------------------------------------------- hand-computed


def test_paired_t_by_hand():
    # mean 2, sd 1, n 3: half-width t_{0.975, 2} / √3 = 4.302653 / 1.732051, t = 2√3
    r = st.paired_t([1.0, 2.0, 3.0])
    assert (r["n"], r["mean"], r["sd"]) == (3, 2.0, 1.0)
    assert r["high"] - r["mean"] == pytest.approx(4.302653 / math.sqrt(3), abs=1e-6)
    # df 2: P(|T| ≥ t) = 1 − t / √(2 + t²) exactly; t = 2√3
    t = 2 * math.sqrt(3)
    assert r["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10)
    # df 1 (Cauchy): P(|T| ≥ t) = 1 − 2·atan(t)/π
    assert st.t_sf2(1.5, 1) == pytest.approx(1 - 2 * math.atan(1.5) / math.pi, rel=1e-10)
    assert st.t_ppf(0.975, 1) == pytest.approx(12.706205, abs=1e-6)
    assert st.t_ppf(0.025, 4) == pytest.approx(-2.776445, abs=1e-6)
    assert st.t_ppf(0.5, 7) == 0.0


def test_paired_t_edges():
    one = st.paired_t([0.25])
    assert one["mean"] == 0.25 and math.isnan(one["low"]) and math.isnan(one["p"])
    same = st.paired_t([0.5, 0.5, 0.5])
    assert same["low"] == same["high"] == 0.5 and same["p"] == 0.0
    assert st.paired_t([0.0, 0.0])["p"] == 1.0
    with pytest.raises(ValueError, match="diffs"):
        st.paired_t([])


def test_sign_test_counts_ties():
    assert st.sign_test([0.1, 0.2, 0.3, 0.4, 0.0]) == dict(wins=4, losses=0, ties=1, p=0.125)
    assert st.sign_test([0.1] * 5)["p"] == pytest.approx(0.0625)
    assert st.sign_test([0.1, -0.2, 0.3, 0.0, -0.1]) == dict(wins=2, losses=2, ties=1, p=1.0)
    # 8 wins, 2 losses: 2·(1 + 10 + 45)/1024
    assert st.sign_test([1] * 8 + [-1] * 2)["p"] == pytest.approx(112 / 1024)
    assert st.sign_test([0.0, 0.0]) == dict(wins=0, losses=0, ties=2, p=1.0)


def test_holm_by_hand():
    # m = 4 (nan is outside the family): 0.01·4 = 0.04, 0.03·3 = 0.09, max(0.04·2, 0.09) = 0.09, 0.5·1
    assert st.holm([0.01, 0.04, 0.03, NAN, 0.5])[:3] == pytest.approx([0.04, 0.09, 0.09])
    out = st.holm([0.01, 0.04, 0.03, NAN, 0.5])
    assert math.isnan(out[3]) and out[4] == 0.5
    assert st.holm([0.3, 0.6]) == [0.6, 0.6]
    assert st.holm([0.9, 0.9, 0.9]) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="pvalues"):
        st.holm([1.5])


def test_cluster_t_by_hand():
    # cluster means 2, 3, 1: mean 2, sd 1 on 2 df; MS_between = 3·1 = 3, MS_within = 1 -> σ_b² = (3 − 1)/3
    r = st.cluster_t({0: [1.0, 2.0, 3.0], 1: [2.0, 3.0, 4.0], 2: [0.0, 1.0, 2.0]})
    assert (r["n"], r["mean"], r["sd"]) == (3, 2.0, 1.0)
    assert r["high"] - r["mean"] == pytest.approx(4.302653 / math.sqrt(3), abs=1e-6)
    assert r["sd_between"] == pytest.approx(math.sqrt(2 / 3)) and r["sd_within"] == pytest.approx(1.0)
    # no between-initialisation variance beyond the seeds': σ_b clipped at 0
    flat = st.cluster_t({0: [0.0, 2.0], 1: [0.0, 2.0]})
    assert flat["sd_between"] == 0.0 and flat["sd"] == 0.0
    # unequal clusters: the interval still, no variance components
    assert math.isnan(st.cluster_t({0: [1.0], 1: [2.0, 3.0]})["sd_between"])
    with pytest.raises(ValueError, match="diffs_by_cluster"):
        st.cluster_t({0: []})


def test_min_detectable_by_hand():
    # (t_{0.975, 29} + t_{0.8, 29}) · sd / √30 = (2.045230 + 0.854192) / √30
    assert st.min_detectable(1.0, 30) == pytest.approx((2.045230 + 0.854192) / math.sqrt(30), abs=1e-5)
    assert st.min_detectable(0.02, 30) == pytest.approx(0.02 * st.min_detectable(1.0, 30))
    assert math.isnan(st.min_detectable(1.0, 1))


# ---------------------------------------------------------------- against scipy

DATA = [0.012, -0.004, 0.031, 0.0, 0.008, -0.016, 0.023, 0.004, 0.0, 0.019, -0.008, 0.027]


def test_t_distribution_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 29, 200):
        for q in (0.6, 0.8, 0.975, 0.995, 0.025):
            assert st.t_ppf(q, df) == pytest.approx(stats.t.ppf(q, df), rel=1e-9, abs=1e-9)
        for t in (0.0, 0.3, 1.7, 4.0, 25.0):
            assert st.t_sf2(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-9, abs=1e-15)


def test_betainc_against_scipy():
    special = pytest.importorskip("scipy.special")
    for a, b, x in [(0.5, 0.5, 0.3), (14.5, 0.5, 0.9), (2.0, 3.0, 0.7), (100.0, 0.5, 0.999), (1.0, 1.0, 0.25)]:
        assert st.betainc(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-10)


def test_paired_t_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    r = st.paired_t(DATA)
    ref = stats.ttest_1samp(DATA, 0.0)
    ci = ref.confidence_interval(0.95)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert (r["low"], r["high"]) == pytest.approx((ci.low, ci.high), rel=1e-9)
    # the paired form: the same as scipy's ttest_rel on the two arms
    base = [0.5 + 0.01 * i for i in range(len(DATA))]
    arm = [b + d for b, d in zip(base, DATA)]
    assert st.paired_t([a - b for a, b in zip(arm, base)])["p"] == pytest.approx(
        stats.ttest_rel(arm, base).pvalue, rel=1e-9
    )


def test_cluster_t_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    clusters = {0: DATA[:4], 1: DATA[4:8], 2: DATA[8:]}
    means = [sum(v) / len(v) for v in clusters.values()]
    r, ref = st.cluster_t(clusters), stats.ttest_1samp(means, 0.0)
    ci = ref.confidence_interval(0.95)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert (r["low"], r["high"]) == pytest.approx((ci.low, ci.high), rel=1e-9)
    # the variance components from one-way ANOVA's mean squares: here F < 1, so σ_b is clipped at 0
    assert stats.f_oneway(*clusters.values()).statistic < 1 and r["sd_between"] == 0.0
    shifted = {0: DATA[:4], 1: [d + 0.03 for d in DATA[4:8]], 2: DATA[8:]}
    r, f = st.cluster_t(shifted), stats.f_oneway(*shifted.values()).statistic
    ms_within = r["sd_within"] ** 2
    ms_between = ms_within + 4 * r["sd_between"] ** 2
    assert f > 1 and ms_between / ms_within == pytest.approx(f, rel=1e-9)


def test_sign_test_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for diffs in (DATA, [1] * 9 + [-1], [1, -1] * 5 + [0] * 3, [1] * 30):
        r = st.sign_test(diffs)
        ref = stats.binomtest(r["wins"], r["wins"] + r["losses"], 0.5)
        assert r["p"] == pytest.approx(ref.pvalue, rel=1e-12)
        assert r["ties"] == sum(d == 0 for d in diffs)


def test_min_detectable_has_the_power_it_claims():
    """At the minimum detectable difference the noncentral t gives 80% power (the approximation is
    within 1.5 points at n = 10 and within 0.5 at n = 30)."""
    stats = pytest.importorskip("scipy.stats")
    for n, tol in ((10, 0.015), (30, 0.005)):
        d = st.min_detectable(1.0, n)
        crit = stats.t.ppf(0.975, n - 1)
        nc = d * math.sqrt(n)
        power = stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc)
        assert power == pytest.approx(0.8, abs=tol)
