"""A worker's batch (``workers/worker.py``), run in this process on a real ``Worker`` (its model,
KV store and broker sockets; no broker needed to compute a batch)."""

from __future__ import annotations

import numpy as np

from nebula_flow import protocol
from nebula_flow.options import WorkerOptions
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import Free
from nebula_flow_workers.runner import Task
from nebula_flow_workers.worker import BatchClock, Worker


def test_a_waiting_task_whose_request_ends_is_dropped_with_its_kv(tiny_pair) -> None:  # noqa: ANN001
    """A request cancelled while its task waited behind the batch computing: the FREE that comes
    after the task drops it (its result would be stale), and the batch leaves no KV of it behind
    (no FREE comes again); the other waiting task runs as usual. A task that comes after the FREE
    (a restarted broker numbers its requests afresh) runs."""
    worker = Worker(WorkerOptions("target", "tcp://127.0.0.1:9", str(tiny_pair / "target"), kv_transport="none"))
    try:
        greedy = SamplingParams(max_new_tokens=8)

        def task(rid: int) -> Task:
            return Task(rid, "verify", 1, 1, np.arange(2, 20 + rid), 2, greedy, rid, draft=[5, 6])

        worker.pending = [task(1), task(2)]
        worker._on_message(worker.links[0], protocol.encode(Free([2])))
        result, _ = worker._run_batch(worker.pending, worker.frees, None, BatchClock())
        assert [r.rid for r in result.results] == [1] and result.results[0].committed
        assert set(worker.target.store.caches) == {1}
        worker.pending = [task(2)]  # (after the FREE: a request of its own)
        result, _ = worker._run_batch(worker.pending, [], None, BatchClock())
        assert [r.rid for r in result.results] == [2] and set(worker.target.store.caches) == {1, 2}
    finally:
        worker.executor.shutdown(wait=True)
        worker.prefetcher.shutdown(wait=True)
        for link in worker.links:
            link.close()
