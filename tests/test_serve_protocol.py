"""The websocket policy protocol: msgpack-numpy framing, metadata, errors, and a server that
survives hostile clients (oversized messages, degenerate images, huge prompts, crashes, two
clients at once, a taken port), each fault made the way it happens: real websocket clients."""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import torch
from websockets.sync.client import connect

from serve_fixtures import assert_refused_unread, start_in_thread

from pisft.policy import observations
from pisft.serve import hostile_probe, protocol
from pisft.serve.server import PolicyServer, bind


def test_arrays_round_trip_with_dtype_and_shape():
    msg = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.uint8(7), "s": "text",
           "nested": {"c": np.array([True, False])}}
    out = protocol.unpackb(protocol.packb(msg))
    assert out["a"].dtype == np.float32 and out["a"].shape == (3, 4)
    np.testing.assert_array_equal(out["a"], msg["a"])
    assert out["b"] == 7 and out["b"].dtype == np.uint8
    assert out["s"] == "text"
    np.testing.assert_array_equal(out["nested"]["c"], [True, False])


def test_wire_format_is_openpi_msgpack_numpy():
    """The exact map layout openpi_client.msgpack_numpy writes and reads."""
    arr = np.ones((2, 3), dtype=np.float64)
    raw = msgpack.unpackb(protocol.packb({"x": arr}), raw=False)
    enc = raw["x"]
    assert enc[b"__ndarray__"] is True
    assert enc[b"dtype"] == "<f8" and list(enc[b"shape"]) == [2, 3]
    assert enc[b"data"] == arr.tobytes()
    # and a frame built the way openpi's client builds it decodes here
    frame = msgpack.packb({"y": {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": "<f8",
                                 b"shape": (2, 3)}}, use_bin_type=True)
    np.testing.assert_array_equal(protocol.unpackb(frame)["y"], arr)


@pytest.mark.parametrize("dtype", ["|O", "|V8"])
def test_object_and_void_arrays_are_refused(dtype):
    frame = msgpack.packb({"x": {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": dtype,
                                 b"shape": [1]}}, use_bin_type=True)
    with pytest.raises(protocol.ProtocolError, match="not allowed"):
        protocol.unpackb(frame)
    with pytest.raises(TypeError):
        protocol.packb({"x": np.array([object()], dtype=object)})


def test_truncated_array_data_is_a_protocol_error():
    frame = msgpack.packb({"x": {b"__ndarray__": True, b"data": b"\0" * 7, b"dtype": "<f4",
                                 b"shape": [2]}}, use_bin_type=True)
    with pytest.raises(protocol.ProtocolError, match="needs 8 bytes"):
        protocol.unpackb(frame)
    with pytest.raises(protocol.ProtocolError):
        protocol.unpackb(b"\xc1 not msgpack")


# ---- observation mapping -------------------------------------------------------------------

FEATURES = [observations.BASE_IMAGE, observations.WRIST_IMAGE]


def libero_obs(size: int = 32) -> dict:
    rng = np.random.default_rng(0)
    return {
        "observation/image": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
        "observation/state": rng.normal(size=8),  # float64, as openpi's LIBERO client sends
        "prompt": "put the bowl on the plate",
    }


def test_openpi_libero_keys_map_to_model_features():
    obs = libero_obs()
    batch = observations.to_batch(obs, image_features=FEATURES, state_dim=8)
    img = batch[observations.BASE_IMAGE]
    assert img.shape == (1, 3, 32, 32) and img.dtype == torch.float32
    assert float(img.min()) >= 0.0 and float(img.max()) <= 1.0
    # HWC uint8 -> CHW float: pixel (row 3, col 5, channel 1)
    assert float(img[0, 1, 3, 5]) == pytest.approx(obs["observation/image"][3, 5, 1] / 255.0)
    assert batch[observations.STATE].shape == (1, 8) and batch[observations.STATE].dtype == torch.float32
    assert batch["task"] == ["put the bowl on the plate"]


