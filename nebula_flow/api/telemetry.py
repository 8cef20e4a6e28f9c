"""The gateway's Prometheus metrics: latency histograms as users see them through the front door,
and request counters; ``/metrics`` serves them beside the broker's families (``nebula_flow.metrics``).

Names (also in docs/operations.md):

- ``nebula_api_time_to_first_token_seconds``: request received to its first token sent;
- ``nebula_api_inter_token_latency_seconds``: between tokens, each chunk's gap spread over its tokens;
- ``nebula_api_e2e_request_latency_seconds``: request received to its last byte;
- ``nebula_api_queue_time_seconds``: the broker's wait from admission to the first task sent;
- ``nebula_api_tokens_per_round``: tokens each round of a finished request committed;
- ``nebula_api_requests_total{endpoint,status}``: answers by HTTP status;
- ``nebula_api_prompt_tokens_total``, ``nebula_api_generation_tokens_total``;
- ``nebula_api_disconnects_total``: requests cancelled because their client went away.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from nebula_flow.client import Completion
from nebula_flow.roles import unserved_in

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                     1.0, 2.5)
ROUND_BUCKETS = tuple(float(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64))


class SpreadHistogram(Collector):
    """A histogram that takes many equal observations at once (``observe(value, count)``): a chunk's
    gap spread over its tokens is one call, not one per token (per-token ``Histogram.observe`` calls
    were ~5 % of the gateway's CPU). Exposed as a Prometheus histogram of the same name and buckets."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.bounds = name, documentation, list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # (the last: above every bound, +Inf)
        self.sum = 0.0
        self.lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        with self.lock:
            self.counts[bisect_left(self.bounds, value)] += count  # (a bucket holds values <= its bound)
            self.sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self.lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, self.bounds), "+Inf"], counts):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)


class Telemetry:
    """One gateway's metrics, in a registry of its own (several gateways may share a process in tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("nebula_api_time_to_first_token_seconds", "Request received to its first token sent.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = SpreadHistogram("nebula_api_inter_token_latency_seconds", "Time between output tokens (a chunk's "
                                   "gap spread over its tokens).", TOKEN_GAP_BUCKETS, r)
        self.e2e = Histogram("nebula_api_e2e_request_latency_seconds", "Request received to its last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("nebula_api_queue_time_seconds", "The broker's wait from admission to the request's "
                               "first task sent.", buckets=LATENCY_BUCKETS, registry=r)
        self.per_round = Histogram("nebula_api_tokens_per_round", "Tokens each round of a finished request committed.",
                                   buckets=ROUND_BUCKETS, registry=r)
        self.requests = Counter("nebula_api_requests", "Answers by endpoint and HTTP status.", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("nebula_api_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("nebula_api_generation_tokens", "Output tokens of finished requests.",
                                         registry=r)
        self.disconnects = Counter("nebula_api_disconnects", "Requests cancelled because their client went away.",
                                   registry=r)

    def finished(self, out: Completion) -> None:
        """A request's latencies, from the client's clock (``Completion`` times start when it was sent)."""
        self.ttft.observe(out.ttft_s)
        self.e2e.observe(out.latency_s)
        self.queue.observe(float(out.stats.get("queue_s", 0.0)))
        previous = out.ttft_s
        for t, n in zip(out.chunk_times_s[1:], out.chunk_tokens[1:]):
            if n:
                self.itl.observe((t - previous) / n, n)
            previous = t
        for n in out.tokens_per_round:
            self.per_round.observe(n)
        self.prompt_tokens.inc(int(out.stats.get("prompt_tokens", 0)))
        self.generation_tokens.inc(len(out.token_ids))


def health(state: dict) -> tuple[int, dict]:
    """``/health``'s status and body from the broker's state: 503 while it drains, or while its
    requests cannot progress (no worker takes a stage they need: ``roles.unserved``), so that a
    load balancer sends callers elsewhere; 200 otherwise."""
    workers = state.get("workers", [])
    if state.get("draining"):
        return 503, {"status": "draining"}
    if why := unserved_in(state):
        return 503, {"status": "unavailable", "message": why, "workers": len(workers)}
    return 200, {"status": "ok", "workers": len(workers)}
