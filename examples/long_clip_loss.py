"""Long-CLIP's two-pair loss with HNClipLoss, on 2 gloo processes (CPU) by default.

Long-CLIP (Zhang et al., 2024) fine-tunes CLIP on long captions with two contrastive losses
per step, each of a rank's local rows against the columns gathered from every rank, with
label smoothing ε = 0.1, added together:

* long captions against the image features;
* short captions (the long caption's first sentence) against a projection of the image
  features onto their top principal components ("coarse" features; Long-CLIP keeps 32 of
  512 dimensions).

Each pair is one ``HNClipLoss(local_loss=True, gather_with_grad=True, label_smoothing=0.1)``.
What differs from Long-CLIP's own loss code:

* unequal local batches (an epoch's last batch) are exact: each rank's positives sit at its
  real global offset, and its loss is scaled so that the mean over ranks is the global mean;
  Long-CLIP's targets ``rank * bs + arange(bs)`` assume every rank holds ``bs`` pairs;
* the HN-CLIP margin γ (default 0.5) on each pair; ``--gamma 0`` is Long-CLIP's InfoNCE;
* no N×N (or local × global) logit matrix is formed on the fused backends.

Runs as is, spawning ``--nproc`` processes (file rendezvous in a temporary folder)::

    python examples/long_clip_loss.py                   # 2 gloo processes, ranks of 6 and 4 pairs
    python examples/long_clip_loss.py --gamma 0 --steps 5
    torchrun --standalone --nproc_per_node=2 examples/long_clip_loss.py   # or under torchrun

The model is a tiny random-init open_clip CLIP (nothing is downloaded). At step 0 every rank's
features are gathered once more and both losses recomputed by one process on the global
batch: the mean of the ranks' losses equals it (printed as ``check:``; exit status 1 if not).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hnclip_kernels import HNClipLoss

TINY = dict(  # a few hundred thousand parameters: seconds per step on 2 CPU cores
    embed_dim=32,
    vision_cfg=dict(image_size=32, patch_size=8, width=64, head_width=32, layers=1),
    text_cfg=dict(context_length=64, vocab_size=49408, width=32, heads=2, layers=1),
)
COLORS = ["red", "green", "blue", "yellow", "white", "black"]
THINGS = ["cat", "dog", "car", "boat", "tree", "house"]
PLACES = ["on a beach", "in a garden", "on a street", "in a kitchen"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--sizes", default="6,4", help="local pairs per rank, comma-separated (cycled over ranks)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=0.5, help="HN-CLIP margin scale (0: Long-CLIP's InfoNCE)")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="ε (Long-CLIP: 0.1)")
    p.add_argument(
        "--components",
        type=int,
        default=8,
        help="principal components of the short-caption image features (Long-CLIP: 32 of 512)",
    )
    p.add_argument("--backend", default="auto", help="auto | torch | triton | cpp")
    return p.parse_args(argv)


def batch(n, generator, prototypes):
    """n images with (long, short) captions; the short caption is the long one's first sentence.
    An image is a noisy copy of the prototype of its caption's colour and object: learnable."""
    pick = lambda seq: int(torch.randint(len(seq), (1,), generator=generator))  # noqa: E731
    long, short, which = [], [], []
    for _ in range(n):
        color, thing = pick(COLORS), pick(THINGS)
        first = f"a {COLORS[color]} {THINGS[thing]} {PLACES[pick(PLACES)]}."
        long.append(
            f"{first} behind the {THINGS[thing]} stands a {COLORS[pick(COLORS)]} {THINGS[pick(THINGS)]}, "
            f"and the light comes from the {['left', 'right'][pick('lr')]}. the {THINGS[thing]} looks "
            f"{['old', 'new', 'small', 'large'][pick('onsl')]}."
        )
        short.append(first)
        which.append(color * len(THINGS) + thing)
    images = prototypes[which] + 0.5 * torch.randn(n, *prototypes.shape[1:], generator=generator)
    return images, long, short


def principal_projection(features, k):
    """The features projected onto the top-k principal directions of this batch (centred, then the
    mean added back); the directions are constants, the gradient flows through the projection."""
    mean = features.mean(dim=0, keepdim=True)
    centred = features - mean
    k = min(k, *centred.shape)
    basis = torch.linalg.svd(centred.detach().float(), full_matrices=False).Vh[:k].to(features.dtype)  # (k, D)
    return centred @ basis.T @ basis + mean


def encode(model, images, long_tokens, short_tokens, k):
    """(image, long text, short image, short text) features, L2-normalised, and s = exp(logit_scale)."""
    image = model.encode_image(images)
    long_text = model.encode_text(long_tokens)
    short_text = model.encode_text(short_tokens)
    short_image = principal_projection(image, k)
    norm = F.normalize
    return (
        norm(image, dim=-1),
        norm(long_text, dim=-1),
        norm(short_image, dim=-1),
        norm(short_text, dim=-1),
        model.logit_scale.exp(),
    )


