"""Broker shards: several brokers, each owning a slice of a deployment's requests.

A client sends each request to the shard its id hashes to (``shard_of``), or its
``prompt_cache_key`` where it has one (``route``), so every message about that request (its
tokens, a cancel, a re-attach) stays with one broker; workers serve every shard
(``workers/link.py``). Nothing is coordinated per round: a shard is a whole broker, and adding
one adds dispatch capacity. Shard ``i`` of ``n`` numbers its requests ``i+1, i+1+n, ...``, so a
worker's KV and FREEs never confuse two shards' requests. ``merge_states`` makes the status of
the shards read as one broker's.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

ZMQ_ADDRESS = re.compile(r"tcp://[^\s/]+:\d{1,5}|ipc://\S+|inproc://\S+")  # ZeroMQ's own endpoint forms
# status fields that add up across shards (numbers, or dicts and lists of them)
SUMMED = ("pool", "waiting_for_prefix", "counters", "errors", "topics", "round_times", "tokens_per_round_hist", "batch_sizes",
          "draft_ahead", "fusion", "proposed_by_position", "accepted_by_position", "queued_by_priority")


def addresses(value: str) -> list[str]:
    """A broker address, or a deployment's shards' addresses separated by commas, as a list."""
    found = [a.strip() for a in value.split(",") if a.strip()]
    if not found:
        raise ValueError("a broker address is needed (tcp://HOST:PORT; shards separated by commas)")
    for address in found:
        if not ZMQ_ADDRESS.fullmatch(address):
            raise ValueError(f"{address!r} is not a broker address (tcp://HOST:PORT or ipc://PATH; shards "
                             "separated by commas)")
    if len(set(found)) != len(found):
        raise ValueError(f"a broker address is named twice: {value}")
    return found


def shard_of(req_id: str, shards: int) -> int:
    """The shard that owns request ``req_id`` (a stable hash: any client finds the same one)."""
    return zlib.crc32(req_id.encode()) % shards if shards > 1 else 0


def route(req_id: str, prompt_cache_key: str | None, shards: int) -> int:
    """The shard a request goes to: its ``prompt_cache_key``'s where it has one (OpenAI's name for a
    caching hint: requests that share one, a chat's turns or questions on one document, go to one
    shard, whose placement by prefix knows where the earlier ones' KV is held), else its id's. A
    shard knows only its own requests' prompts (``prefixes.py``): by id alone, a chat's next turn
    reaches the shard that placed its last turn one time in ``shards``."""
    if prompt_cache_key is not None and not isinstance(prompt_cache_key, str):
        raise ValueError(f"prompt_cache_key must be a string, got {type(prompt_cache_key).__name__}")
    return shard_of(prompt_cache_key or req_id, shards)


def _add(a: Any, b: Any) -> Any:
    """``a + b`` for numbers, key by key for dicts, item by item for lists (the longer's tail kept)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a.keys() | b.keys()}
    if isinstance(a, list) and isinstance(b, list):
        short, long = sorted((a, b), key=len)
        return [_add(x, y) for x, y in zip(short, long)] + long[len(short):]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a + b
    return a


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One status for a sharded deployment: counts summed over the shards; each worker once (it
    registers with every shard), its tasks summed; the restarts of all brokers; ``by_shard`` lists
    each shard's own pid, pool, workers and rounds. One shard's state is returned unchanged."""
    if len(states) == 1:
        return states[0]
    merged = dict(states[0])
    for key in SUMMED:
        values = [s[key] for s in states if key in s]
        if values:
            total = values[0]
            for v in values[1:]:
                total = _add(total, v)
            merged[key] = total
    merged["draining"] = any(s.get("draining") for s in states)
    workers: dict[str, dict[str, Any]] = {}
    for s in states:
        for w in s.get("workers", []):
            if w["name"] in workers:
                seen = workers[w["name"]]
                seen["tasks"] = _add(seen.get("tasks", 0), w.get("tasks", 0))
                seen["batches"] = _add(seen.get("batches", {}), w.get("batches", {}))
            else:
                workers[w["name"]] = dict(w)
    merged["workers"] = list(workers.values())
    merged["restarts"] = {"broker": sum(s.get("restarts", {}).get("broker", 0) for s in states),
                          "workers": max(s.get("restarts", {}).get("workers", 0) for s in states)}
    merged["worker_address"] = ",".join(s["worker_address"] for s in states if "worker_address" in s)  # (all shards)
    merged["by_shard"] = [{"shard": s.get("shard", i), "pid": s.get("pid"), "pool": s.get("pool"),
                         "workers": len(s.get("workers", [])), "rounds": s.get("counters", {}).get("rounds", 0),
                         "restarts": s.get("restarts", {}).get("broker", 0), "metrics_port": s.get("metrics_port")}
                        for i, s in enumerate(states)]
    return merged


def fewest_workers(state: dict[str, Any]) -> int:
    """Workers registered at the shard that has fewest (a worker serves once every shard has it)."""
    return min(s["workers"] for s in state.get("by_shard", [{"workers": len(state["workers"])}]))
