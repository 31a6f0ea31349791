"""Issue 22, item 4: the paths a RECAP dataset names stay inside its folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from data_fixtures import convert, make_recap

from pisft.errors import DataError


def set_info(root: Path, **keys) -> None:
    info_path = root / "meta/info.json"
    info = json.loads(info_path.read_text())
    info.update(keys)
    info_path.write_text(json.dumps(info))


def fails(src: Path, out: Path, *patterns: str, **opts) -> None:
    with pytest.raises(DataError) as err:
        convert(src, out, **opts)
    for p in patterns:
        assert p in str(err.value), f"{p!r} not in: {err.value}"
    assert not out.exists()


@pytest.mark.parametrize("version", ["v2.1", "v3.0"])
def test_a_data_path_template_that_climbs_out_is_refused_though_the_files_exist_there(tmp_path, version):
    src = make_recap(tmp_path / "in" / "recap", version=version, n_tasks=1, per_task=2, length=6, size=16)
    info = json.loads((src / "meta/info.json").read_text())
    template = info["data_path"]
    # the same files, outside the dataset folder: the old reader read them and converted "fine"
    shutil.copytree(src / "data", tmp_path / "in" / "elsewhere" / "data")
    set_info(src, data_path="../elsewhere/" + template)
    fails(src, tmp_path / "out", "meta/info.json", "data_path (meta/info.json's template, filled) '../elsewhere/",
          "leaves the dataset folder", "through ..")
    set_info(src, data_path=str(tmp_path / "in" / "elsewhere" / template))
    fails(src, tmp_path / "out", "data_path (meta/info.json's template, filled) '/", "an absolute path")


def test_a_video_path_that_leaves_the_folder_is_refused(tmp_path):
    src = make_recap(tmp_path / "in", n_tasks=1, per_task=2, length=6, size=16, video=True)
    info = json.loads((src / "meta/info.json").read_text())
    set_info(src, video_path="videos/../../" + info["video_path"])
    fails(src, tmp_path / "out", "video_path (meta/info.json's template, filled) 'videos/../../",
          "leaves the dataset folder")


def test_an_advantage_side_file_outside_the_folder_is_refused(tmp_path):
    src = make_recap(tmp_path / "in" / "recap", n_tasks=1, per_task=2, length=6, size=16)
    shutil.copy(src / "meta/advantages_demo.parquet", tmp_path / "in" / "labels.parquet")
    fails(src, tmp_path / "out", "'meta/../../labels.parquet' leaves the dataset folder",
          advantage_tag="../../labels.parquet")


def test_paths_inside_the_folder_and_links_in_it_are_read(tmp_path):
    src = make_recap(tmp_path / "in" / "recap", n_tasks=1, per_task=2, length=6, size=16)
    info = json.loads((src / "meta/info.json").read_text())
    set_info(src, data_path="./data/../" + info["data_path"])  # stays inside: fine
    assert convert(src, tmp_path / "out")["out"]["episodes"] == 2
    # a folder that is a symbolic link (as a DVC checkout leaves them) is followed as usual
    shutil.move(src / "data", tmp_path / "in" / "cache")
    (src / "data").symlink_to(tmp_path / "in" / "cache")
    assert convert(src, tmp_path / "out2")["out"]["episodes"] == 2
