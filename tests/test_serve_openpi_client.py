"""`pisft serve` with a real tiny model: over a real websocket (fast), and driven by the real
`openpi-client` from PyPI (integration).

openpi-client needs numpy<2, so it cannot share the project's environment: the integration
test builds a small virtual environment for it (once; cached under build/, or
$PISFT_OPENPI_CLIENT_VENV) with the Python 3.12 that scripts/find-python312.sh finds (else the
base interpreter of this one), as openpi's own LIBERO example keeps its client in an
environment of its own. Where that environment is missing and the package index cannot be
reached (and pip's --find-links hold no wheels for it), the test is skipped, saying so: a
verdict on the server must not rest on this machine's network.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from model_fixtures import tiny_model_dir
from serve_fixtures import assert_refused_unread, start_in_thread
from pisft.policy import observations
from pisft.serve import protocol
from pisft.policy.libero import LiberoPolicy, cut_prompt
from pisft.serve.server import PolicyServer

ROOT = Path(__file__).resolve().parents[1]
# openpi-client 0.1.2 imports typing_extensions without declaring it.
CLIENT_REQUIREMENTS = ["openpi-client==0.1.2", "numpy==1.26.4", "typing-extensions==4.16.0"]


def _base_python() -> str:
    """A Python 3.12 to build the client's environment from: what the project's setup uses."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "find-python312.sh")],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.strip()
    return getattr(sys, "_base_executable", None) or sys.executable


