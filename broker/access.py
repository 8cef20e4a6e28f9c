"""Who may talk to the broker, and about what: CURVE by role on its two sockets, the worker key
a registration must hold, whose a request is, and the metrics server's token
(docs/security.md)."""

from __future__ import annotations

from pathlib import Path

import zmq

from nebula_flow.options import BrokerOptions
from nebula_flow.protocol import ProtocolError, Register
from nebula_flow.security import (
    Identity,
    SecurityError,
    is_loopback,
    keys_dir,
    make_server,
    server_key_of,
    start_authenticator,
    user_id,
)


class Access:
    """The broker's keys and the keys it accepts (none without a key folder: local trust)."""

    def __init__(self, opts: BrokerOptions) -> None:
        folder = keys_dir(opts.keys)
        if folder is None and not is_loopback(opts.host):
            raise SecurityError(f"binding to {opts.host} (off loopback) requires CURVE keys: "
                                "create them with `nebula-flow keys DIR` and pass --keys DIR")
        self.me = Identity.load(folder, "broker", "broker") if folder else None
        # (with keys: each socket accepts its own role's keys only, and revoked ones no longer)
        self.auth, self.authorized = start_authenticator(folder) if folder else (None, None)

    def secure(self, sock: zmq.Socket, accepts: str) -> None:
        """Make ``sock`` a CURVE server taking the keys of role ``accepts`` (with keys)."""
        if self.me is not None:
            make_server(sock, self.me, accepts)

    def check_worker(self, msg: Register, key: str | None) -> None:
        """A registration's key is still authorized (the handshake checked it; it may have been
        revoked since), and its KV endpoint names that same key."""
        if self.authorized is None:
            return
        if not self.authorized.allowed("workers", key):
            raise ProtocolError("unauthorized", "this worker key is not authorized (revoked?)")
        if msg.kv_endpoint and server_key_of(msg.kv_endpoint) != key:
            raise ProtocolError("malformed", "a KV endpoint must name this worker's own key")

    def revoked(self, key: str | None) -> bool:
        """A registered worker's key was taken back."""
        return self.authorized is not None and not self.authorized.allowed("workers", key)

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()


def owner_of(identity: bytes, frame: zmq.Frame, session: str | None) -> str:
    """Who a client message comes from, for request ownership: its CURVE key where keys are on,
    else the secret session its client library sends; a client that sends none is its connection."""
    key = user_id(frame)
    if key is not None:
        return "key:" + key
    return "session:" + session if session else "connection:" + identity.hex()


def metrics_token(opts: BrokerOptions) -> str | None:
    """The metrics server's token (read once, never logged); refuses metrics off loopback without one."""
    if opts.metrics_token_file:
        token = Path(opts.metrics_token_file).read_text().strip()
        if len(token) < 16:
            raise SecurityError(f"the metrics token in {opts.metrics_token_file} is too short (16 characters at least)")
        return token
    if not is_loopback(opts.metrics_host):
        raise SecurityError(f"metrics on {opts.metrics_host} (off loopback) require a token: --metrics-token-file FILE")
    return None

