"""The Triton path's workspace: ``hnclip_kernels.workspace_bytes`` equals what the operators
actually allocate (counted, not computed), and the forward's statistics are O(N). Also each
row's own negatives (their host-side block, counted by a dispatch mode),
``reduction="directions"`` (two directional walks) and both together (the own columns by
autograd: its saved tensors count from the forward into the backward).

The count: every ``torch.empty`` called from the host walks and their helpers (``forward.py``,
``merge.py``, ``backward.py``, ``scales.py``) during a forward + backward, under the interpreter
with the GPU launch configuration, is recorded with its bytes and the moments it is allocated and
freed; a buffer still alive when its walk (``*_stats`` / ``*_shares``) returns is an output (statistics, gradients),
one freed inside it is workspace. The workspace of each launcher is the peak of its live
workspace buffers; ``workspace_bytes`` must equal the sum of the two peaks.
"""

import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hnclip_kernels
from cases import check_against_truth, make_pair
from hnclip_kernels import backends
from hnclip_kernels import loss as loss_module
from hnclip_kernels.backends.triton import config as cfg
from hnclip_kernels.backends.triton import directional, rank, symmetric, workspace, workspace_host
from hnclip_kernels.backends.triton import ops as tops
from hnclip_kernels.options import LossOptions
from hnclip_kernels.validation_family import Family

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only: counts CPU allocations")

_LAYERS = tuple(f"hnclip_kernels.backends.triton.{m}" for m in ("forward", "merge", "backward", "scales"))


class _Counter:
    """Allocation log of the kernel layers: (buffer, +1 allocated / −1 freed) in order, each
    buffer's bytes and the launcher it was allocated in."""

    def __init__(self):
        self.events = []
        self.phase = None  # the launcher running now ("fwd", "bwd"), None outside them
        self.nbytes, self.born_in = [], []
        self.scratch = set()  # buffers freed before their launcher returned

    def allocated(self, t):
        key = len(self.nbytes)
        self.nbytes.append(t.untyped_storage().nbytes())
        self.born_in.append(self.phase)
        self.events.append((key, +1))
        weakref.finalize(t, self.freed, key)

    def freed(self, key):
        self.events.append((key, -1))
        if self.born_in[key] is not None and self.born_in[key] == self.phase:
            self.scratch.add(key)

    def peak(self, phase):
        """The peak of the live workspace buffers allocated in ``phase``."""
        live = peak = 0
        for key, sign in self.events:
            if key in self.scratch and self.born_in[key] == phase:
                live += sign * self.nbytes[key]
                peak = max(peak, live)
        return peak


@pytest.fixture
def counter(monkeypatch):
    """Record every torch.empty of the kernel layers; mark the launchers' phases."""
    c = _Counter()
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if sys._getframe(1).f_globals.get("__name__") in _LAYERS:
            c.allocated(t)
        return t

    def phased(name, fn):
        def run(*args, **kwargs):
            c.phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                c.phase = None  # buffers freed from here on outlived their launcher: outputs

        return run

    monkeypatch.setattr(torch, "empty", empty)
    for body, walks in (
        (symmetric, ("symmetric_stats", "symmetric_shares")),
        (directional, ("directional_stats", "directional_shares")),
        (rank, ("rank_stats", "rank_shares")),
    ):
        for walk in walks:  # the operator bodies call the walks by these names
            monkeypatch.setattr(body, walk, phased("fwd" if walk.endswith("stats") else "bwd", getattr(body, walk)))
    return c


@pytest.fixture
def gpu_launch_small(monkeypatch):
    """GPU tiles; 4 "SMs" (the symmetric forward's row groups then hold several row blocks);
    a small dS budget (several backward chunks, the last ones ragged)."""
    monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    monkeypatch.setattr(cfg, "sm_count", lambda device: 4)
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)
    assert cfg.launch_mode() == "gpu"


