"""CURVE authentication with separate roles, required whenever a socket leaves loopback.

``nebula-flow keys DIR`` writes a key folder; ``keys DIR add-worker NAME`` / ``add-client NAME``
add one keypair each, ``keys DIR revoke NAME`` takes one back::

    DIR/broker.key, broker.key_secret            the broker (clients and workers verify it)
    DIR/workers/NAME.key, NAME.key_secret        one per worker (a deployment makes its workers')
    DIR/clients/NAME.key, NAME.key_secret        one per client ("client" made by `keys DIR`)
    DIR/authorized/workers/NAME.key              accepted on the broker's worker socket and by KV servers
    DIR/authorized/clients/NAME.key              accepted on the broker's client socket
    DIR/revoked/                                 keypairs taken back (kept for the record)

Each socket accepts only its role's keys (a ZAP domain per socket): a client key cannot register
as a worker or read KV, a worker key cannot submit requests. A worker's KV server uses the
worker's own keypair and names its public key in its endpoint (``tcp://H:P;curve:KEY``), so a
puller verifies the holder it reaches. Revoking a key refuses its next connection and the broker
drops a worker whose key was revoked within a second. Secret keys are read once and never
logged. The UCX KV transport has no such authentication: with keys, KV moves over ZeroMQ + CURVE.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ROLES = {"worker": "workers", "client": "clients"}  # a party's role -> its folder and ZAP domain
KEY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
CLIENT_KEY_ENV = "NEBULA_FLOW_CLIENT_KEY"  # which client keypair a client uses (default "client")


class SecurityError(ValueError):
    """Keys are missing or a socket would leave loopback without them."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def keys_dir(explicit: str | None) -> Path | None:
    value = explicit or os.environ.get("NEBULA_FLOW_KEYS")
    return Path(value) if value else None


def _check_name(name: str) -> None:
    if not KEY_NAME.fullmatch(name) or name.startswith("."):
        raise SecurityError(f"key name {name!r} must be 1-64 letters, digits, '_', '.', '-'")


def generate_keys(folder: str | Path) -> Path:
    """A new key folder: the broker's keypair, a worker key "worker" and a client key "client"."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    if not (folder / "broker.key_secret").exists():
        zmq.auth.create_certificates(str(folder), "broker")
    for role in ("worker", "client"):
        ensure_key(folder, role, role)
    return folder


def add_key(folder: str | Path, role: str, name: str) -> Path:
    """A new keypair for one worker or client, authorized for its role; its secret key file."""
    _check_name(name)
    folder = Path(folder)
    if not (folder / "broker.key").is_file():
        raise SecurityError(f"{folder} is not a key folder (create it with `nebula-flow keys {folder}`)")
    mine = folder / ROLES[role]
    if (mine / f"{name}.key_secret").exists():
        raise SecurityError(f"{role} key {name!r} exists already in {mine}")
    mine.mkdir(exist_ok=True)
    authorized = folder / "authorized" / ROLES[role]
    authorized.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(mine), name)
    shutil.copy(public, authorized / f"{name}.key")
    return Path(secret)


def ensure_key(folder: Path, role: str, name: str) -> None:
    """``add_key`` unless the keypair exists (a revoked one was moved away: a new key is made)."""
    if not (folder / ROLES[role] / f"{name}.key_secret").exists():
        add_key(folder, role, name)


def revoke(folder: str | Path, name: str, role: str | None = None) -> list[str]:
    """Take back the key(s) named ``name`` (of ``role``, or of either role): no longer authorized,
    the keypair moved to ``revoked/``. Returns what was revoked ("worker NAME", ...)."""
    _check_name(name)
    folder, done = Path(folder), []
    for r in [role] if role else list(ROLES):
        authorized = folder / "authorized" / ROLES[r] / f"{name}.key"
        if not authorized.exists():
            continue
        authorized.unlink()
        gone = folder / "revoked" / f"{time.strftime('%Y%m%d-%H%M%S')}-{r}-{name}"
        gone.mkdir(parents=True, exist_ok=True)
        for suffix in (".key", ".key_secret"):
            if (folder / ROLES[r] / f"{name}{suffix}").exists():
                shutil.move(str(folder / ROLES[r] / f"{name}{suffix}"), str(gone / f"{name}{suffix}"))
        done.append(f"{r} {name}")
    return done


def _load(folder: Path, role: str, name: str) -> tuple[bytes, bytes]:
    secret = folder / "broker.key_secret" if role == "broker" else folder / ROLES[role] / f"{name}.key_secret"
    if not secret.is_file():
        if (folder / "worker.key_secret").exists():  # (one key for every worker, every socket open to all)
            raise SecurityError(f"{folder} is a key folder of the old layout, whose keys take every role: make "
                                "a new one with `nebula-flow keys NEW_DIR` (docs/security.md)")
        how = f"`nebula-flow keys {folder}`" if role == "broker" else f"`nebula-flow keys {folder} add-{role} {name}`"
        raise SecurityError(f"no {role} key {name!r}: {secret} not found (create it with {how})")
    return zmq.auth.load_certificate(str(secret))


@dataclass(frozen=True)
class Identity:
    """A process's keys, read once: its role's keypair ``name`` from the key folder, and the
    broker's public key. (The secret key never shows in a repr, so never in a log.)"""

    folder: Path
    role: str
    name: str
    public: bytes
    secret: bytes = field(repr=False)
    broker_public: bytes = field(repr=False)

    @classmethod
    def load(cls, folder: Path, role: str, name: str) -> Identity:
        public, secret = _load(folder, role, name)
        broker_public = zmq.auth.load_certificate(str(folder / "broker.key"))[0]
        return cls(folder, role, name, public, secret, broker_public)


