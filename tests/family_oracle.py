"""The float64 oracle of the hard-negative family (``negatives``, ``group_ids``, ``margin``) and the
checks every backend's family tests run against it (tests/api/test_hard_negatives*.py; the
distributed family test uses :func:`family_rows_f64` with separate query and key copies).

The oracle forms the dense N × (N + M) image→text and N × N text→image logits straight from the
formula (docs/hard_negatives.md), in float64, without calling the package. :func:`check` compares
the loss and every gradient (img, txt, negatives, τ) of a backend with it.

Tolerances (relative, float64 norms; ``helpers.rel_err``): float64 inputs 1e-10 (gradients 1e-9);
float32 inputs loss 1e-5, gradients 1e-4 (the README's float32 bounds); 16-bit inputs (the oracle
evaluated on the 16-bit values) loss 1e-5, gradients 2^-7 (bf16) / 2^-10 (fp16): the result is
rounded once to the input dtype. Per-row checks (:func:`rows_agree`): each row against the
oracle's row, relative to that row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import assume
from hypothesis import strategies as st

from helpers import rel_err
from hnclip_kernels import hn_clip_loss

# the margin's factor rows per kind, written from the formula: (i2t's query side against the key
# captions, t2i's key side against the query captions). A kind missing here is a KeyError: a new
# Margin member fails every oracle test until its formula is written down.
MARGIN_FACTORS = {
    "text": lambda vq, tq, vk, tk: (tq, tk),  # sg(t_i·x), sg(t_k·t_i)
    "image_text": lambda vq, tq, vk, tk: (vq, vk),  # sg(v_i·x), sg(v_i·t_k)
}


def family_rows_f64(vq, tq, vk, tk, nk, tau, *, margin="text", gamma=0.5, label_smoothing=0.0, threshold=None,
                    group_ids=None, captions=None):  # fmt: skip
    """Per-pair rows ½(CE_i2t_i + CE_t2i_i) from the formula, in the dtype given (float64), dense,
    autograd kept: queries (vq, tq) against keys (vk, tk, nk), equal values as separate tensors (a
    caller may hold one side constant), used as given (normalise first).

    i2t row i over x ∈ [t_1..t_N, n_1..n_M]: Z_ix = (v_i·x + γ·h(i, x)·[x ≠ t_i]) / τ with
    h = sg(t_i·x) ("text") or sg(v_i·x) ("image_text"); t2i row k over the images:
    Z_ki = (t_k·v_i + γ·h'(k, i)·[i ≠ k]) / τ with h' = sg(t_k·t_i) or sg(v_i·t_k). Dropped:
    the captions' cosine ≥ ``threshold`` (``captions``: the unit (query, key, negative) captions it
    compares; default the detached tq, tk, nk), equal group ids (caption columns only); ε spreads
    over each row's kept classes (the positive included). A row with every column dropped has loss
    0 and no gradient."""
    n, m = vq.shape[0], nk.shape[0]
    x = torch.cat([tk, nk])
    eye_x = torch.zeros(n, n + m, dtype=torch.bool)
    eye_x[:, :n] = torch.eye(n, dtype=torch.bool)
    eye = torch.eye(n, dtype=torch.bool)
    query_factor, key_factor = MARGIN_FACTORS[str(margin)](vq, tq, vk, tk)
    h_i2t = (query_factor @ x.T).detach().masked_fill(eye_x, 0.0)
    h_t2i = (tq @ key_factor.T).detach().masked_fill(eye, 0.0)
    z_i2t = (vq @ x.T + gamma * h_i2t) / tau
    z_t2i = (tq @ vk.T + gamma * h_t2i) / tau
    drop_i2t, drop_t2i = eye_x.clone(), eye.clone()
    if threshold is not None:
        cq, ck, cn = (tq.detach(), tk.detach(), nk.detach()) if captions is None else captions
        drop_i2t |= cq @ torch.cat([ck, cn]).T >= threshold
        drop_t2i |= cq @ ck.T >= threshold
    if group_ids is not None:
        same = group_ids[:, None] == group_ids[None, :]
        drop_i2t[:, :n] |= same
        drop_t2i |= same
    rows = []
    for z, drop in ((z_i2t, drop_i2t), (z_t2i, drop_t2i)):
        pos = z.diagonal()  # column i of row i: t_i for i2t, v_i for t2i
        gaps = z - pos[:, None]
        empty = drop.all(dim=1)
        lse = torch.logsumexp(gaps.masked_fill(drop, float("-inf")).masked_fill(empty[:, None], 0.0), dim=1)
        nll = torch.logaddexp(torch.zeros_like(pos), lse.masked_fill(empty, float("-inf")))
        kept = (~drop).sum(dim=1) + 1
        kept_mean = (z.masked_fill(drop, 0.0).sum(dim=1) + pos) / kept
        rows.append(nll + label_smoothing * (pos - kept_mean))
    return 0.5 * (rows[0] + rows[1])


def family_f64(img, txt, tau, negatives=None, group_ids=None, margin="text", gamma=0.5, label_smoothing=0.0,
               normalize=True, threshold=None):  # fmt: skip
    """:func:`family_rows_f64` of one batch in float64 (queries and keys the same tensors),
    normalised when ``normalize``; the threshold compares the captions' cosine, also with
    ``normalize=False``."""
    v, t = img.double(), txt.double()
    n = torch.zeros(0, v.shape[1], dtype=torch.float64) if negatives is None else negatives.double()
    tau = tau.double() if isinstance(tau, torch.Tensor) else torch.tensor(float(tau), dtype=torch.float64)
    if normalize:
        v, t, n = (F.normalize(x, dim=1) for x in (v, t, n))
    captions = None
    if threshold is not None:
        tu = F.normalize(txt.double().detach(), dim=1)
        nu = tu[:0] if negatives is None else F.normalize(negatives.double().detach(), dim=1)
        captions = (tu, tu, nu)
    kw = dict(margin=margin, gamma=gamma, label_smoothing=label_smoothing, threshold=threshold, group_ids=group_ids)
    return family_rows_f64(v, t, v, t, n, tau, captions=captions, **kw)


def features(n, d, seed, dtype=torch.float32, clusters=None, spread=0.05):
    """(n, d) random features; ``clusters``: rows near that many centres (near-duplicates)."""
    gen = torch.Generator().manual_seed(seed)
    if clusters is None:
        x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    else:
        centres = torch.randn(clusters, d, generator=gen, dtype=torch.float64)
        x = centres[torch.arange(n) % clusters] + spread * torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x.to(dtype)


GRAD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
LOSS_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}
# a saturated batch's rows: float32 logit gaps up to (2 + γ)/τ = 250 carry ~(2 + γ)/τ · 2^-24 of
# absolute rounding, the relative error of the row's loss and gradient (measured: 2.3e-5): 4×
SATURATED_TOL = 4 * (2 + 0.5) / 0.01 * 2.0**-24


def run_both(img, txt, neg, tau, *, reduction="mean", backend="torch", **kw):
    """(loss, grads) of hn_clip_loss(backend=backend) and of the oracle on the same values."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
    if neg is not None:
        leaves.append(neg.detach().clone().requires_grad_(True))
    tau_t = torch.tensor(tau, dtype=torch.float64 if img.dtype == torch.float64 else torch.float32, requires_grad=True)
    got = hn_clip_loss(
        leaves[0], leaves[1], tau_t, negatives=leaves[2] if neg is not None else None, reduction=reduction,
        backend=backend, **_api(kw),
    )  # fmt: skip
    upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64).reshape(got.shape)
    # M = 0 is None: the empty negatives take no part (no gradient, not even zeros)
    got_grads = torch.autograd.grad((got.double() * upstream).sum(), leaves + [tau_t], allow_unused=True)
    got_grads = [torch.zeros_like(x) if g is None else g for g, x in zip(got_grads, leaves + [tau_t])]
    ref_leaves = [x.detach().double().requires_grad_(True) for x in leaves]
    ref_tau = torch.tensor(float(tau_t.detach()), dtype=torch.float64, requires_grad=True)
    rows = family_f64(ref_leaves[0], ref_leaves[1], ref_tau, ref_leaves[2] if neg is not None else None, **kw)
    want = {"mean": rows.mean(), "sum": rows.sum(), "none": rows}[reduction]
    want_grads = torch.autograd.grad((want * upstream).sum(), ref_leaves + [ref_tau])
    names = ["img", "txt"] + (["negatives"] if neg is not None else []) + ["tau"]
    return got, want, dict(zip(names, got_grads)), dict(zip(names, want_grads))


