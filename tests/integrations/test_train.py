"""``python -m hnclip_kernels.train``: open_clip_train's own loop with HNClipLoss, end to end on CPU.

A tiny ViT (open_clip's ``local-dir:`` schema) trains 4 steps on 16 generated PNGs from a CSV.
The per-step contrastive losses are recorded by wrapping the loss object open_clip_train hands
to ``train_one_epoch``, so they are compared at full precision (its log prints 5 digits).
"""

import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("open_clip")
oc_main = pytest.importorskip("open_clip_train.main", reason='needs pip install "open_clip_torch[training]"')

from hnclip_kernels import HNClipLoss  # noqa: E402
from hnclip_kernels import train as hn_train  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("oc_train")
    (root / "model").mkdir()
    (root / "img").mkdir()
    model_cfg = {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "head_width": 32, "layers": 1},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (root / "model" / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg}))
    rng = np.random.default_rng(0)
    colors, shapes = ["red", "green", "blue", "yellow"], ["square", "circle", "stripe", "dot"]
    rows = ["filepath,title"]
    for i in range(4 * STEPS):
        path = root / "img" / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
        rows.append(f"{path},a {colors[i % 4]} {shapes[i // 4]} on a plain background")
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    return root


def _argv(data, logs, name):
    return [
        "--model",
        f"local-dir:{data / 'model'}",
        "--train-data",
        str(data / "train.csv"),
        "--dataset-type",
        "csv",
        "--csv-img-key",
        "filepath",
        "--csv-caption-key",
        "title",
        "--csv-separator",
        ",",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--workers",
        "0",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--lr",
        "1e-3",
        "--warmup",
        "0",
        "--seed",
        "0",
        "--log-every-n-steps",
        "1",
        "--report-to",
        "",
        "--logs",
        str(logs),
        "--name",
        name,
    ]


