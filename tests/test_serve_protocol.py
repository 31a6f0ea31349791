"""The websocket policy protocol: msgpack-numpy framing, metadata, errors, server survival."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import msgpack
import numpy as np
import pytest
import torch
from websockets.sync.client import connect

from pisft.serve import observations, protocol
from pisft.serve.server import PolicyServer


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
    assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
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
    (lambda o: o.__setitem__("observation/wrist_image", np.full((8, 8, 3), 2.0)), r"\[0, 1\]"),
    (lambda o: o.__setitem__("observation/state", np.full(8, np.nan)), "NaN"),
])
def test_malformed_observations_name_the_key(mutate, message):
    obs = libero_obs()
    mutate(obs)
    with pytest.raises(observations.ObservationError, match=message):
        observations.to_batch(obs, image_features=FEATURES, state_dim=8)


# ---- server over a real websocket ----------------------------------------------------------

class MeanImagePolicy:
    """A stand-in policy: its action chunk depends on the observation, so a mixed-up request
    would show. Uses the real observation mapping, so malformed requests fail as they would."""

    metadata = {"action_horizon": 4, "action_dim": 7}

    def infer(self, obs: dict) -> dict:
        batch = observations.to_batch(obs, image_features=FEATURES, state_dim=8)
        level = float(batch[observations.BASE_IMAGE].mean())
        state = batch[observations.STATE][0].numpy()
        actions = np.tile(np.concatenate([state[:6], [level]]), (4, 1)).astype(np.float32)
        if "explode" in batch["task"][0]:
            raise RuntimeError("boom inside the model")
        return {"actions": actions}


@pytest.fixture
def running_server():
    server = PolicyServer(MeanImagePolicy(), host="127.0.0.1", port=0)
    ready = threading.Event()
    where: dict = {}
    loop = asyncio.new_event_loop()
    stop = loop.create_future()

    def on_ready(host, port):
        where["url"] = f"ws://{host}:{port}"
        where["http"] = f"http://{host}:{port}"
        ready.set()

    thread = threading.Thread(target=lambda: loop.run_until_complete(server.run(on_ready=on_ready, stop=stop)),
                              daemon=True)
    thread.start()
    assert ready.wait(10), "server did not start"
    yield server, where
    loop.call_soon_threadsafe(stop.set_result, None)
    thread.join(10)
    loop.close()


def test_metadata_then_actions_then_error_then_actions_again(running_server):
    server, where = running_server
    with connect(where["url"], compression=None, max_size=None) as ws:
        assert protocol.unpackb(ws.recv()) == {"action_horizon": 4, "action_dim": 7}
        obs = libero_obs()
        ws.send(protocol.packb(obs))
        reply = protocol.unpackb(ws.recv())
        assert reply["actions"].shape == (4, 7) and reply["actions"].dtype == np.float32
        np.testing.assert_allclose(reply["actions"][0, :6], obs["observation/state"][:6], rtol=1e-6)
        assert reply["server_timing"]["infer_ms"] >= 0

        bad = dict(obs)
        del bad["observation/state"]
        ws.send(protocol.packb(bad))
        error = ws.recv()
        assert isinstance(error, str) and "observation/state" in error

        ws.send(b"\xc1garbage")
        assert "not a msgpack message" in ws.recv()
        ws.send("a text frame")
        assert "binary" in ws.recv()

        ws.send(protocol.packb({**obs, "prompt": "explode please"}))
        crash = ws.recv()
        assert isinstance(crash, str) and "boom inside the model" in crash

        ws.send(protocol.packb(obs))  # the same connection still works
        again = protocol.unpackb(ws.recv())
        np.testing.assert_array_equal(again["actions"], reply["actions"])
    with connect(where["url"]) as ws2:  # and so does a new one
        ws2.recv()
        ws2.send(protocol.packb(obs))
        assert protocol.unpackb(ws2.recv())["actions"].shape == (4, 7)
    assert server.requests == 7 and server.errors == 4


def test_health_check(running_server):
    _, where = running_server
    with urllib.request.urlopen(where["http"] + "/healthz", timeout=5) as resp:
        assert resp.status == 200 and resp.read() == b"OK\n"
