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
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nebula_flow.client import AsyncClient, Client, Completion, RequestError
from nebula_flow.config import DeployConfig
from nebula_flow.deploy import Deployment, is_broker
from nebula_flow.process import cpu_seconds
from nebula_flow.round_times import PARTS, breakdown, summary
from nebula_flow.stats import is_urgent, percentiles

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
# Chat requests for JSON records (``--json-schema``, e.g. configs/schemas/person.json): structured outputs.
DEFAULT_JSON_PROMPTS = [
    "Make up a software engineer and describe them as JSON.", "Describe a fictional data scientist as JSON.",
    "Invent a Python developer who maintains an open-source library; give their profile as JSON.",
    "Describe a junior web developer as JSON.", "Make up a researcher who writes C++ and Rust; answer in JSON.",
    "Describe a fictional game programmer as JSON.", "Invent a DevOps engineer and describe them as JSON.",
    "Describe a retired COBOL programmer as JSON.",
]
_EDITS = ["Add type hints to this Python code. Reply with the whole code only.",
          "Add a docstring to this Python code. Reply with the whole code only."]
DEFAULT_EDIT_PROMPTS = [f"{edit}\n\n```python\n{code}```" for edit in _EDITS for code in _EDIT_CODE]


def edit_prediction(prompt: str) -> str | None:
    """An edit request's prediction of its answer (``--predict``): the code it asks to change,
    as OpenAI's Predicted Outputs guide passes it (None: the prompt holds no code block)."""
    start = prompt.find("```python\n")
    end = prompt.find("```", start + 10) if start >= 0 else -1
    return prompt[start + 10:end] if end >= 0 else None


def with_context(prompts: list[str], context_tokens: int, model: str | Path, shared: bool = False,
                 stretch: int = 0) -> list[str]:
    """Each prompt after about ``context_tokens`` tokens of code to read first (a different
    stretch of the stdlib's sources per prompt, cut in tokens and decoded back to text): code
    completion with a file open, where the prompt's KV is most of the bytes that move.
    ``shared``: the same stretch for every prompt (a shared system prompt or document: what
    the workers' prefix cache saves), the ``stretch``-th (another document for each value)."""
    if context_tokens <= 0:
        return list(prompts)
    from nebula_flow.corpus import corpus_files
    from nebula_flow.tokenizer import TextCodec

    codec = TextCodec(model)
    ids: list[int] = []
    for f in corpus_files(None):
        # (a file's first 16k characters: fewer tokens than any model's context, so no warning)
        ids += codec.encode(f.read_text(errors="ignore")[:16_000], special=False)
        if len(ids) >= context_tokens * (stretch + 1 if shared else len(prompts)):
            break
    heads = [codec.decode(ids[stretch * context_tokens:(stretch + 1) * context_tokens])] * len(prompts) if shared else \
        [codec.decode(ids[i * context_tokens:(i + 1) * context_tokens]) for i in range(len(prompts))]
    return [f"{head}\n{p}" for head, p in zip(heads, prompts)]


@dataclass
class BenchWorkload:
    prompts: list[str]
    max_new_tokens: int = 64
    concurrency: int = 1
    temperature: float = 0.0
    ignore_eos: bool = True  # fixed-length outputs keep modes comparable
    chat: bool = False  # send each prompt as a user message in the model's chat format
    top_p: float = 1.0  # nucleus sampling (with a temperature): 1 = the whole distribution
    structured: dict[str, Any] | None = None  # every request's structured output (``nebula_flow/structured.py``)
    predictions: list[str | None] | None = None  # each prompt's prediction of its answer (Predicted Outputs)
    turns: int = 1  # chat: each request a conversation of this many turns, each sent with the ones before it
    urgent_every: int = 0  # requests 0, N, 2N, ... are urgent: their latency is reported apart (``urgent_latency_s``)
    urgent_priority: int = 0  # the priority urgent requests are sent at (-1 where the policy schedules by priority)
    # a shared start new to the deployment in each repeat (``--fresh-prefix``): the warm-up's prompts, then each repeat's
    fresh: list[list[str]] | None = None
    seeded: bool = True  # sampled requests carry seeds (the same samples in every mode), or none (as API clients send)


