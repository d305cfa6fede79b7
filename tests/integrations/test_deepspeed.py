"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU: 2 gloo ranks of 6 and 5 pairs, ``local_loss=True, gather_with_grad=True``.

The tiny open_clip ViT and ``CLIPModel`` of ``test_chunked.py`` (no dropout), their 0-dim
``logit_scale`` made (1,) by ``unsqueeze_scalar_parameters`` (``deepspeed.initialize`` cannot
broadcast a 0-dim parameter), the towers chunked inside the engine's forward (open_clip:
``train.py``'s chunked forward; ``CLIPModel``: ``clip_model_loss(engine, ..., chunk_size=4)``).
Two SGD steps each: the chunked losses equal the unchunked ones at both steps and the full
gradients of the first step (``safe_get_full_grad``, ``logit_scale`` included) equal those of
one process on all 11 pairs, at 1e-5. ZeRO-3 partitions every parameter
(``stage3_param_persistence_threshold: 0``). The trained models' gathered state dicts, scalars
squeezed back, load into the unmodified 0-dim models (open_clip: ``load_state_dict``;
``CLIPModel``: ``save_pretrained`` / ``from_pretrained``) with ``logit_scale`` bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from helpers import spawn_gloo_ranks
from hnclip_kernels import HNClipLoss
from hnclip_kernels.sharding import squeeze_scalar_parameters, unsqueeze_scalar_parameters
from test_chunked import SIZES, C, assert_worst, groups, hf_batch, hf_model, hf_step, oc_batch, oc_model, oc_step

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (the [test] extra: deepspeed==0.19.8)"
)

STEPS, LR = 2, 0.5


def _config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter, however small
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's SGD
        "steps_per_print": 10**9,
    }


def _full_state(deepspeed, model):
    """The full state dict on every rank (ZeRO-3: the parameters gathered; ZeRO-2: as they are)."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(deepspeed, stage, kind, chunk, rank, world, out_dir):
    from deepspeed.utils import safe_get_full_grad

    from hnclip_kernels.integrations.transformers import clip_model_loss
    from hnclip_kernels.train import _chunked_forward

    rows = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    model = oc_model(dropout=False) if kind == "oc" else hf_model(dropout=False)
    names = unsqueeze_scalar_parameters(model)
    initial = model.logit_scale.detach().clone()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=_config(stage)
    )
    if kind == "oc" and chunk:
        model.forward = functools.partial(_chunked_forward, model, chunk)
    loss_fn = HNClipLoss(gamma=0.5, local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    losses, grads = [], None
    for step in range(STEPS):
        if kind == "oc":
            images, texts = oc_batch()
            loss = loss_fn(*engine(images[rows], texts[rows]))
        else:
            ids, pixels, mask = hf_batch()
            loss = clip_model_loss(engine, ids[rows], pixels[rows], mask[rows], gamma=0.5, chunk_size=chunk)
        engine.backward(loss)
        if step == 0:  # every rank takes part: ZeRO gathers the partitions
            grads = groups(model, {n: safe_get_full_grad(p) for n, p in model.named_parameters()})
        engine.step()
        losses.append(loss.item())
    state = _full_state(deepspeed, model)
    scale = state["logit_scale"]
    assert not torch.equal(scale, initial)  # trained
    saved = None
    if rank == 0 and chunk:
        state = squeeze_scalar_parameters(state, names)
        assert state["logit_scale"].shape == ()
        if kind == "oc":
            fresh = oc_model(dropout=False)  # 0-dim logit_scale, as open_clip builds it
            fresh.load_state_dict(state)
            saved = fresh.logit_scale.detach().clone()
        else:
            model.save_pretrained(os.path.join(out_dir, f"zero{stage}"), state_dict=state)  # consumes state
    return losses, grads, scale, saved


def _rank(rank, world, out_dir):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))  # deepspeed.initialize reads LOCAL_RANK
    import deepspeed
    import deepspeed.ops

    # the shared-memory all-reduce DeepSpeed JIT-compiles on CPU serves inference_all_reduce only,
    # not training (1-2 minutes of g++ in a fresh environment): left out
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    report = {}
    for stage in (2, 3):
        for kind in ("oc", "hf"):
            for name, chunk in (("unchunked", None), ("chunked", C)):
                losses, grads, scale, saved = _run(deepspeed, stage, kind, chunk, rank, world, out_dir)
                report[(stage, kind, name)] = dict(
                    losses=losses,
                    grads={k: {n: g.numpy() for n, g in v.items()} for k, v in grads.items()},
                    scale=scale.numpy(),
                    saved=None if saved is None else saved.numpy(),
                )
    return report


def test_zero_2_and_3_chunked_equal_unchunked_and_one_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    reports = spawn_gloo_ranks(_rank, tmp_path, str(tmp_path), timeout=300, pg_timeout_s=120)

    single = {}  # one process on all 11 pairs
    oc, hf = oc_model(dropout=False), hf_model(dropout=False)
    unsqueeze_scalar_parameters(oc), unsqueeze_scalar_parameters(hf)
    _, single["oc"] = oc_step(oc, *oc_batch(), None)
    _, single["hf"] = hf_step(hf, hf_batch(), None)
    for rank in (0, 1):
        report = reports[rank]
        for stage in (2, 3):
            for kind in ("oc", "hf"):
                plain, chunked = report[(stage, kind, "unchunked")], report[(stage, kind, "chunked")]
                assert chunked["losses"] == pytest.approx(plain["losses"], rel=1e-5), (stage, kind)
                assert plain["losses"][0] != plain["losses"][1]  # the first step changed the model
                plain_grads, chunked_grads = (
                    {k: {n: torch.from_numpy(g) for n, g in v.items()} for k, v in run["grads"].items()}
                    for run in (plain, chunked)
                )
                assert_worst(chunked_grads, plain_grads)
                assert_worst(plain_grads, single[kind])
                assert_worst(chunked_grads, single[kind])
    for stage in (2, 3):  # the trained scale, saved 0-dim, loads bit for bit into the unmodified models
        oc_run, hf_run = (reports[0][(stage, kind, "chunked")] for kind in ("oc", "hf"))
        assert oc_run["saved"].shape == () and oc_run["saved"].tobytes() == oc_run["scale"].tobytes()
        back = transformers.CLIPModel.from_pretrained(str(tmp_path / f"zero{stage}")).logit_scale.detach()
        assert back.shape == () and back.numpy().tobytes() == hf_run["scale"].tobytes()
