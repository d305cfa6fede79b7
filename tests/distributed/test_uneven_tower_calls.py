"""Per-layer sharding with ranks whose towers would run a different number of times.

``fully_shard`` on every encoder layer plus the root (docs/distributed.md's recipe) makes each
call of a layer a collective (its parameters all-gathered in the forward, again in the backward,
its gradient reduce-scattered), and so does DeepSpeed ZeRO-3 (parameters fetched per module). A
rank with fewer chunks, or without hard negatives, used to leave its peer waiting in gloo ("Is
there a distributed collective mismatch", "Connection reset by peer"). The entries now agree on
the calls (``hnclip_kernels.chunked.agree_tower_calls``: one all_reduce a step) and pad with
one-row calls whose outputs join the features with zero rows.

One spawn of 2 gloo ranks runs every case below (pairs, negatives per rank, chunk size):

* ``clip_model_loss`` on ``CLIPModel`` under FSDP2 per layer, all cases; under DeepSpeed ZeRO-3
  (every parameter partitioned) the unequal ones;
* open_clip through ``python -m hnclip_kernels.train``'s forwards (``train_negatives.family_forward``,
  ``train._chunked_forward``) under FSDP2 per layer (one negative per row at most there: case e's
  rank 1 holds 3, one chunk);
* both towers' calls per rank counted (forward pre-hooks on a layer of each tower): equal;
* bit-identity: with dropout, unwrapped models, the padded rank's gradients equal, bit for bit,
  those of the same rank with the padding switched off (the dummy calls leave the RNG as it was).

Each sharded gradient (``full_tensor`` / ``safe_get_full_grad``, ``logit_scale`` included) equals
the single-process gradient on the concatenated batch (pairs and negatives in rank order) at 1e-5
relative per parameter (float32; ``test_chunked.assert_worst``).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from helpers import spawn_gloo_ranks
from hnclip_kernels import HNClipLoss
from hnclip_kernels.sharding import unsqueeze_scalar_parameters
from test_chunked import assert_worst, groups, hf_batch, hf_model, oc_batch, oc_model

# name: (pairs per rank, negatives per rank, chunk size); chunks per rank in the comments
CASES = {
    "a_equal": ((4, 4), (2, 2), None),  # 1 + 1 calls a tower, negatives on both ranks
    "b_negatives_on_rank_0_only": ((4, 3), (3, 0), None),  # negatives' text call: 1 and 0
    "c_chunks_2_and_1": ((4, 3), (0, 0), 3),  # pair chunks 2 and 1
    "d_chunks_2_and_1_negatives_3_and_0": ((4, 3), (3, 0), 3),  # pair chunks 2/1, negative chunks 1/0
    "e_chunks_2_and_1_negatives_0_and_4": ((4, 3), (0, 4), 3),  # pair chunks 2/1, negative chunks 0/2
}
DEEPSPEED_CASES = ("b_negatives_on_rank_0_only", "c_chunks_2_and_1", "d_chunks_2_and_1_negatives_3_and_0")
OPEN_CLIP_CASES = ("b_negatives_on_rank_0_only", "c_chunks_2_and_1", "e_chunks_2_and_1_negatives_0_and_4")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _rows(sizes, rank):
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def _hf_data(case):
    sizes, neg_sizes, _ = CASES[case]
    ids, pixels, mask = hf_batch(sum(sizes))
    neg_ids, _, neg_mask = hf_batch(max(sum(neg_sizes), 1), seed=2)
    return ids, pixels, mask, neg_ids[: sum(neg_sizes)], neg_mask[: sum(neg_sizes)]


def _hf_rank_loss(model, case, rank, **kw):
    from hnclip_kernels.integrations.transformers import clip_model_loss

    sizes, neg_sizes, chunk = CASES[case]
    ids, pixels, mask, neg_ids, neg_mask = _hf_data(case)
    rows, negs = _rows(sizes, rank), _rows(neg_sizes, rank)
    negatives = {}
    if neg_sizes[rank]:
        negatives = dict(negative_input_ids=neg_ids[negs], negative_attention_mask=neg_mask[negs])
    return clip_model_loss(model, ids[rows], pixels[rows], mask[rows], gamma=0.5, chunk_size=chunk, **negatives, **kw)


def _oc_data(case):
    """Images and tokens, packed with negatives (train_negatives.pack, a rank's rows with negatives
    first) when the case has any."""
    from hnclip_kernels.train_negatives import pack

    sizes, neg_sizes, _ = CASES[case]
    images, texts = oc_batch(sum(sizes))
    if not any(neg_sizes):
        return images, texts
    _, negatives = oc_batch(sum(sizes), seed=2)
    packed = []
    for rank in range(2):
        for i in range(_rows(sizes, rank).start, _rows(sizes, rank).stop):
            has = i - _rows(sizes, rank).start < neg_sizes[rank]
            packed.append(pack(texts[i], negatives[i] if has else None, 0))
    return images, torch.stack(packed)


def _oc_forward(model, case):
    from hnclip_kernels.train import _chunked_forward
    from hnclip_kernels.train_negatives import family_forward

    _, neg_sizes, chunk = CASES[case]
    if any(neg_sizes):
        return functools.partial(family_forward, model, chunk_size=chunk)
    return functools.partial(_chunked_forward, model, chunk)


def _per_layer_fsdp2(model, kind):
    from torch.distributed.fsdp import fully_shard

    unsqueeze_scalar_parameters(model)  # fully_shard refuses 0-dim parameters
    towers = (
        (model.vision_model.encoder.layers, model.text_model.encoder.layers)
        if kind == "hf"
        else (model.visual.transformer.resblocks, model.transformer.resblocks)
    )
    for layers in towers:
        for layer in layers:
            fully_shard(layer)
    return fully_shard(model)


def _count_layer_calls(model, kind):
    """{tower: forward calls of its first layer (recomputes included)}."""
    counts = {"image": 0, "text": 0}
    first = (
        (model.vision_model.encoder.layers[0], model.text_model.encoder.layers[0])
        if kind == "hf"
        else (model.visual.transformer.resblocks[0], model.transformer.resblocks[0])
    )
    for tower, layer in zip(counts, first):
        layer.register_forward_pre_hook(lambda *_, tower=tower: counts.__setitem__(tower, counts[tower] + 1))
    return counts


def _numpy_grads(model, full=None):
    out = {}
    for key, params in groups(model, full).items():
        out[key] = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).numpy() for n, g in params.items()}
    return out


def _fsdp2_hf(case, rank, world):
    model = _per_layer_fsdp2(hf_model(dropout=False), "hf")
    counts = _count_layer_calls(model, "hf")
    _hf_rank_loss(model, case, rank).backward()
    return _numpy_grads(model), counts


def _fsdp2_oc(case, rank, world):
    sizes, _, _ = CASES[case]
    model = _per_layer_fsdp2(oc_model(dropout=False), "oc")
    model.output_dict = True  # as open_clip_train builds it: the loss takes the dict
    counts = _count_layer_calls(model, "oc")
    model.forward = _oc_forward(model, case)
    images, packed = _oc_data(case)
    rows = _rows(sizes, rank)
    loss_fn = HNClipLoss(gamma=0.5, local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    loss_fn(**model(images[rows], packed[rows])).backward()
    return _numpy_grads(model), counts


def _zero3_hf(case, rank, world):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    model = hf_model(dropout=False)
    unsqueeze_scalar_parameters(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    counts = _count_layer_calls(model, "hf")
    engine.backward(_hf_rank_loss(engine, case, rank))
    return _numpy_grads(model, {n: safe_get_full_grad(p) for n, p in model.named_parameters()}), counts


def _unpadded_bits(case, rank, world):
    """Dropout on, no wrapper: this rank's gradients with the padding, then with it switched off."""
    from hnclip_kernels import chunked

    out = []
    for pad in (True, False):
        model = hf_model(dropout=True)
        torch.manual_seed(3)
        agree = chunked.agree_tower_calls if pad else (lambda *counts, like=None: tuple(counts))
        original, chunked.agree_tower_calls = chunked.agree_tower_calls, agree
        try:
            _hf_rank_loss(model, case, rank).backward()
        finally:
            chunked.agree_tower_calls = original
        out.append(_numpy_grads(model))
    return out