@pytest.mark.parametrize(
    "dtype,eps,threshold", [(torch.bfloat16, 0.0, None), (torch.float32, 0.1, None), (torch.float32, 0.1, 0.5)]
)
def test_symmetric_workspace_counted(gpu_launch_small, counter, dtype, eps, threshold):
    # threshold: false-negative masking adds the kept-count plane to the forward's partials
    n, d = 300, 32
    img, txt = (x.requires_grad_(True) for x in make_pair(n, d, dtype, seed=1))
    loss = hnclip_kernels.hn_clip_loss(
        img, txt, 0.07, gamma=0.5, label_smoothing=eps, backend="triton", false_negative_threshold=threshold
    )
    loss.backward()
    fwd, bwd = counter.peak("fwd"), counter.peak("bwd")
    assert fwd > 0 and bwd > 0
    # one slab's partials (2 row blocks' of 2N lines, the splits' of the slab's 2 · 256 lines),
    # the running summaries (2N lines)
    masked = threshold is not None
    planes = (4 if eps else 3) + masked
    assert fwd == workspace.forward_bytes(n, n, dtype.itemsize, True, bool(eps), masked=masked)
    assert fwd % (4 * planes * 2) == 0
    assert bwd == workspace.backward_bytes(n, n, d, dtype, symmetric=True)
    assert fwd + bwd == hnclip_kernels.workspace_bytes(
        n, d, dtype, gamma=0.5, label_smoothing=eps, false_negative_threshold=threshold
    )


@pytest.mark.parametrize(
    "dtype,threshold", [(torch.bfloat16, None), (torch.float16, None), (torch.float32, None), (torch.bfloat16, 0.5)]
)
def test_rank_workspace_counted(gpu_launch_small, counter, dtype, threshold):
    """A distributed rank's op (both directions in one walk and one dS chunk walk): what it
    allocates is ``workspace_bytes(n, d, dtype, local_rows=m)``, several ragged backward chunks
    (with false-negative masking: the kept-count plane)."""
    m, n, d, offset = 130, 300, 32, 100
    all_img, all_txt = (x.requires_grad_(True) for x in make_pair(n, d, dtype, seed=2))
    img, txt = all_img[offset : offset + m], all_txt[offset : offset + m]
    loss = tops.rank_nll_triton(
        img,
        txt,
        all_img,
        all_txt,
        tau=torch.tensor(0.05),
        offset=offset,
        gamma=0.5,
        label_smoothing=0.0,
        normalize=True,
        false_negative_threshold=threshold,
    )
    loss.sum().backward()
    fwd, bwd = counter.peak("fwd"), counter.peak("bwd")
    assert fwd == workspace.forward_bytes(m, n, dtype.itemsize, False, False, masked=threshold is not None) > 0
    assert bwd == workspace.backward_bytes(m, n, d, dtype) > 0
    assert fwd + bwd == hnclip_kernels.workspace_bytes(n, d, dtype, local_rows=m, false_negative_threshold=threshold)


def test_workspace_is_linear_in_n():
    """At N = 262144, D = 768, bf16, γ = 0.5 the loss needs ≤ 1 GiB beyond inputs and gradients
    (it needed 6.25 GiB with column partials per row block), and the forward's share grows as N."""
    ws = {n: hnclip_kernels.workspace_bytes(n, 768, torch.bfloat16, gamma=0.5) for n in (65536, 131072, 262144)}
    assert ws[262144] <= 1 << 30
    fwd = {n: workspace.forward_bytes(n, n, 2, True, False) for n in ws}
    assert fwd[262144] <= 2 * fwd[131072] <= 4 * fwd[65536]
    assert fwd[262144] <= 128 << 20
    # a rank's op (both directions): row partials only, and one chunk of two dS buffers
    assert hnclip_kernels.workspace_bytes(262144, 768, torch.bfloat16, local_rows=32768) <= 1 << 30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slabs_fold_columns_gpu_launch(gpu_launch_small, dtype):
    # 600 rows in slabs of 2 row blocks: bf16 has 5 blocks of 128 (slabs 2 + 2 + 1), float32 10 of
    # 64 (5 slabs); each slab's column partials are folded into the running summaries
    row_blocks, slab, splits, _ = cfg.fwd_grid(600, 600, dtype.itemsize, True, torch.device("cpu"))
    assert slab == 2 and row_blocks > slab and splits == 4
    check_against_truth(
        "triton", 600, 24, dtype, 0.5, 0.05, 0.1, "none", upstream=torch.linspace(-1.0, 2.0, 600), seed=5
    )


