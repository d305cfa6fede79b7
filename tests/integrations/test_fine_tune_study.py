"""examples/fine_tune_study.py --quick end to end: the outputs are well formed (not what they say),
the stage-1 checkpoint is reused, and the statistics helpers compute what they claim."""

import csv
import math

import pytest

pytest.importorskip("open_clip")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
import fine_tune_study as study


def _rows(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_statistics_helpers():
    mean, half = study.t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(study.t_interval([0.5])[1])
    assert study.sign_test([0.1, 0.2, 0.3, 0.0, -0.1]) == (3, 1, pytest.approx(2 * 5 / 16))
    assert study.sign_test([0.1] * 5)[2] == pytest.approx(0.0625)
    lo, hi = study.bootstrap_ci([1.0, 1.0, 1.0])
    assert lo == hi == 1.0
    lo, hi = study.bootstrap_ci([0.0, 1.0, 2.0, 3.0])
    assert 0.0 <= lo < 1.5 < hi <= 3.0


def test_saturation_measures_the_float32_cross_entropy():
    import torch

    # two pairs, cross cosine 0.8: every row's gap to its negative is 0.2·s
    feats = torch.tensor([[1.0, 0.0], [0.8, 0.6]])
    # s = 100: gap 20, e^-20 ≈ 2e-9 is below float32's half-ulp of 1 (3e-8), not float64's: all rows lost
    assert study.batch_saturation(feats, feats, torch.tensor(100.0)) == (True, 1.0)
    # s = 50: gap 10, loss ≈ 4.5e-5 < 1e-3, but p_ii − 1 ≈ −4.5e-5 is still representable
    assert study.batch_saturation(feats, feats, torch.tensor(50.0)) == (True, 0.0)
    assert study.batch_saturation(feats, feats, torch.tensor(1.0)) == (False, 0.0)
    assert study.dup_fraction(torch.tensor([0, 1, 4, 9])) == 0.5  # 0 and 1 share group 0


def test_quick_run_outputs_are_well_formed(tmp_path):
    out = tmp_path / "study"
    result = study.main(["--quick", "--no-progress", "--out", str(out)])
    for name in ("stage1.csv", "history.csv", "final.csv", "summary.csv", "paired.csv", "table.md", "curves.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(out.glob("stage1_*.pt"))) == 1
    ran = [a for a in study.ARMS if a not in result["missing"]]
    assert ran[:4] == list(study.ARMS[:4])
    if study.big_batch_available():
        assert ran == list(study.ARMS)
    else:  # reported, never silently left out
        assert "HN-CLIP 4×batch" in result["missing"] and "| HN-CLIP 4×batch | not run" in result["table"]
    history = _rows(out / "history.csv")
    quick = study.QUICK
    assert {(r["arm"], int(r["seed"]), int(r["epoch"])) for r in history} == {
        (a, s, e) for a in ran for s in range(quick["seeds"]) for e in range(quick["epochs"] + 1)
    }
    for r in history:
        for key in ("i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5", "i2t_group_acc", "t2i_group_acc"):
            assert 0.0 <= float(r[key]) <= 1.0, key
        assert float(r["i2t_R@1"]) <= float(r["i2t_R@5"]) and float(r["tau"]) > 0
        if int(r["epoch"]) > 0:
            for key in ("train_loss", "sat_batches", "zero_grad_rows", "dup_rows"):
                assert math.isfinite(float(r[key])), key
            assert 0.0 <= float(r["sat_batches"]) <= 1.0 and 0.0 <= float(r["zero_grad_rows"]) <= 1.0
    # the same initialisation for every arm of a seed
    init = {(r["seed"], r["i2t_R@1"], r["t2i_R@1"], r["tau"]) for r in history if r["epoch"] == "0"}
    assert len(init) == quick["seeds"]
    summary = _rows(out / "summary.csv")
    assert {(r["arm"], r["metric"]) for r in summary} == {(a, m) for a in ran for m in study.METRICS}
    for r in summary:
        assert float(r["ci_low"]) <= float(r["mean"]) <= float(r["ci_high"])
    paired = _rows(out / "paired.csv")
    assert {r["arm"] for r in paired} == set(ran[1:])
    assert all(math.isfinite(float(r[k])) for r in paired for k in ("mean_diff", "boot_low", "boot_high", "sign_p"))
    assert len(_rows(out / "final.csv")) == len(ran) * quick["seeds"]
    # a second run reuses the stage-1 checkpoint and repeats the numbers
    again = study.main(["--quick", "--no-progress", "--out", str(out), "--seeds", "1"])
    assert again["stage1"]["reused"]
    strip = lambda rows: [repr(r) for r in rows]  # noqa: E731  (repr: epoch 0's nan statistics compare equal)
    assert strip(again["history"]) == strip([r for r in result["history"] if r["seed"] == 0])
