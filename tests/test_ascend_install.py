"""The Ascend install: `make setup DEVICE=npu` builds .venv from workflow/envs/ascend-aarch64.lock.txt.

Fast tests check the lock against the CPU/CUDA lock, the Ascend environment defaults and the
docs/ascend.md, and the Makefile's choice of lock (in a scratch copy with a stand-in Python, so nothing is
installed). The integration tests resolve the
lock for Linux aarch64 / CPython 3.12 with pip's dry run against the live package indexes:
metadata only, nothing is installed and torch_npu is never imported; they run only with
PISFT_LIVE_INDEX=1 (the `live_index` mark, docs/development.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CPU_LOCK = ROOT / "workflow/envs/cpu-cuda.lock.txt"
NPU_LOCK = ROOT / "workflow/envs/ascend-aarch64.lock.txt"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The builds taken from PyTorch's CPU index instead of PyPI (PyPI's aarch64 torch 2.11 is a CUDA
# build whose metadata requires cuda-toolkit, nvidia-* and triton on Linux).
FROM_TORCH_INDEX = {"torch": "2.11.0+cpu", "torchvision": "0.26.0+cpu"}
# Pins of the lock that PyPI serves only as a source distribution; pure Python (checked below).
SDIST_ONLY = ("antlr4-python3-runtime==4.9.3", "connection_pool==0.0.3")
# A host with glibc 2.28 (what torch 2.11's manylinux_2_28 wheels need) accepts these tags.
AARCH64_PLATFORMS = ["manylinux2014_aarch64"] + [f"manylinux_2_{m}_aarch64" for m in range(17, 29)]


# Pins of the Ascend lock that the CPU/CUDA lock lacks: Python packages CANN 9.1.0 and torch-npu
# load at run time (CANN 9.1.0 "Runtime Dependencies": decorator, cython, pathlib2; Huawei's pi0.5
# recipe, TORCH_NPU_RUNTIME_DEPS: tornado, ml-dtypes). See the lock's header. protobuf, also a CANN
# run-time dependency, is in both locks (the SentencePiece tokenizer conversion needs it).
ASCEND_RUNTIME_EXTRAS = {"cython": "3.3.1", "decorator": "5.3.1", "ml-dtypes": "0.7.0",
                         "pathlib2": "2.3.7.post1", "tornado": "6.6.1"}


def _cuda_only(name: str) -> bool:
    name = canonicalize_name(name)
    return name.startswith(("nvidia-", "cuda-")) or name == "triton"


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "-")):
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


# ---------------------------------------------------------------- the lock itself (fast)

def test_npu_lock_is_the_cpu_lock_without_cuda_plus_torch_npu_and_cann_runtime():
    cpu, npu = pins(CPU_LOCK), pins(NPU_LOCK)
    assert not [n for n in npu if _cuda_only(n)], "CUDA-only packages in the Ascend lock"
    assert npu.pop("torch-npu").startswith("2.11."), "torch-npu must match torch 2.11"
    assert not set(ASCEND_RUNTIME_EXTRAS) & set(cpu), "an extra is in the CPU lock: not an extra"
    for name, version in ASCEND_RUNTIME_EXTRAS.items():
        assert npu.pop(name) == version, name
    for name, version in FROM_TORCH_INDEX.items():
        assert npu.pop(name) == version
        assert cpu.pop(name) == version.split("+")[0]
    expected = {n: v for n, v in cpu.items() if not _cuda_only(n)}
    assert npu == expected, "pins that differ from cpu-cuda.lock.txt"
    lines = NPU_LOCK.read_text().splitlines()
    assert f"--extra-index-url {TORCH_CPU_INDEX}" in lines
    assert any(line.startswith("# Regenerate") for line in lines)  # `make lock` keeps the header up to it


def test_npu_lock_satisfies_cann_and_the_recipe():
    """CANN 9.1.0's Python run-time dependencies and the recipe's torch_npu ones are all pinned,
    numpy satisfies both CANN's rule for Python 3.12 and LeRobot's range, and the header names
    the CANN release the doctor checks against."""
    from pisft.doctor import versions

    npu = pins(NPU_LOCK)
    missing = sorted(n for n in versions.CANN_PYTHON_DEPENDENCIES if canonicalize_name(n) not in npu)
    assert not missing, f"CANN's run-time Python dependencies missing from the Ascend lock: {missing}"
    for name, spec in versions.CANN_PYTHON_DEPENDENCIES.items():
        assert Version(npu[canonicalize_name(name)]) in spec, (name, npu[canonicalize_name(name)], spec)
    numpy = npu["numpy"]
    assert versions.numpy_rule(versions.CANN_RELEASE, (3, 12)).contains(numpy)
    assert not versions.numpy_rule("8.5.0", (3, 12)).contains(numpy)  # why not CANN 8.5.0
    header = NPU_LOCK.read_text().split("# Regenerate")[0]
    assert f"CANN {versions.CANN_RELEASE}" in header.splitlines()[0]
    assert "8.5.0" not in header.splitlines()[0]
    assert versions.supported_pair(npu["torch-npu"], versions.CANN_RELEASE)


def test_npu_lock_pins_every_project_dependency():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {canonicalize_name(Requirement(d).name) for d in deps}
    assert names <= set(pins(NPU_LOCK)), sorted(names - set(pins(NPU_LOCK)))


# ------------------------------------------------------- environment and docs/ascend.md (fast)

def test_huawei_pi05_recipe_defaults_are_set_and_the_user_wins():
    from pisft import device

    assert device.ASCEND_ENV_DEFAULTS["ACLNN_CACHE_LIMIT"] == "100000"
    assert device.ASCEND_ENV_DEFAULTS["HOST_CACHE_CAPACITY"] == "20"
    env = device.process_env("npu", {"HOST_CACHE_CAPACITY": "5"})
    assert env["HOST_CACHE_CAPACITY"] == "5" and env["ACLNN_CACHE_LIMIT"] == "100000"
    assert "ACLNN_CACHE_LIMIT" not in device.process_env("cpu", {})


def test_deterministic_env_per_device_kind():
    from pisft import device

    assert device.deterministic_env("npu") == {"HCCL_DETERMINISTIC": "true"}
    assert device.deterministic_env("cuda") == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert device.deterministic_env("cpu") == {}
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    try:
        env = {"HCCL_DETERMINISTIC": "strict"}
        assert device.enable_determinism("npu", env) == {}  # the user's value wins
        assert env == {"HCCL_DETERMINISTIC": "strict"}
        env = {}
        assert device.enable_determinism("cuda", env) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_ascend_page_states_cann_the_lock_and_every_environment_default():
    from pisft import device

    text = (ROOT / "README.md").read_text() + (ROOT / "docs/ascend.md").read_text()
    section = (ROOT / "docs/ascend.md").read_text()
    assert section.startswith("# Running on an Ascend 910B node")
    assert "CANN 9.1.0" in section and "make setup DEVICE=npu" in section
    assert "built for CANN 8.5.0" not in text
    assert "ascend-aarch64.lock.txt" in section
    for key, value in device.ASCEND_ENV_DEFAULTS.items():
        assert f"| `{key}` | `{value}` |" in section, f"docs/ascend.md misses {key}={value}"
    for key, value in device.row("npu").deterministic_env.items():
        assert f"{key}={value}" in section
    assert "8.x" not in section
    first_paragraph = section.split("\n\n")[1]
    assert "python -m pisft doctor" in first_paragraph  # the section starts with the preflight
    from pisft.doctor import CHECK_NAMES

    for name in CHECK_NAMES:
        assert f"| `{name}` |" in section, f"docs/ascend.md's preflight table misses {name}"


# ---------------------------------------------------------------- the Makefile (fast)

def make(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("DEVICE", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ASCEND_HOME_PATH",
                         "ASCEND_TOOLKIT_HOME")}  # as typed at a shell, also under `make test`
    return subprocess.run(["make", *args], cwd=cwd, capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=120)


@pytest.mark.parametrize("device, lock", [("npu", NPU_LOCK), ("cpu", CPU_LOCK), ("cuda", CPU_LOCK)])
def test_make_setup_picks_the_lock_by_device(device, lock):
    out = make("-n", "setup", f"DEVICE={device}")  # -n: print the recipe, run nothing
    assert out.returncode == 0, out.stderr
    other = ({NPU_LOCK, CPU_LOCK} - {lock}).pop()
    assert f"pip install --quiet -r {lock.relative_to(ROOT)}" in out.stdout
    assert f"-r {other.relative_to(ROOT)}" not in out.stdout


def test_unknown_device_is_a_one_line_error():
    out = make("-s", "setup", "DEVICE=tpu")
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "DEVICE=tpu" in lines[0] and "cpu, cuda, npu" in lines[0]


STUB_PYTHON = """#!/bin/bash
# Stand-in interpreter: logs what setup asks of it; `-m venv DIR` makes DIR/bin/python a copy.
echo "python $*" >> "$PISFT_TEST_LOG"
if [ "$*" = "-m pisft doctor" ] && [ -n "${PISFT_TEST_DOCTOR_FAILS:-}" ]; then exit 1; fi
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi
exit 0
"""


@pytest.fixture
def scratch(tmp_path: Path) -> tuple[Path, Path]:
    """The Makefile, pyproject.toml and both locks in a scratch directory with a stand-in Python."""
    work = tmp_path / "proj"
    (work / "workflow/envs").mkdir(parents=True)
    (work / "scripts").mkdir()
    for rel in ("Makefile", "pyproject.toml", "workflow/envs/cpu-cuda.lock.txt",
                "workflow/envs/ascend-aarch64.lock.txt"):
        shutil.copy(ROOT / rel, work / rel)
    stub = tmp_path / "python3.12"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    finder = work / "scripts/find-python312.sh"
    finder.write_text(f"#!/bin/bash\necho {stub}\n")
    finder.chmod(0o755)
    return work, tmp_path / "calls.log"


def _setup(work: Path, log: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    if log.exists():
        log.unlink()
    return make("-s", "setup", *args, cwd=work, env={"PISFT_TEST_LOG": str(log), **env})


def _calls(log: Path) -> str:
    return log.read_text() if log.exists() else ""


def test_switching_device_rebuilds_the_venv_and_the_stamp_remembers_the_lock(scratch):
    work, log = scratch
    out = _setup(work, log)  # fresh: no .venv, no DEVICE -> the CPU/CUDA lock
    assert out.returncode == 0, out.stderr
    assert "-r workflow/envs/cpu-cuda.lock.txt" in _calls(log)
    stamp = (work / ".venv/.pisft-setup").read_text().split()
    assert stamp[1] == "workflow/envs/cpu-cuda.lock.txt"

    out = _setup(work, log, "DEVICE=cuda")  # same lock: nothing to do
    assert out.stdout.strip() == "setup: .venv is up to date" and _calls(log) == ""

    out = _setup(work, log, "DEVICE=npu", ASCEND_HOME_PATH="/usr/local/Ascend/cann")
    assert out.returncode == 0, out.stderr
    assert "recreating" in out.stdout  # never the Ascend lock on top of the CUDA one
    calls = _calls(log)
    assert "-m venv .venv" in calls and "-r workflow/envs/ascend-aarch64.lock.txt" in calls
    assert "cpu-cuda.lock.txt" not in calls
    assert "import torch, torch_npu" in calls  # set-up checks the install imports against CANN
    assert calls.rstrip().endswith("-m pisft doctor")  # and ends with the node's preflight

    out = _setup(work, log)  # no DEVICE: keeps the lock .venv was built from
    assert out.stdout.splitlines()[0] == "setup: .venv is up to date", out.stdout + out.stderr
    assert _calls(log).strip() == "python -m pisft doctor"  # the preflight runs every time
    out = make("-n", "test", cwd=work)
    assert "ascend-aarch64.lock.txt" in out.stdout  # make test / make run honour it too

    out = _setup(work, log, "DEVICE=cpu")
    assert "recreating" in out.stdout and "-r workflow/envs/cpu-cuda.lock.txt" in _calls(log)


def test_a_stamp_from_before_the_lock_was_recorded_still_counts_as_the_cpu_lock(scratch):
    work, log = scratch
    assert _setup(work, log).returncode == 0
    stamp = work / ".venv/.pisft-setup"
    stamp.write_text(stamp.read_text().split()[0] + "\n")  # the old format: the hash alone
    out = _setup(work, log)
    assert out.stdout.strip() == "setup: .venv is up to date" and _calls(log) == ""


def test_npu_setup_fails_when_the_preflight_fails_and_says_what_to_rerun(scratch):
    work, log = scratch
    out = _setup(work, log, "DEVICE=npu", ASCEND_HOME_PATH="/usr/local/Ascend/cann",
                 PISFT_TEST_DOCTOR_FAILS="1")
    assert out.returncode != 0
    assert "failed the preflight" in out.stderr and "pisft doctor" in out.stderr, out.stderr
    assert (work / ".venv/.pisft-setup").is_file()  # the install itself is kept
    assert make("-s", "setup", "DEVICE=cpu", cwd=work,
                env={"PISFT_TEST_LOG": str(log)}).returncode == 0  # no preflight off Ascend
    assert "pisft doctor" not in _calls(log).splitlines()[-1]


def test_npu_setup_without_cann_is_a_one_line_error_and_installs_nothing(scratch):
    work, log = scratch
    out = _setup(work, log, "DEVICE=npu")
    assert out.returncode != 0
    lines = [line for line in out.stderr.strip().splitlines()
             if not re.match(r"make(\[\d+\])?: ", line)]  # make's own trailer
    assert len(lines) == 1 and "CANN 9.1.0" in lines[0] and "set_env.sh" in lines[0], out.stderr
    assert "pip" not in _calls(log)


# ---------------------------------------------------------------- resolution for aarch64 (network)
# The rule for a test that resolves against a live package index (docs/development.md, "Tests that
# need a live package index"): it carries the `live_index` mark and runs only where
# PISFT_LIVE_INDEX=1 asks for it (`make test` then never depends on the network or on what an
# index serves that day); asked for, an index it cannot reach fails it instead of skipping.
LIVE_INDEX_ENV = "PISFT_LIVE_INDEX"


def _require_live_index(*urls: str) -> None:
    if os.environ.get(LIVE_INDEX_ENV) != "1":
        pytest.skip(f"resolves against a live package index: runs with {LIVE_INDEX_ENV}=1 "
                    "(docs/development.md, 'Tests that need a live package index')")
    for url in urls:
        if problem := _reachable(url):
            pytest.fail(f"{LIVE_INDEX_ENV}=1 asks for the live index, but {url} cannot be reached: {problem}")


def _reachable(url: str) -> str | None:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15).close()
        return None
    except Exception as exc:  # noqa: BLE001 - DNS, proxy, TLS, HTTP errors: all mean "cannot check from here"
        return f"{type(exc).__name__}: {exc}"


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=1200)


def _dry_run(requirements: list[str], tmp: Path, find_links: Path, *, only_binary: bool = True,
             no_deps: bool = False) -> dict:
    """pip's resolution for Linux aarch64 / CPython 3.12: the report, nothing installed."""
    args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(tmp / "report.json"),
            "--python-version", "3.12", "--implementation", "cp", "--target", str(tmp / "target"),
            "--find-links", str(find_links)]
    for platform in AARCH64_PLATFORMS:
        args += ["--platform", platform]
    if only_binary:
        args.append("--only-binary=:all:")
    if no_deps:
        args.append("--no-deps")
    out = _pip(*args, *requirements, cwd=tmp)
    assert out.returncode == 0, (
        "pip could not resolve the Ascend lock for linux aarch64 / CPython 3.12 (a pin without an "
        "aarch64 wheel? a sdist-only pin missing from SDIST_ONLY?):\n" + out.stderr[-4000:])
    return json.loads((tmp / "report.json").read_text())


