"""HN-CLIP's adaptive-margin loss as a sentence-transformers loss (``sentence-transformers`` 6.x).

:class:`HNMultipleNegativesRankingLoss` has the constructor of sentence-transformers'
``MultipleNegativesRankingLoss`` (MNRL: ``model, scale, similarity_fct, gather_across_devices,
directions, partition_mode``) plus the margin's strength ``gamma`` and source ``margin``;
:class:`CachedHNMultipleNegativesRankingLoss` is the same loss on sentence-transformers' own
GradCache machinery (``CachedLossMixin``, as ``CachedMultipleNegativesRankingLoss``). Both take
(anchor, positive) pairs or (anchor, positive, negative_1, …, negative_n) tuples; anchors play
the image role, positives the caption role and the negatives become shared extra caption
columns (``hn_clip_loss(negatives=...)``). At ``gamma=0`` each is MNRL with the same directions
and partitions, loss and gradients (``tests/integrations/test_sentence_transformers.py``).

Needs the ``[st]`` extra (``pip install "hnclip-kernels[st]"``: ``sentence-transformers`` 6.x).
Docs: ``docs/sentence_transformers.md``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

try:
    from sentence_transformers.base.losses.gradcache import (
        CachedLossMixin,
        _validate_mini_batch_num_tokens,
        has_static_embedding_input,
    )
    from sentence_transformers.base.losses.merged_forward import embed_columns
    from sentence_transformers.util import cos_sim
except ImportError as exc:  # pragma: no cover - the [st] extra is part of [test]
    raise ImportError(
        "hnclip_kernels.integrations.sentence_transformers needs sentence-transformers 6.x: "
        'pip install "hnclip-kernels[st]" (or "sentence-transformers>=6.2,<7")'
    ) from exc

from ..options import LossOptions, option_attribute
from .sentence_transformers_loss import SYMMETRIC, check_hardness, check_mnrl_arguments, columns_loss

__all__ = ["HNMultipleNegativesRankingLoss", "CachedHNMultipleNegativesRankingLoss", "HNCLIP_CITATION"]

HNCLIP_CITATION = """
@misc{hnclip2026,
    title={Which Negatives Matter? Ask Your Text Encoder: Adaptive Similarity Margins for Dense-Caption Retrieval},
    year={2026},
    eprint={2608.18521},
    archivePrefix={arXiv},
    primaryClass={cs.CV},
    url={https://arxiv.org/abs/2608.18521},
}
"""

GRADCACHE_CITATION = """
@misc{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    year={2021},
    eprint={2101.06983},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


class HNMultipleNegativesRankingLoss(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct=cos_sim,
        gather_across_devices: bool = False,
        directions: tuple = ("query_to_doc",),
        partition_mode: str = "joint",
        gamma: float = 0.5,
        margin: str = "text",
        backend: str = "auto",
        hardness_mode: Optional[str] = None,
        hardness_strength: float = 0.0,
    ) -> None:
        """MNRL (InfoNCE with in-batch negatives) with HN-CLIP's adaptive similarity margin
        (arXiv 2608.18521, Eq. 2). With anchors v, positives t (row i pairs v_i with t_i) and the
        negatives n (all ``negative_k`` columns, shared by every row as MNRL's are), s = ``scale``::

            Z_ij = s·(cos(v_i, t_j) + γ·sg(cos(t_i, t_j))·[j ≠ i])      (and cos(v_i, n_m) likewise)
            loss = mean_i [LSE_j Z_ij − Z_ii]                                    ("query_to_doc",)
            loss = ½ mean_i [LSE_j Z_ij − Z_ii] + ½ mean_k [LSE_i Z_ik − Z_kk]   (+ "doc_to_query")

        The margin raises the logit of every negative whose caption is close to the row's own,
        by up to s·γ logits: what transfers between frameworks is the product s·γ.

        Args:
            model: the ``SentenceTransformer`` to train.
            scale: s = 1/τ > 0 (MNRL's default 20.0, τ = 0.05).
            similarity_fct: ``sentence_transformers.util.cos_sim`` only (the loss normalises inside).
            gather_across_devices: under ``torch.distributed``, this rank's rows against every
                rank's positives and negatives, gradients through the gather (MNRL's convention:
                with DDP's averaging the gradients of the loss on the concatenated batch).
            directions: ``("query_to_doc",)`` (default) or ``("query_to_doc", "doc_to_query")``.
            partition_mode: "joint" (MNRL's default) or "per_direction"; both directions need
                "per_direction" (½(i2t + t2i)); with one direction both are the same softmax.
            gamma: the margin's strength γ ≥ 0 (0.5, the paper's; 0 is MNRL exactly).
            margin: the margin's source, "text" (sg(cos(t_i, x)), the positives' geometry, the
                paper's) or "image_text" (sg(cos(v_i, x)), LLaVE-style; with ``("query_to_doc",)``
                it is MNRL's ``hardness_mode="all_negatives"`` with ``hardness_strength`` = s·γ).
            backend: ``hn_clip_loss``'s: "auto" (Triton on CUDA, the C++ kernel on CPU, torch for
                float64), "torch", "cpp" or "triton".
            hardness_mode, hardness_strength: MNRL's; only their defaults (the margin replaces them).

        Inputs: (anchor, positive) pairs or (anchor, positive, negative_1, …, negative_n) tuples,
        every column of N rows; no labels. The loss: a float32 scalar (float64 for float64
        embeddings), on the embeddings' device.

        Raises:
            TypeError/ValueError: a ``scale`` that is not a positive finite number; a
                ``similarity_fct`` other than ``cos_sim``; directions other than those above
                ("query_to_query", "doc_to_doc" by name); ``partition_mode="joint"`` with both
                directions; a ``hardness_mode``; γ < 0, an unknown ``margin`` or ``backend``
                (:class:`hnclip_kernels.LossOptions`). At the call, ``hn_clip_loss``'s errors.
        """
        super().__init__()
        self.model = model
        self.options = LossOptions(gamma=gamma, margin=margin, backend=backend)
        check_hardness(hardness_mode, hardness_strength)
        if not isinstance(gather_across_devices, bool):
            raise TypeError(f"gather_across_devices must be True or False, got {gather_across_devices!r}")
        self.gather_across_devices = gather_across_devices
        self._set_mnrl(scale, similarity_fct, directions, partition_mode)

    gamma = option_attribute("gamma")
    margin = option_attribute("margin")
    backend = option_attribute("backend")

    def _set_mnrl(self, scale, similarity_fct, directions, partition_mode) -> None:
        """Check MNRL's four arguments together (the joint partition depends on the directions) and keep them."""
        directions = check_mnrl_arguments(scale, similarity_fct, directions, partition_mode, cos_sim)
        self.__dict__.update(_scale=scale, _similarity_fct=similarity_fct, _directions=directions)
        self.__dict__["_partition_mode"] = partition_mode

    # MNRL's attributes, assignable as there; an assignment is checked with the other three
    scale = property(
        lambda self: self._scale,
        lambda self, v: self._set_mnrl(v, self._similarity_fct, self._directions, self._partition_mode),
    )
    similarity_fct = property(
        lambda self: self._similarity_fct,
        lambda self, v: self._set_mnrl(self._scale, v, self._directions, self._partition_mode),
    )
    directions = property(
        lambda self: self._directions,
        lambda self, v: self._set_mnrl(self._scale, self._similarity_fct, v, self._partition_mode),
    )
    partition_mode = property(
        lambda self: self._partition_mode,
        lambda self, v: self._set_mnrl(self._scale, self._similarity_fct, self._directions, v),
    )

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    @property
    def symmetric(self) -> bool:
        """Both directions (½(i2t + t2i), one fused ``hn_clip_loss``); else query→doc only."""
        return set(self.directions) == SYMMETRIC

    def forward(self, sentence_features: Iterable[dict], labels: Optional[Tensor] = None) -> Tensor:
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels)

    def compute_loss_from_embeddings(self, embeddings: list, labels: Optional[Tensor] = None) -> Tensor:
        """The loss of the column embeddings ``[anchor (N, D), positive (N, D), negative_1 (N, D), …]``
        (``labels`` unused: row i's positive is column i), one fused call."""
        return columns_loss(list(embeddings), self.scale, self.options, self.symmetric, self.gather_across_devices)

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "similarity_fct": getattr(self.similarity_fct, "__name__", repr(self.similarity_fct)),
            "gather_across_devices": self.gather_across_devices,
            "directions": self.directions,
            "partition_mode": self.partition_mode,
            "gamma": float(self.gamma),
            "margin": self.margin.value,
            "backend": self.backend,
        }

    @property
    def citation(self) -> str:
        return HNCLIP_CITATION


