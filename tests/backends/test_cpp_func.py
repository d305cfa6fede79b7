"""The C++ backend under torch.func (grad, grad_and_value, vjp, jacrev, vmap, vmap of grad) and
under torch.compile with a τ/γ/ε schedule.

The wrappers ``hn_clip_pairs_cpp`` / ``directional_nll_cpp`` (what ``hn_clip_loss`` and the
distributed loss call) must give the eager results, in float32 and float64; second
derivatives and forward mode must raise the clear errors naming backend="torch"; and a
compiled loss whose γ and ε change every step must not recompile per value.
"""

import warnings

import pytest
import torch
from torch.func import grad, grad_and_value, jacrev, vjp, vmap

from cases import make_pair
from helpers import assert_close_rel

try:
    from hnclip_kernels.backends.cpp.ops import directional_nll_cpp, hn_clip_pairs_cpp
except ImportError as exc:  # pragma: no cover - depends on the install
    pytest.skip(f"C++ extension hnclip_kernels._C not built ({exc})", allow_module_level=True)

from hnclip_kernels import hn_clip_loss

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}  # same kernels, same order: equal up to summation order
GAMMA, EPS = 0.5, 0.1


def _sym(img, txt, tau, weights=None):
    rows = hn_clip_pairs_cpp(img, txt, tau=tau, gamma=GAMMA, label_smoothing=EPS, normalize=True)
    return rows.mean() if weights is None else (rows * weights).sum()


def _dir(img, txt, tau, weights=None):
    # t2i with the texts as queries: the same tensor as queries and query margin factors
    rows = directional_nll_cpp(
        txt, img, query_txt=txt, key_txt=txt, tau=tau, offset=0, gamma=GAMMA, label_smoothing=EPS, normalize=True
    )
    return rows.mean() if weights is None else (rows * weights).sum()


LOSSES = {"symmetric": _sym, "directional": _dir}


