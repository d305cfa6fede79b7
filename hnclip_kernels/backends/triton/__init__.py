"""backend="triton": fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
