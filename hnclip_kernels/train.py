"""``python -m hnclip_kernels.train``: open_clip's trainer (``open_clip_train.main``) with HN-CLIP.

Usage (every argument but the ``--hn-*`` flags goes to ``open_clip_train.main`` unchanged)::

    python -m hnclip_kernels.train [open_clip_train arguments] \\
        [--hn-gamma 0.5] [--hn-label-smoothing 0.0] [--hn-backend auto] [--hn-log-stats]
        [--hn-false-negative-threshold C] [--hn-chunk-size C]
        [--hn-negatives-key COL [--hn-negatives-layout {shared,own}]] [--hn-group-key COL]
        [--hn-margin {text,image_text}]
        [--siglip [--hn-group-mode {mask,positive}]]
    torchrun --nproc_per_node 8 -m hnclip_kernels.train -- --local-loss --gather-with-grad ...

Flags:
    --hn-gamma G            margin scale γ ≥ 0 (default 0.5; 0 reproduces open_clip's ClipLoss)
    --hn-label-smoothing E  ε in [0, 1) (default 0.0)
    --hn-backend B          "auto", "torch", "triton" or "cpp" (default "auto"); checked against the
                            device the run uses (open_clip's ``--device``, CPU without CUDA)
    --hn-log-stats          log rank 0's saturation statistics (loss, saturated rows, effective
                            negatives; ``HNClipLoss(return_stats=True)``) every ``--log-every-n-steps``
                            optimizer steps
    --hn-false-negative-threshold C
                            mask pairs whose captions have cosine >= C in (-1, 1] as false
                            negatives (default: none; not in the paper; see hn_clip_loss)
    --hn-chunk-size C       run both towers C pairs at a time, each chunk's activations recomputed
                            in the backward with its dropout masks replayed
                            (:func:`hnclip_kernels.chunked_features`): ``--batch-size 1024
                            --hn-chunk-size 32`` contrasts 1024 × world size pairs in one loss while
                            the encoders hold the activations of 32 (default: no chunking)
    --hn-negatives-key COL  a CSV column of hard-negative captions (NegCLIP's format: one per row,
                            an empty cell for none): the batch's negatives, through the text tower,
                            are the loss's ``negatives`` (extra image→text columns; docs/hard_negatives.md)
    --hn-negatives-layout L "shared" (default: each negative a column of every image row, NegCLIP's)
                            or "own" (each row's cell a column of its own row only, per-query negatives)
    --hn-group-key COL      a CSV column of group ids (equal values: no negatives of each other)
    --hn-margin M           "text" (default) or "image_text" (the margin from the image-text score)
    --hn-group-mode M       with --siglip: equal group ids are "mask"ed (default) or "positive" (label +1)
    The two column flags: :mod:`hnclip_kernels.train_negatives` (a CSV --train-data, no --torchcompile).

``--siglip`` (open_clip_train's flag: a model with ``init_logit_bias``, e.g. a ``*-SigLIP`` config)
trains with :class:`hnclip_kernels.HNSigLipLoss` where open_clip builds ``SigLipLoss`` (its
``--loss-dist-impl`` validated and kept: one caption gather for every value), with ``--hn-gamma``,
``--hn-margin``, ``--hn-backend``, ``--hn-chunk-size`` and the column flags; ``--hn-label-smoothing``,
``--hn-false-negative-threshold`` and ``--hn-log-stats`` have no sigmoid meaning and are refused.

open_clip's ``--accum-freq K`` (K > 1) is refused: its cached features give ``logit_scale`` K
times its gradient (the loss runs K times a step) and its re-forward draws new dropout masks;
``--batch-size K·B --hn-chunk-size B`` gives the same contrastive batch with exact gradients.

A CSV dataset is checked before anything is built: readable, and tab-separated with columns
``filepath`` and ``title`` unless ``--csv-separator``/``--csv-img-key``/``--csv-caption-key`` say
otherwise. The column flags log each epoch's counts (:class:`.train_negatives.EpochCounts`).

Where open_clip 3.x builds a plain ``ClipLoss`` (``open_clip.create_loss``, from
``open_clip/factory.py``, imported by name into ``open_clip_train.main``; patched there for the
run), this builds :class:`hnclip_kernels.HNClipLoss` from open_clip's own ``--local-loss``,
``--gather-with-grad``, rank and world size (set by its ``init_distributed_device``, so torchrun
works). With ``--hn-chunk-size`` the model's forward is, for each ``train_one_epoch`` call
(wrapped, not copied), an instance ``forward`` of the model inside DDP running
:func:`hnclip_kernels.chunked_features`; DDP's forward still wraps it (one all-reduce per step),
evaluation runs the model's own forward. The model's logit scale reaches the loss already exponentiated and its features
L2-normalised, as HNClipLoss expects. One more fix, for multi-process CPU runs only:
open_clip_train passes ``device_ids=[cpu]`` to ``DistributedDataParallel``, which torch
rejects, so CPU ``device_ids`` are dropped (GPU runs are untouched). Under torchrun put ``--``
after the module name when passing ``--logs`` (torchrun's parser takes it for ``--logs-specs``).

Errors:
    SystemExit(2) with an argparse message, before anything is built: a bad or unknown ``--hn-*``
        flag, ``--accum-freq`` > 1, ``--hn-chunk-size`` with ``--torchcompile`` (untested), a backend that cannot run on the run's device, a CSV ``--train-data``/``--val-data`` that
        cannot be read or whose header lacks the image or caption column, or a run whose loss is neither ClipLoss nor SigLipLoss (``--distill-model``, CoCa models,
        ``--horovod``; :mod:`hnclip_kernels.train_loss`); use ``python -m open_clip_train.main`` for those.
    MissingTrainExtra (an ImportError) naming ``pip install "open_clip_torch[training]"`` when
        open_clip_train or its dependencies (webdataset, pandas, ...) cannot be imported; run
        with ``-m`` it exits 1 with that message.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import logging
import os
import sys

import torch

from . import train_loss, train_negatives
from .backends import resolve_backend
from .chunked import check_chunk_size, chunked_features
from .clip_loss import HNClipLoss

_PROG = "python -m hnclip_kernels.train"
_INSTALL = 'pip install "open_clip_torch[training]"'


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG,
        add_help=False,
        allow_abbrev=False,
        description="HN-CLIP flags; all other arguments go to open_clip_train.main.",
    )
    p.add_argument(
        "--hn-gamma",
        type=float,
        default=0.5,
        metavar="G",
        help="margin scale γ >= 0 (default 0.5; 0 reproduces ClipLoss)",
    )
    p.add_argument(
        "--hn-label-smoothing", type=float, default=0.0, metavar="E", help="label smoothing ε in [0, 1) (default 0)"
    )
    p.add_argument("--hn-backend", default="auto", metavar="B", help='"auto" (default), "torch", "triton" or "cpp"')
    p.add_argument(
        "--hn-log-stats",
        action="store_true",
        help="log rank 0's saturated rows and effective negatives every --log-every-n-steps",
    )
    p.add_argument(
        "--hn-false-negative-threshold",
        type=float,
        default=None,
        metavar="C",
        help="caption cosine in (-1, 1] at and above which a pair is masked as a false negative "
        "(default: no masking; e.g. 0.95 for near-duplicate captions)",
    )
    p.add_argument(
        "--hn-chunk-size",
        type=int,
        default=None,
        metavar="C",
        help="run the encoders C pairs at a time, recomputed in the backward: --batch-size is then the "
        "contrastive batch, the activation memory that of C pairs (default: no chunking)",
    )
    train_negatives.add_arguments(p)
    train_loss.add_arguments(p)
    return p


def _reject_unknown_hn_flags(parser, rest) -> None:
    """A mistyped ``--hn-*`` flag would reach open_clip's parser and fail under its usage text."""
    known = [a for action in parser._actions for a in action.option_strings]
    for token in rest:
        flag = token.split("=", 1)[0]
        if flag.startswith(("--hn-", "--hn_")):
            close = difflib.get_close_matches(flag.replace("_", "-"), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            parser.error(f"unrecognized HN-CLIP flag {flag}{hint} (the flags are {', '.join(known)})")


def _run_device(args) -> str:
    """The device type open_clip_train will train on: ``--device``, CPU when CUDA is missing."""
    kind = str(args.device).split(":", 1)[0]
    return "cpu" if kind == "cuda" and not torch.cuda.is_available() else kind


def _check_backend_device(parser, backend: str, args) -> None:
    kind = _run_device(args)
    if kind not in ("cpu", "cuda"):
        return  # other accelerators: the loss itself says what it can run
    try:
        resolve_backend(backend, torch.empty(0, device=kind))
    except (TypeError, ValueError) as exc:
        parser.error(f"argument --hn-backend: {backend!r} cannot run on this run's device ({kind}): {exc}")


def _check_csv_header(parser, args) -> None:
    """A CSV unreadable or without the image or caption column fails here, not after the model is
    built (a pandas traceback, ``KeyError: 'filepath'``); pandas reads a file (``~`` expanded) or a URL."""
    for flag, path in (("--train-data", args.train_data), ("--val-data", args.val_data)):
        is_csv = args.dataset_type == "csv" or (args.dataset_type == "auto" and str(path).endswith((".csv", ".tsv")))
        if not path or not is_csv or "://" in path:
            continue
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as fh:  # pandas expands ~ too
                header = fh.readline().rstrip("\r\n").split(args.csv_separator)
        except OSError as exc:
            parser.error(
                f"argument {flag}: cannot read {path!r} ({exc.strerror or exc}); open_clip reads one CSV file "
                f"(working directory {os.getcwd()!r}; '::' lists and brace patterns are webdataset's, .tar)"
            )
        missing = [key for key in (args.csv_img_key, args.csv_caption_key) if key not in header]
        if missing:
            parser.error(
                f"argument {flag}: {path}'s header, split on --csv-separator {args.csv_separator!r}, is "
                f"{header}: no column {', '.join(repr(k) for k in missing)}. open_clip reads tab-separated "
                "files with columns 'filepath' (image path) and 'title' (caption) by default: pass "
                "--csv-separator ',' for a comma-separated file, --csv-img-key/--csv-caption-key for "
                "other column names"
            )


class MissingTrainExtra(ImportError):
    """open_clip_train or its training dependencies are not installed."""


def _import_open_clip_train():
    try:
        import open_clip_train.main as oc_main
        from open_clip_train.params import parse_args
    except ImportError as exc:
        raise MissingTrainExtra(
            f"{_PROG} runs open_clip_train, which could not be imported ({exc}); "
            f"install it with: {_INSTALL}  (or the hnclip-kernels[train] extra)"
        ) from exc
    return oc_main, parse_args


def main(argv=None):
    """Run ``open_clip_train.main.main`` with HNClipLoss; returns what it returns."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:  # torchrun ... -m hnclip_kernels.train -- ARGS, where torchrun keeps it
        argv = argv[1:]
    hn, rest = parser.parse_known_args(argv)
    _reject_unknown_hn_flags(parser, rest)
    kwargs = dict(
        gamma=hn.hn_gamma,
        label_smoothing=hn.hn_label_smoothing,
        backend=hn.hn_backend,
        false_negative_threshold=hn.hn_false_negative_threshold,
        margin=hn.hn_margin,
    )
    for name, value in kwargs.items():  # each flag is checked before anything is built
        try:
            HNClipLoss(**{name: value})
        except (TypeError, ValueError) as exc:
            parser.error(f"argument --hn-{name.replace('_', '-')}: {exc}")
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print()  # open_clip's own help follows
    oc_main, parse_args = _import_open_clip_train()
    oc_args = parse_args(rest)
    train_loss.check_loss_flags(parser, hn, oc_args)
    _check_backend_device(parser, hn.hn_backend, oc_args)
    _check_csv_header(parser, oc_args)
    _check_chunking(parser, hn, oc_args)
    train_negatives.check_columns(parser, hn, oc_args)

    original = oc_main.create_loss

    def create_loss(args):
        loss = train_loss.hn_loss(original(args), args, hn, kwargs)
        logging.info(f"Contrastive loss: {loss}")
        return loss

    ddp = torch.nn.parallel.DistributedDataParallel

    class CpuDeviceIdsDDP(ddp):
        """open_clip_train passes ``device_ids=[device]`` also on CPU, which DDP rejects: drop them."""

        def __init__(self, module, device_ids=None, *args, **kw):
            if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
                device_ids = None
            super().__init__(module, device_ids, *args, **kw)

    oc_main.create_loss, torch.nn.parallel.DistributedDataParallel = create_loss, CpuDeviceIdsDDP
    original_epoch, data_module = oc_main.train_one_epoch, importlib.import_module("open_clip_train.data")
    original_csv = data_module.get_csv_dataset
    if train_negatives.uses_columns(hn):  # packed CSV rows, unpacked by the epoch's forward
        data_module.get_csv_dataset = train_negatives.patched_csv_dataset(original_csv, data_module, hn)
        groups, counts = hn.hn_group_key is not None, train_negatives.EpochCounts()
        forward = functools.partial(
            train_negatives.family_forward,
            chunk_size=hn.hn_chunk_size,
            groups=groups,
            counts=counts,
            layout=hn.hn_negatives_layout,
        )
        oc_main.train_one_epoch = train_negatives.counting_epoch(
            _epoch_with_forward(original_epoch, forward), counts, groups
        )
    elif hn.hn_chunk_size is not None:
        oc_main.train_one_epoch = _chunked_epoch(original_epoch, hn.hn_chunk_size)
    torch_levels = {name: logging.getLogger(name).level for name in _torch_loggers()}
    try:
        return oc_main.main(rest)
    finally:
        oc_main.create_loss, torch.nn.parallel.DistributedDataParallel = original, ddp
        oc_main.train_one_epoch, data_module.get_csv_dataset = original_epoch, original_csv
        _restore_torch_logger_levels(torch_levels)


def _check_chunking(parser, hn, args) -> None:
    if args.accum_freq > 1:
        parser.error(
            f"argument --accum-freq: {args.accum_freq} is refused with the HN-CLIP loss: open_clip's "
            f"accumulation runs the loss {args.accum_freq} times a step, giving logit_scale "
            f"{args.accum_freq}× its gradient, and re-forwards without replaying dropout. Use "
            f"--batch-size {args.accum_freq * args.batch_size} --hn-chunk-size {args.batch_size} for the "
            "same contrastive batch with exact gradients"
        )
    if hn.hn_chunk_size is None:
        return
    try:
        check_chunk_size(hn.hn_chunk_size, "--hn-chunk-size")
    except (TypeError, ValueError) as exc:
        parser.error(f"argument --hn-chunk-size: {exc}")
    if args.torchcompile:
        parser.error("argument --hn-chunk-size: not supported with --torchcompile (untested); drop one of them")


def _chunked_epoch(train_one_epoch, chunk_size: int):
    """``train_one_epoch`` with the model's forward chunked (:func:`_epoch_with_forward`)."""
    return _epoch_with_forward(
        train_one_epoch, lambda model, image=None, text=None: _chunked_forward(model, chunk_size, image, text)
    )


def _epoch_with_forward(train_one_epoch, forward):
    """open_clip's ``train_one_epoch`` with the model's forward replaced for its duration by
    ``forward(model, image=, text=)`` (chunked, or unpacking the hard-negative columns).

    It calls ``model(images, texts)`` once a step, ``model`` being the CLIP model or DDP around
    it; an instance ``forward`` on the CLIP model makes that call run :func:`chunked_features`
    inside DDP's forward (DDP's hooks and one all-reduce per step stay as they are)."""

    @functools.wraps(train_one_epoch)
    def wrapped(model, *args, **kwargs):
        inner = getattr(model, "module", model)  # DDP's module, as open_clip_train's unwrap_model
        saved = inner.__dict__.get("forward")
        inner.forward = functools.partial(forward, inner)
        try:
            return train_one_epoch(model, *args, **kwargs)
        finally:
            if saved is None:
                del inner.forward
            else:
                inner.forward = saved

    return wrapped


def _chunked_forward(model, chunk_size, image=None, text=None):
    """open_clip ``CLIP.forward``'s outputs (dict under ``output_dict``), its towers chunked."""
    if image is None or text is None:  # not what train_one_epoch calls: the model's own forward
        return type(model).forward(model, image, text)
    out = chunked_features(model, image, text, chunk_size)  # logit_bias fourth for a SigLIP model
    if getattr(model, "output_dict", False):
        return dict(zip(("image_features", "text_features", "logit_scale", "logit_bias"), out))
    return out


def _torch_loggers() -> list:
    return [name for name in list(logging.root.manager.loggerDict) if name == "torch" or name.startswith("torch.")]


def _restore_torch_logger_levels(levels: dict) -> None:
    # open_clip's setup_logging raises every existing logger to INFO; torch's then dump their
    # (empty) compilation metrics at exit into the user's log. Give torch its own levels back.
    for name in _torch_loggers():
        logging.getLogger(name).setLevel(levels.get(name, logging.NOTSET))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MissingTrainExtra as exc:
        sys.exit(f"error: {exc}")
