"""Hard negatives in ``python -m hnclip_kernels.train``: the CSV columns and the model's forward.

Split from :mod:`hnclip_kernels.train` by role. ``--hn-negatives-key COL`` reads a column of
hard-negative captions (NegCLIP's format: one caption per row, an empty cell for none) and
``--hn-group-key COL`` a column of group ids (any strings or numbers: equal values, one group;
an empty cell, a group of its own). open_clip_train's loop unpacks each batch as
``images, texts = batch`` and calls ``model(images, texts)`` then ``loss(**model_out)``, so:

* the training CSV's dataset (open_clip's ``CsvDataset``, built by its ``get_csv_dataset`` for the
  training data only, patched for the run) returns for each row the packed token tensor
  ``[caption (L) | negative (L) | has_negative | group id]`` of length 2L + 2 in place of the
  caption's L tokens (``pack``); the default collation stacks it as for captions;
* during ``train_one_epoch`` the model's forward (an instance ``forward``, as for
  ``--hn-chunk-size``) unpacks it, encodes the captions and, in a second ``encode_text`` call, the
  batch's M non-empty negatives, and returns open_clip's output dict with ``negatives`` (M, D)
  (absent when M = 0) and ``group_ids`` (B,) added, which ``loss(**model_out)`` hands to
  :class:`hnclip_kernels.HNClipLoss`. Evaluation runs the model's own forward on unpacked data.

``--hn-negatives-layout own`` makes each row's cell its own negative instead of a column of every
row: the same M embeddings, scattered into ``negatives`` (B, 1, D) with ``negatives_mask`` (B, 1)
= the non-empty cells (:mod:`hnclip_kernels.negatives_layout`).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .chunked import agree_tower_calls, chunked_features, padded_encode, tower_calls
from .negatives_layout import NegativesLayout, own_slots

__all__ = [
    "add_arguments",
    "uses_columns",
    "check_columns",
    "patched_csv_dataset",
    "family_forward",
    "pack",
    "EpochCounts",
]


def add_arguments(p) -> None:
    p.add_argument(
        "--hn-negatives-key",
        default=None,
        metavar="COL",
        help="CSV column of hard-negative captions (one per row, empty for none): extra image→text columns",
    )
    p.add_argument(
        "--hn-group-key",
        default=None,
        metavar="COL",
        help="CSV column of group ids: pairs with equal values are no negatives of each other",
    )
    p.add_argument(
        "--hn-margin",
        default="text",
        metavar="M",
        help='the margin\'s score, "text" (default, HN-CLIP\'s) or "image_text" (LLaVE-style hardness)',
    )
    p.add_argument(
        "--hn-negatives-layout",
        choices=[m.value for m in NegativesLayout],
        default="shared",
        help='with --hn-negatives-key: each negative is a column of every image row ("shared", default, '
        'NegCLIP\'s) or of its own row only ("own", per-query negatives)',
    )


def uses_columns(hn) -> bool:
    return hn.hn_negatives_key is not None or hn.hn_group_key is not None


def check_columns(parser, hn, args) -> None:
    """The column flags need a CSV ``--train-data`` whose header has the columns, and no
    ``--torchcompile`` (untested with the packed forward)."""
    if hn.hn_negatives_layout != "shared":
        if hn.hn_negatives_key is None:
            parser.error("argument --hn-negatives-layout: places the negatives of --hn-negatives-key; pass that too")
        if args.siglip:
            parser.error(
                "argument --hn-negatives-layout: 'own' is the softmax loss's (HNClipLoss); the sigmoid loss "
                "(--siglip) takes shared negatives only"
            )
    if not uses_columns(hn):
        return
    flag = "--hn-negatives-key" if hn.hn_negatives_key is not None else "--hn-group-key"
    path = args.train_data
    is_csv = args.dataset_type == "csv" or (args.dataset_type == "auto" and str(path).endswith((".csv", ".tsv")))
    if not path or not is_csv:
        parser.error(
            f"argument {flag}: reads a column of a CSV --train-data (--dataset-type csv or a .csv/.tsv path), "
            f"got --train-data {path!r} with --dataset-type {args.dataset_type}"
        )
    if args.torchcompile:
        parser.error(f"argument {flag}: not supported with --torchcompile (untested); drop one of them")
    if not os.path.isfile(os.path.expanduser(path)):
        return
    with open(os.path.expanduser(path), encoding="utf-8") as fh:
        header = fh.readline().rstrip("\r\n").split(args.csv_separator)
    for key, name in ((hn.hn_negatives_key, "--hn-negatives-key"), (hn.hn_group_key, "--hn-group-key")):
        if key is not None and key not in header:
            parser.error(
                f"argument {name}: {path}'s header, split on {args.csv_separator!r}, is {header}: no column {key!r}"
            )


def pack(caption: torch.Tensor, negative, group: int) -> torch.Tensor:
    """[caption (L) | negative (L), zeros for None | has_negative | group id], int64."""
    has = negative is not None
    negative = negative if has else torch.zeros_like(caption)
    return torch.cat([caption, negative, torch.tensor([int(has), group], dtype=caption.dtype)])


def _unpack(text: torch.Tensor, context_length):
    width = text.shape[-1]
    length = (width - 2) // 2
    if text.dim() != 2 or width % 2 or (context_length is not None and length != context_length):
        raise ValueError(
            f"the hard-negative forward expects packed tokens (B, 2L + 2) with L = {context_length}, got shape "
            f"{tuple(text.shape)}: was the training CSV read without --hn-negatives-key/--hn-group-key?"
        )
    return text[:, :length], text[:, length : 2 * length], text[:, 2 * length].bool(), text[:, 2 * length + 1]


class PackedCsvDataset(torch.utils.data.Dataset):
    """open_clip's ``CsvDataset`` (``base``) whose items' texts are :func:`pack`'s tensors."""

    def __init__(self, input_filename, transforms, img_key, caption_key, sep="\t", tokenizer=None, **columns):
        import pandas as pd  # an open_clip_train dependency

        base, neg_key, group_key = columns["base"], columns["negatives_key"], columns["group_key"]
        self.base = base(input_filename, transforms, img_key, caption_key, sep=sep, tokenizer=tokenizer)
        keys = [k for k in (neg_key, group_key) if k is not None]
        df = pd.read_csv(input_filename, sep=sep, usecols=keys, dtype=str, keep_default_na=False)
        self.negatives = [s if s.strip() else None for s in df[neg_key]] if neg_key else [None] * len(df)
        index = {}
        if group_key is None:
            self.groups = [0] * len(df)
        else:  # equal values, equal ids; an empty cell, an id of its own (negative: no value maps there)
            self.groups = [
                index.setdefault(v, len(index)) if v.strip() else -1 - i for i, v in enumerate(df[group_key])
            ]
        self.tokenize = tokenizer

    def __len__(self):
        return len(self.base)

    def __getitem__(self, idx):
        image, caption = self.base[idx]
        neg = self.negatives[idx]
        return image, pack(caption, None if neg is None else self.tokenize([neg])[0], self.groups[idx])


