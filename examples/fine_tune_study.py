"""Fine-tuning study: ClipLoss against HN-CLIP from strong initialisations, over (initialisation, seed) pairs.

The paper's claim (arXiv 2608.18521) is about fine-tuning a strong pretrained CLIP on dense
captions with many near-duplicates. This script builds that setting procedurally, at toy
scale. The protocol below, the primary comparison and the statistics were fixed before the
default run (revision 5; revisions 1–4 are summarised at the end).

**Primary comparison** (named before revision 4's run, unchanged): HN-CLIP γ = 0.5 against
ClipLoss, text→image R@1 on the held-out pool at the last epoch, over all (initialisation, seed)
cells under the crossed two-way random-effects model (below). Everything else is secondary, and
every p-value is Holm-adjusted over the whole family (5 arms × 4 metrics: R@1 and group accuracy
in both directions).

**Task.** The scenes of ``dense_caption_demo.py``: 32×32 images of two coloured shapes (colour 8,
shape 4, size 2, background 3, one of 4 relations) with the demo's dense three-clause caption.
One fixed vocabulary (open_clip's bundled tokenizer, renumbered as in the demo).

**No leakage.** Items are reserved by *canonical scene* (``scene_key``): the background, the
axis of the relation, and the two objects (colour, shape, size) in reading order along it
(left, then right; top, then bottom). A caption and its mirror ("a red square is to the left of
a blue circle" and "a blue circle is to the right of a red square") are one picture and one
key; the objects' float positions play no part. The 16 128 keys are split once, by a hash:
``blake2b(repr(key))[0] % 8 < 3`` (3/8) are *reserved*. Stage 1 and every fine-tuning pool only
use groups whose scenes are all unreserved (a group is redrawn otherwise); the held-out pools
only groups whose scenes are all reserved and new: no key twice in a pool, none in an earlier
held-out pool of the run (stage 1's held-out set, then the seeds in order), so the held-out
pools of different seeds are disjoint. 3/8 because these pools need 2 816 distinct reserved
keys: at 1/8 (4 032 reserved) the last groups cannot be drawn. The run checks it over everything
it trained on, reading the keys back from the caption text (``caption_key``, which must agree
with the rendered scenes): how many held-out items share a canonical scene with stage-1 data
and with any training set, how many a caption string, and how many keys two held-out pools
share; it asserts that every count is 0, prints them
(``leakage check: ...``) and ``run.json`` records them.

**Stage 1, the initialisations** (one cached model per initialisation seed ``i``; all seeds
and arms of ``i`` start from it): the tiny open_clip CLIP (2-layer ViT, patch 8, and 2-layer
text transformer, width ``width``, model seed ``i``) trained from scratch with
``open_clip.loss.ClipLoss`` on the dense captions of ``s1_train`` independent unreserved scenes
(data seed ``100 000 + i``), batches of 64 drawn as random permutations, AdamW (lr ``s1_lr``,
betas (0.9, 0.98), eps 1e-6, weight decay 0.1 on matrices), 50 warmup steps then cosine to 0 at
``s1_steps``, logit scale learned and clamped at 30 (``S1_SCALE_MAX``: features trained at a lower
scale sit further apart at fine-tuning's s = 100). Its held-out R@1 is measured
on ``s1_eval`` reserved pairs (one fixed set for every initialisation). The checkpoint is cached
under ``--cache`` (default: the temporary directory, never the repository) as
``stage1_<hash>.pt``, the hash of its configuration, and reused when present.

**Stage 2, fine-tuning.** Per cell (initialisation ``i``, seed ``s``): a training pool of
``train_groups`` near-duplicate groups of 4 (a base scene and 3 edits of one attribute, the
background or the relation; data seed ``cell_seed("train", i, s)``, a hash of the cell), so no
two cells share training data. Per seed: a held-out pool of ``eval_groups`` reserved groups
(seed ``2 000 + s``), shared by the seed's initialisations (the arms of every initialisation
are measured on the same items) and disjoint from every other seed's: it avoids the scenes of
stage 1's held-out set and of the run's earlier seeds, so the first seed's pool depends on its
seed only, a later seed's also on the seeds before it in the run (``--seed-offset``). A run
repeats, bit for bit, the cells of another run with the same first seed.
Every arm starts from initialisation ``i`` with its logit scale set to 100 and clamped at
ln 100 after every step (as Long-CLIP starts from CLIP's). AdamW lr 5e-4, the same betas / eps
/ weight decay, 10% warmup then cosine to 0 over the arm's steps. Batches: each pass a fresh
permutation of the (sub)pool from seed ``cell_seed("order", i, s)``, cut into batches; arms 1–3
of a cell see exactly the same batches. An *epoch* is pool/64 steps of 64 pairs (one pass of the pool). Arms:

1. ``ClipLoss``: open_clip's ClipLoss (InfoNCE).
2. ``HN-CLIP``: ``hnclip_kernels.HNClipLoss(gamma=0.5)`` (backend "auto": the C++ kernel on CPU).
3. ``HN-CLIP+FN``: the same with ``false_negative_threshold=0.95``.
4. ``HN-CLIP 20%``: HN-CLIP on a random 20% of the pool's pairs (seed ``cell_seed("subset", i, s)``), the same
   steps (5 passes of its subset per epoch).
5. ``HN-CLIP 4×batch, same pairs``: batches of 256, ¼ of the steps: the pairs seen are those of
   arms 1–3 (an epoch is pool/256 steps).
6. ``HN-CLIP 4×batch, same steps``: batches of 256, the steps of arms 1–3: 4× the pairs seen.

Arms 5 and 6 run the encoders 64 pairs at a time through
``hnclip_kernels.chunked_encode(encoder, inputs, 64)`` (checkpointed chunks). Arms 5 and 6 need
``hnclip_kernels.chunked_encode``; without it they are reported as not run (never silently left
out).

**Measured.** On the held-out pool, at epoch 0 (the initialisation, once per (i, s)) and at
the last epoch (no other evaluation, no best-epoch selection): R@1 in both directions against
the whole pool and the accuracy within each near-duplicate group (the demo's
``retrieval_metrics``), and τ. The regime, per epoch, from each arm's own training batches
(each step's forward, before its update): ``sat_batches``, the fraction of batches whose
InfoNCE (ClipLoss: float32 logits s·v tᵀ, float32 cross-entropy, mean of both directions) is
below 1e-3, whatever loss the arm trains with; ``fp32_zero_pos_grad_rows``, the fraction of the 2B
directional rows whose float32 gradient on the positive logit (softmax(logits)[i, i] − 1, as a
plain float32 cross-entropy computes it) rounds to 0 (``lost_positive_rows_fp32`` of
``hnclip_kernels.diagnostics``; the row's gradients on its negatives, softmax(logits)[i, j], round
to 0 only when they underflow too, so this is not a row whose whole gradient is 0, nor the
paper's zero-gradient figure); the median batch InfoNCE. *Epoch 0*
of the regime is the initialisation itself (no update) on the cell's first-epoch batches of 64:
the regime at the start of fine-tuning.

**Statistics** (``study_stats.py``). Per arm and metric, the paired difference against
ClipLoss within each cell (i, s). The cells are crossed, not independent: an initialisation is
shared by its seeds, and a seed's held-out pool by its initialisations. So the test is the
crossed two-way random-effects model d_is = μ + a_i + b_s + e_is (``crossed_t``: balanced ANOVA
variance components, which are REML's, a component below 0 pooled into the residual; the
Satterthwaite t-interval of μ and its two-sided p), Holm-adjusted over the family. Also the
exact sign test with wins / losses / ties (descriptive: it treats the cells as independent). A
difference counts as detected when its Holm-adjusted p < 0.05; where none is detected the
minimum detectable difference (80% power, α = 0.05, the model's standard error and df) is
reported. No bootstrap.

**Arm set ``siglip``** (``--arm-set siglip``; its own protocol, revision S1, fixed before its
run; everything above holds for it unless said here, and the main arm set stays revision 5).
Per cell, from the same initialisation, on exactly the same batches of 64 (the cell's order
seed), the same steps, optimizer, schedule and s = 100 clamped at 100 as arms 1–3:

1. ``ClipLoss``: open_clip's ClipLoss, the reference arm (the main arm set's arm 1, the same
   code and cells).
2. ``SigLIP``: open_clip's ``SigLipLoss`` (the sigmoid loss; ``HNSigLipLoss`` at γ = 0 equals it,
   but the reference is the independent implementation, as ClipLoss is for HN-CLIP).
3. ``HN-SigLIP``: ``hnclip_kernels.HNSigLipLoss(gamma=0.5, margin="text")`` (backend "auto").

The sigmoid arms need a bias b: one learnable scalar per arm, in the AdamW with no weight decay
(open_clip excludes biases and scalars from decay), the same lr and schedule. *Its initial
value b₀* is the arm's calibrated bias: the zero of ∂L/∂b of the arm's own loss, summed over
the cell's first-epoch batches of 64, at the initialisation (no update; s = 100; float64;
a bracketed root finder): where the predicted positives Σ σ(z_ij) equal the positives, the bias's own
stationary point with the features fixed, i.e. the value a bias learnt to convergence on this
model would take. The reason: SigLIP's init t' = log 10, b = −10 (s = 10) is a from-scratch
one. Random features have cosines ≈ 0, so every pair starts at z ≈ −10, σ ≈ 4.5e-5, about the
positive rate of the paper's batch of 32k (log(1/32 768) = −10.4): "close to the prior", no
massive over-correction at the start, in the paper's words. A contrastively pretrained model's
cosines are not ≈ 0: at the study's s = 100, b = −10 puts the decision threshold at cos 0.1, and
a negative at cos 0.3 starts at z = 20, a loss of 20 with full gradient, however many negatives
sit there (an earlier, uncommitted attempt with b = −10 at s = 100 was reported
to collapse both sigmoid arms, t→i R@1 0.095 / 0.064 against ClipLoss's 0.698); at s = 10 every
z ≤ 0, the pretrained positives are predicted negative, and the arms would train 10× hotter than
arms 1–3 at a temperature the model was never at. Neither can be left to learning: AdamW at lr
5e-4 moves a scalar by about lr per step at most, so over the 32 steps of an arm (warmup and
cosine: Σ lr_t ≈ 0.008) b and ln s move by about 0.01 at most. The calibrated b₀ applies the paper's principle (start where the loss
is calibrated: no over-correction of the prior) to the pretrained model, and keeps s = 100, the
scale of every other arm, so the comparison with ClipLoss is of the loss, not of the temperature.
b₀ is calibrated per arm: HN-SigLIP's margin raises its negatives' logits by s·γ·h (up to 50 at
s = 100, h the captions' cosine), which a learnt bias absorbs on average; its own b₀ does that and
leaves the margin's relative weight on the near-duplicates. b₀ uses the cell's training batches
only (never held-out data); ``final.csv`` records each sigmoid arm's b₀ (``logit_bias_init``) and
its last value (``logit_bias``).

*Primary comparison* of this arm set (named before its run): HN-SigLIP γ = 0.5 against SigLIP,
text→image R@1 on the held-out pool at the last epoch, under the crossed model. Secondary: SigLIP
against ClipLoss and HN-SigLIP against ClipLoss. Holm over this arm set's family: 3 comparisons
× 4 metrics = 12. Written to its own ``--out`` (default ``<tmp>/hnclip_fine_tune_study_siglip``);
the stage-1 initialisations (and their cache) are the main arm set's.

**Budget.** Default: 3 initialisations × 10 seeds × 6 arms (``--arm-set siglip``: 3 arms); see ``DEFAULT``. 1 torch thread.
``--quick`` is a smoke test of the same code (2 initialisations × 2 seeds, tiny sizes, 1 epoch),
with its own default ``--out`` and ``--cache`` (``..._quick``): it never writes over a full run.

    python examples/fine_tune_study.py --quick
    python examples/fine_tune_study.py                      # the default run
    python examples/fine_tune_study.py --seeds 10 --seed-offset 10 --init-seeds 3 --init-offset 3
    python examples/fine_tune_study.py --arm-set siglip       # ClipLoss, SigLIP, HN-SigLIP

Writes under ``--out`` (default: ``<tmp>/hnclip_fine_tune_study``, ``--quick``:
``<tmp>/hnclip_fine_tune_study_quick``): ``final.csv`` (arm × initialisation × seed: the
held-out metrics; arm ``initialisation`` is epoch 0), ``regime.csv`` (arm × initialisation ×
seed × epoch), ``stage1.csv``, ``run.json`` (configuration, leakage check, versions, CPU and
wall time) and ``study.png`` (``study_plots.py``: the regime per epoch, R@1 per arm with
intervals), and prints the tables (``study_tables.py``). The docs'
tables are generated from the committed copies in ``examples/results/fine_tune_study/`` (the default run) and
``examples/results/fine_tune_study_replication/`` (``--init-offset 3 --seed-offset 10``) and
``examples/results/fine_tune_study_siglip/`` (``--arm-set siglip``).

*Revisions.* 1–3 (one initialisation, seeds 0–4, a percentile bootstrap): stage 1 moved from
coarse to dense captions and more steps; no stage-2 ClipLoss batch reached InfoNCE < 1e-3. 4:
initialisation and seed control, the reserved held-out captions, a stronger stage 1 (see
``DEFAULT``), the two 4× batch arms, the statistics module, evaluation only at epoch 0 and the
last epoch. 5 (this one, after an outside review of 4): a training pool and batch order per
cell (4 shared them across a seed's initialisations), held-out pools disjoint across seeds (4's
repeated captions: 1 187 distinct in 2 560 items), reservation and leakage check by canonical scene (4's compared
caption strings, and 35–39% of held-out items had their mirror in stage-1 data), the verdicts
under the crossed random-effects model (4's paired t over the cells treated them as independent).

A toy: a small model on synthetic scenes; it says what the losses do in this setting, nothing
about the paper's benchmarks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import resource
import sys
import tempfile
import time
import warnings
from typing import List, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dense_caption_demo as demo  # noqa: E402

GROUP_SIZE = 4
BATCH = 64
BIG_BATCH = 4 * BATCH
GAMMA = 0.5
FN_THRESHOLD = 0.95
SUBSET = 0.2
SAT_THRESHOLD = 1e-3
S1_WARMUP = 50
RESERVED = 3  # of 8: 3/8 of the 16 128 canonical scenes are reserved (the held-out pools need 2 816 distinct ones)
S1_EVAL_SEED = 199_999
VERSION = 5

DEFAULT = dict(
    init_seeds=3,
    init_offset=0,
    seeds=10,
    seed_offset=0,
    train_groups=128,
    eval_groups=64,
    epochs=4,
    s1_train=16384,
    s1_eval=256,
    s1_steps=1600,
    width=64,
)
QUICK = dict(
    init_seeds=2,
    init_offset=0,
    seeds=2,
    seed_offset=0,
    train_groups=64,
    eval_groups=8,
    epochs=1,
    s1_train=256,
    s1_eval=64,
    s1_steps=30,
    width=64,
)
S1_LR = 2e-3
S1_SCALE_MAX = 30.0  # stage 1's clamp on s (fine-tuning starts at s = 100, clamped at 100)

ARMS = (
    "ClipLoss",
    "HN-CLIP",
    "HN-CLIP+FN",
    "HN-CLIP 20%",
    "HN-CLIP 4×batch, same pairs",
    "HN-CLIP 4×batch, same steps",
)
BIG_ARMS = ARMS[4:]
SIGLIP_ARMS = ("ClipLoss", "SigLIP", "HN-SigLIP")  # --arm-set siglip
SIGMOID_ARMS = SIGLIP_ARMS[1:]  # the arms with a learnable bias
ARM_SETS = {"main": ARMS, "siglip": SIGLIP_ARMS}
SIGLIP_REVISION = "S1"
BIAS_BRACKET = 250.0  # |b₀| bound of the calibration's bisection: |s·(cos + γ·h)| ≤ 150 at s = 100
INIT_ARM = "initialisation"
METRICS = ("t2i_R@1", "i2t_R@1", "t2i_group_acc", "i2t_group_acc")  # the Holm family's metrics
PRIMARY = ("HN-CLIP", "t2i_R@1")
SIGLIP_PRIMARY = ("HN-SigLIP", "SigLIP", "t2i_R@1")  # (arm, against, metric)


# ---------------------------------------------------------------- vocabulary and data

_VOCAB_TEXTS = [
    " ".join(sorted(demo.COLORS)),
    " ".join(demo.SHAPES + tuple(demo.SIZES)),
    " ".join(sorted(demo.BACKGROUNDS)) + " left right top bottom",
    " ".join(sorted(demo.OPPOSITE)),
    demo.caption(demo.sample_scene(random.Random(0))),
]


def tokenize(captions: Sequence[str]):
    tokens, vocab = demo.tokenize(_VOCAB_TEXTS + list(captions))
    return tokens[len(_VOCAB_TEXTS) :], vocab


VOCAB = tokenize([])[1]


def _check_vocab(vocab: int) -> None:
    if vocab != VOCAB:  # a caption used a word outside _VOCAB_TEXTS: the ids would shift
        raise RuntimeError(f"vocabulary grew from {VOCAB} to {vocab}: extend _VOCAB_TEXTS")


_FIRST = ("to the left of", "above")  # a is left of / above b: a is the first object on its axis
_CAPTION = re.compile(
    r"two shapes on a (\w+) background\. a (\w+) (\w+) (\w+) is (to the left of|to the right of|above|below) "
    r"a (\w+) (\w+) (\w+)\. "
)


def _key(background: str, relation: str, a: tuple, b: tuple) -> tuple:
    axis = "horizontal" if relation in ("to the left of", "to the right of") else "vertical"
    first, second = (a, b) if relation in _FIRST else (b, a)
    return (background, axis, first, second)


def scene_key(scene) -> tuple:
    """The picture a scene shows, as its caption describes it: (background, axis, first, second).

    ``first`` is the object on the left (horizontal relation) or on top (vertical), ``second``
    the other, each (colour, shape, size). Independent of the objects' float positions and of
    which object the caption names first: "a red square is to the left of a blue circle" and
    its mirror "a blue circle is to the right of a red square" have one key.
    """
    a, b = scene.a, scene.b
    return _key(scene.background, scene.relation, (a.color, a.shape, a.size), (b.color, b.shape, b.size))


def caption_key(caption: str) -> tuple:
    """``scene_key`` read back from a dense caption's text (the leakage check's second path).

    Raises ValueError when ``caption`` is not a dense caption of ``dense_caption_demo``.
    """
    m = _CAPTION.match(caption)
    if m is None:
        raise ValueError(f"caption is not a dense caption of dense_caption_demo: {caption!r}")
    background, size_a, color_a, shape_a, relation, size_b, color_b, shape_b = m.groups()
    return _key(background, relation, (color_a, shape_a, size_a), (color_b, shape_b, size_b))


def reserved(key: tuple) -> bool:
    """Whether a canonical scene (``scene_key``) is reserved for the held-out pools (RESERVED/8 of them)."""
    return hashlib.blake2b(repr(key).encode(), digest_size=8).digest()[0] % 8 < RESERVED


def cell_seed(what: str, init: int, seed: int) -> int:
    """The data seed of one (initialisation, seed) cell: no two cells share a training pool or batch order."""
    return int.from_bytes(hashlib.blake2b(f"{what}:{init}:{seed}".encode(), digest_size=6).digest(), "big")


def draw_groups(n_groups: int, group_size: int, seed: int, held_out: bool, taken=frozenset()) -> dict:
    """``n_groups`` groups (a base scene and ``group_size − 1`` one-attribute edits), rendered.

    ``held_out=False``: every scene of a group unreserved; ``True``: every scene reserved, no
    canonical scene (``scene_key``) twice in the pool nor in ``taken`` (the keys of the other
    held-out pools; not modified). A group that fails is redrawn from the same stream.
    Returns dict(images (n·K, 3, 32, 32) float32, tokens (n·K, 48) int64, scenes, captions, keys).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    scenes, captions, keys, seen = [], [], [], set(taken)
    while len(scenes) < n_groups * group_size:
        base = demo.sample_scene(rng)
        group = [base] + [demo.edit_scene(base, kind, rng) for kind in rng.sample(demo.EDITS, group_size - 1)]
        group_keys = [scene_key(s) for s in group]
        if held_out:
            if not all(map(reserved, group_keys)) or len(set(group_keys)) < len(group_keys):
                continue
            if seen.intersection(group_keys):
                continue
            seen.update(group_keys)
        elif any(map(reserved, group_keys)):
            continue
        scenes += group
        keys += group_keys
        captions += [demo.caption(s) for s in group]
    noise = 0.04 * torch.randn(len(scenes), 3, demo.IMAGE_SIZE, demo.IMAGE_SIZE, generator=gen)
    images = torch.stack([demo.render(s, n) for s, n in zip(scenes, noise)])
    tokens, vocab = tokenize(captions)
    _check_vocab(vocab)
    return dict(images=images, tokens=tokens, scenes=scenes, captions=captions, keys=keys)