def _pure_python_wheels(tmp: Path) -> Path:
    """Wheels of the sdist-only pins, built here: they must be pure Python (py3-none-any)."""
    wheels = tmp / "wheels"
    wheels.mkdir()
    out = _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels),
               *SDIST_ONLY, cwd=tmp)
    assert out.returncode == 0, out.stderr[-4000:]
    built = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(built) == len(SDIST_ONLY) and all(n.endswith("-py3-none-any.whl") for n in built), built
    return wheels


def _stand_in_wheel(directory: Path, name: str, version: str, requires: list[str]) -> None:
    """A metadata-only wheel with the given name, version and requirements (never installed)."""
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(directory / f"{name}-{version}-cp312-cp312-manylinux_2_28_aarch64.whl", "w") as z:
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\n"
                   f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: pisft-test\nRoot-Is-Purelib: false\n"
                   "Tag: cp312-cp312-manylinux_2_28_aarch64\n")
        z.writestr(f"{dist}/RECORD", "")


def _check_resolution(report: dict, lock_pins: dict[str, str]) -> dict[str, str]:
    resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    cuda = sorted(n for n in resolved if _cuda_only(n))
    assert not cuda, f"CUDA-only packages in the aarch64 resolution: {cuda}"
    assert resolved.get("torch-npu", "").startswith("2.11."), resolved.get("torch-npu")
    extra = sorted(set(resolved) - set(lock_pins))
    assert not extra, f"the lock is incomplete for aarch64; pip added: {extra}"
    assert {n: Version(v) for n, v in resolved.items()} == {n: Version(v) for n, v in lock_pins.items()}
    for item in report["install"]:
        url = item["download_info"]["url"]
        wheel = url.rsplit("/", 1)[-1]
        assert wheel.endswith(("-none-any.whl", "_aarch64.whl")), f"not an aarch64 wheel: {url}"
    assert "torch_npu" not in sys.modules
    return resolved


