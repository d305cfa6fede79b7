"""The Triton backend as registered operators: ``hnclip::triton_symmetric_nll`` and
``hnclip::triton_directional_nll`` (plus their ``*_backward`` operators), registered with
``torch.library.triton_op`` for compiled kernels and ``torch.library.custom_op`` under the
interpreter (hnclip_kernels/backends/triton/ops.py explains why).

Here, on CPU tensors in Triton's interpreter: ``torch.library.opcheck`` of the four operators,
``torch.func.grad`` / ``vmap`` against loops of eager calls, ``torch.export``,
``torch.compile(fullgraph=True)`` with the "eager", "aot_eager" and "inductor" backends over
12-step τ/γ schedules (compile count and results; the operator is opaque here, so Inductor
compiles only the code around it, for the CPU), second derivatives without loss.py's guard; and, in a
subprocess without the interpreter, the trace that Inductor gets on a GPU (one
``triton_kernel_wrapper_functional`` node per launch, mutating only its outputs).

GPU only (tests/backends/test_gpu.py ``test_library_*``, the "compile" step of tools/gpu_check.sh):
Inductor compiling the kernels (``torch.compile`` with the default backend, fullgraph, the τ/γ
schedule: compile count, values and gradients against eager), the traced kernels running under
``aot_eager`` (autotuned, chunked backward), opcheck / torch.func / torch.export on CUDA tensors,
dynamic shapes (full level). The kernels' sm_90a compile with Inductor's scalar types needs no
GPU: ``python -m tools.sm90 --wide-scalars`` (tests/tooling/test_sm90_compile.py).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from cases import make_pair
from helpers import assert_close_rel
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends import triton_directional
from hnclip_kernels.backends.triton import ops as ht
from hnclip_kernels.margin import Margin

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter checks (CPU tensors)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = torch.ops.hnclip
N, D = 6, 8  # the interpreter pays per program: one tile per kernel


def _features(n=N, d=D, seed=0, grad=False):
    img, txt = make_pair(n, d, torch.float32, seed=seed)
    return img.requires_grad_(grad), txt.requires_grad_(grad)


def _sym_args(gamma=0.5, eps=0.1, grad=True, threshold=None):
    img, txt = _features(grad=grad)
    tau = torch.tensor(0.07, requires_grad=grad)
    masked = threshold is not None
    return (
        img,
        txt,
        img.new_empty((0, D)),  # no negatives
        img.new_empty((0, 0, D)),  # no own negatives, and their mask
        torch.empty((0, 0), dtype=torch.bool),
        torch.empty(0, dtype=torch.long),  # no group ids
        tau,
        _hyper(gamma),
        _hyper(eps),
        _hyper(threshold if masked else 0.0),
        True,  # normalize
        masked,
        gamma != 0.0,  # has_margin
        eps != 0.0,  # smoothing
        "tf32x3",
        Margin.TEXT.code,
        0,  # group_mode: "mask"
    )


def _hyper(x):
    """γ or ε as the operators take it: a 0-dim float64 tensor."""
    return torch.tensor(x, dtype=torch.float64)


def _dir_args(gamma=0.5, eps=0.1, grad=True, m=4, offset=2, threshold=None):
    q, k = _features(grad=grad)
    a, b = make_pair(N, D, torch.float32, seed=1)
    tau = torch.tensor(0.05, requires_grad=grad)
    masked = threshold is not None
    no_id = torch.empty(0, dtype=torch.long)
    return (
        q[:m].detach().requires_grad_(grad),
        k,
        a[offset : offset + m],
        b,
        *(torch.empty(0), torch.empty(0), no_id, no_id),  # no mask captions, no group ids
        tau,
        _hyper(gamma),
        _hyper(eps),
        _hyper(threshold if masked else 0.0),
        offset,
        True,  # normalize
        masked,
        gamma != 0.0,  # has_margin
        eps != 0.0,  # smoothing
        "ieee",
        0,  # group_mode: "mask"
    )


def test_registration():
    assert ht.USE_TRITON_OP is False  # interpreter: custom_op (triton_op's fake would launch the kernels)
    schema = str(OPS.triton_symmetric_nll.default._schema)
    assert (
        "Tensor gamma, Tensor label_smoothing, Tensor threshold, bool normalize, bool masked, bool has_margin, "
        "bool smoothing, str precision, SymInt margin" in schema
    )
    for name in (
        "triton_symmetric_nll",
        "triton_symmetric_nll_backward",
        "triton_directional_nll",
        "triton_directional_nll_backward",
    ):
        assert hasattr(OPS, name), name


@pytest.mark.parametrize("gamma, eps, threshold", [(0.0, 0.0, None), (0.5, 0.1, None), (0.0, 0.1, 0.3)])
def test_opcheck_symmetric(gamma, eps, threshold):
    # threshold: false-negative masking (the kept counts an output, the caption tile formed at γ = 0)
    args = _sym_args(gamma, eps, threshold=threshold)
    torch.library.opcheck(OPS.triton_symmetric_nll, args)
    out = OPS.triton_symmetric_nll(*(x.detach() if isinstance(x, torch.Tensor) else x for x in args))
    grad = torch.linspace(0.5, 1.5, N)
    inputs = (args[i].detach() for i in range(10))  # img, txt, negatives, own, own mask, ids, τ, γ, ε, threshold
    torch.library.opcheck(OPS.triton_symmetric_nll_backward, (grad, *inputs, *out[1:], *args[10:], True))


@pytest.mark.parametrize("gamma, eps, threshold", [(0.0, 0.1, None), (0.5, 0.0, None), (0.5, 0.1, 0.3)])
def test_opcheck_directional(gamma, eps, threshold):
    args = _dir_args(gamma, eps, threshold=threshold)
    torch.library.opcheck(OPS.triton_directional_nll, args)
    inputs = [args[i].detach() for i in range(12)]  # q, k, a, b, the family's four, τ, γ, ε, threshold
    out = OPS.triton_directional_nll(*inputs, *args[12:])
    torch.library.opcheck(
        OPS.triton_directional_nll_backward,
        (torch.linspace(-1.0, 1.0, inputs[0].shape[0]), *inputs, *out[1:], *args[12:], True),
    )


# ------------------------------------------------------------------ torch.func
def _loss(img, txt, tau, backend="triton", gamma=0.5, eps=0.1):
    return hn_clip_loss(img, txt, tau, gamma=gamma, label_smoothing=eps, backend=backend)


def _eager_grads(img, txt, tau):
    leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_(), tau.clone().requires_grad_()]
    loss = _loss(*leaves)
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def test_func_grad_matches_autograd():
    img, txt = _features()
    tau = torch.tensor(0.07)
    want = _eager_grads(img, txt, tau)
    got_grads, got_loss = torch.func.grad_and_value(_loss, argnums=(0, 1, 2))(img, txt, tau)
    assert torch.equal(got_loss, want[0])
    for name, got, ref in zip(("d img", "d txt", "d tau"), got_grads, want[1:]):
        assert torch.equal(got, ref), name
    # the plain call with τ a Python float, against autograd
    leaf = img.clone().requires_grad_()
    want_img = torch.autograd.grad(hn_clip_loss(leaf, txt, 0.1, backend="triton"), leaf)[0]
    assert torch.equal(torch.func.grad(lambda a: hn_clip_loss(a, txt, 0.1, backend="triton"))(img), want_img)


def test_func_grad_directional():
    q, k, a, b, _mq, _mk, _qg, _kg, tau, _g, _e, _c, offset, *_flags = _dir_args(grad=False)
    fn = triton_directional()

    def rows(q, k, tau):
        return (
            fn(q, k, query_txt=a, key_txt=b, tau=tau, offset=offset, gamma=0.5, label_smoothing=0.1, normalize=True)
            * torch.arange(1.0, q.shape[0] + 1)
        ).sum()

    got = torch.func.grad(rows, argnums=(0, 1, 2))(q, k, tau)
    leaves = [x.clone().requires_grad_() for x in (q, k, tau)]
    want = torch.autograd.grad(rows(*leaves), leaves)
    for name, x, y in zip(("d q", "d k", "d tau"), got, want):
        assert torch.equal(x, y), name


def test_func_vmap_values_and_gradients():
    b = 3
    stack = [_features(seed=s) for s in range(b)]
    imgs, txts = torch.stack([x for x, _ in stack]), torch.stack([y for _, y in stack])
    tau = torch.tensor(0.07)
    # values: vmap over a stack of batches == a loop of eager calls
    got = torch.func.vmap(_loss, in_dims=(0, 0, None))(imgs, txts, tau)
    want = torch.stack([_loss(imgs[i], txts[i], tau) for i in range(b)])
    assert_close_rel(got, want, 1e-6, "vmap vs loop")
    # per-batch gradients (an ensemble's): vmap(grad) == per-batch autograd
    grads = torch.func.vmap(torch.func.grad(_loss, argnums=(0, 1, 2)), in_dims=(0, 0, None))(imgs, txts, tau)
    for i in range(b):
        ref = _eager_grads(imgs[i], txts[i], tau)
        for name, got_i, want_i in zip(("d img", "d txt", "d tau"), (grads[0][i], grads[1][i], grads[2][i]), ref[1:]):
            assert_close_rel(got_i, want_i, 1e-6, f"vmap(grad) {name}, batch {i}")
    # grad through vmap: the summed loss of the stack
    total = torch.func.grad(lambda x: torch.func.vmap(_loss, in_dims=(0, 0, None))(x, txts, tau).sum())(imgs)
    for i in range(b):
        assert_close_rel(total[i], _eager_grads(imgs[i], txts[i], tau)[1], 1e-6, f"d img[{i}]")


def test_second_derivative_raises_without_the_guard():
    # the operators' own first-order protection (loss.py also wraps the inputs in a guard)
    img, txt = _features(grad=True)
    tau = torch.tensor(0.1, requires_grad=True)
    pairs = ht.hn_clip_pairs_triton(img, txt, tau=tau, gamma=0.5, label_smoothing=0.0, normalize=True)
    d_img, d_txt, d_tau = torch.autograd.grad(pairs.mean(), [img, txt, tau], create_graph=True)
    for wrt in (img, txt, tau):
        with pytest.raises(RuntimeError, match='second derivatives .* backend="torch"'):
            torch.autograd.grad(d_img.pow(2).sum() + d_txt.pow(2).sum() + d_tau.pow(2), wrt, retain_graph=True)
    plain_txt = txt.detach()
    hessian = torch.func.jacrev(
        torch.func.jacrev(
            lambda a: ht.hn_clip_pairs_triton(
                a, plain_txt, tau=torch.tensor(0.1), gamma=0.5, label_smoothing=0.0, normalize=True
            ).mean()
        )
    )
    with pytest.raises(RuntimeError, match='second derivatives .* backend="triton"'):
        hessian(img.detach())


# ------------------------------------------------------------------ torch.export / torch.compile
class _Loss(torch.nn.Module):
    def forward(self, img, txt):
        return hn_clip_loss(img, txt, 0.05, gamma=0.5, label_smoothing=0.1, backend="triton")


def test_export():
    img, txt = _features(seed=3)
    ep = torch.export.export(_Loss(), (img, txt))
    targets = {
        str(n.target)
        for m in ep.graph_module.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function"
    }
    assert "hnclip.triton_symmetric_nll.default" in targets, targets
    assert torch.equal(ep.module()(img, txt), _Loss()(img, txt))


SCHEDULES = {
    # γ ≠ 0 throughout, τ and γ changing every step: the first graph is specialised on the first
    # values, the second (Dynamo's automatic dynamic) takes both as symbolic floats
    "margin": [(0.07 + 0.01 * i, 0.5 + 0.05 * i) for i in range(12)],
    # a margin warm-up from γ = 0 (HAS_MARGIN False: the first graph), then a ramp, τ annealed
    "warmup": [(0.1 - 0.005 * i, 0.1 * i) for i in range(12)],
}
# (a schedule that holds γ = 0 for several steps while τ changes and only then ramps γ compiles
# three times: automatic dynamic makes τ symbolic at the first change, γ at its first change.)


@pytest.mark.parametrize(
    "backend, schedule", [("eager", "margin"), ("aot_eager", "margin"), ("aot_eager", "warmup"), ("inductor", "warmup")]
)
def test_compile_fullgraph_schedule_compiles_at_most_twice(backend, schedule):
    # "inductor" here compiles the code around the operator (opaque under the interpreter) for the
    # CPU; Inductor compiling the Triton kernels themselves is tests/backends/test_gpu.py's
    img, txt = _features(seed=4)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def step(img, txt, tau, gamma):
        return hn_clip_loss(img, txt, tau, gamma=gamma, label_smoothing=0.1, backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for tau, gamma in SCHEDULES[schedule]:
        results = []
        for fn in (compiled, step):
            leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_()]
            loss = fn(*leaves, tau, gamma)
            results.append((loss.detach(), *torch.autograd.grad(loss, leaves)))
        for name, got, want in zip(("loss", "d img", "d txt"), *results):
            assert_close_rel(got, want, 1e-6, f"{name} at tau={tau}, gamma={gamma}")
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles over 12 steps"


# ------------------------------------------------------------------ the GPU path, traced on CPU
_TRACE = textwrap.dedent("""
    import json
    import torch, triton
    from triton.backends.compiler import GPUTarget

    class _Target:  # torch's mutation analysis asks the active driver for its target; no GPU here
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(_Target())
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch._library.triton import get_triton_kernels_for_op
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.fx.experimental.proxy_tensor import make_fx
    from hnclip_kernels.backends.triton import ops as ht

    assert ht.USE_TRITON_OP, "compiled kernels must register with triton_op"

    def _name(kernel):  # through the autotuner and the heuristics to the JIT function
        while not isinstance(kernel, triton.runtime.JITFunction):
            kernel = kernel.fn
        return kernel.__name__

    def launches(fn, *args):  # the kernel launches of fn traced as AOTAutograd traces it for Inductor
        gm = make_fx(dispatch_functionalize(fn), tracing_mode="fake")(*args)
        return [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]

    def kernel_of(node):
        return kernel_side_table.get_kernel(node.kwargs["kernel_idx"])

    def family(v):  # no negatives, no own negatives, no group ids
        no_own = (torch.empty(0, 0, v.shape[1]), torch.empty(0, 0, dtype=torch.bool))
        return torch.empty(0, v.shape[1]), *no_own, torch.empty(0, dtype=torch.long)

    def fwd(v, t, *a):
        return torch.ops.hnclip.triton_symmetric_nll(v, t, *family(v), *a, True, False, True, True, "tf32x3", 0)

    def bwd(g, v, t, *a):
        return torch.ops.hnclip.triton_symmetric_nll_backward(g, v, t, *family(v), *a, True, False, True, True,
                                                              "tf32x3", 0, 0, True)

    def inputs(n, d=16):
        return (torch.randn(n, d), torch.randn(n, d), torch.tensor(0.07), torch.tensor(0.5, dtype=torch.float64),
                torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))

    def stats(n):  # rv, rt, rn (no negatives), pos, then each direction's delta, mean_neg, dsum and kept (empty),
        vec = lambda: torch.rand(n) + 0.5  # noqa: E731  (then each direction's positives' statistics: empty)
        return [vec(), vec(), torch.empty(0), vec(), vec(), vec(), vec(), torch.empty(0), vec(), vec(), vec(),
                torch.empty(0), torch.empty(0), torch.empty(0)]

    out = {name: [[_name(kernel_of(node)), sorted(node.kwargs["tensors_to_clone"]),
                   "gamma_ptr" in node.kwargs["kwargs"]] for node in nodes]
           for name, nodes in (("fwd", launches(fwd, *inputs(8))),
                               ("bwd", launches(bwd, torch.ones(8), *inputs(8), *stats(8))))}
    out["kernels"] = sorted({_name(k)
                             for k in get_triton_kernels_for_op("hnclip::triton_symmetric_nll_backward")})
    # a distributed rank's op: 4 local rows of 8 gathered ones, both directions in one walk
    def rank_fwd(*a):
        return torch.ops.hnclip.triton_rank_nll(*a, 2, True, False, True, True, "tf32x3")

    def rank_bwd(*a):
        return torch.ops.hnclip.triton_rank_nll_backward(*a, 2, True, False, True, True, "tf32x3", True)

    v, t, tau, g, e, thr = inputs(8)
    rank_in = (v[2:6].clone(), t[2:6].clone(), v, t, tau, g, e, thr)
    rank_stats = [torch.rand(n) + 0.5 for n in (4, 4, 8, 8, 8, 8, 8, 8, 0)]
    out["rank_fwd"] = [[_name(kernel_of(node)), sorted(node.kwargs["tensors_to_clone"]),
                        "gamma_ptr" in node.kwargs["kwargs"]] for node in launches(rank_fwd, *rank_in)]
    out["rank_bwd"] = [[_name(kernel_of(node)), sorted(node.kwargs["tensors_to_clone"]),
                        "gamma_ptr" in node.kwargs["kwargs"]] for node in launches(rank_bwd, torch.ones(4), *rank_in,
                                                                                     *rank_stats)]
    # a backward in 3 x 3 chunks, autotuned: one dS launch per chunk pair (the GEMMs are torch's)
    from hnclip_kernels.backends.triton import config as cfg
    cfg.BWD_WORKSPACE_BYTES = 8192
    nodes = launches(bwd, torch.ones(300), *inputs(300), *stats(300))
    out["chunked"] = [[_name(kernel_of(node)), len(kernel_of(node).configs)]
                      for node in nodes]
    print(json.dumps(out))