def leakage_check(stage1: Sequence[dict], fine_tuning: Sequence[dict], held_out: Sequence[dict]) -> dict:
    """Asserts that no held-out item shares a canonical scene with any training set; returns the counts.

    The canonical scenes are read from the captions (``caption_key``), the text the models see,
    and must agree with the scenes the images were rendered from (``scene_key``). Counted: the
    held-out items whose canonical scene is in stage-1 data, in any training set, and (the
    guard before version 5) whose caption string is; and the keys shared between the held-out
    pools (disjoint by design). AssertionError names the counts when any leak is found.
    """

    def keys(data):
        out = [caption_key(c) for c in data["captions"]]
        if out != [scene_key(s) for s in data["scenes"]]:
            raise AssertionError("captions and rendered scenes disagree on their canonical scenes")
        return out

    s1_keys = set().union(*(keys(d) for d in stage1))
    train_keys = s1_keys.union(*(keys(d) for d in fine_tuning))
    train_caps = set().union(*(d["captions"] for d in list(stage1) + list(fine_tuning)))
    held_keys = [keys(d) for d in held_out]
    items = [k for pool in held_keys for k in pool]
    caps = [c for d in held_out for c in d["captions"]]
    report = dict(
        training_scenes=len(train_keys),
        held_out_items=len(items),
        held_out_scenes=len(set(items)),
        held_out_in_stage1=sum(k in s1_keys for k in items),
        held_out_in_training=sum(k in train_keys for k in items),
        held_out_captions_in_training=sum(c in train_caps for c in caps),
        held_out_pools_sharing_scenes=len(items) - len(set(items)),
        reserved_training_scenes=sum(map(reserved, train_keys)),
    )
    leaks = ("held_out_in_training", "held_out_pools_sharing_scenes", "reserved_training_scenes")
    assert not any(report[k] for k in leaks), f"held-out scenes in training or in two held-out pools: {report}"
    return report


