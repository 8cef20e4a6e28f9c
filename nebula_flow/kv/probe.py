"""The raw transport, measured bare: one holder, one puller, nothing else of the system.

``bench-kv`` compares in-system KV bandwidth against this, in two ways:

* back to back on an idle machine (``RawPair.gbps``): the transport's best case;
* paced, as the system pulls (one exchange now and then, not a hot loop), in a separate process
  that runs while the system runs (``python -m nebula_flow.kv.probe``): the same machine under the
  same load. Measured here, a 48 kB shm read took 0.05 ms back to back but ~0.3 ms paced at
  10 ms, on an otherwise idle machine: caches and idle cores go cold between pulls.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time

import numpy as np
import torch

ROW_BYTES = 4096


SPREAD_BYTES = 128 << 20  # more than any last-level cache here (32 MiB): pulls spread over it come from memory


class RawPair:
    """A serving and a pulling endpoint of ``transport`` in this process, holding ``max_bytes``."""

    def __init__(self, transport: str, max_bytes: int) -> None:
        from nebula_flow.kv.transport import ZmqTransport, make_transport

        self.server = make_transport(transport)
        # (a ZeroMQ server thread answers a separate client; UCX is one context per process)
        self.client = ZmqTransport() if self.server.scheme == "tcp" else self.server
        self.rows = torch.randn(max(1, max_bytes // ROW_BYTES), ROW_BYTES // 4)
        tokens = np.zeros(len(self.rows), dtype=np.int32)
        self.endpoint = self.server.serve("127.0.0.1", lambda rid, role, s, e: (tokens[s:e], self.rows[s:e]))
        if self.server.share_folder is not None:  # a shared-memory holder serves from a file, not a thread
            from nebula_flow.kv.cache import KVCache
            from nebula_flow.kv.shm import kv_path

            held = KVCache(1, 1, ROW_BYTES // 8, capacity=len(self.rows))  # 4 kB rows, like ``rows``
            held.buf[:] = self.rows.view(held.buf.shape)
            held.tokens = tokens.tolist()
            held.share(kv_path(self.server.share_folder, "target", 1), 1)
        self.dest = torch.empty_like(self.rows)

    def pull(self, nbytes: int, start: int = 0) -> float:
        """Seconds for one pull of ``nbytes`` (rounded to whole 4 kB rows) from row ``start`` on."""
        n = max(1, min(len(self.rows) - start, nbytes // ROW_BYTES))
        t0 = time.perf_counter()
        got = self.client.pull(self.endpoint, 1, "target", start, start + n, self.dest[start:start + n])
        if got is None:
            raise RuntimeError("raw pull failed")
        return time.perf_counter() - t0

    def gbps(self, nbytes: int, repeats: int = 20, spread: bool = False) -> float:
        """Median bandwidth of back-to-back pulls of ``nbytes``: the same rows each time (their
        data stays in the CPU's caches), or, with ``spread``, each pull the next rows of the whole
        buffer (make it SPREAD_BYTES or more: the data then comes from memory, as in a real pull
        of rows another process wrote a batch ago)."""
        n = max(1, nbytes // ROW_BYTES)
        slots = max(1, len(self.rows) // n) if spread else 1
        for i in range(slots if spread else 0):  # first map every page (as the system's buffers are) ...
            self.pull(n * ROW_BYTES, i * n)
        # ... then time pulls whose rows were last touched a whole buffer ago, out of every cache
        return n * ROW_BYTES / statistics.median(self.pull(n * ROW_BYTES, (i % slots) * n) for i in range(repeats)) / 1e9

    def close(self) -> None:
        self.server.close()
        if self.client is not self.server:
            self.client.close()


def paced_gbps(samples: dict[int, list[float]], nbytes: float) -> float:
    """Bandwidth at ``nbytes`` from paced samples {size: [seconds]}: mean time per size (the
    statistic of the in-system figure, total bytes over total pull time, slow pulls included),
    linear in size between the two nearest sizes (time = fixed cost + bytes / rate). Below the
    smallest size, that size's time (the fixed cost); above the largest, that size's bandwidth."""
    points = sorted((size, statistics.fmean(ts)) for size, ts in samples.items() if ts)
    if not points:
        raise ValueError("no paced samples")
    if nbytes > points[-1][0]:
        return points[-1][0] / max(points[-1][1], 1e-9) / 1e9
    lo = max([p for p in points if p[0] <= nbytes], default=points[0])
    hi = min([p for p in points if p[0] >= nbytes], default=points[-1])
    t = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (nbytes - lo[0]) / (hi[0] - lo[0])
    return nbytes / max(t, 1e-9) / 1e9


def run_paced(transport: str, sizes: list[int], pace_s: float, duration_s: float | None = None,
              wait_for_go: bool = False) -> dict[int, list[float]]:
    """Pull each size in turn, ``pace_s`` apart, until ``duration_s`` passes or SIGTERM; with
    ``wait_for_go``, from the moment a line arrives on stdin (so that whoever started us can
    start us early, while what we measure beside starts too)."""
    pair = RawPair(transport, max(sizes))
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)  # for whoever started us: a SIGTERM from now on still writes results
    if wait_for_go and not sys.stdin.readline():  # (stdin closed before the go: nothing to measure)
        stop = True
    samples: dict[int, list[float]] = {s: [] for s in sizes}
    end = time.monotonic() + duration_s if duration_s else float("inf")
    try:
        i = 0
        while not stop and time.monotonic() < end:
            size = sizes[i % len(sizes)]
            samples[size].append(pair.pull(size))
            i += 1
            time.sleep(pace_s)
    finally:
        pair.close()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description="Paced raw KV pulls (see bench-kv); writes {size: [seconds]} as JSON.")
    ap.add_argument("--transport", required=True)
    ap.add_argument("--sizes", default="16384,65536,262144,1048576", help="Bytes per pull, comma-separated.")
    ap.add_argument("--pace-ms", type=float, default=20.0, help="Pause between pulls.")
    ap.add_argument("--duration-s", type=float, default=None, help="Stop after this long (default: at SIGTERM).")
    ap.add_argument("--wait-for-go", action="store_true", help="Start pulling when a line arrives on stdin.")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    samples = run_paced(a.transport, [int(s) for s in a.sizes.split(",")], a.pace_ms / 1000, a.duration_s,
                        a.wait_for_go)
    with open(a.out, "w") as f:
        json.dump({str(k): v for k, v in samples.items()}, f)


if __name__ == "__main__":
    main()