""")


def test_traced_for_inductor_without_gpu():
    """What torch.compile hands Inductor on a GPU: the operators decomposed into one
    triton_kernel_wrapper_functional node per launch, each cloning (writing) only its outputs
    (torch's mutation analysis of the kernels' TTIR), γ a tensor argument."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HNCLIP_TRITON_LAUNCH")}
    env["HNCLIP_AUTOTUNE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _TRACE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    writes = {
        "_fwd_pair_kernel": ["col_part_ptr", "row_part_ptr"],
        "_fold_kernel": ["acc_ptr"],
        "_merge_kernel": ["delta_ptr", "dsum_ptr", "mean_neg_ptr"],
        "_dscore_pair_kernel": ["w_ptr"],
    }
    # one slab at N = 8: the walk over tile pairs, the folds of its row blocks' and its splits'
    # partials, the two merges (rows, columns)
    assert [k for k, *_ in out["fwd"]] == [
        "_fwd_pair_kernel",
        "_fold_kernel",
        "_fold_kernel",
        "_merge_kernel",
        "_merge_kernel",
    ], out["fwd"]
    assert [k for k, *_ in out["bwd"]] == ["_dscore_pair_kernel"], out["bwd"]  # the GEMMs: torch.mm / addmm
    for kernel, cloned, takes_gamma in out["fwd"] + out["bwd"]:
        assert cloned == writes[kernel], (kernel, cloned)
        assert takes_gamma == (kernel in ("_fwd_pair_kernel", "_dscore_pair_kernel")), kernel  # γ: a tensor argument
    # triton_op finds the kernels the backward operator launches, and no other (torch hashes them into
    # its cache keys; each kernel has one named launcher): the dS and, for 16-bit features, its rounding
    # (and the negatives' block: the directional dS)
    assert out["kernels"] == ["_dscore_kernel", "_dscore_pair_kernel", "_round16_kernel"], out["kernels"]
    # the rank op: one walk for both directions, one merge of their 2M lines; one dS launch (one chunk)
    writes.update({"_fwd_rank_kernel": ["row_part_ptr"], "_dscore_rank_kernel": ["w_ptr"]})
    assert [k for k, *_ in out["rank_fwd"]] == ["_fwd_rank_kernel", "_merge_kernel"], out["rank_fwd"]
    assert [k for k, *_ in out["rank_bwd"]] == ["_dscore_rank_kernel"], out["rank_bwd"]
    for kernel, cloned, takes_gamma in out["rank_fwd"] + out["rank_bwd"]:
        assert cloned == writes[kernel], (kernel, cloned)
        assert takes_gamma == (kernel != "_merge_kernel"), kernel
    # 3 x 3 square chunks, 6 chunk pairs (b >= a), one autotuned dS launch each (float32 features: W_ab
    # and W_ba written whole, nothing accumulated; the traced autotuner keeps float32's one
    # spill-free pair tile, 64 x 16)
    chunked = out["chunked"]
    assert len(chunked) == 6 and all(name == "_dscore_pair_kernel" and configs >= 1 for name, configs in chunked), (
        chunked
    )
