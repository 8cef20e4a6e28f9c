"""The broker's dispatch path measured alone (`nebula-flow bench-broker`): a real broker process
driven by workers whose forwards cost nothing and by clients, all in one light load-generator
process (asyncio, one socket per worker), so what is measured is the broker's own work.

A zero-cost worker speaks the worker protocol as a real one does (REGISTER, PULL, RESULT,
heartbeats), answering each task at once: a draft of ``k`` tokens, a verify that accepts the
whole draft and adds one token, an ahead task with nothing made. The figure that transfers to
bigger hosts is the broker's **CPU time per request-round** (its process's user + system seconds
over the rounds it ended): on a 2-core machine wall-clock throughput of the broker, the load
generator and the clients together says little.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from nebula_flow import protocol
from nebula_flow.client import AsyncClient, Client, NebulaError
from nebula_flow.deploy import free_port, http_answers
from nebula_flow.process import cpu_seconds
from nebula_flow.protocol import Heartbeat, Pull, Register, Result, TaskResult, Tasks, Welcome
from nebula_flow.roles import MODES
from nebula_flow.shards import fewest_workers

TOKEN = 7  # what zero-cost workers draft and commit (not an EOS id of the tiny pair)
ZERO_FACTS = {"path": "zero-cost", "device": "none", "vocab_size": 1 << 20, "max_model_len": 1 << 20}  # (its REGISTER)
# Policy settings that keep a round's shape fixed: k draft tokens, nothing fused or branched.
FIXED_POLICY = ["adaptive_k=false", "measure_costs=false", "first_alternatives=0", "fuse_ngram=0", "draft_ahead=0",
                "max_forward_tokens=0", "disable_by_batch_size=0"]


def answer(task: Any) -> TaskResult:  # noqa: ANN401
    """A zero-cost worker's result for one task."""
    kind = task.kind
    if kind == "draft":
        return TaskResult(task.rid, kind, task.round, task.attempt, draft=[TOKEN] * task.k)
    if kind == "verify":
        return TaskResult(task.rid, kind, task.round, task.attempt, committed=[*task.draft, TOKEN])
    if kind == "round":
        draft = [TOKEN] * task.k
        return TaskResult(task.rid, kind, task.round, task.attempt, draft=draft, committed=[*draft, TOKEN])
    return TaskResult(task.rid, kind, task.round, task.attempt)  # (ahead: nothing made)


async def zero_worker(ctx: zmq.asyncio.Context, address: str, role: str, name: str, capacity: int,
                      stop: asyncio.Event) -> int:
    """One zero-cost worker until ``stop``; returns the tasks it answered."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    await sock.send_multipart(protocol.encode(Register(role, name, capacity, ZERO_FACTS, pid=os.getpid())))
    done, last = 0, time.monotonic()
    try:
        while not stop.is_set():
            if not await sock.poll(200):
                await sock.send_multipart(protocol.encode(Heartbeat()))
                continue
            msg = protocol.decode(await sock.recv_multipart(copy=False))
            if isinstance(msg, Welcome):
                await sock.send_multipart(protocol.encode(Pull(capacity, True)))
            elif isinstance(msg, Tasks):
                tasks = [t for t in msg.tasks if not isinstance(t, protocol.Rejected)]
                await sock.send_multipart(protocol.encode(Result([answer(t) for t in tasks])))
                await sock.send_multipart(protocol.encode(Pull(capacity, True)))
                done += len(tasks)
            if time.monotonic() - last > 0.5:  # (liveness, whatever else is said)
                await sock.send_multipart(protocol.encode(Heartbeat()))
                last = time.monotonic()
    finally:
        sock.close()
    return done


def prompt(i: int, length: int) -> list[int]:
    """Request ``i``'s prompt of ``length`` token ids (distinct requests, ids every tokenizer has)."""
    return [5, 6, 7, 8, i % 50 + 10][:length] + [(i + j) % 50 + 10 for j in range(length - 5)]


def worker_roles(mode: str, workers: int) -> list[str]:
    """``workers`` per stage of ``mode`` (pooled, paired: draft and target; elastic: elastic workers,
    each taking either stage; the others: their one role)."""
    roles = ("any",) if mode == "elastic" else MODES[mode]  # (elastic also admits fixed roles: none here)
    return [role for role in roles for _ in range(workers)]


