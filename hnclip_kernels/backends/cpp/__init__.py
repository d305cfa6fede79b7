"""backend="cpp": the fused C++ CPU kernels of csrc/ (``hnclip_kernels._C``) as operators.

Importing any module of this package registers every C++ operator: those of :mod:`.ops` and
the hard-negative family's of :mod:`.family` and :mod:`.family_sym` (ImportError when the
extension was not built)."""

# registers hnclip::cpp_family_directional_nll and hnclip::cpp_family_nll, after .ops
from . import family, family_sym  # noqa: F401
