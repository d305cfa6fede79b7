"""The trainer's CSV columns read by ``train_negatives.PackedCsvDataset`` (called directly, with a
stand-in for open_clip's ``CsvDataset``): the group ids and negatives each row gets. Default tier
(no model, no training run: tests/integrations/test_train.py runs the trainer, full tier).
Bound: well under a second."""

from __future__ import annotations

import pytest
import torch

from hnclip_kernels.train_negatives import PackedCsvDataset, _unpack

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
