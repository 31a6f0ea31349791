"""The version rules of the Ascend environment (the doctor's `versions` and `numpy` checks).

Pure functions over version strings, so they are tested without Ascend hardware. Sources:
- torch-npu <-> PyTorch <-> CANN: Ascend/pytorch `COMPATIBILITY.en.md`, "TorchNPU version mapping
  table": torch-npu 2.11.0, branch v2.11.0-26.1.0, PyTorch 2.11.0, CANN 9.1.0. The torch-npu
  2.11.0.post3 wheel itself requires torch==2.11.0 (its METADATA).
- CANN <-> Ascend HDK (driver): CANN 9.1.0 release notes, "CANN and Ascend HDK Version
  Compatibility": CANN 9.1.X runs on HDK 25.2.X, 25.3.X, 25.5.X, 26.0.RC1/25.7.RC1 and 26.1.0;
  not on 25.0.X.
- numpy: CANN's "Runtime Dependencies" page. CANN 8.5.0: Python < 3.13 -> numpy >= 1.19.2, < 2.0;
  Python >= 3.13 -> numpy > 2.1. CANN 9.1.0: numpy >= 1.19.2. (A numpy CANN refuses shows up as
  `torch.npu.set_device` failing with AclSetCompileopt(ACL_PRECISION_MODE) error code 500001:
  vllm-ascend issue #2210, PR #472.)
- CANN's Python run-time dependencies: the same page of CANN 9.1.0 (decorator >= 4.4.0,
  sympy >= 1.5.1, cffi >= 1.12.3; attrs, cython, pyyaml, pathlib2, protobuf, scipy, requests,
  psutil, absl-py without a version). Huawei's pi0.5 training recipe installs these torch_npu
  run-time dependencies: hicann/cann-recipes-embodied-intelligence,
  manipulation/pi05/train/src/scripts/setup.sh, TORCH_NPU_RUNTIME_DEPS (+ absl-py).
"""

from __future__ import annotations

import importlib.metadata
import re

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# The CANN release the Ascend lock (workflow/envs/ascend-aarch64.lock.txt) is defined for.
CANN_RELEASE = "9.1.0"
TORCH_RELEASE = "2.11.0"
# torch-npu release -> the CANN release it is paired with (COMPATIBILITY.en.md, active versions
# the lock could use; extend it from that table when the lock moves).
SUPPORTED_PAIRS: dict[str, str] = {"2.11.0": "9.1.0"}
# CANN release -> the Ascend HDK (driver) major.minor versions its release notes mark "Y".
SUPPORTED_DRIVERS: dict[str, tuple[str, ...]] = {
    "9.1.0": ("25.2", "25.3", "25.5", "25.7", "26.0", "26.1"),
}
# CANN release -> [(Python from, Python below, numpy specifier)] (CANN "Runtime Dependencies").
NUMPY_RULES: dict[str, list[tuple[tuple[int, int], tuple[int, int], str]]] = {
    "8.5.0": [((3, 0), (3, 13), ">=1.19.2,<2.0"), ((3, 13), (4, 0), ">2.1")],
    "9.1.0": [((3, 0), (4, 0), ">=1.19.2")],
}
CANN_PYTHON_DEPENDENCIES: dict[str, SpecifierSet] = {
    name: SpecifierSet(spec) for name, spec in {
        "decorator": ">=4.4.0", "sympy": ">=1.5.1", "cffi": ">=1.12.3", "attrs": "",
        "cython": "", "pyyaml": "", "pathlib2": "", "protobuf": "", "scipy": "", "requests": "",
        "psutil": "", "absl-py": ""}.items()}
RECIPE_TORCH_NPU_DEPENDENCIES = ("pyyaml", "attrs", "psutil", "decorator", "cloudpickle", "scipy",
                                 "tornado", "ml-dtypes", "absl-py")

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+|rc\d+))?", re.IGNORECASE)


def release(version: str | None) -> str | None:
    """'2.11.0.post3' -> '2.11.0', '9.1.0' -> '9.1.0', '26.0.rc1' -> '26.0.RC1', '8.3.RC1' ->
    '8.3.RC1'; None when the string is not a version."""
    match = _RELEASE.match(version or "")
    if not match:
        return None
    major, minor, third = match.groups()
    return f"{major}.{minor}.{(third or '0').upper()}"