async def _drive(client_address: str, worker_addresses: list[str], mode: str, workers: int, capacity: int,
                 concurrency: int, requests: int, max_new_tokens: int, api: str | None = None,
                 pids: tuple[int, ...] = (), prompt_tokens: int = 5) -> dict[str, Any]:
    """The run: zero-cost workers, warm-up, then ``requests`` through the ZeroMQ client (or the
    gateway at ``api``). The CPU seconds of the processes ``pids`` are read beside the status
    snapshots that count the rounds, so start-up, registration and warm-up are in neither."""
    from nebula_flow.api.http_client import HttpClient

    ctx = zmq.asyncio.Context.instance()
    stop = asyncio.Event()
    # (a worker serving several shards speaks to each over a socket of its own, as a one-shard
    # worker does: from a shard's side, one zero-cost worker loop per worker per shard)
    pool = [asyncio.ensure_future(zero_worker(ctx, address, role, f"zero-{role}-{i}", capacity, stop))
            for i, role in enumerate(worker_roles(mode, workers)) for address in worker_addresses]
    queue = list(range(requests))
    async with AsyncClient(client_address, timeout_s=120) as client, \
            (HttpClient(api, timeout_s=120) if api else contextlib.nullcontext()) as http:
        while fewest_workers(state := await client.status()) < len(worker_roles(mode, workers)):
            await asyncio.sleep(0.05)
        if max_new_tokens + prompt_tokens > state["max_model_len"]:
            stop.set()
            raise ValueError(f"max_new_tokens {max_new_tokens} does not fit the model's context of "
                             f"{state['max_model_len']} tokens (with the {prompt_tokens}-token prompts)")

        front = http or client  # (requests through the gateway carry its ids, not ours)

        async def user() -> None:
            while queue:
                i = queue.pop()
                ids = {} if api else {"request_id": f"bench-{i}"}  # (ids: the same shards every run)
                await front.generate(token_ids=prompt(i, prompt_tokens), max_new_tokens=max_new_tokens,
                                     ignore_eos=True, **ids)

        await asyncio.gather(*(client.generate(token_ids=[5, 6, 7], max_new_tokens=8, ignore_eos=True)
                               for _ in range(2 * len(worker_addresses))))  # (warm-up, every shard)
        before, cpu0, t0 = await client.status(), [cpu_seconds(pid) for pid in pids], time.monotonic()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.monotonic() - t0
        after = await client.status()
        cpu = [cpu_seconds(pid) - c0 for pid, c0 in zip(pids, cpu0)]
    stop.set()
    tasks = sum(await asyncio.gather(*pool))
    return {"before": before, "after": after, "wall_s": wall, "tasks": tasks, "cpu_s": cpu}


