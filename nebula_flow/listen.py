"""The HTTP gateway's listening socket, bound before the server starts: a port that cannot be
bound is then one clear error (``OSError``: which address, and why) instead of uvicorn's log
line and exit from inside its event loop, and ``serve`` can say so before starting a gateway."""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: any free port), not yet listening; ``OSError``
    naming the address when it cannot be bound (taken, or not this host's)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"the HTTP API cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own: a restart reuses the port at once)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"the HTTP API cannot listen on {host}:{port}: {exc.strerror.lower()}") from None
    return sock
