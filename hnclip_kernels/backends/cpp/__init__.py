"""backend="cpp": the fused C++ CPU kernels of csrc/ (``hnclip_kernels._C``) as operators.

Importing any module of this package registers the C++ operators, ``hnclip::cpp_symmetric_nll``,
``hnclip::cpp_directional_nll`` and the sigmoid loss's ``hnclip::cpp_sigmoid_nll`` (:mod:`.ops`,
their public entries; ImportError when the extension was not built)."""

from . import ops  # noqa: F401  (registers the operators and their FLOP formulas)
