"""examples/fine_tune_study.py: the regime measures are what they claim, and ``--quick`` end to end
writes well-formed outputs (not what they say) and its figure, records a clean leakage check,
reuses its cached initialisations and repeats its numbers bit for bit (one thread). The held-out
guard's own tests are in test_study_leakage.py (default tier)."""

import csv
import json
import math

import pytest

pytest.importorskip("open_clip")
pytest.importorskip("tqdm")
import fine_tune_study as study
import study_tables


def _rows(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_saturation_measures_the_float32_cross_entropy():
    import torch

    # two pairs, cross cosine 0.8: every row's gap to its negative is 0.2·s
    feats = torch.tensor([[1.0, 0.0], [0.8, 0.6]])
    # s = 100: gap 20, e^-20 ≈ 2e-9 is below float32's half-ulp of 1 (3e-8): every positive gradient is 0
    value, zero = study.batch_saturation(feats, feats, torch.tensor(100.0))
    assert value < study.SAT_THRESHOLD and zero == 1.0
    # s = 50: gap 10, loss ≈ 4.5e-5 < 1e-3, but p_ii − 1 ≈ −4.5e-5 is still representable
    value, zero = study.batch_saturation(feats, feats, torch.tensor(50.0))
    assert value == pytest.approx(math.log1p(math.exp(-10.0)), rel=1e-3) and zero == 0.0
    assert study.batch_saturation(feats, feats, torch.tensor(1.0))[0] > study.SAT_THRESHOLD
    assert study.dup_fraction(torch.tensor([0, 1, 4, 9])) == 0.5  # 0 and 1 share group 0
    r = study.regime_row([1e-4, 2e-3, 5e-4, 1.0], [0.5, 0.25, 0.0, 0.25], [0.0, 0.5, 0.5, 1.0])
    assert r == dict(
        batches=4, sat_batches=0.5, fp32_zero_pos_grad_rows=0.25, median_infonce=0.5 * (5e-4 + 2e-3), dup_rows=0.5
    )


def test_arm_plans_separate_batch_size_from_data_seen():
    plans = {arm: study.arm_plan(arm, 512, 4) for arm in study.ARMS}
    seen = {arm: p["batch"] * p["total"] for arm, p in plans.items()}
    assert seen["HN-CLIP 4×batch, same pairs"] == seen["ClipLoss"] == 4 * 512
    assert plans["HN-CLIP 4×batch, same steps"]["total"] == plans["ClipLoss"]["total"] == 32
    assert seen["HN-CLIP 4×batch, same steps"] == 4 * seen["ClipLoss"]


def test_quick_run_outputs_are_well_formed(tmp_path, capsys):
    out, cache = tmp_path / "study", tmp_path / "cache"
    result = study.main(["--quick", "--no-progress", "--out", str(out), "--cache", str(cache)])
    printed = capsys.readouterr().out
    for name in ("final.csv", "regime.csv", "stage1.csv", "run.json", "study.png"):
        assert (out / name).stat().st_size > 0, name
    assert len(list(cache.glob("stage1_*.pt"))) == study.QUICK["init_seeds"]
    run = json.loads((out / "run.json").read_text())
    leak = run["leakage"]
    assert run["complete"] and leak["held_out_in_training"] == leak["held_out_pools_sharing_scenes"] == 0
    assert leak["held_out_items"] == leak["held_out_scenes"] == study.QUICK["s1_eval"] + 4 * 8 * 2
    assert "leakage check: " in printed and '"held_out_in_training": 0' in printed
    ran = [a for a in study.ARMS if a not in result["missing"]]
    assert ran[:4] == list(study.ARMS[:4])
    if study.big_batch_available():
        assert ran == list(study.ARMS)
    else:  # reported, never silently left out
        assert "| HN-CLIP 4×batch, same steps | not run" in result["tables"]
    q = study.QUICK
    pairs = {(i, s) for i in range(q["init_seeds"]) for s in range(q["seeds"])}
    final = _rows(out / "final.csv")
    assert {(r["arm"], int(r["init"]), int(r["seed"])) for r in final} == {
        (a, i, s) for a in [study.INIT_ARM] + ran for i, s in pairs
    }
    for r in final:
        for key in study.METRICS:
            assert 0.0 <= float(r[key]) <= 1.0, key
        assert float(r["tau"]) > 0
    regime = _rows(out / "regime.csv")
    assert {(r["arm"], int(r["init"]), int(r["seed"]), int(r["epoch"])) for r in regime} == {
        (study.INIT_ARM, i, s, 0) for i, s in pairs
    } | {(a, i, s, e) for a in ran for i, s in pairs for e in range(1, q["epochs"] + 1)}
    for r in regime:
        assert 0.0 <= float(r["sat_batches"]) <= 1.0 and 0.0 <= float(r["fp32_zero_pos_grad_rows"]) <= 1.0
        assert float(r["median_infonce"]) > 0
    assert {int(r["batches"]) for r in regime if r["arm"] == "HN-CLIP 4×batch, same pairs"} <= {1}
    # the tables: the primary comparison first, every comparison Holm-adjusted
    rows = study_tables.comparisons(study_tables.load(str(out))["final"], ran)
    assert (rows[0]["arm"], rows[0]["metric"]) == study.PRIMARY == study_tables.PRIMARY
    assert len(rows) == 4 * (len(ran) - 1) and all(r["holm_p"] >= r["x"]["p"] for r in rows)
    assert "Primary (HN-CLIP γ = 0.5 − ClipLoss, t→i R@1)" in result["tables"]
    # offsets: initialisation 1 and the first seed alone reuse the cached model and repeat their numbers bit
    # for bit (a later seed's held-out pool avoids the scenes of the run's earlier seeds: not the first's)
    again = study.main(
        ["--quick", "--no-progress", "--out", str(tmp_path / "again"), "--cache", str(cache)]
        + ["--init-seeds", "1", "--init-offset", "1", "--seeds", "1", "--seed-offset", "0"]
    )
    assert [r["reused"] for r in again["stage1"]] == [True]
    pick = lambda rows: [repr(r) for r in rows if r["init"] == 1 and r["seed"] == 0]  # noqa: E731 (repr: nan == nan)
    assert pick(again["final"]) == pick(result["final"]) and pick(again["regime"]) == pick(result["regime"])


def test_quick_siglip_arm_set_end_to_end(tmp_path):
    """``--arm-set siglip --quick``: ClipLoss, SigLIP and HN-SigLIP per cell, every sigmoid arm's bias
    calibrated and learned, the arm set's family of 12 comparisons with HN-SigLIP − SigLIP first."""
    out = tmp_path / "siglip"
    result = study.main(
        ["--quick", "--arm-set", "siglip", "--no-progress", "--out", str(out), "--cache", str(tmp_path / "cache")]
    )
    for name in ("final.csv", "regime.csv", "stage1.csv", "run.json", "study.png"):
        assert (out / name).stat().st_size > 0, name
    run = json.loads((out / "run.json").read_text())
    assert run["arm_set"] == "siglip" and run["arm_set_revision"] == study.SIGLIP_REVISION
    assert run["arms"] == list(study.SIGLIP_ARMS) and not run["missing"]
    q = study.QUICK
    pairs = {(i, s) for i in range(q["init_seeds"]) for s in range(q["seeds"])}
    final = _rows(out / "final.csv")
    assert {(r["arm"], int(r["init"]), int(r["seed"])) for r in final} == {
        (a, i, s) for a in [study.INIT_ARM, *study.SIGLIP_ARMS] for i, s in pairs
    }
    for r in final:
        b0, b = float(r["logit_bias_init"]), float(r["logit_bias"])
        if r["arm"] in study.SIGMOID_ARMS:
            assert math.isfinite(b0) and b != b0  # calibrated, then learned
        else:
            assert math.isnan(b0) and math.isnan(b)
    rows = study_tables.data_comparisons(study_tables.load(str(out)))
    assert len(rows) == 12
    assert (rows[0]["arm"], rows[0]["ref"], rows[0]["metric"]) == study.SIGLIP_PRIMARY
    assert {(r["arm"], r["ref"]) for r in rows} == {
        ("HN-SigLIP", "SigLIP"),
        ("SigLIP", "ClipLoss"),
        ("HN-SigLIP", "ClipLoss"),
    }
    assert all(r["holm_p"] >= r["x"]["p"] for r in rows)
    assert "Primary (HN-SigLIP γ = 0.5 − SigLIP, t→i R@1)" in result["tables"]
    assert "The sigmoid arms' learnable bias" in result["tables"]
