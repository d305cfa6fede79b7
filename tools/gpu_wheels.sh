#!/usr/bin/env bash
# Rebuild .whl/ in the repository root: the wheels tools/gpu_check.sh installs on a GPU
# machine that has no package index (the lent H200: Python 3.12, torch 2.11, triton 3.6).
#
#   bash tools/gpu_wheels.sh        # needs pip and PyPI here, ~2.4 MiB in all
#
# Only what that machine lacks (its image already holds torch, torchvision, timm, regex,
# safetensors, tqdm, huggingface_hub, numpy, matplotlib, pytest, pytest-xdist, hypothesis):
#   open_clip_torch 3.3.0   the open_clip peer provider (ClipLoss) and tests/integrations/test_readme.py
#   ftfy 6.3.1, wcwidth     open_clip's tokenizer imports them at `import open_clip`
#   inf-cl 1.2.1            the Inf-CL peer provider (package inf_cl; needs only numpy, triton)
#   siglip-kernel 0.1.2     the sigmoid sweep's peer provider (package siglip_kernel: Triton kernels,
#                           needs only torch and triton); open_clip's SigLipLoss comes with open_clip_torch
# .whl/ is ignored through .git/info/exclude (never committed); each device call that needs
# it names `.whl` in its carry list.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PKGS=(open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 inf-cl==1.2.1 siglip-kernel==0.1.2)

if [ -d .git ] && ! grep -qxF '/.whl/' .git/info/exclude 2>/dev/null; then
    mkdir -p .git/info
    echo '/.whl/' >> .git/info/exclude
fi
rm -rf .whl
mkdir .whl
# One version of each: two versions of one package in .whl/ stop the whole install there.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${PKGS[@]}"
ls -l .whl
du -ch .whl/*.whl | tail -n 1
