"""Shared test inputs and the check that runs any backend against the float64 truth."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from helpers import assert_close_rel, hn_clip_loss_f64, rel_err
from hnclip_kernels import hn_clip_loss

SIZES_N = (1, 2, 15, 16, 17, 65, 130)
SIZES_D = (3, 8, 64, 100)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GAMMAS = (0.0, 0.5, 2.0)
TAUS = (0.01, 0.07, 1.0)
SMOOTHINGS = (0.0, 0.1)
REDUCTIONS = ("mean", "sum", "none")

# Tolerances (relative error in norm against the float64 formula on the same upcast inputs).
TOL_F32_LOSS, TOL_F32_GRAD = 1e-5, 1e-4
TOL_LOWP_LOSS = 1e-3
# Saturated regime (τ = 0.01, true loss < 1e-20): each row's loss is exp(d) of a few hardest
# negatives with |d| ≈ 50-100, so any float32 evaluation carries a relative error of about
# |d|·2⁻²⁴·(a few) ≈ 1e-5 from float32 logits and dot products alone (half an ulp of a logit
# of 100 is 4e-6). Over 48 such batches the float32 torch backend exceeded 1e-5 in 30 (max
# 2.3e-5), Triton in 15 (max 1.3e-5), the C++ kernel in 11 (max 1.5e-5). The loss is held to
# 3e-5 there; gradients keep 1e-4.
TOL_F32_LOSS_SATURATED = 3e-5


def covering_cases():
    """Every (N, D) pair once, the other axes rotated so each of their values appears
    many times and in different combinations (a full product would take hours in the
    Triton interpreter)."""
    others = list(itertools.product(DTYPES, GAMMAS, TAUS, SMOOTHINGS, REDUCTIONS))
    cases = []
    for start, step in ((0, 37), (81, 53)):  # steps coprime with 162: walk through the combinations
        for idx, (n, d) in enumerate(itertools.product(SIZES_N, SIZES_D)):
            dtype, gamma, tau, eps, red = others[(start + idx * step) % len(others)]
            cases.append((n, d, dtype, gamma, tau, eps, red))
    return cases


def case_id(case) -> str:
    n, d, dtype, gamma, tau, eps, red = case
    return f"N{n}-D{d}-{str(dtype).split('.')[-1]}-g{gamma}-tau{tau}-ls{eps}-{red}"


def make_pair(n: int, d: int, dtype=torch.float32, seed: int = 0, aligned: float = 0.0):
    """Random (img, txt); ``aligned`` > 0 pulls each caption towards its image (trained model)."""
    gen = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=gen, dtype=torch.float64)
    txt = torch.randn(n, d, generator=gen, dtype=torch.float64)
    if aligned:
        txt = img + (1.0 - aligned) * txt
    return img.to(dtype), txt.to(dtype)


def check_against_truth(
    backend,
    n,
    d,
    dtype,
    gamma,
    tau,
    eps,
    reduction,
    *,
    tau_grad=True,
    upstream=None,
    normalize=True,
    img=None,
    txt=None,
    seed=0,
    loss_tol=None,
    threshold=None,
    errors=None,
):
    """Run ``backend`` and the float64 truth on the same inputs; assert loss and all grads.
    ``threshold``: false-negative masking at that caption cosine (both sides). ``errors``: a
    dict that receives the relative errors (loss, d img, d txt, d tau) for reporting."""
    if img is None:
        img, txt = make_pair(n, d, dtype, seed=seed)
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
    tau_arg = torch.tensor(tau, dtype=torch.float32, requires_grad=True) if tau_grad else tau
    loss = hn_clip_loss(
        leaves[0],
        leaves[1],
        tau_arg,
        gamma=gamma,
        label_smoothing=eps,
        reduction=reduction,
        normalize=normalize,
        backend=backend,
        **({} if threshold is None else {"false_negative_threshold": threshold}),
    )
    ref_leaves = [x.detach().double().requires_grad_(True) for x in (img, txt)]
    ref_tau = torch.tensor(tau, dtype=torch.float64, requires_grad=True)
    ref = hn_clip_loss_f64(
        ref_leaves[0], ref_leaves[1], ref_tau, gamma, eps, reduction, normalize, false_negative_threshold=threshold
    )
    if errors is not None:
        errors["loss"] = rel_err(loss, ref)

    assert loss.dtype == torch.float32
    lowp = dtype in (torch.float16, torch.bfloat16)
    assert_close_rel(loss, ref, loss_tol or (TOL_LOWP_LOSS if lowp else TOL_F32_LOSS), "loss")
    if upstream is None:
        upstream = torch.ones_like(ref) if reduction == "none" else torch.ones(())
    loss.backward(upstream.to(loss.dtype))
    ref.backward(upstream.double())
    if errors is not None:
        errors.update(
            {"d img": rel_err(leaves[0].grad, ref_leaves[0].grad), "d txt": rel_err(leaves[1].grad, ref_leaves[1].grad)}
        )
        if tau_grad:
            errors["d tau"] = rel_err(tau_arg.grad, ref_tau.grad)
    for leaf, ref_leaf, name in zip(leaves, ref_leaves, ("d img", "d txt")):
        assert leaf.grad.dtype == dtype, f"{name} dtype {leaf.grad.dtype} != input dtype {dtype}"
        if lowp:
            # gradients rounded to the input dtype: judge against the float64 truth rounded likewise
            floor = (ref_leaf.grad.to(dtype).double() - ref_leaf.grad).norm() / ref_leaf.grad.norm().clamp_min(1e-300)
            assert_close_rel(leaf.grad, ref_leaf.grad, 2 * float(floor) + 2e-3, name)
        else:
            assert_close_rel(leaf.grad, ref_leaf.grad, TOL_F32_GRAD, name)
    if tau_grad:
        assert_close_rel(tau_arg.grad, ref_tau.grad, TOL_LOWP_LOSS if lowp else TOL_F32_GRAD, "d tau")
    return loss


def naive_clip_loss(img, txt, tau, gamma=0.0):
    """What a user writes by hand: logits in the input dtype, F.cross_entropy."""
    v, t = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    n = v.shape[0]
    margin = (t @ t.T).detach() * (1 - torch.eye(n, dtype=v.dtype))
    z = (v @ t.T + gamma * margin) / tau
    labels = torch.arange(n)
    return 0.5 * (F.cross_entropy(z, labels) + F.cross_entropy(z.T, labels))


def fused_backends():
    """The fused backends testable here: triton (interpreted on CPU) and cpp when built."""
    from hnclip_kernels.backends import cpp_directional

    return ["triton"] + (["cpp"] if cpp_directional() is not None else [])


# A new backend is added here (and in fused_backends() when it is fused): the shared checks of
# test_api.py, test_properties.py and test_backends.py then run on it with no other change.
ALL_BACKENDS = ["torch"] + fused_backends()


def saturated_pair(seed: int, n: int = 40, d: int = 128):
    """Well-separated pairs for τ = 0.01: the true loss is < 1e-20 (asserted by the callers)."""
    return make_pair(n, d, torch.float32, seed=seed, aligned=0.95)


def directional_case(kind, m=5, n=19, d=8, offset=7, dtype=torch.float32, seed=4):
    """(queries, keys, query_txt, key_txt) of one direction as a rank of a distributed job sees it:
    m local query rows against n global keys, the positive of row i at column ``offset + i``.
    ``kind``: "i2t", "t2i" or "general" (margin factors unrelated to the features)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(m, d, generator=gen), torch.randn(n, d, generator=gen)
    k[offset : offset + m] = q + 0.1 * k[offset : offset + m]
    if kind == "i2t":  # q local images, k = b global texts, a the local slice of the texts
        b = k
        a = k[offset : offset + m]
    elif kind == "t2i":  # q = a local texts, k global images, b global texts
        b = torch.randn(n, d, generator=gen)
        b[offset : offset + m] = q
        a = q
    else:  # unrelated margin factors
        a, b = torch.randn(m, d, generator=gen), torch.randn(n, d, generator=gen)
    return [x.to(dtype) for x in (q, k, a, b)]


