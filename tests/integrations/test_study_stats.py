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


def test_crossed_t_by_hand():
    # initialisation rows (0, 2, 4) and (2, 6, 4): grand mean 3, row means 2, 4, column means 1, 4, 4;
    # MS_init = 3·2/1 = 6, MS_seed = 2·6/2 = 6, residuals 0, −1, 1, 0, 1, −1: MS_cell = 4/2 = 2
    grid = {(0, 0): 0.0, (0, 1): 2.0, (0, 2): 4.0, (1, 0): 2.0, (1, 1): 6.0, (1, 2): 4.0}
    r = st.crossed_t(grid)
    assert (r["n"], r["mean"]) == (6, 3.0)
    assert r["se"] == pytest.approx(math.sqrt((6 + 6 - 2) / 6), rel=1e-12)  # σ_a²/2 + σ_b²/3 + σ_e²/6
    assert r["df"] == pytest.approx(10**2 / (6**2 / 1 + 6**2 / 2 + 2**2 / 2), rel=1e-12)  # Satterthwaite
    assert (r["sd_init"], r["sd_seed"], r["sd_cell"]) == pytest.approx((math.sqrt(4 / 3), math.sqrt(2), math.sqrt(2)))
    half = st.t_ppf(0.975, r["df"]) * r["se"]
    assert (r["low"], r["high"]) == pytest.approx((3.0 - half, 3.0 + half), rel=1e-12)
    assert r["p"] == pytest.approx(st.t_sf2(3.0 / r["se"], r["df"]), rel=1e-12)
    # neither factor's mean square above the residual's: both pooled, the paired t over all cells
    flat = {(0, 0): 1.0, (0, 1): -1.0, (0, 2): 0.5, (1, 0): -1.0, (1, 1): 1.0, (1, 2): 0.5}
    r, t = st.crossed_t(flat), st.paired_t(list(flat.values()))
    assert (r["sd_init"], r["sd_seed"], r["df"]) == (0.0, 0.0, 5)
    assert (r["low"], r["high"], r["p"]) == pytest.approx((t["low"], t["high"], t["p"]), rel=1e-12)
    # one initialisation (or one seed): one factor, independent cells, the paired t
    one = {(0, 0): 1.0, (0, 1): 2.0, (0, 2): 4.0}
    r, t = st.crossed_t(one), st.paired_t([1.0, 2.0, 4.0])
    assert (r["df"], r["low"], r["high"], r["p"], r["sd_cell"]) == (2, t["low"], t["high"], t["p"], t["sd"])
    assert math.isnan(r["sd_init"]) and math.isnan(st.crossed_t({(3, 7): 0.5})["p"])
    for bad in ({}, {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 3.0}):
        with pytest.raises(ValueError, match="complete grid"):
            st.crossed_t(bad)


def test_min_detectable_by_hand():
    # (t_{0.975, 29} + t_{0.8, 29}) · sd / √30 = (2.045230 + 0.854192) / √30
    assert st.min_detectable(1.0, 30) == pytest.approx((2.045230 + 0.854192) / math.sqrt(30), abs=1e-5)
    assert st.min_detectable(0.02, 30) == pytest.approx(0.02 * st.min_detectable(1.0, 30))
    assert math.isnan(st.min_detectable(1.0, 1)) and math.isnan(st.min_detectable_se(0.1, 0.0))
    assert st.min_detectable_se(0.1, 29) == pytest.approx(st.min_detectable(0.1 * math.sqrt(30), 30), rel=1e-12)


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


def _crossed_data(seed: int, sd_init: float, sd_seed: float, sd_cell: float, inits=3, seeds=10) -> dict:
    import random

    rng = random.Random(seed)
    a = [rng.gauss(0, sd_init) for _ in range(inits)]
    b = [rng.gauss(0, sd_seed) for _ in range(seeds)]
    return {(i, s): 0.003 + a[i] + b[s] + rng.gauss(0, sd_cell) for i in range(inits) for s in range(seeds)}