# A conversation's later turns (``BenchWorkload.turns``), each asked after the answers before it.
FOLLOW_UPS = ["Now explain that in two sentences.", "Can you make it shorter?", "Add one test for it."]


URGENT_KEYS = ("urgent_ttft_s", "urgent_latency_s", "other_ttft_s", "other_latency_s")


async def _closed_loop(address: str, wl: BenchWorkload, api: str | None = None,
                       urgent: list[bool] | None = None) -> list[Completion]:
    """``wl`` through the ZeroMQ client, or through the HTTP API at ``api``; ``urgent`` gets whether
    each answer's request was urgent (``BenchWorkload.urgent_every``), in the answers' order."""
    from nebula_flow.api.http_client import HttpClient

    queue = list(enumerate(wl.prompts))
    outs: list[Completion] = []
    async with HttpClient(api) if api else AsyncClient(address, timeout_s=600) as client:
        async def user() -> None:
            while queue:
                i, prompt = queue.pop(0)
                priority = {"priority": wl.urgent_priority} if is_urgent(wl.urgent_every, i) and wl.urgent_priority else {}
                if wl.turns > 1:
                    done = await _conversation(client, wl, i, prompt, **priority)
                else:
                    done = [await client.generate(prompt, max_new_tokens=wl.max_new_tokens, temperature=wl.temperature,
                                                  top_p=wl.top_p, seed=i if wl.seeded else None,
                                                  ignore_eos=wl.ignore_eos, chat=wl.chat,
                                                  **({"structured": wl.structured} if wl.structured else {}),
                                                  **({"prediction": wl.predictions[i]} if wl.predictions else {}),
                                                  **priority)]
                outs.extend(done)
                if urgent is not None:
                    urgent.extend([is_urgent(wl.urgent_every, i)] * len(done))
        await asyncio.gather(*(user() for _ in range(max(1, wl.concurrency))))
    return outs


async def _conversation(client: Any, wl: BenchWorkload, i: int, prompt: str,  # noqa: ANN401
                        **params: Any) -> list[Completion]:  # noqa: ANN401
    """Request ``i`` as a chat of ``wl.turns`` turns: ``prompt``, then ``FOLLOW_UPS``, each sent
    with the conversation so far (what a chat user sends: the earlier turns' KV is what the
    workers' prefix cache and the broker's placement by prefix keep), under one ``prompt_cache_key``
    (with broker shards, its turns go to one: ``shards.route``)."""
    history: list[dict[str, str]] = []
    outs = []
    for turn in range(wl.turns):
        history.append({"role": "user", "content": prompt if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]})
        out = await client.generate(messages=list(history), max_new_tokens=wl.max_new_tokens,
                                    temperature=wl.temperature, top_p=wl.top_p,
                                    seed=i * wl.turns + turn if wl.seeded else None,
                                    ignore_eos=wl.ignore_eos, prompt_cache_key=f"conversation-{i}", **params)
        history.append({"role": "assistant", "content": out.text})
        outs.append(out)
    return outs


def _busy(state: dict[str, Any]) -> dict[int, float]:
    return {w["id"]: w["busy_s"] for w in state["workers"]}


def _kv_bytes(state: dict[str, Any]) -> float:
    return sum((w["kv"] or {}).get("bytes_pulled", 0) for w in state["workers"])


