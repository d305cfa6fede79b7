"""A toy dense-caption retrieval task: open_clip's ClipLoss against HN-CLIP, trained from scratch on CPU.

Data (procedural, deterministic for a seed): 32×32 images with two coloured shapes on a
background; attributes colour (8), shape (4), size (2), background (3) and one spatial
relation ("to the left of", "to the right of", "above", "below"). Each caption is several clauses long.
Data come in *hard-negative groups*: a base scene and ``--group-size − 1`` edits of it that
change exactly one attribute of one object, the background, or flip the relation (the
objects swap places), so the captions of a group differ in one or two words. Training
batches hold whole groups, so every batch contains its own hard negatives.

Both runs train the same tiny open_clip CLIP (a 2-layer ViT and a 2-layer text transformer,
width 64; random init, the same for both) with the same seed, data, batches, optimizer and
number of steps; only the loss differs: ``open_clip.loss.ClipLoss`` (InfoNCE) or
``hnclip_kernels.HNClipLoss(gamma=0.5)`` (the C++ kernel on CPU). After every epoch the script
measures, on held-out groups, image→text and text→image Recall@1/@5 against the whole
held-out pool and the within-group accuracy (the right caption among its group's near
duplicates), and, on a few fixed training batches, the fraction of saturated rows and of rows
whose float32 positive gradient is lost (``hnclip_kernels.diagnostics.saturation_report``,
with each run's own γ: 0 for ClipLoss, 0.5 for HN-CLIP, and the model's current τ).

Captions are tokenised with open_clip's bundled tokenizer (no download); the token ids that
occur are then renumbered in order (0, the padding, stays 0; the end-of-text token stays the
largest, which open_clip's argmax pooling needs), so the text model's vocabulary is ~60 rows
instead of 49408.

    python examples/dense_caption_demo.py --quick     # about 45 s on 2 idle cores, 1 minute loaded
    python examples/dense_caption_demo.py             # 3 minutes on 2 idle cores, up to 10 loaded

Writes ``history.csv`` (one row per run and epoch), ``steps.csv`` (the loss of every step),
``summary.csv``, ``table.md`` and ``curves.png`` under ``--out`` and prints the table.
A toy task: its numbers say nothing about the paper's benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import logging
import math
import os
import random
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch

COLORS = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.75, 0.15),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.90, 0.10),
    "purple": (0.60, 0.15, 0.80),
    "orange": (1.00, 0.55, 0.00),
    "white": (0.97, 0.97, 0.97),
    "cyan": (0.10, 0.85, 0.90),
}
BACKGROUNDS = {"black": (0.05, 0.05, 0.05), "gray": (0.45, 0.45, 0.45), "brown": (0.40, 0.25, 0.10)}
SHAPES = ("square", "circle", "triangle", "diamond")
SIZES = {"small": 3.0, "large": 6.0}
OPPOSITE = {
    "to the left of": "to the right of",
    "to the right of": "to the left of",
    "above": "below",
    "below": "above",
}
EDITS = ("color", "shape", "size", "relation", "background")
IMAGE_SIZE = 32
CONTEXT_LENGTH = 48

QUICK = dict(train_groups=256, eval_groups=64, epochs=6)  # 4 steps of 64 pairs per 16 groups
DEFAULT = dict(train_groups=1024, eval_groups=96, epochs=12)


@dataclasses.dataclass(frozen=True)
class Obj:
    color: str
    shape: str
    size: str
    x: float
    y: float


@dataclasses.dataclass(frozen=True)
class Scene:
    a: Obj
    b: Obj
    relation: str  # a's relation to b
    background: str


def sample_scene(rng: random.Random) -> Scene:
    ca, cb = rng.sample(sorted(COLORS), 2)
    sa, sb = rng.sample(SHAPES, 2)
    za, zb = rng.choice(sorted(SIZES)), rng.choice(sorted(SIZES))
    relation = rng.choice(sorted(OPPOSITE))
    near, far = 8.0 + rng.uniform(-1, 1), 24.0 + rng.uniform(-1, 1)  # along the relation's axis
    mid = rng.uniform(10, 22)
    o1, o2 = mid + rng.uniform(-2, 2), mid + rng.uniform(-2, 2)  # across it
    first, second = {
        "to the left of": (near, far),
        "to the right of": (far, near),
        "above": (near, far),
        "below": (far, near),
    }[relation]
    if relation in ("to the left of", "to the right of"):
        pa, pb = (first, o1), (second, o2)
    else:
        pa, pb = (o1, first), (o2, second)
    return Scene(Obj(ca, sa, za, *pa), Obj(cb, sb, zb, *pb), relation, rng.choice(sorted(BACKGROUNDS)))


def edit_scene(scene: Scene, kind: str, rng: random.Random) -> Scene:
    """The scene with exactly one attribute (of one object), the background or the relation changed."""
    if kind == "relation":  # the objects swap places: left of becomes right of
        a = dataclasses.replace(scene.a, x=scene.b.x, y=scene.b.y)
        b = dataclasses.replace(scene.b, x=scene.a.x, y=scene.a.y)
        return dataclasses.replace(scene, a=a, b=b, relation=OPPOSITE[scene.relation])
    if kind == "background":
        return dataclasses.replace(
            scene, background=rng.choice([c for c in sorted(BACKGROUNDS) if c != scene.background])
        )
    which = rng.choice(("a", "b"))
    obj = getattr(scene, which)
    if kind == "color":
        new = dataclasses.replace(
            obj, color=rng.choice([c for c in sorted(COLORS) if c not in (scene.a.color, scene.b.color)])
        )
    elif kind == "shape":
        new = dataclasses.replace(obj, shape=rng.choice([s for s in SHAPES if s not in (scene.a.shape, scene.b.shape)]))
    else:
        new = dataclasses.replace(obj, size="small" if obj.size == "large" else "large")
    return dataclasses.replace(scene, **{which: new})


def region(obj: Obj, relation: str) -> str:
    if relation in ("to the left of", "to the right of"):
        return "left" if obj.x < IMAGE_SIZE / 2 else "right"
    return "top" if obj.y < IMAGE_SIZE / 2 else "bottom"


def caption(s: Scene) -> str:
    a, b = s.a, s.b
    return (
        f"two shapes on a {s.background} background. a {a.size} {a.color} {a.shape} is "
        f"{s.relation} a {b.size} {b.color} {b.shape}. the {a.shape} is {a.color} and sits on the "
        f"{region(a, s.relation)} side, while the {b.shape} is {b.size} and {b.color}."
    )


_YY, _XX = torch.meshgrid(
    torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5,
    torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5,
    indexing="ij",
)


def _mask(obj: Obj) -> torch.Tensor:
    r = SIZES[obj.size]
    dx, dy = _XX - obj.x, _YY - obj.y
    if obj.shape == "square":
        return (dx.abs() <= r) & (dy.abs() <= r)
    if obj.shape == "circle":
        return dx * dx + dy * dy <= r * r * 1.2
    if obj.shape == "diamond":
        return dx.abs() + dy.abs() <= 1.35 * r
    return (dy >= -r) & (dy <= r) & (dx.abs() <= (dy + r) / 2)  # triangle, apex up


def render(s: Scene, noise: torch.Tensor) -> torch.Tensor:
    img = torch.tensor(BACKGROUNDS[s.background]).view(3, 1, 1).expand(3, IMAGE_SIZE, IMAGE_SIZE).clone()
    for obj in (s.a, s.b):
        img = torch.where(_mask(obj), torch.tensor(COLORS[obj.color]).view(3, 1, 1), img)
    return ((img + noise).clamp(0, 1) - 0.5) / 0.25


def make_scene_groups(n_groups: int, group_size: int, seed: int) -> Tuple[torch.Tensor, List[Scene]]:
    """(images (n·K, 3, 32, 32), scenes): group g holds items g·K ... g·K + K − 1, item g·K the base."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    images, scenes = [], []
    for _ in range(n_groups):
        base = sample_scene(rng)
        group = [base] + [edit_scene(base, kind, rng) for kind in rng.sample(EDITS, group_size - 1)]
        for s in group:
            images.append(render(s, 0.04 * torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)))
            scenes.append(s)
    return torch.stack(images), scenes


