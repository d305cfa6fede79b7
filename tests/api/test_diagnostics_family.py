"""``saturation_report`` with the hard-negative family (``negatives``, ``group_ids``, ``margin``):
its fields against the loss's own ``return_stats`` report and a dense N × (N + M) evaluation."""

import pytest
import torch
import torch.nn.functional as F

from hnclip_kernels import hn_clip_loss
from hnclip_kernels.diagnostics import saturation_report

N, M, D = 9, 5, 16


def _batch(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    img, txt, neg = (torch.randn(k, D, generator=g, dtype=torch.float64).to(dtype) for k in (N, N, M))
    ids = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5])
    return img, txt, neg, ids


def _dense_naive(img, txt, neg, ids, tau, gamma, margin, threshold):
    """Mean over the 2N rows of float32 F.cross_entropy on the family's logits, masked at −inf."""
    v, t = F.normalize(img.float(), dim=1), F.normalize(txt.float(), dim=1)
    caps = torch.cat([t, F.normalize(neg.float(), dim=1)])
    eye = torch.eye(N, N + neg.shape[0], dtype=torch.bool)
    h_i2t = (t if margin == "text" else v) @ caps.T
    h_t2i = t @ t.T if margin == "text" else t @ v.T
    out = []
    for q, k, h, cos, cols in ((v, caps, h_i2t, t @ caps.T, N + neg.shape[0]), (t, v, h_t2i, t @ t.T, N)):
        pos = eye[:, :cols]
        same = torch.zeros(N, cols, dtype=torch.bool)
        same[:, :N] = ids[:, None] == ids[None, :]
        masked = (same | (cos >= threshold if threshold is not None else False)) & ~pos
        logits = (q @ k.T + gamma * h.masked_fill(pos, 0.0)) / tau
        out.append(F.cross_entropy(logits.masked_fill(masked, float("-inf")), torch.arange(N), reduction="none"))
    return torch.cat(out).double().mean().item()


@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_family_report_matches_the_loss_report_and_a_dense_evaluation(margin, threshold):
    img, txt, neg, ids = _batch()
    kw = dict(negatives=neg, group_ids=ids, margin=margin, false_negative_threshold=threshold, gamma=0.5)
    report = saturation_report(img, txt, 0.3, backend="torch", **kw)
    loss, stats = hn_clip_loss(img, txt, 0.3, backend="torch", return_stats=True, **kw)
    assert report.loss == pytest.approx(loss.item(), rel=1e-6)
    assert report.rows == 2 * N
    assert report.saturated_rows == pytest.approx(stats.saturated_rows)
    assert report.effective_negatives == pytest.approx(stats.effective_negatives, rel=1e-5)
    assert report.masked_pairs == stats.masked_pairs and report.masked_pairs >= 8  # ids alone mask 2 + 6
    naive = _dense_naive(img, txt, neg, ids, 0.3, 0.5, margin, threshold)
    assert report.naive_fp32_loss == pytest.approx(naive, rel=1e-5)


def test_negatives_widen_the_i2t_rows_only():
    img, txt, neg, _ = _batch(1)
    plain = saturation_report(img, txt, 0.1, backend="torch")
    with_neg = saturation_report(img, txt, 0.1, backend="torch", negatives=neg)
    assert with_neg.masked_pairs is None and plain.masked_pairs is None
    assert with_neg.loss > plain.loss  # more columns in i2t: a larger LSE
    assert with_neg.effective_negatives > plain.effective_negatives
    assert with_neg.loss == pytest.approx(hn_clip_loss(img, txt, 0.1, negatives=neg, backend="torch").item(), rel=1e-6)
    empty = saturation_report(img, txt, 0.1, backend="torch", negatives=neg[:0])  # M = 0 is None
    assert empty == plain


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_family_report_chunking_and_dtypes(dtype):
    img, txt, neg, ids = _batch(2, dtype)
    kw = dict(negatives=neg, group_ids=ids, margin="image_text", backend="torch")
    whole = saturation_report(img, txt, 0.2, **kw)
    chunked = saturation_report(img, txt, 0.2, chunk_rows=4, **kw)
    for field, value in whole.as_dict().items():
        assert chunked.as_dict()[field] == pytest.approx(value, rel=1e-6, abs=1e-12), field


def test_group_ids_alone_count_masked_pairs():
    img, txt, _, ids = _batch(3)
    report = saturation_report(img, txt, 0.2, group_ids=ids, backend="torch")
    assert report.masked_pairs == 2 + 6  # (0, 1), (1, 0) and the six ordered pairs of {3, 4, 5}


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(negatives=torch.randn(3, D + 1)), ValueError, "negatives has D"),
        (dict(group_ids=torch.zeros(N)), TypeError, "group_ids must be an integer"),
        (dict(group_ids=torch.zeros(N + 1, dtype=torch.long)), ValueError, "group_ids must be 1-D of length"),
        (dict(margin="image"), ValueError, "margin must be one of"),
    ],
)
def test_family_arguments_are_checked(kwargs, exc, match):
    img, txt, _, _ = _batch()
    with pytest.raises(exc, match=match):
        saturation_report(img, txt, 0.2, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_masked_negative_columns_count_once(backend, k):
    # k negatives equal to captions t_0 … t_{k-1}: each is one masked entry of the N × (N + M) i2t
    # logits (no t2i row sees it). Half-counting them, as the caption pairs' two directions are,
    # gave 0, 1, 2 (round half to even) for k = 1, 2, 3.
    from cases import ALL_BACKENDS

    if backend not in ALL_BACKENDS:
        pytest.skip(f"{backend} cannot run here")
    g = torch.Generator().manual_seed(5)
    img, txt = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    neg = torch.cat([txt[:k].clone(), torch.randn(2, 8, generator=g)])
    kw = dict(negatives=neg, false_negative_threshold=0.9999)
    _, report = hn_clip_loss(img, txt, 0.1, return_stats=True, backend=backend, **kw)
    assert report.masked_pairs == k
    assert saturation_report(img, txt, 0.1, **kw).masked_pairs == k
    # a duplicated caption pair still counts its two entries (i, j) and (j, i), with or without negatives
    txt2 = torch.cat([txt[:1], txt[:1], txt[2:]])
    _, report = hn_clip_loss(img, txt2, 0.1, return_stats=True, backend=backend, **kw)
    # (0, 1) and (1, 0); negative 0 = t_0 in rows 0 and 1; negative 1 (the old t_1) in none; negative 2 = t_2 in row 2
    assert report.masked_pairs == 2 + 2 + (1 if k == 3 else 0)
