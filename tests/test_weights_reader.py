"""pisft.model.weights reads each tensor of a safetensors file with pread into a tensor of its own
(never a mapping of the file): every dtype and shape as safetensors itself reads it, a cut file
refused by name, and no mapping of the file in the process while it is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pisft.errors import ModelLoadError
from pisft.model import weights

TENSORS = {
    "bf16": torch.randn(3, 5).to(torch.bfloat16),
    "f32": torch.randn(7),
    "f16": torch.randn(2, 2).to(torch.float16),
    "i64": torch.arange(6).reshape(2, 3),
    "i32": torch.arange(4, dtype=torch.int32),
    "u8": torch.arange(9, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


def _mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


def test_every_dtype_and_shape_reads_as_safetensors_reads_it_without_mapping_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path))
    copy = tmp_path / "copy.safetensors"  # safetensors' own reader may keep its file mapped
    copy.write_bytes(path.read_bytes())
    expected = load_file(str(copy))
    _, where = weights.tensor_locations(path)
    with weights._tensor_reader(where) as get:
        for name, tensor in expected.items():
            got = get(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got, tensor), name
            assert not _mapped(path)  # read into the tensor, not through a mapping of the file


def test_load_strict_casts_into_the_parameters_dtype(tmp_path):
    module = torch.nn.Linear(4, 3)
    state = {k: v.to(torch.bfloat16) for k, v in torch.nn.Linear(4, 3).state_dict().items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    weights.load_strict(module, tmp_path / "w.safetensors")
    assert module.weight.dtype == torch.float32
    assert torch.equal(module.weight.detach(), state["weight"].float())


def test_a_cut_file_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64), "b": torch.randn(1000)}, str(path))
    _, where = weights.tensor_locations(path)
    data = path.read_bytes()
    path.write_bytes(data[:-1000])  # the last tensor's bytes cut off, as an interrupted copy leaves it
    with pytest.raises(ModelLoadError, match=r"ends inside b .*truncated"), weights._tensor_reader(where) as get:
        get("a")
        get("b")
