"""backend="cpp": the fused C++ CPU kernels of csrc/ (``hnclip_kernels._C``) as operators."""