def test_model_feature_names_and_chw_float_images_are_accepted():
    obs = libero_obs()
    native = {observations.BASE_IMAGE: obs["observation/image"].transpose(2, 0, 1) / 255.0,
              observations.WRIST_IMAGE: obs["observation/wrist_image"],
              observations.STATE: obs["observation/state"], "task": "x"}
    a = observations.to_batch(native, image_features=FEATURES, state_dim=8)
    b = observations.to_batch(obs, image_features=FEATURES, state_dim=8)
    torch.testing.assert_close(a[observations.BASE_IMAGE], b[observations.BASE_IMAGE])


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o.pop("observation/state"), "observation/state"),
    (lambda o: o.pop("prompt"), "prompt"),
    (lambda o: o.__setitem__("observation/state", np.zeros(7)), r"shape \(8,\)"),
    (lambda o: o.__setitem__("observation/image", np.zeros((32, 32), np.uint8)), "observation/image"),
    (lambda o: o.__setitem__("observation/wrist_image", np.full((16, 16, 3), 2.0)), r"\[0, 1\]"),
    (lambda o: o.__setitem__("observation/state", np.full(8, np.nan)), "NaN"),
])
def test_malformed_observations_name_the_key(mutate, message):
    obs = libero_obs()
    mutate(obs)
    with pytest.raises(observations.ObservationError, match=message):
        observations.to_batch(obs, image_features=FEATURES, state_dim=8)



@pytest.mark.parametrize("shape, message", [
    ((1, 10000, 3), "too small"),      # a line of pixels
    ((3, 224, 3), "too small"),        # a CHW/HWC mix-up, read as 3×224
    ((224, 3, 3), "too small"),
    ((16, 2048, 3), "too elongated"),  # shrinks to 0×64 in the model's resize-with-pad
    ((2049, 16, 3), "too large"),
])
def test_degenerate_and_oversized_images_are_refused_before_conversion(shape, message):
    obs = libero_obs()
    obs["observation/image"] = np.zeros(shape, np.uint8)
    with pytest.raises(observations.ObservationError, match=message) as err:
        observations.to_batch(obs, image_features=FEATURES, state_dim=8,
                              limits=observations.Limits(max_image_side=2048), image_resolution=(64, 64))
    assert "observation/image" in str(err.value) and str(shape) in str(err.value)


def test_a_long_prompt_is_refused_before_any_pixel_is_read():
    obs = libero_obs()
    obs["prompt"] = "x" * 5000
    obs["observation/image"] = np.full((32, 32, 3), 2.0)  # out of range: only found by reading pixels
    with pytest.raises(observations.ObservationError, match=r"5000 characters; the limit is 2048"):
        observations.to_batch(obs, image_features=FEATURES, state_dim=8)
    obs["prompt"] = b"y" * 3000  # bytes: refused by length before decoding
    with pytest.raises(observations.ObservationError, match="3000 bytes"):
        observations.to_batch(obs, image_features=FEATURES, state_dim=8)


# ---- server over a real websocket ----------------------------------------------------------