def test_forward_bit_reproducible_gpu_launch(gpu_launch_small):
    img, txt = make_pair(400, 32, torch.bfloat16, seed=6)
    runs = [
        hnclip_kernels.hn_clip_loss(img, txt, 0.03, gamma=0.5, reduction="none", backend="triton") for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


class _OwnBuffers(TorchDispatchMode):
    """Every new storage an aten op returns inside the own block's host steps whose tensor is led by
    (N, K) or N·K (the (N, K, D) and (N, K) buffers; the O(N·D) and O(N) temporaries are not
    workspace, as the epilogue's are not), logged in ``counter`` under the phase running, freed
    when its storage is (views and autograd's saved tensors keep it alive)."""

    def __init__(self, counter, n, k):
        super().__init__()
        self.counter, self.n, self.k = counter, n, k

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (
                tuple(t.shape[:2]) == (self.n, self.k) or t.shape[:1] == (self.n * self.k,)
            ):
                storage = t.untyped_storage()
                if storage.nbytes() and id(storage) not in self.counter.storages:
                    self.counter.record(storage, "rows" if t.numel() == self.n * self.k else "block")
        return out


class _OwnCounter(_Counter):
    """:class:`_Counter` of storages, each with its kind ("block": N·K·D elements, "rows": N·K)."""

    def __init__(self):
        super().__init__()
        self.storages, self.kind = set(), []

    def record(self, storage, kind):
        key = len(self.nbytes)
        self.nbytes.append(storage.nbytes())
        self.born_in.append(self.phase)
        self.kind.append(kind)
        self.storages.add(id(storage))
        self.events.append((key, +1))
        weakref.finalize(storage, self.storage_freed, key, id(storage))

    def storage_freed(self, key, ident):
        self.storages.discard(ident)
        self.freed(key)

    def peak_of(self, phase, kind):
        live = peak = 0
        for key, sign in self.events:
            if key in self.scratch and self.born_in[key] == phase and self.kind[key] == kind:
                live += sign * self.nbytes[key]
                peak = max(peak, live)
        return peak


OWN_CASES = {  # dtype, hn_clip_loss's options; N = 130 rows of K = 3 own negatives, D = 20
    "float32": (torch.float32, {}),
    "bf16 threshold mask": (torch.bfloat16, dict(false_negative_threshold=0.5, mask=True)),
    "float32 threshold image_text eps": (
        torch.float32,
        dict(false_negative_threshold=0.5, margin="image_text", label_smoothing=0.1),
    ),
    "float16 unnormalized": (torch.float16, dict(normalize=False)),
    "float32 unnormalized threshold": (torch.float32, dict(normalize=False, false_negative_threshold=0.5)),
}


@pytest.mark.parametrize("case", list(OWN_CASES), ids=list(OWN_CASES))
def test_own_negatives_workspace_counted(gpu_launch_small, counter, monkeypatch, case):
    """Each row's own negatives: the float32 (N, K, D) buffers the host block holds at its peak are
    ``own_bytes``'s count in both phases, its (N, K) ones within ``OWN_ROW_BYTES``·N·K, the kernels'
    walks are the plain loss's, and ``workspace_bytes(own_negatives=K)`` takes each phase's larger."""
    dtype, kw = OWN_CASES[case]
    kw = dict(kw)
    n, k, d = 130, 3, 20
    own_count = _OwnCounter()

    def phased(name, fn):
        def run(*args, **kwargs):
            own_count.phase = name
            try:
                with _OwnBuffers(own_count, n, k):
                    return fn(*args, **kwargs)
            finally:
                own_count.phase = None

        return run

    for name in ("_own_forward", "_own_backward"):
        monkeypatch.setattr(symmetric, name, phased(name, getattr(symmetric, name)))
    img, txt = (x.requires_grad_(True) for x in make_pair(n, d, dtype, seed=7))
    gen = torch.Generator().manual_seed(8)
    own = torch.randn(n, k, d, generator=gen).to(dtype).requires_grad_(True)
    mask = torch.rand(n, k, generator=gen) < 0.7 if kw.pop("mask", False) else None
    loss = hnclip_kernels.hn_clip_loss(img, txt, 0.07, negatives=own, negatives_mask=mask, backend="triton", **kw)
    loss.backward()
    assert own.grad is not None and torch.isfinite(own.grad).all()
    threshold, eps, normalize = (
        kw.get("false_negative_threshold"),
        kw.get("label_smoothing", 0.0),
        kw.get("normalize", True),
    )
    own_fwd, own_bwd = workspace_host.own_bytes(n, k, d, dtype, threshold is not None, normalize)
    rows = workspace_host.OWN_ROW_BYTES * n * k
    for phase, stated in (("_own_forward", own_fwd), ("_own_backward", own_bwd)):
        assert own_count.peak_of(phase, "block") == stated - rows > 0, phase
        assert 0 < own_count.peak_of(phase, "rows") <= rows, phase
        assert own_count.peak(phase) <= stated, phase
    fwd, bwd = counter.peak("fwd"), counter.peak("bwd")
    masked = threshold is not None
    assert fwd == workspace.forward_bytes(n, n, dtype.itemsize, True, bool(eps), masked=masked) > 0
    assert bwd == workspace.backward_bytes(n, n, d, dtype, symmetric=True) > 0
    assert max(fwd, own_fwd) + max(bwd, own_bwd) == hnclip_kernels.workspace_bytes(
        n, d, dtype, label_smoothing=eps, false_negative_threshold=threshold, own_negatives=k, normalize=normalize
    )


@pytest.mark.parametrize(
    "dtype,n,m,eps,threshold",
    [(torch.bfloat16, 60, 50, 0.1, None), (torch.float32, 200, 0, 0.0, 0.5)],
    ids=["bf16 negatives eps", "float32 threshold"],
)
def test_directions_workspace_counted(gpu_launch_small, counter, dtype, n, m, eps, threshold):
    """``reduction="directions"``: its directional walks (two, four with ε > 0) allocate at their
    peaks what ``directions_bytes`` states, in float32 whatever the features' dtype (N = 60 rows:
    i2t's dS chunk is 60 × (60 + M), wider than t2i's)."""
    d = 24
    img, txt = (x.requires_grad_(True) for x in make_pair(n, d, dtype, seed=9))
    neg = torch.randn(m, d).to(dtype) if m else None
    rows = hnclip_kernels.hn_clip_loss(img, txt, 0.07, reduction="directions", negatives=neg, label_smoothing=eps,
                                       false_negative_threshold=threshold, backend="triton")  # fmt: skip
    sum(x.sum() for x in rows).backward()
    fwd, bwd = counter.peak("fwd"), counter.peak("bwd")
    masked = threshold is not None
    stated = workspace.directions_bytes(n, n, d, dtype, bool(eps), masked=masked, m=m)
    assert (fwd, bwd) == stated and fwd > 0 and bwd > 0
    assert fwd + bwd == hnclip_kernels.workspace_bytes(
        n, d, dtype, label_smoothing=eps, false_negative_threshold=threshold, negatives=m, reduction="directions"
    )


class _DirectionsOwnCounter(_OwnCounter):
    """:class:`_OwnCounter` of ``reduction="directions"``'s own columns: autograd differentiates
    them, so the tensors it saves live from the forward ("fwd": the ``direction_losses`` call) into
    the backward ("bwd": ``backward()``). A storage alive after both is an output (the gradient in
    the negatives' dtype; an input's view); every other one is workspace, counted live in each
    phase it spans."""

    def _workspace(self, kind=None):
        """(event index, live workspace bytes after it), outputs left out."""
        outputs = {key for key, sign in self.events if sign > 0} - {key for key, sign in self.events if sign < 0}
        live = 0
        for at, (key, sign) in enumerate(self.events):
            if key not in outputs and (kind is None or self.kind[key] == kind):
                live += sign * self.nbytes[key]
            yield at, live

    def peak_spanning(self, phase, kind=None):
        return max((live for at, live in self._workspace(kind) if self.phase_of[at] == phase), default=0)

    def live_at(self, events):
        """Workspace bytes live once the first ``events`` events happened."""
        return dict(self._workspace()).get(events - 1, 0)


DIRECTIONS_OWN_CASES = {  # dtype, hn_clip_loss's options, local rows R (None: one process); N = 130, K = 3, D = 20
    "float32": (torch.float32, {}, None),
    "bf16 threshold mask eps": (
        torch.bfloat16,
        dict(false_negative_threshold=0.5, mask=True, label_smoothing=0.1),
        None,
    ),
    "float32 threshold image_text": (torch.float32, dict(false_negative_threshold=0.5, margin="image_text"), None),
    "float16 unnormalized": (torch.float16, dict(normalize=False), None),
    "float32 local rows threshold eps": (torch.float32, dict(false_negative_threshold=0.5, label_smoothing=0.1), 50),
    "float32 local rows unnormalized mask": (torch.float32, dict(normalize=False, mask=True), 50),
}


_DIRECTIONS_OWN_FULL_TIER = (
    "float32 threshold image_text",
    "float16 unnormalized",
    "float32 local rows unnormalized mask",
)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in _DIRECTIONS_OWN_FULL_TIER else c for c in DIRECTIONS_OWN_CASES],
)
def test_directions_own_negatives_workspace_counted(gpu_launch_small, counter, monkeypatch, case):
    """``reduction="directions"`` with each row's own negatives: the (R, K, D) buffers its own
    columns hold at each phase's peak (autograd's saved tensors included) are
    ``directions_own_bytes``'s count, the (R, K) ones within ``DIRECTIONS_OWN_ROW_BYTES``·R·K, the
    walks are the plain directions' (i2t over the N captions), the block runs after the walks and
    its backward before theirs (only a 16-bit copy or its float32 gradient is live beside a walk),
    and ``workspace_bytes(own_negatives=K, reduction="directions")`` takes each phase's larger. With
    ``local_rows``: a rank's R rows against the N gathered columns (``local_loss=True``'s call)."""
    dtype, kw, local = DIRECTIONS_OWN_CASES[case]
    kw = dict(kw)
    n, k, d = 130, 3, 20
    r, offset = (n, 0) if local is None else (local, 40)
    own_count = _DirectionsOwnCounter()
    own_count.phase_of = []
    real_record, real_freed = own_count.record, own_count.freed

    def record(storage, kind):  # each event's phase (the parent's `born_in` marks only births)
        own_count.phase_of.append(own_count.phase)
        real_record(storage, kind)

    def freed(key):
        own_count.phase_of.append(own_count.phase)
        real_freed(key)

    own_count.record, own_count.freed = record, freed
    at_walks = []  # own bytes live when a walk starts

    def watched(fn):
        def run(*args, **kwargs):
            at_walks.append(len(own_count.events))
            return fn(*args, **kwargs)

        return run

    for walk in ("directional_stats", "directional_shares"):
        monkeypatch.setattr(directional, walk, watched(getattr(directional, walk)))
    img, txt = (x.requires_grad_(True) for x in make_pair(n, d, dtype, seed=11))
    gen = torch.Generator().manual_seed(12)
    own = torch.randn(r, k, d, generator=gen).to(dtype).requires_grad_(True)
    mask = torch.rand(r, k, generator=gen) < 0.7 if kw.pop("mask", False) else None
    mode = _OwnBuffers(own_count, r, k)
    mode.counter.storages.add(id(own.untyped_storage()))  # the input (its views are no new buffer)
    with mode:
        own_count.phase = "fwd"
        if local is None:
            real = loss_module.direction_losses

            def scoped(*args, **kwargs):  # the validation's temporaries are not the block's
                own_count.phase = "fwd"
                try:
                    return real(*args, **kwargs)
                finally:
                    own_count.phase = None

            monkeypatch.setattr(loss_module, "direction_losses", scoped)
            own_count.phase = None
            rows = hnclip_kernels.hn_clip_loss(
                img, txt, 0.07, negatives=own, negatives_mask=mask, reduction="directions", backend="triton", **kw
            )
        else:  # a rank's R rows at offset against the N gathered columns, as local_loss=True calls it
            threshold = kw.pop("false_negative_threshold", None)
            options = LossOptions(reduction="directions", backend="triton", false_negative_threshold=threshold, **kw)
            bound = options.bind(img, txt, 0.07)
            tau = torch.tensor(0.07)
            family = Family(own_negatives=own, own_mask=mask)
            q_img, q_txt = img[offset : offset + r], txt[offset : offset + r]
            rows = backends.direction_losses(q_img, q_txt, img, txt, tau, offset, bound, False, family)
            kw["false_negative_threshold"] = threshold
            own_count.phase = None
        own_count.phase = "bwd"
        sum(x.sum() for x in rows).backward()
        del rows
        own_count.phase = None
    assert own.grad is not None and torch.isfinite(own.grad).all()
    # 16-bit: the float32 copy (made before the walks) is live through the forward's walks, its
    # float32 gradient (rounded to the dtype last) through the backward's; nothing else is
    copy = 4 * r * k * d * (dtype != torch.float32)
    assert len(at_walks) >= 4 and {own_count.live_at(at) for at in at_walks} == {copy}, at_walks
    threshold, eps, normalize = (
        kw.get("false_negative_threshold"),
        kw.get("label_smoothing", 0.0),
        kw.get("normalize", True),
    )
    own_fwd, own_bwd = workspace_host.directions_own_bytes(r, k, d, dtype, threshold is not None, normalize)
    row_bound = workspace_host.DIRECTIONS_OWN_ROW_BYTES * r * k
    for phase, stated in (("fwd", own_fwd), ("bwd", own_bwd)):
        assert own_count.peak_spanning(phase, "block") == stated - row_bound > 0, phase
        assert 0 < own_count.peak_spanning(phase, "rows") <= row_bound, phase
        assert own_count.peak_spanning(phase) <= stated, phase
    fwd, bwd = counter.peak("fwd"), counter.peak("bwd")
    masked = threshold is not None
    assert (fwd, bwd) == workspace.directions_bytes(r, n, d, dtype, bool(eps), masked=masked) and fwd > 0 and bwd > 0
    assert max(fwd + copy, own_fwd) + max(bwd + copy, own_bwd) == hnclip_kernels.workspace_bytes(
        n, d, dtype, label_smoothing=eps, false_negative_threshold=threshold, own_negatives=k, normalize=normalize,
        local_rows=local, reduction="directions",
    )  # fmt: skip