def host_cpu_s(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of a deployment's processes on this host, by kind (``pids``: kind -> pids);
    a process that is gone, or a host without ``/proc``, counts nothing."""
    seconds = dict.fromkeys(pids, 0.0)
    for kind, group in pids.items():
        for pid in group:
            with contextlib.suppress(OSError, ValueError, IndexError):
                seconds[kind] += cpu_seconds(pid)
    return seconds


def run_once(address: str, wl: BenchWorkload, api: str | None = None, pids: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """``wl`` once against the deployment at ``address``; ``pids``: its processes on this host by kind
    (``broker``, ``workers``), whose CPU time per request-round the result then carries."""
    with Client(address) as c:
        s0 = c.status()
        busy0, kv0, cpu0 = _busy(s0), _kv_bytes(s0), host_cpu_s(pids or {})
        t0 = time.monotonic()
        urgent: list[bool] = []
        outs = asyncio.run(_closed_loop(address, wl, api, urgent))
        wall = time.monotonic() - t0
        s1 = c.status()
        busy1, cpu1 = _busy(s1), host_cpu_s(pids or {})
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
    ahead = {k: since(v, s0.get("draft_ahead", {}).get(k)) for k, v in s1.get("draft_ahead", {}).items()}
    fused = {k: since(v, s0.get("fusion", {}).get(k)) for k, v in s1.get("fusion", {}).items() if k != "won_by"}
    return {"wall_s": wall, "requests": len(outs), "tokens": tokens, "rounds": rounds,
            # draft-ahead: its counters, and the share of rounds whose draft a pre-draft was
            "draft_ahead": ahead, "ahead_hit_rate": ahead.get("hits", 0) / max(rounds, 1),
            # fused drafters: second drafts, fused rounds, tokens their chains won; the share of rounds fused
            "fusion": fused, "fused_rate": fused.get("rounds", 0) / max(rounds, 1),
            "tokens_per_s": tokens / wall, "round_rate": rounds / wall,
            # host CPU per request-round of the broker(s) and of the workers (each process's own
            # seconds: what a bigger host or a GPU's host would pay, apart from this one's wall clock)
            "cpu_per_round_s": {kind: (cpu1[kind] - cpu0[kind]) / max(rounds, 1) for kind in cpu0},
            "tokens_per_round": tokens / max(rounds, 1),
            # the share of the prompts' tokens the workers' prefix cache held (copied, not computed)
            "prompt_cached": sum(o.stats.get("cached_tokens", 0) for o in outs)
            / max(1, sum(o.stats.get("prompt_tokens", 0) for o in outs)),
            "utilization": statistics.mean(util.values()) if util else 0.0, "workers": workers,
            "kv_bytes": _kv_bytes(s1) - kv0, "forwards": forwards,
            # emulated devices: mean time a forward ran past its profile (the host falling behind)
            "emulated_overrun_per_forward_s": overrun / forwards if forwards else 0.0,
            "ttft_s": percentiles([o.ttft_s for o in outs]), "latency_s": percentiles([o.latency_s for o in outs]),
            # (--urgent: the urgent requests' and the others' latency apart)
            **({f"{who}_{what}_s": percentiles([getattr(o, f"{what}_s") for o, u in zip(outs, urgent) if u == (who == "urgent")])
                for who in ("urgent", "other") for what in ("ttft", "latency")} if wl.urgent_every else {}),
            # where the rounds' time went (round_times): decode rounds, and first rounds (with the prefill)
            "breakdown": breakdown(s0, s1), "first_breakdown": breakdown(s0, s1, "first")}


def bench_mode(cfg: DeployConfig, mode: str, wl: BenchWorkload, repeats: int, log=print, label: str | None = None,  # noqa: ANN001
               vias: tuple[str, ...] = ("zmq",), predict: bool = False) -> dict[str, dict[str, Any]]:
    """Run ``wl`` ``repeats`` times on a fresh deployment of ``cfg`` in ``mode``; medians, by front
    door (``vias``: ``zmq``, the client library; ``api``, the HTTP API, started with the deployment;
    both: each repeat runs both on the same deployment, in turns). ``predict``: each door also runs
    ``wl`` with each edit request's prediction (``edit_prediction``), in turns, as ``DOOR predicted``.
    ``label``: the name progress lines use (default: the mode)."""
    cfg.mode = mode
    cfg.broker.client_port = cfg.broker.worker_port = 0
    # (urgent requests go at priority -1 where the policy schedules by priority; elsewhere they are only counted)
    wl = replace(wl, urgent_priority=-1 if cfg.broker.policy.priority_scheduling else 0)
    sides = [*vias, *(f"{via} predicted" for via in vias if predict)]
    predicted = replace(wl, predictions=[edit_prediction(p) for p in wl.prompts]) if predict else wl
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    with Deployment(cfg) as dep:
        url = dep.start_api("127.0.0.1", 0, model_name="bench") if "api" in vias else None
        pids = {"broker": [p.pid for name, p in dep.procs if is_broker(name)],
                "workers": [p.pid for name, p in dep.procs if not is_broker(name) and name != "api"]}
        with Client(dep.address) as c:  # warm-up: first-call allocations, page faults
            try:
                c.generate(wl.fresh[0][0] if wl.fresh else wl.prompts[0], max_new_tokens=8)
            except RequestError as exc:
                raise RuntimeError(f"{mode}: warm-up failed: {exc}") from None
        for r in range(repeats):
            for side in sides[::-1] if r % 2 else sides:  # (turns: drift of a noisy machine falls on both)
                via = side.split()[0]
                res = run_once(dep.address, replace(wl, prompts=wl.fresh[r + 1]) if wl.fresh else
                               predicted if side.endswith("predicted") else wl, url if via == "api" else None, pids)
                hits = f", {res['ahead_hit_rate']:.0%} of rounds pre-drafted" if res["draft_ahead"].get("tasks") else ""
                if res["fused_rate"]:
                    hits += f", {res['fused_rate']:.0%} of rounds fused"
                log(f"  {label or mode}{' via ' + side if len(sides) > 1 else ''} repeat {r + 1}/{repeats}: "
                    f"{res['tokens_per_s']:.1f} tokens/s, {res['round_rate']:.1f} rounds/s, "
                    f"{res['tokens_per_round']:.2f} tokens/round{hits}")
                runs[side].append(res)
    return {side: _median_run(done) for side, done in runs.items()}


def since(after: Any, before: Any) -> Any:  # noqa: ANN401
    """A counter's growth between two status reads: ``after - before``, item by item for a list of
    counters (draft-ahead's hits by outcome), a counter not there before counting from 0."""
    if isinstance(after, list):
        before = before or []
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    return after - (before or 0)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {**_medians(runs), "utilization": med("utilization"),
            "kv_bytes": med("kv_bytes"), "emulated_overrun_per_forward_s": med("emulated_overrun_per_forward_s"),
            "ahead_hit_rate": med("ahead_hit_rate"), "fused_rate": med("fused_rate"), "prompt_cached": med("prompt_cached"),
            "cpu_per_round_s": {kind: statistics.median(r["cpu_per_round_s"][kind] for r in runs)
                                for kind in runs[0]["cpu_per_round_s"]},
            "breakdown": _median_breakdown([r["breakdown"] for r in runs]),
            "first_breakdown": _median_breakdown([r["first_breakdown"] for r in runs]), "repeats": runs}


def bench_peer(cfg: DeployConfig, peer: str, wl: BenchWorkload, repeats: int, log=print) -> dict[str, Any]:  # noqa: ANN001
    """``wl`` run ``repeats`` times by HF transformers (``hf_peer``: ``hf``, ``hf-assisted`` or ``hf-lookup``) in a
    process of its own, as a user would run it, on the config's target (and draft); medians, in the
    shape ``bench_mode`` returns (no utilization, KV or breakdown: one process, no pipeline)."""
    from nebula_flow.hf_peer import LOOKUP_TOKENS, PEERS
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
            "max_new_tokens": wl.max_new_tokens, "temperature": wl.temperature, "top_p": wl.top_p,
            "ignore_eos": wl.ignore_eos, "repeats": repeats, "label": peer,
            "lookup": LOOKUP_TOKENS if peer == "hf-lookup" else None}
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
               for k in ("ttft_s", "latency_s", *URGENT_KEYS) if k in runs[0]}}


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
    its time per token, the overhead's share (all but the forwards and the queue), and the CPU time
    per request-round (every round, prefills too) of the broker and of the workers on this host."""
    parts = [p for p in PARTS if any(r["breakdown"]["per_round_s"].get(p, 0.0) >= 5e-5 for r in results.values())]
    m = max(15, *(len(name) + 2 for name in results))
    head = f"{'ms per round':<{m}}" + "".join(f"{p:>{max(9, len(p) + 1)}}" for p in parts)
    rows = [head + f"{'total':>9}{'per token':>10}{'overhead':>9}{'broker CPU':>11}{'worker CPU':>11}"]
    for mode, r in results.items():
        b = r["breakdown"]
        if not b["rounds"]:
            rows.append(f"{mode:<{m}}" + ("(one process: no pipeline to break down)" if r["utilization"] is None
                                         else "(no decode rounds)"))
            continue
        per = b["per_round_s"]
        cells = "".join(f"{per.get(p, 0.0) * 1000:>{max(9, len(p) + 1)}.2f}" for p in parts)
        cpu = r.get("cpu_per_round_s", {})
        rows.append(f"{mode:<{m}}{cells}{per['total'] * 1000:>9.2f}{b['per_token_s'] * 1000:>10.2f}"
                    f"{overhead_share(b) * 100:>8.1f}%" + "".join(f"{cpu[k] * 1000:>11.2f}" if k in cpu else f"{'-':>11}"
                                                                  for k in ("broker", "workers")))
    return "\n".join(rows)


def urgent_lines(results: dict[str, dict[str, Any]]) -> str:
    """``--urgent``: each mode's urgent requests' latency beside the others'."""
    return "\n".join(f"{mode}: urgent requests TTFT p50 {r['urgent_ttft_s']['p50'] * 1000:.0f} ms, latency p50 "
                     f"{r['urgent_latency_s']['p50']:.2f} s, p90 {r['urgent_latency_s']['p90']:.2f} s; the others TTFT p50 "
                     f"{r['other_ttft_s']['p50'] * 1000:.0f} ms, latency p50 {r['other_latency_s']['p50']:.2f} s, "
                     f"p90 {r['other_latency_s']['p90']:.2f} s" for mode, r in results.items() if "urgent_latency_s" in r)