def start_broker(args: list[str], out, profile: Path | None = None,  # noqa: ANN001
                 env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[subprocess.Popen, str]:
    """A broker process with ``args`` (after ``broker``; ``--client-port`` among them), its output
    to the file ``out``, and its client address once it answers. ``env``/``cwd``: run another
    checkout's broker (``tools/bench_long_prompt.py --tree``)."""
    runner = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else []), "-m", "nebula_flow.cli"]
    proc = subprocess.Popen([*runner, "broker", *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    address = f"tcp://127.0.0.1:{args[args.index('--client-port') + 1]}"
    with Client(address, timeout_s=1.0) as c:
        deadline = time.monotonic() + 60
        while True:
            try:
                c.status()
                return proc, address
            except NebulaError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out.seek(0)
                    raise RuntimeError(f"the broker did not start:\n{out.read().decode()[-2000:]}") from None


def start_gateway(brokers: list[str], out) -> tuple[subprocess.Popen, str]:  # noqa: ANN001
    """An HTTP gateway (``nebula-flow api``) in front of ``brokers``, its output to the file ``out``,
    and its URL once ``/health`` answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "api", "--broker", ",".join(brokers), "--port",
                             str(port), "--served-model-name", "bench"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    if http_answers(url, proc, 60):
        return proc, url
    proc.kill()
    out.seek(0)
    raise RuntimeError(f"the HTTP gateway did not start:\n{out.read().decode()[-2000:]}")


def bench_broker(mode: str, model: str | None, workers: int = 4, capacity: int = 32, concurrency: int = 64,
                 requests: int = 256, max_new_tokens: int = 128, k: int = 4, profile: Path | None = None,
                 log=print, shards: int = 1, api: bool = False, prompt_tokens: int = 5,
                 full_tokens: bool = False) -> dict[str, Any]:  # noqa: ANN001
    """``shards`` brokers (one, unless sharded) in ``mode`` under zero-cost workers; their CPU per
    request-round (over all shards, and each shard's own) and rates. ``profile``: run the (first)
    broker under cProfile and write its stats there. ``api``: the requests go through an HTTP
    gateway in front of the brokers, and its CPU per token streamed is measured too.
    ``prompt_tokens``: each request's prompt length; ``full_tokens``: the brokers send every task
    the request's whole tokens (``BrokerOptions.full_tokens``), not only what its worker lacks."""
    procs, clients, worker_addresses = [], [], []
    url = None
    with tempfile.TemporaryFile() as out:
        try:
            for shard in range(shards):
                client_port, worker_port = free_port(), free_port()
                args = ["--mode", mode, "--client-port", str(client_port), "--worker-port", str(worker_port),
                        "--k", str(k), "--liveness-s", "30", "--shard", str(shard), "--shards", str(shards),
                        *(["--model", model] if model else []), *(f"--set={s}" for s in FIXED_POLICY),
                        *(["--full-tokens"] if full_tokens else [])]
                proc, address = start_broker(args, out, profile if shard == 0 else None)
                procs.append(proc)
                clients.append(address)
                worker_addresses.append(f"tcp://127.0.0.1:{worker_port}")
            if api:
                gateway, url = start_gateway(clients, out)
                procs.append(gateway)  # (last: its CPU is the last measured)
            run = asyncio.run(_drive(",".join(clients), worker_addresses, mode, workers, capacity,
                                     concurrency, requests, max_new_tokens, url, tuple(p.pid for p in procs),
                                     prompt_tokens))
            cpus = run["cpu_s"]
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
    before, after = run["before"]["counters"], run["after"]["counters"]
    rounds = after.get("rounds", 0) - before.get("rounds", 0)
    shard_rounds = ([a["rounds"] - b["rounds"] for a, b in zip(run["after"]["by_shard"], run["before"]["by_shard"])]
                    if shards > 1 else [rounds])
    per_shard = [cpu / max(n, 1) * 1e6 for cpu, n in zip(cpus[:shards], shard_rounds)]
    res = {"mode": mode, "shards": shards, "rounds": rounds, "wall_s": run["wall_s"],
           "round_rate": rounds / run["wall_s"], "tasks_per_s": run["tasks"] / run["wall_s"],
           "broker_cpu_s": sum(cpus[:shards]), "broker_cpu_us_per_round": sum(cpus[:shards]) / max(rounds, 1) * 1e6,
           "shard_rounds": shard_rounds, "shard_cpu_us_per_round": per_shard,
           "tokens_per_round": (tokens := after.get("tokens_out", 0) - before.get("tokens_out", 0)) / max(rounds, 1),
           # token ids the broker sent in tasks per round (each task: what its worker lacks), and the positions they covered
           "task_tokens_per_round": (after.get("task_tokens", 0) - before.get("task_tokens", 0)) / max(rounds, 1),
           "task_positions_per_round": (after.get("task_positions", 0) - before.get("task_positions", 0)) / max(rounds, 1)}
    if api:
        res["gateway_cpu_us_per_token"] = cpus[-1] / max(tokens, 1) * 1e6
    log(f"  {mode}, {shards} shard{'s' if shards > 1 else ''}: {rounds} request-rounds in {run['wall_s']:.1f} s "
        f"({res['round_rate']:.0f}/s, {res['tasks_per_s']:.0f} tasks/s), broker CPU "
        f"{res['broker_cpu_us_per_round']:.0f} us per request-round, {res['task_tokens_per_round']:.1f} token ids sent "
        f"in tasks a round (of {res['task_positions_per_round']:.0f} covered)"
        + (f" (per shard: {', '.join(f'{c:.0f}' for c in per_shard)})" if shards > 1 else "")
        + (f"; gateway CPU {res['gateway_cpu_us_per_token']:.0f} us per token" if api else ""))
    return res


def profile_table(path: Path, top: int = 25) -> str:
    """The broker's hottest functions by their own time, from a cProfile stats file."""
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(str(path), stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
