"""Issue 22, item 2: a model that answers NaN or inf actions is never served."""

from __future__ import annotations

import logging

import pytest

import numpy as np
from test_serve_protocol import StandInPolicy, ask, client, libero_obs, serve  # noqa: F401 - the fixture

from pisft.serve import policy_server


class NaNPolicy(StandInPolicy):
    def predict(self, batch, noise):
        out = super().predict(batch, noise)
        if "diverged" in batch["task"][0]:
            out["actions"][1, 3] = np.nan
            out["actions"][2, 0] = -np.inf
        return out


def test_non_finite_actions_are_answered_with_an_error_and_the_connection_kept(serve, caplog):  # noqa: F811
    server, where = serve(NaNPolicy())
    obs = libero_obs()
    with client(where["url"]) as ws:
        with caplog.at_level(logging.ERROR, logger="pisft.serve"):
            reply = ask(ws, {**obs, "prompt": "diverged"})
        assert isinstance(reply, str) and reply.startswith("model error: the model returned non-finite actions")
        assert "1 NaN and 1 infinite of 32 values" in reply and "not served" in reply
        assert any("non-finite" in r.getMessage() for r in caplog.records)
        ok = ask(ws, obs)  # the connection still serves finite answers
        assert np.isfinite(ok["actions"]).all() and ok["actions"].shape == (4, 8)
    assert server.errors == 1 and server.non_finite == 1 and server.requests == 2


def test_the_finiteness_check():
    assert policy_server._non_finite(np.zeros((4, 7), np.float32)) is None
    assert policy_server._non_finite(np.array([1.0, np.nan, np.inf])) == "1 NaN and 1 infinite of 3 values"
    assert "not an array of numbers" in policy_server._non_finite(np.array(["a"]))
    assert "not an array of numbers" in policy_server._non_finite(None)


# ---- item 3: a server input costs in proportion to its bytes --------------------------------

def test_a_message_that_decodes_into_millions_of_objects_is_refused_from_its_headers(serve, monkeypatch):  # noqa: F811
    import msgpack

    from pisft.serve import protocol

    server, where = serve(StandInPolicy())
    built = []
    real_unpackb = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: built.append(1) or real_unpackb(*a, **k))
    obs = libero_obs()
    bomb = protocol.packb({**obs, "observation/state": [0] * 3_000_000})  # 3 MB, under the 32 MiB limit
    deep = b"\x91" * 1_000_000 + b"\x00"
    with client(where["url"]) as ws:
        ws.send(bomb)
        reply = ws.recv(timeout=60)
        assert reply.startswith("bad request: the message holds more than 4096 objects")
        ws.send(deep)
        assert ws.recv(timeout=60).startswith("bad request: the message nests deeper than 32 levels")
        assert built == []  # refused from the headers: nothing was decoded
        ok = ask(ws, obs)  # the connection is kept and an ordinary request is answered
        assert ok["actions"].shape == (4, 8)
    assert server.errors == 2


def test_the_structure_check_counts_what_msgpack_builds():
    import msgpack

    from pisft.serve import protocol

    rng = np.random.default_rng(0)

    def value(depth):
        kind = int(rng.integers(0, 8 if depth < 4 else 6))
        if kind == 0:
            return None
        if kind == 1:
            return True
        if kind == 2:
            return int(rng.integers(-2**40, 2**40))
        if kind == 3:
            return float(rng.normal())
        if kind == 4:
            return "t" * int(rng.integers(0, 300))
        if kind == 5:
            return b"b" * int(rng.integers(0, 70000))
        if kind == 6:
            return [value(depth + 1) for _ in range(rng.integers(0, 20))]
        return {f"k{i}": value(depth + 1) for i in range(rng.integers(0, 20))}

    def count(v):
        if isinstance(v, list):
            return 1 + sum(count(x) for x in v)
        if isinstance(v, dict):
            return 1 + sum(1 + count(x) for x in v.values())
        return 1

    for _ in range(200):
        v = value(0)
        data = msgpack.packb(v, use_bin_type=True)
        assert protocol.check_structure(data, max_objects=10**7) == count(v)
    arrays = protocol.packb({"a": np.zeros((2, 3), np.float32), "s": np.float64(1.0)})
    # top map, "a", array map (4 keys, flag, data, dtype, shape list of 2), "s", a float (msgpack packs
    # np.float64 as its own float)
    assert protocol.check_structure(arrays) == 1 + 1 + (1 + 4 + 3 + 3) + 1 + 1


def test_connections_over_the_cap_are_closed_at_once_and_ordinary_clients_served(serve):  # noqa: F811
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server, where = serve(StandInPolicy(), max_connections=2)
    obs = libero_obs()
    with client(where["url"]) as a, client(where["url"]) as b:
        with connect(where["url"], compression=None, max_size=None) as extra, \
                pytest.raises(ConnectionClosed) as closed:
            extra.recv(timeout=60)
        assert closed.value.rcvd.code == 1013 and "--max-connections" in closed.value.rcvd.reason
        assert ask(a, obs)["actions"].shape == (4, 8) and ask(b, obs)["actions"].shape == (4, 8)
    assert server.refused_connections == 1
    with client(where["url"]) as c:  # once one closed, a new one is accepted
        assert ask(c, obs)["actions"].shape == (4, 8)


def test_decodes_beyond_the_cap_wait_their_turn(serve):  # noqa: F811
    import threading

    policy = StandInPolicy()
    server, where = serve(policy, max_decodes=1)
    obs = libero_obs()
    replies = {}

    def send(name, request):
        with client(where["url"]) as ws:
            replies[name] = ask(ws, request)

    held = threading.Thread(target=send, args=("held", {**obs, "prompt": "hold in prepare"}))
    held.start()
    assert policy.in_prepare.wait(60)  # the one decode slot is taken
    other = threading.Thread(target=send, args=("other", obs))
    other.start()
    while server.decodes_waiting != 1:  # the second message waits for the slot (a condition, not a time)
        assert other.is_alive()
        threading.Event().wait(0.01)
    assert policy.prepared == 1  # ...and has not been decoded beside the first
    policy.release_prepare.set()
    held.join(60)
    other.join(60)
    assert replies["held"]["actions"].shape == replies["other"]["actions"].shape == (4, 8)
    assert policy.prepared == 2


@pytest.mark.parametrize("seed", [2**63, -1, 2**70])
def test_a_reset_with_a_seed_out_of_range_is_a_bad_request(serve, seed):  # noqa: F811
    import msgpack

    server, where = serve(StandInPolicy())
    with client(where["url"]) as ws:
        ws.send(msgpack.packb({"reset": True, "seed": seed}) if seed < 2**64 else
                b"\x82\xa5reset\xc3\xa4seed\xcb" + np.float64(seed).tobytes()[::-1])
        reply = ws.recv(timeout=60)
        assert isinstance(reply, str) and reply.startswith("bad request:") and "seed" in reply
        assert "internal error" not in reply
        assert protocol_reset_ok(ws)


def protocol_reset_ok(ws) -> bool:
    from pisft.serve import protocol

    ws.send(protocol.packb({"reset": True, "seed": 5}))
    return protocol.unpackb(ws.recv(timeout=60)) == {"reset": True, "seed": 5}