# ---------------------------------------------------------------- model and steps


def build_model(width: int, seed: int):
    """The demo's tiny open_clip CLIP at ``width`` (2 layers per tower, heads of 32)."""
    import logging

    import open_clip

    torch.manual_seed(seed)
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))  # "no pretrained weights"
    return open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=width,
        vision_cfg=dict(image_size=demo.IMAGE_SIZE, patch_size=8, width=width, head_width=32, layers=2, mlp_ratio=2.0),
        text_cfg=dict(
            context_length=demo.CONTEXT_LENGTH,
            vocab_size=VOCAB,
            width=width,
            heads=width // 32,
            layers=2,
            mlp_ratio=2.0,
        ),
    )


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def warmup_cosine(warmup: int, total: int):
    """The lr factor at a step: linear warmup, then cosine to 0 at ``total``."""
    return lambda s: (
        (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))
    )


def _optimizer(model, lr: float):
    return torch.optim.AdamW(demo.param_groups(model, 0.1), lr=lr, betas=(0.9, 0.98), eps=1e-6)


def _step(loss, opt, sched, model, scale_max: float) -> None:
    """One AdamW step and the scheduler's, then the logit scale's clamp."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(scale_max))


def batch_saturation(img_f: torch.Tensor, txt_f: torch.Tensor, scale: torch.Tensor) -> tuple:
    """(InfoNCE value in float32, fraction of rows with an exactly-zero float32 positive gradient)."""
    with torch.no_grad():
        logits = float(scale) * img_f.detach().float() @ txt_f.detach().float().T
        labels = torch.arange(logits.shape[0])
        value = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
        zero = [(torch.softmax(z, dim=1).diagonal() - 1 == 0) for z in (logits, logits.T)]
        return value.item(), torch.cat(zero).double().mean().item()


def dup_fraction(idx: torch.Tensor) -> float:
    """Fraction of the batch's pairs that have a near-duplicate (same group) in the batch."""
    groups = idx // GROUP_SIZE
    return ((groups[:, None] == groups[None, :]).sum(dim=1) > 1).double().mean().item()