def major_minor(version: str | None) -> str | None:
    rel = release(version)
    return None if rel is None else ".".join(rel.split(".")[:2])


def supported_pair(torch_npu_version: str, cann_version: str | None) -> bool:
    return SUPPORTED_PAIRS.get(release(torch_npu_version) or "") == release(cann_version)


def pair_problems(torch_version: str, torch_npu_version: str | None, cann_version: str | None) -> list[str]:
    """What is wrong with this torch / torch-npu / CANN combination (empty: a supported pair)."""
    problems = []
    if release(torch_version) != TORCH_RELEASE:
        problems.append(f"torch {torch_version}: the lock pins torch {TORCH_RELEASE}; rebuild .venv "
                        "with `make setup DEVICE=npu`")
    if torch_npu_version is None:
        return problems + ["torch_npu is not installed: `make setup DEVICE=npu`"]
    if release(torch_npu_version) != release(torch_version):
        problems.append(f"torch-npu {torch_npu_version} is not built for torch {torch_version} "
                        f"(it requires torch=={release(torch_npu_version)})")
    paired = SUPPORTED_PAIRS.get(release(torch_npu_version) or "")
    if paired is None:
        problems.append(f"torch-npu {torch_npu_version} is not in pisft's supported pairs "
                        f"{SUPPORTED_PAIRS} (torch-npu's COMPATIBILITY.en.md)")
    elif cann_version is None:
        problems.append(f"the CANN version cannot be read; torch-npu {torch_npu_version} needs "
                        f"CANN {paired}: install it and source its set_env.sh")
    elif release(cann_version) != paired:
        problems.append(f"CANN {cann_version} with torch-npu {torch_npu_version}: torch-npu "
                        f"{release(torch_npu_version)} is paired with CANN {paired} only "
                        "(torch-npu's COMPATIBILITY.en.md); install CANN "
                        f"{paired} and source its set_env.sh")
    return problems


def driver_problem(cann_version: str | None, driver_version: str | None) -> str | None:
    """None when CANN's release notes list this driver (Ascend HDK) for the CANN release."""
    allowed = SUPPORTED_DRIVERS.get(release(cann_version) or "")
    if allowed is None:
        return f"no driver table for CANN {cann_version} (pisft knows {sorted(SUPPORTED_DRIVERS)})"
    if major_minor(driver_version) not in allowed:
        return (f"driver (Ascend HDK) {driver_version or 'unknown'} is not listed for CANN "
                f"{release(cann_version)} (its release notes list HDK "
                f"{', '.join(a + '.x' for a in allowed)}); upgrade the NPU driver and firmware")
    return None


def numpy_rule(cann_version: str | None, python: tuple[int, int]) -> SpecifierSet | None:
    """The numpy versions CANN `cann_version` accepts on Python `python`; None: no rule known."""
    for low, high, spec in NUMPY_RULES.get(release(cann_version) or "", []):
        if low <= tuple(python[:2]) < high:
            return SpecifierSet(spec)
    return None


def lerobot_numpy_spec() -> SpecifierSet | None:
    """The numpy range the installed LeRobot declares (0.6.1: >=2.0.0,<2.3.0); None if absent."""
    try:
        requires = importlib.metadata.requires("lerobot") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if canonicalize_name(req.name) == "numpy" and (req.marker is None or req.marker.evaluate()):
            return req.specifier
    return None


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_dependency_problems(requirements: dict[str, SpecifierSet]) -> list[str]:
    """Each package of `requirements` that is missing or outside its specifier."""
    problems = []
    for name, spec in requirements.items():
        have = installed_version(name)
        if have is None:
            problems.append(f"{name} missing")
            continue
        try:
            ok = Version(have) in spec
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append(f"{name} {have} (needs {spec})")
    return problems


def ascend_python_requirements() -> dict[str, SpecifierSet]:
    """CANN's Python run-time dependencies and the recipe's torch_npu ones, together."""
    out = dict(CANN_PYTHON_DEPENDENCIES)
    for name in RECIPE_TORCH_NPU_DEPENDENCIES:
        out.setdefault(name, SpecifierSet())
    return out
