"""Multi-process open_clip training with the HN-CLIP loss on the global batch.

Synthetic images and captions (open_clip's bundled tokenizer, nothing is downloaded); a small
random-init CLIP by default so it runs on CPU. Launch with torchrun::

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 5          # CPU: gloo
    torchrun --standalone --nproc_per_node=8 examples/ddp_train.py --model ViT-B-32    # GPUs: nccl
    # several nodes: torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 \\
    #     --rdzv_backend=c10d --rdzv_endpoint=$HOST:29500 examples/ddp_train.py ...

Every rank computes the HN-CLIP rows of its own pairs against the whole global batch
(local_loss=True, gather_with_grad=True): with DDP's gradient averaging each step equals a
single-process step on the concatenated global batch. ``--uneven`` gives rank r a batch
of ``batch_size - r`` pairs to show that unequal local batches are handled exactly.
"""

from __future__ import annotations

import argparse
import math
import os

import open_clip
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hnclip_kernels import HNClipLoss

TINY = dict(  # ~1.6M parameters: fine on two CPU cores
    embed_dim=64,
    vision_cfg=dict(image_size=64, patch_size=16, width=64, head_width=32, layers=2, mlp_ratio=2.0),
    text_cfg=dict(context_length=32, vocab_size=49408, width=64, heads=2, layers=2, mlp_ratio=2.0),
)
WORDS = ["cat", "dog", "red car", "small boat", "tall tree", "blue bird", "old house", "green apple"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (default) or an open_clip model name, e.g. ViT-B-32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="local pairs per rank")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--gamma", type=float, default=0.5, help="HN-CLIP margin scale (0 = CLIP's InfoNCE)")
    p.add_argument("--backend", default="auto", help="auto | torch | triton | cpp")
    p.add_argument("--uneven", action="store_true", help="rank r uses batch_size - r pairs")
    return p.parse_args()


def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")  # env:// from torchrun
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    torch.manual_seed(0)  # same init everywhere (DDP also broadcasts rank 0's weights)
    if args.model == "tiny":
        model = open_clip.create_model("ViT-B-32", pretrained=None, **TINY)
    else:
        model = open_clip.create_model(args.model, pretrained=None)  # random init, no download
    model.to(device)
    tokenizer = open_clip.get_tokenizer("ViT-B-32", context_length=model.context_length)
    image_size = model.visual.image_size
    ddp_model = DDP(model, device_ids=[local_rank] if use_cuda else None)

    loss_fn = HNClipLoss(
        local_loss=True,
        gather_with_grad=True,
        cache_labels=True,
        rank=rank,
        world_size=world_size,
        gamma=args.gamma,
        backend=args.backend,
    )
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1234 + rank)  # different data on every rank
    # a learnable toy task: each caption's images are noisy copies of one random prototype
    prototypes = torch.randn(len(WORDS), 3, *image_size, generator=torch.Generator().manual_seed(0))

    for step in range(args.steps):
        n = max(1, args.batch_size - (rank if args.uneven else 0))
        idx = torch.randint(len(WORDS), (n,), generator=generator)
        images = (prototypes[idx] + 0.5 * torch.randn(n, 3, *image_size, generator=generator)).to(device)
        idx = idx.tolist()
        texts = tokenizer([f"a photo of a {WORDS[i]}" for i in idx]).to(device)

        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
            image_features, text_features, logit_scale = ddp_model(images, texts)
            loss = loss_fn(image_features, text_features, logit_scale)  # float32 inside
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():  # open_clip's clamp of the learnable temperature
            model.logit_scale.clamp_(0, math.log(100))

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # mean over ranks of the rank losses = the global-batch loss
        global_loss /= world_size
        if rank == 0:
            print(f"step {step}: loss {global_loss.item():.4f}  scale {logit_scale.item():.2f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