def regime_row(values: List[float], zeros: List[float], dups: List[float]) -> dict:
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
    return dict(
        batches=len(values),
        sat_batches=sum(v < SAT_THRESHOLD for v in values) / len(values),
        fp32_zero_pos_grad_rows=sum(zeros) / len(zeros),
        median_infonce=median,
        dup_rows=sum(dups) / len(dups),
    )


# ---------------------------------------------------------------- stage 1


def stage1_config(args, init: int) -> dict:
    return dict(
        s1_train=args.s1_train,
        s1_eval=args.s1_eval,
        s1_steps=args.s1_steps,
        lr=S1_LR,
        scale_max=S1_SCALE_MAX,
        batch=BATCH,
        warmup=S1_WARMUP,
        width=args.width,
        model_seed=init,
        data_seed=100_000 + init,
        eval_seed=S1_EVAL_SEED,
        reserved=RESERVED,
        vocab=VOCAB,
        threads=args.threads,
        version=VERSION,
    )


def stage1(args, init: int, s1_eval: dict, log) -> tuple:
    """Initialisation ``init``: (state_dict, record, training data). Cached under --cache."""
    from open_clip.loss import ClipLoss

    cfg = stage1_config(args, init)
    data = draw_groups(cfg["s1_train"], 1, cfg["data_seed"], held_out=False)
    key = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(args.cache, f"stage1_{key}.pt")
    if os.path.exists(path):
        ckpt = torch.load(path, map_location="cpu")
        if ckpt["config"] == cfg:
            log(f"stage 1, initialisation {init}: reusing {path}")
            return ckpt["state_dict"], dict(ckpt["record"], reused=True), data
    t0, c0 = time.perf_counter(), _cpu_seconds()
    model = build_model(cfg["width"], cfg["model_seed"])
    opt = _optimizer(model, cfg["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg["warmup"], cfg["s1_steps"]))
    loss_fn, gen = ClipLoss(), torch.Generator().manual_seed(cfg["data_seed"])
    order, rows, n = torch.empty(0, dtype=torch.long), [], cfg["s1_train"]
    every = max(1, cfg["s1_steps"] // 4)
    for step in range(1, cfg["s1_steps"] + 1):
        if order.numel() < BATCH:
            order = torch.randperm(n, generator=gen)
        idx, order = order[:BATCH], order[BATCH:]
        img_f, txt_f, scale = model(data["images"][idx], data["tokens"][idx])
        loss = loss_fn(img_f, txt_f, scale)
        _step(loss, opt, sched, model, cfg["scale_max"])
        if step % every == 0 or step == cfg["s1_steps"]:
            model.eval()
            fi, ft, scale = demo.encode(model, s1_eval["images"], s1_eval["tokens"])
            model.train()
            rec = {k: v for k, v in demo.retrieval_metrics(fi, ft, 1).items() if k.endswith("R@1")}
            rows.append(dict(init=init, step=step, train_loss=loss.item(), logit_scale=float(scale), **rec))
            log(
                f"stage 1, initialisation {init}: step {step} loss {loss.item():.4f} s {float(scale):.1f} "
                f"held-out R@1 t→i {rec['t2i_R@1']:.3f} i→t {rec['i2t_R@1']:.3f}"
            )
    record = dict(
        init=init,
        steps=cfg["s1_steps"],
        seconds=time.perf_counter() - t0,
        cpu_seconds=_cpu_seconds() - c0,
        history=rows,
        **{k: rows[-1][k] for k in ("t2i_R@1", "i2t_R@1", "logit_scale")},
    )
    os.makedirs(args.cache, exist_ok=True)
    torch.save(dict(config=cfg, state_dict=model.state_dict(), record=record), path)
    return model.state_dict(), dict(record, reused=False), data


# ---------------------------------------------------------------- stage 2


def big_batch_available() -> bool:
    import hnclip_kernels

    return callable(getattr(hnclip_kernels, "chunked_encode", None))


def _encode(model, images: torch.Tensor, tokens: torch.Tensor, chunked: bool):
    if not chunked:
        return model(images, tokens)
    from hnclip_kernels import chunked_encode  # arms 5 and 6

    img_f = chunked_encode(lambda x: model.encode_image(x, normalize=True), images, BATCH)
    txt_f = chunked_encode(lambda x: model.encode_text(x, normalize=True), tokens, BATCH)
    return img_f, txt_f, model.logit_scale.exp()


def make_loss(arm: str):
    from open_clip.loss import ClipLoss, SigLipLoss

    from hnclip_kernels import HNClipLoss, HNSigLipLoss

    if arm == "ClipLoss":
        return ClipLoss()
    if arm == "SigLIP":
        return SigLipLoss()
    if arm == "HN-SigLIP":
        return HNSigLipLoss(gamma=GAMMA, margin="text", backend="auto")
    if arm == "HN-CLIP+FN":
        return HNClipLoss(gamma=GAMMA, backend="auto", false_negative_threshold=FN_THRESHOLD)
    return HNClipLoss(gamma=GAMMA, backend="auto")


def arm_plan(arm: str, n_pool: int, epochs: int) -> dict:
    """(batch, steps per epoch, total steps) of an arm: an epoch is one pass's worth of pairs."""
    batch = BIG_BATCH if arm in BIG_ARMS else BATCH
    per_epoch = n_pool // BATCH if arm != "HN-CLIP 4×batch, same pairs" else n_pool // BIG_BATCH
    return dict(batch=batch, per_epoch=per_epoch, total=per_epoch * epochs)


def _init_model(state: dict, width: int):
    model = build_model(width, 0)
    model.load_state_dict(state)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100))
    return model


def held_out_metrics(model, data: dict) -> dict:
    model.eval()
    img_f, txt_f, scale = demo.encode(model, data["eval"]["images"], data["eval"]["tokens"])
    model.train()
    out = {k: v for k, v in demo.retrieval_metrics(img_f, txt_f, GROUP_SIZE).items() if "R@5" not in k}
    return dict(out, tau=1.0 / float(scale))


def first_epoch_batches(init: int, seed: int, n_pool: int) -> list:
    """The cell's first-epoch batches of 64 (the first pass of the order every arm of 64 sees)."""
    gen = torch.Generator().manual_seed(cell_seed("order", init, seed))
    order = torch.randperm(n_pool, generator=gen)
    return [order[b * BATCH : (b + 1) * BATCH] for b in range(n_pool // BATCH)]


def start_regime(state: dict, init: int, seed: int, data: dict, args) -> dict:
    """The initialisation (no update) on the cell's first-epoch batches of 64: epoch 0."""
    model = _init_model(state, args.width)
    values, zeros, dups = [], [], []
    with torch.no_grad():
        for idx in first_epoch_batches(init, seed, data["train"]["images"].shape[0]):
            img_f, txt_f, scale = model(data["train"]["images"][idx], data["train"]["tokens"][idx])
            v, z = batch_saturation(img_f, txt_f, scale)
            values.append(v)
            zeros.append(z)
            dups.append(dup_fraction(idx))
    return dict(regime_row(values, zeros, dups), train_loss=float("nan"))


def fine_tune(arm: str, init: int, seed: int, state: dict, data: dict, args, progress) -> tuple:
    """One stage-2 run from an initialisation: (final metrics, per-epoch regime rows)."""
    model = _init_model(state, args.width)
    loss_fn = make_loss(arm)
    opt = _optimizer(model, args.lr)
    bias = None
    if arm in SIGMOID_ARMS:  # the arm's learnable bias, from its calibrated value; no weight decay
        b0 = calibrate_bias(arm, state, init, seed, data, args)
        bias = torch.nn.Parameter(torch.tensor(b0, dtype=torch.float32))
        opt.add_param_group(dict(params=[bias], weight_decay=0.0))
    n_pool = data["train"]["images"].shape[0]
    plan = arm_plan(arm, n_pool, args.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, plan["total"] // 10), plan["total"]))
    gen = torch.Generator().manual_seed(cell_seed("order", init, seed))  # the cell's batch order: arms 1-3 share it
    pool = torch.arange(n_pool)
    if arm == "HN-CLIP 20%":
        pool = torch.randperm(n_pool, generator=torch.Generator().manual_seed(cell_seed("subset", init, seed)))
        pool = pool[: max(BATCH, round(SUBSET * n_pool))]
    order, regime = torch.empty(0, dtype=torch.long), []
    for epoch in range(1, args.epochs + 1):
        losses, values, zeros, dups = [], [], [], []
        for _ in range(plan["per_epoch"]):
            if order.numel() < plan["batch"]:  # a fresh permutation of the (sub)pool, no pair twice per pass
                order = pool[torch.randperm(pool.numel(), generator=gen)]
            idx, order = order[: plan["batch"]], order[plan["batch"] :]
            images, tokens = data["train"]["images"][idx], data["train"]["tokens"][idx]
            img_f, txt_f, scale = _encode(model, images, tokens, arm in BIG_ARMS)
            loss = loss_fn(img_f, txt_f, scale) if bias is None else loss_fn(img_f, txt_f, scale, bias)
            v, z = batch_saturation(img_f, txt_f, scale)
            _step(loss, opt, sched, model, 100.0)
            losses.append(loss.item())
            values.append(v)
            zeros.append(z)
            dups.append(dup_fraction(idx))
            progress(plan["batch"] // BATCH)
        regime.append(dict(epoch=epoch, train_loss=sum(losses) / len(losses), **regime_row(values, zeros, dups)))
    metrics = held_out_metrics(model, data)
    if bias is not None:
        metrics.update(logit_bias_init=b0, logit_bias=bias.item())
    return metrics, regime


def calibrate_bias(arm: str, state: dict, init: int, seed: int, data: dict, args) -> float:
    """A sigmoid arm's initial bias b₀: the zero of ∂L/∂b of the arm's own loss, summed over the cell's
    first-epoch batches of 64, at the initialisation (no update, s = 100), in float64, by a bracketed
    root finder (Illinois, with bisection steps while the bracket is wide).

    At b₀ the predicted positives Σ σ(z_ij) equal the positives: the bias's stationary point with the
    features fixed (the loss is convex in b, its slope increasing from −batches to N − batches).
    """
    model, loss_fn = _init_model(state, args.width), make_loss(arm)
    feats = []
    with torch.no_grad():
        for idx in first_epoch_batches(init, seed, data["train"]["images"].shape[0]):
            img_f, txt_f, scale = model(data["train"]["images"][idx], data["train"]["tokens"][idx])
            feats.append((img_f.double(), txt_f.double(), scale.double()))

    def slope(b: float) -> float:
        bias = torch.tensor(b, dtype=torch.float64, requires_grad=True)
        total = sum(loss_fn(i, t, s, bias) for i, t, s in feats)
        return torch.autograd.grad(total, bias)[0].item()

    lo, hi = -BIAS_BRACKET, BIAS_BRACKET
    f_lo, f_hi = slope(lo), slope(hi)
    if not f_lo < 0 < f_hi:
        raise RuntimeError(f"the bias calibration's bracket [{lo}, {hi}] does not hold the zero of dL/db")
    kept = 0  # Illinois (regula falsi that halves an endpoint kept twice); bisection where it stalls
    for _ in range(200):
        x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        if not lo < x < hi or hi - lo > 0.5 * BIAS_BRACKET:
            x = 0.5 * (lo + hi)
        f = slope(x)
        if f == 0.0 or hi - lo < 1e-9:
            return x
        if f < 0:
            lo, f_lo, f_hi, kept = x, f, f_hi * 0.5 if kept == 1 else f_hi, 1
        else:
            hi, f_hi, f_lo, kept = x, f, f_lo * 0.5 if kept == -1 else f_lo, -1
        if abs(f) < 1e-13:
            return x
    raise RuntimeError("the bias calibration did not converge")


# ---------------------------------------------------------------- the run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a smoke test: {QUICK}")
    parser.add_argument(
        "--arm-set",
        choices=sorted(ARM_SETS),
        default="main",
        help="main: the 6 arms of revision 5; siglip: ClipLoss, SigLIP, HN-SigLIP (revision S1)",
    )
    for key, value in DEFAULT.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    parser.add_argument("--lr", type=float, default=5e-4, help="stage-2 peak learning rate")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (results are reproducible per count)")
    parser.add_argument(
        "--out",
        default=None,
        help="default <tmp>/hnclip_fine_tune_study (--arm-set siglip: ..._siglip; --quick: ..._quick)",
    )
    parser.add_argument(
        "--cache", default=None, help="default <tmp>/hnclip_fine_tune_study_cache (--quick: ..._quick_cache)"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULT
    name = "hnclip_fine_tune_study" + ("_quick" if args.quick else "")  # a smoke run never overwrites a real one
    suffix = "" if args.arm_set == "main" else "_" + args.arm_set  # the arm sets share stage 1's cache
    args.out = args.out or os.path.join(tempfile.gettempdir(), name + suffix)
    args.cache = args.cache or os.path.join(tempfile.gettempdir(), name + "_cache")
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in DEFAULT:
        low = 0 if key.endswith("offset") else 1
        if getattr(args, key) < low:
            parser.error(f"--{key.replace('_', '-')} must be >= {low}")
    if args.train_groups * GROUP_SIZE < BIG_BATCH or (args.train_groups * GROUP_SIZE) % BIG_BATCH:
        parser.error(
            f"--train-groups must be a multiple of {BIG_BATCH // GROUP_SIZE} (the 4× batch is {BIG_BATCH} pairs)"
        )
    if args.width % 32:
        parser.error("--width must be a multiple of 32 (attention heads of 32)")
    return args


def with_bias(metrics: dict, arm_set: str) -> dict:
    """A final.csv row's metrics; the siglip arm set's rows all have the bias columns (nan: no bias)."""
    if arm_set != "siglip":
        return metrics
    return dict(metrics, **{k: metrics.get(k, float("nan")) for k in ("logit_bias_init", "logit_bias")})


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> dict:
    import study_plots
    import study_tables
    from tqdm import tqdm

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    arms, missing = list(ARM_SETS[args.arm_set]), {}
    if args.arm_set == "main" and not big_batch_available():
        for arm in BIG_ARMS:
            missing[arm] = "hnclip_kernels.chunked_encode is not available in this install"
            arms.remove(arm)
        warnings.warn("the 4× batch arms not run: hnclip_kernels.chunked_encode is not available", stacklevel=1)
    inits = list(range(args.init_offset, args.init_offset + args.init_seeds))
    seeds = list(range(args.seed_offset, args.seed_offset + args.seeds))
    n_pool = args.train_groups * GROUP_SIZE
    per_run = sum(arm_plan(a, n_pool, args.epochs)["total"] * arm_plan(a, n_pool, args.epochs)["batch"] for a in arms)
    final, regime, s1_rows, s1_records = [], [], [], []
    leakage = {}

    def write_run(complete: bool = True) -> dict:
        """run.json (and stage1.csv) so far: the leakage check, versions, CPU and wall time."""
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        run = dict(
            version=VERSION,
            complete=complete,
            arm_set=args.arm_set,
            **(dict(arm_set_revision=SIGLIP_REVISION) if args.arm_set == "siglip" else {}),
            config={k: getattr(args, k) for k in list(DEFAULT) + ["lr", "threads"]},
            quick=args.quick,
            arms=arms,
            missing=missing,
            inits=inits,
            seeds=sorted({r["seed"] for r in final}) if not complete else seeds,
            pool_pairs=n_pool,
            held_out_pairs=args.eval_groups * GROUP_SIZE,
            stage1=s1_records,
            leakage=leakage,
            wall_seconds=round(wall, 1),
            cpu_seconds=round(cpu, 1),
            load_average_at_start=round(load, 2),
            cpu=_cpu_name(),
            torch=torch.__version__,
            python=platform.python_version(),
        )
        demo.write_csv(os.path.join(args.out, "stage1.csv"), s1_rows)
        with open(os.path.join(args.out, "run.json"), "w") as fh:
            json.dump(run, fh, indent=1)
        return run

    with (
        demo.deterministic(args.threads),
        tqdm(
            total=per_run // BATCH * len(seeds) * len(inits),
            desc="fine-tuning (steps of 64)",
            unit="step",
            disable=args.no_progress,
            file=sys.stderr,
        ) as bar,
    ):
        log = (lambda msg: None) if args.no_progress else bar.write
        s1_eval = draw_groups(args.s1_eval, 1, S1_EVAL_SEED, held_out=True)
        evals, taken = {}, frozenset(s1_eval["keys"])
        for (
            seed
        ) in seeds:  # held-out pools disjoint across seeds (and from stage 1's): each avoids the scenes before it
            evals[seed] = draw_groups(args.eval_groups, GROUP_SIZE, 2_000 + seed, held_out=True, taken=taken)
            taken = taken.union(evals[seed]["keys"])
        trains = {  # a training pool per (initialisation, seed): no two cells share training data
            (init, seed): draw_groups(args.train_groups, GROUP_SIZE, cell_seed("train", init, seed), held_out=False)
            for init in inits
            for seed in seeds
        }
        states, stage1_data = {}, []
        for init in inits:
            states[init], rec, s1_data = stage1(args, init, s1_eval, log)
            stage1_data.append(s1_data)
            s1_rows += rec.pop("history")
            s1_records.append(rec)
        leakage = leakage_check(stage1_data, list(trains.values()), [s1_eval] + list(evals.values()))
        del stage1_data
        print(f"leakage check: {json.dumps(leakage)}", flush=True)
        for seed in seeds:  # seeds outer: a run stopped early still has every initialisation per seed
            for init, state in states.items():
                data = dict(train=trains[(init, seed)], eval=evals[seed])
                key = dict(init=init, seed=seed)
                init_metrics = held_out_metrics(_init_model(state, args.width), data)
                final.append(dict(arm=INIT_ARM, **key, **with_bias(init_metrics, args.arm_set)))
                regime.append(dict(arm=INIT_ARM, **key, epoch=0, **start_regime(state, init, seed, data, args)))
                for arm in arms:
                    bar.set_postfix_str(f"seed {seed} init {init} {arm}")
                    metrics, rows = fine_tune(arm, init, seed, state, data, args, bar.update)
                    final.append(dict(arm=arm, **key, **with_bias(metrics, args.arm_set)))
                    regime += [dict(arm=arm, **key, **r) for r in rows]
                demo.write_csv(os.path.join(args.out, "final.csv"), final)  # so far: a run stopped early keeps them
                demo.write_csv(os.path.join(args.out, "regime.csv"), regime)
                write_run(complete=False)
    run = write_run()
    tables = study_tables.render_all(args.out)
    print(tables)
    study_plots.plot(args.out, os.path.join(args.out, "study.png"))
    print(
        f"{run['wall_seconds']:.0f} s wall, {run['cpu_seconds']:.0f} s CPU (user+sys), load average at start {load:.2f}"
    )
    print(f"wrote final.csv, regime.csv, stage1.csv, run.json, study.png to {args.out}/")
    return dict(final=final, regime=regime, stage1=s1_records, run=run, missing=missing, tables=tables)


if __name__ == "__main__":
    main()