def _package_index() -> str:
    """The index pip installs from here: PIP_INDEX_URL, else pip's configuration, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL", "").strip()
    if not url:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                              capture_output=True, text=True, timeout=60)
        url = proc.stdout.strip() if proc.returncode == 0 else ""
    return url or "https://pypi.org/simple"


def index_unreachable(url: str, timeout: float = 15) -> str | None:
    """Why the package index at `url` cannot be reached from here, or None when it answers (an
    HTTP error is an answer: then pip's own error is the verdict)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/openpi-client/", timeout=timeout) as reply:
            reply.read(1)
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as exc:  # URLError, a timeout, a refused connection
        return f"the package index {url} cannot be reached ({getattr(exc, 'reason', exc)})"
    return None


def openpi_client_python() -> Path:
    """The interpreter of the openpi-client environment; built if missing (atomic rename).
    Skips the calling test, with the reason, when it is missing and cannot be built offline."""
    root = Path(os.environ.get("PISFT_OPENPI_CLIENT_VENV", ROOT / "build" / "openpi-client-venv"))
    python = root / "bin" / "python"
    stamp = root / "pisft-requirements.txt"
    wanted = "\n".join(CLIENT_REQUIREMENTS) + "\n"
    if python.exists() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    offline = index_unreachable(_package_index())
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        subprocess.run([_base_python(), "-m", "venv", str(tmp)], check=True, capture_output=True)
        proc = subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", *(["--no-index"] if offline else []),
                               *CLIENT_REQUIREMENTS],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 and offline:  # nothing to install from: no verdict here
            pytest.skip(f"the openpi-client environment {root} is missing and {offline}, nor do pip's "
                        f"--find-links hold {CLIENT_REQUIREMENTS}; run this test once where the index "
                        f"is reachable (it builds the environment there), or point PISFT_OPENPI_CLIENT_VENV "
                        f"at an environment built with them")
        if proc.returncode != 0:
            raise RuntimeError(f"installing {CLIENT_REQUIREMENTS} failed:\n{proc.stderr[-3000:]}")
        (tmp / stamp.name).write_text(wanted)
        if root.exists():
            shutil.rmtree(root)
        tmp.rename(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return python


def test_an_unreachable_index_is_told_from_one_that_answers(tmp_path):
    """What decides between building the client's environment and skipping: a real HTTP server
    that answers (404 here) counts as reachable, a closed port does not."""
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert index_unreachable(f"http://127.0.0.1:{port}/simple") is None
    finally:
        server.shutdown()
        server.server_close()
    reason = index_unreachable(f"http://127.0.0.1:{port}/simple")
    assert reason.startswith(f"the package index http://127.0.0.1:{port}/simple cannot be reached (")


SERVE_STATS = {  # distinct per action dimension, so the raw-unit mapping shows
    "observation.state": {"q01": np.full(8, -1.0, np.float32), "q99": np.full(8, 1.0, np.float32),
                          "mean": np.zeros(8, np.float32), "std": np.ones(8, np.float32)},
    "action": {"q01": np.linspace(-1, 0, 7).astype(np.float32), "q99": np.linspace(1, 3, 7).astype(np.float32),
               "mean": np.zeros(7, np.float32), "std": np.ones(7, np.float32)},
}


def write_tiny_model(out: Path) -> Path:
    """A tiny pi0.5 in the exported layout, with SERVE_STATS, built afresh under `out`
    (tests/test_eval_closed_loop.py and tests/test_eval_libero_real.py use it)."""
    from pisft.model.policy import build_policy, save_model
    from pisft.model.tokenizer import save_tiny_tokenizer

    tok = out / "tokenizer-src"
    tok.mkdir(parents=True)
    save_tiny_tokenizer(tok)
    model = out / "model"
    model.mkdir()
    save_model(build_policy("tiny", seed=0), model, tokenizer_dir=tok, dataset_stats=SERVE_STATS)
    return model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The shared tiny pi0.5 (tests/model_fixtures.py) in the exported layout, with SERVE_STATS."""
    from pisft.model.norm_stats import STATS_FILE, save_stats

    model = tiny_model_dir(tmp_path_factory, tmp_path_factory.mktemp("serve_model") / "model")
    save_stats(SERVE_STATS, model / STATS_FILE)
    return model


def libero_request(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.uniform(-1, 1, 8),
        "prompt": "put the bowl on the plate",
    }


def test_libero_policy_is_reproducible_and_in_raw_units(tiny_model):
    policy = LiberoPolicy.from_model_dir(tiny_model, device="cpu", seed=3)
    assert policy.metadata["action_horizon"] == 10 and policy.metadata["action_dim"] == 7
    first = policy.infer(libero_request())["actions"]
    second = policy.infer(libero_request())["actions"]
    assert first.shape == (10, 7) and first.dtype == np.float32
    assert not np.array_equal(first, second)  # fresh noise for the next request
    policy.reset(3)
    np.testing.assert_array_equal(policy.infer(libero_request())["actions"], first)
    # raw units: the postprocessor maps the model's [-1, 1] onto [q01, q99] of each dimension
    p = policy.predictor
    batch = {k: v for k, v in p.preprocessor({
        "observation.images.base_0_rgb": torch.rand(1, 3, 8, 8),
        "observation.images.left_wrist_0_rgb": torch.rand(1, 3, 8, 8),
        "observation.state": torch.zeros(1, 8), "task": ["x"]}).items()}
    norm = p.policy.predict_action_chunk(batch, noise=torch.zeros(1, 10, 32))
    raw = p.postprocessor(norm)
    q01, q99 = np.linspace(-1, 0, 7), np.linspace(1, 3, 7)
    np.testing.assert_allclose(raw[0].numpy(), (norm[0].numpy() + 1) / 2 * (q99 - q01) + q01, atol=1e-5)


def test_a_model_without_stats_needs_a_dataset(tmp_path, tiny_model):
    from pisft.errors import ModelLoadError

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    (bare / "normalization_stats.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="--dataset"):
        LiberoPolicy.from_model_dir(bare, device="cpu")


@pytest.fixture(scope="module")
def tiny_policy(tiny_model) -> LiberoPolicy:
    return LiberoPolicy.from_model_dir(tiny_model, device="cpu", seed=3)


@contextlib.contextmanager
def served(policy):
    """`policy` behind a real PolicyServer on a free port; yields its ws:// URL."""
    where, stop = start_in_thread(PolicyServer(policy, host="127.0.0.1", port=0), timeout=30)
    try:
        yield where["url"]
    finally:
        stop()


def _ask(ws, obs):
    ws.send(protocol.packb(obs))
    reply = ws.recv(timeout=300)
    return reply if isinstance(reply, str) else protocol.unpackb(reply)


def test_served_replies_equal_in_process_inference_for_every_connection(tiny_policy):
    """The served chunk is the in-process one (what closed_loop computes), and a second client
    gets the same chunk for the same request: each connection has noise of its own. Degenerate
    images that crashed LeRobot's resize are answered, and the connection is kept."""
    from websockets.sync.client import connect

    request = libero_request()
    tiny_policy.reset(3)
    expected = tiny_policy.infer(request)["actions"]
    with (served(tiny_policy) as url, connect(url, compression=None, max_size=None) as a,
          connect(url, compression=None, max_size=None) as b):
        meta = protocol.unpackb(a.recv())
        b.recv()
        assert meta["limits"]["max_prompt_chars"] == 2048 and meta["limits"]["min_image_side"] == 16
        for shape in [(1, 10000, 3), (3, 224, 3), (16, 2048, 3)]:
            reply = _ask(a, {**request, "observation/image": np.zeros(shape, np.uint8)})
            assert isinstance(reply, str) and reply.startswith("bad request:") and str(shape) in reply
            assert "Traceback" not in reply and "site-packages" not in reply
        np.testing.assert_array_equal(_ask(a, request)["actions"], expected)
        np.testing.assert_array_equal(_ask(b, request)["actions"], expected)


def test_rtc_per_connection_agrees_with_the_previous_chunk_and_plain_chunks_without_it(tiny_model, tiny_policy):
    """`serve --rtc`: the server keeps each connection's last chunk; a request with
    rtc/executed_steps and rtc/delay_steps gets a chunk whose first delay actions agree with that
    chunk's actions from executed_steps on (LeRobot's RTC). A connection's first request, one after a
    reset and one without the keys get plain chunks. Replies carry openpi's policy_timing."""
    from websockets.sync.client import connect

    from pisft.policy.rtc import RtcSettings

    rtc_policy = LiberoPolicy.from_model_dir(tiny_model, device="cpu", seed=3, rtc=RtcSettings())
    request, ask = libero_request(), {"rtc/executed_steps": 3, "rtc/delay_steps": 2}
    with (served(rtc_policy) as url, connect(url, compression=None, max_size=None) as a,
          connect(url, compression=None, max_size=None) as b):
        a.recv(), b.recv()
        first = _ask(a, {**request, **ask})  # nothing to agree with yet: a plain chunk
        assert "rtc" not in first and first["policy_timing"]["infer_ms"] > 0 and "infer_ms" in first["server_timing"]
        np.testing.assert_array_equal(_ask(b, request)["actions"], first["actions"])  # same seed, plain
        second = _ask(a, {**request, **ask})
        plain = _ask(b, request)["actions"]  # b's second draw is a's second: the same chunk without RTC
        assert second["rtc"] == {"delay_steps": 2, "prev_steps": 7}
        held = first["actions"][3:5]  # executed while the reply was computed
        assert np.abs(second["actions"][:2] - held).max() < 0.1 < np.abs(plain[:2] - held).max()
        refused = _ask(a, {**request, "rtc/prev_actions": np.zeros((5, 7))})
        assert isinstance(refused, str) and "rtc/executed_steps" in refused
        alone = _ask(a, {**request, "rtc/delay_steps": 2})  # the delay without where the robot was
        assert isinstance(alone, str) and "'rtc/delay_steps' needs 'rtc/executed_steps'" in alone
        assert _ask(a, {"reset": True, "seed": 3}) == {"reset": True, "seed": 3}
        assert "rtc" not in _ask(a, {**request, **ask})  # a new episode: nothing to agree with
    with served(tiny_policy) as url, connect(url, compression=None, max_size=None) as c:
        c.recv()
        reply = _ask(c, {**request, **ask})
        assert isinstance(reply, str) and reply.startswith("bad request:") and "--rtc" in reply


def test_every_malformed_rtc_field_is_a_bad_request_with_or_without_a_chunk_to_agree_with(tiny_model):
    """Issue 56, item 3, over the real protocol: an `rtc/executed_steps` array was an internal TypeError
    with a traceback; a delay past the rest of the last chunk was answered as an RTC chunk, though its
    first d actions cannot agree with fewer than d; a bad delay went unchecked when there was no chunk to
    agree with (a connection's first request, or the last chunk executed whole). Each is a bad request
    naming the field, the connection is kept, and what is well formed is answered as documented."""
    from websockets.sync.client import connect

    from pisft.policy.rtc import RtcSettings

    rtc_policy = LiberoPolicy.from_model_dir(tiny_model, device="cpu", seed=3, rtc=RtcSettings())
    chunk = rtc_policy.predictor.chunk_size  # 10
    request = libero_request()

    def refused(ws, executed, delay, *words):
        reply = _ask(ws, {**request, "rtc/executed_steps": executed, "rtc/delay_steps": delay})
        assert isinstance(reply, str) and reply.startswith("bad request:"), reply
        assert "Traceback" not in reply and "internal" not in reply and all(w in reply for w in words), reply

    with served(rtc_policy) as url, connect(url, compression=None, max_size=None) as ws:
        ws.recv()
        # no chunk to agree with yet: the fields are checked all the same
        refused(ws, np.array([1, 2]), 2, "'rtc/executed_steps' must be a whole number >= 0")
        refused(ws, np.array([3]), 2, "'rtc/executed_steps'")
        refused(ws, 0, -1, "'rtc/delay_steps' must be a whole number of control steps in 0..10")
        refused(ws, 0, chunk + 1, "'rtc/delay_steps'", "in 0..10")
        refused(ws, 0, np.array([2, 3]), "'rtc/delay_steps'")
        refused(ws, 0, 2.0, "'rtc/delay_steps'")
        refused(ws, 0, True, "'rtc/delay_steps'")
        first = _ask(ws, {**request, "rtc/executed_steps": 0, "rtc/delay_steps": 2})
        assert "rtc" not in first and first["actions"].shape == (chunk, 7)  # nothing to agree with: plain
        # a chunk to agree with: the delay fits in the actions left after executed_steps
        refused(ws, 8, 3, "'rtc/delay_steps' is 3, more than the 2 actions left of the last chunk after "
                          "'rtc/executed_steps' 8")
        refused(ws, chunk + 1, 0, "'rtc/executed_steps' is 11, past the end of the last chunk")
        refused(ws, np.array([1, 2]), 2, "'rtc/executed_steps' must be a whole number")
        # executed whole: a plain chunk, and still a checked delay
        refused(ws, chunk, -1, "'rtc/delay_steps'")
        refused(ws, chunk, "2", "'rtc/delay_steps'")
        refused(ws, chunk, chunk + 1, "'rtc/delay_steps'")
        whole = _ask(ws, {**request, "rtc/executed_steps": chunk, "rtc/delay_steps": 3})
        assert "rtc" not in whole
        fits = _ask(ws, {**request, "rtc/executed_steps": np.int64(8), "rtc/delay_steps": np.int32(2)})
        assert fits["rtc"] == {"delay_steps": 2, "prev_steps": 2}  # NumPy integers, as msgpack-numpy sends them


def test_a_long_prompt_is_cut_before_tokenization_without_changing_the_tokens(tiny_policy):
    pre = tiny_policy.predictor.preprocessor
    budget = tiny_policy.prompt_budget
    tokenizer = next(step.input_tokenizer for step in pre.steps if hasattr(step, "input_tokenizer"))
    assert budget == 2 * 48 * max(len(piece) for piece in tokenizer.get_vocab())

    def tokens(task):
        out = pre({observations.BASE_IMAGE: torch.rand(1, 3, 8, 8),
                   observations.WRIST_IMAGE: torch.rand(1, 3, 8, 8),
                   observations.STATE: torch.zeros(1, 8), "task": [task]})
        return out["observation.language.tokens"], out["observation.language.attention_mask"]

    long_task = "   pick up the black_bowl and place it\non the plate " * 400  # 20k characters
    cut = cut_prompt(long_task, budget)
    assert len(cut) == budget < len(long_task)
    for full, short in zip(tokens(long_task), tokens(cut)):
        torch.testing.assert_close(full, short, rtol=0, atol=0)
    # the policy hands the model the cut prompt
    policy = LiberoPolicy(tiny_policy.predictor, seed=3,
                          limits=observations.Limits(max_prompt_chars=10**6))
    assert policy.prepare({**libero_request(), "prompt": long_task})["task"] == [cut]
    assert policy.prepare(libero_request())["task"] == ["put the bowl on the plate"]


CLIENT_SCRIPT = r"""
import json, sys
import numpy as np
from openpi_client import image_tools, websocket_client_policy

host, port, dump = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
def element():
    img = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)[::-1, ::-1]
    img = image_tools.convert_to_uint8(image_tools.resize_with_pad(np.ascontiguousarray(img), 224, 224))
    return {"observation/image": img, "observation/wrist_image": img.copy(),
            "observation/state": rng.uniform(-0.5, 0.5, 8),  # float64, as LIBERO's obs give it
            "prompt": "pick up the black bowl and place it on the plate"}

out = {"numpy": np.__version__}
client = websocket_client_policy.WebsocketClientPolicy(host, port)
out["metadata"] = client.get_server_metadata()
good = element()
first = client.infer(good)
out["actions_shape"] = list(first["actions"].shape)
out["actions_dtype"] = str(first["actions"].dtype)
out["actions_finite"] = bool(np.isfinite(first["actions"]).all())
out["server_timing"] = sorted(first.get("server_timing", {}))
bad = dict(good)
bad["observation/state"] = np.zeros(5)
try:
    client.infer(bad)
    out["bad_error"] = None
except RuntimeError as exc:
    out["bad_error"] = str(exc)
missing = {k: v for k, v in good.items() if k != "observation/wrist_image"}
try:
    client.infer(missing)
    out["missing_error"] = None
except RuntimeError as exc:
    out["missing_error"] = str(exc)
try:  # a line of pixels: crashed LeRobot's resize, with the traceback sent to the client
    client.infer({**good, "observation/image": np.zeros((1, 10000, 3), np.uint8)})
    out["degenerate_error"] = None
except RuntimeError as exc:
    out["degenerate_error"] = str(exc)
again = client.infer(good)  # same connection, after three errors
out["again_timing"] = sorted(again["server_timing"])
client2 = websocket_client_policy.WebsocketClientPolicy(host, port)  # and a new connection
second = client2.infer(good)
np.savez(dump, request_image=good["observation/image"], request_wrist=good["observation/wrist_image"],
         request_state=good["observation/state"], first=first["actions"], again=again["actions"],
         second_client=second["actions"])
print("RESULT " + json.dumps(out))
"""


def stop_server(proc, lines: queue.Queue) -> str:
    """Stop a `_start_server` process as a user would (SIGTERM); its output after start-up."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    log = []
    while not lines.empty():
        log.append(lines.get())
    return "".join(log)


def _start_server(model: Path, *options: str) -> tuple[subprocess.Popen, int, queue.Queue, str]:
    """`pisft serve` in a process of its own: (process, port, its further output lines, its
    output up to the line naming the URL)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pisft", "serve", "--model", str(model),
                             "--host", "127.0.0.1", "--port", "0", "--device", "cpu", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            proc.kill()
            raise AssertionError("server did not start:\n" + "".join(seen)) from None
        seen.append(line)
        match = re.search(r"ws://127\.0\.0\.1:(\d+)", line)
        if match:
            return proc, int(match.group(1)), lines, "".join(seen)
        if proc.poll() is not None:
            raise AssertionError("server exited:\n" + "".join(seen))


# The request the client dumped, answered as the server answers it (seed 0, the first request of a
# connection, then the next one) by LiberoPolicy in a process of its own with `threads` intra-op threads.
REFERENCE_SCRIPT = """
import sys
import numpy as np
import torch
from pisft.policy.libero import LiberoPolicy
model, dump, threads, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
got = np.load(dump)
policy = LiberoPolicy.from_model_dir(model, device="cpu", seed=0)
request = {"observation/image": got["request_image"], "observation/wrist_image": got["request_wrist"],
           "observation/state": got["request_state"], "prompt": "pick up the black bowl and place it on the plate"}
first, again = policy.infer(request)["actions"], policy.infer(request)["actions"]
np.savez(out, first=first, again=again)
"""


def _in_process_actions(model: Path, dump: Path, threads: int, out: Path):
    """(first, again): the in-process answers to the dumped request, from a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", REFERENCE_SCRIPT, str(model), str(dump), str(threads), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = np.load(out)
    return ref["first"], ref["again"]


@pytest.mark.integration
def test_openpi_client_gets_the_in_process_chunk_and_errors_keep_the_server_up(tiny_model, tmp_path):
    client_python = openpi_client_python()
    server, port, lines, started = _start_server(tiny_model)
    try:
        script = tmp_path / "client.py"
        script.write_text(CLIENT_SCRIPT)
        dump = tmp_path / "client.npz"
        proc = subprocess.run([str(client_python), str(script), "127.0.0.1", str(port), str(dump)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout.split("RESULT ", 1)[1])
        assert result["numpy"].startswith("1.")  # the client really runs with numpy<2
        assert result["metadata"]["action_horizon"] == 10 and result["metadata"]["action_dim"] == 7
        assert result["actions_shape"] == [10, 7] and result["actions_dtype"] == "float32"
        assert result["actions_finite"] and result["server_timing"] == ["infer_ms", "queue_ms"]
        assert result["again_timing"] == ["infer_ms", "prev_total_ms", "queue_ms"]
        assert "observation/state" in result["bad_error"] and "shape (8,)" in result["bad_error"]
        assert "observation/wrist_image" in result["missing_error"]
        assert "too small" in result["degenerate_error"] and "Traceback" not in result["degenerate_error"]
        assert server.poll() is None
        # the reply is what in-process inference gives for the same request (the server's seed
        # 0, the first request of a connection), and a new connection starts from the same noise
        got = np.load(dump)
        # in a fresh process with the server's intra-op thread count (its start-up line): float32
        # bits depend on how the threads split the work, and a pytest worker carries what earlier
        # tests left in it (CI saw 25 of 70 values one ulp apart with the worker at one thread and
        # the server at two; then, the counts made equal, 37 of 70 with the worker after some thirty
        # other modules)
        threads = int(re.search(r"; (\d+) CPU threads", started).group(1))
        first, again = _in_process_actions(tiny_model, dump, threads, tmp_path / "reference.npz")
        np.testing.assert_array_equal(got["first"], first)
        np.testing.assert_array_equal(got["again"], again)
        np.testing.assert_array_equal(got["second_client"], got["first"])
    finally:
        log = stop_server(server, lines)
    assert server.returncode == 0, log
    assert "stopped after 6 requests (3 errors)" in log


@pytest.mark.integration  # ~15-25 s here: the server process imports torch and LeRobot, loads the model
def test_serve_with_small_limits_refuses_accordingly_and_reports_them(tiny_model):
    """`serve --max-message-mib 0.5 --max-image-side 300 --max-prompt-chars 40`: a request
    within them is answered; one over each is refused naming the limit; the metadata, the
    start-up line and the closing line say so."""
    from websockets.sync.client import connect

    server, port, lines, started = _start_server(tiny_model, "--max-message-mib", "0.5", "--max-image-side",
                                                 "300", "--max-prompt-chars", "40")
    url = f"ws://127.0.0.1:{port}"
    try:
        assert "limits: 0.5 MiB a message, 300 px an image side, 40 prompt characters" in started
        with connect(url, compression=None, max_size=None) as ws:
            meta = protocol.unpackb(ws.recv())
            assert meta["limits"] == {"max_image_side": 300, "max_prompt_chars": 40, "min_image_side": 16,
                                      "max_message_bytes": 512 * 1024}
            ok = {**libero_request(), "prompt": "x" * 40}  # 2 x 224 x 224 x 3 bytes: about 0.29 MiB
            assert _ask(ws, ok)["actions"].shape == (10, 7)
            wide = np.zeros((301, 301, 3), np.uint8)  # about 0.4 MiB in all: under the message limit
            reply = _ask(ws, {**ok, "observation/image": wide})
            assert isinstance(reply, str) and "(301, 301, 3)" in reply and "300 pixels a side" in reply
            assert "--max-image-side" in reply
            assert _ask(ws, {**ok, "observation/image": np.zeros((300, 300, 3), np.uint8)})["actions"].shape == (10, 7)
            reply = _ask(ws, {**ok, "prompt": "x" * 41})
            assert isinstance(reply, str) and "41 characters; the limit is 40" in reply
            assert "--max-prompt-chars" in reply
        with connect(url, compression=None, max_size=None) as ws:  # over 0.5 MiB: refused unread
            ws.recv()
            big = protocol.packb({**ok, "observation/image": np.zeros((400, 400, 3), np.uint8)})
            assert 512 * 1024 < len(big) < 32 * 2**20  # over this server's limit, under the default
            assert_refused_unread(ws, big)
    finally:
        log = stop_server(server, lines)
    assert server.returncode == 0, log
    assert "stopped after 4 requests (2 errors); 1 oversized messages refused" in log


def test_serve_refuses_a_missing_model_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pisft", "serve", "--model", str(tmp_path / "nope"),
                           "--port", "0", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "not found" in proc.stderr
