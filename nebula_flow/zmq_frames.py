"""Multipart ZeroMQ messages sent and received a frame at a time, with plain integer flags.

pyzmq's ``send_multipart`` and ``recv_multipart`` combine flag enums for every frame (on Python
3.11 an enum ``|`` is a Python call, about a microsecond) and ask the socket after each frame
whether more follow: a message of four frames sent and received cost ~9 us against ~4 us here
(2026-12-05, the 2-core Xeon VM; ``tools/bench_frames.py``). Every message on the pipeline's
critical path goes through these (the broker's sockets, a worker's link, the KV transport, the
client library's synchronous side); asyncio sockets keep pyzmq's own, which return futures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


def send(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Send ``frames`` (bytes or buffers) as one message, without copying large ones. With
    ``NOBLOCK`` a full queue raises ``zmq.Again`` at the first frame, before any is queued (ZeroMQ
    queues a message's frames all or none)."""
    last = len(frames) - 1
    more = flags | SNDMORE
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else flags, copy=False)


def recv(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """The next message's frames (``zmq.Frame``s, not copied). With ``NOBLOCK`` and nothing
    waiting, raises ``zmq.Again`` (a message's frames arrive all at once, so only the first waits)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames
