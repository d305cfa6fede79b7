"""Build of the C++ extension of hnclip-kernels; the package metadata is in pyproject.toml.

The C++ CPU kernel in csrc/ is compiled against the torch already installed, so install
with ``--no-build-isolation`` (see README): build isolation would download torch again.
HNCLIP_NO_CPP=1 skips the extension (the package then runs without the C++ backend).
"""

import glob
import os

from setuptools import setup


def _extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources or os.environ.get("HNCLIP_NO_CPP") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        raise RuntimeError(
            "hnclip-kernels compiles its C++ kernel against an installed torch: install torch first, "
            "then `pip install --no-build-isolation .` (see README)"
        ) from exc
    ext = CppExtension(
        name="hnclip_kernels._C",
        sources=sources,
        depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),  # rebuild when a header changes
        # no -std=: BuildExtension adds the standard the installed torch headers need (C++20 today)
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