def test_own_negatives_and_directions_figures_and_refusals():
    """The docstring's figures (132 SMs) and the refusals naming the argument."""
    mib = 1 << 20
    n, k, d = 32768, 8, 768
    plain = hnclip_kernels.workspace_bytes(n, d, torch.bfloat16, device="cpu")
    own = hnclip_kernels.workspace_bytes(n, d, torch.bfloat16, own_negatives=k, device="cpu")
    assert (round(plain / mib), own // mib) == (493, 5396)
    big = 262144
    assert hnclip_kernels.workspace_bytes(big, d, torch.bfloat16, reduction="directions", device="cpu") == 259 * mib
    own_directions = {
        dtype: hnclip_kernels.workspace_bytes(n, d, dtype, own_negatives=k, reduction="directions", device="cpu")
        for dtype in (torch.bfloat16, torch.float32)
    }
    assert own_directions == {torch.bfloat16: 6180 * mib, torch.float32: 4644 * mib}
    for bad, match in (
        (dict(own_negatives=-1), "own_negatives"),
        (dict(own_negatives=2, negatives=3), "shared negatives"),
        (dict(own_negatives=2, local_rows=5), "local_rows"),
        (dict(own_negatives=2, local_rows=5, reduction="mean"), "local_rows only with reduction='directions'"),
        (dict(reduction="rows"), "reduction"),
    ):
        with pytest.raises(ValueError, match=match):
            hnclip_kernels.workspace_bytes(64, 8, torch.float32, **bad)


class _HostBuffers(TorchDispatchMode):
    """Every new storage an aten op returns inside a host positive pass (its outputs included),
    logged with its bytes; the pass's peak of live ones."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs, self.live, self.peak, self.mine = inputs, 0, 0, set()

    def _free(self, nbytes, ptr):
        self.live -= nbytes
        self.mine.discard(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.inputs and ptr not in self.mine:  # a view's storage is no new buffer
                    self.mine.add(ptr)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage.nbytes(), ptr)
        return out


POSITIVE_CASES = {  # dtype, group_mode, D, groups (ids = arange(N) % groups), M shared negatives (0: the counter logs
    # the walk without them); N = 100
    "float32 supcon": (torch.float32, "supcon", 16, 10, 0),
    "bf16 mil_nce": (torch.bfloat16, "mil_nce", 32, 3, 0),
    "float32 mil_nce wide": (torch.float32, "mil_nce", 64, 25, 0),
}


@pytest.mark.parametrize("case", list(POSITIVE_CASES))
def test_positive_modes_workspace_counted(gpu_launch_small, counter, monkeypatch, case):
    """``group_mode="supcon"/"mil_nce"``: the kernels allocate what they do under "mask" (the
    kept-count plane), and each direction's host pass (``hnclip::host_positive_fwd/bwd``, one chunk
    here) at its peak within ``positive_bytes``' bound, its (pairs, D) buffers counted exactly (the
    bound's slack at most its per-pair and per-row terms); ``workspace_bytes(group_mode=,
    positive_pairs=)`` takes each phase's larger."""
    from hnclip_kernels.backends import positives

    dtype, mode, d, groups, m = POSITIVE_CASES[case]
    n = 100
    peaks = {"fwd": [], "bwd": []}

    def logged(phase, op):
        def run(*args, **kwargs):
            log = _HostBuffers({a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)})
            with log:
                out = op._init_fn(*args, **kwargs)  # the op's body, so the mode sees its aten calls
            peaks[phase].append(log.peak)
            return out

        return run

    monkeypatch.setattr(symmetric, "positive_fwd", logged("fwd", positives.positive_fwd))
    monkeypatch.setattr(symmetric, "positive_bwd", logged("bwd", positives.positive_bwd))
    img, txt = (x.requires_grad_(True) for x in make_pair(n, d, dtype, seed=13))
    ids = torch.arange(n) % groups
    neg = torch.randn(m, d).to(dtype) if m else None
    loss = hnclip_kernels.hn_clip_loss(img, txt, 0.07, negatives=neg, group_ids=ids, group_mode=mode, backend="triton")
    loss.backward()
    pairs = int(torch.bincount(ids).pow(2).sum())
    host_fwd, host_bwd = workspace_host.positive_bytes(n, d, pairs)
    bounded = workspace_host.POSITIVE_PAIR_BYTES * pairs + workspace_host.POSITIVE_ROW_BYTES * n
    for phase, stated in (("fwd", host_fwd), ("bwd", host_bwd)):
        assert len(peaks[phase]) == 2, phase  # i2t and t2i, the same sizes
        for peak in peaks[phase]:
            assert stated - bounded < peak <= stated, (phase, peak, stated)
    fwd, bwd = counter.peak("fwd"), counter.peak("bwd")
    assert fwd == workspace.family_forward_bytes(n, m, dtype.itemsize, False, masked=True) > 0
    kernels_bwd = workspace.backward_bytes(n, n, d, dtype, symmetric=True)
    if m:
        kernels_bwd = max(kernels_bwd, workspace.backward_bytes(n, m, d, dtype, rank=False))
    assert bwd == kernels_bwd > 0
    assert max(fwd, host_fwd) + max(bwd, host_bwd) == hnclip_kernels.workspace_bytes(
        n, d, dtype, negatives=m, group_ids=True, group_mode=mode, positive_pairs=pairs
    )
    for bad, match in (
        (dict(group_mode="pairs"), "group_mode"),
        (dict(group_mode=mode, positive_pairs=n - 1), "positive_pairs"),
        (dict(group_mode=mode, positive_pairs=pairs, group_ids=False), "group_ids=True"),
        (dict(group_mode=mode, positive_pairs=pairs, reduction="directions"), "reduction"),
    ):
        with pytest.raises(ValueError, match=match):
            hnclip_kernels.workspace_bytes(n, d, dtype, **{"group_ids": True, **bad})