@pytest.mark.integration
@pytest.mark.live_index
def test_npu_lock_resolves_for_linux_aarch64_cpython312(tmp_path):
    """Every pin of the lock, resolved with dependencies from PyPI for aarch64 / CPython 3.12.

    torch 2.11.0+cpu and torchvision 0.26.0+cpu come from PyTorch's CPU index, which this test
    does not need: they are stood in for by metadata-only wheels whose requirements are those of
    PyPI's aarch64 build of the same version minus its CUDA-only ones (`test_npu_lock_resolves_as_written`
    checks the real index when it is reachable).
    """
    _require_live_index(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/")
    lock_pins = pins(NPU_LOCK)
    find_links = _pure_python_wheels(tmp_path)
    # Requirements of PyPI's aarch64 torch / torchvision of the pinned versions (metadata only).
    pypi_builds = [f"{n}=={v.split('+')[0]}" for n, v in FROM_TORCH_INDEX.items()]
    meta = _dry_run(pypi_builds, tmp_path, find_links, no_deps=True)
    for item in meta["install"]:
        name = canonicalize_name(item["metadata"]["name"])
        requires = [r for r in item["metadata"].get("requires_dist", []) if not _cuda_only(Requirement(r).name)]
        _stand_in_wheel(find_links, name, FROM_TORCH_INDEX[name], requires)
    requirements = [f"{n}=={v}" for n, v in lock_pins.items()]
    resolved = _check_resolution(_dry_run(requirements, tmp_path, find_links), lock_pins)
    assert resolved["torch"] == "2.11.0+cpu"


@pytest.mark.integration
@pytest.mark.live_index
def test_npu_lock_resolves_as_written(tmp_path):
    """The lock file exactly as `make setup DEVICE=npu` reads it, PyTorch's CPU index included."""
    _require_live_index(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/",
                        f"{TORCH_CPU_INDEX}/torch/")
    find_links = _pure_python_wheels(tmp_path)
    report = _dry_run(["-r", str(NPU_LOCK)], tmp_path, find_links)
    resolved = _check_resolution(report, pins(NPU_LOCK))
    assert resolved["torch"] == "2.11.0+cpu"
    urls = {canonicalize_name(i["metadata"]["name"]): i["download_info"]["url"] for i in report["install"]}
    assert re.search(r"/torch-2\.11\.0%2Bcpu-cp312-cp312-manylinux_2_28_aarch64\.whl", urls["torch"]), urls["torch"]
