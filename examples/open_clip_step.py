"""A few CLIP fine-tuning steps with hn_clip_loss next to open_clip's ClipLoss.

Builds a real open_clip model (ViT-B-32 config; random weights unless --checkpoint points
at a local file: nothing is downloaded), draws simple images that match real captions,
tokenises the captions with open_clip's bundled tokenizer, and takes optimizer steps with
the HN-CLIP loss. Each step prints both losses, the parameter gradient norm and dL/d logit_scale.

    python examples/open_clip_step.py --batch-size 8 --steps 3
"""

from __future__ import annotations

import argparse
import random

import open_clip
import torch
from open_clip.loss import ClipLoss
from PIL import Image, ImageDraw

from hnclip_kernels import hn_clip_loss

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["square", "circle", "triangle"]


def draw(color: str, shape: str, background: str, size: int = 224) -> Image.Image:
    img = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(img)
    box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
    if shape == "square":
        pen.rectangle(box, fill=color)
    elif shape == "circle":
        pen.ellipse(box, fill=color)
    else:
        pen.polygon([(size // 2, size // 4), (size // 4, 3 * size // 4), (3 * size // 4, 3 * size // 4)], fill=color)
    return img


def make_batch(n: int, rng: random.Random):
    """Images and their dense-ish captions; near-duplicate captions on purpose (one word apart)."""
    images, captions = [], []
    for _ in range(n):
        color, shape = rng.choice(COLORS), rng.choice(SHAPES)
        background = rng.choice([c for c in COLORS if c != color])
        images.append(draw(color, shape, background))
        captions.append(
            f"a photo of a large {color} {shape} centred on a plain {background} background, "
            f"with nothing else in the picture"
        )
    return images, captions


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--checkpoint", default=None, help="local open_clip checkpoint (never downloaded)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model, _, preprocess = open_clip.create_model_and_transforms(args.model, pretrained=args.checkpoint)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = model.to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    clip_loss = ClipLoss()
    rng = random.Random(args.seed)

    print(
        f"{'step':>4} {'hn_clip_loss':>14} {'ClipLoss':>12} {'grad_norm':>10} {'dL/dlogit_scale':>16} {'logit_scale':>11}"
    )
    history = []
    for step in range(args.steps):
        pil_images, captions = make_batch(args.batch_size, rng)
        images = torch.stack([preprocess(im) for im in pil_images]).to(args.device)
        texts = tokenizer(captions).to(args.device)
        image_features, text_features, logit_scale = model(images, texts)  # normalised; scale = exp(.)
        loss = hn_clip_loss(
            image_features,
            text_features,
            1.0 / logit_scale,
            gamma=args.gamma,
            label_smoothing=args.label_smoothing,
            backend=args.backend,
        )
        with torch.no_grad():
            baseline = clip_loss(image_features, text_features, logit_scale)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
        scale_grad = model.logit_scale.grad.item()
        optimizer.step()
        row = dict(
            step=step,
            loss=loss.item(),
            clip_loss=baseline.item(),
            grad_norm=grad_norm,
            logit_scale_grad=scale_grad,
            logit_scale=logit_scale.item(),
        )
        history.append(row)
        print(
            f"{step:>4} {row['loss']:>14.6f} {row['clip_loss']:>12.6f} {grad_norm:>10.4f} "
            f"{scale_grad:>16.3e} {row['logit_scale']:>11.4f}"
        )
    return history


if __name__ == "__main__":
    main()
