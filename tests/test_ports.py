"""pisft.ports.held_port: the port it holds is refused to anything but a SO_REUSEADDR listener,
and torch's TCPStore (the rendezvous of torchrun at node 0 and of env://) binds it in both backends."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from pisft.ports import held_port


def test_a_held_port_is_refused_to_a_plain_bind_and_to_port_0():
    with held_port() as port:
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))
        handed_out = set()
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                handed_out.add(s.getsockname()[1])
        assert port not in handed_out
    with socket.socket() as after:  # released at the end of the block
        after.bind(("127.0.0.1", port))


@pytest.mark.parametrize("libuv", [True, False])
def test_torch_tcpstore_binds_a_held_port_and_its_clients_reach_it(libuv):
    with held_port() as port:
        server = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), use_libuv=libuv,
                               wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30), use_libuv=libuv)
        server.set("rendezvous", "met")
        assert client.get("rendezvous") == b"met"
        del client, server
