"""hnclip_kernels.diagnostics: every field against an explicit float64 loop, saturated and
mixed batches, chunking invariance, the row-statistics path, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from cases import ALL_BACKENDS, masked_case, masked_pairs_f64
from helpers import hn_clip_loss_f64
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.backends.softmax import RowStats
from hnclip_kernels.diagnostics import SaturationReport, report_from_row_stats, saturation_report

GAMMA = 0.5


def explicit_rows(img, txt, tau, gamma=GAMMA, normalize=True):
    """Per directional row (i2t rows 0..N−1, then t2i rows), by explicit loops in float64:
    the loss log(1 + Σ_k e^{d_k}), the negatives' entropy, and γ·cos(t_r, t_h) at the hardest
    negative h = argmax_{k≠r} Z_rk."""
    v, t = img.double(), txt.double()
    if normalize:
        v, t = F.normalize(v, dim=1), F.normalize(t, dim=1)
    n = v.shape[0]
    cos_tt = [[float(t[i] @ t[j]) for j in range(n)] for i in range(n)]
    z = [[(float(v[i] @ t[j]) + (gamma * cos_tt[i][j] if i != j else 0.0)) / tau for j in range(n)] for i in range(n)]
    out = []
    for direction in ("i2t", "t2i"):
        for r in range(n):
            row = z[r] if direction == "i2t" else [z[k][r] for k in range(n)]
            gaps = [row[k] - row[r] for k in range(n) if k != r]
            negs = [k for k in range(n) if k != r]
            top = max(gaps)
            s = sum(math.exp(g - top) for g in gaps)
            loss = math.log1p(math.exp(top) * s) if top < 700 else top + math.log(s)
            q = [math.exp(g - top) / s for g in gaps]
            entropy = -sum(p * math.log(p) for p in q if p > 0)
            h = negs[max(range(n - 1), key=lambda idx: gaps[idx])]
            out.append(dict(loss=loss, entropy=entropy, hard_margin=gamma * cos_tt[r][h]))
    return out


def naive_full(img, txt, tau, gamma=GAMMA):
    """What a user gets from F.cross_entropy on the full float32 logit matrix (both directions):
    the loss in float32 and bf16 (per-row values, averaged in float64) and the fraction of the
    2N rows whose autograd gradient on the positive logit is exactly 0 — plus the same fraction
    from softmax − 1 computed directly, which must agree."""
    v, t = F.normalize(img.float(), dim=1), F.normalize(txt.float(), dim=1)
    n = v.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    z = (v @ t.T + gamma * (t @ t.T).masked_fill(eye, 0.0)) / tau
    labels = torch.arange(n)
    ce32, ce16, lost, lost_softmax = [], [], 0, 0
    for logits in (z, z.T.contiguous()):
        leaf = logits.clone().requires_grad_(True)
        loss = F.cross_entropy(leaf, labels)  # mean, as a training loop calls it
        loss.backward()
        lost += int((leaf.grad.diagonal() == 0).sum())
        lost_softmax += int(((torch.softmax(logits, dim=1).diagonal() - 1) == 0).sum())
        ce32.append(F.cross_entropy(logits, labels, reduction="none").double())
        ce16.append(F.cross_entropy(logits.bfloat16(), labels, reduction="none").double())
    return dict(
        fp32=torch.cat(ce32).mean().item(),
        bf16=torch.cat(ce16).mean().item(),
        lost=lost / (2 * n),
        lost_softmax=lost_softmax / (2 * n),
    )


def random_pair(n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randn(n, d, generator=g, dtype=dtype)


def near_duplicates(n, d, seed, noise=1e-3, dtype=torch.float32):
    """Image i ≈ text i (cos ≈ 1), different pairs nearly orthogonal: saturated at τ = 0.01."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    img = base + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    txt = base + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    return img.to(dtype), txt.to(dtype)