def _eager(fn, img, txt, tau, weights=None):
    """(value, (d img, d txt, d tau)) by plain autograd."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt, tau)]
    value = fn(*leaves, weights)
    value.backward()
    return value.detach(), tuple(x.grad for x in leaves)


def _inputs(dtype, n=7, d=5, seed=0):
    img, txt = make_pair(n, d, dtype, seed=seed)
    return img, txt, torch.tensor(0.1, dtype=dtype)


def _check(actual, expected, dtype, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype, f"{what}[{i}]: dtype {a.dtype} != {e.dtype}"
        assert_close_rel(a, e, TOL[dtype], f"{what}[{i}]")


# ------------------------------------------------------------------ grad, grad_and_value, vjp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", LOSSES)
def test_func_grad_matches_autograd(kind, dtype):
    fn = LOSSES[kind]
    img, txt, tau = _inputs(dtype)
    weights = torch.linspace(0.2, 1.5, img.shape[0], dtype=dtype)  # non-uniform upstream: the column sweep
    for w in (None, weights):
        value, grads = _eager(fn, img, txt, tau, w)
        _check(grad(fn, argnums=(0, 1, 2))(img, txt, tau, w), grads, dtype, f"{kind} grad")
        g, v = grad_and_value(fn, argnums=(0, 1, 2))(img, txt, tau, w)
        _check(g, grads, dtype, f"{kind} grad_and_value")
        _check((v,), (value,), dtype, f"{kind} value")
        out, pullback = vjp(lambda a, b, s, w=w: fn(a, b, s, w), img, txt, tau)
        _check(pullback(torch.ones((), dtype=dtype)), grads, dtype, f"{kind} vjp")
        # one argument only (the others plain tensors): only that gradient is formed
        _check((grad(fn)(img, txt, tau, w),), grads[:1], dtype, f"{kind} grad img")
        _check((grad(fn, argnums=2)(img, txt, tau, w),), grads[2:], dtype, f"{kind} grad tau")


@pytest.mark.parametrize("kind", LOSSES)
def test_func_jacrev_of_per_pair_losses(kind):
    # jacrev = vmap over the vjp: the backward operator under vmap, one basis vector per row
    img, txt, tau = _inputs(torch.float64, n=5, d=4, seed=2)
    rows_fn = {
        "symmetric": lambda a: hn_clip_pairs_cpp(a, txt, tau=tau, gamma=GAMMA, label_smoothing=EPS, normalize=True),
        "directional": lambda a: directional_nll_cpp(
            a, txt, query_txt=a, key_txt=txt, tau=tau, offset=0, gamma=GAMMA, label_smoothing=EPS, normalize=True
        ),
    }[kind]
    jac = jacrev(rows_fn)(img)
    expected = torch.autograd.functional.jacobian(rows_fn, img)
    assert_close_rel(jac, expected, 1e-12, f"{kind} jacrev")


# ------------------------------------------------------------------ vmap and vmap(grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", LOSSES)
def test_vmap_over_a_stack_of_batches(kind, dtype):
    fn = LOSSES[kind]
    b = 3
    imgs, txts = (torch.stack(x) for x in zip(*(make_pair(6, 4, dtype, seed=s) for s in range(b))))
    taus = torch.tensor([0.05, 0.1, 0.3], dtype=dtype)
    expected = torch.stack([fn(imgs[i], txts[i], taus[i]) for i in range(b)])
    _check((vmap(fn)(imgs, txts, taus),), (expected,), dtype, f"{kind} vmap")
    # τ shared, and the batch dimension elsewhere than 0 for one input
    expected = torch.stack([fn(imgs[i], txts[i], taus[1]) for i in range(b)])
    got = vmap(fn, in_dims=(0, 1, None))(imgs, txts.transpose(0, 1), taus[1])
    _check((got,), (expected,), dtype, f"{kind} vmap in_dims")
    # texts shared by every batch entry
    expected = torch.stack([fn(imgs[i], txts[0], taus[1]) for i in range(b)])
    _check((vmap(fn, in_dims=(0, None, None))(imgs, txts[0], taus[1]),), (expected,), dtype, f"{kind} vmap shared")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", LOSSES)
def test_vmap_of_grad_per_example_gradients(kind, dtype):
    fn = LOSSES[kind]
    b = 3
    imgs, txts = (torch.stack(x) for x in zip(*(make_pair(6, 4, dtype, seed=10 + s) for s in range(b))))
    taus = torch.tensor([0.07, 0.1, 0.2], dtype=dtype)
    per_example = vmap(grad(fn, argnums=(0, 1, 2)))(imgs, txts, taus)
    expected = [_eager(fn, imgs[i], txts[i], taus[i])[1] for i in range(b)]
    for k, name in enumerate(("d img", "d txt", "d tau")):
        _check((per_example[k],), (torch.stack([e[k] for e in expected]),), dtype, f"{kind} vmap(grad) {name}")
    # and grad of a vmapped (summed) loss
    total = grad(lambda a: vmap(fn)(a, txts, taus).sum())(imgs)
    _check((total,), (per_example[0],), dtype, f"{kind} grad(vmap)")


def test_vmap_does_not_use_the_slow_fallback():
    # PyTorch's "There is a performance drop because we have not yet implemented the batching
    # rule" warning would mean the loop rules were not registered
    img, txt, tau = _inputs(torch.float32)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        vmap(_sym, in_dims=(0, None, None))(img[None].expand(2, -1, -1), txt, tau)
        vmap(grad(_dir), in_dims=(0, None, None))(img[None].expand(2, -1, -1), txt, tau)
    assert not log, [str(w.message) for w in log]


# ------------------------------------------------------------------ through hn_clip_loss


@pytest.mark.parametrize("dtype", DTYPES)
def test_hn_clip_loss_func_grad_and_vmap(dtype):
    img, txt = make_pair(8, 4, dtype, seed=5)

    def loss(a, b):
        return hn_clip_loss(a, b, 0.1, gamma=GAMMA, label_smoothing=EPS, backend="cpp")

    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    loss(*leaves).backward()
    _check(grad(loss, argnums=(0, 1))(img, txt), tuple(x.grad for x in leaves), dtype, "hn_clip_loss grad")
    imgs = torch.stack([img, img.flip(0)])
    expected = torch.stack([loss(img, txt), loss(img.flip(0), txt)])
    _check((vmap(loss, in_dims=(0, None))(imgs, txt),), (expected,), dtype, "hn_clip_loss vmap")


# ------------------------------------------------------------------ first order only


@pytest.mark.parametrize("kind", LOSSES)
def test_second_derivative_under_func_raises_clear_error(kind):
    fn = LOSSES[kind]
    img, txt, tau = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match='backend="torch"'):
        grad(lambda a: grad(fn)(a, txt, tau).sum())(img)
    with pytest.raises(RuntimeError, match='backend="torch"'):
        torch.func.hessian(fn)(img, txt, tau)
    with pytest.raises(RuntimeError, match='forward-mode.*backend="torch"'):
        torch.func.jvp(lambda a: fn(a, txt, tau), (img,), (torch.ones_like(img),))
    # eager create_graph=True: the same error from the second backward
    a = img.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(a, txt, tau), a, create_graph=True)
    with pytest.raises(RuntimeError, match='backend="torch"'):
        g.sum().backward()


# ------------------------------------------------------------------ torch.compile with a schedule


class _GraphCounter:
    """A torch.compile backend that counts the graphs it is given and runs them through
    AOTAutograd (``aot_eager``): the pass that turns dynamic floats into tensors, which
    specialises on anything it cannot convert, runs there too."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.parametrize("kind", LOSSES)
