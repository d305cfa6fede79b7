"""Chunked encoder passes: a contrastive batch larger than the encoders' activation memory.

The loss needs O(N·D) memory, the encoders O(N × activations). :func:`chunked_encode` runs an
encoder chunk by chunk, each chunk under non-reentrant ``torch.utils.checkpoint``: its
activations are dropped after the forward and recomputed chunk by chunk in the backward, so
the encoders hold the activations of one chunk at a time, while the concatenated (N, D)
features go to one fused loss over the whole batch. One optimizer step is one loss and one
backward (under DDP: one gradient all-reduce).

Under ``torch.distributed`` every rank makes the same number of encoder calls: a sharded layer
(FSDP2's ``fully_shard`` per layer, DeepSpeed ZeRO-3) runs collectives in each call, forward and
backward, so a rank with fewer chunks (a smaller last batch) or no hard negatives would leave
its peers waiting. :func:`agree_tower_calls` takes each count's maximum over the ranks (one small
all_reduce), and the ranks with fewer calls pad with one-row calls whose outputs join the
features with zero rows (``torch.cat`` with ``out[:0]``): nothing of them enters the loss, but
the backward runs through them (zero gradients), so the sharded layers' backward collectives
match too. The padding calls run under a forked RNG (dropout draws of the real calls unchanged).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.utils.checkpoint import checkpoint

from .distributed.gather import HAS_DISTRIBUTED, dist, meta_device

__all__ = [
    "chunked_encode",
    "chunked_features",
    "check_chunk_size",
    "tower_calls",
    "agree_tower_calls",
    "padded_encode",
]

Inputs = Union[torch.Tensor, Mapping[str, Any], Sequence[Any]]


def check_chunk_size(chunk_size, name: str = "chunk_size") -> Optional[int]:
    """``chunk_size`` as an int ≥ 1, or None for None (no chunking).

    Raises:
        TypeError: a bool, a float (also ``16.0``) or any non-integer, naming ``name``.
        ValueError: 0 or a negative integer, naming ``name``.
    """
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive integer (pairs per encoder chunk) or None, "
            f"got {chunk_size!r} ({type(chunk_size).__name__})"
        )
    if chunk_size < 1:
        raise ValueError(f"{name} must be a positive integer (pairs per encoder chunk) or None, got {chunk_size}")
    return int(chunk_size)


def tower_calls(rows: int, chunk_size: Optional[int]) -> int:
    """Encoder calls :func:`chunked_encode` makes for ``rows`` rows: 1 unchunked (``chunk_size``
    None) or for ``rows <= chunk_size`` (0 rows too), else ⌈rows / chunk_size⌉."""
    if chunk_size is None or rows <= chunk_size:
        return 1
    return math.ceil(rows / chunk_size)


def agree_tower_calls(*counts: int, like: Optional[torch.Tensor] = None) -> Tuple[int, ...]:
    """Each count's largest value over the ranks of the default process group.

    One ``all_reduce(MAX)`` of ``len(counts)`` int64 values when ``torch.distributed`` is
    initialised with world_size > 1 (a collective: every rank calls it with as many counts;
    ``like`` places the values on its device where the backend needs it, NCCL's CUDA);
    otherwise the counts unchanged and no collective.
    """
    counts = tuple(int(c) for c in counts)
    if not (HAS_DISTRIBUTED and dist.is_initialized()) or dist.get_world_size() == 1:
        return counts
    values = torch.tensor(counts, dtype=torch.int64, device=meta_device(None, like))
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(int(v) for v in values.tolist())


def _batch_size(inputs: Inputs) -> int:
    tensors = _tensors(inputs)
    if not tensors:
        raise TypeError(
            f"inputs must be a tensor or a dict/tuple/list holding at least one tensor, got {type(inputs).__name__}"
        )
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            "every tensor in inputs must have the same batch size along dim 0, got shapes "
            f"{[tuple(t.shape) for t in tensors]}"
        )
    return sizes.pop()


def _tensors(inputs: Inputs) -> list:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if isinstance(inputs, Mapping):
        values = list(inputs.values())
    elif isinstance(inputs, (tuple, list)):
        values = list(inputs)
    else:
        raise TypeError(f"inputs must be a tensor, a dict or a tuple/list, got {type(inputs).__name__}")
    return [v for v in values if isinstance(v, torch.Tensor)]


def _slice(inputs: Inputs, start: int, stop: int) -> Inputs:
    """Rows start:stop of every tensor in inputs (non-tensors, e.g. None masks, pass unchanged)."""

    def cut(v):
        return v[start:stop] if isinstance(v, torch.Tensor) else v

    if isinstance(inputs, torch.Tensor):
        return inputs[start:stop]
    if isinstance(inputs, Mapping):
        return {k: cut(v) for k, v in inputs.items()}
    return tuple(cut(v) for v in inputs)


def _call(encoder: Callable, inputs: Inputs) -> torch.Tensor:
    if isinstance(inputs, torch.Tensor):
        out = encoder(inputs)
    elif isinstance(inputs, Mapping):
        out = encoder(**inputs)
    else:
        out = encoder(*inputs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"encoder must return a tensor of per-row features, got {type(out).__name__} (wrap it, "
            "e.g. lambda **kw: model.get_text_features(**kw).pooler_output)"
        )
    rows = _tensors(inputs)[0].shape[0]
    if out.dim() == 0 or out.shape[0] != rows:  # a batch-pooled output would be cat'ed per chunk, silently
        raise ValueError(f"encoder must return one row per input row, got shape {tuple(out.shape)} for {rows} rows")
    return out


def _checkpointed(encoder: Callable, chunk: Inputs) -> torch.Tensor:
    # The chunk's tensors are checkpoint's positional arguments (not captured by a closure):
    # preserve_rng_state stashes the RNG state of the devices of those arguments (CUDA's too)
    # besides the CPU's, and the recompute runs under that state.
    flat = _tensors(chunk)

    def run(*tensors):
        it = iter(tensors)
        if isinstance(chunk, torch.Tensor):
            rebuilt = next(it)
        elif isinstance(chunk, Mapping):
            rebuilt = {k: next(it) if isinstance(v, torch.Tensor) else v for k, v in chunk.items()}
        else:
            rebuilt = tuple(next(it) if isinstance(v, torch.Tensor) else v for v in chunk)
        return _call(encoder, rebuilt)

    return checkpoint(run, *flat, use_reentrant=False, preserve_rng_state=True)


def chunked_encode(encoder: Callable, inputs: Inputs, chunk_size: int, *, calls: Optional[int] = None) -> torch.Tensor:
    """``encoder(inputs)`` computed ``chunk_size`` rows at a time, each chunk recomputed in the backward.

    Returns ``torch.cat([encoder(inputs[i:i + chunk_size]) for i in range(0, N, chunk_size)])``
    with the same values and the same gradients (to float rounding; a deterministic encoder on
    exact chunk boundaries gives the unchunked encoder's gradients), while autograd keeps only
    each chunk's inputs and output, never its activations.

    Mechanism and what it means:

    * Each chunk runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
      preserve_rng_state=True)``. Non-reentrant checkpointing keeps the autograd graph of the
      plain forward (each parameter has one gradient accumulator however many chunks use it,
      so DDP's hooks fire once per parameter and one all-reduce runs per backward; no
      "marked ready twice", no ``static_graph`` needed), recomputes a chunk when its
      backward first needs a saved tensor, and nests with open_clip's own non-reentrant
      ``--grad-checkpointing``.
    * ``preserve_rng_state=True``: the CPU RNG state and that of the inputs' devices are
      saved before each chunk's forward and restored for its recompute, so dropout and
      patch-dropout masks in the backward are the ones the forward drew. The gradients equal
      those of the same chunks run once with grad, same seed, same chunk order. (With
      ``False`` the recompute would draw new masks and the gradients would belong to another
      forward, silently.)
    * Autocast: checkpoint records the autocast state of the forward and recomputes under it.
    * BatchNorm in train mode normalises each chunk by the chunk's statistics (as any
      micro-batching does; not the batch's) and updates its running statistics twice per
      chunk (forward and recompute). CLIP towers (LayerNorm) are unaffected; for BatchNorm
      towers freeze the statistics (open_clip's ``--lock-image-freeze-bn-stats``) or use
      ``eval()`` for them.
    * Under ``torch.no_grad()`` / ``torch.inference_mode()`` (a frozen tower, LiT, or
      evaluation) the chunks run plainly, nothing is checkpointed; a single chunk
      (``chunk_size >= N``) runs plainly too (nothing to drop).

    Args:
        encoder: a callable returning one (rows, ...) tensor: ``encoder(x)`` for a tensor,
            ``encoder(**inputs)`` for a dict (e.g. ``input_ids`` and ``attention_mask``),
            ``encoder(*inputs)`` for a tuple or list.
        inputs: a tensor, or a dict / tuple / list of tensors with the same size N along dim 0,
            split along dim 0 (other values, e.g. a None mask, are passed to every chunk as is).
        chunk_size: rows per chunk, an integer ≥ 1; the last chunk holds the rest.
        calls: None (default): under ``torch.distributed`` (initialised, world_size > 1) the
            ranks agree on the number of encoder calls (:func:`agree_tower_calls`, one small
            all_reduce: every rank must call this) and a rank with fewer chunks pads with one-row
            calls whose outputs enter nothing (module docstring); on one process nothing changes.
            An integer: make that many calls, without a collective (an entry that agreed once for
            several towers passes it; code that only one rank runs passes 1).

    Returns:
        The (N, ...) concatenation of the chunks' outputs, in row order.

    Raises:
        TypeError: ``chunk_size`` not an integer (a bool, a float), inputs of another type,
            an encoder that returns no tensor.
        ValueError: ``chunk_size`` < 1; tensors of different sizes along dim 0; an encoder
            output without one row per input row; ``calls`` below this rank's chunk count.
    """
    chunk_size = check_chunk_size(chunk_size)
    if chunk_size is None:
        raise TypeError("chunk_size must be a positive integer, got None (call the encoder directly instead)")
    own = tower_calls(_batch_size(inputs), chunk_size)
    if calls is None:
        calls = agree_tower_calls(own, like=_tensors(inputs)[0])[0]
    return padded_encode(encoder, inputs, chunk_size, calls)


def padded_encode(
    encoder: Callable,
    inputs: Optional[Inputs],
    chunk_size: Optional[int],
    calls: int,
    *,
    filler: Optional[Inputs] = None,
) -> Optional[torch.Tensor]:
    """The features of ``inputs`` from exactly ``calls`` encoder calls (no collective: ``calls``
    comes from :func:`agree_tower_calls`).

    This rank's own calls first (:func:`tower_calls`: the whole batch, or its chunks, each
    checkpointed when grad mode is on and ``calls`` > 1), then ``calls`` minus that many padding
    calls on one row of ``inputs`` (of ``filler`` when ``inputs`` is None: a rank without hard
    negatives), under a forked RNG, their outputs joined with zero rows. With ``calls`` equal to
    the own count this is the plain chunked (or unchunked) encoding, bit for bit.

    Returns:
        The (N, ...) features; for ``inputs`` None a (0, ...) tensor carrying the padding calls
        (join it to features that enter the loss: ``torch.cat([text, pad])``), or None when
        ``calls`` is 0.

    Raises:
        ValueError: ``calls`` smaller than this rank's own count (ranks that disagree), or
            padding calls with neither ``inputs`` nor ``filler``.
    """
    rows = 0 if inputs is None else _batch_size(inputs)
    own = 0 if inputs is None else tower_calls(rows, chunk_size)
    if calls < own:
        raise ValueError(f"calls must be at least this rank's {own} encoder calls, got {calls}")
    if calls == 0:
        return None
    # inference_mode turns grad mode off too, so this one test covers it; and Dynamo traces grad
    # mode (torch.is_inference_mode_enabled() would break the graph under torch.compile)
    run = _checkpointed if torch.is_grad_enabled() and calls > 1 else _call
    if own == 1 and calls == 1:
        return _call(encoder, inputs)
    if own <= 1:
        outs = [] if inputs is None else [run(encoder, inputs)]
    else:
        outs = [run(encoder, _slice(inputs, i, i + chunk_size)) for i in range(0, rows, chunk_size)]
    if calls > own:
        source = inputs if rows else filler
        if source is None:
            raise ValueError("padding calls need one row of inputs or a filler; got neither")
        one = _slice(source, 0, 1)
        with _rng_kept(_tensors(one)):
            outs += [run(encoder, one)[:0] for _ in range(calls - own)]
    return torch.cat(outs, dim=0)


def _rng_kept(tensors):
    """The RNG states of the CPU and of the tensors' accelerator restored on exit."""
    devices = sorted({t.device for t in tensors if t.device.type != "cpu"}, key=str)
    if not devices:
        return torch.random.fork_rng(devices=[])
    kind = devices[0].type
    return torch.random.fork_rng(devices=[d.index or 0 for d in devices if d.type == kind], device_type=kind)


def chunked_features(
    model, images: torch.Tensor, texts: Inputs, chunk_size: int, *, calls: Optional[int] = None
) -> Tuple[torch.Tensor, ...]:
    """An open_clip model's ``(image_features, text_features, logit_scale[, logit_bias])``, as its ``forward``
    returns them (features L2-normalised, ``logit_scale`` exponentiated), with both towers run
    ``chunk_size`` pairs at a time (:func:`chunked_encode`): all image chunks first, then all
    text chunks. Feed them to one :class:`hnclip_kernels.HNClipLoss` call::

        img, txt, scale = chunked_features(model, images, texts, chunk_size=32)
        loss_fn(img, txt, scale).backward()

    Args:
        model: an open_clip ``CLIP`` / ``CustomTextCLIP`` (``encode_image``, ``encode_text``,
            ``logit_scale``), not wrapped in DDP (for DDP, run this inside the wrapper's forward,
            as ``python -m hnclip_kernels.train --hn-chunk-size`` does).
        images: (N, 3, H, W); texts: (N, L) token ids.
        chunk_size: pairs per chunk, an integer ≥ 1.
        calls: encoder calls per tower, as :func:`chunked_encode`'s; None (default): agreed
            across ranks under ``torch.distributed`` by one all_reduce for both towers.

    Returns:
        ``(image_features, text_features, logit_scale)``, and ``logit_bias`` fourth for a SigLIP
        model (``init_logit_bias``: open_clip's forward returns it too), which feeds
        :class:`hnclip_kernels.HNSigLipLoss`: ``loss_fn(*chunked_features(model, images, texts, 32))``.

    Raises:
        TypeError / ValueError: as :func:`chunked_encode`.
    """
    if calls is None:  # one agreement for both towers (same N)
        calls = agree_tower_calls(tower_calls(_batch_size(images), check_chunk_size(chunk_size)), like=images)[0]
    image = chunked_encode(lambda x: model.encode_image(x, normalize=True), images, chunk_size, calls=calls)
    text = chunked_encode(lambda x: model.encode_text(x, normalize=True), texts, chunk_size, calls=calls)
    bias = getattr(model, "logit_bias", None)
    if bias is not None:  # SigLIP: open_clip's forward returns the bias too, for SigLipLoss / HNSigLipLoss
        return image, text, model.logit_scale.exp(), bias
    return image, text, model.logit_scale.exp()