def patched_csv_dataset(get_csv_dataset, data_module, hn):
    """open_clip_train's ``get_csv_dataset`` building :class:`PackedCsvDataset` for the training data."""

    @functools.wraps(get_csv_dataset)
    def wrapped(args, preprocess_fn, is_train, epoch=0, tokenizer=None):
        if not is_train:
            return get_csv_dataset(args, preprocess_fn, is_train, epoch=epoch, tokenizer=tokenizer)
        base = data_module.CsvDataset
        columns = dict(base=base, negatives_key=hn.hn_negatives_key, group_key=hn.hn_group_key)
        data_module.CsvDataset = functools.partial(PackedCsvDataset, **columns)
        try:
            return get_csv_dataset(args, preprocess_fn, is_train, epoch=epoch, tokenizer=tokenizer)
        finally:
            data_module.CsvDataset = base

    return wrapped


class EpochCounts:
    """What the two columns gave one epoch's training batches on this rank: pairs, negatives (the
    non-empty cells, each one more image→text column), pairs with a group id (a non-empty cell) and
    pairs that met another pair of their group in their batch (those the ids mask). Summed on the
    batches' device, read once per epoch (:meth:`log`): no host sync per step."""

    def __init__(self):
        self.sums = None

    def add(self, has_negative: torch.Tensor, group_ids: torch.Tensor) -> None:
        """One batch's flags (B,) and ids (B,) (:func:`_unpack`'s; empty cells' ids are < 0)."""
        ids = group_ids.sort().values  # equal ids side by side: no B × B comparison, no host sync
        equal = ids[1:] == ids[:-1]
        shared = torch.zeros_like(ids, dtype=torch.bool)
        shared[1:] |= equal
        shared[:-1] |= equal
        shared &= ids >= 0
        batch = torch.stack([torch.ones_like(has_negative).sum(), has_negative.sum(), (group_ids >= 0).sum(),
                             shared.sum()])  # fmt: skip
        self.sums = batch if self.sums is None else self.sums + batch

    def log(self, epoch, rank: int = 0, groups: bool = True) -> None:
        """Log the epoch's counts (open_clip's log: ``out.log`` of the run) and start over."""
        pairs, negatives, grouped, shared = [0] * 4 if self.sums is None else self.sums.tolist()
        self.sums = None
        text = f"HN-CLIP epoch {epoch} (rank {rank}): {pairs} pairs, {negatives} hard negatives"
        if groups:
            text += f", {grouped} pairs with a group id, {shared} of them with another pair of their group in the batch"
        logging.info(text)


