"""Integrations of the HN-CLIP loss with other training frameworks.

- :mod:`hnclip_kernels.integrations.transformers`: Hugging Face ``transformers`` CLIP models
  (``clip_model_loss``, ``HNClipTrainer``); needs the ``[hf]`` extra.
- :mod:`hnclip_kernels.integrations.transformers_negatives`: their hard-negative batches
  (``collate_hard_negatives``).
- :mod:`hnclip_kernels.integrations.sentence_transformers`: sentence-transformers 6 losses
  (``HNMultipleNegativesRankingLoss``, ``CachedHNMultipleNegativesRankingLoss``); needs the ``[st]``
  extra. :mod:`~hnclip_kernels.integrations.sentence_transformers_loss` holds their computation.

open_clip needs no module here: :class:`hnclip_kernels.HNClipLoss` is its drop-in, and
``python -m hnclip_kernels.train`` runs its trainer.
"""