def _api(kw):
    out = dict(kw)
    if "threshold" in out:
        out["false_negative_threshold"] = out.pop("threshold")
    return out


def worst_errors(img, txt, neg, tau, backend="torch", **kw):
    """{"loss": rel err, "d img": ..., ...} of ``backend`` against the oracle."""
    got, want, gg, wg = run_both(img, txt, neg, tau, backend=backend, **kw)
    errs = {"loss": rel_err(got, want)}
    errs.update({f"d {k}": rel_err(gg[k], wg[k]) for k in gg})
    return errs


def check(img, txt, neg, tau, dtype=torch.float32, backend="torch", **kw):
    errs = worst_errors(img, txt, neg, tau, backend, **kw)
    for name, err in errs.items():
        tol = LOSS_TOL[dtype] if name == "loss" else GRAD_TOL[dtype]
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} ({kw})"
    return errs


def rows_agree(got, want, gg, wg, tol):
    """Each row of ``got`` and of every gradient in ``gg`` within ``tol`` of ``want``'s / ``wg``'s,
    relative to that row (a gradient row within 1e-30 absolute passes: both are zero)."""
    for i in range(got.shape[0]):
        assert rel_err(got[i], want[i]) <= tol, f"row {i}: {got[i].item():.6e} vs {want[i].item():.6e}"
    for name in gg:
        g, w = gg[name].double(), wg[name].double()
        if g.dim() == 0:
            assert rel_err(g, w) <= tol, name
            continue
        for i in range(g.shape[0]):
            assert rel_err(g[i], w[i]) <= tol or (g[i] - w[i]).norm() <= 1e-30, f"d {name} row {i}"


