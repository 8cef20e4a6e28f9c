"""The worker's loop (``workers/worker.py``), a real ``Worker`` (emulated device: each verify
takes the profile's time) against a stand-in broker on a real socket:

- TASKS that reach an idle worker are decoded on the thread that computes them: no thread
  handoff on the round's critical path;
- while a batch computes, the next one is fetched (a busy PULL goes out as the batch starts),
  decoded by the main thread, and run right after the first, whose RESULT says work still waits;
- once nothing waits, the worker says so (the last RESULT is idle) and parks no second PULL;
- an idle worker, its compute thread listening, spends next to no CPU (no spinning listener).

A stand-in broker, not a real one: the test decides when each TASKS goes out.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from nebula_flow import protocol
from nebula_flow.deploy import free_port
from nebula_flow.options import WorkerOptions
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import Holder, Pull, Register, Result, Tasks, TaskSpec, Welcome
from nebula_flow_workers.worker import Worker
from tests.test_emulated import PROFILE

VERIFY_S = 0.4  # the emulated verify's time: long enough that a second batch arrives while it runs


def _task(rid: int) -> TaskSpec:
    return TaskSpec(rid, "verify", 1, 1, np.arange(5, 12, dtype=np.int32), 2,
                    SamplingParams(max_new_tokens=8).to_wire(), rid, Holder(), draft=[20, 21])


def _broker(router: zmq.Socket, worker: Worker, seen: list) -> None:
    """Welcome the worker; answer its first PULL with one task and its busy PULL with a second;
    record what it sends until both results are back, then stop it."""
    def receive() -> tuple[bytes, protocol.Msg]:
        assert router.poll(30_000), "the worker went silent"
        identity, *frames = router.recv_multipart(copy=False)
        return identity.bytes, protocol.decode(frames)

    results = 0
    try:
        while results < 2:
            identity, msg = receive()
            if isinstance(msg, Register):
                router.send_multipart([identity, *protocol.encode(Welcome(1, 0, "pooled", {"heartbeat_s": 5.0}))])
                continue
            seen.append(msg)
            if isinstance(msg, Pull) and msg.credits:
                pulls = sum(isinstance(m, Pull) for m in seen)
                if pulls <= 2:  # (the idle PULL gets task 1; the busy one, sent while it computes, task 2)
                    router.send_multipart([identity, *protocol.encode(Tasks([_task(pulls)]))])
            results += isinstance(msg, Result)
        # (anything it still sends before it stops: no second PULL after the idle result)
        while router.poll(300):
            seen.append(receive()[1])
        # idle, its compute thread listening: a second of it costs this process (the worker and
        # this stand-in) next to no CPU, where a listener that spun would burn a core
        cpu = time.process_time()
        if router.poll(1000):
            seen.append(receive()[1])
        seen.append(("idle cpu", time.process_time() - cpu))
    finally:
        worker._stop()


def test_tasks_run_on_the_thread_that_listened_and_the_next_batch_is_fetched_meanwhile(tmp_path: Path) -> None:
    profile = tmp_path / "target.json"
    profile.write_text(json.dumps(dict(PROFILE, latency={"base_s": VERIFY_S})))
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    worker = Worker(WorkerOptions("target", f"tcp://127.0.0.1:{port}", device="emulated", profile=str(profile),
                                  kv_transport="none", heartbeat_s=5.0))
    decoded_on: list[str] = []
    runnable = worker._runnable

    def recording(link, msg):  # noqa: ANN001, ANN202
        decoded_on.append(threading.current_thread().name)
        return runnable(link, msg)

    worker._runnable = recording
    seen: list = []
    broker = threading.Thread(target=_broker, args=(router, worker, seen))
    broker.start()
    try:
        assert worker.run() == 0
    finally:
        broker.join(timeout=30)
        router.close(linger=0)
    idle_cpu = [m[1] for m in seen if isinstance(m, tuple)]
    assert idle_cpu and idle_cpu[0] < 0.3, idle_cpu
    seen = [m for m in seen if not isinstance(m, tuple)]
    kinds = [(type(m).__name__, getattr(m, "idle", None)) for m in seen if not isinstance(m, protocol.Heartbeat)]
    # idle PULL; busy PULL while task 1 computes; task 1's RESULT (task 2 waits); a busy PULL as
    # task 2 starts; its RESULT (idle: that PULL is now an idle worker's); then only the withdrawal
    # of that PULL as it stopped
    assert kinds[:5] == [("Pull", True), ("Pull", False), ("Result", False), ("Pull", False), ("Result", True)], kinds
    assert all(not (isinstance(m, Pull) and m.credits) for m in seen[5:]), kinds
    results = [m for m in seen if isinstance(m, Result)]
    assert [r.results[0].rid for r in results] == [1, 2] and all(r.results[0].committed for r in results)
    # task 1 reached an idle worker: decoded on the compute thread; task 2 came while it computed
    assert decoded_on[0].startswith("compute") and decoded_on[1] == "MainThread", decoded_on
    # task 2 waited behind task 1 (fetched meanwhile), not for a fetch after it
    assert results[1].timing.queue_s > VERIFY_S / 4, results[1].timing
