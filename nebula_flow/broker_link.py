"""The client library's connection to one broker (a shard's, in a sharded deployment): its DEALER
socket, a monitor of the connection, and what the monitor's events say (``Link``): whether the
connection is up, and when one that dropped is made again (a restarted broker)."""

from __future__ import annotations

import time
from collections import deque

import zmq
from zmq.utils.monitor import parse_monitor_message

from nebula_flow.protocol import Msg

# what answers at the address, but not as a broker: an HTTP server (the HTTP API's port, say), or a
# broker that refused this client's CURVE keys
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def connect(ctx: zmq.Context, address: str, keys: str | None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER to the broker (CURVE when a key folder is given, or NEBULA_FLOW_KEYS is set: the
    client keypair named by NEBULA_FLOW_CLIENT_KEY, default "client") and a monitor of its
    connection (see ``Link``)."""
    from nebula_flow.security import Identity, client_key_name, keys_dir, make_client

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # ZMTP heartbeats: a broker that vanished without closing its connection (host down) still
    # reads as a dropped connection within seconds
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
    folder = keys_dir(keys)
    if folder is not None:
        make_client(sock, Identity.load(folder, "client", client_key_name()))
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
    sock.connect(address)
    return sock, monitor


def handshake_failed(kind: int, secure: bool, who: str) -> str:
    """Why a connection to a broker failed its handshake (monitor event ``kind``; ``secure``: the
    ``who`` (client, worker) has a key folder), in words an operator can act on."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the broker refused this {who}'s key (not in its key folder, or revoked)"
    return "it answers, but its ZeroMQ handshake failed: " + (
        f"a broker whose key is not the one in this {who}'s key folder, a broker without keys, or no broker"
        if secure else f"a broker that uses CURVE keys (give the {who} its key folder: --keys or NEBULA_FLOW_KEYS), "
        "or no broker") + " (an HTTP port, such as the HTTP API's? HTTP clients go there)"


class Link:
    """Follows the connection to the broker from its monitor's events: ``event`` says True when
    a connection that dropped is made again (a restarted broker, which knows nothing of this
    client's requests): then the requests in flight are sent again at once (same ids: a broker
    that still runs one re-attaches), not after a timeout."""

    def __init__(self) -> None:
        self.dropped = False
        self.up = False  # (connected: its handshake done, not dropped since)
        self.refused: int | None = None  # the last failed handshake's event (ZeroMQ retries it: nothing changes)
        self.since = time.monotonic()  # when it last came up or went down

    def event(self, frames: list[bytes]) -> bool:
        kind = parse_monitor_message(frames)["event"]
        if kind & HANDSHAKE_FAILED:
            self.refused = kind
            return False
        if kind == zmq.EVENT_DISCONNECTED:
            if self.up:
                self.since = time.monotonic()
            self.dropped, self.up = True, False
            return False
        if not self.up:
            self.since = time.monotonic()
        back, self.dropped, self.up, self.refused = self.dropped, False, True, None
        return back


class Conn:
    """One broker's socket (a shard's, in a sharded deployment), its monitor and its ``Link``."""

    def __init__(self, ctx: zmq.Context, address: str, keys: str | None) -> None:
        from nebula_flow.security import keys_dir

        self.address, self.secure = address, keys_dir(keys) is not None
        self.sock, self.monitor = connect(ctx, address, keys)
        self.link = Link()
        self.poller: zmq.Poller | None = None  # (the blocking client's)
        # the blocking client's messages by request id (or ``client.STATUS``), each read by its caller
        self.boxes: dict[str, deque[Msg | None]] = {}

    def wait_up(self, deadline: float) -> bool:
        """Wait until the connection is made (its handshake done), reading the monitor's events;
        False if it is not by ``deadline`` (``time.monotonic()``), or its handshake failed
        (``Link.refused`` says why). (The blocking client's: its requests read the monitor too, so
        none is in flight.)"""
        while not self.link.up and self.link.refused is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self.monitor.poll(int(left * 1000) + 1):
                return False
            self.link.event(self.monitor.recv_multipart())
        return self.link.up

    def refusal(self) -> str | None:
        """Why the connection's handshake failed (None: it did not), in words an operator can act on."""
        return None if self.link.refused is None else handshake_failed(self.link.refused, self.secure, "client")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()