def test_compile_schedule_of_tau_gamma_eps_compiles_at_most_twice(kind):
    wrapper = {
        "symmetric": lambda a, b, s, g, e: hn_clip_pairs_cpp(a, b, tau=s, gamma=g, label_smoothing=e, normalize=True),
        "directional": lambda a, b, s, g, e: directional_nll_cpp(
            b, a, query_txt=b, key_txt=b, tau=s, offset=0, gamma=g, label_smoothing=e, normalize=True
        ),
    }[kind]

    def step(img, txt, tau, gamma, eps):
        return wrapper(img, txt, tau, gamma, eps).mean()

    torch._dynamo.reset()
    counter = _GraphCounter()
    compiled = torch.compile(step, fullgraph=True, backend=counter)  # fullgraph: the 9th recompile would raise
    img0, txt0 = make_pair(9, 6, seed=12)
    for i in range(12):  # a temperature schedule, a margin warm-up and a changing smoothing, all Python floats
        gamma, eps = 0.05 * i, (0.0, 0.05, 0.1)[i % 3]
        out = []
        for fn in (step, compiled):
            img, txt = (x.clone().requires_grad_(True) for x in (img0, txt0))
            tau = torch.tensor(0.2 - 0.01 * i, requires_grad=True)
            loss = fn(img, txt, tau, gamma, eps)
            loss.backward()
            out.append((loss.detach(), img.grad, txt.grad, tau.grad))
        for name, a, b in zip(("loss", "d img", "d txt", "d tau"), *out):
            assert_close_rel(b, a, 1e-6, f"step {i} compiled {name}")
    assert counter.graphs <= 2, f"{counter.graphs} graphs for 12 values of γ and ε"
    torch._dynamo.reset()


def test_gamma_and_eps_as_tensors_match_floats():
    img, txt, tau = _inputs(torch.float32)
    a = hn_clip_pairs_cpp(img, txt, tau=tau, gamma=0.3, label_smoothing=0.1, normalize=True)
    b = hn_clip_pairs_cpp(
        img,
        txt,
        tau=tau,
        gamma=torch.tensor(0.3, dtype=torch.float64),
        label_smoothing=torch.tensor(0.1, dtype=torch.float64),
        normalize=True,
    )
    assert torch.equal(a, b)