class CachedHNMultipleNegativesRankingLoss(CachedLossMixin, nn.Module):
    # the wrapped loss holds and checks these; assignments go to it (as CachedMultipleNegativesRankingLoss)
    _delegated_to_wrapped_loss = (
        "scale", "similarity_fct", "gather_across_devices", "directions", "partition_mode", "gamma", "margin",
        "backend",
    )  # fmt: skip

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct=cos_sim,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: Optional[int] = None,
        gather_across_devices: bool = False,
        directions: tuple = ("query_to_doc",),
        partition_mode: str = "joint",
        show_progress_bar: bool = False,
        gamma: float = 0.5,
        margin: str = "text",
        backend: str = "auto",
        hardness_mode: Optional[str] = None,
        hardness_strength: float = 0.0,
    ) -> None:
        """:class:`HNMultipleNegativesRankingLoss` with GradCache (arXiv 2101.06983) on
        sentence-transformers' ``CachedLossMixin``, the arguments of
        ``CachedMultipleNegativesRankingLoss``: the columns are embedded ``mini_batch_size`` rows
        (or ``mini_batch_num_tokens`` tokens) at a time without a graph, the loss of the whole batch
        is one fused call (no N×N logits on the fused backends, so the loss stage is not chunked)
        whose backward caches dL/d(embedding), and the mini-batches are embedded again with
        gradients. The loss and the parameters' gradients equal the uncached loss's (up to dropout).

        Raises: :class:`HNMultipleNegativesRankingLoss`'s errors; ``ValueError`` for a model on a
        ``StaticEmbedding`` (its inputs cannot be split: use the uncached loss) or
        ``mini_batch_num_tokens`` ≤ 0.
        """
        super().__init__()
        if has_static_embedding_input(model):
            raise ValueError(
                "CachedHNMultipleNegativesRankingLoss is not compatible with a StaticEmbedding model, whose inputs "
                "cannot be split into mini-batches; use HNMultipleNegativesRankingLoss instead"
            )
        _validate_mini_batch_num_tokens(mini_batch_num_tokens)
        self.model = model
        self.loss = HNMultipleNegativesRankingLoss(
            model, scale=scale, similarity_fct=similarity_fct, gather_across_devices=gather_across_devices,
            directions=directions, partition_mode=partition_mode, gamma=gamma, margin=margin, backend=backend,
            hardness_mode=hardness_mode, hardness_strength=hardness_strength,
        )  # fmt: skip
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._delegated_to_wrapped_loss and isinstance(getattr(self, "loss", None), nn.Module):
            setattr(self.loss, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name in type(self)._delegated_to_wrapped_loss:
            return getattr(self.loss, name)
        return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules

    @property
    def temperature(self) -> float:
        return 1.0 / self.loss.scale

    def calculate_loss(self, reps: list, labels: Optional[Tensor] = None, *, with_backward: bool = False) -> Tensor:
        """The whole batch's loss from the per-mini-batch embeddings ``reps[column][mini_batch]``, one
        fused call; ``with_backward``: back-propagated to the embeddings (their gradients are
        GradCache's cache) and returned detached."""
        loss = self.loss.compute_loss_from_embeddings([torch_cat(r) for r in reps], labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def forward(self, sentence_features: Iterable[dict], labels: Optional[Tensor] = None) -> Tensor:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ValueError(f"Expected at least 2 inputs (anchor, positive), got {len(sentence_features)}")
        return self.forward_cached(sentence_features, labels)

    def get_config_dict(self) -> dict[str, Any]:
        config = self.loss.get_config_dict()
        config.update(mini_batch_size=self.mini_batch_size, mini_batch_num_tokens=self.mini_batch_num_tokens)
        return config

    @property
    def citation(self) -> str:
        return HNCLIP_CITATION + GRADCACHE_CITATION


def torch_cat(tensors: list) -> Tensor:
    """One column's mini-batch embeddings as one (N, D) tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
