"""A worker's connection to one broker.

A deployment may split its requests over several brokers (shards, each owning a slice of the
requests; see ``deploy``). A worker serves them all: it holds one link per broker, registers with
each, keeps a PULL parked at each and builds its batch from whatever they send, and answers each
task to the broker that sent it. Nothing here coordinates the shards: each link is the whole
protocol with one broker, as a worker of a one-broker deployment speaks it.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from nebula_flow import protocol, zmq_frames
from nebula_flow.broker_link import HANDSHAKE_FAILED, handshake_failed
from nebula_flow.protocol import Msg
from nebula_flow.security import Identity, make_client


class BrokerLink:
    """One broker's socket and what the worker knows of that conversation: registered or not, the
    PULL parked there (None, "busy": sent while computing, or "idle"), when each side last spoke,
    and how long to wait before reconnecting to a silent broker.

    Two threads use the socket: the main thread, and the compute thread, which sends each batch's
    RESULT itself the moment the batch ends and, while it has no batch, waits for the next TASKS
    itself (``workers/worker.py``: a thread handoff cost a wake-up on every round's critical path).
    A ZeroMQ socket may change threads behind a full memory barrier: every use holds ``lock``. The
    threads poll the socket's ``ZMQ_FD`` (``wait``) rather than the socket, so neither ever waits
    inside it: that file descriptor only says "look again" (edge-triggered), so whoever used the
    socket last checks ``readable`` (``ZMQ_EVENTS``) before the thread listening sleeps, and wakes
    it when a message waits."""

    def __init__(self, address: str, identity: Identity | None) -> None:
        self.address, self.identity = address, identity
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # (connections and failed handshakes: what a silent broker's address holds)
        self.refused: int | None = None
        self.reached = False  # a connection was made to the address since ``connect`` (something listens there)
        self.fd: int | None = None
        self.lock = threading.Lock()
        self.registered = False
        self.register_sent = 0.0
        self.pull_out: str | None = None
        self.last_heard = self.last_sent = time.monotonic()
        self.backoff = 1.0
        self.worker_id = 0  # this worker's number at that broker (WELCOME)

    def connect(self) -> None:
        """A fresh DEALER (a new identity: the broker sees a new worker); the caller registers."""
        with self.lock:
            self._close_monitor()
            if self.sock is not None:
                self.sock.close(linger=0)
            self.sock = zmq.Context.instance().socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 2000)
            if self.identity:
                make_client(self.sock, self.identity)
            self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_CONNECTED)
            self.refused, self.reached = None, False
            self.sock.connect(self.address)
            self.fd = self.sock.getsockopt(zmq.FD)
        self.last_heard = time.monotonic()
        self.registered, self.pull_out = False, None

    def send(self, msg: Msg) -> None:
        frames = protocol.encode(msg)
        with self.lock:
            zmq_frames.send(self.sock, frames)
        self.last_sent = time.monotonic()

    def readable(self) -> bool:
        """A message waits (``ZMQ_EVENTS``: also what re-arms ``fd``)."""
        with self.lock:
            return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def receive(self) -> list[list[Any]]:
        """Every message waiting, in order (all of them: ``fd`` will not say so again)."""
        out = []
        with self.lock:
            while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                out.append(zmq_frames.recv(self.sock, zmq_frames.NOBLOCK))
        return out

    def silent_for(self, now: float) -> float:
        return now - self.last_heard

    def refusal(self) -> str:
        """Why a silent broker's address failed this worker, as " (...)": nothing accepted a
        connection there, or its handshakes failed (else "")."""
        while self.monitor is not None and self.monitor.poll(0):
            kind = parse_monitor_message(self.monitor.recv_multipart())["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.reached = True
            else:
                self.refused = kind
        if self.refused is not None:
            return f" ({handshake_failed(self.refused, self.identity is not None, 'worker')})"
        return "" if self.reached else (" (nothing accepts connections there: no broker runs at that address yet, "
                                        "or it is not reachable from this host)")

    def _close_monitor(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None

    def close(self) -> None:
        with self.lock:
            self._close_monitor()
            if self.sock is not None:
                self.sock.close()


def wait(links: list[BrokerLink], wake_fd: int, timeout_s: float) -> None:
    """Sleep until ``wake_fd`` is written or a message may wait on one of ``links`` (none: only
    the former), ``timeout_s`` at most. The caller checks ``readable`` first (edge-triggered)."""
    poll = select.poll()
    poll.register(wake_fd, select.POLLIN)
    for link in links:
        poll.register(link.fd, select.POLLIN)
    if any(fd == wake_fd for fd, _ in poll.poll(max(1, int(timeout_s * 1000) + 1))):
        os.read(wake_fd, 64)
