"""``nebula_flow.zmq_frames``: multipart messages over real TCP sockets arrive whole and in order,
whatever their frames hold, and an empty non-blocking receive says so."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from nebula_flow import protocol, zmq_frames
from nebula_flow.protocol import KvPull, Pull


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 10_000)  # (a lost message fails the test, never hangs it)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close()
    dealer.close()
    ctx.term()


def test_messages_arrive_whole_and_in_order(pair) -> None:
    router, dealer = pair
    big = np.arange(100_000, dtype=np.int32)  # (over pyzmq's copy threshold: sent without a copy)
    messages = [[b"one"], [b"a", b"", b"c"], [b"head", memoryview(big)], [bytes([i]) for i in range(40)]]
    for frames in messages:
        zmq_frames.send(dealer, frames)
    identity = None
    for frames in messages:
        got = zmq_frames.recv(router)
        identity = identity or got[0].bytes
        assert got[0].bytes == identity  # the ROUTER's identity frame, then the message's own
        assert [f.bytes for f in got[1:]] == [bytes(f) for f in frames]
    zmq_frames.send(router, [identity, b"back", memoryview(big)], zmq_frames.NOBLOCK)
    back = zmq_frames.recv(dealer)
    assert back[0].bytes == b"back"
    assert np.array_equal(np.frombuffer(back[1].buffer, dtype=np.int32), big)


def test_protocol_messages_round_trip(pair) -> None:
    router, dealer = pair
    for msg in (Pull(8, True), KvPull(3, [[1, "draft", 0, 16]])):
        zmq_frames.send(dealer, protocol.encode(msg))
        identity, *frames = zmq_frames.recv(router)
        assert protocol.decode(frames) == msg


def test_nothing_waiting_raises_again(pair) -> None:
    router, _ = pair
    with pytest.raises(zmq.Again):
        zmq_frames.recv(router, zmq_frames.NOBLOCK)
