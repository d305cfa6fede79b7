"""Quick run of the float32 precision study (tools/precision.py): one seed, N = 40.

Under the GPU launch configuration in Triton's interpreter, where ``_dot`` rounds operands as
the tensor cores do: the split modes tf32x3 and bf16x6 keep the float32 guarantees in both
regimes, plain tf32 breaks them (so the emulated rounding is really there), and bf16x3 keeps
them on random features. ``python -m tools.precision`` is the full study (4 seeds, N = 130).
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    # conftest interprets Triton only without CUDA; importing the study would switch the
    # interpreter on for every later test. Run `python -m tools.precision` there instead.
    pytest.skip(
        "the precision study needs a session that interprets Triton (TRITON_INTERPRET=1)", allow_module_level=True
    )


from tools import precision

N = 40
DIMS = {"random": 64, "saturated": 128}  # D = 64 does not saturate at τ = 0.01 (true loss ~1e-17)


@pytest.fixture(scope="module")
def rows():
    out = {}
    for regime, d in DIMS.items():
        for r in precision.study(("tf32x3", "bf16x6", "bf16x3", "tf32"), (regime,), n=N, d=d, seeds=[0]):
            out[r["precision"], regime] = r
    return out


def _describe(r) -> str:
    return (
        f"{r['precision']} {r['regime']} N={r['n']} D={r['d']}: loss {r['loss_err']:.2e} (≤ {r['loss_tol']:g}), "
        f"d img {r['d_img_err']:.2e}, d txt {r['d_txt_err']:.2e}, d tau {r['d_tau_err']:.2e} "
        f"(≤ {r['grad_tol']:g})"
    )


@pytest.mark.parametrize("regime", list(DIMS))
@pytest.mark.parametrize("mode", ["tf32x3", "bf16x6"])
def test_split_modes_keep_float32_guarantees(rows, mode, regime):
    r = rows[mode, regime]
    assert r["loss_err"] <= r["loss_tol"] and r["grad_err"] <= r["grad_tol"], _describe(r)
    assert r["ok"]


def test_plain_tf32_breaks_them(rows):
    # one tf32 pass rounds the operands to 10 bits: the emulation is real, and the study sees it
    r = rows["tf32", "saturated"]
    assert r["loss_err"] > 1e-4 and r["grad_err"] > 1e-4, _describe(r)
    assert not r["ok"] and not rows["tf32", "random"]["ok"], _describe(rows["tf32", "random"])


def test_bf16x3_keeps_them_on_random_features(rows):
    r = rows["bf16x3", "random"]
    assert r["ok"], _describe(r)


def test_saturated_batches_are_saturated(rows):
    assert 0 < rows["tf32x3", "saturated"]["max_true_loss"] < 1e-20


def test_recommend_picks_the_cheapest_mode_keeping_the_guarantees(rows):
    table = list(rows.values())
    keep, best = precision.recommend(table)
    assert "tf32" not in keep and {"tf32x3", "bf16x6"} <= set(keep)
    assert best == [m for m in keep if precision.MODES[m].bf16_equiv == precision.MODES[keep[0]].bf16_equiv]
    assert "tf32x3" in precision.format_table(table)


def test_study_covers_every_public_precision():
    from hnclip_kernels.backends.triton import config as cfg

    assert set(cfg.FP32_PRECISIONS) | {"tf32"} == set(precision.MODES)
