"""Atomic outputs, manifests and per-stage logs."""

import subprocess
import sys

import pytest

from pisft import io


def test_atomic_dir_publishes_on_success_and_replaces_old(tmp_path):
    final = tmp_path / "out"
    with io.atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("1")
    assert (final / "a.txt").read_text() == "1"
    with io.atomic_dir(final) as tmp:
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), io.atomic_dir(final) as tmp:
        (tmp / "half.txt").write_text("x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_keeps_previous_output_on_failure(tmp_path):
    final = tmp_path / "out"
    with io.atomic_dir(final) as tmp:
        (tmp / "good.txt").write_text("ok")
    with pytest.raises(ValueError), io.atomic_dir(final):
        raise ValueError
    assert (final / "good.txt").read_text() == "ok"


def test_manifest_detects_changes(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"abc")
    files = io.write_manifest(tmp_path)
    assert files["w.bin"]["size"] == 3
    assert io.verify_manifest(tmp_path) == []
    (tmp_path / "w.bin").write_bytes(b"abd")
    (tmp_path / "extra").write_text("")
    problems = io.verify_manifest(tmp_path)
    assert any("sha256 differs" in p for p in problems)
    assert any("not listed" in p for p in problems)


def test_manifest_ignores_the_marker_snakemake_adds_to_directory_outputs(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    io.write_manifest(tmp_path)
    (tmp_path / ".snakemake_timestamp").write_text("")  # what Snakemake does after the job
    assert io.verify_manifest(tmp_path) == []
    (tmp_path / ".other_hidden").write_text("")  # anything else is still refused
    assert io.verify_manifest(tmp_path) == [f"{tmp_path / '.other_hidden'}: present but not listed in MANIFEST.json"]


def test_log_captures_child_processes(tmp_path):
    log = tmp_path / "logs" / "stage.log"
    code = (
        "import subprocess, sys\n"
        "from pisft.logs import tee_output\n"
        f"with tee_output({str(log)!r}):\n"
        "    print('parent says hi', flush=True)\n"
        "    subprocess.run([sys.executable, '-c',\n"
        "                    'import sys; print(\"child out\"); print(\"child err\", file=sys.stderr)'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    text = log.read_text()
    for line in ("parent says hi", "child out", "child err"):
        assert line in text and line in out.stdout


def test_a_line_printed_in_two_writes_reaches_the_shared_console_whole(tmp_path):
    """Under PYTHONUNBUFFERED (the Makefile's), `print` writes its text and its newline in two
    calls. Snakemake runs stages side by side on one terminal: another stage's line written
    between the two must land before or after this one, never inside it (CI saw
    "...-> results/recap/iter_1/datasetevaluate: base model: 96/200 frames")."""
    log, console = tmp_path / "stage.log", tmp_path / "console.txt"
    code = (
        "import array, fcntl, os, termios, time\n"
        "from pisft.logs import tee_output\n"
        "def unread(fd):\n"  # bytes in the pipe behind fd that no one has read yet
        "    n = array.array('i', [0]); fcntl.ioctl(fd, termios.FIONREAD, n); return n[0]\n"
        "other_stage = os.dup(1)\n"  # the same terminal, as a stage running beside this one has it
        f"with tee_output({str(log)!r}):\n"
        "    os.write(1, b'convert_recap: done -> results/dataset')\n"
        "    deadline = time.monotonic() + 50\n"
        "    while unread(1):\n"  # until the pump has read the first half (a bound, not a verdict)
        "        assert time.monotonic() < deadline, 'the pump never read the first half'\n"
        "        time.sleep(0.005)\n"
        "    os.write(other_stage, b'evaluate: 96/200 frames\\n')\n"
        "    os.write(1, b'\\n')\n"
        "    os.write(1, b'a prompt with no newline')\n"
    )
    with console.open("wb") as out:
        subprocess.run([sys.executable, "-c", code], stdout=out, check=True, timeout=60)
    assert console.read_text().splitlines() == [
        "evaluate: 96/200 frames", "convert_recap: done -> results/dataset", "a prompt with no newline"]
    assert log.read_text() == "convert_recap: done -> results/dataset\na prompt with no newline"


def test_the_log_ends_with_the_stage_not_with_a_process_that_holds_its_pipe(tmp_path):
    """A process that outlives the stage's work (multiprocessing's resource tracker does, after
    any spawn) keeps the tee's pipe open: the stage must still end, with all output logged."""
    log = tmp_path / "stage.log"
    code = (
        "import subprocess, sys\n"
        "from multiprocessing import resource_tracker\n"
        "from pisft.logs import tee_output\n"
        f"with tee_output({str(log)!r}):\n"
        "    subprocess.run([sys.executable, '-c', 'print(\"x\" * 999_999)'])\n"
        "    holder = subprocess.Popen(['sleep', '600'])\n"  # inherits fds 1 and 2
        "    resource_tracker.ensure_running()\n"  # what a spawn start method starts
        "    print('last line', flush=True)\n"
        "holder.kill()\n"
    )
    # The old tee waited 30 s for an end of file that never came; this bound is 10x the rest
    # of the run, not a speed requirement.
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=20)
    text = log.read_text()
    assert "x" * 999_999 in text and text.rstrip().endswith("last line")


def test_outputs_follow_the_umask_not_tempfile_modes(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        with io.atomic_dir(tmp_path / "out") as tmp:
            io.write_text_atomic(tmp / "f.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "out" / "f.txt").stat().st_mode) == 0o644