# ----------------------------------------------------------------------------- the shared cases

N, D = 6, 8
GROUPS = {
    "random": torch.tensor([0, 2, 0, 1, 2, 5]),
    "one": torch.zeros(N, dtype=torch.long),
    "distinct": torch.arange(N, dtype=torch.int32),
}
M_SIZES = [0, 1, 7, N, 3 * N + 1]
MARGINS = ["text", "image_text"]
# the options of every backend's sweep over options × dtypes × margins (:func:`check_combination`)
OPTIONS = {
    "threshold": dict(threshold=0.3),
    "smoothing": dict(label_smoothing=0.1),
    "unnormalized": dict(normalize=False),
    "all": dict(threshold=0.3, label_smoothing=0.1, normalize=False, group_ids=GROUPS["random"]),
    "gamma0-one-group": dict(gamma=0.0, label_smoothing=0.2, group_ids=GROUPS["one"]),
    "threshold-distinct": dict(threshold=0.3, group_ids=GROUPS["distinct"]),
}


def check_negatives(backend, m, margin):
    """M = ``m`` negatives (τ = 0.07) against the oracle."""
    img, txt, neg = features(N, D, 1), features(N, D, 2), features(m, D, 3)
    check(img, txt, neg, 0.07, backend=backend, margin=margin)


def check_group_ids(backend, groups, margin, m):
    """The ids ``GROUPS[groups]`` (τ = 0.1), with M = ``m`` negatives or none, against the oracle."""
    img, txt, neg = features(N, D, 4), features(N, D, 5), features(m, D, 6)
    check(img, txt, neg if m else None, 0.1, backend=backend, group_ids=GROUPS[groups], margin=margin)


def check_combination(backend, dtype, options, margin):
    """One case of the sweep: ``OPTIONS[options]`` on ``dtype`` features (τ = 0.05, M = 5)."""
    options = OPTIONS[options]
    img, txt, neg = (features(n, D, s, dtype) for n, s in ((N, 7), (N, 8), (5, 9)))
    if options.get("normalize") is False:  # near-unit rows: dot products of the given features
        img, txt, neg = (F.normalize(x.double(), dim=1).to(dtype) for x in (img, txt, neg))
    if "threshold" in options:  # every caption cosine away from the threshold (float32 vs float64 compare)
        xs = F.normalize(torch.cat([txt, neg]).double(), dim=1)
        assert ((F.normalize(txt.double(), dim=1) @ xs.T - options["threshold"]).abs() > 1e-4).all()
    return check(img, txt, neg, 0.05, dtype, backend=backend, margin=margin, **options)


def saturated_batch():
    """τ = 0.01's saturated batch (float32 img, txt, negatives and each pair's centre): each pair
    near its own centre (losses down to e^-100), pairs 0-2 near one centre (near-duplicate captions:
    unsaturated rows), negatives near the first centres (hard); with ids, the near-duplicates share
    one (the centre's)."""
    n, d, m = 12, 16, 9
    centre_of = torch.tensor([0, 0, 0] + list(range(1, n - 2)))
    centres = F.normalize(features(n, d, 10, torch.float64), dim=1)[centre_of]
    img = (centres + 0.02 * features(n, d, 11, torch.float64)).float()
    txt = (centres + 0.02 * features(n, d, 12, torch.float64)).float()
    neg = (centres[3 : 3 + m] + 0.3 * features(m, d, 13, torch.float64)).float()
    return img, txt, neg, centre_of


def check_saturated_rows(backend, margin, with_ids):
    """:func:`saturated_batch` on ``backend``: its rows' losses span many orders of magnitude; each
    row and each gradient row against the oracle within :data:`SATURATED_TOL`."""
    img, txt, neg, centre_of = saturated_batch()
    ids = centre_of if with_ids else None
    got, want, gg, wg = run_both(img, txt, neg, 0.01, reduction="none", backend=backend, margin=margin, group_ids=ids)
    assert want.min() < 1e-10 and want.max() > 1.0  # saturated and unsaturated rows in one batch
    rows_agree(got, want, gg, wg, SATURATED_TOL)


