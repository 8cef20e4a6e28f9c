"""The broker's state as Prometheus metric families (``prometheus_client`` writes the text
format), and the tiny HTTP server that serves them on the broker's metrics port.

The broker loop renders a snapshot every half second; the HTTP thread only hands out the
latest string, so scraping never touches live broker state from another thread. The HTTP
gateway (``nebula_flow/api``) serves the same families, from the broker's ``status``, beside
its own histograms. The names are listed in docs/operations.md.
"""

from __future__ import annotations

import hmac
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def families(state: dict[str, Any]) -> list[Metric]:
    """The metric families of a broker ``state()`` snapshot."""
    out: list[Metric] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[float, dict[str, Any] | None]]) -> None:
        labels = list((samples[0][1] or {}).keys()) if samples else []
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = cls(name, help_, labels=labels)
        for value, tags in samples:
            fam.add_metric([str(v) for v in (tags or {}).values()], float(value))
        out.append(fam)

    c = state["counters"]
    family("nebula_requests_total", "counter", "Requests by outcome.",
           [(c.get("requests_submitted", 0), {"outcome": "submitted"})] +
           [(v, {"outcome": k[len("requests_"):]}) for k, v in c.items()
            if k.startswith("requests_") and k != "requests_submitted"])
    family("nebula_rounds_total", "counter", "Completed request-rounds.", [(c.get("rounds", 0), None)])
    family("nebula_output_tokens_total", "counter", "Committed output tokens.", [(c.get("tokens_out", 0), None)])
    family("nebula_prefix_waits_total", "counter", "Requests that waited for another request computing their "
           "prompt's start, then started from its KV (policy knob wait_for_prefix).", [(c.get("prefix_waits", 0), None)])
    family("nebula_requests_displaced_total", "counter", "Requests not started that a full pool (max_pending) turned "
           "away, with a busy error, for a more urgent request (priority scheduling; also counted as failed).",
           [(c.get("displaced", 0), None)])
    family("nebula_task_tokens_total", "counter", "Token ids the broker sent in tasks (each carries what its worker "
           "lacks), the positions those tasks covered, and tasks sent again whole because their worker lacked the rest.",
           [(c.get(kind, 0), {"kind": kind}) for kind in ("task_tokens", "task_positions", "tokens_resent")])
    family("nebula_draft_tokens_proposed_total", "counter", "Draft tokens proposed, by position in the draft.",
           [(v, {"position": i + 1}) for i, v in enumerate(state.get("proposed_by_position", []))])
    family("nebula_draft_tokens_accepted_total", "counter", "Draft tokens accepted, by position in the draft.",
           [(v, {"position": i + 1}) for i, v in enumerate(state.get("accepted_by_position", []))])
    family("nebula_tokens_per_round_total", "counter", "Rounds by the number of tokens they committed.",
           [(v, {"tokens": k}) for k, v in sorted(state.get("tokens_per_round_hist", {}).items(), key=lambda x: int(x[0]))])
    family("nebula_batch_size_total", "counter", "Task batches sent to workers, by role and size.",
           [(v, {"role": role, "size": size}) for role, hist in state.get("batch_sizes", {}).items()
            for size, v in sorted(hist.items(), key=lambda x: int(x[0]))])
    tree_counts = ("alternatives_proposed", "alternatives_contested", "alternatives_accepted", "fused_asked",
                   "fused_chains", "fused_rounds_won", "fused_tokens_accepted")
    family("nebula_token_tree_total", "counter", "Token trees: runner-ups to the first draft token proposed, "
           "in rounds whose first draft token was rejected, and won; rounds that asked for a fused prompt-lookup "
           "chain, chains verified, rounds they won, and tokens they added beyond the draft.",
           [(c.get(kind, 0), {"kind": kind}) for kind in tree_counts])
    family("nebula_prediction_tokens_total", "counter", "Predicted Outputs: requests that gave a prediction, and "
           "its tokens their outputs held (accepted) or did not (rejected).",
           [(c.get(f"prediction_{kind}", 0), {"kind": kind})
            for kind in ("requests", "tokens_accepted", "tokens_rejected")])
    ahead = state.get("draft_ahead", {})
    family("nebula_draft_ahead_total", "counter", "Draft-ahead: pre-drafts made, outcomes drafted, rounds whose draft "
           "was one (late: after its verify), outcomes never used, pre-drafts cancelled, or skipped under load.",
           [(ahead.get(kind, 0), {"kind": kind}) for kind in ("tasks", "branches", "hits", "late_hits", "wasted",
                                                               "cancelled", "skipped")])
    family("nebula_draft_ahead_hits_by_outcome_total", "counter", "Draft-ahead: rounds whose draft was a "
           "pre-drafted outcome, by the outcome's place, most likely first (0: the whole draft and its guess of the "
           "bonus token; nebula_flow/ahead.py): how many outcomes draft_ahead needs to cover.",
           [(n, {"outcome": str(i)}) for i, n in enumerate(ahead.get("hits_by_outcome", []))])
    fused = state.get("fusion", {})
    family("nebula_fused_drafts_total", "counter", "Fused model drafters: second drafts asked for, re-queued after "
           "their worker died, dropped (still queued when the first draft came back, or no worker of the drafter "
           "left), fused rounds verified, and tokens second chains won beyond the first draft.",
           [(fused.get(kind, 0), {"kind": kind}) for kind in ("tasks", "requeued", "dropped", "rounds", "tokens_won")])
    family("nebula_fused_rounds_won_total", "counter", "Fused rounds whose committed path went furthest along "
           "each drafter's chain (ties counted for neither).",
           [(n, {"drafter": name}) for name, n in sorted(fused.get("won_by", {}).items())])
    drafters = state.get("drafters", {})
    family("nebula_drafter_rounds_total", "counter", "Rounds each drafter drafted (routing among drafters).",
           [(d["rounds"], {"drafter": name}) for name, d in drafters.items()])
    family("nebula_drafter_tokens_total", "counter", "Draft tokens each drafter proposed and had accepted.",
           [(d[kind], {"drafter": name, "kind": kind}) for name, d in drafters.items() for kind in ("proposed", "accepted")])
    family("nebula_topic_depth", "gauge", "Tasks waiting per topic.",
           [(v, {"topic": t}) for t, v in state["topics"].items()])
    family("nebula_pool_requests", "gauge", "Requests in the pool.", [(state["pool"], None)])
    family("nebula_requests_waiting_for_prefix", "gauge", "Requests of the pool waiting for another computing their "
           "prompt's start (policy knob wait_for_prefix).", [(state.get("waiting_for_prefix", 0), None)])
    family("nebula_workers", "gauge", "Registered workers by role.",
           [(sum(1 for w in state["workers"] if w["role"] == r), {"role": r}) for r in state["roles"]])
    family("nebula_worker_busy_seconds_total", "counter", "Time each worker spent in forward passes.",
           [(w["busy_s"], {"worker": w["name"], "role": w["role"]}) for w in state["workers"]])
    family("nebula_worker_tasks_total", "counter", "Tasks each worker completed.",
           [(w["tasks"], {"worker": w["name"], "role": w["role"]}) for w in state["workers"]])
    family("nebula_restarts", "gauge", "Times the deployment started a process again after it died.",
           [(state["restarts"]["broker"], {"process": "broker"})] +
           [(w["restarts"], {"process": w["name"]}) for w in state["workers"]])
    kv_keys = {"bytes_pulled": "nebula_kv_bytes_pulled_total", "pulls": "nebula_kv_pulls_total",
               "pull_failures": "nebula_kv_pull_failures_total", "pulls_skipped": "nebula_kv_pulls_skipped_total",
               "stall_s": "nebula_kv_stall_seconds_total",
               "overlap_s": "nebula_kv_overlap_seconds_total", "computed": "nebula_kv_recomputed_positions_total",
               "prefix_hits": "nebula_kv_prefix_hits_total", "prefix_reused": "nebula_kv_prefix_reused_positions_total",
               "prefix_pulls": "nebula_kv_prefix_pulls_total", "prefix_pulled": "nebula_kv_prefix_pulled_positions_total",
               "pull_saved": "nebula_kv_pull_saved_positions_total"}
    for key, name in kv_keys.items():
        family(name, "counter", f"Per-worker KV counter {key}.",
               [(w["kv"].get(key, 0), {"worker": w["name"], "role": w["role"]}) for w in state["workers"] if w.get("kv")])
    family("nebula_errors_total", "counter", "Rejected or failed messages by code.",
           [(v, {"code": k}) for k, v in state["errors"].items()])
    rt = state.get("round_times", {})
    family("nebula_round_seconds_total", "counter", "Request-round time by part (docs/operations.md); kind "
           "first: rounds that carried their prompt's prefill, decode: the rest.",
           [(v, {"kind": "decode" if kind == "rounds" else kind, "part": part})
            for kind, entry in rt.items() for part, v in entry["seconds"].items()])
    family("nebula_round_times_rounds_total", "counter", "Request-rounds ended, as round_seconds counts them.",
           [(entry["rounds"], {"kind": "decode" if kind == "rounds" else kind}) for kind, entry in rt.items()])
    family("nebula_uptime_seconds", "gauge", "Seconds since the broker started.", [(state["uptime_s"], None)])
    return out


class _Snapshot(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


def exposition(metrics: list[Metric]) -> str:
    """The Prometheus text format of ``metrics``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metrics))
    return generate_latest(registry).decode()


def render(state: dict[str, Any]) -> str:
    """The Prometheus text format of a broker ``state()`` snapshot."""
    return exposition(families(state))


class MetricsServer:
    """Serves ``/metrics`` from the latest snapshot string on a background thread; with a
    ``token``, only to requests that send it (``Authorization: Bearer TOKEN``)."""

    def __init__(self, host: str, port: int, token: str | None = None) -> None:
        self.snapshot = "# no data yet\n"
        self.refused = 0
        server = self
        expected = f"Bearer {token}".encode() if token else None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if expected is not None and not hmac.compare_digest(
                        self.headers.get("Authorization", "").encode(), expected):
                    server.refused += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Bearer")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = server.snapshot.encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # keep scrapes out of the broker log
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
