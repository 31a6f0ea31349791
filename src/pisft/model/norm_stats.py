"""Normalisation statistics carried by a model directory, and openpi's `norm_stats.json` import.

A model directory holds the stats it was trained with in `normalization_stats.safetensors`
(tensor names `<feature>/<stat>`, e.g. `observation.state/q01`; float32), so an exported model
can be evaluated or served without the dataset it was trained on.

openpi and RLinf keep one `norm_stats.json` per asset id (the dataset's repo id, e.g.
`physical-intelligence/libero`): openpi under `assets/<asset_id>/` (its checkpoints' assets,
copied by examples/convert_jax_model_to_pytorch.py), RLinf directly under the model directory,
`<model_path>/<asset_id>/norm_stats.json` (RLinf rlinf/models/embodiment/openpi/__init__.py reads
it with openpi's `load_norm_stats(checkpoint_dir, asset_id)`). `find_norm_stats` finds both.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from pisft.errors import ModelLoadError
from pisft.io import follow_umask
from pisft.model.weights import read_json

STATS_FILE = "normalization_stats.safetensors"
# pi0.5 normalises state and action by quantiles: these two stats are required for each.
REQUIRED = {"observation.state": ("q01", "q99"), "action": ("q01", "q99")}
# openpi's names -> LeRobot's (openpi's LIBERO config: `state` and `actions`).
OPENPI_KEYS = {"state": "observation.state", "actions": "action"}

Stats = dict[str, dict[str, np.ndarray]]


def check_stats(stats: Stats, source: str) -> None:
    problems = []
    for feature, names in REQUIRED.items():
        if feature not in stats:
            problems.append(f"no stats for '{feature}'")
            continue
        for name in names:
            if name not in stats[feature]:
                problems.append(f"'{feature}' has no '{name}'")
            elif not np.all(np.isfinite(np.asarray(stats[feature][name], dtype=np.float64))):
                problems.append(f"'{feature}/{name}' is not finite")
    if problems:
        raise ModelLoadError(f"{source}: unusable normalisation stats: {'; '.join(problems)} "
                             f"(pi0.5 normalises state and action by their q01/q99 quantiles)")


def save_stats(stats: Stats, path: str | Path) -> None:
    from safetensors.numpy import save_file

    tensors = {}
    for feature, by_name in stats.items():
        for name, value in by_name.items():
            arr = np.asarray(value)
            if arr.dtype.kind not in "fiub":
                continue  # non-numeric entries (none in LeRobot stats) are not normalisation stats
            tensors[f"{feature}/{name}"] = np.ascontiguousarray(arr, dtype=np.float32)
    save_file(tensors, str(path), metadata={"format": "pisft-normalization-stats"})
    follow_umask(path)  # safetensors writes 0600: the next user's serve could not read the model


def load_stats(path: str | Path) -> Stats:
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no normalisation stats; pass the dataset's stats explicitly")
    stats: Stats = {}
    for key, value in load_file(str(path)).items():
        feature, _, name = key.rpartition("/")
        stats.setdefault(feature, {})[name] = value
    return stats


def import_openpi_norm_stats(path: str | Path, *, state_dim: int = 8, action_dim: int = 7) -> Stats:
    """Read openpi's `norm_stats.json` ({"norm_stats": {"state"|"actions": {mean, std, q01, q99}}}).

    openpi may store stats padded to the model's 32 dims; trailing dims beyond `state_dim` /
    `action_dim` are dropped only when they are padding (q01 == q99), else it is an error.
    """
    path = Path(path)
    raw = read_json(path, missing="openpi norm_stats.json not found")
    body = raw.get("norm_stats", raw) if isinstance(raw, dict) else None
    if not isinstance(body, dict):
        raise ModelLoadError(f"{path}: expected an object with 'norm_stats' (openpi format)")
    dims = {"state": state_dim, "actions": action_dim}
    stats: Stats = {}
    for openpi_key, feature in OPENPI_KEYS.items():
        if openpi_key not in body:
            raise ModelLoadError(f"{path}: no '{openpi_key}' entry in norm_stats "
                                 f"(found: {', '.join(sorted(body)) or 'nothing'})")
        entry = body[openpi_key]
        out: dict[str, np.ndarray] = {}
        for name in ("mean", "std", "q01", "q99"):
            if entry.get(name) is None:
                if name in ("q01", "q99"):
                    raise ModelLoadError(f"{path}: '{openpi_key}' has no '{name}' (pi0.5 needs quantiles)")
                continue
            out[name] = np.asarray(entry[name], dtype=np.float32)
        want = dims[openpi_key]
        have = out["q01"].shape[-1]
        if have < want:
            raise ModelLoadError(f"{path}: '{openpi_key}' stats have {have} dims, the data has {want}")
        if have > want:
            pad_q01, pad_q99 = out["q01"][want:], out["q99"][want:]
            if not np.array_equal(pad_q01, pad_q99):
                raise ModelLoadError(
                    f"{path}: '{openpi_key}' stats have {have} dims and dims {want}..{have - 1} are not "
                    f"padding (q01 != q99); these stats belong to data with another layout"
                )
            out = {k: v[:want] for k, v in out.items()}
        stats[feature] = out
    check_stats(stats, str(path))
    return stats


def stats_equal(a: Stats, b: Stats) -> bool:
    if a.keys() != b.keys():
        return False
    for feature in a:
        if a[feature].keys() != b[feature].keys():
            return False
        for name in a[feature]:
            x, y = np.asarray(a[feature][name]), np.asarray(b[feature][name])
            if x.shape != y.shape or not np.allclose(x, y, rtol=0, atol=0, equal_nan=True):
                return False
    return True


@dataclasses.dataclass(frozen=True)
class StatsFile:
    asset_id: str
    path: Path
    form: str  # "openpi" (assets/<asset_id>/norm_stats.json) | "rlinf" (<asset_id>/norm_stats.json)

    def describe(self, directory: Path) -> str:
        return f"{self.asset_id} ({self.path.relative_to(directory)})"


def find_norm_stats(directory: str | Path) -> list[StatsFile]:
    """Every openpi `assets/<asset_id>/norm_stats.json` and RLinf `<asset_id>/norm_stats.json`
    below `directory` (asset ids may have several levels: `physical-intelligence/libero`)."""
    directory = Path(directory)
    found = []
    for path in sorted(directory.rglob("norm_stats.json")):
        parts = path.parent.relative_to(directory).parts
        if parts[:1] == ("assets",) and len(parts) > 1:
            found.append(StatsFile("/".join(parts[1:]), path, "openpi"))
        else:
            found.append(StatsFile("/".join(parts) or ".", path, "rlinf"))
    return found
