"""A TCP port for a rendezvous, held until the process that listens on it is done with it.

Choosing a free port by binding port 0 and closing the socket leaves a window in which anything
else on the host (another torchrun, a connection's ephemeral port) can take it before the process
that needs it binds it; that process then fails to bind, or its peers meet a stranger. A port of
`held_port()` stays bound by this process while the caller needs it, without listening:

- Linux lets no other socket bind it, except one that sets SO_REUSEADDR too while neither listens
  (socket(7), SO_REUSEADDR: "a socket may bind, except when there is an active listening socket
  bound to the address"); a bind to port 0 and a connect's ephemeral port skip a port something
  is bound to.
- torch's TCPStore server (the rendezvous store of torchrun's static rendezvous at node 0,
  torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py, and of `init_process_group`'s
  env://) sets SO_REUSEADDR before it binds, in both its backends (libuv's uv_tcp_bind always
  sets it; c10d's own socket.cpp sets it on a listening socket), so it binds the held port.
  `tests/test_ports.py` checks both, and that a plain bind is refused.

The holder never listens, so every connection to the port reaches the store.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A free port on `host`, kept from everything but a SO_REUSEADDR listener (a TCPStore) until
    the block ends: start the process that listens on it inside the block."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, 0))
        yield int(holder.getsockname()[1])
