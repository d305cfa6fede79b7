"""hnclip_kernels.sigmoid_saturation_report: every field against an explicit float64 loop, a
saturated batch (float32 σ(z) − 1 rounds to 0) against a direct count, a non-saturated one,
chunking invariance, hypothesis draws over small shapes, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hnclip_kernels
from hnclip_kernels import SigmoidSaturationReport, hn_siglip_loss, sigmoid_saturation_report


def explicit(img, txt, s, b, *, gamma=0.0, margin="text", negatives=None, group_ids=None, group_mode="mask"):
    """Pair by pair in float64: (loss, pairs, masked, per-row lists of (y, z)) of the sigmoid loss
    (1/N)·Σ log(1 + exp(−y·z)), z = s·(v̂·k̂ + γ·h·[y = −1]) + b over the columns [txt; negatives]."""
    v = F.normalize(img.double(), dim=1)
    k = F.normalize(torch.cat([txt] + ([] if negatives is None else [negatives])).double(), dim=1)
    n = v.shape[0]
    total, pairs, masked, rows = 0.0, 0, 0, []
    for i in range(n):
        row = []
        for j in range(k.shape[0]):
            same = group_ids is not None and j < n and int(group_ids[i]) == int(group_ids[j])
            if j == i or (same and group_mode == "positive"):
                y = 1.0
            elif same:
                masked += 1
                continue
            else:
                y = -1.0
            dot = float(v[i] @ k[j])
            h = float(k[i] @ k[j]) if margin == "text" else dot
            z = s * (dot + (gamma * h if y < 0 else 0.0)) + b
            x = -y * z
            total += max(x, 0.0) + math.log1p(math.exp(-abs(x)))
            pairs += 1
            row.append((y, z))
        rows.append(row)
    return total / n, pairs, masked, rows


def float32_grads(img, txt, s, b, logits=False):
    """γ = 0: the float32 gradients σ(z) − [y = +1] of every pair, formed directly (no autograd);
    with ``logits`` the float32 logits z themselves."""
    v, t = F.normalize(img.float(), dim=1), F.normalize(txt.float(), dim=1)
    z = torch.tensor(s, dtype=torch.float32) * (v @ t.T) + torch.tensor(b, dtype=torch.float32)
    return z if logits else torch.sigmoid(z) - torch.eye(img.shape[0], dtype=torch.float32)


def test_exported_with_its_report_type():
    assert hnclip_kernels.sigmoid_saturation_report is sigmoid_saturation_report
    assert "SigmoidSaturationReport" in hnclip_kernels.__all__
    r = sigmoid_saturation_report(torch.randn(3, 4), torch.randn(3, 4), 10.0, -10.0)
    assert isinstance(r, SigmoidSaturationReport)
    d = r.as_dict()
    assert d["pairs"] == 9 and d["masked_pairs"] is None and len(d["row_lost_loss"]) == 3


@pytest.mark.parametrize("group_mode", ["mask", "positive"])
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_values_match_an_explicit_float64_loop(margin, group_mode):
    g = torch.Generator().manual_seed(1)
    img, txt, neg = (torch.randn(n, 8, generator=g) for n in (6, 6, 2))
    ids = torch.tensor([0, 1, 1, 2, 3, 3])
    r = sigmoid_saturation_report(img, txt, 7.0, -3.0, gamma=0.5, margin=margin, negatives=neg, group_ids=ids,
                                  group_mode=group_mode)  # fmt: skip
    loss, pairs, masked, rows = explicit(img, txt, 7.0, -3.0, gamma=0.5, margin=margin, negatives=neg,
                                         group_ids=ids, group_mode=group_mode)  # fmt: skip
    assert r.loss == pytest.approx(loss, rel=1e-12)
    assert r.pairs == pairs == sum(len(row) for row in rows)
    assert r.masked_pairs == (masked if group_mode == "mask" else None)
    assert (masked > 0) == (group_mode == "mask")
    # open_clip's float32 pair losses: float32 rounding of the logits away from the exact loss
    assert r.naive_fp32_loss == pytest.approx(loss, rel=1e-5)
    assert r.lost_pairs_fp32 == r.lost_loss == r.lost_loss_share == 0.0  # |z| ≤ 13.5: nothing saturates
    # the loss the project trains on agrees with the report's exact loss
    ours = hn_siglip_loss(img.double(), txt.double(), 7.0, -3.0, gamma=0.5, margin=margin, negatives=neg.double(),
                          group_ids=ids, group_mode=group_mode, backend="torch")  # fmt: skip
    assert float(ours) == pytest.approx(loss, rel=1e-12)


def saturated_batch(n=16, d=32):
    """s = 100, b = −80, txt = img: every positive at z ≈ 20 (float32 σ(z) rounds to 1), negatives
    near z = −80 + 100·cos."""
    img = torch.randn(n, d, generator=torch.Generator().manual_seed(2))
    return img, img.clone(), 100.0, -80.0


def test_saturated_positives_lose_their_float32_gradient():
    img, txt, s, b = saturated_batch()
    n = img.shape[0]
    r = sigmoid_saturation_report(img, txt, s, b)
    direct = float32_grads(img, txt, s, b) == 0  # the float64 gradient of every pair is nonzero here
    assert direct.diagonal().all()  # every positive: σ(20) rounds to 1 in float32
    # and the negatives below z ≈ −103, where σ(z) underflows float32
    assert r.lost_pairs_fp32 == direct.sum().item() / (n * n) > 1 / n
    assert r.row_lost_pairs.tolist() == direct.sum(dim=1).tolist()
    # the loss they carry, softplus(−y·z) each, dominated by the positives' softplus(−20)
    _, _, _, rows = explicit(img, txt, s, b)
    lost_loss = sum(
        math.log1p(math.exp(y * -z)) for i, row in enumerate(rows) for j, (y, z) in enumerate(row) if direct[i, j]
    )
    assert r.lost_loss == pytest.approx(lost_loss / n, rel=1e-9)
    assert r.lost_loss == pytest.approx(math.log1p(math.exp(-20.0)), rel=1e-5)
    assert r.row_lost_loss.sum().item() / n == pytest.approx(r.lost_loss, rel=1e-12)
    assert 0.99 < r.lost_loss_share <= 1.0  # the other negatives' loss (z ≲ −40) is negligible beside it
    # open_clip's −logsigmoid(y·z) keeps the positives' gradients in float32: it loses only the
    # pairs whose e^{−|z|} underflows (|z| ≳ 104; σ(z) − 0 already at z ≲ −88.7, where e^{−z} overflows)
    z = float32_grads(img, txt, s, b, logits=True)
    underflow = torch.exp(-z.abs()) == 0
    assert not underflow.diagonal().any()
    assert r.lost_pairs_logsigmoid_fp32 == underflow.sum().item() / (n * n) < r.lost_pairs_fp32
    assert r.naive_fp32_loss == pytest.approx(r.loss, rel=1e-4)


def test_a_non_saturated_batch_loses_nothing():
    g = torch.Generator().manual_seed(3)
    img, txt = torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)
    r = sigmoid_saturation_report(img, txt, 10.0, -10.0)
    assert not (float32_grads(img, txt, 10.0, -10.0) == 0).any()
    assert r.lost_pairs_fp32 == r.lost_loss == r.lost_loss_share == r.lost_pairs_logsigmoid_fp32 == 0.0
    assert r.row_lost_pairs.tolist() == [0] * 12 and r.pairs == 144


def test_logsigmoid_loses_only_where_its_exponential_underflows():
    img, txt, _, _ = saturated_batch(n=4, d=512)
    r = sigmoid_saturation_report(img, txt, 120.0, 0.0)  # positives at z ≈ 120: e^{-120} underflows float32
    assert float32_grads(img, txt, 120.0, 0.0, logits=True).abs().fill_diagonal_(0).max() < 20  # negatives
    assert r.lost_pairs_logsigmoid_fp32 == r.lost_pairs_fp32 == 4 / 16


def test_pairs_whose_float64_gradient_is_zero_too_are_not_lost():
    img, txt, _, _ = saturated_batch(n=4, d=512)
    r = sigmoid_saturation_report(img, txt, 800.0, 0.0)  # positives at z ≈ 800: σ(−800) is 0 in float64 as well
    assert r.lost_pairs_fp32 == r.lost_pairs_logsigmoid_fp32 == 0.0 and r.lost_loss == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_naive_side_is_float32_whatever_the_features(dtype):
    img, txt, s, b = saturated_batch(n=8)
    img, txt = img.to(dtype), txt.to(dtype)
    r = sigmoid_saturation_report(img, txt, s, b)
    r32 = sigmoid_saturation_report(img.float(), txt.float(), s, b)
    assert r.lost_pairs_fp32 == r32.lost_pairs_fp32 >= 8 / 64  # the positives at least
    assert r.row_lost_pairs.tolist() == r32.row_lost_pairs.tolist()
    assert r.loss == pytest.approx(r32.loss, rel=1e-6)


def test_chunking_changes_nothing():
    g = torch.Generator().manual_seed(4)
    img, txt, neg = (torch.randn(n, 8, generator=g) for n in (7, 7, 3))
    img[:3] = txt[:3]  # three saturated rows: positives at z = 40 − 20, no negative below z = −72
    kwargs = dict(gamma=0.3, negatives=neg, group_ids=torch.tensor([0, 0, 1, 2, 3, 3, 4]))
    whole = sigmoid_saturation_report(img, txt, 40.0, -20.0, **kwargs)
    for chunk in (1, 2, 3):
        part = sigmoid_saturation_report(img, txt, 40.0, -20.0, chunk_rows=chunk, **kwargs)
        assert part.row_lost_pairs.tolist() == whole.row_lost_pairs.tolist()
        assert part.pairs == whole.pairs and part.masked_pairs == whole.masked_pairs
        assert part.loss == pytest.approx(whole.loss, rel=1e-12)
        assert part.lost_loss == pytest.approx(whole.lost_loss, rel=1e-12)
    assert whole.row_lost_pairs[:3].tolist() == [1, 1, 1]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 5),
    d=st.integers(1, 6),
    s=st.sampled_from([1.0, 10.0, 100.0, 150.0]),
    b=st.sampled_from([0.0, -10.0, -80.0]),
    same=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_draws_match_the_explicit_loop_and_a_direct_count(n, d, s, b, same, seed):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=g)
    txt = img.clone() if same else torch.randn(n, d, generator=g)
    r = sigmoid_saturation_report(img, txt, s, b, chunk_rows=2)
    loss, pairs, _, _ = explicit(img, txt, s, b)
    assert r.loss == pytest.approx(loss, rel=1e-10, abs=1e-300)
    assert r.pairs == pairs == n * n
    direct = float32_grads(img, txt, s, b)
    assert r.row_lost_pairs.tolist() == (direct == 0).sum(dim=1).tolist()
    assert r.lost_pairs_fp32 == (direct == 0).sum().item() / (n * n)
    assert 0.0 <= r.lost_loss_share <= 1.0 + 1e-12


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(img="x"), TypeError, "img"),
        (dict(txt=torch.randn(4, 3)), ValueError, "txt"),
        (dict(txt=torch.randn(3, 4, dtype=torch.float64)), TypeError, "dtype"),
        (dict(logit_scale=0.0), ValueError, "logit_scale"),
        (dict(logit_scale="10"), TypeError, "logit_scale"),
        (dict(logit_bias=float("nan")), ValueError, "logit_bias"),
        (dict(gamma=-1.0), ValueError, "gamma"),
        (dict(margin="caption"), ValueError, "margin"),
        (dict(group_mode="drop"), ValueError, "group_mode"),
        (dict(group_ids=torch.zeros(2, dtype=torch.long)), ValueError, "group_ids"),
        (dict(negatives=torch.randn(2, 5)), ValueError, "negatives"),
        (dict(chunk_rows=0), ValueError, "chunk_rows"),
        (dict(chunk_rows=2.0), TypeError, "chunk_rows"),
        (dict(logit_scale=1e38), ValueError, "logit_scale"),
    ],
)
def test_bad_input_names_the_argument(kwargs, exc, match):
    args = dict(img=torch.randn(3, 4), txt=torch.randn(3, 4), logit_scale=10.0, logit_bias=-10.0)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        sigmoid_saturation_report(args.pop("img"), args.pop("txt"), args.pop("logit_scale"), args.pop("logit_bias"),
                                  **args)  # fmt: skip


def test_meta_tensors_are_refused():
    with pytest.raises(ValueError, match="meta"):
        sigmoid_saturation_report(torch.empty(3, 4, device="meta"), torch.empty(3, 4, device="meta"), 10.0)
