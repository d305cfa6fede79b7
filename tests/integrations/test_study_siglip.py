"""examples/fine_tune_study.py ``--arm-set siglip`` on one tiny cell (default tier, a few seconds): the
three arms see exactly the same batches, each sigmoid arm's bias starts at its calibrated value (the
zero of the arm's own dL/db on the cell's first-epoch batches) and is learned (it changes). The arm
set end to end at ``--quick`` is in test_fine_tune_study.py (full tier)."""

import types

import pytest

pytest.importorskip("open_clip")
import fine_tune_study as study
import torch

WIDTH = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The study's setting (1 torch thread, deterministic algorithms): also the fastest here."""
    with study.demo.deterministic(1):
        yield


@pytest.fixture(scope="module")
def cell(one_thread):
    """A width-32 model and a cell of 128 training pairs (2 batches of 64 per epoch, 1 epoch), 8
    held-out; the three arms fine-tuned on it, the batches each arm encoded recorded."""
    data = dict(
        train=study.draw_groups(32, study.GROUP_SIZE, 11, held_out=False),
        eval=study.draw_groups(2, study.GROUP_SIZE, 12, held_out=True),
    )
    state = study.build_model(WIDTH, 0).state_dict()
    args = types.SimpleNamespace(width=WIDTH, epochs=1, lr=5e-4)
    seen, out, encode = {}, {}, study._encode
    with pytest.MonkeyPatch.context() as mp:
        for arm in study.SIGLIP_ARMS:

            def recording(model, images, tokens, chunked, arm=arm):
                seen.setdefault(arm, []).append(tokens.clone())
                return encode(model, images, tokens, chunked)

            mp.setattr(study, "_encode", recording)
            out[arm] = study.fine_tune(arm, 0, 0, state, data, args, lambda n: None)
    return types.SimpleNamespace(state=state, data=data, args=args, seen=seen, out=out)


def test_the_arm_sets_and_their_losses():
    from open_clip.loss import ClipLoss, SigLipLoss

    from hnclip_kernels import HNSigLipLoss

    assert study.ARM_SETS["siglip"] == ("ClipLoss", "SigLIP", "HN-SigLIP")
    assert study.ARM_SETS["main"] == study.ARMS
    assert type(study.make_loss("ClipLoss")) is ClipLoss and type(study.make_loss("SigLIP")) is SigLipLoss
    hn = study.make_loss("HN-SigLIP")
    assert isinstance(hn, HNSigLipLoss) and hn.options.gamma == study.GAMMA == 0.5 and hn.options.margin == "text"
    args = study.parse_args(["--arm-set", "siglip"])
    assert args.out.endswith("hnclip_fine_tune_study_siglip") and args.cache.endswith("hnclip_fine_tune_study_cache")


def test_the_arms_see_the_same_batches_and_the_bias_is_learned(cell):
    seen, out = cell.seen, cell.out
    assert [len(seen[a]) for a in study.SIGLIP_ARMS] == [2, 2, 2]
    for arm in study.SIGMOID_ARMS:  # the same pairs, in the same order, as ClipLoss
        assert all(torch.equal(a, b) for a, b in zip(seen[arm], seen["ClipLoss"]))
    assert not torch.equal(seen["ClipLoss"][0], seen["ClipLoss"][1])
    assert "logit_bias" not in out["ClipLoss"][0]
    for arm in study.SIGMOID_ARMS:
        metrics, regime = out[arm]
        change = metrics["logit_bias"] - metrics["logit_bias_init"]
        # learned: AdamW moves it by about lr per step (no weight decay on it), 2 steps here
        assert 1e-5 < abs(change) < 2 * cell.args.lr * 1.5, (arm, change)
        assert [r["epoch"] for r in regime] == [1] and regime[0]["batches"] == 2


def test_the_bias_starts_at_the_zero_of_the_arms_own_bias_gradient(cell):
    """b₀: Σ σ(z_ij) over the first-epoch batches equals the positives (the formula for SigLIP; the
    arm's own loss, with its margin, for HN-SigLIP)."""
    model = study._init_model(cell.state, WIDTH)
    data = cell.data["train"]
    batches = study.first_epoch_batches(0, 0, data["images"].shape[0])
    assert len(batches) == 2 and sorted(torch.cat(batches).tolist()) == list(range(128))
    assert all(torch.equal(data["tokens"][i], t) for i, t in zip(batches, cell.seen["ClipLoss"]))
    with torch.no_grad():
        feats = [[x.double() for x in model(data["images"][i], data["tokens"][i])] for i in batches]
    b0 = {arm: cell.out[arm][0]["logit_bias_init"] for arm in study.SIGMOID_ARMS}
    predicted = sum(torch.sigmoid(s * i @ t.T + b0["SigLIP"]).sum().item() for i, t, s in feats)
    assert predicted == pytest.approx(2 * study.BATCH, rel=1e-6)
    bias = torch.tensor(b0["HN-SigLIP"], dtype=torch.float64, requires_grad=True)
    loss = study.make_loss("HN-SigLIP")
    (slope,) = torch.autograd.grad(sum(loss(i, t, s, bias) for i, t, s in feats), bias)
    assert abs(slope.item()) < 1e-6
    assert b0["HN-SigLIP"] != b0["SigLIP"]  # calibrated per arm: the margin moves it