def mixed(n, d, seed):
    """First half near-duplicate pairs (saturated), second half unrelated pairs (loss ≫ 1)."""
    img, txt = near_duplicates(n, d, seed)
    img[n // 2 :] = torch.randn(n - n // 2, d, generator=torch.Generator().manual_seed(seed + 1))
    return img, txt


def check_against_explicit(rep, img, txt, tau, threshold, rtol=1e-6):
    rows = explicit_rows(img, txt, tau)
    n = img.shape[0]
    assert rep.rows == 2 * n and rep.threshold == threshold
    exact = sum(r["loss"] for r in rows) / len(rows)
    assert rep.loss == pytest.approx(exact, rel=rtol * 10)
    assert rep.loss == pytest.approx(float(hn_clip_loss_f64(img, txt, tau, GAMMA)), rel=rtol * 10)
    assert rep.saturated_rows == sum(r["loss"] < threshold for r in rows) / len(rows)
    eff = sum(math.exp(r["entropy"]) for r in rows) / len(rows)
    assert rep.effective_negatives == pytest.approx(eff, rel=1e-5)
    margins = [r["hard_margin"] for r in rows]
    assert rep.hardest_margin_mean == pytest.approx(sum(margins) / len(margins), rel=1e-5, abs=1e-7)
    assert rep.hardest_margin_max == pytest.approx(max(margins), rel=1e-5, abs=1e-7)
    naive = naive_full(img, txt, tau)
    assert naive["lost"] == naive["lost_softmax"]  # autograd's p − 1 and softmax − 1 agree here
    assert rep.lost_positive_rows_fp32 == naive["lost"]
    assert rep.naive_fp32_loss == pytest.approx(naive["fp32"], rel=1e-5, abs=0.0)
    assert rep.naive_bf16_loss == pytest.approx(naive["bf16"], rel=1e-2, abs=0.0)
    return rows, naive


@pytest.mark.parametrize("n,d,tau,seed", [(8, 16, 0.07, 0), (33, 24, 0.2, 1), (64, 32, 0.05, 2)])
def test_random_batches_match_explicit(n, d, tau, seed):
    img, txt = random_pair(n, d, seed)
    rows = explicit_rows(img, txt, tau)
    losses = sorted(r["loss"] for r in rows)
    # a threshold halfway (geometrically) between two row losses, so the count is unambiguous
    threshold = math.sqrt(losses[n // 2] * losses[n // 2 + 1])
    rep = saturation_report(img, txt, tau, gamma=GAMMA, threshold=threshold, backend="torch")
    check_against_explicit(rep, img, txt, tau, threshold)
    assert rep.lost_positive_rows_fp32 == 0.0  # nothing saturated in a random batch
    assert rep.saturated_rows == pytest.approx((n // 2 + 1) / (2 * n))


def test_saturated_batch():
    """τ = 0.01, near-duplicate pairs: naive float32 CE is exactly 0 and every positive's gradient
    is gone, while the exact loss is positive and equals hn_clip_loss."""
    img, txt = near_duplicates(24, 64, seed=3)
    tau = 0.01
    rep = saturation_report(img, txt, tau)
    check_against_explicit(rep, img, txt, tau, 1e-3)
    assert rep.naive_fp32_loss == 0.0
    assert rep.naive_bf16_loss == 0.0
    assert rep.lost_positive_rows_fp32 == 1.0
    assert rep.saturated_rows == 1.0
    assert 0.0 < rep.loss < 1e-8
    assert rep.loss == float(hn_clip_loss(img, txt, tau, gamma=GAMMA))
    assert rep.loss == pytest.approx(float(hn_clip_loss(img.double(), txt.double(), tau, gamma=GAMMA)), rel=1e-4)


def test_mixed_batch_counts_each_direction():
    img, txt = mixed(16, 64, seed=4)
    rep = saturation_report(img, txt, 0.01, backend="cpp")
    _, naive = check_against_explicit(rep, img, txt, 0.01, 1e-3)
    assert rep.lost_positive_rows_fp32 == 0.5 and rep.saturated_rows == 0.5
    assert rep.naive_fp32_loss > 1.0 and rep.loss > 1.0


def test_float64_features():
    img, txt = mixed(12, 32, seed=5)
    img, txt = img.double(), txt.double()
    rep = saturation_report(img, txt, 0.02)
    check_against_explicit(rep, img, txt, 0.02, 1e-3)
    assert rep.loss == pytest.approx(float(hn_clip_loss_f64(img, txt, 0.02)), rel=1e-9)


@pytest.mark.parametrize("maker", [random_pair, near_duplicates, mixed])
def test_chunking_invariance(maker):
    img, txt = maker(20, 16, 6)
    reports = [saturation_report(img, txt, 0.03, chunk_rows=c) for c in (1, 3, 20, 1024)]
    for rep in reports[1:]:
        for field, value in rep.as_dict().items():
            if value is None:  # masked_pairs without masking
                assert getattr(reports[0], field) is None, field
                continue
            # the naive float32 losses are as sensitive to the logits' last bits as a user's own
            # F.cross_entropy (a BLAS may round a dot product differently for another chunk shape)
            tol = dict(naive_fp32_loss=(1e-6, 1e-5), naive_bf16_loss=(1e-2, 0.0)).get(field, (1e-6, 1e-12))
            assert value == pytest.approx(getattr(reports[0], field), rel=tol[0], abs=tol[1]), field


def test_bounds_over_many_batches():
    for seed in range(6):
        for tau in (0.01, 0.07, 1.0):
            n = 4 + 5 * seed
            img, txt = random_pair(n, 8, seed) if seed % 2 else mixed(n, 8, seed)
            rep = saturation_report(img, txt, tau, gamma=0.3 * seed)
            for frac in (rep.saturated_rows, rep.lost_positive_rows_fp32):
                assert 0.0 <= frac <= 1.0
            assert 1.0 - 1e-9 <= rep.effective_negatives <= n - 1 + 1e-6
            assert rep.hardest_margin_mean <= rep.hardest_margin_max + 1e-12
            assert abs(rep.hardest_margin_max) <= 0.3 * seed + 1e-6
            assert rep.loss >= 0 and rep.naive_fp32_loss >= 0 and rep.naive_bf16_loss >= 0


def test_inputs_untouched_and_no_graph():
    img, txt = random_pair(6, 5, 7)
    img.requires_grad_(True)
    tau = torch.tensor(0.05, requires_grad=True)
    before = img.detach().clone()
    rep = saturation_report(img, txt, tau)
    assert isinstance(rep, SaturationReport)
    assert img.grad is None and tau.grad is None and torch.equal(img.detach(), before)
    normed = F.normalize(img.detach(), dim=1), F.normalize(txt, dim=1)
    rep_pre = saturation_report(*normed, 0.05, normalize=False)
    for field, value in rep.as_dict().items():
        if value is None:  # masked_pairs without masking
            assert getattr(rep_pre, field) is None, field
            continue
        assert value == pytest.approx(getattr(rep_pre, field), rel=1e-5, abs=1e-7), field


def stats_from_logits(z):
    """RowStats of each row of a float64 logit matrix (positives on the diagonal)."""
    n = z.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    pos = z.diagonal()
    gaps = z - pos[:, None]
    neg = gaps.masked_fill(eye, float("-inf"))
    delta = torch.logsumexp(neg, dim=1)
    mean_neg = (torch.softmax(neg, dim=1) * gaps.masked_fill(eye, 0.0)).sum(dim=1)
    return RowStats(pos, delta, mean_neg, gaps.masked_fill(eye, 0.0).sum(dim=1))


def logits64(img, txt, tau, gamma=GAMMA):
    v, t = F.normalize(img.double(), dim=1), F.normalize(txt.double(), dim=1)
    eye = torch.eye(v.shape[0], dtype=torch.bool)
    return (v @ t.T + gamma * (t @ t.T).masked_fill(eye, 0.0)) / tau


@pytest.mark.parametrize("maker,tau", [(random_pair, 0.1), (mixed, 0.01), (near_duplicates, 0.01)])
def test_report_from_row_stats(maker, tau):
    img, txt = maker(16, 32, 8)
    z = logits64(img, txt, tau)
    rep = report_from_row_stats(stats_from_logits(z), stats_from_logits(z.T), threshold=1e-3)
    rows = explicit_rows(img, txt, tau)
    assert rep.rows == 32 and rep.threshold == 1e-3
    assert rep.loss == pytest.approx(sum(r["loss"] for r in rows) / 32, rel=1e-9)
    assert rep.saturated_rows == sum(r["loss"] < 1e-3 for r in rows) / 32
    assert rep.effective_negatives == pytest.approx(sum(math.exp(r["entropy"]) for r in rows) / 32, rel=1e-9)
    for field in (
        "naive_fp32_loss",
        "naive_bf16_loss",
        "lost_positive_rows_fp32",
        "hardest_margin_mean",
        "hardest_margin_max",
    ):
        assert getattr(rep, field) is None
    full = saturation_report(img.double(), txt.double(), tau)
    for field in ("loss", "saturated_rows", "effective_negatives", "rows"):
        assert getattr(rep, field) == pytest.approx(getattr(full, field), rel=1e-9), field


def test_report_from_row_stats_label_smoothing():
    img, txt = random_pair(10, 8, 9, dtype=torch.float64)
    z = logits64(img, txt, 0.1)
    rep = report_from_row_stats(stats_from_logits(z), stats_from_logits(z.T), label_smoothing=0.1, n_keys=10)
    assert rep.loss == pytest.approx(float(hn_clip_loss(img, txt, 0.1, label_smoothing=0.1)), rel=1e-12)
    plain = report_from_row_stats(stats_from_logits(z), stats_from_logits(z.T))
    assert plain.saturated_rows == rep.saturated_rows and plain.loss != rep.loss


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_report_from_backend_statistics(backend):
    """The statistics a backend saves in its forward (what HNClipLoss(return_stats=True) passes)
    give the same report fields as the materialising pass."""
    from hnclip_kernels import backends
    from hnclip_kernels.options import LossOptions

    if backend == "cpp" and backends.cpp_directional() is None:
        pytest.skip("the C++ extension is not built")
    img, txt = mixed(16, 32, 10)
    options = LossOptions(gamma=GAMMA, backend=backend).bind(img, txt, 0.02)
    _, (i2t, t2i) = backends.symmetric_losses(img, txt, torch.tensor(0.02), options, return_stats=True)
    rep = report_from_row_stats(i2t, t2i)
    full = saturation_report(img, txt, 0.02, backend=backend)
    assert rep.loss == pytest.approx(full.loss, rel=1e-6)
    assert rep.saturated_rows == full.saturated_rows == 0.5
    assert rep.effective_negatives == pytest.approx(full.effective_negatives, rel=1e-5)


X = torch.randn(4, 3)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(threshold=0.0), ValueError, "threshold"),
        (dict(threshold=-1e-3), ValueError, "threshold"),
        (dict(threshold=float("nan")), ValueError, "threshold"),
        (dict(threshold=float("inf")), ValueError, "threshold"),
        (dict(threshold="1e-3"), TypeError, "threshold"),
        (dict(threshold=True), TypeError, "threshold"),
        (dict(chunk_rows=0), ValueError, "chunk_rows"),
        (dict(chunk_rows=2.0), TypeError, "chunk_rows"),
        (dict(img=torch.randn(4)), ValueError, "img must be 2-D"),
        (dict(txt=torch.randn(5, 3)), ValueError, "same shape"),
        (dict(img=torch.ones(4, 3, dtype=torch.int64), txt=torch.ones(4, 3, dtype=torch.int64)), TypeError, "dtype"),
        (dict(img=torch.randn(1, 3), txt=torch.randn(1, 3)), ValueError, "N >= 2"),
        (dict(img=torch.randn(4, 3, device="meta"), txt=torch.randn(4, 3, device="meta")), ValueError, "meta"),
        (dict(tau=0.0), ValueError, "tau"),
        (dict(tau=torch.tensor([0.1, 0.2])), ValueError, "tau"),
        (dict(gamma=-0.5), ValueError, "gamma"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(normalize=1), TypeError, "normalize"),
    ],
)
def test_bad_input(kwargs, exc, match):
    args = dict(img=X, txt=X, tau=0.1)
    args.update(kwargs)
    img, txt, tau = args.pop("img"), args.pop("txt"), args.pop("tau")
    with pytest.raises(exc, match=match):
        saturation_report(img, txt, tau, **args)


def test_report_from_row_stats_bad_input():
    s = RowStats(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="threshold"):
        report_from_row_stats(s, s, threshold=0)
    with pytest.raises(ValueError, match="same length"):
        report_from_row_stats(s, RowStats(*(torch.zeros(3) for _ in range(4))))
    with pytest.raises(ValueError, match="1-D"):
        report_from_row_stats(s, RowStats(*(torch.zeros(4, 1) for _ in range(4))))
    with pytest.raises(TypeError, match="t2i.delta"):
        report_from_row_stats(s, RowStats(None, [0.0], None, None))
    with pytest.raises(ValueError, match="n_keys"):
        report_from_row_stats(s, s, label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        report_from_row_stats(s, s, label_smoothing=1.0, n_keys=4)


def test_no_negatives_row_statistics():
    """A row without negatives (N = 1, δ = −inf) has loss 0 and 0 effective negatives."""
    s = RowStats(torch.zeros(1), torch.full((1,), float("-inf")), torch.zeros(1), torch.zeros(1))
    rep = report_from_row_stats(s, s)
    assert rep.loss == 0.0 and rep.effective_negatives == 0.0 and rep.saturated_rows == 1.0


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_hn_clip_loss_module_return_stats(backend, eps):
    # HNClipLoss(return_stats=True) fills last_stats from the statistics its own forward saved
    from cases import ALL_BACKENDS, make_pair
    from hnclip_kernels import HNClipLoss

    if backend not in ALL_BACKENDS:
        pytest.skip(f"{backend} not built")
    img, txt = make_pair(14, 8, seed=3, aligned=0.9)
    img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    module = HNClipLoss(gamma=GAMMA, label_smoothing=eps, backend=backend, return_stats=True)
    assert module.last_stats is None
    loss = module(img, txt, torch.tensor(1 / 0.03))
    stats = module.last_stats
    full = saturation_report(img, txt, 0.03, gamma=GAMMA, backend="torch")
    assert isinstance(stats, SaturationReport) and stats.rows == 2 * 14
    assert math.isclose(stats.loss, loss.item(), rel_tol=1e-6)
    if eps == 0.0:
        assert math.isclose(stats.loss, full.loss, rel_tol=1e-5)
    assert stats.saturated_rows == full.saturated_rows
    assert math.isclose(stats.effective_negatives, full.effective_negatives, rel_tol=1e-4)
    assert stats.naive_fp32_loss is None and stats.hardest_margin_max is None
    assert "contrastive_loss" in module(img, txt, torch.tensor(1 / 0.03), output_dict=True)  # the dict is unchanged


def test_return_stats_meta_and_misaligned_dsum():
    # return_stats with meta features returns a meta loss and no stats; a dsum of the wrong
    # length raises instead of giving a misaligned report
    from hnclip_kernels import HNClipLoss

    module = HNClipLoss(backend="torch", return_stats=True)
    loss = module(torch.empty(5, 4, device="meta"), torch.empty(5, 4, device="meta"), torch.tensor(10.0))
    assert loss.device.type == "meta" and module.last_stats is None
    d, m = torch.zeros(5), torch.zeros(5)
    with pytest.raises(ValueError, match="dsum"):
        report_from_row_stats(
            RowStats(None, d, m, torch.zeros(6)), RowStats(None, d, m, torch.zeros(4)), label_smoothing=0.1, n_keys=5
        )


# ---- false-negative masking ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_masked_pairs_are_reported_by_both_reports(backend):
    # duplicate captions (tests/cases.py, masked_case): both reports count the masked entries as the
    # float64 mask does, and agree on the fields they share; HNClipLoss's report too (kept counts)
    img, txt, threshold = masked_case("duplicates", 12, 16, dtype=torch.float32)
    expected = masked_pairs_f64(txt, threshold)
    assert expected == 8  # captions 2 = 5 = 9 (6 ordered pairs) and 7 = 11 (2)
    full = saturation_report(img, txt, 0.07, backend=backend, false_negative_threshold=threshold)
    assert full.masked_pairs == expected
    module = HNClipLoss(backend=backend, normalize=True, return_stats=True, false_negative_threshold=threshold)
    loss = module(img, txt, torch.tensor(1 / 0.07))
    quick = module.last_stats
    assert quick.masked_pairs == expected
    for field in ("loss", "saturated_rows", "effective_negatives"):
        assert getattr(quick, field) == pytest.approx(getattr(full, field), rel=1e-5), field
    assert quick.loss == pytest.approx(float(loss), rel=1e-6)
    plain = saturation_report(img, txt, 0.07, backend=backend)
    assert plain.masked_pairs is None and plain.loss > full.loss  # the duplicates' impossible terms are gone


def test_masked_report_of_a_row_without_negatives():
    # "all_masked": row 0 keeps no negative in either direction: 0 effective negatives there, no NaN
    img, txt, threshold = masked_case("all_masked", 12, 16, dtype=torch.float32)
    rep = saturation_report(img, txt, 0.07, backend="torch", false_negative_threshold=threshold)
    assert rep.masked_pairs == masked_pairs_f64(txt, threshold) == 22
    values = [v for v in rep.as_dict().values() if isinstance(v, float)]
    assert all(math.isfinite(v) for v in values), rep
    with pytest.raises(ValueError, match="false_negative_threshold"):
        saturation_report(img, txt, 0.07, false_negative_threshold=2.0)
