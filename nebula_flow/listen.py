"""Sockets a process listens on, bound with one clear error (``OSError``: which address, and why)
where they cannot be: the HTTP gateway's, bound before uvicorn starts (whose own failure is a log
line and an exit from inside its event loop), so ``serve`` can say so before starting anything;
and the broker's."""

from __future__ import annotations

import socket

import zmq

from nebula_flow.security import is_loopback


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


def bind_zmq(sock: zmq.Socket, address: str) -> None:
    """``sock.bind(address)``, or ``OSError`` naming the address and why (a broker's port that is
    taken: one line instead of a traceback; ``deploy`` reads its "Address already in use" to pick
    other ports)."""
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot listen on {address}: {zmq.strerror(exc.errno)}") from None


def route_to(addresses: list[str]) -> str:
    """The address of this host's interface that reaches the first of ``addresses`` (ZeroMQ
    ``tcp://HOST:PORT``) off loopback: where a worker's KV server listens unless told, so that peers
    on other hosts can reach it as they reach the broker; ``127.0.0.1`` where every address is on
    loopback (or ``ipc://``). No packet is sent: a UDP socket's connect only picks the route.
    ``ValueError`` (what a worker's options say wrong, in words) where the host cannot be resolved
    or routed to."""
    for address in addresses:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        host = host.strip("[]")
        if not address.startswith("tcp://") or is_loopback(host):
            continue
        try:
            family, _, _, _, where = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(where)
                local = probe.getsockname()[0]
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot tell which interface reaches the broker at {address}: {exc}; give --kv-host") from None
        if family != socket.AF_INET:  # (the KV servers listen on IPv4)
            raise ValueError(f"the broker at {address} is reached over IPv6: give --kv-host, an IPv4 address peers reach")
        return local
    return "127.0.0.1"
