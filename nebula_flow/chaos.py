"""Fault drills: a supervised deployment under load, its processes killed (SIGKILL) on a
schedule; what completed, how soon each killed process was serving again, and whether the output
changed (``nebula-flow chaos``)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nebula_flow.client import AsyncClient, Client, Completion, NebulaError
from nebula_flow.deploy import Deployment


@dataclass
class Kill:
    """SIGKILL one process of the deployment (``broker``, ``draft-0``, ...) ``at_s`` seconds
    after the first streamed token."""

    name: str
    at_s: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Kill:
        name, _, at = spec.partition("@")
        try:
            at_s = float(at) if at else 0.0
        except ValueError:
            raise ValueError(f"--kill {spec!r}: NAME or NAME@SECONDS") from None
        if at_s < 0:
            raise ValueError(f"--kill {spec!r}: seconds must be >= 0")
        return cls(name, at_s)


def default_kills(names: list[str]) -> list[Kill]:
    """The operations issue's drill on ``names`` (the deployment's processes, in plan order): the
    last draft worker at the first token, the last verifying worker (target, colocated or elastic)
    3 s later; with no draft-only worker, the one before it first."""
    drafters = [n for n in names if n.startswith("draft-")]
    verifiers = [n for n in names if n.startswith(("target-", "colocated-", "any-"))]
    return [Kill(n, 0.0) for n in drafters[-1:] or verifiers[-2:-1]] + [Kill(n, 3.0) for n in verifiers[-1:]]


def _back(state: dict[str, Any], name: str, killed_pid: int, workers: int) -> bool:
    """Whether a killed process serves again: a worker registered again from a new process; a new
    broker with every worker registered to it."""
    if name == "broker":
        return state["pid"] != killed_pid and len(state["workers"]) >= workers
    return any(w["name"] == name and w["pid"] != killed_pid for w in state["workers"])


async def _watch_back(client: AsyncClient, kill: dict[str, Any], workers: int, timeout_s: float) -> None:
    """Poll from the kill on, beside the load, until the killed process serves again: seconds from
    ``kill`` to then in its ``recovered_s`` (None: not within ``timeout_s``). (Polled only once the
    load had ended, a worker back in 2 s was said to be back when the load ended, 13 s later.)"""
    kill["recovered_s"] = None
    while time.monotonic() < kill["t"] + timeout_s:
        try:
            if _back(await client.status(), kill["name"], kill["pid"], workers):
                kill["recovered_s"] = round(time.monotonic() - kill["t"], 2)
                return
        except NebulaError:  # (the broker is starting again)
            pass
        await asyncio.sleep(0.1)


def _tasks_since(state: dict[str, Any], kill: dict[str, Any]) -> int | None:
    """The tasks a killed worker's new process ran (all of them after its restart: the drill's load
    included, which shows whether the requests in flight came back to it); None where it is not back."""
    return next((w["tasks"] for w in state["workers"] if w["name"] == kill["name"] and w["pid"] != kill["pid"]), None)


async def _load(address: str, prompts: list[str], max_new_tokens: int, chat: bool,
                first_token: asyncio.Event) -> list[Completion | str]:
    async with AsyncClient(address, timeout_s=300) as client:
        async def one(prompt: str) -> Completion | str:
            try:
                async for item in client.stream(prompt, chat=chat, max_new_tokens=max_new_tokens):
                    if isinstance(item, Completion):
                        return item
                    first_token.set()
            except NebulaError as exc:
                return f"{type(exc).__name__}: {exc}"
            return "the stream ended without a result"

        return await asyncio.gather(*(one(p) for p in prompts))


def drill(dep: Deployment, prompts: list[str], max_new_tokens: int, kills: list[Kill], chat: bool = False,
          log: Callable[[str], None] = print, recover_timeout_s: float = 120.0) -> dict[str, Any]:
    """Send ``prompts`` at once (greedy), kill on schedule while they run, wait until every
    killed process serves again. Returns outcomes, the kills with their recovery times, and the
    broker's restarts and worker counters."""
    workers = len(dep.cfg.worker_plan())
    stop = threading.Event()
    supervisor = threading.Thread(target=dep.watch, args=(stop, log), daemon=True)  # (as serve does)
    supervisor.start()
    done: list[dict[str, Any]] = []  # the kills made: name, seconds after the first token, pid, when
    try:
        async def run() -> tuple[list[Completion | str], float]:
            first_token = asyncio.Event()
            watch = AsyncClient(dep.address, timeout_s=5)
            watches = []

            async def killer(load: asyncio.Task) -> None:
                await asyncio.wait([asyncio.ensure_future(first_token.wait()), load],
                                   return_when=asyncio.FIRST_COMPLETED)
                t0 = time.monotonic()  # (a load that failed before its first token: kill now)
                for kill in sorted(kills, key=lambda k: k.at_s):
                    await asyncio.sleep(max(0.0, t0 + kill.at_s - time.monotonic()))
                    while (proc := dict(dep.procs)[kill.name]).poll() is not None:  # (killed before: the
                        await asyncio.sleep(0.05)  # one the supervisor starts next, never a stale pid)
                    pid = proc.pid
                    os.kill(pid, signal.SIGKILL)
                    done.append({"name": kill.name, "at_s": round(time.monotonic() - t0, 2), "pid": pid,
                                 "t": time.monotonic()})
                    log(f"{time.strftime('%H:%M:%S')} killed {kill.name} (pid {pid})")
                    watches.append(asyncio.ensure_future(_watch_back(watch, done[-1], workers, recover_timeout_s)))

            async def timed_load() -> tuple[list[Completion | str], float]:
                """The load and when it ended (read in it: a done-callback's turn may come after ``await``)."""
                outs = await _load(dep.address, prompts, max_new_tokens, chat, first_token)
                return outs, time.monotonic()

            t_start = time.monotonic()
            load = asyncio.ensure_future(timed_load())
            async with watch:
                await killer(load)  # (kills may go on after the load is done)
                outs, ended = await load
                await asyncio.gather(*watches)
            for k in done:  # (a kill after the last request ended tested a restart, not a recovery mid-request)
                k["during_load"] = k.pop("t") < ended
            return outs, ended - t_start

        outs, wall_s = asyncio.run(run())
        with Client(dep.address, timeout_s=5) as c:
            state = c.status()
        for k in done:
            if k["name"] != "broker":
                k["tasks_since"] = _tasks_since(state, k)
    finally:
        stop.set()
        supervisor.join()
    completions = [o for o in outs if isinstance(o, Completion)]
    return {"requests": len(prompts), "completed": len(completions), "wall_s": round(wall_s, 2),
            "failures": [o for o in outs if isinstance(o, str)],
            "token_ids": [o.token_ids if isinstance(o, Completion) else None for o in outs], "kills": done,
            "restarts": state["restarts"],
            "counters": {k: v for k, v in state["counters"].items() if k.startswith("workers_")
                         or k in ("tasks_requeued", "requests_reattached")}}
