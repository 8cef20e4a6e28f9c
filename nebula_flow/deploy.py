"""Start a broker and its workers as child processes, wait until ready, stop them cleanly.

Used by ``nebula-flow serve`` / ``run`` / ``bench`` and by the integration tests, so all of
them start deployments the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import Any

from nebula_flow import io_threads, wake_latency
from nebula_flow.client import Client, NebulaError
from nebula_flow.config import ConfigError, DeployConfig, PoolConfig
from nebula_flow.cores import make_lease_file, usable_cores
from nebula_flow.listen import listening_socket
from nebula_flow.log_relay import ACTIVITY_MARKER, LogRelay
from nebula_flow.options import BrokerOptions, WorkerOptions, write_options
from nebula_flow.process import PARENT_ENV, RESTARTS_ENV
from nebula_flow.security import ensure_key
from nebula_flow.shards import fewest_workers
from nebula_flow.spawn import Child, fork_worker
from nebula_flow.supervisor import ChildRecord, describe_exit, judge

# glibc's default allocator returns and re-faults large buffers on every forward pass; these
# settings keep them mapped (measured up to ~4x faster forwards on CPU).
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184",
                 "MALLOC_TOP_PAD_": "1073741824"}
STOP_POLL_S = 0.1  # while stopping, how often the wait for a child checks whether to kill at once
STOP_AFTER_DRAIN_S = 10.0  # stopping: what the workers get to leave after the brokers' drain time


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, avoid: AbstractSet[int] = frozenset()) -> list[int]:
    """``count`` distinct loopback ports free now, none of them in ``avoid``. Every pick stays bound
    until all are made: a port one pick has closed may be the next pick's (two broker shards once
    got the same port, and the second's answer came from the first)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)  # (one in ``avoid`` stays bound too, so it is not picked again)
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def http_answers(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until the HTTP gateway at ``url`` (run by ``proc``) answers ``/health``: False if it
    exits first or ``timeout_s`` passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return True
        except urllib.error.HTTPError:  # (it answers: 503 while no worker can serve yet is the deployment's state)
            return True
        except OSError:
            time.sleep(0.05)
    return False


def default_threads(role: str, plan: list[tuple[str, Any]], cores: int | None = None) -> int:
    """Torch threads for a worker of ``role`` in ``plan`` when its pool sets none: the workers that
    run the target (target, colocated) share the cores; a draft worker gets its share of all
    workers. Measured on a 2-core CPU (docs/benchmarks.md): pooled 1+1 with the target on both
    cores and the draft on one beat one core each, single stream and at 16 concurrent requests;
    both on two cores collapsed (the idle one's spinning OpenMP threads take the core the other
    needs the moment it starts), and a passive OpenMP wait was slower still."""
    cores = cores or usable_cores()
    sharing = sum(1 for r, _ in plan if r != "draft") if role != "draft" else len(plan)
    return max(1, cores // max(1, sharing))


def place_devices(plan: list[tuple[str, PoolConfig]], gpus: int | None = None) -> list[str]:
    """Each worker's device, in plan order. A pool's ``devices`` list places its workers in order
    (a list shorter than the workers repeats: sharing a GPU is configured, never implied); a pool
    on plain "cuda" gets one visible GPU per worker, the next ones not listed anywhere, and more
    such workers than GPUs is a ``ConfigError`` (a second model on a full device fails or crawls).
    ``gpus``: how many are visible (default: torch's count)."""
    seen: dict[int, int] = {}  # id(pool) -> its workers placed so far
    out = []
    if any(pool.device == "cuda" and not pool.devices for _, pool in plan):
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count()
        listed = {int(d.split(":")[1]) for _, pool in plan for d in pool.devices or ()}
        free = [f"cuda:{i}" for i in range(gpus) if i not in listed]
        wanting = sum(pool.device == "cuda" and not pool.devices for _, pool in plan)
        if wanting > len(free):
            raise ConfigError(f"{wanting} workers want a GPU of their own (device = \"cuda\") and {len(free)} are free "
                              f"of the {gpus} visible: list `devices` in the pools to share one")
    for _, pool in plan:
        j = seen.get(id(pool), 0)
        seen[id(pool)] = j + 1
        if pool.devices:
            out.append(pool.devices[j % len(pool.devices)])
        elif pool.device == "cuda":
            out.append(free.pop(0))
        else:
            out.append(pool.device)
    return out


def broker_name(shard: int, shards: int) -> str:
    """The broker's log and process name: "broker", or "broker-<shard>" when the requests are sharded."""
    return "broker" if shards == 1 else f"broker-{shard}"


def is_broker(name: str) -> bool:
    return name == "broker" or name.startswith("broker-")


def worker_name(role: str, index: int) -> str:
    """Worker ``index`` of a plan: its log, its options file and, with keys, its keypair."""
    return f"{role}-{index}"


class DeploymentError(RuntimeError):
    """A child process failed to start or died; the message carries its log tail."""


class Deployment:
    """One broker plus the workers ``cfg.worker_plan()`` asks for."""

    def __init__(self, cfg: DeployConfig, log_dir: str | Path | None = None,
                 worker_changes: dict[str, Any] | None = None) -> None:
        """``worker_changes``: ``WorkerOptions`` fields every worker runs with (e.g. ``kv_overlap``)."""
        cfg.validate()
        self.cfg = cfg
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="nebula-flow-logs-"))
        try:
            if self.log_dir.exists() and not self.log_dir.is_dir():
                raise NotADirectoryError(20, "it is a file, not a folder")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.log_dir, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable by this user")
        except OSError as exc:  # (said before any process starts, not as a traceback)
            raise DeploymentError(f"cannot keep the logs in {self.log_dir}: {exc.strerror}") from None
        self.procs: list[tuple[str, Child]] = []
        self.commands: dict[str, tuple[list[str], int]] = {}  # each child's arguments and threads
        self.records: dict[str, ChildRecord] = {}  # each child's restarts
        self.relays: dict[str, LogRelay] = {}  # the brokers' activity lines, as relayed (``relay_activity``)
        self.due: dict[str, float] = {}  # dead children waiting out their backoff: when to start them
        self.worker_changes = worker_changes or {}
        self.child_env: dict[str, dict[str, str]] = {}  # a child's own environment (the gateway's API key)
        self.http_url: str | None = None
        self.wake_fd: int | None = None  # the CPU wake-up latency request held while this runs (wake_latency)
        b = cfg.broker
        self.auto_ports = b.client_port == 0 or b.worker_port == 0
        b.model = b.model or cfg.target.model
        b.model_name = b.model_name or cfg.target.name or b.model
        picks = iter(free_ports(2 * b.shards) if self.auto_ports else [])  # (all shards' at once: distinct)
        self.shards = [self._shard_options(i, picks) for i in range(b.shards)]  # (one, unless [broker] shards > 1)
        b.client_port, b.worker_port = self.shards[0].client_port, self.shards[0].worker_port

    @property
    def drain_s(self) -> float:
        """How long the brokers give requests in flight to finish once told to stop (their ``drain_s``)."""
        return max(shard.drain_s for shard in self.shards)

    def _shard_options(self, shard: int, picks: Iterator[int]) -> BrokerOptions:
        """Shard ``shard``'s broker: the config's ports plus 2 per shard (free ones, from ``picks``,
        where the config asks for any), its own metrics port and policy log beside the first's."""
        b = self.cfg.broker
        step = 2 * shard
        metrics = b.metrics_port + shard if b.metrics_port else b.metrics_port
        log = f"{b.policy_log}.{shard}" if b.policy_log and b.shards > 1 else b.policy_log
        return replace(b, shard=shard, client_port=b.client_port + step if b.client_port else next(picks),
                       worker_port=b.worker_port + step if b.worker_port else next(picks),
                       metrics_port=metrics, policy_log=log)

    @property
    def address(self) -> str:
        """Where clients connect: the broker's address, or every shard's separated by commas."""
        return ",".join(opts.client_address for opts in self.shards)

    def _spawn(self, name: str, args: list[str], threads: int = 1, restarts: int = 0) -> Child:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), **ALLOCATOR_ENV,
                   **{PARENT_ENV: str(os.getpid()),  # children exit if we die without stopping them
                      RESTARTS_ENV: str(restarts)})
        if self.cfg.broker.keys:  # every party of the deployment authenticates with CURVE
            env["NEBULA_FLOW_KEYS"] = str(self.cfg.broker.keys)
        if self.cfg.zmq_io_cpu is not None:  # (brokers and workers put their ZeroMQ I/O thread there)
            env[io_threads.ENV] = str(self.cfg.zmq_io_cpu)
        env.update(self.child_env.get(name, {}))
        path = self.log_dir / f"{name}.log"
        if not restarts:  # (a restart keeps the death's log)
            path.write_bytes(b"")
        with open(path, "ab") as log:  # (appended to, as a forked worker's: cutting it, logrotate's copytruncate, is safe)
            if restarts:
                log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} restart {restarts} ---\n".encode())
                log.flush()
            # a worker forked from the zygote (seconds of imports saved, see spawn.py), or a fresh process
            proc: Child | None = fork_worker(args, env, path) if args[0] == "worker" else None
            if proc is None:
                proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", *args], stdout=log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.commands[name] = (args, threads)
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        return proc

    def start(self, timeout_s: float = 600.0) -> str:
        """Start the brokers and the workers together (a worker re-sends its REGISTER until a broker
        answers, and its imports take seconds the broker's start would otherwise add), then wait
        for every broker to answer and every worker to register."""
        plan = self.cfg.worker_plan()
        if self.cfg.cpu_wake_latency_us is not None and self.wake_fd is None:
            self.wake_fd = wake_latency.hold(self.cfg.cpu_wake_latency_us)
        if self.cfg.broker.keys:  # one key per worker, made on its first start (revocable alone)
            for i, (role, _) in enumerate(plan):
                ensure_key(Path(self.cfg.broker.keys), "worker", worker_name(role, i))
        try:
            devices = place_devices(plan)  # (before anything starts: a GPU short is a config error)
        except ConfigError as exc:
            raise DeploymentError(str(exc)) from None
        for shard in range(len(self.shards)):
            self._spawn_broker(shard)
        self.relays = {name: LogRelay(self.log_dir / f"{name}.log", ACTIVITY_MARKER) for name, _ in self.procs
                       if is_broker(name)}
        self._start_workers(plan, devices)
        moved = [self._await_broker(shard, timeout_s) for shard in range(len(self.shards))]  # (every shard awaited)
        if any(moved):
            # a broker moved to new ports: the workers started with the old ones start again
            names = {worker_name(role, i) for i, (role, _) in enumerate(plan)}
            for proc in [p for n, p in self.procs if n in names]:
                proc.kill()
                proc.wait()
            self._start_workers(plan, devices)
        self.wait_ready(len(plan), timeout_s)
        return self.address

    def _start_workers(self, plan: list[tuple[str, PoolConfig]], devices: list[str]) -> None:
        # with lend_cores, CPU workers without a configured thread count share the host's cores through a lease
        lease = self.log_dir / "cores"
        leased = [self.cfg.lend_cores and pool.threads is None and devices[i] == "cpu" for i, (_, pool) in enumerate(plan)]
        if any(leased):
            make_lease_file(lease, len(plan))
        for i, (role, pool) in enumerate(plan):
            name = worker_name(role, i)
            opts = self.worker_options(role, pool, devices[i], name, pool.threads or default_threads(role, plan))
            if leased[i]:
                opts = replace(opts, core_lease=str(lease), core_slot=i)
            self._spawn(name, ["worker", "--options", str(write_options(opts, self.log_dir / f"{name}.json"))],
                        opts.threads)

    def worker_options(self, role: str, pool: PoolConfig, device: str, name: str, threads: int) -> WorkerOptions:
        """What a worker of the plan runs with (written beside its log); ``device``: ``place_devices``'."""
        colocated = role in ("colocated", "any")  # (both models)
        return replace(WorkerOptions(
            role=role, broker=",".join(o.worker_address for o in self.shards), model=str(pool.model), name=name,
            capacity=pool.max_batch, threads=threads, device=device, dtype=pool.dtype,
            batch_invariant=pool.batch_invariant, cuda_graphs=pool.cuda_graphs, max_kv_gb=pool.max_kv_gb,
            kv_pool_gb=pool.kv_pool_gb, prefix_cache=pool.prefix_cache,
            kv_transport=self.cfg.kv_transport, profile=pool.profile,
            draft_model=str(self.cfg.draft.model) if colocated else None,
            draft_profile=self.cfg.draft.profile if colocated else None,
            draft_capacity=self.cfg.draft.max_batch if role == "any" else None,
            drafter=pool.drafter if role == "draft" else None), **self.worker_changes)

    def _spawn_broker(self, shard: int) -> Child:
        opts, name = self.shards[shard], broker_name(shard, len(self.shards))
        return self._spawn(name, ["broker", "--options", str(write_options(opts, self.log_dir / f"{name}.json"))])

    def _await_broker(self, shard: int, timeout_s: float, attempts: int = 5) -> bool:
        """Wait until broker ``shard`` (spawned) answers; True when it had to move to new ports. A
        port picked free by ``free_port`` can be taken by another process before the broker binds
        it: then pick new ones and start it again."""
        moved = False
        name = broker_name(shard, len(self.shards))
        for attempt in range(attempts):
            opts, proc = self.shards[shard], dict(self.procs)[name]
            deadline = time.monotonic() + timeout_s
            with Client(opts.client_address, timeout_s=1.0, keys=self.cfg.broker.keys) as client:
                while proc.poll() is None and time.monotonic() < deadline:
                    try:
                        client.status()
                        return moved
                    except NebulaError:
                        time.sleep(0.1)
            if proc.poll() is None:
                raise DeploymentError(f"the broker did not answer within {timeout_s:.0f} s; logs in {self.log_dir}")
            tail = self.log_tail(name)
            if not (self.auto_ports and "Address already in use" in tail) or attempt == attempts - 1:
                raise DeploymentError(f"broker exited with code {proc.returncode}:\n{tail}")
            moved = True
            taken = {port for o in self.shards for port in (o.client_port, o.worker_port)}  # (the other shards')
            client_port, worker_port = free_ports(2, avoid=taken)
            self.shards[shard] = replace(opts, client_port=client_port, worker_port=worker_port)
            if shard == 0:
                self.cfg.broker.client_port, self.cfg.broker.worker_port = (self.shards[0].client_port,
                                                                            self.shards[0].worker_port)
            self._spawn_broker(shard)
        return moved

    def start_api(self, host: str, port: int, api_key: str | None = None, model_name: str | None = None,
                  timeout_s: float = 60.0, tool_parser: str | None = None, reasoning_parser: str | None = None,
                  allowed_origins: tuple[str, ...] = (), access_log: str = "errors") -> str:
        """Start the HTTP gateway (``nebula-flow api``) in front of the broker, supervised like the
        rest; returns its URL once ``/health`` answers."""
        port = port or free_port()
        try:  # (a port that is taken is said plainly, and never mistaken for this gateway once another answers on it)
            listening_socket(host, port).close()
        except OSError as exc:
            raise DeploymentError(str(exc)) from None
        name = model_name or self.cfg.broker.model_name or "default"
        if api_key:
            self.child_env["api"] = {"NEBULA_FLOW_API_KEY": api_key}
        proc = self._spawn("api", ["api", "--broker", self.address, "--http-host", host, "--port", str(port),
                                   "--drain-s", str(self.drain_s + STOP_AFTER_DRAIN_S / 2),  # (the brokers' errors first)
                                   "--served-model-name", name, *(["--tool-call-parser", tool_parser] if tool_parser else []),
                                   *(["--reasoning-parser", reasoning_parser] if reasoning_parser else []),
                                   *(arg for origin in allowed_origins for arg in ("--allowed-origins", origin)),
                                   "--access-log", access_log])
        self.http_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        if http_answers(self.http_url, proc, timeout_s):
            return self.http_url
        raise DeploymentError(f"the HTTP API did not start:\n{self.log_tail('api')}")

    def wait_ready(self, n_workers: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with Client(self.address, timeout_s=2.0, keys=self.cfg.broker.keys) as client:
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    if fewest_workers(client.status()) >= n_workers:  # (with shards: at every shard)
                        return
                except NebulaError:
                    pass
                time.sleep(0.2)
        raise DeploymentError(f"workers not ready within {timeout_s:.0f} s; logs in {self.log_dir}")

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise DeploymentError(f"{name} exited with code {proc.returncode}:\n{self.log_tail(name)}")

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart children that died, after a backoff (the config's ``[supervise]``); give up on one that
        crash-loops or was refused for its configuration, while the rest keep serving. A restarted
        worker registers again and the broker re-queues the dead one's tasks; a restarted broker
        binds the same ports, its workers re-register and clients re-send their requests. Returns
        one line per event; raises ``DeploymentError`` when the broker is given up."""
        now = time.monotonic() if now is None else now
        events = []
        for name, proc in list(self.procs):
            record = self.records.setdefault(name, ChildRecord())
            if proc.poll() is None or record.given_up or name in self.due:
                continue
            verdict = judge(self.cfg.supervise, record, proc.returncode, now)
            what = f"{name} {describe_exit(proc.returncode)}"
            if proc.returncode >= 0 and (last := self.log_tail(name, 1)):  # (not a signal: its log says why)
                what += f" (its log ends: {last.strip()[:300]})"
            if verdict.delay_s is not None:
                self.due[name] = now + verdict.delay_s
                events.append(f"{what}; starting it again in {verdict.delay_s:.0f} s ({verdict.reason})")
                continue
            record.given_up = True
            tail = self.log_tail(name, 10)
            if is_broker(name):
                raise DeploymentError(f"{what}; giving up: {verdict.reason}; nothing serves without it. "
                                      f"Logs in {self.log_dir}:\n{tail}")
            events.append(f"{what}; giving up on it: {verdict.reason}. The rest keep serving. "
                          f"Its log: {self.log_dir / (name + '.log')}\n{tail}")
        for name, at in list(self.due.items()):
            if now >= at:
                del self.due[name]
                record = self.records[name]
                record.restarts.append(now)
                args, threads = self.commands[name]
                proc = self._spawn(name, args, threads, restarts=len(record.restarts))
                events.append(f"{name} started again (pid {proc.pid}, restart {len(record.restarts)})")
        return events

    def watch(self, stop: threading.Event, log: Callable[[str], None], every_s: float = 0.2) -> None:
        """``supervise`` until ``stop`` is set, logging each event with its time (what ``serve``
        runs), and each activity line its brokers log (``broker/activity.py``); a broker given up
        raises ``DeploymentError``."""
        while not stop.wait(every_s):
            for event in self.supervise():
                log(f"{time.strftime('%H:%M:%S')} {event}")
            self.relay_activity(log)

    def relay_activity(self, log: Callable[[str], None]) -> None:
        """Log the activity lines the brokers wrote since the last call (the first: since they started)."""
        for name, relay in self.relays.items():
            for line in relay.lines():
                log(f"{time.strftime('%H:%M:%S')} {name}: {line}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        for n, proc in self.procs:
            if n == name:
                proc.send_signal(sig)

    def stop(self, timeout_s: float | None = None, now: threading.Event | None = None,
             log: Callable[[str], None] | None = None) -> None:
        """Stop so that in-flight requests finish: the HTTP gateway and the brokers first (they refuse
        new requests and wait, up to the brokers' ``drain_s``, for those in flight, which the workers
        go on computing), then the workers. SIGKILL whatever still runs after ``timeout_s`` (default:
        the drain time and 10 s more), once ``now`` is set (``serve``: Ctrl-C again), or on a
        ``KeyboardInterrupt`` while waiting. No child outlives it (each runs in a session of its
        own, so a Ctrl-C never reaches them). ``log``: where the brokers' activity lines go
        meanwhile (``serve``: how the drain goes)."""
        if timeout_s is None:
            timeout_s = self.drain_s + STOP_AFTER_DRAIN_S
        deadline = time.monotonic() + timeout_s
        fronts = [proc for name, proc in self.procs if is_broker(name) or name == "api"]
        try:
            for group in (fronts, [proc for _, proc in self.procs if proc not in fronts]):
                for proc in group:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                for proc in group:
                    while proc.poll() is None and time.monotonic() < deadline and not (now is not None and now.is_set()):
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(STOP_POLL_S)
                        if log is not None:
                            self.relay_activity(log)
                if log is not None:  # (what they wrote last, as they stopped)
                    self.relay_activity(log)
        finally:  # (a KeyboardInterrupt too: SIGKILL, then it goes on up)
            for _, proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
            for _, proc in self.procs:
                proc.wait()
            if self.wake_fd is not None:
                os.close(self.wake_fd)
                self.wake_fd = None

    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
