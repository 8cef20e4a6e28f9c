"""Time the wire codec on the messages of a pooled round: the broker's TASKS (encode) and RESULT
(decode), and the worker's side of each. Prints microseconds per message and per task, medians of
``--repeats`` passes of ``--loops`` each.

``--idle-ms MS`` times each call after MS milliseconds of sleep instead (medians of single calls),
as a worker decodes a task arriving after an idle wait: on a virtual machine whose idle cores are
handed to other guests, the same code then runs several times slower (its caches went cold).

    .venv/bin/python tools/bench_codec.py [--batch 14] [--tokens 300] [--idle-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from nebula_flow import protocol
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import Holder, Result, TaskResult, Tasks, TaskSpec, Timing


def messages(batch: int, tokens: int) -> dict[str, protocol.Msg]:
    """A draft and a verify TASKS of ``batch`` greedy requests of ``tokens`` committed tokens, and
    the RESULT each comes back as."""
    params = SamplingParams(max_new_tokens=128).to_wire()
    rng = np.random.default_rng(0)
    held = [rng.integers(0, 49_000, tokens).astype(np.int32) for _ in range(batch)]
    holder = Holder(3, tokens - 5, "tcp://127.0.0.1:40123")
    draft = [TaskSpec(i, "draft", 7, 0, held[i], 4, params, 1234 + i, holder) for i in range(batch)]
    verify = [TaskSpec(i, "verify", 7, 0, held[i], 4, params, 1234 + i, holder, draft=[11, 12, 13, 14])
              for i in range(batch)]
    timing = Timing(0.02, 0.0001, 0.0002, 0.0, 0.01, 0.0, 0.0003, 0.0001)
    drafted = [TaskResult(i, "draft", 7, 0, draft=[11, 12, 13, 14]) for i in range(batch)]
    verified = [TaskResult(i, "verify", 7, 0, committed=[11, 12, 99]) for i in range(batch)]
    return {"TASKS draft": Tasks(draft), "TASKS verify": Tasks(verify),
            "RESULT draft": Result(drafted, 0.01, timing=timing), "RESULT verify": Result(verified, 0.02, timing=timing)}


def per_call(fn, loops: int, repeats: int) -> float:  # noqa: ANN001
    """Median over ``repeats`` of the mean seconds of ``loops`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - start) / loops)
    return statistics.median(times)


def after_idle(fn, idle_s: float, calls: int) -> float:  # noqa: ANN001
    """Median seconds of one call of ``fn`` made after ``idle_s`` of sleep."""
    times = []
    for _ in range(calls):
        time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=14, help="tasks per message")
    ap.add_argument("--tokens", type=int, default=300, help="committed tokens per request")
    ap.add_argument("--loops", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--idle-ms", type=float, default=0.0, help="sleep this long before each call (100 calls)")
    args = ap.parse_args()
    print(f"{'message':<15} {'encode us':>10} {'decode us':>10} {'per task':>18}")
    for name, msg in messages(args.batch, args.tokens).items():
        frames = [bytes(f) if not isinstance(f, np.ndarray) else f.tobytes() for f in protocol.encode(msg)]
        assert name.startswith("TASKS") or protocol.decode(frames) == msg  # (arrays compare elementwise)
        if args.idle_ms:
            enc = after_idle(lambda: protocol.encode(msg), args.idle_ms / 1000, 100) * 1e6  # noqa: B023
            dec = after_idle(lambda: protocol.decode(frames), args.idle_ms / 1000, 100) * 1e6  # noqa: B023
        else:
            enc = per_call(lambda: protocol.encode(msg), args.loops, args.repeats) * 1e6  # noqa: B023
            dec = per_call(lambda: protocol.decode(frames), args.loops, args.repeats) * 1e6  # noqa: B023
        print(f"{name:<15} {enc:>10.1f} {dec:>10.1f} {enc / args.batch:>8.2f} {dec / args.batch:>8.2f} us")


if __name__ == "__main__":
    main()