class FakeClock:
    """The server's clock: only the stand-in policy moves it, so timings are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StandInPolicy:
    """A stand-in policy with the server's interface (new_noise, prepare, predict).

    Its chunk depends on the observation and on the connection's noise, so a mixed-up request
    or a shared noise generator would show: columns 0-5 the state, 6 the mean image level,
    7 a draw from the noise. It checks requests with the real observation mapping (64×64
    model input, the default limits). Prompts drive faults: "explode" raises in the model,
    "hold in prepare"/"hold in predict" wait for the test's release.
    """

    metadata = {"action_horizon": 4, "action_dim": 8}
    seed = 0

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock
        self.prepared = 0
        self.in_prepare, self.release_prepare = threading.Event(), threading.Event()
        self.in_predict, self.release_predict = threading.Event(), threading.Event()

    def new_noise(self, seed=None):
        return torch.Generator().manual_seed(self.seed if seed is None else seed)

    def prepare(self, obs):
        self.prepared += 1
        batch = observations.to_batch(obs, image_features=FEATURES, state_dim=8,
                                      limits=observations.Limits(), image_resolution=(64, 64))
        if "hold in prepare" in batch["task"][0]:
            self.in_prepare.set()
            assert self.release_prepare.wait(60)
        return batch

    def predict(self, batch, noise):
        task = batch["task"][0]
        if "explode" in task:
            raise RuntimeError("boom inside the model at /opt/secret/site-packages/x.py")
        if "hold in predict" in task:
            self.in_predict.set()
            assert self.release_predict.wait(60)
            self.clock.now += 1.0
        if self.clock is not None:
            self.clock.now += 0.005
        level = float(batch[observations.BASE_IMAGE].mean())
        state = batch[observations.STATE][0].numpy()
        row = np.concatenate([state[:6], [level, 0.0]])
        actions = np.tile(row, (4, 1)).astype(np.float32)
        actions[:, 7] = torch.randn(4, generator=noise).numpy()
        return {"actions": actions}


@pytest.fixture
def serve():
    """serve(policy, **server options) -> (server, urls); stopped at the end of the test."""
    started = []

    def start(policy, **options):
        server = PolicyServer(policy, host="127.0.0.1", port=0, **options)
        where, stop = start_in_thread(server, timeout=10)
        started.append((stop, policy))
        return server, where

    yield start
    for stop, policy in started:
        for event in (policy.release_prepare, policy.release_predict):
            event.set()
        stop()


@contextlib.contextmanager
def client(url):
    with connect(url, compression=None, max_size=None) as ws:
        ws.recv()  # metadata
        yield ws


def ask(ws, obs, timeout=60):
    ws.send(protocol.packb(obs))
    reply = ws.recv(timeout=timeout)
    return reply if isinstance(reply, str) else protocol.unpackb(reply)


def test_metadata_then_actions_then_errors_then_actions_again(serve, caplog):
    server, where = serve(StandInPolicy())
    with connect(where["url"], compression=None, max_size=None) as ws:
        assert protocol.unpackb(ws.recv()) == {"action_horizon": 4, "action_dim": 8,
                                               "limits": {"max_message_bytes": 32 * 2**20}}  # the default
        obs = libero_obs()
        reply = ask(ws, obs)
        assert reply["actions"].shape == (4, 8) and reply["actions"].dtype == np.float32
        np.testing.assert_allclose(reply["actions"][0, :6], obs["observation/state"][:6], rtol=1e-6)
        assert sorted(reply["server_timing"]) == ["infer_ms", "queue_ms"]

        bad = dict(obs)
        del bad["observation/state"]
        error = ask(ws, bad)
        assert isinstance(error, str) and "observation/state" in error

        ws.send(b"\xc1garbage")
        assert "not a msgpack message" in ws.recv()
        ws.send("a text frame")
        assert "binary" in ws.recv()

        with caplog.at_level(logging.ERROR, logger="pisft.serve"):
            crash = ask(ws, {**obs, "prompt": "explode please"})
        # the client learns that it failed and the id to look up; nothing of the server's insides
        assert isinstance(crash, str) and "RuntimeError" in crash
        error_id = re.search(r"error id ([0-9a-f]{12})", crash).group(1)
        for secret in ("boom", "Traceback", "/opt/secret", ".py"):
            assert secret not in crash
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert logged and "boom inside the model" in str(logged[0].exc_info[1])

        again = ask(ws, obs)  # the same connection still works
        np.testing.assert_array_equal(again["actions"][:, :7], reply["actions"][:, :7])
        assert "prev_total_ms" in again["server_timing"]  # as openpi: from the second reply on
    with client(where["url"]) as ws2:  # and so does a new one
        assert ask(ws2, obs)["actions"].shape == (4, 8)
    assert server.requests == 7 and server.errors == 4


def test_degenerate_images_and_a_huge_prompt_are_answered_and_the_connection_kept(serve):
    policy = StandInPolicy()
    _, where = serve(policy)
    obs = libero_obs()
    with client(where["url"]) as ws:
        for shape, message in [((1, 10000, 3), "too small"), ((3, 224, 3), "too small"),
                               ((16, 2048, 3), "too elongated"), ((2049, 16, 3), "too large")]:
            reply = ask(ws, {**obs, "observation/image": np.zeros(shape, np.uint8)})
            assert isinstance(reply, str) and message in reply and str(shape) in reply
        # 8 MB of prompt with an out-of-range float image: refused for the prompt, pixels unread
        reply = ask(ws, {**obs, "prompt": "pick " * 1_600_000,
                         "observation/image": np.full((32, 32, 3), 2.0, np.float32)})
        assert isinstance(reply, str) and "8000000 characters; the limit is 2048" in reply
        assert ask(ws, obs)["actions"].shape == (4, 8)


def test_an_oversized_message_is_refused_unread_and_other_clients_are_served(serve):
    policy = StandInPolicy()
    server, where = serve(policy, max_message_bytes=64 * 1024)
    obs = libero_obs()
    with client(where["url"]) as other, client(where["url"]) as hostile:
        big = protocol.packb({**obs, "observation/image": np.zeros((600, 600, 3), np.uint8)})
        assert len(big) > 1_000_000
        assert_refused_unread(hostile, big)
        reply = ask(other, obs)  # the other client, after the oversized message
        assert reply["actions"].shape == (4, 8)
    assert policy.prepared == 1  # the oversized message was never decoded
    for _ in range(600):  # the hostile handler notes the refusal when its connection ends
        if server.oversized:
            break
        time.sleep(0.05)
    assert server.oversized == 1 and server.requests == 1


def test_a_request_being_decoded_does_not_block_another_client(serve):
    """Client A's request (a large image) is held while it is checked and converted; client
    B's request is answered meanwhile. Were decoding on the event loop or behind the model,
    B's reply could only come after A's was released."""
    policy = StandInPolicy()
    _, where = serve(policy)
    obs = libero_obs()
    with client(where["url"]) as a, client(where["url"]) as b:
        big = {**obs, "observation/image": np.zeros((2048, 2048, 3), np.uint8), "prompt": "hold in prepare"}
        a.send(protocol.packb(big))
        assert policy.in_prepare.wait(60)
        assert ask(b, obs)["actions"].shape == (4, 8)  # while A's request is still held
        assert not policy.release_prepare.is_set()
        policy.release_prepare.set()
        assert protocol.unpackb(a.recv(timeout=60))["actions"].shape == (4, 8)


def test_infer_ms_is_the_inference_alone_and_queue_ms_the_wait_behind_others(serve):
    clock = FakeClock()
    policy = StandInPolicy(clock)
    server, where = serve(policy, clock=clock)
    obs = libero_obs()
    with client(where["url"]) as a, client(where["url"]) as b:
        a.send(protocol.packb({**obs, "prompt": "hold in predict"}))
        assert policy.in_predict.wait(60)
        b.send(protocol.packb(obs))
        for _ in range(1200):  # B's request checked and queued behind A's inference
            if server.waiting == 1:
                break
            time.sleep(0.05)
        assert server.waiting == 1
        policy.release_predict.set()  # A's inference "takes" 1.005 s of the fake clock
        first = protocol.unpackb(a.recv(timeout=60))["server_timing"]
        second = protocol.unpackb(b.recv(timeout=60))["server_timing"]
    assert first["infer_ms"] == pytest.approx(1005.0) and first["queue_ms"] == pytest.approx(0.0)
    assert second["infer_ms"] == pytest.approx(5.0)  # its own inference only (openpi's measure)
    assert second["queue_ms"] == pytest.approx(1005.0)


def test_each_connection_has_its_own_noise_and_can_reset_it(serve):
    _, where = serve(StandInPolicy())
    obs = libero_obs()
    noise = lambda reply: reply["actions"][:, 7]  # noqa: E731
    with client(where["url"]) as a:
        a1, a2 = noise(ask(a, obs)), noise(ask(a, obs))
        assert not np.array_equal(a1, a2)
        with client(where["url"]) as b:  # a second client starts from the seed, as A did
            np.testing.assert_array_equal(noise(ask(b, obs)), a1)
        assert ask(a, {"reset": True}) == {"reset": True, "seed": 0}
        np.testing.assert_array_equal(noise(ask(a, obs)), a1)
        assert ask(a, {"reset": True, "seed": np.int64(5)}) == {"reset": True, "seed": 5}
        np.testing.assert_array_equal(noise(ask(a, obs)),
                                      torch.randn(4, generator=torch.Generator().manual_seed(5)).numpy())
        bad = ask(a, {"reset": True, "seed": "five"})
        assert isinstance(bad, str) and "'seed'" in bad
        assert ask(a, {"reset": np.bool_(True)}) == {"reset": True, "seed": 0}  # a NumPy bool too
        bad = ask(a, {"reset": 1, "seed": 0})
        assert isinstance(bad, str) and "reset request" in bad


def test_hostile_probe_reports_the_refusal_and_the_other_clients_round_trips(serve):
    _, where = serve(StandInPolicy(), max_message_bytes=64 * 1024)
    big = protocol.packb({**libero_obs(), "observation/image": np.zeros((600, 600, 3), np.uint8)})
    good_frame = protocol.packb(libero_obs())
    with hostile_probe._connect(where["url"]) as good:
        result = hostile_probe.probe(where["url"], big, good, good_frame, timeout=60)
        assert result["outcome"] == "connection closed by the server (code 1009)"
        assert result["good_client_requests"] >= 1 and "good_client_error" not in result
        small = protocol.packb({**libero_obs(), "observation/image": np.zeros((3, 224, 3), np.uint8)})
        refused = hostile_probe.probe(where["url"], small, good, good_frame, timeout=60)
        assert refused["outcome"].startswith("bad request: 'observation/image'")


def test_health_check(serve):
    _, where = serve(StandInPolicy())
    with urllib.request.urlopen(where["http"] + "/healthz", timeout=5) as resp:
        assert resp.status == 200 and resp.read() == b"OK\n"


def test_a_taken_port_is_reported_before_the_model_is_loaded():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as err:
            bind("127.0.0.1", port)
        assert err.value.errno == errno.EADDRINUSE
        # a model directory that does not exist: had the model been loaded first, that would be
        # the error; the port is checked first
        proc = subprocess.run([sys.executable, "-m", "pisft", "serve", "--model", "/nonexistent/model",
                               "--port", str(port), "--device", "cpu"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr
    assert "not found" not in proc.stderr
