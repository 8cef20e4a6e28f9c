"""A multipart message sent and received through pyzmq's ``send_multipart``/``recv_multipart``
against ``nebula_flow.zmq_frames`` (plain integer flags, a frame's own ``more``), over an inproc
PAIR so only the Python side is timed. Prints microseconds per message sent and received, median
of ``--repeats`` passes of ``--messages`` each.

    PYTHONPATH=. .venv/bin/python tools/bench_frames.py [--frames 4] [--messages 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import zmq

from nebula_flow import zmq_frames


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=4, help="frames per message (a header and packed arrays)")
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://bench-frames")
    b.connect("inproc://bench-frames")
    frames = [b"x" * 200] + [b"y" * 64] * (args.frames - 1)
    ways = {
        "pyzmq send_multipart/recv_multipart": lambda: (a.send_multipart(frames, copy=False), b.recv_multipart(copy=False)),
        "zmq_frames.send/recv": lambda: (zmq_frames.send(a, frames), zmq_frames.recv(b)),
    }
    for name, once in ways.items():
        passes = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.messages):
                once()
            passes.append((time.perf_counter() - start) / args.messages * 1e6)
        print(f"{name:36s} {statistics.median(passes):6.2f} us per message of {args.frames} frames "
              f"(passes: {', '.join(f'{p:.2f}' for p in passes)})", flush=True)
    a.close()
    b.close()


if __name__ == "__main__":
    main()
