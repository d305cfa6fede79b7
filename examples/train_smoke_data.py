"""Files for a CPU smoke run of ``python -m hnclip_kernels.train``: a tiny model and 16 captioned PNGs.

    python examples/train_smoke_data.py smoke

writes

* ``smoke/model/open_clip_config.json``: a tiny random-init ViT CLIP, loaded with
  ``--model local-dir:smoke/model`` (nothing is downloaded);
* ``smoke/images/0.png`` … ``15.png``: 32×32 images of a coloured shape;
* ``smoke/train.csv``: what open_clip's CSV reader expects by default, **tab-separated**, with a
  header naming the image column ``filepath`` and the caption column ``title`` (for a
  comma-separated file pass ``--csv-separator ','``; other column names: ``--csv-img-key``,
  ``--csv-caption-key``).

The README's "A smoke run on CPU" trains on these files.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from PIL import Image, ImageDraw

MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "head_width": 32, "layers": 1},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ["square", "circle", "triangle", "bar"]


def draw(color, shape, rng) -> Image.Image:
    img = Image.fromarray(rng.integers(90, 140, (32, 32, 3), dtype=np.uint8))  # a noisy gray background
    pen = ImageDraw.Draw(img)
    box = (8, 8, 24, 24)
    if shape == "square":
        pen.rectangle(box, fill=color)
    elif shape == "circle":
        pen.ellipse(box, fill=color)
    elif shape == "triangle":
        pen.polygon([(16, 6), (6, 26), (26, 26)], fill=color)
    else:
        pen.rectangle((4, 13, 28, 19), fill=color)
    return img


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="smoke", help="folder to write (default: smoke)")
    args = p.parse_args(argv)
    os.makedirs(os.path.join(args.out, "model"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "images"), exist_ok=True)
    with open(os.path.join(args.out, "model", "open_clip_config.json"), "w") as fh:
        json.dump({"model_cfg": MODEL}, fh, indent=1)
    rng = np.random.default_rng(0)
    lines = ["filepath\ttitle"]
    for i, (color, shape) in enumerate((c, s) for s in SHAPES for c in COLORS):
        path = os.path.abspath(os.path.join(args.out, "images", f"{i}.png"))
        draw(COLORS[color], shape, rng).save(path)
        lines.append(f"{path}\ta {color} {shape} on a gray background")
    csv_path = os.path.join(args.out, "train.csv")
    with open(csv_path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}/model/open_clip_config.json, {len(lines) - 1} images in {args.out}/images, {csv_path}")
    return csv_path


if __name__ == "__main__":
    main()
