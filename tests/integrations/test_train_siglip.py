"""``python -m hnclip_kernels.train --siglip``: open_clip_train's loop with ``HNSigLipLoss`` where
it builds ``SigLipLoss``, end to end on CPU (the tiny ViT of test_train.py with ``init_logit_bias``,
4 steps). At ``--hn-gamma 0`` every step's loss equals open_clip's own ``--siglip`` run; with the
margin and ``--hn-chunk-size`` it trains; the flags without a sigmoid meaning are refused."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("open_clip")
oc_main = pytest.importorskip("open_clip_train.main", reason='needs pip install "open_clip_torch[training]"')

from test_train import STEPS, _argv, _run  # noqa: E402

from hnclip_kernels import HNSigLipLoss  # noqa: E402
from hnclip_kernels import train as hn_train  # noqa: E402


@pytest.fixture(scope="module")
def siglip_data(tmp_path_factory):
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("oc_siglip")
    (root / "model").mkdir()
    (root / "img").mkdir()
    model_cfg = {
        "embed_dim": 32,
        "init_logit_bias": -10.0,
        "init_logit_scale": math.log(10),
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "head_width": 32, "layers": 1},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (root / "model" / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg}))
    rng = np.random.default_rng(0)
    rows = ["filepath,title"]
    for i in range(4 * STEPS):
        path = root / "img" / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
        rows.append(f"{path},a photo number {i} of a {['red', 'blue'][i % 2]} thing")
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.mark.slow
def test_siglip_runs(siglip_data, tmp_path):
    stock_loss, stock = _run(oc_main.main, _argv(siglip_data, tmp_path, "stock") + ["--siglip"])
    ours_loss, ours = _run(
        hn_train.main, _argv(siglip_data, tmp_path, "g0") + ["--siglip", "--hn-gamma", "0", "--hn-backend", "torch"]
    )
    assert type(stock_loss).__name__ == "SigLipLoss" and isinstance(ours_loss, HNSigLipLoss)
    assert ours_loss.options.gamma == 0.0 and ours_loss.dist_impl == "bidir"
    assert len(ours) == len(stock) == STEPS
    for a, b in zip(ours, stock):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, stock)
    argv = _argv(siglip_data, tmp_path, "chunked") + [
        "--siglip",
        "--hn-gamma",
        "0.5",
        "--hn-chunk-size",
        "3",
        "--hn-backend",
        "torch",
    ]
    _, chunked = _run(hn_train.main, argv)
    assert len(chunked) == STEPS and all(math.isfinite(v) for v in chunked)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--siglip", "--hn-log-stats"], "--hn-log-stats: not with --siglip"),
        (["--siglip", "--hn-label-smoothing", "0.1"], "--hn-label-smoothing: not with --siglip"),
        (["--hn-group-mode", "positive"], "add --siglip"),
    ],
)
def test_flags_without_a_sigmoid_meaning_are_refused(monkeypatch, capsys, extra, words):
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        hn_train.main(["--model", "ViT-B-32", *extra])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