# ---- false-negative masking: batches with duplicate captions and the threshold that masks them
MASKED_KINDS = ("duplicates", "near", "all_masked")


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def masked_case(kind: str, n: int = 12, d: int = 16, seed: int = 0, dtype=torch.float64):
    """(img, txt, threshold), features in ``dtype``, every caption cosine off the diagonal (of the
    features as rounded to ``dtype``) at least 1e-3 from the threshold (asserted), so float32 and
    float64 mask the same pairs:

    * "duplicates": captions 2 = 5 = 9 (= n − 1 when n > 12) and 7 = 11 (= n // 2 when n > 12)
      exactly (bit-identical rows), threshold 0.99;
    * "near": captions of rows 1-4 at cosines 0.88, 0.895, 0.905, 0.92 from caption 0, and of rows
      6, 7 at 0.898 / 0.902 from caption 5, threshold 0.9: the near-duplicates either side of it;
    * "all_masked": caption 0 at cosine 0.8 from every other caption (those at 0.64 from each
      other), threshold 0.7: row 0's negatives are all masked in both directions.
    Images are their captions plus noise (a trained model's alignment)."""
    gen = torch.Generator().manual_seed(seed)
    txt = _unit(torch.randn(n, d, generator=gen, dtype=torch.float64))
    if kind == "duplicates":
        threshold = 0.99
        txt[5] = txt[2]
        txt[9] = txt[2]
        txt[11] = txt[7]
        if n > 12:  # duplicates in other tiles too
            txt[n - 1] = txt[2]
            txt[n // 2] = txt[7]
    elif kind == "near":
        threshold = 0.9
        for anchor, rows, cosines in ((0, (1, 2, 3, 4), (0.88, 0.895, 0.905, 0.92)), (5, (6, 7), (0.898, 0.902))):
            for row, c in zip(rows, cosines):
                w = txt[row] - (txt[row] @ txt[anchor]) * txt[anchor]
                txt[row] = c * txt[anchor] + (1.0 - c * c) ** 0.5 * _unit(w)
    elif kind == "all_masked":
        assert d >= n, "orthogonal directions for the other captions"
        threshold = 0.7
        basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        txt = torch.empty(n, d, dtype=torch.float64)
        txt[0] = basis[:, 0]
        for row in range(1, n):
            txt[row] = 0.8 * basis[:, 0] + 0.6 * basis[:, row]
    else:
        raise ValueError(kind)
    img = (txt + 0.6 * torch.randn(n, d, generator=gen, dtype=torch.float64) / d**0.5).to(dtype)
    txt = txt.to(dtype)
    cos = _unit(txt.double()) @ _unit(txt.double()).T
    off = cos[~torch.eye(n, dtype=torch.bool)]
    assert ((off - threshold).abs() > 1e-3).all(), "a cosine too close to the threshold: pick another seed"
    assert (off >= threshold).any(), "nothing masked"
    return img, txt, threshold


def masked_pairs_f64(txt, threshold) -> int:
    """How many (i, j), i ≠ j, the float64 mask drops (each pair counted in both orders)."""
    t = _unit(txt.double())
    cos = t @ t.T
    return int(((cos >= threshold) & ~torch.eye(t.shape[0], dtype=torch.bool)).sum())


# ---- the three loss ops against float64: saturated 16-bit features, non-finite and extreme inputs
def op_loss(op: str, backend: str, img, txt, tau: float, gamma: float, eps: float, threshold, m: int, offset: int):
    """(loss, leaves) of ``op`` on ``backend`` ("f64": the float64 truth on upcast inputs): "symmetric",
    the single-process mean loss (leaves img, txt, τ); "directional", i2t of the ``m`` rows at
    ``offset`` against the whole batch (img rows, all txt, τ); "rank", a rank's op on those rows
    (img rows, txt rows, all img, all txt, τ); both the mean over the M rows."""
    from hnclip_kernels.backends import directional_fn, rank_losses
    from hnclip_kernels.backends.pytorch.reference import directional_nll_torch
    from hnclip_kernels.options import LossOptions

    kw = dict(gamma=gamma, label_smoothing=eps, false_negative_threshold=threshold)
    tau_t = torch.tensor(tau, dtype=torch.float64 if backend == "f64" else torch.float32, requires_grad=True)
    if backend == "f64":
        img, txt = img.double(), txt.double()
    if op == "symmetric":
        leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
        loss = (
            hn_clip_loss_f64(*leaves, tau_t, **kw)
            if backend == "f64"
            else hn_clip_loss(*leaves, tau_t, backend=backend, **kw)
        )
        return loss, [*leaves, tau_t]
    all_img, all_txt = (x.detach().clone().requires_grad_(True) for x in (img, txt))
    loc_img, loc_txt = (x.detach()[offset : offset + m].clone().requires_grad_(True) for x in (img, txt))
    if op == "directional":
        fn = directional_nll_torch if backend == "f64" else directional_fn(backend)
        rows = fn(
            loc_img,
            all_txt,
            query_txt=loc_txt.detach(),
            key_txt=all_txt.detach(),
            tau=tau_t,
            offset=offset,
            normalize=True,
            **kw,
        )
        return rows.mean(), [loc_img, all_txt, tau_t]
    options = LossOptions(backend="torch" if backend == "f64" else backend, **kw)
    return rank_losses(loc_img, loc_txt, all_img, all_txt, tau_t, offset, options).mean(), [
        loc_img,
        loc_txt,
        all_img,
        all_txt,
        tau_t,
    ]


OP_GRADS = {
    "symmetric": ("d img", "d txt", "d tau"),
    "directional": ("d img", "d all_txt", "d tau"),
    "rank": ("d img", "d txt", "d all_img", "d all_txt", "d tau"),
}


def op_errors(
    op: str,
    backend: str,
    img,
    txt,
    tau: float,
    gamma: float = 0.5,
    eps: float = 0.0,
    threshold=None,
    m: int = 0,
    offset: int = 0,
) -> dict:
    """{name: (relative error, bound)} of ``op`` (:func:`op_loss`) on ``backend`` against float64:
    the loss (bound TOL_LOWP_LOSS), d τ (TOL_LOWP_LOSS) and each feature gradient (2× the error
    of rounding the float64 gradient to the features' dtype + 2e-3, the suite's 16-bit bound).
    The backward runs with a power-of-two loss scale S (a GradScaler's) that puts the largest
    true gradient entry in [½, 1): a saturated batch's float16 gradients would underflow without."""
    truth, ref_leaves = op_loss(op, "f64", img, txt, tau, gamma, eps, threshold, m, offset)
    ref_grads = torch.autograd.grad(truth, ref_leaves)
    _, e = torch.frexp(torch.stack([g.abs().max() for g in ref_grads[:-1]]).max())
    scale = 2.0 ** -int(e)
    loss, leaves = op_loss(op, backend, img, txt, tau, gamma, eps, threshold, m, offset)
    grads = torch.autograd.grad(loss * scale, leaves)
    assert loss.dtype == torch.float32
    out = {"loss": (rel_err(loss, truth), TOL_LOWP_LOSS)}
    for name, got, want in zip(OP_GRADS[op], grads, ref_grads):
        want = want * scale
        if name == "d tau":
            out[name] = (rel_err(got, want), TOL_LOWP_LOSS)
            continue
        assert got.dtype == img.dtype, f"{name}: {got.dtype}"
        floor = float((want.to(img.dtype).double() - want).norm() / want.norm().clamp_min(1e-300))
        out[name] = (rel_err(got, want), 2 * floor + 2e-3)
    return out


def assert_within(errors: dict, what: str = "") -> None:
    """Every (error, bound) of :func:`op_errors` within its bound."""
    over = {k: f"{e:.3e} > {b:.2e}" for k, (e, b) in errors.items() if not e <= b}
    assert not over, f"{what}: {over}"
