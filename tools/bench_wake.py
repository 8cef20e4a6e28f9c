"""How long a message takes to cross processes when the receiver has been idle: a ZeroMQ ping-pong
(DEALER to ROUTER over loopback TCP, as a broker and a worker talk) with a pause between rounds,
its round-trip time with and without a CPU wake-up latency request held (``nebula_flow.wake_latency``).

A pipeline whose processes wait milliseconds between messages pays the host's idle wake-up on
every hop; this separates that cost from the project's own code.

    PYTHONPATH=. .venv/bin/python tools/bench_wake.py [--gaps-ms 0,5,20] [--rounds 300] [--us 0]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import zmq

from nebula_flow import wake_latency
from nebula_flow.deploy import free_port


def echo(port: int) -> None:
    """The other side: answer every message until an empty one."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        frames = sock.recv_multipart()
        if not frames[1]:
            break
        sock.send_multipart(frames)
    sock.close(linger=0)


def round_trips(gap_s: float, rounds: int) -> list[float]:
    """Round-trip seconds of ``rounds`` pings of 200 bytes, ``gap_s`` apart (the first 20 left out)."""
    port = free_port()
    peer = multiprocessing.get_context("spawn").Process(target=echo, args=(port,))
    peer.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    out = []
    for _ in range(rounds + 20):
        t0 = time.perf_counter()
        sock.send(b"x" * 200)
        sock.recv()
        out.append(time.perf_counter() - t0)
        if gap_s:
            time.sleep(gap_s)
    sock.send(b"")
    peer.join()
    sock.close(linger=0)
    return out[20:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps-ms", default="0,5,20", help="pauses between pings (ms), comma-separated")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--us", type=int, default=0, help="the wake-up latency request (us) for the second column")
    args = ap.parse_args()
    print(f"{'gap ms':>7}{'host default: p50 us':>22}{'p90 us':>9}{f'request {args.us} us: p50 us':>26}{'p90 us':>9}")
    for gap in (float(g) for g in args.gaps_ms.split(",")):
        row = []
        for us in (None, args.us):
            with wake_latency.held(us) as held:
                if us is not None and not held:
                    raise SystemExit(f"this host refused the request ({wake_latency.PM_QOS_DEVICE}): nothing to compare")
                rtts = sorted(round_trips(gap / 1000, args.rounds))
            row += [statistics.median(rtts) * 1e6, rtts[int(len(rtts) * 0.9)] * 1e6]
        print(f"{gap:>7g}{row[0]:>22.0f}{row[1]:>9.0f}{row[2]:>26.0f}{row[3]:>9.0f}")


if __name__ == "__main__":
    main()
