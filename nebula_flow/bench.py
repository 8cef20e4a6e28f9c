"""Side-by-side benchmark of the modes on one configuration and one workload.

Each mode is started in turn (same config, same devices), warmed up, then the workload is run
``repeats`` times; every figure reported is the median over repeats, and ratios are taken
against the first mode measured in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_flow.client import AsyncClient, Client, Completion, RequestError
from nebula_flow.config import DeployConfig
from nebula_flow.deploy import Deployment
from nebula_flow.kv.store import PULL_SIZE_CLASSES, add_by_size
from nebula_flow.round_times import PARTS, breakdown, summary
from nebula_flow.stats import percentiles

DEFAULT_PROMPTS = [
    "def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
    "for i in range(10):\n", "def read_config(path):\n    with open(path) as f:", "# sort a list of numbers\n",
    "The quick brown fox", "Once upon a time, there was",
]
# Requests an instruct model gets as chat messages (``--chat``).
DEFAULT_CHAT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.", "Write a Python function that lists the files in a folder.",
    "Implement a stack class in Python.", "Write Python code that prints the numbers from 1 to 10.",
    "Write a Python function that reads a config file.", "Write a Python function that sorts a list of numbers.",
    "Write a Python class for a bank account.", "Write a Python function that counts the vowels in a string.",
]

# Chat requests to change a given function (``--edit``): the answer repeats most of the prompt's
# code, which a prompt-lookup drafter (``--add-drafter ngram``) proposes for almost nothing.
_EDIT_CODE = [
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
    "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n    result.extend(b[j:])\n"
    "    return result\n",
    "def word_counts(path):\n    counts = {}\n    with open(path) as f:\n        for line in f:\n"
    "            for word in line.split():\n                word = word.lower()\n"
    "                counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return len(self.items) == 0\n",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n"
    "        mid = (low + high) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            low = mid + 1\n        else:\n            high = mid - 1\n"
    "    return -1\n",
]
_EDITS = ["Add type hints to this Python code. Reply with the whole code only.",
          "Add a docstring to this Python code. Reply with the whole code only."]
DEFAULT_EDIT_PROMPTS = [f"{edit}\n\n```python\n{code}```" for edit in _EDITS for code in _EDIT_CODE]


def with_context(prompts: list[str], context_tokens: int, model: str | Path) -> list[str]:
    """Each prompt after about ``context_tokens`` tokens of code to read first (a different
    stretch of the stdlib's sources per prompt, cut in tokens and decoded back to text): code
    completion with a file open, where the prompt's KV is most of the bytes that move."""
    if context_tokens <= 0:
        return list(prompts)
    from nebula_flow.corpus import corpus_files
    from nebula_flow.tokenizer import TextCodec

    codec = TextCodec(model)
    ids: list[int] = []
    for f in corpus_files(None):
        # (a file's first 16k characters: fewer tokens than any model's context, so no warning)
        ids += codec.encode(f.read_text(errors="ignore")[:16_000], special=False)
        if len(ids) >= context_tokens * len(prompts):
            break
    return [f"{codec.decode(ids[i * context_tokens:(i + 1) * context_tokens])}\n{p}" for i, p in enumerate(prompts)]


@dataclass
class BenchWorkload:
    prompts: list[str]
    max_new_tokens: int = 64
    concurrency: int = 1
    temperature: float = 0.0
    ignore_eos: bool = True  # fixed-length outputs keep modes comparable
    chat: bool = False  # send each prompt as a user message in the model's chat format


async def _closed_loop(address: str, wl: BenchWorkload) -> list[Completion]:
    queue = list(enumerate(wl.prompts))
    outs: list[Completion] = []
    async with AsyncClient(address, timeout_s=600) as client:
        async def user() -> None:
            while queue:
                i, prompt = queue.pop(0)
                outs.append(await client.generate(prompt, max_new_tokens=wl.max_new_tokens, temperature=wl.temperature,
                                                  seed=i, ignore_eos=wl.ignore_eos, chat=wl.chat))
        await asyncio.gather(*(user() for _ in range(max(1, wl.concurrency))))
    return outs


def _busy(state: dict[str, Any]) -> dict[int, float]:
    return {w["id"]: w["busy_s"] for w in state["workers"]}


def _kv_bytes(state: dict[str, Any]) -> float:
    return sum((w["kv"] or {}).get("bytes_pulled", 0) for w in state["workers"])


def run_once(address: str, wl: BenchWorkload) -> dict[str, Any]:
    with Client(address) as c:
        s0 = c.status()
        busy0, kv0 = _busy(s0), _kv_bytes(s0)
        t0 = time.monotonic()
        outs = asyncio.run(_closed_loop(address, wl))
        wall = time.monotonic() - t0
        s1 = c.status()
        busy1 = _busy(s1)
    tokens = sum(len(o.token_ids) for o in outs)
    rounds = sum(o.rounds for o in outs)
    util = {wid: (busy1[wid] - busy0.get(wid, 0.0)) / wall for wid in busy1}
    tasks0 = {w["id"]: w["tasks"] for w in s0["workers"]}
    dev0 = {w["id"]: w.get("device") or {} for w in s0["workers"]}
    forwards = overrun = 0.0
    for w in s1["workers"]:
        d1, d0 = w.get("device") or {}, dev0.get(w["id"], {})
        forwards += d1.get("forwards", 0) - d0.get("forwards", 0)
        overrun += d1.get("emulated_overrun_s", 0.0) - d0.get("emulated_overrun_s", 0.0)
    workers = [{"id": w["id"], "role": w["role"], "utilization": util[w["id"]], "tasks": w["tasks"] - tasks0.get(w["id"], 0)}
               for w in s1["workers"]]
    ahead = {k: v - s0.get("draft_ahead", {}).get(k, 0) for k, v in s1.get("draft_ahead", {}).items()}
    return {"wall_s": wall, "requests": len(outs), "tokens": tokens, "rounds": rounds,
            # draft-ahead: its counters, and the share of rounds whose draft a pre-draft was
            "draft_ahead": ahead, "ahead_hit_rate": ahead.get("hits", 0) / max(rounds, 1),
            "tokens_per_s": tokens / wall, "round_rate": rounds / wall,
            "tokens_per_round": tokens / max(rounds, 1),
            "utilization": statistics.mean(util.values()) if util else 0.0, "workers": workers,
            "kv_bytes": _kv_bytes(s1) - kv0, "forwards": forwards,
            # emulated devices: mean time a forward ran past its profile (the host falling behind)
            "emulated_overrun_per_forward_s": overrun / forwards if forwards else 0.0,
            "ttft_s": percentiles([o.ttft_s for o in outs]), "latency_s": percentiles([o.latency_s for o in outs]),
            # where the rounds' time went (round_times): decode rounds, and first rounds (with the prefill)
            "breakdown": breakdown(s0, s1), "first_breakdown": breakdown(s0, s1, "first")}


def bench_mode(cfg: DeployConfig, mode: str, wl: BenchWorkload, repeats: int, log=print, label: str | None = None) -> dict[str, Any]:  # noqa: ANN001
    """Run ``wl`` ``repeats`` times on a fresh deployment of ``cfg`` in ``mode``; medians.
    ``label``: the name progress lines use (default: the mode)."""
    cfg.mode = mode
    cfg.broker.client_port = cfg.broker.worker_port = 0
    with Deployment(cfg) as dep:
        with Client(dep.address) as c:  # warm-up: first-call allocations, page faults
            try:
                c.generate(wl.prompts[0], max_new_tokens=8)
            except RequestError as exc:
                raise RuntimeError(f"{mode}: warm-up failed: {exc}") from None
        runs = []
        for r in range(repeats):
            res = run_once(dep.address, wl)
            hits = f", {res['ahead_hit_rate']:.0%} of rounds pre-drafted" if res["draft_ahead"].get("tasks") else ""
            log(f"  {label or mode} repeat {r + 1}/{repeats}: {res['tokens_per_s']:.1f} tokens/s, "
                f"{res['round_rate']:.1f} rounds/s, {res['tokens_per_round']:.2f} tokens/round{hits}")
            runs.append(res)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {**_medians(runs), "utilization": med("utilization"),
            "kv_bytes": med("kv_bytes"), "emulated_overrun_per_forward_s": med("emulated_overrun_per_forward_s"),
            "ahead_hit_rate": med("ahead_hit_rate"),
            "breakdown": _median_breakdown([r["breakdown"] for r in runs]),
            "first_breakdown": _median_breakdown([r["first_breakdown"] for r in runs]), "repeats": runs}


def bench_peer(cfg: DeployConfig, peer: str, wl: BenchWorkload, repeats: int, log=print) -> dict[str, Any]:  # noqa: ANN001
    """``wl`` run ``repeats`` times by HF transformers (``hf_peer``: ``hf`` or ``hf-assisted``) in a
    process of its own, as a user would run it, on the config's target (and draft); medians, in the
    shape ``bench_mode`` returns (no utilization, KV or breakdown: one process, no pipeline)."""
    from nebula_flow.hf_peer import PEERS
    from nebula_flow.lookup import is_ngram
    from nebula_flow.tokenizer import TextCodec

    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    if "emulated" in (cfg.target.device, cfg.draft.device):
        raise ValueError(f"{peer} runs real checkpoints; this config's workers run on emulated devices")
    if cfg.target.device != "cpu":
        raise ValueError(f"{peer} is measured on the CPU; this config's target runs on {cfg.target.device}")
    assisted = peer == "hf-assisted"
    if assisted and (not cfg.draft.model or is_ngram(cfg.draft.model)):
        raise ValueError("hf-assisted needs a draft model in the config's [draft] pool")
    codec = TextCodec(cfg.target.model)
    spec = {"target": str(cfg.target.model), "draft": str(cfg.draft.model) if assisted else None,
            "dtype": cfg.target.dtype, "prompts": [codec.encode(p, chat=wl.chat) for p in wl.prompts],
            "max_new_tokens": wl.max_new_tokens, "temperature": wl.temperature, "ignore_eos": wl.ignore_eos,
            "repeats": repeats, "label": peer}
    with tempfile.TemporaryDirectory(prefix="nebula-flow-hf-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.hf_peer", str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stderr:  # progress as it comes; the rest kept for an error
            if line.startswith(f"  {peer} repeat"):
                log(line.rstrip())
            else:
                lines.append(line)
        out, code = proc.stdout.read(), proc.wait()
    if code != 0:
        raise RuntimeError(f"{peer} failed (exit code {code}):\n{''.join(lines[-20:])}")
    res = json.loads(out.strip().splitlines()[-1])
    runs = res["runs"]
    for r in runs:
        r["ttft_s"], r["latency_s"] = percentiles(r.pop("ttft")), percentiles(r.pop("latency"))
    empty = summary(0, {}, 0.0)
    return {**_medians(runs), "utilization": None, "kv_bytes": 0.0, "emulated_overrun_per_forward_s": 0.0,
            "breakdown": empty, "first_breakdown": empty, "threads": res["threads"], "dtype": res["dtype"],
            "transformers": res["transformers"], "repeats": runs}


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What every side of a bench reports: throughput, and TTFT and latency percentiles, each
    the median over repeats."""
    return {**{k: statistics.median(r[k] for r in runs) for k in ("tokens_per_s", "round_rate", "tokens_per_round")},
            **{k: {p: statistics.median(r[k][p] for r in runs) for p in ("p50", "p90", "p99")}
               for k in ("ttft_s", "latency_s")}}


def _median_breakdown(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each part's per-round seconds: the median over repeats (shares from those medians)."""
    runs = [r for r in runs if r["rounds"]]
    if not runs:
        return summary(0, {}, 0.0)
    per = {p: statistics.median(r["per_round_s"].get(p, 0.0) for r in runs) for p in runs[0]["per_round_s"]}
    return summary(statistics.median(r["rounds"] for r in runs), per,
                   statistics.median(r["per_token_s"] for r in runs))


FORWARDS = ("draft_forward", "verify_forward")
NOT_OVERHEAD = (*FORWARDS, "queue")  # a round's forwards, and its tasks waiting for a worker


def overhead_share(b: dict[str, Any]) -> float:
    """The share of a round's time that is neither forward passes nor waiting for a worker."""
    return 1.0 - sum(b["share"].get(p, 0.0) for p in NOT_OVERHEAD) if b["share"] else 0.0


def breakdown_table(results: dict[str, dict[str, Any]]) -> str:
    """Per mode, milliseconds per decode round by part (medians over repeats), the round's total,
    its time per token, and the overhead's share (all but the forwards and the queue)."""
    parts = [p for p in PARTS if any(r["breakdown"]["per_round_s"].get(p, 0.0) >= 5e-5 for r in results.values())]
    m = max(15, *(len(name) + 2 for name in results))
    head = f"{'ms per round':<{m}}" + "".join(f"{p:>{max(9, len(p) + 1)}}" for p in parts)
    rows = [head + f"{'total':>9}{'per token':>10}{'overhead':>9}"]
    for mode, r in results.items():
        b = r["breakdown"]
        if not b["rounds"]:
            rows.append(f"{mode:<{m}}" + ("(one process: no pipeline to break down)" if r["utilization"] is None
                                         else "(no decode rounds)"))
            continue
        per = b["per_round_s"]
        cells = "".join(f"{per.get(p, 0.0) * 1000:>{max(9, len(p) + 1)}.2f}" for p in parts)
        rows.append(f"{mode:<{m}}{cells}{per['total'] * 1000:>9.2f}{b['per_token_s'] * 1000:>10.2f}"
                    f"{overhead_share(b) * 100:>8.1f}%")
    return "\n".join(rows)


def table(results: dict[str, dict[str, Any]]) -> str:
    base_name = next(iter(results))
    base = results[base_name]
    w = max(20, len("tokens/s vs " + base_name) + 2)  # ratio columns fit the baseline's name
    m = max(15, *(len(name) + 2 for name in results))  # the mode column fits every mode's name
    rows = [f"{'mode':<{m}}{'tokens/s':>10}{'rounds/s':>10}{'tok/round':>10}{'util':>7}"
            f"{'TTFT p50':>10}{'lat p50':>9}{'lat p90':>9}{'KV MB':>8}{'rounds/s vs ' + base_name:>{w}}"
            f"{'tokens/s vs ' + base_name:>{w}}"]
    for mode, r in results.items():
        util = "-" if r["utilization"] is None else f"{r['utilization']:.2f}"  # (HF's peers: one process)
        rows.append(f"{mode:<{m}}{r['tokens_per_s']:>10.1f}{r['round_rate']:>10.1f}{r['tokens_per_round']:>10.2f}"
                    f"{util:>7}{r['ttft_s']['p50'] * 1000:>8.0f}ms{r['latency_s']['p50']:>8.2f}s"
                    f"{r['latency_s']['p90']:>8.2f}s{r['kv_bytes'] / 1e6:>8.1f}"
                    f"{r['round_rate'] / base['round_rate']:>{w - 1}.2f}x{r['tokens_per_s'] / base['tokens_per_s']:>{w - 1}.2f}x")
    return "\n".join(rows)


def raw_transport_gbps(transport: str, nbytes: int, repeats: int = 20, spread: bool = False) -> float:
    """Median bandwidth of back-to-back bare pulls of ``nbytes`` on this machine (kv/probe.py);
    ``spread``: each pull other rows of a buffer larger than the CPU's caches."""
    from nebula_flow.kv.probe import SPREAD_BYTES, RawPair

    pair = RawPair(transport, max(nbytes, SPREAD_BYTES) if spread else nbytes)
    try:
        return pair.gbps(nbytes, repeats, spread)
    finally:
        pair.close()


PROBE_PACE_MS = 20.0  # about one exchange per batch of a worker, as the system pulls
PROBE_START_S = 120.0
# Up to a long prompt's whole KV (the larger size classes of bench-kv's exchanges)
PROBE_SIZES = "16384,65536,262144,1048576,4194304,16777216"


@contextlib.contextmanager
def paced_probe(transport: str, out: Path):  # noqa: ANN201
    """Run paced raw pulls in a separate process for the duration of the block (kv/probe.py)."""
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.kv.probe", "--transport", transport,
                             "--pace-ms", str(PROBE_PACE_MS), "--sizes", PROBE_SIZES, "--out", str(out)],
                            stdout=subprocess.PIPE, text=True)
    give_up = threading.Timer(PROBE_START_S, proc.kill)  # a probe that never says ready must not hang us
    give_up.start()
    try:
        # Started (imports take seconds) before we time. A library may print to stdout first
        # (UCX prints its warnings there), so read up to the line that says so.
        ready = any(line.strip() == "ready" for line in proc.stdout)
        give_up.cancel()
        if not ready:
            raise RuntimeError(f"the raw {transport} probe failed to start (exit code {proc.wait(timeout=30)})")
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _kv_totals(address: str) -> dict[str, float]:
    with Client(address) as c:
        workers = c.status()["workers"]
    tot: dict[str, Any] = {"busy_s": sum(w["busy_s"] for w in workers)}
    for key in ("stall_s", "pull_s", "pull_cpu_s", "bytes_pulled", "pulls", "transfers", "pull_failures", "computed",
                "pulled", "files_recycled"):
        tot[key] = sum((w["kv"] or {}).get(key, 0) for w in workers)
    tot["by_size"] = {}
    for w in workers:
        add_by_size(tot["by_size"], (w["kv"] or {}).get("by_size") or {})
    return tot