def _rank(rank, world, jobs):
    if HAS_DEEPSPEED and any(job[0] == "zero3" for job in jobs):
        os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as tests/integrations/test_deepspeed.py
        deepspeed.init_distributed(dist_backend="gloo")
    run = {"fsdp2_hf": _fsdp2_hf, "fsdp2_oc": _fsdp2_oc, "zero3": _zero3_hf, "bits": _unpadded_bits}
    return {job: run[job[0]](job[1], rank, world) for job in jobs}


def _jobs():
    jobs = [("fsdp2_hf", case) for case in CASES]
    jobs += [("fsdp2_oc", case) for case in OPEN_CLIP_CASES]
    if HAS_DEEPSPEED:
        jobs += [("zero3", case) for case in DEEPSPEED_CASES]
    return jobs + [("bits", "d_chunks_2_and_1_negatives_3_and_0")]


def _single_hf(case):
    from hnclip_kernels.integrations.transformers import clip_model_loss

    model = hf_model(dropout=False)
    unsqueeze_scalar_parameters(model)
    ids, pixels, mask, neg_ids, neg_mask = _hf_data(case)
    negatives = dict(negative_input_ids=neg_ids, negative_attention_mask=neg_mask) if len(neg_ids) else {}
    clip_model_loss(model, ids, pixels, mask, gamma=0.5, **negatives).backward()
    return groups(model)


def _single_oc(case):
    from hnclip_kernels.train_negatives import family_forward

    model = oc_model(dropout=False)
    model.output_dict = True
    unsqueeze_scalar_parameters(model)
    images, texts = _oc_data(case)
    out = family_forward(model, images, texts) if any(CASES[case][1]) else model(images, texts)
    HNClipLoss(gamma=0.5)(**out).backward()
    return groups(model)


def _torch(report):
    return {k: {n: torch.from_numpy(g) for n, g in v.items()} for k, v in report.items()}


def max_abs_diff(got, want) -> float:
    return max((got[k][n] - g).abs().max().item() for k, params in want.items() for n, g in params.items())


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_per_layer_sharding_with_unequal_chunks_and_negatives(tmp_path):
    pytest.importorskip("transformers")
    jobs = _jobs()
    reports = spawn_gloo_ranks(_rank, tmp_path, jobs, timeout=400, pg_timeout_s=60)
    singles = {}
    for job in jobs:
        kind, case = job
        if kind == "bits":
            for rank in (0, 1):
                padded, unpadded = reports[rank][job]
                for key, params in padded.items():
                    for name, grad in params.items():
                        assert grad.tobytes() == unpadded[key][name].tobytes(), (rank, name)
            continue
        counts = [reports[rank][job][1] for rank in (0, 1)]
        assert counts[0] == counts[1], (job, counts)
        want = singles.setdefault(kind == "fsdp2_oc", {}).get(case)
        if want is None:
            want = singles[kind == "fsdp2_oc"][case] = (_single_oc if kind == "fsdp2_oc" else _single_hf)(case)
        for rank in (0, 1):
            got = _torch(reports[rank][job][0])
            assert_worst(got, want)
            print(f"{kind} {case} rank {rank}: calls {counts[rank]}, max |grad - single| {max_abs_diff(got, want):.2e}")