class AuthorizedKeys:
    """The public keys each role may connect with, read from ``authorized/ROLE`` again whenever
    that folder changes (one ``stat`` per look), so a revocation takes effect without a restart.
    Also pyzmq's credentials provider: ``callback`` answers each CURVE handshake."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.lock = threading.Lock()
        self.keys: dict[str, tuple[int, set[str]]] = {}  # domain -> (folder mtime in ns, z85 keys)

    def allowed(self, domain: str, z85_key: str | bytes | None) -> bool:
        if z85_key is None:
            return False
        key = z85_key.decode() if isinstance(z85_key, bytes) else z85_key
        return key in self._current(domain)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return self.allowed(domain, z85_key)

    def _current(self, domain: str) -> set[str]:
        path = self.folder / "authorized" / domain
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return set()
        with self.lock:
            if domain not in self.keys or self.keys[domain][0] != mtime:
                self.keys[domain] = (mtime, {zmq.auth.load_certificate(str(p))[0].decode()
                                             for p in sorted(path.glob("*.key"))})
            return self.keys[domain][1]


def start_authenticator(folder: Path) -> tuple[ThreadAuthenticator, AuthorizedKeys]:
    """Answer CURVE handshakes in this process: a socket's ZAP domain ("workers" or "clients",
    set by ``make_server``) says which role's keys it accepts."""
    keys = AuthorizedKeys(folder)
    auth = ThreadAuthenticator(zmq.Context.instance())
    auth.start()
    for domain in ROLES.values():
        auth.configure_curve_callback(domain=domain, credentials_provider=keys)
    return auth, keys


def make_server(sock: zmq.Socket, me: Identity, accepts: str) -> None:
    """CURVE server with ``me``'s keys, accepting the keys of role ``accepts``."""
    sock.zap_domain = ROLES[accepts].encode()
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = me.public, me.secret, True


def make_client(sock: zmq.Socket, me: Identity, server_key: str | None = None) -> None:
    """CURVE client with ``me``'s keys, talking to the broker (or to the server whose public
    key is ``server_key``)."""
    sock.curve_publickey, sock.curve_secretkey = me.public, me.secret
    sock.curve_serverkey = server_key.encode() if server_key else me.broker_public


def client_key_name() -> str:
    return os.environ.get(CLIENT_KEY_ENV) or "client"


def with_server_key(endpoint: str, z85_key: str) -> str:
    """A KV endpoint naming its server's public key (a puller verifies whom it reaches)."""
    return f"{endpoint};curve:{z85_key}"


def server_key_of(endpoint: str) -> str | None:
    return next((part[len("curve:"):] for part in endpoint.split(";") if part.startswith("curve:")), None)


def user_id(frame: zmq.Frame | bytes) -> str | None:
    """The CURVE public key (z85) a message came with; None without CURVE (or for bytes that
    did not come off a socket)."""
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None
