"""CURVE authentication for every ZeroMQ socket, required whenever a socket leaves loopback.

``nebula-flow keys DIR`` writes one keypair per party::

    DIR/broker.key, broker.key_secret     the broker's sockets (clients and workers verify it)
    DIR/worker.key, worker.key_secret     workers: to the broker, and as KV servers to each other
    DIR/client.key, client.key_secret     clients
    DIR/authorized/                       public keys the broker and KV servers accept

Give a client or worker the folder with its own secret key and the public keys (``--keys DIR``
or ``NEBULA_FLOW_KEYS``); a party whose public key is not in ``authorized/`` cannot connect.
The UCX KV transport has no such authentication: with keys, KV moves over ZeroMQ + CURVE.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

PARTIES = ("broker", "worker", "client")


class SecurityError(ValueError):
    """Keys are missing or a socket would leave loopback without them."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def generate_keys(folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "authorized").mkdir(exist_ok=True)
    for party in PARTIES:
        public, _secret = zmq.auth.create_certificates(str(folder), party)
        shutil.copy(public, folder / "authorized" / Path(public).name)
    os.chmod(folder, 0o700)
    return folder


def keys_dir(explicit: str | None) -> Path | None:
    value = explicit or os.environ.get("NEBULA_FLOW_KEYS")
    return Path(value) if value else None


def _load(folder: Path, party: str) -> tuple[bytes, bytes]:
    secret = folder / f"{party}.key_secret"
    if not secret.is_file():
        raise SecurityError(f"{secret} not found (create keys with `nebula-flow keys {folder}`)")
    return zmq.auth.load_certificate(str(secret))


def start_authenticator(folder: Path) -> ThreadAuthenticator:
    """Accept only CURVE clients whose public key is in ``folder/authorized``."""
    auth = ThreadAuthenticator(zmq.Context.instance())
    auth.start()
    auth.configure_curve(domain="*", location=str(folder / "authorized"))
    return auth


def make_server(sock: zmq.Socket, folder: Path, party: str) -> None:
    public, secret = _load(folder, party)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True


def make_client(sock: zmq.Socket, folder: Path, party: str, server: str = "broker") -> None:
    public, secret = _load(folder, party)
    server_public, _ = zmq.auth.load_certificate(str(folder / f"{server}.key"))
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
