"""LossOptions: the options validated once at the public boundary, bound once per call (τ read on
the host at most once, the backend and the Triton precision default resolved), and carried
unchanged to every backend and to the distributed path."""

import contextlib

import pytest
import torch

from cases import make_pair
from hnclip_kernels import HNClipLoss, LossOptions, hn_clip_loss
from hnclip_kernels.backends import cpp_directional
from hnclip_kernels.validation_options import DEFAULT_FP32_PRECISION


def test_constructor_validates_every_option():
    for kwargs, exc, name in (
        ({"gamma": -1.0}, ValueError, "gamma"),
        ({"gamma": "0.5"}, TypeError, "gamma"),
        ({"label_smoothing": 1.0}, ValueError, "label_smoothing"),
        ({"reduction": "max"}, ValueError, "reduction"),
        ({"normalize": 1}, TypeError, "normalize"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"precision": "tf32"}, ValueError, "precision"),
        ({"precision": 3}, TypeError, "precision"),
    ):
        with pytest.raises(exc, match=name):
            LossOptions(**kwargs)


def test_bind_resolves_backend_precision_and_reads_tau():
    img, txt = make_pair(6, 4, seed=1)
    bound = LossOptions(backend="triton").bind(img, txt, torch.tensor(0.05))
    assert (bound.backend, bound.precision) == ("triton", DEFAULT_FP32_PRECISION)
    assert bound.tau_value == pytest.approx(0.05)
    assert LossOptions(backend="triton", precision="ieee").bind(img, txt, 0.05).precision == "ieee"
    auto = LossOptions().bind(img, txt, 0.05)
    assert auto.backend == ("cpp" if cpp_directional() is not None else "torch") and auto.precision is None
    assert LossOptions().bind(img.double(), txt.double(), 0.05).backend == "torch"
    with pytest.raises(ValueError, match="tau"):
        LossOptions().bind(img, txt, -1.0)
    with pytest.raises(ValueError, match="img and txt must have the same shape"):
        LossOptions().bind(img, txt[:3], 0.05)


@contextlib.contextmanager
def _count_host_reads():
    """Counts the host reads of one-element tensors (``float(t)``, ``t.item()``)."""
    reads = []
    float_, item = torch.Tensor.__float__, torch.Tensor.item

    def counted_float(self):
        if self.numel() == 1:
            reads.append(self)
        return float_(self)

    def counted_item(self):
        if self.numel() == 1:
            reads.append(self)
        return item(self)

    torch.Tensor.__float__, torch.Tensor.item = counted_float, counted_item
    try:
        yield reads
    finally:
        torch.Tensor.__float__, torch.Tensor.item = float_, item


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tau_is_read_on_the_host_once_per_call(backend):
    # one device sync per step: hn_clip_loss reads a tensor τ once, HNClipLoss reads logit_scale
    # once and derives τ's value from it (no second read of τ = 1 / logit_scale)
    img, txt = make_pair(8, 4, seed=2)
    with _count_host_reads() as reads:
        hn_clip_loss(img, txt, torch.tensor(0.05), backend=backend)
    assert len(reads) == 1, f"hn_clip_loss read {len(reads)} one-element tensors on the host"
    loss = HNClipLoss(backend=backend, normalize=True)
    with _count_host_reads() as reads:
        loss(img, txt, torch.tensor(20.0))
    assert len(reads) == 1, f"HNClipLoss read {len(reads)} one-element tensors on the host"


def test_module_keeps_its_validated_options():
    loss = HNClipLoss(gamma=0.25, label_smoothing=0.1, backend="torch", precision="ieee")
    assert loss.options == LossOptions(
        gamma=0.25, label_smoothing=0.1, normalize=False, backend="torch", precision="ieee"
    )
    with pytest.raises(ValueError, match="gamma"):
        HNClipLoss(gamma=-0.5)


def test_fused_operators_share_one_hyperparameter_convention():
    # γ and ε are tensor inputs of every fused operator (a graph input under torch.compile, not a
    # constant that a schedule would recompile), after τ
    import hnclip_kernels.backends.triton.ops  # noqa: F401  (registers hnclip::triton_*)

    names = ["triton_symmetric_nll", "triton_directional_nll"]
    if cpp_directional() is not None:
        names += ["cpp_symmetric_nll", "cpp_directional_nll"]
    for name in names:
        schema = str(getattr(torch.ops.hnclip, name).default._schema)
        assert "Tensor tau, Tensor gamma, Tensor label_smoothing" in schema, schema


@pytest.mark.parametrize(
    "value,exc",
    [
        ("0.9", TypeError),
        (True, TypeError),
        (torch.tensor(0.9), TypeError),
        (1.5, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
    ],
)
def test_false_negative_threshold_is_validated_everywhere(value, exc):
    # a real number in (-1, 1] or None; the error names the argument, at every entry point
    img, txt = make_pair(6, 4, seed=1)
    with pytest.raises(exc, match="false_negative_threshold"):
        LossOptions(false_negative_threshold=value)
    with pytest.raises(exc, match="false_negative_threshold"):
        hn_clip_loss(img, txt, 0.05, false_negative_threshold=value)
    with pytest.raises(exc, match="false_negative_threshold"):
        HNClipLoss(false_negative_threshold=value)


def test_false_negative_threshold_accepts_numbers_of_any_kind():
    np = pytest.importorskip("numpy")
    img, txt = make_pair(6, 4, seed=1)
    for value in (1, 1.0, 0.5, -0.999, np.float32(0.9), np.float64(0.9)):
        assert torch.isfinite(hn_clip_loss(img, txt, 0.05, backend="torch", false_negative_threshold=value))
