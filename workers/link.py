"""A worker's connection to one broker.

A deployment may split its requests over several brokers (shards, each owning a slice of the
requests; see ``deploy``). A worker serves them all: it holds one link per broker, registers with
each, keeps a PULL parked at each and builds its batch from whatever they send, and answers each
task to the broker that sent it. Nothing here coordinates the shards: each link is the whole
protocol with one broker, as a worker of a one-broker deployment speaks it.
"""

from __future__ import annotations

import time

import zmq

from nebula_flow import protocol
from nebula_flow.protocol import Msg
from nebula_flow.security import Identity, make_client


class BrokerLink:
    """One broker's socket and what the worker knows of that conversation: registered or not, the
    PULL parked there (None, "busy": sent while computing, or "idle"), when each side last spoke,
    and how long to wait before reconnecting to a silent broker."""

    def __init__(self, address: str, identity: Identity | None) -> None:
        self.address, self.identity = address, identity
        self.sock: zmq.Socket | None = None
        self.registered = False
        self.register_sent = 0.0
        self.pull_out: str | None = None
        self.last_heard = self.last_sent = time.monotonic()
        self.backoff = 1.0
        self.worker_id = 0  # this worker's number at that broker (WELCOME)

    def connect(self, poller: zmq.Poller) -> None:
        """A fresh DEALER (a new identity: the broker sees a new worker); the caller registers."""
        if self.sock is not None:
            poller.unregister(self.sock)
            self.sock.close(linger=0)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        if self.identity:
            make_client(self.sock, self.identity)
        self.sock.connect(self.address)
        poller.register(self.sock, zmq.POLLIN)
        self.last_heard = time.monotonic()
        self.registered, self.pull_out = False, None

    def send(self, msg: Msg) -> None:
        self.sock.send_multipart(protocol.encode(msg), copy=False)
        self.last_sent = time.monotonic()

    def silent_for(self, now: float) -> float:
        return now - self.last_heard

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()

