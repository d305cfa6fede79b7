"""The loss ``python -m hnclip_kernels.train`` builds where open_clip builds its own (split from
:mod:`hnclip_kernels.train` by role): :class:`~hnclip_kernels.HNClipLoss` for open_clip's
``ClipLoss``, :class:`~hnclip_kernels.HNSigLipLoss` for its ``SigLipLoss`` (``--siglip``), and the
checks of the runs and flags each one takes."""

from __future__ import annotations

import logging

from .clip_loss import HNClipLoss
from .siglip_loss import HNSigLipLoss


def add_arguments(p) -> None:
    p.add_argument(
        "--hn-group-mode",
        choices=("mask", "positive"),
        default="mask",
        help="with --siglip and --hn-group-key: equal group ids are masked (default) or positives (label +1)",
    )


def refused_loss(args):
    """Why open_clip would build a loss this trainer does not replace for ``args``, or None."""
    if args.horovod:
        return "--horovod (HNClipLoss runs on torch.distributed: launch with torchrun)"
    if args.distill_model is not None and args.distill_pretrained is not None:
        return "--distill-model (open_clip builds DistillClipLoss)"
    if "coca" in args.model.lower():
        return f"model {args.model!r} (open_clip builds CoCaLoss for CoCa models)"
    return None


def check_loss_flags(parser, hn, args) -> None:
    """argparse errors, before anything is built: a loss not replaced, or ``--hn-*`` flags the
    run's loss has no meaning for (the sigmoid loss has no label smoothing, false-negative
    threshold or saturation statistics; ``--hn-group-mode`` is the sigmoid loss's)."""
    why = refused_loss(args)
    if why is not None:
        parser.error(
            f"HN-CLIP replaces only open_clip's ClipLoss and SigLipLoss, not the loss of {why}; "
            "run python -m open_clip_train.main for that"
        )
    if args.siglip:
        flags = [f for f, on in (("--hn-label-smoothing", hn.hn_label_smoothing != 0),
                                 ("--hn-false-negative-threshold", hn.hn_false_negative_threshold is not None),
                                 ("--hn-log-stats", hn.hn_log_stats)) if on]  # fmt: skip
        if flags:
            parser.error(f"argument {flags[0]}: not with --siglip (the sigmoid loss has no such option)")
    elif hn.hn_group_mode != "mask":
        parser.error("argument --hn-group-mode: 'positive' is the sigmoid loss's; add --siglip")


def hn_loss(loss, args, hn, kwargs):
    """The HN loss replacing open_clip's ``loss`` (built by its ``create_loss`` from ``args``);
    ``kwargs``: the checked ``--hn-*`` options of HNClipLoss."""
    name = type(loss).__name__
    if args.siglip and name == "SigLipLoss":
        return HNSigLipLoss(
            cache_labels=True,
            rank=args.rank,
            world_size=args.world_size,
            dist_impl=args.loss_dist_impl,  # validated and kept: one caption gather for every value
            gamma=kwargs["gamma"],
            margin=kwargs["margin"],
            group_mode=hn.hn_group_mode,
            backend=kwargs["backend"],
        )
    if name != "ClipLoss":  # not reached for the runs checked above; guards new losses
        raise ValueError(f"HN-CLIP replaces only open_clip's ClipLoss and SigLipLoss, got {name}")
    loss_cls = StatsLoggingHNClipLoss if hn.hn_log_stats else HNClipLoss
    out = loss_cls(
        local_loss=args.local_loss,
        gather_with_grad=args.gather_with_grad,
        cache_labels=True,
        rank=args.rank,
        world_size=args.world_size,
        **kwargs,
    )
    if hn.hn_log_stats:
        out.log_every = max(1, int(args.log_every_n_steps))
    return out


class StatsLoggingHNClipLoss(HNClipLoss):
    """``HNClipLoss(return_stats=True)`` that logs rank 0's report every ``log_every`` calls
    (one call per optimizer step: ``--accum-freq`` > 1, k calls a step, is refused)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, return_stats=True, **kwargs)
        self.log_every, self.calls = 1, 0

    def _get_name(self):  # the run's log names the loss as without the flag (with return_stats=True)
        return "HNClipLoss"

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.rank == 0 and self.last_stats is not None and self.calls % self.log_every == 0:
            r = self.last_stats
            logging.info(
                f"HN-CLIP stats (call {self.calls}, rank 0's {r.rows} directional rows): loss {r.loss:.6g} "
                f"saturated_rows {r.saturated_rows:.4f} effective_negatives {r.effective_negatives:.3f}"
            )
        self.calls += 1
        return out
