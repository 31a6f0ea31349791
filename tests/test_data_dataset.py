"""pisft.data.dataset: stats, split and LeRobotDataset items for training/evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_fixtures import convert, make_recap

from pisft.data import dataset
from pisft.errors import DataError


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    src = make_recap(tmp / "in", n_tasks=2, per_task=3, length=12)
    convert(src, tmp / "out", eval_fraction=0.34)
    return tmp / "out"


def test_load_stats(converted):
    stats = dataset.load_stats(converted)
    assert stats["observation.state"]["q01"].shape == (8,)
    assert stats["action"]["q99"].shape == (7,)
    assert stats["observation.images.base_0_rgb"]["mean"].shape == (3, 1, 1)
    assert isinstance(stats["action"]["mean"], np.ndarray)
    assert np.all(stats["action"]["q01"] <= stats["action"]["q99"])


def test_split_and_tasks(converted):
    split = dataset.split_episodes(converted)
    assert sorted(split["train"] + split["eval"]) == list(range(6))
    assert len(split["eval"]) == 2
    tasks = dataset.episode_tasks(converted)
    assert len({tasks[i] for i in split["eval"]}) == 2
    assert dataset.fps(converted) == 10


def test_load_split_items(converted):
    chunk = 5
    ds = dataset.load_split(converted, "eval", chunk_size=chunk)
    split = dataset.split_episodes(converted)
    assert len(ds) == 12 * len(split["eval"])
    item = ds[0]
    assert item["observation.images.base_0_rgb"].dtype == torch.float32
    assert item["observation.images.base_0_rgb"].shape == (3, 32, 32)
    assert 0.0 <= float(item["observation.images.left_wrist_0_rgb"].min()) <= 1.0
    assert item["observation.state"].shape == (8,)
    assert item["action"].shape == (chunk, 7) and item["action_is_pad"].shape == (chunk,)
    assert isinstance(item["task"], str)
    assert int(item["episode_index"]) == split["eval"][0]
    # the chunk is the next `chunk` actions of the episode; past its end they are padding
    last = ds[11]
    assert last["action_is_pad"].tolist() == [False] + [True] * (chunk - 1)
    assert torch.equal(ds[3]["action"][1], ds[4]["action"][0])
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["action"].shape == (4, chunk, 7) and len(batch["task"]) == 4


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("chunk", [1, 5, 15])
def test_items_are_lerobots_own_chunked_items(converted, split, chunk):
    """Every item equals, tensor for tensor, the item of LeRobot's own delta_timestamps query
    (what load_split returned before ActionChunks), chunks past the episode's end included."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ours = dataset.load_split(converted, split, chunk_size=chunk)
    theirs = LeRobotDataset(repo_id=dataset.REPO_ID, root=converted,
                            episodes=dataset.split_episodes(converted)[split],
                            delta_timestamps={"action": [k / dataset.fps(converted) for k in range(chunk)]},
                            video_backend="pyav")
    assert len(ours) == len(theirs)
    padded = 0
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        assert a.keys() == b.keys()
        for key in b:
            if isinstance(b[key], torch.Tensor):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (i, key)
            else:
                assert a[key] == b[key], (i, key)
        padded += int(b["action_is_pad"].any())
    assert padded >= min(chunk - 1, 12) * ours.frames.num_episodes  # episode ends were compared


def test_a_chunk_decodes_only_its_own_frame(converted, monkeypatch):
    """LeRobot's chunk query decodes the images of all chunk frames; ours decodes one frame's."""
    from datasets.features import image as hf_image

    decoded = []
    real = hf_image.Image.decode_example
    monkeypatch.setattr(hf_image.Image, "decode_example",
                        lambda self, *a, **k: decoded.append(1) or real(self, *a, **k))
    ds = dataset.load_split(converted, "train", chunk_size=10)
    ds[3]
    assert len(decoded) == 2  # the two cameras of frame 3


def test_frames_of_an_episode_missing_from_the_data_are_named(converted):
    from types import SimpleNamespace

    frames = dataset.load_split(converted, "eval", chunk_size=3).frames
    keep = [i for i in range(len(frames.hf_dataset)) if i != 4]
    frames = SimpleNamespace(hf_dataset=frames.hf_dataset.select(keep), meta=frames.meta,
                             root=frames.root)  # a data file that lost a row the metadata counts
    with pytest.raises(DataError, match=r"episode \d+ lacks frames \[\d+\]"):
        dataset.ActionChunks(frames, 3)


def test_load_split_train_has_the_other_episodes(converted):
    ds = dataset.load_split(converted, "train", chunk_size=2)
    eps = {int(ds[i]["episode_index"]) for i in range(0, len(ds), 12)}
    assert eps == set(dataset.split_episodes(converted)["train"])


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="convert_recap"):
        dataset.load_split(tmp_path, "train", chunk_size=4)
    with pytest.raises(DataError, match="stats.json"):
        dataset.load_stats(tmp_path)
    with pytest.raises(ValueError):
        dataset.load_split(tmp_path, "test", chunk_size=4)
