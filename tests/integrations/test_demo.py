"""examples/dense_caption_demo.py end to end on a tiny configuration: outputs exist and are sane,
and two runs with the same seed give identical numbers."""

import csv
import math

import pytest

pytest.importorskip("open_clip")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
import dense_caption_demo as demo

TINY = [
    "--train-groups",
    "6",
    "--eval-groups",
    "3",
    "--epochs",
    "1",
    "--batch-groups",
    "3",
    "--probe-batches",
    "1",
    "--no-progress",
]


def test_dataset_groups_differ_in_one_attribute():
    images, captions = demo.make_groups(5, 4, seed=3)
    assert images.shape == (20, 3, demo.IMAGE_SIZE, demo.IMAGE_SIZE)
    for g in range(5):
        group = captions[4 * g : 4 * g + 4]
        base = group[0].split()
        for other in group[1:]:
            words = other.split()
            assert len(words) == len(base) and other != group[0]
            # one attribute appears twice in a caption, a relation flip changes the relation and the side
            assert 1 <= sum(a != b for a, b in zip(base, words)) <= 2
        assert not any((images[4 * g] - images[4 * g + j]).abs().max() == 0 for j in range(1, 4))
    tokens, vocab = demo.tokenize(captions)
    assert tokens.shape == (20, demo.CONTEXT_LENGTH) and tokens.max() == vocab - 1
    assert demo.make_groups(5, 4, seed=3)[1] == captions  # deterministic


def test_tiny_run_outputs_and_determinism(tmp_path):
    first = demo.main(TINY + ["--out", str(tmp_path / "a")])
    second = demo.main(TINY + ["--out", str(tmp_path / "b")])
    out = tmp_path / "a"
    for name in ("history.csv", "steps.csv", "summary.csv", "table.md", "curves.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "history.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["loss"], r["epoch"]) for r in rows] == [
        ("ClipLoss", "0"),
        ("ClipLoss", "1"),
        ("HN-CLIP", "0"),
        ("HN-CLIP", "1"),
    ]
    with open(out / "steps.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 2 * 2  # 6 groups / 3 per batch, two runs
    for row in first["history"]:
        for key in (
            "i2t_R@1",
            "i2t_R@5",
            "t2i_R@1",
            "t2i_R@5",
            "i2t_group_acc",
            "t2i_group_acc",
            "saturated_rows",
            "lost_positive_rows",
        ):
            assert 0.0 <= row[key] <= 1.0, key
        assert row["i2t_R@1"] <= row["i2t_R@5"] and row["t2i_R@1"] <= row["t2i_R@5"]
        assert row["tau"] > 0 and math.isfinite(row["exact_loss"])
    # the same initial model for both losses: identical epoch-0 retrieval
    init = [r for r in first["history"] if r["epoch"] == 0]
    assert init[0]["i2t_R@1"] == init[1]["i2t_R@1"] and init[0]["tau"] == init[1]["tau"]
    assert all(math.isfinite(s["train_loss"]) for s in first["steps"])
    # deterministic: every number except wall-clock times repeats exactly
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(first["history"]) == strip(second["history"])
    assert first["steps"] == second["steps"]
    assert "| HN-CLIP |" in first["table"] and "| ClipLoss |" in first["table"]
