"""Issue 22, item 2: a model that answers NaN or inf actions is never served."""

from __future__ import annotations

import logging

import numpy as np
from test_serve_protocol import StandInPolicy, ask, client, libero_obs, serve  # noqa: F401 - the fixture

from pisft.serve import server as server_mod


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
    assert server_mod._non_finite(np.zeros((4, 7), np.float32)) is None
    assert server_mod._non_finite(np.array([1.0, np.nan, np.inf])) == "1 NaN and 1 infinite of 3 values"
    assert "not an array of numbers" in server_mod._non_finite(np.array(["a"]))
    assert "not an array of numbers" in server_mod._non_finite(None)
