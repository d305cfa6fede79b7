"""``python -m hnclip_kernels.train``'s checks that run before anything is built, and the per-epoch
counts of the hard-negative columns: the default tier's part of the trainer (the training runs
are tests/integrations/test_train.py, full tier). In-process, no model: each test takes well under
a second, the one CLI run a few (its imports: torch, open_clip_train).
"""

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("open_clip")
oc_main = pytest.importorskip("open_clip_train.main", reason='needs pip install "open_clip_torch[training]"')

from hnclip_kernels import train as hn_train  # noqa: E402
from hnclip_kernels import train_negatives  # noqa: E402

ARGS = ["--model", "ViT-B-32", "--device", "cpu", "--csv-img-key", "filepath", "--csv-caption-key", "title"]


@pytest.fixture
def csv(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("filepath\ttitle\n/x.png\ta caption\n")
    return path


@pytest.fixture
def started(monkeypatch):
    """The arguments open_clip_train.main was started with (nothing is trained)."""
    calls = []
    monkeypatch.setattr(oc_main, "main", lambda argv: calls.append(argv))
    return calls


def _error(capsys, argv) -> str:
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        hn_train.main(argv)
    assert exc.value.code == 2 and time.perf_counter() - t0 < 1.0  # before the model (~70 s at ViT-B-32)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage:") and [line for line in err if "error:" in line] == err[-1:], err
    return err[-1]  # argparse's usage, then one error line


@pytest.mark.parametrize("flag", ["--train-data", "--val-data"])
@pytest.mark.parametrize("dataset_type", ["auto", "csv"])
def test_a_missing_csv_fails_in_one_line_before_anything_is_built(tmp_path, csv, started, capsys, flag, dataset_type):
    missing = tmp_path / "no_such.csv"
    data = ["--train-data", str(csv), "--val-data", str(csv)]
    data[data.index(flag) + 1] = str(missing)
    line = _error(capsys, [*ARGS, *data, "--dataset-type", dataset_type])
    assert f"argument {flag}: cannot read '{missing}' (No such file or directory)" in line, line
    assert not started


def test_an_unreadable_csv_fails_in_one_line(tmp_path, started, capsys):
    folder = tmp_path / "train.csv"
    folder.mkdir()  # a directory where the file belongs (permissions do not stop root)
    line = _error(capsys, [*ARGS, "--train-data", str(folder)])
    assert "argument --train-data: cannot read" in line and "Is a directory" in line, line
    assert not started


@pytest.mark.parametrize(
    "data",
    [
        ["--train-data", "s3://bucket/train.csv"],  # pandas reads URLs: nothing local to check
        ["--train-data", "/data/shards-{000000..000009}.tar", "--dataset-type", "webdataset"],
        ["--train-data", "/a/{0..3}.tar::/b/{0..1}.tar", "--train-num-samples", "8"],  # webdataset's '::' list
        ["--train-data", "pipe:aws s3 cp s3://b/{0..3}.tar -", "--dataset-type", "webdataset"],
        ["--dataset-type", "synthetic"],
    ],
)
def test_webdataset_urls_and_patterns_are_left_to_open_clip(started, data):
    hn_train.main([*ARGS, *data])
    assert len(started) == 1


def test_a_home_relative_csv_is_read_as_pandas_would(csv, started, monkeypatch):
    monkeypatch.setenv("HOME", str(csv.parent))
    hn_train.main([*ARGS, "--train-data", "~/train.csv"])
    assert len(started) == 1


def test_the_cli_exits_with_one_line(tmp_path):
    missing = tmp_path / "train.csv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "hnclip_kernels.train", *ARGS, "--train-data", str(missing)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("usage:") and "Traceback" not in out.stderr, out.stderr
    assert [line for line in lines if "error:" in line] == lines[-1:] and "cannot read" in lines[-1], lines
    assert wall < 60, wall  # the imports only (torch, open_clip_train); the model took ~70 s before


@pytest.mark.parametrize(
    "extra, words",
    [
        ([], "places the negatives of --hn-negatives-key; pass that too"),
        (["--hn-negatives-key", "neg", "--siglip"], "the sigmoid loss (--siglip) takes shared negatives only"),
    ],
)
def test_own_negatives_layout_needs_the_column_and_the_softmax_loss(tmp_path, started, capsys, extra, words):
    path = tmp_path / "train.csv"
    path.write_text("filepath\ttitle\tneg\n/x.png\ta caption\tno caption\n")
    line = _error(capsys, [*ARGS, "--train-data", str(path), "--hn-negatives-layout", "own", *extra])
    assert "argument --hn-negatives-layout: " in line and words in line, line
    line = _error(capsys, [*ARGS, "--train-data", str(path), "--hn-negatives-layout", "rows"])
    assert "argument --hn-negatives-layout: invalid choice: 'rows'" in line and "own" in line, line
    assert not started


# ------------------------------------------------------------------ the columns' per-epoch counts


def test_each_epoch_logs_its_negatives_and_groups(caplog):
    counts = train_negatives.EpochCounts()
    batches = [  # (has_negative, group ids): empty group cells have ids < 0, each its own
        (torch.tensor([True, False, True, True]), torch.tensor([3, 3, -2, 5])),
        (torch.tensor([False, False, True, True]), torch.tensor([1, -5, -6, 1])),
    ]

    def train_one_epoch(model, data, loss, epoch, *rest):
        for has_negative, ids in batches:
            counts.add(has_negative, ids)
        return "done"

    wrapped = train_negatives.counting_epoch(train_one_epoch, counts, groups=True)
    with caplog.at_level(logging.INFO):
        assert wrapped(None, None, None, 0, None) == "done"
        batches.pop()
        wrapped(None, None, None, 1, None)  # a new epoch counts from 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HN-CLIP epoch")]
    assert lines == [
        "HN-CLIP epoch 0 (rank 0): 8 pairs, 5 hard negatives, 5 pairs with a group id, 4 of them with "
        "another pair of their group in the batch",
        "HN-CLIP epoch 1 (rank 0): 4 pairs, 3 hard negatives, 3 pairs with a group id, 2 of them with "
        "another pair of their group in the batch",
    ]
