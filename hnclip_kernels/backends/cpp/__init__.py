"""backend="cpp": the fused C++ CPU kernels of csrc/ (``hnclip_kernels._C``) as operators.

Importing any module of this package registers every C++ operator: those of :mod:`.ops` and
the hard-negative family's of :mod:`.family` (ImportError when the extension was not built)."""

from . import family  # noqa: F401  (registers hnclip::cpp_family_directional_nll, after .ops)
