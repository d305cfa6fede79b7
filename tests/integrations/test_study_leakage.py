"""examples/fine_tune_study.py's held-out guard (default tier, no training): items are reserved by
canonical scene, so a mirrored caption (the objects swapped, the relation reversed: the same
picture) is held out with its original; the leakage check compares canonical scenes read from the
captions; held-out pools are disjoint across seeds; every cell has its own training data; and a
``--quick`` run never writes over a full run's outputs."""

import dataclasses
import random

import pytest

pytest.importorskip("open_clip")
import fine_tune_study as study

import dense_caption_demo as demo


def mirror(scene):
    """The same picture described from the other object: a and b swapped, the relation reversed."""
    return dataclasses.replace(scene, a=scene.b, b=scene.a, relation=demo.OPPOSITE[scene.relation])


def test_a_mirrored_caption_is_the_same_scene():
    import torch

    rng = random.Random(5)
    noise = torch.zeros(3, demo.IMAGE_SIZE, demo.IMAGE_SIZE)
    for _ in range(300):
        scene = demo.sample_scene(rng)
        other = mirror(scene)
        assert demo.caption(other) != demo.caption(scene)  # a string guard sees two captions
        assert torch.equal(demo.render(other, noise), demo.render(scene, noise))  # one picture
        key = study.scene_key(scene)
        assert study.scene_key(other) == key == study.caption_key(demo.caption(other))
        assert study.reserved(study.scene_key(other)) == study.reserved(key)
        # every one-attribute edit (the relation edit moves the objects) is another picture
        for kind in demo.EDITS:
            assert study.scene_key(demo.edit_scene(scene, kind, rng)) != key, kind


def test_caption_key_reads_every_caption():
    rng = random.Random(6)
    for _ in range(500):
        scene = demo.sample_scene(rng)
        assert study.caption_key(demo.caption(scene)) == study.scene_key(scene)
    with pytest.raises(ValueError, match="caption is not a dense caption"):
        study.caption_key("a photo of a cat")
    # 3/8 of the 16 128 canonical scenes are reserved
    share = sum(study.reserved(study.scene_key(demo.sample_scene(rng))) for _ in range(4000)) / 4000
    assert 0.34 < share < 0.41


def test_leakage_check_finds_a_mirrored_held_out_scene():
    train = study.draw_groups(8, study.GROUP_SIZE, 1_000, held_out=False)
    s1 = study.draw_groups(64, 1, 100_000, held_out=False)
    held = study.draw_groups(4, study.GROUP_SIZE, 2_000, held_out=True)
    assert all(map(study.reserved, held["keys"])) and len(set(held["keys"])) == 16
    assert not any(map(study.reserved, train["keys"] + s1["keys"]))
    report = study.leakage_check([s1], [train], [held])
    assert report["held_out_in_training"] == report["held_out_in_stage1"] == 0 and report["held_out_items"] == 16
    # stage 1 trained on the mirror of a held-out scene: a new caption string, the same picture
    twin = mirror(held["scenes"][3])
    leaky = dict(s1, scenes=s1["scenes"] + [twin], captions=s1["captions"] + [demo.caption(twin)])
    assert demo.caption(twin) not in held["captions"]
    with pytest.raises(AssertionError, match="held-out scenes in training") as info:
        study.leakage_check([leaky], [train], [held])
    assert "'held_out_in_stage1': 1, 'held_out_in_training': 1, 'held_out_captions_in_training': 0" in str(info.value)


def test_held_out_pools_are_disjoint_across_seeds():
    first = study.draw_groups(6, study.GROUP_SIZE, 2_000, held_out=True)
    second = study.draw_groups(6, study.GROUP_SIZE, 2_001, held_out=True, taken=frozenset(first["keys"]))
    assert not set(first["keys"]) & set(second["keys"])
    train = study.draw_groups(8, study.GROUP_SIZE, 1_000, held_out=False)
    report = study.leakage_check([], [train], [first, second])
    assert report["held_out_pools_sharing_scenes"] == 0 and report["held_out_scenes"] == 48
    # a pool holding the mirror of another pool's scene is caught
    twin = mirror(first["scenes"][0])
    again = dict(second, scenes=second["scenes"] + [twin], captions=second["captions"] + [demo.caption(twin)])
    with pytest.raises(AssertionError, match="in two held-out pools"):
        study.leakage_check([], [train], [first, again])


def test_every_cell_has_its_own_training_data():
    cells = [(i, s) for i in range(3) for s in range(3)]
    assert len({study.cell_seed("train", i, s) for i, s in cells}) == len(cells)
    assert study.cell_seed("order", 0, 1) != study.cell_seed("train", 0, 1) != study.cell_seed("train", 1, 0)
    pools = [study.draw_groups(2, study.GROUP_SIZE, study.cell_seed("train", i, s), held_out=False) for i, s in cells]
    assert len({tuple(p["captions"]) for p in pools}) == len(cells)


def test_quick_has_its_own_out_and_cache():
    full, quick = study.parse_args([]), study.parse_args(["--quick"])
    assert quick.out != full.out and quick.cache != full.cache
    assert study.parse_args(["--quick", "--out", full.out]).out == full.out  # asked for by name only