def bench_kv(cfg: DeployConfig, wl: BenchWorkload, transport: str, log=print, repeats: int = 2) -> dict[str, Any]:  # noqa: ANN001
    """Pooled run with forced migration (every round moves KV), with and without overlap:
    ``repeats`` runs of each, in alternating order, reported as medians."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="nebula-flow-bench-kv-") as tmp:
        return _bench_kv(cfg, wl, transport, Path(tmp), log, repeats)


def _kv_run(cfg: DeployConfig, wl: BenchWorkload, overlap: bool, probe_out: Path, transport: str) -> dict[str, Any]:
    """One deployment, one workload: the KV counters it moved and its tokens/s."""
    with Deployment(cfg, worker_changes={"kv_overlap": overlap}) as dep:
        with Client(dep.address) as c:
            c.generate(wl.prompts[0], max_new_tokens=8)
        before = _kv_totals(dep.address)
        # The raw transport under the same load, as the system uses it: paced pulls in a
        # separate process while this run goes on (in both modes, so that the probe's own load
        # does not favour either in the tokens/s they report).
        with paced_probe(transport, probe_out):
            res = run_once(dep.address, wl)
        after = _kv_totals(dep.address)
    d = {k: after[k] - before[k] for k in after if k != "by_size"}
    by_size = add_by_size(dict(after["by_size"]), before["by_size"], sign=-1)
    return {"by_size": {size: c for size, c in by_size.items() if c[0] > 0}, "files_recycled": d["files_recycled"],
            "stall_fraction": d["stall_s"] / max(d["busy_s"], 1e-9), "stall_s": d["stall_s"],
            "compute_s": d["busy_s"], "pull_s": d["pull_s"], "pulls": d["pulls"], "transfers": d["transfers"],
            # the share of pull time the pulling thread was running; the rest it waited (for a
            # core on a busy machine, for the holder, for the wire)
            "pull_on_cpu": d["pull_cpu_s"] / max(d["pull_s"], 1e-9),
            "pull_failures": d["pull_failures"], "bytes_pulled": d["bytes_pulled"],
            "positions_pulled": d["pulled"], "positions_recomputed": d["computed"],
            "system_gbps": d["bytes_pulled"] / max(d["pull_s"], 1e-9) / 1e9,
            # one exchange carries every request a batch needs from one holder
            "mean_pull_bytes": d["bytes_pulled"] / max(d["transfers"], 1), "tokens_per_s": res["tokens_per_s"]}


def _bench_kv(cfg: DeployConfig, wl: BenchWorkload, transport: str, tmp: Path, log, repeats: int) -> dict[str, Any]:  # noqa: ANN001
    out: dict[str, Any] = {"transport": transport, "repeats": repeats}
    cfg.mode, cfg.kv_transport = "pooled", transport
    # speculate at every load: both roles' KV moves
    cfg.broker.policy = cfg.broker.policy.replace(migrate=True, disable_by_batch_size=0)
    cfg.broker.client_port = cfg.broker.worker_port = 0
    runs: dict[str, list[dict[str, Any]]] = {"overlap": [], "no_overlap": []}
    loaded_probes, probe_idle = [], tmp / "idle.json"
    for rep in range(repeats):
        # Alternate which mode runs first (A B B A ...): on this machine a deployment's tokens/s
        # depended on its place in the sequence by up to ~10 %, which a fixed order reads as a
        # difference between the modes.
        for overlap in (True, False) if rep % 2 == 0 else (False, True):
            key = "overlap" if overlap else "no_overlap"
            probe = tmp / f"loaded-{key}-{rep}.json"
            run = _kv_run(cfg, wl, overlap, probe, transport)
            runs[key].append(run)
            if overlap:
                loaded_probes.append(probe)
            log(f"  {key} ({rep + 1}/{repeats}): stall {run['stall_fraction'] * 100:.2f}% of compute, "
                f"{run['pulls']:.0f} pulls in {run['transfers']:.0f} exchanges, "
                f"{run['bytes_pulled'] / 1e6:.1f} MB, {run['tokens_per_s']:.1f} tokens/s")
    for key, rs in runs.items():
        out[key] = {name: statistics.median(r[name] for r in rs) for name in rs[0] if name != "by_size"}
        out[key]["runs"] = rs
    size = int(out["overlap"]["mean_pull_bytes"]) or 1 << 20
    out["raw_gbps_same_size"] = raw_transport_gbps(transport, size)
    out["raw_gbps_4mib"] = raw_transport_gbps(transport, 4 << 20)
    out["bandwidth_ratio"] = out["overlap"]["system_gbps"] / out["raw_gbps_same_size"]
    # The same, each pull's data from memory rather than the cache (as every real pull's is)
    out["raw_spread_gbps_same_size"] = raw_transport_gbps(transport, size, spread=True)
    out["raw_spread_gbps_4mib"] = raw_transport_gbps(transport, 4 << 20, spread=True)
    out["bandwidth_ratio_spread"] = out["overlap"]["system_gbps"] / out["raw_spread_gbps_same_size"]
    # Paced raw pulls: on the idle machine now, and (recorded above) while the system ran.
    with paced_probe(transport, probe_idle):
        time.sleep(8)
    from nebula_flow.kv.probe import paced_gbps

    for key, paths in (("idle", [probe_idle]), ("loaded", loaded_probes)):
        samples: dict[int, list[float]] = {}
        for path in paths:
            for k, v in json.loads(path.read_text()).items():
                samples.setdefault(int(k), []).extend(v)
        out[f"raw_paced_{key}_gbps"] = paced_gbps(samples, size)
        out[f"bandwidth_ratio_paced_{key}"] = out["overlap"]["system_gbps"] / out[f"raw_paced_{key}_gbps"]
    out["by_size"] = _by_size_against_raw(runs["overlap"], transport, samples)  # (paced: the loaded samples)
    out["raw_pace_ms"] = PROBE_PACE_MS
    return out


def _by_size_against_raw(runs: list[dict[str, Any]], transport: str, paced: dict[int, list[float]]) -> dict[str, Any]:
    """The in-system bandwidth of each size class of exchanges against raw pulls at that class's
    mean size: back to back with the data from memory, and paced like the system's during the
    run (``paced`` samples). Over all exchanges, the time raw pulls of the same sizes would take
    against the time the system took (the "size-matched" ratio). Medians over ``runs``."""
    from nebula_flow.kv.probe import paced_gbps

    classes: dict[str, dict[str, list[float]]] = {}
    raw: dict[str, float] = {}
    matched: dict[str, list[float]] = {"b2b": [], "paced": []}
    for run in runs:
        raw_s = paced_s = sys_s = 0.0
        for size, (n, nbytes, took) in run["by_size"].items():
            if size not in raw:  # (measured once, at the first run's mean size of the class)
                raw[size] = raw_transport_gbps(transport, int(nbytes / n), spread=True)
            c = classes.setdefault(size, {"exchanges": [], "mean_bytes": [], "system_gbps": [], "paced_gbps": []})
            c["exchanges"].append(n)
            c["mean_bytes"].append(nbytes / n)
            c["system_gbps"].append(nbytes / max(took, 1e-9) / 1e9)
            c["paced_gbps"].append(paced_gbps(paced, nbytes / n))
            raw_s += nbytes / (raw[size] * 1e9)
            paced_s += nbytes / (c["paced_gbps"][-1] * 1e9)
            sys_s += took
        matched["b2b"].append(raw_s / max(sys_s, 1e-9))
        matched["paced"].append(paced_s / max(sys_s, 1e-9))
    out: dict[str, Any] = {"classes": {}, **{f"size_matched_ratio_{k}": statistics.median(v) if v else 0.0
                                              for k, v in matched.items()}}
    for size in sorted(classes, key=list(PULL_SIZE_CLASSES).index):
        c = {k: statistics.median(v) for k, v in classes[size].items()}
        c["raw_gbps"] = raw[size]
        c["ratio"] = c["system_gbps"] / raw[size]
        c["ratio_paced"] = c["system_gbps"] / c["paced_gbps"]
        out["classes"][size] = c
    return out


def kv_report(res: dict[str, Any]) -> str:
    """``bench_kv``'s result as the text ``bench-kv`` prints."""
    lines = [f"medians of {res['repeats']} run(s) per mode, transport {res['transport']}"]
    for key in ("overlap", "no_overlap"):
        r = res[key]
        lines.append(f"{key:<11} stall {r['stall_fraction'] * 100:6.2f}% of compute ({r['stall_s']:.3f} s / "
                     f"{r['compute_s']:.2f} s), {r['pulls']:.0f} pulls, {r['bytes_pulled'] / 1e6:.1f} MB, "
                     f"{r['positions_recomputed']:.0f} positions recomputed, {r['tokens_per_s']:.1f} tokens/s")
    o, size = res["overlap"], res["overlap"]["mean_pull_bytes"]
    lines.append(f"bandwidth  in-system {o['system_gbps']:.2f} GB/s: {o['pull_s'] / max(o['transfers'], 1) * 1e6:.0f} us "
                 f"per exchange of {size / 1e3:.0f} kB on average (the pulling thread on a core "
                 f"{o['pull_on_cpu'] * 100:.0f}% of that time)")
    lines.append(f"raw {res['transport']}, back to back, at that size: data in cache {res['raw_gbps_same_size']:.2f} GB/s "
                 f"-> ratio {res['bandwidth_ratio']:.2f}; data from memory {res['raw_spread_gbps_same_size']:.2f} GB/s "
                 f"-> ratio {res['bandwidth_ratio_spread']:.2f} (at 4 MiB: {res['raw_gbps_4mib']:.2f} and "
                 f"{res['raw_spread_gbps_4mib']:.2f} GB/s)")
    by = res["by_size"]
    lines.append(f"by exchange size (overlap runs; raw at the class's mean size: back to back with the data from "
                 f"memory, and paced during the run; {o['files_recycled']:.0f} caches got a pooled file):")
    for size, c in by["classes"].items():
        lines.append(f"  {size:<9}{c['exchanges']:5.0f} exchanges of {c['mean_bytes'] / 1e3:7.0f} kB: in-system "
                     f"{c['system_gbps']:6.2f} GB/s; raw b2b {c['raw_gbps']:6.2f} GB/s -> ratio {c['ratio']:.2f}; "
                     f"raw paced {c['paced_gbps']:6.2f} GB/s -> ratio {c['ratio_paced']:.2f}")
    lines.append(f"  all sizes: raw pulls of the same sizes would take {by['size_matched_ratio_b2b']:.2f} (b2b) and "
                 f"{by['size_matched_ratio_paced']:.2f} (paced) of the time the system's took (size-matched ratios)")
    lines.append(f"raw {res['transport']}, one pull per {res['raw_pace_ms']:.0f} ms, at that size: idle machine "
                 f"{res['raw_paced_idle_gbps']:.2f} GB/s -> ratio {res['bandwidth_ratio_paced_idle']:.2f}; during the "
                 f"run (same load) {res['raw_paced_loaded_gbps']:.2f} GB/s -> ratio {res['bandwidth_ratio_paced_loaded']:.2f}")
    return "\n".join(lines)