def counting_epoch(train_one_epoch, counts: EpochCounts, groups: bool):
    """open_clip's ``train_one_epoch`` logging ``counts`` of its batches when it returns."""

    @functools.wraps(train_one_epoch)
    def wrapped(model, data, loss, epoch, *args, **kwargs):
        counts.sums = None
        out = train_one_epoch(model, data, loss, epoch, *args, **kwargs)
        counts.log(epoch, getattr(loss, "rank", 0), groups)
        return out

    return wrapped


def family_forward(
    model, image=None, text=None, *, chunk_size=None, groups: bool = False, counts=None, layout="shared"
):
    """open_clip ``CLIP.forward``'s output dict on packed tokens, plus ``negatives`` (M, D), the
    batch's non-empty negative captions through ``encode_text`` (L2-normalised; absent for M = 0)
    and, with ``groups``, ``group_ids`` (B,); the towers chunked with a ``chunk_size``; with
    ``layout`` "own" (a :class:`~hnclip_kernels.negatives_layout.NegativesLayout`) the same M
    embeddings as each row's own, ``negatives`` (B, 1, D) and ``negatives_mask`` (B, 1); the batch
    added to ``counts`` (an :class:`EpochCounts`) if given. Under ``torch.distributed`` the ranks
    agree on the calls of each tower (one all_reduce) and pad (:mod:`hnclip_kernels.chunked`): a
    rank without negatives joins its padding calls to the captions' features with zero rows."""
    if image is None or text is None:  # not what train_one_epoch calls: the model's own forward
        return type(model).forward(model, image, text)
    captions, neg_tokens, has_negative, group_ids = _unpack(text, getattr(model, "context_length", None))
    if counts is not None:
        counts.add(has_negative, group_ids)
    negatives = neg_tokens[has_negative]
    # every rank makes as many tower calls (sharded layers gather in each; chunked.agree_tower_calls)
    own = (tower_calls(captions.shape[0], chunk_size), tower_calls(len(negatives), chunk_size) if len(negatives) else 0)
    pair_calls, negative_calls = agree_tower_calls(*own, like=captions)
    if chunk_size is None:
        out = type(model).forward(model, image, captions)
    else:
        features = chunked_features(model, image, captions, chunk_size, calls=pair_calls)  # a SigLIP model's bias 4th
        out = dict(zip(("image_features", "text_features", "logit_scale", "logit_bias"), features))
    if not isinstance(out, dict):
        raise TypeError(
            "the hard-negative forward needs open_clip's output dict (output_dict=True, as open_clip_train)"
        )
    encode = functools.partial(model.encode_text, normalize=True)
    features = padded_encode(encode, negatives if len(negatives) else None, chunk_size, negative_calls, filler=captions)
    if len(negatives) and NegativesLayout.parse(layout, "layout") is NegativesLayout.OWN:
        out["negatives"] = own_slots(features, has_negative[:, None])  # row i's cell: its one slot
        out["negatives_mask"] = has_negative[:, None]
    elif len(negatives):
        out["negatives"] = features
    elif features is not None:  # padding calls only: (0, D) rows, joined to the captions' features
        out["text_features"] = torch.cat([out["text_features"], features])
    if groups:
        out["group_ids"] = group_ids
    return out