def make_groups(n_groups: int, group_size: int, seed: int) -> Tuple[torch.Tensor, List[str]]:
    """As :func:`make_scene_groups`, with each scene's caption."""
    images, scenes = make_scene_groups(n_groups, group_size, seed)
    return images, [caption(s) for s in scenes]


def tokenize(captions: Sequence[str], context_length: int = CONTEXT_LENGTH) -> Tuple[torch.Tensor, int]:
    """open_clip's bundled BPE tokens, renumbered in order to a compact vocabulary (0 stays 0,
    end-of-text stays the largest id). Returns (tokens, vocabulary size)."""
    import open_clip

    tokens = open_clip.get_tokenizer("ViT-B-32", context_length=context_length)(list(captions))
    if (tokens[:, -1] != 0).any():
        raise ValueError(f"a caption does not fit in {context_length} tokens")
    ids = torch.unique(torch.cat([torch.zeros(1, dtype=tokens.dtype), tokens.flatten()]))
    return torch.searchsorted(ids, tokens), int(ids.numel())


def build_model(vocab_size: int, seed: int):
    import open_clip

    torch.manual_seed(seed)
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))  # "no pretrained weights"
    return open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=64,
        vision_cfg=dict(image_size=IMAGE_SIZE, patch_size=8, width=64, head_width=32, layers=2, mlp_ratio=2.0),
        text_cfg=dict(context_length=CONTEXT_LENGTH, vocab_size=vocab_size, width=64, heads=2, layers=2, mlp_ratio=2.0),
    )