def check_backends_agree_per_row(want_backend, got_backend, margin, dtype):
    """:func:`saturated_batch` in ``dtype`` with ids, ε and a threshold on both backends: each row
    and each gradient row of ``got_backend`` within float32's 1e-4 (bf16: 2^-7) of ``want_backend``'s."""
    img, txt, neg, centre_of = (x.to(dtype) if x.is_floating_point() else x for x in saturated_batch())
    kw = dict(group_ids=centre_of, margin=margin, label_smoothing=0.1, false_negative_threshold=0.9)
    out = []
    for backend in (want_backend, got_backend):
        leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt, neg)]
        tau = torch.tensor(0.01, requires_grad=True)
        rows = hn_clip_loss(leaves[0], leaves[1], tau, negatives=leaves[2], **kw, reduction="none", backend=backend)
        upstream = torch.linspace(0.5, 1.5, rows.numel())
        grads = torch.autograd.grad((rows * upstream).sum(), [*leaves, tau])
        out.append((rows.detach(), dict(zip(("img", "txt", "negatives", "tau"), grads))))
    (want, wg), (got, gg) = out
    rows_agree(got, want, gg, wg, 1e-4 if dtype == torch.float32 else 2.0**-7)


def flop_counter(backend, img, txt, neg):
    """``count(family=True, **options)``: ``FlopCounterMode``'s total of one forward and backward of
    ``hn_clip_loss`` (τ = 0.1) on ``backend``, with ``neg`` as the negatives when ``family``."""
    from torch.utils.flop_counter import FlopCounterMode

    def count(family=True, **kw):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
        extra = dict(negatives=leaves[2]) if family else {}
        with FlopCounterMode(display=False) as mode:
            hn_clip_loss(leaves[0], leaves[1], 0.1, backend=backend, **extra, **kw).backward()
        return mode.get_total_flops()

    return count


# the hypothesis draws of every backend's oracle test
FAMILY_DRAWS = dict(
    n=st.integers(1, 7),
    d=st.integers(2, 6),
    m=st.integers(0, 9),
    tau=st.sampled_from([0.02, 0.07, 0.3, 1.0]),
    gamma=st.sampled_from([0.0, 0.5, 2.0]),
    eps=st.sampled_from([0.0, 0.1]),
    n_groups=st.sampled_from([None, 1, 2, 4]),
    margin=st.sampled_from(["text", "image_text"]),
    threshold=st.sampled_from([None, 0.4]),
    seed=st.integers(0, 2**16),
)


def check_draw(backend, n, d, m, tau, gamma, eps, n_groups, margin, threshold, seed):
    """One :data:`FAMILY_DRAWS` draw against the oracle on ``backend`` (pairs within 1e-4 of the
    threshold are drawn again: their mask flips with rounding)."""
    img, txt, neg = features(n, d, seed), features(n, d, seed + 1), features(m, d, seed + 2)
    if threshold is not None:
        xs = F.normalize(torch.cat([txt, neg]).double(), dim=1)
        assume(((F.normalize(txt.double(), dim=1) @ xs.T - threshold).abs() > 1e-4).all())
    ids = None if n_groups is None else torch.randint(0, n_groups, (n,), generator=torch.Generator().manual_seed(seed))
    kw = dict(margin=margin, gamma=gamma, label_smoothing=eps, threshold=threshold, group_ids=ids)
    check(img, txt, neg if m else None, tau, backend=backend, **kw)


def assert_compiled_equals_eager(backend: str):
    """``hn_clip_loss`` with every family option under ``torch.compile(fullgraph=True)``
    (aot_eager: the fused operators are opaque custom ops on CPU; a graph break raises): loss and
    every gradient equal to eager, to the bit."""
    torch._dynamo.reset()
    img, txt, neg = features(N, D, 21), features(N, D, 22), features(4, D, 23)
    ids = GROUPS["random"]

    def fn(a, b, c, tau):
        return hn_clip_loss(
            a, b, tau, negatives=c, group_ids=ids, margin="image_text", false_negative_threshold=0.5,
            label_smoothing=0.1, backend=backend,
        )  # fmt: skip

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = []
    for f in (fn, compiled):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
        tau = torch.tensor(0.1, requires_grad=True)
        loss = f(*leaves, tau)
        out.append((loss.detach(), *torch.autograd.grad(loss, [*leaves, tau])))
    for name, x, y in zip(("loss", "d img", "d txt", "d neg", "d tau"), *out):
        assert torch.equal(x, y), name