def test_crossed_t_against_statsmodels_mixedlm():
    """The standard error and the variance components are REML's (statsmodels MixedLM with crossed
    variance components), including fits where a component sits on the boundary 0. MixedLM's default
    optimiser can stop short on the boundary, so the best REML likelihood over four optimisers is used."""
    pd = pytest.importorskip("pandas")
    sm = pytest.importorskip("statsmodels.api")
    import warnings

    for seed, sds in enumerate([(0.01, 0.008, 0.01), (0.004, 0.012, 0.008), (0.012, 0.003, 0.01), (0.002, 0.01, 0.01)]):
        cells = _crossed_data(seed, *sds)
        r = st.crossed_t(cells)
        frame = pd.DataFrame([dict(init=i, seed=s, d=v, all=1) for (i, s), v in cells.items()])
        model = sm.MixedLM.from_formula(
            "d ~ 1", groups="all", re_formula="0", vc_formula={"init": "0 + C(init)", "seed": "0 + C(seed)"}, data=frame
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fits = [model.fit(reml=True, method=m) for m in ("nm", "powell", "bfgs", "lbfgs")]
        best = max(fits, key=lambda f: f.llf)
        assert r["mean"] == pytest.approx(best.fe_params["Intercept"], rel=1e-9)
        assert r["se"] == pytest.approx(best.bse["Intercept"], rel=2e-3), seed
        assert (r["sd_init"], r["sd_seed"]) == pytest.approx(tuple(best.vcomp**0.5), abs=2e-5), seed
        assert r["sd_cell"] == pytest.approx(best.scale**0.5, rel=1e-3)


def test_crossed_t_covers_what_paired_t_misses():
    """Simulated from the crossed model (initialisation and seed effects as large as the cell's): the
    crossed interval covers the true mean about 95% of the time; the paired t over the cells, which
    treats them as independent, far less often."""
    covered = dict(crossed=0, paired=0)
    runs = 300
    for seed in range(runs):
        cells = _crossed_data(1000 + seed, 0.01, 0.01, 0.01)
        c, t = st.crossed_t(cells), st.paired_t(list(cells.values()))
        covered["crossed"] += c["low"] <= 0.003 <= c["high"]
        covered["paired"] += t["low"] <= 0.003 <= t["high"]
    assert 0.90 <= covered["crossed"] / runs <= 0.99 and covered["paired"] / runs < 0.8, covered


def test_verdicts_respect_the_crossed_design():
    """A difference that is all seed effect (each seed's cells move together) is not a detection: with
    10 seeds the crossed model has about 9 df, where the paired t over 30 cells had 29."""
    import study_tables as tb

    seed_effect = [0.031, -0.012, 0.024, 0.006, -0.018, 0.029, 0.002, 0.021, -0.009, 0.017]
    final = []
    for i in range(3):
        for s in range(10):
            base = 0.7 + 0.01 * i
            final.append(dict(arm="ClipLoss", init=i, seed=s, **{m: base for m in tb.METRICS}))
            d = seed_effect[s] + 0.0005 * ((i + s) % 3 - 1)
            final.append(dict(arm="HN-CLIP", init=i, seed=s, **{m: base + d for m in tb.METRICS}))
    rows = tb.comparisons(final, ["ClipLoss", "HN-CLIP"])
    naive = st.paired_t([r["t2i_R@1"] - b["t2i_R@1"] for r, b in zip(final[1::2], final[::2])])
    assert naive["p"] < 0.01  # the pre-version-5 verdict: detected even after Holm over 4 comparisons
    primary = rows[0]
    assert (primary["arm"], primary["metric"]) == ("HN-CLIP", "t2i_R@1")
    assert primary["x"]["df"] == pytest.approx(9.0, abs=0.5) and primary["holm_p"] > 0.05
    assert tb.verdict(primary).startswith("none detected")


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


def test_sentences_name_the_run_and_write_small_p_once(tmp_path):
    """ "Holm p < 0.001" (not "= < 0.001"), and a run in another folder is not "the default run"."""
    import study_tables as tb

    final = []
    for i in range(3):
        for s in range(10):
            base = 0.7 + 0.01 * i + 0.005 * (s % 3)
            final.append(dict(arm="ClipLoss", init=i, seed=s, **{m: base for m in tb.METRICS}))
            d = 0.05 + 0.001 * ((7 * i + 3 * s) % 5 - 2)
            final.append(dict(arm="HN-CLIP", init=i, seed=s, **{m: base + d for m in tb.METRICS}))
    data = dict(final=final, run=dict(arms=["ClipLoss", "HN-CLIP"]), folder=str(tmp_path))
    text = tb.conclusions(data)
    assert "Holm p < 0.001: HN-CLIP is ahead of ClipLoss" in text and "= <" not in text
    tail = tb.readme_table(data).splitlines()[-1]
    assert tail.startswith(f"In the run in `{tmp_path}`, on the other metrics") and "default run" not in tail
    assert tb.label(dict(data, folder=tb.COMMITTED)) == "the default run"
    assert tb.label(dict(data, folder=tb.REPLICATION)) == "the replication"
