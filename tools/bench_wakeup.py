"""How long a message's round trip between two processes takes when both sides were idle: a
ping-pong over loopback, ZeroMQ (DEALER/ROUTER-like REQ/REP, as the bus) and raw TCP, back to back
and after a sleep before each round trip (an idle core must wake: what the breakdown's ``hop``
pays on every trip). Prints the median and 90th percentile round trip in microseconds.
``--wake-latency-us N`` measures each row again with a CPU wake-up latency request of N us held
(``nebula_flow.wake_latency``, the config's ``cpu_wake_latency_us``): what it changes on this host.
``--io-cpu N`` runs both processes' ZeroMQ I/O threads on CPU N (``nebula_flow.io_threads``, the
config's ``zmq_io_cpu``): run it with and without to compare.

    PYTHONPATH=. .venv/bin/python tools/bench_wakeup.py [--trips 200] [--idle-ms 5[,20...]] [--wake-latency-us 0] [--io-cpu 0]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import zmq

from nebula_flow import io_threads, wake_latency


def echo(kind: str, address: str, trips: int) -> None:
    """The other side: answer ``trips`` messages."""
    if kind == "zmq":
        sock = zmq.Context.instance().socket(zmq.REP)
        sock.bind(address)
        for _ in range(trips):
            sock.send(sock.recv())
        return
    host, port = address.rsplit(":", 1)
    with socket.create_server((host, int(port))) as listener:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(trips):
            conn.sendall(conn.recv(16))


def measure(kind: str, address: str, trips: int, idle_s: float) -> list[float]:
    peer = subprocess.Popen([sys.executable, __file__, "--echo", kind, address, str(trips + 1)])
    try:
        if kind == "zmq":
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.connect(address)
            send, recv = sock.send, sock.recv
        else:
            host, port = address.rsplit(":", 1)
            for _ in range(100):  # (until the peer listens)
                try:
                    conn = socket.create_connection((host, int(port)))
                    break
                except ConnectionRefusedError:
                    time.sleep(0.05)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send, recv = conn.sendall, lambda: conn.recv(16)
        send(b"x")
        recv()  # (connected and warm)
        times = []
        for _ in range(trips):
            if idle_s:
                time.sleep(idle_s)
            start = time.perf_counter()
            send(b"x")
            recv()
            times.append(time.perf_counter() - start)
        return times
    finally:
        peer.wait(timeout=30)


def main() -> None:
    if sys.argv[1:2] == ["--echo"]:
        io_threads.pin_from_env()  # (the measuring side's --io-cpu, through the environment)
        echo(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trips", type=int, default=200)
    ap.add_argument("--idle-ms", default="5", help="idle pauses to measure after (ms, comma-separated; 0 is always measured)")
    ap.add_argument("--port", type=int, default=5601)
    ap.add_argument("--wake-latency-us", type=int, default=None,
                    help="also measure each row with this CPU wake-up latency request held")
    ap.add_argument("--io-cpu", type=int, default=None, help="run both sides' ZeroMQ I/O threads on this CPU")
    args = ap.parse_args()
    if args.io_cpu is not None:
        os.environ[io_threads.ENV] = str(args.io_cpu)
        if io_threads.pin_from_env() is None:
            raise SystemExit(f"CPU {args.io_cpu} is not one this process may use")
    idles = [0.0, *(float(ms) / 1000 for ms in args.idle_ms.split(",") if float(ms) > 0)]
    for kind, address in (("zmq", f"tcp://127.0.0.1:{args.port}"), ("tcp", f"127.0.0.1:{args.port + 1}")):
        for idle in idles:
            for us in (None, args.wake_latency_us) if args.wake_latency_us is not None else (None,):
                with wake_latency.held(us) as held:
                    if us is not None and not held:
                        raise SystemExit(f"this host refused the request ({wake_latency.PM_QOS_DEVICE}): nothing to compare")
                    times = sorted(measure(kind, address, args.trips, idle))
                label = "" if us is None else f", {us} us request held"
                print(f"{kind:<4} after {idle * 1000:4.1f} ms idle{label}: round trip median "
                      f"{statistics.median(times) * 1e6:7.0f} us, p90 {times[int(0.9 * len(times))] * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
