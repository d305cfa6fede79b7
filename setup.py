"""Build for hnclip-kernels.

The C++ CPU kernel in csrc/ is compiled against the torch already installed, so install
with ``--no-build-isolation`` (see README): build isolation would download torch again.
"""
import glob
import os

from setuptools import find_packages, setup


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
        # no -std=: BuildExtension adds the standard the installed torch headers need (C++20 today)
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions()

setup(
    name="hnclip-kernels",
    version="0.1.0",
    description="Exact, fast, memory-lean HN-CLIP contrastive loss (Triton, C++, PyTorch)",
    packages=find_packages(include=["hnclip_kernels", "hnclip_kernels.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    extras_require={
        "triton": ["triton>=3.0"],
        "test": [
            "triton>=3.0",
            "pytest>=8",
            "hypothesis>=6",
            "open_clip_torch[training]>=3.0,<4",  # tests/integrations/test_train.py runs open_clip_train
            "matplotlib>=3.7",
            "tqdm>=4.60",
        ],
        # python -m hnclip_kernels.train: open_clip_train (shipped in open_clip_torch) and its
        # training dependencies (webdataset, pandas, transformers, ...). Tested with 3.3.0; open_clip
        # 4 restructures open_clip_train, hence < 4.
        "train": ["open_clip_torch[training]>=3.0,<4"],
        # python -m benchmarks.run with the peer providers. inf-cl 1.2.1 needs only numpy and
        # triton (a pure-Python wheel of Triton kernels: Linux/CUDA); open_clip_torch brings
        # torchvision (tied to the installed torch version), timm, huggingface_hub, ftfy, regex.
        "bench": [
            'inf-cl==1.2.1; platform_system == "Linux"',
            "open_clip_torch>=2.24",
            "matplotlib>=3.7",
            "tqdm>=4.60",
        ],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