@torch.no_grad()
def encode(model, images: torch.Tensor, tokens: torch.Tensor, batch: int = 256):
    feats_i, feats_t = [], []
    for s in range(0, images.shape[0], batch):
        fi, ft, scale = model(images[s : s + batch], tokens[s : s + batch])
        feats_i.append(fi)
        feats_t.append(ft)
    return torch.cat(feats_i), torch.cat(feats_t), scale


def retrieval_metrics(img_f: torch.Tensor, txt_f: torch.Tensor, group_size: int) -> Dict[str, float]:
    """R@1/R@5 against the whole pool in both directions, and the within-group accuracy."""
    sims = (img_f @ txt_f.T).double()
    n = sims.shape[0]
    out = {}
    for name, s in (("i2t", sims), ("t2i", sims.T)):
        rank = (s > s.diagonal()[:, None]).sum(dim=1)  # how many candidates beat the right one
        out[f"{name}_R@1"] = (rank < 1).double().mean().item()
        out[f"{name}_R@5"] = (rank < 5).double().mean().item()
        blocks = s.reshape(n // group_size, group_size, n // group_size, group_size)
        within = blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (groups, K, K)
        right = within.diagonal(dim1=1, dim2=2)
        out[f"{name}_group_acc"] = ((within > right[..., None]).sum(dim=2) == 0).double().mean().item()
    return out


def saturation(model, batches, gamma: float) -> Dict[str, float]:
    """saturation_report's fractions averaged over fixed training batches, at the model's τ."""
    from hnclip_kernels.diagnostics import saturation_report

    reports = []
    with torch.no_grad():
        for images, tokens in batches:
            img_f, txt_f, scale = model(images, tokens)
            reports.append(saturation_report(img_f, txt_f, 1.0 / float(scale), gamma=gamma))
    mean = lambda f: sum(getattr(r, f) for r in reports) / len(reports)  # noqa: E731
    return dict(
        saturated_rows=mean("saturated_rows"),
        lost_positive_rows=mean("lost_positive_rows_fp32"),
        naive_fp32_loss=mean("naive_fp32_loss"),
        exact_loss=mean("loss"),
        effective_negatives=mean("effective_negatives"),
    )


def param_groups(model, weight_decay: float):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    return [dict(params=decay, weight_decay=weight_decay), dict(params=rest, weight_decay=0.0)]


def train_run(name: str, loss_fn, gamma: float, data: dict, args, progress) -> Tuple[list, list]:
    """Train one model from the shared init; returns (per-epoch rows, per-step losses)."""
    model = build_model(data["vocab"], args.seed)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    n_groups, k = args.train_groups, args.group_size
    per_epoch = math.ceil(n_groups / args.batch_groups)
    total = per_epoch * args.epochs
    warmup = max(1, total // 10)

    def lr_factor(step: int) -> float:  # linear warmup, then cosine to 0
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    # the saturation columns: the first --probe-batches training batches in dataset order
    probe = []
    for g in range(0, min(n_groups, args.probe_batches * args.batch_groups), args.batch_groups):
        sl = slice(g * k, min(g + args.batch_groups, n_groups) * k)
        probe.append((data["train_images"][sl], data["train_tokens"][sl]))

    def epoch_row(epoch: int, train_loss, seconds: float) -> dict:
        model.eval()
        img_f, txt_f, scale = encode(model, data["eval_images"], data["eval_tokens"])
        row = dict(loss=name, epoch=epoch, train_loss=train_loss, tau=1.0 / float(scale), seconds=seconds)
        row.update(retrieval_metrics(img_f, txt_f, k))
        row.update(saturation(model, probe, gamma))
        model.train()
        return row

    start = time.perf_counter()
    rows, steps = [epoch_row(0, None, 0.0)], []
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(n_groups, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        losses = []
        for b in range(per_epoch):
            groups = order[b * args.batch_groups : (b + 1) * args.batch_groups]
            idx = (groups[:, None] * k + torch.arange(k)).flatten()
            img_f, txt_f, scale = model(data["train_images"][idx], data["train_tokens"][idx])
            loss = loss_fn(img_f, txt_f, scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))  # as open_clip_train does
            losses.append(loss.item())
            steps.append(dict(loss=name, step=len(steps) + 1, train_loss=losses[-1]))
            progress.update(1)
            progress.set_postfix_str(f"{name} epoch {epoch} loss {losses[-1]:.3f}")
        rows.append(epoch_row(epoch, sum(losses) / len(losses), time.perf_counter() - start))
    return rows, steps


@contextlib.contextmanager
def deterministic(threads: int):
    """Fixed thread count and deterministic algorithms for the run; restored afterwards."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


TABLE_COLS = [
    ("i2t_R@1", "i→t R@1"),
    ("i2t_R@5", "i→t R@5"),
    ("t2i_R@1", "t→i R@1"),
    ("t2i_R@5", "t→i R@5"),
    ("i2t_group_acc", "i→t group acc"),
    ("t2i_group_acc", "t→i group acc"),
    ("saturated_rows", "saturated rows"),
    ("lost_positive_rows", "lost-positive rows"),
    ("tau", "final τ"),
    ("seconds", "run s"),
]


def format_table(finals: List[dict]) -> str:
    head = "| loss | " + " | ".join(label for _, label in TABLE_COLS) + " |"
    sep = "|---|" + "---:|" * len(TABLE_COLS)
    lines = [head, sep]
    for row in finals:
        cells = [f"{row[key]:.3f}" if key not in ("seconds",) else f"{row[key]:.0f}" for key, _ in TABLE_COLS]
        lines.append(f"| {row['loss']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(path: str, rows: List[dict]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(path: str, history: List[dict], steps: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(dict.fromkeys(r["loss"] for r in history))
    for name, color in zip(names, ("tab:blue", "tab:red")):
        st = [r for r in steps if r["loss"] == name]
        axes[0].plot([r["step"] for r in st], [r["train_loss"] for r in st], color=color, alpha=0.8, label=name)
        ep = [r for r in history if r["loss"] == name]
        x = [r["epoch"] for r in ep]
        axes[1].plot(x, [r["i2t_R@1"] for r in ep], "-o", color=color, label=f"{name} i→t R@1")
        axes[1].plot(x, [r["t2i_R@1"] for r in ep], "--s", color=color, label=f"{name} t→i R@1")
        axes[1].plot(x, [r["i2t_group_acc"] for r in ep], ":^", color=color, label=f"{name} i→t group acc")
        axes[2].plot(x, [r["saturated_rows"] for r in ep], "-o", color=color, label=f"{name} saturated")
        axes[2].plot(x, [r["lost_positive_rows"] for r in ep], "--s", color=color, label=f"{name} lost positive")
    axes[0].set(title="training loss per step (each its own loss)", xlabel="step", yscale="log")
    axes[1].set(title="held-out retrieval", xlabel="epoch", ylim=(0, 1))
    top = max([r[key] for r in history for key in ("saturated_rows", "lost_positive_rows")] + [0.0])
    axes[2].set(
        title="fraction of directional rows (train batches)",
        xlabel="epoch",
        ylim=(-0.005, max(0.05, min(1.02, 1.2 * top))),
    )
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a smaller run: {QUICK}")
    parser.add_argument("--train-groups", type=int, default=None, help=f"default {DEFAULT['train_groups']}")
    parser.add_argument("--eval-groups", type=int, default=None, help=f"default {DEFAULT['eval_groups']}")
    parser.add_argument("--epochs", type=int, default=None, help=f"default {DEFAULT['epochs']}")
    parser.add_argument("--group-size", type=int, default=4, help="pairs per hard-negative group (2..6)")
    parser.add_argument("--batch-groups", type=int, default=16, help="groups per batch (16 × 4 = 64 pairs)")
    parser.add_argument("--probe-batches", type=int, default=2, help="training batches for the saturation columns")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--gamma", type=float, default=0.5, help="HN-CLIP's margin scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (results are reproducible per count)")
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULT
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 2 <= args.group_size <= len(EDITS) + 1:
        parser.error(f"--group-size must be in 2..{len(EDITS) + 1}")
    for key in ("train_groups", "eval_groups", "epochs", "batch_groups", "probe_batches", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    from open_clip.loss import ClipLoss
    from tqdm import tqdm

    from hnclip_kernels import HNClipLoss

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with deterministic(args.threads):
        train_images, train_caps = make_groups(args.train_groups, args.group_size, args.seed)
        eval_images, eval_caps = make_groups(args.eval_groups, args.group_size, args.seed + 1_000_003)
        tokens, vocab = tokenize(train_caps + eval_caps)
        n_train = len(train_caps)
        data = dict(
            train_images=train_images,
            train_tokens=tokens[:n_train],
            eval_images=eval_images,
            eval_tokens=tokens[n_train:],
            vocab=vocab,
        )
        runs = [("ClipLoss", ClipLoss(), 0.0), ("HN-CLIP", HNClipLoss(gamma=args.gamma), args.gamma)]
        per_run = math.ceil(args.train_groups / args.batch_groups) * args.epochs
        history, steps = [], []
        with tqdm(
            total=per_run * len(runs), desc="training", unit="step", disable=args.no_progress, file=sys.stderr
        ) as progress:
            for name, loss_fn, gamma in runs:
                rows, st = train_run(name, loss_fn, gamma, data, args, progress)
                history += rows
                steps += st
    finals = [max((r for r in history if r["loss"] == name), key=lambda r: r["epoch"]) for name, _, _ in runs]
    table = format_table(finals)
    wall = time.perf_counter() - t0
    note = (
        f"{args.train_groups} train / {args.eval_groups} held-out groups of {args.group_size} "
        f"({args.eval_groups * args.group_size} held-out pairs), {args.epochs} epochs × {per_run // args.epochs} "
        f"steps of {args.batch_groups * args.group_size} pairs, seed {args.seed}, {args.threads} thread(s); "
        f"total {wall:.0f} s, load average at start {load:.2f}"
    )
    write_csv(os.path.join(args.out, "history.csv"), history)
    write_csv(os.path.join(args.out, "steps.csv"), steps)
    write_csv(os.path.join(args.out, "summary.csv"), finals)
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(table + "\n\n" + note + "\n")
    plot(os.path.join(args.out, "curves.png"), history, steps)
    print(table)
    print(note)
    print(f"wrote history.csv, steps.csv, summary.csv, table.md, curves.png to {args.out}/")
    return dict(history=history, steps=steps, finals=finals, table=table, seconds=wall)


if __name__ == "__main__":
    main()
