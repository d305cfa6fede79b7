"""backend="torch": the pure-PyTorch reference (materialises the logits; autograd gives every gradient)."""

from .reference import directional_nll_torch

__all__ = ["directional_nll_torch"]
