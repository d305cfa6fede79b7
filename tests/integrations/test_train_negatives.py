"""The trainer's CSV columns read by ``train_negatives.PackedCsvDataset`` (called directly, with a
stand-in for open_clip's ``CsvDataset``): the group ids and negatives each row gets; and the
epoch's forward (``family_forward``) on a tiny open_clip model with ``--hn-negatives-layout``.
Default tier (no training run: tests/integrations/test_train.py runs the trainer, full tier).
Bound: well under a second for the CSV, about a second for each forward."""

from __future__ import annotations

import copy

import pytest
import torch

from hnclip_kernels.train_negatives import PackedCsvDataset, _unpack, family_forward, pack

pytest.importorskip("pandas")


class _Base:
    """open_clip's ``CsvDataset(input_filename, transforms, img_key, caption_key, sep, tokenizer)``:
    item i is (image, caption tokens); here the image is i and the caption 4 tokens."""

    def __init__(self, input_filename, transforms, img_key, caption_key, sep="\t", tokenizer=None):
        self.n = sum(1 for _ in open(input_filename)) - 1

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        return idx, torch.full((4,), idx + 1)


def test_group_ids_and_negatives_read_from_the_csv(tmp_path):
    # equal cells, one id; each empty (or blank) cell, an id of its own, equal to no other row's
    rows = [("a.jpg", "a cat", "7", "a dog"), ("b.jpg", "b", "", ""), ("c.jpg", "c", "x", "  "),
            ("d.jpg", "d", "7", "no cat"), ("e.jpg", "e", " ", "n"), ("f.jpg", "f", "x", "")]  # fmt: skip
    path = tmp_path / "train.csv"
    path.write_text("\n".join("\t".join(r) for r in [("filepath", "title", "image_id", "neg_caption"), *rows]))
    tokenize = lambda texts: torch.stack([torch.full((4,), 100 + len(t)) for t in texts])  # noqa: E731
    ds = PackedCsvDataset(str(path), None, "filepath", "title", tokenizer=tokenize, base=_Base,
                          negatives_key="neg_caption", group_key="image_id")  # fmt: skip
    packed = torch.stack([ds[i][1] for i in range(len(ds))])
    caption, negative, has_negative, ids = _unpack(packed, 4)
    assert torch.equal(caption[:, 0], torch.arange(1, 7))
    assert has_negative.tolist() == [True, False, False, True, True, False]
    assert negative[has_negative, 0].tolist() == [105, 106, 101]
    ids = ids.tolist()
    same = [[a == b for b in ids] for a in ids]
    want = [[r == c or {r, c} in ({0, 3}, {2, 5}) for c in range(6)] for r in range(6)]
    assert same == want, f"group ids {ids}: rows 0 = 3 and 2 = 5, every other row (empty cells 1, 4) its own"


# ------------------------------------------------------------------ --hn-negatives-layout own


def _tiny_open_clip():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    return open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=16,
        output_dict=True,
        vision_cfg=dict(image_size=16, patch_size=8, width=32, head_width=16, layers=1),
        text_cfg=dict(context_length=8, vocab_size=49408, width=32, heads=2, layers=1),
    )


def _packed_batch(has=(True, False, True, True, False)):
    g = torch.Generator().manual_seed(3)
    captions, negs = (torch.randint(1, 49407, (len(has), 8), generator=g) for _ in range(2))
    packed = torch.stack([pack(c, n if h else None, i) for i, (c, n, h) in enumerate(zip(captions, negs, has))])
    return torch.randn(len(has), 3, 16, 16, generator=g), packed, captions, negs, torch.tensor(has)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_own_layout_is_the_core_own_loss_on_the_towers_features(chunk_size):
    """family_forward(layout="own") then HNClipLoss: each row's cell its own negative, (B, 1, D) with
    negatives_mask (B, 1) = the non-empty cells. The loss and every parameter's gradient equal
    hn_clip_loss(negatives=(B, 1, D), negatives_mask=) on the model's own features (rel 1e-6 and
    1e-5 of each gradient's norm; measured ≤ 7e-8 and ≤ 5.3e-7), and the float64 formula
    (own_oracle) on those features (rel 1e-6; measured ≤ 6e-8). Bound: about a second (a 1-layer
    open_clip ViT of width 32)."""
    from hnclip_kernels import HNClipLoss, hn_clip_loss
    from own_oracle import own_rows_f64

    model = _tiny_open_clip()
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    images, packed, captions, negs, has = _packed_batch()
    out = family_forward(ours, images, packed, chunk_size=chunk_size, layout="own")
    assert out["negatives"].shape == (5, 1, 16) and torch.equal(out["negatives_mask"], has[:, None])
    loss = HNClipLoss(gamma=0.5, label_smoothing=0.1, backend="torch")(**out)
    loss.backward()
    img, txt = ref.encode_image(images, normalize=True), ref.encode_text(captions, normalize=True)
    real = ref.encode_text(negs[has], normalize=True)
    own = torch.zeros(5, 1, 16)
    own[has.nonzero()[:, 0], 0] = real  # the test's own scatter: row i's cell in its one slot
    tau = 1.0 / ref.logit_scale.exp()
    want = hn_clip_loss(img, txt, tau, negatives=own, negatives_mask=has[:, None], gamma=0.5, label_smoothing=0.1,
                        backend="torch")  # fmt: skip
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-6, atol=0), (loss.item(), want.item())
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        scale = q.grad.norm().clamp_min(1e-12)
        assert (p.grad - q.grad).norm() <= 1e-5 * scale, name
    f64 = [x.detach().double() for x in (img, txt, own, tau)]
    oracle = own_rows_f64(*f64[:3], has[:, None], f64[3], gamma=0.5, label_smoothing=0.1).mean()
    assert abs(loss.item() - oracle.item()) <= 1e-6 * oracle.item()


def test_shared_layout_is_todays_forward():
    """The default and layout="shared" give today's dict (negatives (M, D), no mask), bit for bit;
    "own" changes the loss (fewer extra columns per row); no negative in the batch: no key."""
    from hnclip_kernels import HNClipLoss

    model = _tiny_open_clip()
    images, packed, _, _, has = _packed_batch()
    with torch.no_grad():
        default, shared = family_forward(model, images, packed), family_forward(model, images, packed, layout="shared")
        own = family_forward(model, images, packed, layout="own")
        none = family_forward(model, images, _packed_batch(has=(False,) * 5)[1], layout="own")
        loss = HNClipLoss(gamma=0.5, backend="torch")
        assert loss(**own) < loss(**shared)
    assert set(default) == set(shared) == {"image_features", "text_features", "logit_scale", "negatives"}
    assert all(torch.equal(default[k], shared[k]) for k in default) and default["negatives"].shape == (3, 16)
    assert "negatives" not in none and "negatives_mask" not in none
    with pytest.raises(ValueError, match="layout must be 'shared'"):
        family_forward(model, images, packed, layout="rows")