def _run(entry, argv):
    """Run ``entry(argv)`` in-process; return (the loss object open_clip used, per-step losses)."""
    seen = {}
    original = oc_main.train_one_epoch

    def train_one_epoch(model, data, loss, *args, **kwargs):
        seen["loss"] = loss

        def recording(**inputs):
            out = loss(**inputs)
            seen.setdefault("values", []).append(float(out["contrastive_loss"].detach()))
            return out

        return original(model, data, recording, *args, **kwargs)

    # open_clip_train's setup_logging adds root handlers and sets every logger to INFO: undo that
    handlers = list(logging.root.handlers)
    levels = {
        name: logger.level
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    levels[None] = logging.root.level
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(oc_main, "train_one_epoch", train_one_epoch)
            assert entry(argv) is None
    finally:
        for h in logging.root.handlers[len(handlers) :]:
            h.close()
        logging.root.handlers[:] = handlers
        for name in [None, *logging.root.manager.loggerDict]:  # new ones (placeholders before) too
            logger = logging.getLogger(name)
            logger.setLevel(levels.get(name, logging.NOTSET))
    return seen["loss"], seen["values"]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    return {
        "stock": _run(oc_main.main, _argv(data, logs, "stock")),
        "gamma0": _run(hn_train.main, _argv(data, logs, "gamma0") + ["--hn-gamma", "0"]),
        "gamma05": _run(hn_train.main, _argv(data, logs, "gamma05") + ["--hn-gamma", "0.5", "--hn-log-stats"]),
        # 4 pairs a step in chunks of 3 (3 + 1), open_clip's checkpointing nested inside; stats every 2nd step
        "chunked": _run(
            hn_train.main,
            _argv(data, logs, "chunked")
            + [
                "--hn-gamma",
                "0.5",
                "--hn-chunk-size",
                "3",
                "--grad-checkpointing",
                "--hn-log-stats",
                "--log-every-n-steps",
                "2",
            ],
        ),
        "bf16": _run(hn_train.main, _argv(data, logs, "bf16") + ["--precision", "amp_bf16"]),
        "bf16_chunked": _run(
            hn_train.main, _argv(data, logs, "bf16_chunked") + ["--precision", "amp_bf16", "--hn-chunk-size", "3"]
        ),
    }, logs


def test_gamma0_equals_stock_clip_loss_at_every_step(runs):
    (stock_loss, stock), (hn_loss, hn) = runs[0]["stock"], runs[0]["gamma0"]
    assert type(stock_loss).__name__ == "ClipLoss"
    assert isinstance(hn_loss, HNClipLoss) and hn_loss.gamma == 0.0
    assert (hn_loss.local_loss, hn_loss.gather_with_grad, hn_loss.rank, hn_loss.world_size) == (False, False, 0, 1)
    assert len(stock) == len(hn) == STEPS
    # the C++ kernel vs ClipLoss's cross_entropy: float32 rounding, compounded through 4 AdamW steps
    np.testing.assert_allclose(hn, stock, rtol=1e-5, atol=0)
    assert stock[0] != stock[-1]  # the model trains (the comparison is not of 4 identical steps)


def test_gamma_half_trains(runs):
    (_, hn0), (loss, hn) = runs[0]["gamma0"], runs[0]["gamma05"]
    assert isinstance(loss, HNClipLoss) and loss.gamma == 0.5 and loss.label_smoothing == 0.0
    assert len(hn) == STEPS and all(math.isfinite(v) for v in hn)
    # random-weight captions look alike, so γ = 0.5's margins put its loss far above InfoNCE's
    assert all(a > b + 1.0 for a, b in zip(hn, hn0))
    log = (runs[1] / "gamma05" / "out.log").read_text()
    assert "Contrastive loss: HNClipLoss(" in log and "gamma=0.5" in log
    assert log.count("Contrastive_loss:") == STEPS
    checkpoint = torch.load(runs[1] / "gamma05" / "checkpoints" / "epoch_1.pt", map_location="cpu")
    assert checkpoint["state_dict"]["logit_scale"].shape == ()  # open_clip's own 0-dim (issue 37: no FSDP path here)


def test_log_stats_logs_saturation_every_step(runs):
    """--hn-log-stats with --log-every-n-steps 1: one line per step, the loss it logs is the step's."""
    loss, values = runs[0]["gamma05"]
    assert loss.return_stats and loss.last_stats is not None
    log = (runs[1] / "gamma05" / "out.log").read_text()
    lines = [line for line in log.splitlines() if "HN-CLIP stats" in line]
    assert len(lines) == STEPS, lines
    logged = [float(line.split(" loss ")[1].split()[0]) for line in lines]
    np.testing.assert_allclose(logged, values, rtol=1e-5)
    for line in lines:
        saturated = float(line.split("saturated_rows ")[1].split()[0])
        effective = float(line.split("effective_negatives ")[1].split()[0])
        assert 0.0 <= saturated <= 1.0 and 1.0 <= effective <= 3.0  # 4 pairs: 3 negatives a row
    assert not runs[0]["gamma0"][0].return_stats


def test_chunked_steps_equal_unchunked_steps(runs):
    """--hn-chunk-size 3 on batches of 4 (chunks 3 + 1), γ = 0.5, with open_clip's own --grad-checkpointing
    nested inside: the unchunked run's losses at every step; amp_bf16 within bf16 rounding."""
    _, plain = runs[0]["gamma05"]
    loss, chunked = runs[0]["chunked"]
    assert isinstance(loss, HNClipLoss) and loss.gamma == 0.5
    assert len(chunked) == len(plain) == STEPS and plain[0] != plain[-1]
    # float32 rounding (chunk GEMMs of 3 and 1 rows against 4), compounded through 4 AdamW steps
    np.testing.assert_allclose(chunked, plain, rtol=1e-5, atol=0)
    (_, bf16), (_, bf16_chunked) = runs[0]["bf16"], runs[0]["bf16_chunked"]
    # bf16 autocast: chunked and unchunked differ by bf16 rounding (2^-8 relative per GEMM), as both
    # differ from float32
    np.testing.assert_allclose(bf16_chunked, bf16, rtol=2e-2, atol=0)
    np.testing.assert_allclose(bf16, plain, rtol=2e-2, atol=0)


def test_chunked_log_stats_every_log_every_n_steps(runs):
    """--hn-log-stats --log-every-n-steps 2 over 4 steps: 2 lines (steps 0 and 2), each with its step's loss."""
    _, values = runs[0]["chunked"]
    log = (runs[1] / "chunked" / "out.log").read_text()
    lines = [line for line in log.splitlines() if "HN-CLIP stats" in line]
    assert len(lines) == 2, lines
    logged = [float(line.split(" loss ")[1].split()[0]) for line in lines]
    np.testing.assert_allclose(logged, values[0::2], rtol=1e-5)


def test_accum_freq_is_refused_pointing_to_the_chunk_flag(monkeypatch, capsys):
    """open_clip's --accum-freq K gives logit_scale K× its gradient with HNClipLoss: refused, never silent."""
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        hn_train.main(["--model", "ViT-B-32", "--batch-size", "16", "--accum-freq", "3", "--hn-log-stats"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --accum-freq: 3 is refused" in err and "--batch-size 48 --hn-chunk-size 16" in err


@pytest.mark.parametrize(
    "value, words",
    [
        ("0", "must be a positive integer"),
        ("-4", "must be a positive integer"),
        ("1.5", "invalid int value"),
        ("x", "invalid int value"),
    ],
)
def test_bad_chunk_size_flag_fails_before_training(monkeypatch, capsys, value, words):
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        hn_train.main(["--model", "ViT-B-32", "--hn-chunk-size", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --hn-chunk-size: " in err and words in err


def test_chunk_size_with_torchcompile_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit):
        hn_train.main(["--model", "ViT-B-32", "--hn-chunk-size", "8", "--torchcompile"])
    assert "--torchcompile" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--hn-gamma", "-1", "gamma (margin scale) must be >= 0"),
        ("--hn-gamma", "nan", "gamma must be finite"),
        ("--hn-label-smoothing", "1", "label_smoothing must be in [0, 1)"),
        ("--hn-backend", "cuda", "backend must be one of"),
        (
            "--hn-false-negative-threshold",
            "1.5",
            "false_negative_threshold must be None or a caption cosine in (-1, 1]",
        ),
        ("--hn-margin", "image", "margin must be one of"),
    ],
)
def test_bad_hn_flags_fail_before_training(monkeypatch, capsys, flag, value, words):
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        hn_train.main(["--model", "ViT-B-32", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and words in err


@pytest.mark.parametrize(
    "typo, suggestion",
    [("--hn-gama", "--hn-gamma"), ("--hn_backend=cpp", "--hn-backend"), ("--hn-stats", "--hn-log-stats")],
)
def test_mistyped_hn_flag_is_reported_by_name(monkeypatch, capsys, typo, suggestion):
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        hn_train.main(["--model", "ViT-B-32", typo, "0.5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized HN-CLIP flag {typo.split('=')[0]}; did you mean {suggestion}?" in err
    assert err.startswith("usage: python -m hnclip_kernels.train")  # our usage, not open_clip's


def test_triton_backend_without_cuda_is_an_argparse_error(monkeypatch, capsys):
    """What a CPU-only machine sees (the suite itself interprets Triton: that is switched off here)."""
    import hnclip_kernels.backends as backends

    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    monkeypatch.setattr(backends, "_triton_interpreting", lambda: False)
    with pytest.raises(SystemExit) as exc:
        hn_train.main(["--model", "ViT-B-32", "--device", "cpu", "--hn-backend", "triton"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --hn-backend: 'triton' cannot run on this run's device (cpu)" in err
    assert "backend='cpp' / 'torch'" in err


def test_comma_csv_without_separator_flag_is_an_argparse_error(data, monkeypatch, capsys):
    """open_clip alone fails with KeyError: 'filepath' at the first batch on a comma-separated file."""
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    argv = _argv(data, data, "x")
    i = argv.index("--csv-separator")
    del argv[i : i + 2]
    with pytest.raises(SystemExit) as exc:
        hn_train.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --train-data:" in err and "['filepath,title']" in err
    assert "tab-separated" in err and "--csv-separator ','" in err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--model", "coca_ViT-B-32"], "CoCaLoss"),
        (["--distill-model", "ViT-B-32", "--distill-pretrained", "x"], "DistillClipLoss"),
        (["--horovod"], "--horovod"),
    ],
)
def test_losses_other_than_clip_loss_are_rejected(monkeypatch, capsys, extra, words):
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        hn_train.main(["--model", "ViT-B-32", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "HN-CLIP replaces only open_clip's ClipLoss" in err and words in err


def test_passes_other_arguments_through_and_restores_patches(monkeypatch):
    import torch

    got = {}
    ddp, create_loss, epoch = torch.nn.parallel.DistributedDataParallel, oc_main.create_loss, oc_main.train_one_epoch

    def fake_main(argv):
        got["argv"] = argv
        got["ddp"] = torch.nn.parallel.DistributedDataParallel
        got["create_loss"] = oc_main.create_loss
        got["train_one_epoch"] = oc_main.train_one_epoch
        return -1  # open_clip's "experiment already exists" return value comes back

    monkeypatch.setattr(oc_main, "main", fake_main)
    argv = [
        "--model",
        "ViT-B-32",
        "--local-loss",
        "--hn-gamma=0.25",
        "--gather-with-grad",
        "--hn-label-smoothing",
        "0.1",
        "--hn-backend",
        "torch",
        "--hn-false-negative-threshold",
        "0.95",
        "--logs",
        "x",
        "--lr",
        "1e-4",
    ]
    assert hn_train.main(argv) == -1
    assert got["argv"] == ["--model", "ViT-B-32", "--local-loss", "--gather-with-grad", "--logs", "x", "--lr", "1e-4"]
    assert hn_train.main(["--", *argv]) == -1  # a "--" that a launcher passed on is dropped
    assert got["argv"][:2] == ["--model", "ViT-B-32"]
    assert issubclass(got["ddp"], ddp) and got["create_loss"] is not create_loss
    assert torch.nn.parallel.DistributedDataParallel is ddp and oc_main.create_loss is create_loss
    assert got["train_one_epoch"] is epoch  # without --hn-chunk-size open_clip's loop is untouched
    assert hn_train.main([*argv, "--hn-chunk-size", "8"]) == -1
    assert got["train_one_epoch"] is not epoch and oc_main.train_one_epoch is epoch
    args = oc_main.parse_args(got["argv"])
    args.rank, args.world_size, args.distill = 0, 1, False  # as open_clip_train.main sets them
    loss = got["create_loss"](args)
    assert isinstance(loss, HNClipLoss)
    assert (loss.gamma, loss.label_smoothing, loss.backend) == (0.25, 0.1, "torch")
    assert loss.false_negative_threshold == 0.95 and loss.options.false_negative_threshold == 0.95
    assert (loss.local_loss, loss.gather_with_grad) == (True, True)


def test_torch_logger_levels_restored_after_open_clip_raised_them(monkeypatch):
    # open_clip's setup_logging sets every logger to INFO, so torch._dynamo's exit-time metrics
    # dump (8 empty INFO lines) ended the smoke run's log
    import logging

    dynamo = logging.getLogger("torch._dynamo")
    before = dynamo.level

    def fake_main(argv):
        for name in list(logging.root.manager.loggerDict):  # what open_clip's setup_logging does
            logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger("torch.hnclip_test_new_logger").setLevel(logging.INFO)
        return 0

    monkeypatch.setattr(oc_main, "main", fake_main)
    assert hn_train.main(["--model", "ViT-B-32", "--hn-backend", "torch"]) == 0
    assert dynamo.level == before
    assert logging.getLogger("torch.hnclip_test_new_logger").level == logging.NOTSET


def test_missing_training_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip_train.main", None)  # import of it now fails
    with pytest.raises(ImportError, match=r'pip install "open_clip_torch\[training\]"'):
        hn_train.main(["--model", "ViT-B-32"])


def test_cli_without_training_extra_exits_with_the_install_command(tmp_path):
    """``python -m hnclip_kernels.train`` where ``open_clip_train`` cannot import braceexpand."""
    fake = tmp_path / "open_clip_train"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'braceexpand'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "hnclip_kernels.train", "--model", "ViT-B-32"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "braceexpand" in proc.stderr and 'pip install "open_clip_torch[training]"' in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(
    os.environ.get("HNCLIP_TRAIN_DDP") != "1", reason="2-process torchrun run, ~50 s on 2 cores: set HNCLIP_TRAIN_DDP=1"
)
def test_torchrun_two_cpu_processes(data, tmp_path):
    argv = _argv(data, tmp_path, "ddp")
    argv[argv.index("--batch-size") + 1] = "2"  # 2 per rank: 4 steps of the 16 pairs
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "hnclip_kernels.train",
        "--",
        *argv,
        "--local-loss",
        "--gather-with-grad",
    ]
    runs = {}
    for name, extra in (("ddp", []), ("ddp_chunked", ["--hn-chunk-size", "1"])):  # chunks of 1 of 2 per rank
        cmd[cmd.index("--name") + 1] = name
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        log = (tmp_path / name / "out.log").read_text()
        assert "local_loss=True, gather_with_grad=True, rank=0, world_size=2, gamma=0.5" in log
        runs[name] = [
            float(line.split("Contrastive_loss: ")[1].split()[0])
            for line in log.splitlines()
            if "Contrastive_loss: " in line
        ]
        assert len(runs[name]) == STEPS and all(math.isfinite(v) for v in runs[name])
    np.testing.assert_allclose(runs["ddp_chunked"], runs["ddp"], rtol=1e-4)  # the log's 5 digits


def test_chunked_epoch_runs_chunked_features_inside_ddp_and_restores_the_forward(monkeypatch):
    """What --hn-chunk-size installs: model(images, texts) in train_one_epoch is chunked_features' output
    (the model bare, or as DDP's .module); the model's own forward is back afterwards."""
    import open_clip
    import torch

    from hnclip_kernels import chunked

    model = open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=16,
        output_dict=True,
        vision_cfg=dict(image_size=16, patch_size=8, width=32, head_width=16, layers=1),
        text_cfg=dict(context_length=8, vocab_size=49408, width=32, heads=2, layers=1),
    )
    images, texts = torch.randn(5, 3, 16, 16), torch.randint(1, 49407, (5, 8))
    seen = []
    monkeypatch.setattr(chunked, "checkpoint", lambda fn, *a, **k: seen.append(len(a[0])) or fn(*a))

    def epoch(m, *args):
        return m(images, texts)

    class Wrapper(torch.nn.Module):  # stands for DDP: the model is its .module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *a):
            return self.module(*a)

    for outer in (model, Wrapper(model)):
        seen.clear()
        out = hn_train._chunked_epoch(epoch, 2)(outer, None)
        assert set(out) == {"image_features", "text_features", "logit_scale"} and out["text_features"].shape == (5, 16)
        assert seen == [2, 2, 1, 2, 2, 1]  # image chunks, then text chunks
        assert "forward" not in model.__dict__
        plain = model(images, texts)
        assert all(torch.allclose(out[k], plain[k], rtol=1e-5, atol=1e-6) for k in out)


# ------------------------------------------------------------------ hard negatives and group ids


@pytest.fixture(scope="module")
def negatives_csv(data):
    """The 16 rows with a NegCLIP-style column (a swapped colour; every third cell empty) and an
    image id shared by pairs of rows."""
    colors = ["red", "green", "blue", "yellow"]
    lines = (data / "train.csv").read_text().splitlines()
    rows = ["filepath,title,neg_caption,image_id"]
    for i, line in enumerate(lines[1:]):
        path, title = line.split(",")
        color = colors[i % 4]
        neg = "" if i % 3 == 1 else title.replace(color, colors[(i + 1) % 4])
        rows.append(f"{path},{title},{neg},img{i // 2}")
    path = data / "train_neg.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def _run_recording_inputs(argv):
    """Run hn_train.main in-process; per step: (loss, M, group ids, |d loss / d negatives|)."""
    steps = []
    original = oc_main.train_one_epoch

    def train_one_epoch(model, data, loss, *args, **kwargs):
        def recording(**inputs):
            neg, mask = inputs.get("negatives"), inputs.get("negatives_mask")
            own = mask is not None  # --hn-negatives-layout own: (B, 1, D) and its mask (B, 1)
            if own:
                assert neg.shape[:2] == mask.shape == (mask.shape[0], 1) and not neg[~mask].any()
            m = 0 if neg is None else int(mask.sum()) if own else neg.shape[0]
            step = {"M": m, "groups": inputs.get("group_ids"), "own": own}
            if neg is not None:
                assert neg.requires_grad and neg.grad_fn is not None  # the text tower's output
                neg.register_hook(lambda g: step.__setitem__("grad", float(g.abs().sum())))
            out = loss(**inputs)
            step["loss"] = float(out["contrastive_loss"].detach())
            steps.append(step)
            return out

        return original(model, data, recording, *args, **kwargs)

    handlers = list(logging.root.handlers)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(oc_main, "train_one_epoch", train_one_epoch)
            assert hn_train.main(argv) is None
    finally:
        for h in logging.root.handlers[len(handlers) :]:
            h.close()
        logging.root.handlers[:] = handlers
    return steps


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--hn-chunk-size", "3", "--hn-margin", "image_text"],
        ["--hn-negatives-layout", "own", "--hn-chunk-size", "3"],
    ],
)
def test_negatives_column_joins_the_batch_and_gets_gradient(data, negatives_csv, tmp_path, extra):
    """--hn-negatives-key / --hn-group-key: each step's negatives are its rows' non-empty cells,
    through the text tower (their gradient is not 0), the group ids one per pair; 4 steps. With
    --hn-negatives-layout own each row's cell is its own (B, 1, D) slot, the empty ones masked."""
    argv = _argv(data, tmp_path, "negatives") + [
        "--train-data",
        str(negatives_csv),
        "--hn-negatives-key",
        "neg_caption",
        "--hn-group-key",
        "image_id",
        *extra,
    ]
    steps = _run_recording_inputs(argv)
    assert len(steps) == STEPS  # open_clip reads the whole CSV: 16 rows, batches of 4
    assert sum(s["M"] for s in steps) == 16 - 5  # rows 1, 4, 7, 10, 13 have no negative
    assert all(s["own"] == ("own" in extra) for s in steps if s["M"])
    for s in steps:
        assert math.isfinite(s["loss"]) and s["groups"].shape == (4,) and s["groups"].dtype == torch.int64
        if s["M"]:
            assert s["grad"] > 0
    # the run's log says what the columns gave the epoch: 11 negatives; 16 ids, the pairs that met their
    # image's other caption in a batch being the ones the ids masked
    shared = sum(int((s["groups"][:, None] == s["groups"][None, :]).sum(dim=1).gt(1).sum()) for s in steps)
    log = (tmp_path / "negatives" / "out.log").read_text()
    assert (
        "HN-CLIP epoch 0 (rank 0): 16 pairs, 11 hard negatives, 16 pairs with a group id, "
        f"{shared} of them with another pair of their group in the batch"
    ) in log, log[-2000:]


def test_negatives_column_missing_from_the_header_fails_before_training(data, monkeypatch, capsys):
    monkeypatch.setattr(oc_main, "main", lambda argv: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        hn_train.main(_argv(data, data, "x") + ["--hn-negatives-key", "neg_caption"])
    assert exc.value.code == 2
    assert "argument --hn-negatives-key: " in capsys.readouterr().err


def test_packed_rows_round_trip():
    from hnclip_kernels.train_negatives import _unpack, pack

    caption, negative = torch.arange(1, 6), torch.arange(6, 11)
    rows = torch.stack([pack(caption, negative, 3), pack(caption, None, -2)])
    cap, neg, has, ids = _unpack(rows, 5)
    assert torch.equal(cap, torch.stack([caption, caption])) and torch.equal(neg[0], negative)
    assert has.tolist() == [True, False] and ids.tolist() == [3, -2] and not neg[1].any()
    with pytest.raises(ValueError, match="packed tokens"):
        _unpack(rows[:, :-1], 5)