def table(results: dict[str, dict[str, Any]]) -> str:
    base_name = next(iter(results))
    base = results[base_name]
    w = max(20, len("tokens/s vs " + base_name) + 2)  # ratio columns fit the baseline's name
    m = max(15, *(len(name) + 2 for name in results))  # the mode column fits every mode's name
    rows = [f"{'mode':<{m}}{'tokens/s':>10}{'rounds/s':>10}{'tok/round':>10}{'util':>7}"
            f"{'TTFT p50':>10}{'lat p50':>9}{'lat p90':>9}{'cached':>8}{'KV MB':>8}{'rounds/s vs ' + base_name:>{w}}"
            f"{'tokens/s vs ' + base_name:>{w}}"]
    for mode, r in results.items():
        util = "-" if r["utilization"] is None else f"{r['utilization']:.2f}"  # (HF's peers: one process)
        # (the share of the prompts' tokens the prefix cache held; HF's peers: none kept)
        cached = "-" if r.get("prompt_cached") is None else f"{r['prompt_cached'] * 100:.0f}%"
        rows.append(f"{mode:<{m}}{r['tokens_per_s']:>10.1f}{r['round_rate']:>10.1f}{r['tokens_per_round']:>10.2f}"
                    f"{util:>7}{r['ttft_s']['p50'] * 1000:>8.0f}ms{r['latency_s']['p50']:>8.2f}s"
                    f"{r['latency_s']['p90']:>8.2f}s{cached:>8}{r['kv_bytes'] / 1e6:>8.1f}"
                    f"{r['round_rate'] / base['round_rate']:>{w - 1}.2f}x{r['tokens_per_s'] / base['tokens_per_s']:>{w - 1}.2f}x")
    return "\n".join(rows)