def gathered(x):
    """Every rank's rows of x, concatenated in rank order (detached; unequal sizes)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, x.detach())
    return torch.cat(parts)


def train(args, rank, world):
    import open_clip
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)  # the same initial weights on every rank
    model = open_clip.create_model("ViT-B-32", pretrained=None, **TINY)
    tokenizer = open_clip.get_tokenizer("ViT-B-32", context_length=TINY["text_cfg"]["context_length"])
    ddp = DDP(model)
    sizes = [int(s) for s in args.sizes.split(",")]
    n = sizes[rank % len(sizes)]
    pair = dict(
        local_loss=True,
        gather_with_grad=True,
        rank=rank,
        world_size=world,
        gamma=args.gamma,
        label_smoothing=args.label_smoothing,
        backend=args.backend,
    )
    long_loss, short_loss = HNClipLoss(**pair), HNClipLoss(**pair)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own pairs
    prototypes = torch.randn(len(COLORS) * len(THINGS), 3, 32, 32, generator=torch.Generator().manual_seed(0))
    if rank == 0:
        print(
            f"{world} ranks, local pairs {[sizes[r % len(sizes)] for r in range(world)]}, gamma {args.gamma}, "
            f"label smoothing {args.label_smoothing}",
            flush=True,
        )
    ok = True
    for step in range(args.steps):
        images, long, short = batch(n, generator, prototypes)
        image, long_text, short_image, short_text, scale = encode_through(
            ddp, images, tokenizer(long), tokenizer(short), args.components
        )
        loss_long = long_loss(image, long_text, scale)
        loss_short = short_loss(short_image, short_text, scale)
        loss = loss_long + loss_short
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages: the gradient of the two global-batch losses
        optimizer.step()

        both = torch.stack([loss_long.detach(), loss_short.detach()])
        dist.all_reduce(both)
        both /= world  # the mean of the ranks' losses: each global-batch loss
        if step == 0:
            ok = check_against_one_process(args, rank, both, image, long_text, short_image, short_text, scale)
        if rank == 0:
            print(
                f"step {step}: long {both[0].item():.5f}  short {both[1].item():.5f}  total {both.sum().item():.5f}",
                flush=True,
            )
    return ok


def encode_through(ddp, images, long_tokens, short_tokens, k):
    """``encode`` run as the DDP module's forward, so DDP's gradient all-reduce is armed."""
    module = ddp.module
    module.forward = lambda *a: encode(module, *a)
    try:
        return ddp(images, long_tokens, short_tokens, k)
    finally:
        del module.forward


def check_against_one_process(args, rank, both, image, long_text, short_image, short_text, scale):
    """Both losses on the gathered global batch by one process, against the mean of the ranks' losses."""
    feats = [gathered(x) for x in (image, long_text, short_image, short_text)]
    if args.gamma == 0:  # Long-CLIP's own formula: its targets assume every rank holds this rank's n pairs
        n = image.shape[0]
        targets = rank * n + torch.arange(n)
        s = scale.detach()
        i2t, t2i = s * image.detach() @ feats[1].T, s * long_text.detach() @ feats[0].T
        theirs = 0.5 * (
            F.cross_entropy(i2t, targets, label_smoothing=args.label_smoothing)
            + F.cross_entropy(t2i, targets, label_smoothing=args.label_smoothing)
        )
        dist.all_reduce(theirs)
        theirs /= dist.get_world_size()
        if rank == 0:
            print(
                f"long-clip: its formula (targets rank * bs + arange(bs)) gives {theirs.item()} for the long pair, "
                f"HNClipLoss {both[0].item()}: relative difference {abs(theirs.item() / both[0].item() - 1):.1e}",
                flush=True,
            )
    if rank != 0:
        return True
    one = HNClipLoss(gamma=args.gamma, label_smoothing=args.label_smoothing, backend=args.backend)
    want = torch.stack([one(feats[0], feats[1], scale.detach()), one(feats[2], feats[3], scale.detach())])
    rel = ((both - want).abs() / want.abs()).max().item()
    ok = rel <= 1e-5
    print(
        f"check: mean of the ranks' losses (long, short) = {both.tolist()}; one process on the global batch "
        f"of {feats[0].shape[0]} pairs = {want.tolist()}; max relative difference {rel:.1e} "
        f"({'ok' if ok else 'MISMATCH'})",
        flush=True,
    )
    return ok


def _worker(rank, world, init_method, args, results):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        results[rank] = train(args, rank, world)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        try:
            return 0 if train(args, dist.get_rank(), dist.get_world_size()) else 1
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.nproc, f"file://{tmp}/rendezvous", args, results), nprocs=args.nproc)
        return 0 if all(results.get(r, False) for r in range(args.nproc)) else 1


if __name__ == "__main__":
    sys.exit(main())
