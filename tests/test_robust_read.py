"""Issue 33, item 1: every reader of a directory pisft wrote checks it against its MANIFEST.json
before using it, and stops naming the file, the stage that wrote it and the command that
rebuilds it. Real bytes are damaged in real files (same size included); the verdict cache is
exercised the way files change (a write, then mtime put back)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from data_fixtures import convert, make_recap

from pisft import integrity
from pisft import io as io_mod
from pisft.bench.closed_loop_bench import write_tiny_model
from pisft.data import dataset as dataset_mod
from pisft.data.convert import Options, convert_recap
from pisft.data.prompts import LabelledPrompts, PromptConditioning
from pisft.policy.predictor import ChunkPredictor
from pisft.integrity import IntegrityError
from pisft.model.policy import load_policy
from pisft.recap import value_model
from pisft.policy.libero import LiberoPolicy

ROOT = Path(__file__).resolve().parents[1]
ZEROS = 64 * 1024


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(integrity.CACHE_ENV, str(tmp_path / "verify-cache"))


def as_stage_output(folder: Path, rule: str, command: str) -> Path:
    """Finish `folder` as a stage finishes its output: pisft_config.json, then the manifest."""
    (folder / "pisft_config.json").write_text("{}\n")
    with integrity.writing_as(rule, command):
        io_mod.write_manifest(folder)
    return folder


@pytest.fixture(scope="module")
def exported_source(tmp_path_factory) -> Path:
    model = write_tiny_model(tmp_path_factory.mktemp("export") / "model")
    return as_stage_output(model, "train_8card", "python -m pisft launch train_8card")


@pytest.fixture
def policy_dir(exported_source, tmp_path) -> Path:
    return Path(shutil.copytree(exported_source, tmp_path / "results" / "train" / "model"))


def zero_middle(path: Path, n: int = ZEROS) -> None:
    """A partial copy or a bad sector: n zero bytes over the middle, the size unchanged."""
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(max(0, size // 2 - n // 2))
        fh.write(b"\0" * min(n, size))
    assert path.stat().st_size == size


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "64 KiB of zeros in the weights": (lambda m: zero_middle(m / "model.safetensors"),
                                       "model.safetensors: sha256 differs"),
    "one byte of the weights flipped": (lambda m: flip_byte(m / "model.safetensors"),
                                        "model.safetensors: sha256 differs"),
    "the weights truncated": (lambda m: os.truncate(m / "model.safetensors", 4096), "model.safetensors: 4096 bytes"),
    "a tokenizer file deleted": (lambda m: next(p for p in sorted((m / "tokenizer").iterdir()) if p.is_file()).unlink(),
                                 "listed in MANIFEST.json but missing"),
    "the stats edited in place": (lambda m: flip_byte(m / "normalization_stats.safetensors", 40),
                                  "normalization_stats.safetensors: sha256 differs"),
    "a stray file added": (lambda m: (m / "model-extra.safetensors").write_bytes(b"x"), "present but not listed"),
    "the manifest deleted": (lambda m: (m / "MANIFEST.json").unlink(), "MANIFEST.json is missing"),
    "the manifest garbled": (lambda m: (m / "MANIFEST.json").write_text("{"), "MANIFEST.json is unreadable"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_policy_is_refused_by_every_loader(policy_dir, case):
    load_policy(policy_dir)  # intact: loads
    damage, expected = DAMAGE[case]
    damage(policy_dir)
    loaders = {
        "load_policy (train_8card's init, fetch_base, evaluate)": lambda: load_policy(policy_dir),
        "ChunkPredictor.load (evaluate, closed_loop, collect_rollouts)": lambda: ChunkPredictor.load(policy_dir),
        "LiberoPolicy.from_model_dir (serve, closed_loop)": lambda: LiberoPolicy.from_model_dir(policy_dir,
                                                                                                device="cpu"),
    }
    for name, load in loaders.items():
        with pytest.raises(IntegrityError) as err:
            load()
        msg = str(err.value)
        assert expected in msg, (name, msg)
        assert "\n" not in msg and "train_8card" in msg and "--forcerun train_8card" in msg, (name, msg)


def test_a_plain_model_folder_without_manifest_is_loaded_as_before(tmp_path):
    """A folder that is not a stage's output (no pisft_config.json, e.g. a LeRobot checkpoint
    being fetched) has nothing to be checked against."""
    model = write_tiny_model(tmp_path / "plain")
    load_policy(model)
    (model / "pisft_config.json").write_text("{}\n")  # a stage's output without its manifest: refused
    with pytest.raises(IntegrityError, match="MANIFEST.json is missing"):
        load_policy(model)


class HashCount:
    def __init__(self, monkeypatch):
        self.files: list[str] = []
        real = io_mod.sha256_file

        def counting(path, *args, **kwargs):
            self.files.append(Path(path).name)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(io_mod, "sha256_file", counting)


def test_a_file_is_hashed_once_per_identity_and_any_change_is_seen(policy_dir, monkeypatch):
    count = HashCount(monkeypatch)
    integrity.verify_read(policy_dir, what="t")
    first = len(count.files)
    assert "model.safetensors" in count.files and first == len(json.loads(
        (policy_dir / "MANIFEST.json").read_text())["files"])
    integrity.verify_read(policy_dir, what="t")
    assert len(count.files) == first  # the verdicts are reused: nothing hashed again
    # Same-size damage with the modification time put back (a copy tool preserving mtime):
    # ctime still moved, so the file is hashed again and the damage found.
    weights = policy_dir / "model.safetensors"
    st = weights.stat()
    zero_middle(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(IntegrityError, match="model.safetensors: sha256 differs"):
        integrity.verify_read(policy_dir, what="t")
    assert count.files[first:] == ["model.safetensors"]  # only the changed file was hashed


def test_the_cache_can_be_turned_off_and_a_broken_cache_only_costs_time(policy_dir, monkeypatch, tmp_path):
    count = HashCount(monkeypatch)
    monkeypatch.setenv(integrity.CACHE_ENV, "off")
    integrity.verify_read(policy_dir, what="t")
    integrity.verify_read(policy_dir, what="t")
    n = len(json.loads((policy_dir / "MANIFEST.json").read_text())["files"])
    assert len(count.files) == 2 * n
    cache = tmp_path / "garbage-cache"
    monkeypatch.setenv(integrity.CACHE_ENV, str(cache))
    integrity.verify_read(policy_dir, what="t")
    for entry in cache.iterdir():
        entry.write_text("not json")
    integrity.verify_read(policy_dir, what="t")  # unreadable entry: hashed again, still passes
    assert len(count.files) == 4 * n
    flip_byte(policy_dir / "config.json", 5)
    with pytest.raises(IntegrityError, match="config.json: sha256 differs"):
        integrity.verify_read(policy_dir, what="t")


def test_a_manifest_rewritten_for_other_files_does_not_reuse_old_verdicts(policy_dir, monkeypatch):
    integrity.verify_read(policy_dir, what="t")
    count = HashCount(monkeypatch)
    manifest = json.loads((policy_dir / "MANIFEST.json").read_text())
    manifest["files"]["model.safetensors"]["sha256"] = "0" * 64  # same size, another content promised
    (policy_dir / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="model.safetensors: sha256 differs"):
        integrity.verify_read(policy_dir, what="t")
    assert "model.safetensors" in count.files


# ------------------------------------------------------------------------------ the value model
@pytest.fixture
def value_dir(exported_source, tmp_path) -> Path:
    base = Path(shutil.copytree(exported_source, tmp_path / "base_model"))
    policy = load_policy(base, dtype="float32")
    model = value_model.ValueModel(policy, 11)
    out = tmp_path / "recap/iter_1/value/model"
    out.mkdir(parents=True)
    config = value_model.ValueModelConfig(base_model=str(base), preset="tiny", bins=11, return_min=-10.0,
                                          return_max=0.0, base_config_sha256=io_mod.sha256_file(base / "config.json"))
    with integrity.writing_as("train_value_1", "python -m pisft launch train_value --iteration 1"):
        value_model.save(model, out, config)
    return out


@pytest.mark.parametrize("damage", ["zeros", "flip", "config"])
def test_a_damaged_value_model_is_refused(value_dir, damage):
    value_model.load(value_dir)
    if damage == "zeros":
        zero_middle(value_dir / "model.safetensors")
    elif damage == "flip":
        flip_byte(value_dir / "model.safetensors", 100)
    else:
        cfg = json.loads((value_dir / value_model.CONFIG_FILE).read_text())
        cfg["bins"] = 12  # a hand edit: same shape of file, other meaning
        (value_dir / value_model.CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(IntegrityError) as err:
        value_model.load(value_dir)
    msg = str(err.value)
    assert "train_value_1" in msg and "--forcerun train_value_1" in msg
    assert "python -m pisft launch train_value --iteration 1" in msg


# --------------------------------------------------------------------- datasets, rollouts, labels
@pytest.fixture(scope="module")
def converted_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("converted")
    out = root / "dataset"
    with integrity.writing_as("convert_recap", "python -m pisft convert_recap"):
        convert(make_recap(root / "recap"), out)
    return out


@pytest.fixture
def dataset_dir(converted_source, tmp_path) -> Path:
    return Path(shutil.copytree(converted_source, tmp_path / "dataset"))


def _first_data_file(root: Path) -> Path:
    return sorted((root / "data").rglob("*.parquet"))[0]


@pytest.mark.parametrize("damage", ["zeros in a data file", "a flipped byte in the stats", "split.json edited",
                                    "a data file deleted"])
def test_a_damaged_dataset_is_refused_by_its_readers(dataset_dir, damage):
    dataset_mod.load_split(dataset_dir, "train", chunk_size=4)
    if damage == "zeros in a data file":
        zero_middle(_first_data_file(dataset_dir), 4096)
    elif damage == "a flipped byte in the stats":
        flip_byte(dataset_dir / "meta/stats.json", 10)
    elif damage == "split.json edited":
        split = json.loads((dataset_dir / "split.json").read_text())
        split["train"], split["eval"] = split["eval"], split["train"]
        (dataset_dir / "split.json").write_text(json.dumps(split))
    else:
        _first_data_file(dataset_dir).unlink()
    for read in (lambda: dataset_mod.load_split(dataset_dir, "train", chunk_size=4),
                 lambda: dataset_mod.load_stats(dataset_dir)):
        with pytest.raises(IntegrityError, match="convert_recap") as err:
            read()
        assert "--forcerun convert_recap" in str(err.value)


def collected(tmp_path: Path) -> Path:
    """A rollouts folder finished as collect_rollouts finishes it (pisft_config.json, manifest)."""
    return as_stage_output(make_recap(tmp_path / "rollouts", n_tasks=2, per_task=2),
                           "collect_rollouts_1", "python -m pisft collect_rollouts --iteration 1")


@pytest.mark.parametrize("where", ["a data file", "meta/info.json", "another meta file"])
def test_bytes_flipped_in_collected_rollouts_are_refused_by_the_conversion(tmp_path, where):
    rollouts = collected(tmp_path)
    metas = sorted(p for p in (rollouts / "meta").rglob("*") if p.is_file() and p.name != "info.json")
    target = {"a data file": _first_data_file(rollouts), "meta/info.json": rollouts / "meta/info.json",
              "another meta file": metas[0]}[where]
    flip_byte(target, len(target.read_bytes()) // 2)
    out = tmp_path / "results/dataset"
    with pytest.raises(IntegrityError) as err:
        convert_recap(rollouts, out, Options())
    msg = str(err.value)
    assert str(target) in msg and "collect_rollouts_1" in msg and "--forcerun collect_rollouts_1" in msg
    assert not out.exists()


def test_the_users_own_data_has_no_manifest_and_is_converted_as_before(tmp_path):
    src = make_recap(tmp_path / "mine", n_tasks=2, per_task=2)
    assert not (src / "MANIFEST.json").exists()
    convert(src, tmp_path / "dataset")
    assert (tmp_path / "dataset/MANIFEST.json").is_file()  # what pisft writes carries one
    assert io_mod.verify_manifest(tmp_path / "dataset") == []


def test_damaged_advantage_labels_are_refused_before_training_reads_them(tmp_path):
    labels = tmp_path / "recap/iter_1/advantages"
    labels.mkdir(parents=True)
    pd.DataFrame({"episode_index": np.arange(40) // 8, "frame_index": np.arange(40) % 8,
                  "advantage": np.arange(40) % 3 == 0}).to_parquet(labels / "labels.parquet", index=False)
    as_stage_output(labels, "advantages_1", "python -m pisft advantages --iteration 1")
    LabelledPrompts(labels / "labels.parquet", PromptConditioning())
    zero_middle(labels / "labels.parquet", 64)
    with pytest.raises(IntegrityError, match="advantages_1") as err:
        LabelledPrompts(labels / "labels.parquet", PromptConditioning())
    assert "labels.parquet: sha256 differs" in str(err.value)


def test_every_stage_output_that_a_stage_reads_carries_a_manifest(converted_source, exported_source):
    """The writers: the conversion, an export (as train_8card's), the demo, the collection and the
    labels write MANIFEST.json last, naming the rule running."""
    for folder in (converted_source, exported_source):
        manifest = json.loads((folder / "MANIFEST.json").read_text())
        assert manifest["written_by"]["stage"] in ("convert_recap", "train_8card")
        assert io_mod.verify_manifest(folder) == []
    sources = {p: p.read_text() for p in (ROOT / "src/pisft/data/demo.py", ROOT / "src/pisft/recap/collect.py",
                                          ROOT / "src/pisft/recap/advantages.py", ROOT / "src/pisft/train/export.py",
                                          ROOT / "src/pisft/recap/value_model.py", ROOT / "src/pisft/model/fetch.py",
                                          ROOT / "src/pisft/data/convert.py")}
    # each writes through integrity.stage_output (the stages' one writer) or, for a model folder inside
    # its output, write_manifest itself
    writes = ("stage_output(", "write_manifest(")
    assert all(any(w in text for w in writes) for text in sources.values()), [
        p for p, t in sources.items() if not any(w in t for w in writes)]


def test_the_stage_output_writer_adds_the_config_and_a_manifest_naming_the_rule(tmp_path):
    """integrity.stage_output: what the stage wrote, its resolved config and MANIFEST.json, which lists
    both and names the rule and command; an error inside leaves nothing."""
    from pisft import config as config_mod
    from pisft.integrity import stage_output, verify_read, writing_as

    cfg = config_mod.load(ROOT / "config" / "config.yaml", [f"results_dir={tmp_path}"])
    final = tmp_path / "labels"
    with writing_as("advantages_1", "python -m pisft advantages --iteration 1"), stage_output(final, cfg) as out:
        (out / "labels.parquet").write_bytes(b"labels")
    manifest = json.loads((final / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"labels.parquet", "pisft_config.json"}
    assert manifest["written_by"] == {"stage": "advantages_1", "command": "python -m pisft advantages --iteration 1"}
    assert json.loads((final / "pisft_config.json").read_text()) == config_mod.resolved(cfg)
    verify_read(final, what="the test", required=True)
    with pytest.raises(RuntimeError, match="half"), stage_output(tmp_path / "broken", cfg) as out:
        (out / "labels.parquet").write_bytes(b"half")
        raise RuntimeError("half written")
    assert not (tmp_path / "broken").exists() and not [p for p in tmp_path.iterdir() if "broken" in p.name]


def test_serve_refuses_a_damaged_model_before_listening(policy_dir):
    zero_middle(policy_dir / "model.safetensors")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pisft", "serve", "--model", str(policy_dir), "--port", "0",
                          "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "model.safetensors: sha256 differs" in last and "train_8card" in last
    assert "listening" not in out.stderr.lower()


def test_the_tiny_models_verification_cost(exported_source, tmp_path, monkeypatch):
    """The figures the docs quote (cold: every file hashed; warm: the cached verdicts, nothing
    hashed), printed with -s; the verdict is on what was hashed, never on the time."""
    import time

    model = Path(shutil.copytree(exported_source, tmp_path / "m"))
    size = sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
    count = HashCount(monkeypatch)
    t0 = time.perf_counter()
    integrity.verify_read(model, what="t")
    cold = time.perf_counter() - t0
    hashed = len(count.files)
    t0 = time.perf_counter()
    integrity.verify_read(model, what="t")
    warm = time.perf_counter() - t0
    print(f"\ntiny model ({size / 2**20:.1f} MiB, {hashed} files): verify cold {cold * 1e3:.1f} ms, "
          f"warm {warm * 1e3:.2f} ms")
    assert hashed > 0 and len(count.files) == hashed
