"""Non-finite and extreme inputs: one answer on every backend.

Every op (the symmetric ``hn_clip_loss``, the directional op, a rank's op at an offset, called as
``cases.op_loss`` calls them) on every backend gives one of three answers (docs/api.md, "NaN, inf
and extreme inputs"):

* ``ValueError`` (a non-finite τ, or a τ or feature norms that would overflow float32 in the
  loss or in dL/dτ), on every backend alike;
* a finite loss with finite gradients (img, txt, τ; a rank's four features), which match the
  float64 formula (the torch backend on the float64 inputs; tolerance below);
* a non-finite loss with non-finite gradients: never a finite loss with a non-finite gradient,
  or the reverse. NaN or ±inf in one entry or one row of img or txt (a row the op reads: a local
  row, a query and a key) always gives this, with and without false-negative masking (a NaN
  caption cosine is kept, not masked) and label smoothing. (A feature row beyond float32's norm
  range gave this on Triton, whose raw products overflowed; its wrappers now scale such rows by a
  power of two first: a finite answer, ``test_normalized_rows_of_huge_norm_match_float64``.)

Swept (N = 7, D = 5, M = 3 local rows at offset 2; 165 cases × 3 backends): NaN, +inf, −inf
in one entry and in one row, of img and of txt, each with and without a threshold (0.3, which
masks some pairs here), label smoothing ε = 0.1 alternating; τ non-finite and from 1e-30 to 1e4,
with and without the threshold; row norms 1e-30 to 1e30 (all rows; one row of img or txt at
1e-30 and 1e30), ``normalize`` on and off, threshold and ε rotating. The directional and rank
ops are internal (their callers check the inputs first): they run after the checks
``distributed_hn_clip_loss`` runs, ``check_tau`` and the global overflow bound.

Tolerance of "match float64" (relative error in norm, per output: the loss, each gradient):
1e-4 + 4·G·2⁻²⁴ (``truth`` computes G). A softmax weight is exp(Z_k − Z_pos − LSE); a float32
logit of size |Z| carries an absolute rounding error of about |Z|·2⁻²⁴, so the exponent of a
weight carries up to 2G·2⁻²⁴ and dS = P − onehot twice that, G the largest |logit| among a
row's positive and the entries that compete in it (softmax weight ≥ 2⁻²⁴; a row with a single
such entry is one-hot, and no rounding of its logits moves it). No float32 evaluation does
better in general. Outside the exemption below, G ≤ 60 (bound ≤ 1.2e-4), and G = 0 at τ ≤ 1e-3
where every row is one-hot; over the 892 outputs compared, the largest error is 1.6e-6 (dτ at
τ = 1e4), 2% of its bound. Exempt, honestly: one unnormalised img row of norm 1e30
(3 cases, G ≈ 1.5e30, bound ≈ 4e23: finiteness only) — its t2i row, whose positive is
≈ −1.5e30, has gaps Z_k − Z_pos whose O(10) differences even float64 rounds away (ulp ≈ 3e14),
so float64 is no truth there (torch float32 rounds the same way and agrees; cpp and Triton differ by up to 0.74).
And dτ = −Σ ∂L/∂Z·Z/τ is made of the logits themselves: where the features' entries multiply
below float32's normal range (max|x|·max|y| < 2⁻¹²⁶: rows of norm 1e-30) every backend's
float32 products underflow (Triton's also with ``normalize``: it scales by the inverse norms
after the dot), and that dτ (≈ 1e-35 or less) is checked for finiteness only.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cases import ALL_BACKENDS, OP_GRADS, op_loss
from helpers import rel_err
from hnclip_kernels import hn_clip_loss, validation
from hnclip_kernels.backends import directional_fn, rank_losses
from hnclip_kernels.options import LossOptions

N, D, M, OFFSET = 7, 5, 3, 2
ROW = OFFSET + 1  # the poisoned or scaled row: a local row, so every op reads it as a query and a key
GAMMA, THRESHOLD, SMOOTHING = 0.5, 0.3, 0.1
OPS = ("symmetric", "directional", "rank")
TINY = 2.0**-126  # float32's smallest normal number


def _base_pair():
    gen = torch.Generator().manual_seed(3)
    img, txt = (torch.randn(N, D, generator=gen, dtype=torch.float64).float() for _ in range(2))
    unit = torch.nn.functional.normalize(txt.double(), dim=1)
    off = (unit @ unit.T)[~torch.eye(N, dtype=torch.bool)]
    # float32 and float64 mask the same pairs, and the threshold masks some of them
    assert ((off - THRESHOLD).abs() > 1e-3).all() and (off >= THRESHOLD).any() and (off < THRESHOLD).any()
    return img, txt


def _cases():
    """(op, what, tau, normalize, threshold, eps) tuples; ``what`` names the input's change. Every
    change runs with and without the threshold; ε (and, for the norms, the threshold too) rotates."""
    options = [(thr, eps) for thr in (None, THRESHOLD) for eps in (0.0, SMOOTHING)]
    poisons = [f"{w}_{at}_{v}" for w in ("img", "txt") for at in ("entry", "row") for v in ("nan", "inf", "-inf")]
    scaled = [("all", s, n) for s in (1e-30, 1e-15, 1e15, 1e30) for n in (True, False)]
    scaled += [(w, s, n) for w in ("img", "txt") for s in (1e-30, 1e30) for n in (True, False)]
    out = []
    for op in OPS:
        out += [
            (op, p, 0.07, True, thr, SMOOTHING * (i % 2)) for i, p in enumerate(poisons) for thr in (None, THRESHOLD)
        ]
        out += [
            (op, "tau", float(v), True, (None, THRESHOLD)[i % 2], SMOOTHING)
            for i, v in enumerate(("nan", "inf", "-inf"))
        ]
        taus = (1e-30, 1e-20, 1e-10, 1e-3, 1.0, 1e4)
        out += [
            (op, "tau", tau, True, thr, SMOOTHING * (i % 2)) for i, tau in enumerate(taus) for thr in (None, THRESHOLD)
        ]
        out += [(op, f"{w}_norm{s:g}", 0.07, n, *options[i % 4]) for i, (w, s, n) in enumerate(scaled)]
    return out


CASES = _cases()


def case_id(case) -> str:
    op, what, tau, normalize, thr, eps = case
    return "-".join(
        [op, what if what != "tau" else f"tau{tau:g}"]
        + (["tau%g" % tau] if what != "tau" and tau != 0.07 else [])
        + ([] if normalize else ["unnormalized"])
        + ([] if thr is None else [f"masked{thr:g}"])
        + ([] if eps == 0.0 else [f"ls{eps:g}"])
    )


def case_inputs(case):
    """(img, txt) float32 of ``case``, fresh tensors."""
    _, what, *_ = case
    img, txt = _base_pair()
    if what == "tau":
        return img, txt
    which, how = what.split("_", 1)
    if how.startswith("norm"):
        scale = float(how[4:])
        if which == "all":
            return img * scale, txt * scale
        (img if which == "img" else txt)[ROW] *= scale
        return img, txt
    where, value = how.split("_")
    x = img if which == "img" else txt
    if where == "entry":
        x[ROW, 1] = float(value)
    else:
        x[ROW] = float(value)
    return img, txt


def run(case, backend, img, txt):
    """(loss, [gradients]) of ``case``'s op on ``backend`` (float64 inputs: the float64 truth),
    or the ValueError the input checks raise. The gradients: img, txt, τ (symmetric); the local
    img rows, all txt, τ (directional); local img, local txt, all img, all txt, τ (rank)."""
    op, _, tau, normalize, thr, eps = case
    tau_t = torch.tensor(tau, dtype=torch.float64 if img.dtype == torch.float64 else torch.float32, requires_grad=True)
    kw = dict(gamma=GAMMA, label_smoothing=eps, false_negative_threshold=thr)
    try:
        if op == "symmetric":
            leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
            loss = hn_clip_loss(*leaves, tau_t, normalize=normalize, backend=backend, **kw)
            return _with_grads(loss, [*leaves, tau_t])
        # what distributed_hn_clip_loss checks before it calls a rank's op (consensus.py)
        value = validation.check_tau(tau_t, img.device, img.dtype, GAMMA, label_smoothing=eps, n_keys=N, n_rows=N)
        if not normalize:
            validation.check_feature_range(img, txt, value, GAMMA, eps, n_rows=N, tau_grad=True)
    except ValueError as exc:
        return exc
    all_img, all_txt = (x.clone().requires_grad_(True) for x in (img, txt))
    img_rows, txt_rows = (x[OFFSET : OFFSET + M].clone().requires_grad_(True) for x in (img, txt))
    if op == "directional":
        rows = directional_fn(backend)(
            img_rows,
            all_txt,
            query_txt=txt_rows.detach(),
            key_txt=all_txt.detach(),
            tau=tau_t,
            offset=OFFSET,
            normalize=normalize,
            **kw,
        )
        return _with_grads(rows.mean(), [img_rows, all_txt, tau_t])
    options = LossOptions(backend=backend, normalize=normalize, **kw)
    rows = rank_losses(img_rows, txt_rows, all_img, all_txt, tau_t, OFFSET, options)
    return _with_grads(rows.mean(), [img_rows, txt_rows, all_img, all_txt, tau_t])


def _with_grads(loss, leaves):
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return loss.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def category(result) -> str:
    """ "raises", "finite" (loss and every gradient), "nonfinite" (the loss and some gradient),
    or "inconsistent" (a finite loss with a non-finite gradient, or the reverse)."""
    if isinstance(result, ValueError):
        return "raises"
    loss, grads = result
    finite_loss = bool(torch.isfinite(loss).all())
    finite_grads = all(bool(torch.isfinite(g).all()) for g in grads)
    if finite_loss == finite_grads:
        return "finite" if finite_loss else "nonfinite"
    return "inconsistent"


@functools.lru_cache(maxsize=None)
def truth(case):
    """The float64 result of ``case`` (the torch backend on the upcast inputs) and G, the largest
    |logit| that competes in a row of the float64 logits Z = (v t̂ᵀ + γ·margin)/τ (both directions,
    normalised features when ``normalize``, every entry kept: a superset of any op's rows): in each
    row where at least two entries have a softmax weight ≥ 2⁻²⁴, the largest |Z| of those entries
    and of the row's positive (the kernels take every gap from it)."""
    img, txt = case_inputs(case)
    result = run(case, "torch", img.double(), txt.double())
    _, _, tau, normalize, *_ = case
    v, t = img.double(), txt.double()
    if normalize:
        v, t = (torch.nn.functional.normalize(x, dim=1) for x in (v, t))
    z = (v @ t.T + GAMMA * (t @ t.T).fill_diagonal_(0.0)) / tau
    largest = 0.0
    for rows in (z, z.T):
        competing = torch.softmax(rows, dim=1) >= 2.0**-24
        for row, keep, pos in zip(rows, competing, rows.diagonal()):
            if int(keep.sum()) >= 2:
                largest = max(largest, float(row[keep].abs().max()), abs(float(pos)))
    return result, largest


@functools.lru_cache(maxsize=None)
def outcome(case, backend):
    """(category, {output: (relative error, bound)} where the float64 truth is compared)."""
    img, txt = case_inputs(case)
    before = (img.clone(), txt.clone())
    result = run(case, backend, img, txt)
    for x, x0 in zip((img, txt), before):  # inputs are never written to
        torch.testing.assert_close(x, x0, rtol=0, atol=0, equal_nan=True)
    kind = category(result)
    if kind != "finite":
        return kind, {}
    want, largest = truth(case)
    assert category(want) == "finite", f"finite float32 result, float64 truth {category(want)}"
    bound = _tolerance(largest)
    names = ["loss", *(f"d{i}" for i in range(len(want[1]) - 1)), "d tau"]
    errors = {}
    underflow = float(img.abs().max()) * float(txt.abs().max()) < TINY
    for name, got, ref in zip(names, [result[0], *result[1]], [want[0], *want[1]]):
        if name == "d tau" and underflow:
            continue  # its finiteness is checked (category); its value is not resolved in float32
        errors[name] = (_rel_err(got, ref), bound)
    return kind, errors


def _tolerance(largest: float) -> float:
    """1e-4 + 4·G·2⁻²⁴, G from :func:`truth` (the module docstring says why, and the errors seen)."""
    return 1e-4 + 4.0 * largest * 2.0**-24


def _rel_err(got, want) -> float:
    diff = (got.double() - want).norm().item()
    scale = want.norm().item()
    return diff / scale if scale > 0 else diff


def _poisoned(case) -> bool:
    return case[1].split("_")[-1] in ("nan", "inf", "-inf")


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_nonfinite_and_extreme(backend, case):
    kind, errors = outcome(case, backend)
    assert kind != "inconsistent", "a finite loss with non-finite gradients, or the reverse"
    # the input checks are shared: every backend raises where the torch backend does
    assert (kind == "raises") == (outcome(case, "torch")[0] == "raises")
    if _poisoned(case):
        assert kind == "nonfinite", "NaN/inf in a feature the op reads gives a non-finite loss and gradients"
    else:  # finite inputs that pass the checks give a finite answer (Triton too: params.tamed)
        assert kind != "nonfinite", "non-finite answer for finite, checked inputs"
    over = {k: f"{e:.2e} > {b:.2e}" for k, (e, b) in errors.items() if not e <= b}
    assert not over, f"float32 vs float64: {over}"


def test_sweep_covers_every_answer():
    """The sweep reaches all three answers on every backend (else it tests less than it claims)."""
    for backend in ALL_BACKENDS:
        kinds = {outcome(case, backend)[0] for case in CASES if case[0] == "symmetric"}
        assert kinds == {"raises", "finite", "nonfinite"}, (backend, kinds)


# ---- dL/dτ ∝ 1/τ² overflowed float32 (τ ≲ 3e-19 here) under a finite loss on every backend:
# where τ requires grad, every entry point now raises, and the τ its message suggests works
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tau_whose_gradient_would_overflow_raises_where_tau_requires_grad(backend):
    from hnclip_kernels import HNClipLoss
    from hnclip_kernels.distributed import distributed_hn_clip_loss

    img, txt = _base_pair()
    tau = 1e-20
    calls = {
        "hn_clip_loss": lambda: hn_clip_loss(img, txt, torch.tensor(tau, requires_grad=True), backend=backend),
        "HNClipLoss": lambda: HNClipLoss(backend=backend, normalize=True)(
            img, txt, torch.tensor(1 / tau, requires_grad=True)
        ),
        "distributed_hn_clip_loss": lambda: distributed_hn_clip_loss(
            img, txt, torch.tensor(tau, requires_grad=True), world_size=1, backend=backend
        ),
        "torch.func.grad": lambda: torch.func.grad(lambda t: hn_clip_loss(img, txt, t, backend=backend))(
            torch.tensor(tau)
        ),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            messages[name] = str(exc)
        else:
            pytest.fail(f"{name}: no ValueError for tau = {tau} that requires grad")
    assert all("dL/dtau" in m and "use tau > " in m for m in messages.values()), messages
    suggested = float(messages["hn_clip_loss"].rsplit("use tau > ", 1)[1])
    assert 1e-19 < suggested < 1e-18
    # no gradient of τ, no bound on it: a float τ keeps its finite loss and finite feature gradients
    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    loss = hn_clip_loss(*leaves, tau, backend=backend)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(x.grad).all() for x in leaves)
    # just above the suggested τ: finite loss and finite gradients, dτ included
    tau_t = torch.tensor(1.01 * suggested, requires_grad=True)
    loss = hn_clip_loss(*[x.detach() for x in leaves], tau_t, backend=backend)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(tau_t.grad)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("where", ["img", "txt", "negatives"])
def test_tiny_tau_with_a_row_of_norm_near_zero_is_named(backend, where):
    # normalize=True, a plain-float τ = 1e-30 (no dL/dτ, so check_tau's bound is the loss's) and one
    # row of norm 1e-12: the normalised row's logits stay ≤ 1/τ (a finite loss), but dL/dx̂ ≈ 1/τ
    # times 1/‖x‖ = 1e12 through the normalisation is 1e42: it was a finite loss with an infinite (or
    # NaN) gradient on every backend. Now validation_rows.check_small_rows names τ and the tensor.
    img, txt = _base_pair()
    neg = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    kw = dict(negatives=neg) if where == "negatives" else {}
    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    loss = hn_clip_loss(*leaves, 1e-30, backend=backend, **kw)  # unit-scale rows: gradients ~1e30, finite
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in torch.autograd.grad(loss, leaves))
    tensors = {"img": img, "txt": txt, "negatives": neg}
    tensors[where] = tensors[where].clone()
    tensors[where][1] *= 1e-12 / tensors[where][1].norm()
    kw = dict(negatives=tensors["negatives"]) if where == "negatives" else {}
    with pytest.raises(ValueError, match=rf"tau = 1e-30 with a row of {where} of norm 1e-12 .* use tau > "):
        hn_clip_loss(tensors["img"], tensors["txt"], 1e-30, backend=backend, **kw)
    hn_clip_loss(tensors["img"], tensors["txt"], 1e-10, backend=backend, **kw)  # a τ it allows


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("norm", [1e19, 1e37, 3e38])
def test_normalized_rows_of_huge_norm_match_float64(backend, norm):
    # normalize=True, every row of img, txt and the negatives at norm 1e19 … 3e38 (finite float32):
    # the loss is that of the unit rows. Triton formed the raw products x·y before the inverse
    # norms (1e19 · 1e19 overflows float32 at D = 5 only just; 1e37 · 1e37 always): NaN loss and
    # gradients, where torch and cpp (which normalise first) were right. Loss and gradients
    # against float64: float32's 1e-5 / 1e-4 (family_oracle.check).
    from family_oracle import check

    img, txt = (torch.nn.functional.normalize(x, dim=1) * norm for x in _base_pair())
    neg = torch.nn.functional.normalize(torch.randn(3, D, generator=torch.Generator().manual_seed(5)), dim=1) * norm
    check(img, txt, neg, 0.07, backend=backend, threshold=THRESHOLD, label_smoothing=SMOOTHING)
    check(img, txt, None, 0.07, backend=backend, margin="image_text", group_ids=torch.tensor([0, 1, 0, 2, 3, 4, 5]))
    check(img, txt, None, 0.07, backend=backend)  # no family input: the symmetric op
    for op in ("directional", "rank"):  # the distributed path's ops, unscaled (their gradients ~1e-38 / norm)
        truth, ref_leaves = op_loss(op, "f64", img, txt, 0.07, GAMMA, SMOOTHING, THRESHOLD, M, OFFSET)
        loss, leaves = op_loss(op, backend, img, txt, 0.07, GAMMA, SMOOTHING, THRESHOLD, M, OFFSET)
        assert rel_err(loss, truth) <= 1e-5, f"{backend} {op}: loss {loss.item()} vs {truth.item()}"
        for name, g, w in zip(OP_GRADS[op], torch.autograd.grad(loss, leaves), torch.autograd.grad(truth, ref_leaves)):
            assert rel_err(g, w) <= 1e-4, f"{backend} {op} {name}: {rel_err(g, w):.3e}"
