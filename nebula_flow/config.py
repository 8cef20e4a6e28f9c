"""Deployment configuration: a TOML file naming the mode, the broker settings and both pools.

    mode = "pooled"              # pooled | paired | colocated | autoregressive | elastic
    [policy]                     # the scheduling policy's knobs (nebula_flow/policy.py)
    k = 4
    adaptive_k = true
    [broker]                     # any other BrokerOptions field: ports, proposal_top_k, limits, ...
    client_port = 5555
    shards = 1                   # brokers, each owning a slice of the requests (nebula_flow/shards.py);
                                 # shard i binds client_port + 2i and worker_port + 2i
    [draft]
    model = "cache:tiny-pair/draft"
    workers = 1
    max_batch = 16
    [target]
    model = "cache:tiny-pair/target"
    workers = 1
    max_batch = 8
    [[drafters]]                 # pooled mode: more draft pools (other drafters), as many as wanted;
                                 # the other modes (the baselines) run [draft] alone
    model = "ngram"              # each round is routed to the drafter that pays best for its request
    workers = 1                  # (nebula_flow/routing.py). ngram: prompt lookup, no model.

Model paths: ``cache:NAME`` lives in the nebula-flow cache folder ($NEBULA_FLOW_CACHE, default
~/.cache/nebula-flow); a relative path is relative to the repository holding ``configs/``
(the config file's parent folder's parent), an absolute path is used as is, and a hub id
(``Qwen/Qwen3-0.6B``) is found in the hub cache or downloaded when the deployment starts
(``nebula_flow/hub.py``). A pool's ``name`` is what clients call its model (default: ``model`` as
written): the HTTP API's ``/v1/models`` lists the target under it.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nebula_flow.options import BrokerOptions, check_device, check_kinds
from nebula_flow.params import did_you_mean
from nebula_flow.policy import PolicyConfig, PolicyError, knob_names
from nebula_flow.roles import MODES
from nebula_flow.supervisor import RestartPolicy


class ConfigError(ValueError):
    """A configuration file or option that cannot be used; the message says what to fix."""


def cache_dir() -> Path:
    return Path(os.environ.get("NEBULA_FLOW_CACHE", Path.home() / ".cache" / "nebula-flow"))


def resolve_model_path(spec: str, base: Path | None = None) -> str:
    """A config's model path: ``cache:NAME``, relative to ``base``, or as given."""
    if spec.startswith("cache:"):
        return str(cache_dir() / spec[len("cache:"):])
    p = Path(spec).expanduser()
    if not p.is_absolute() and base is not None and (base / p).exists():
        return str(base / p)
    return str(p)


def set_model(pool: PoolConfig, spec: str) -> None:
    """Give ``pool`` the model ``spec`` names on a command line (``--target``, ``--draft``): a path
    relative to the current folder, ``cache:NAME``, a hub id or ``ngram``; clients call it ``spec``."""
    from nebula_flow.lookup import is_ngram

    pool.name = spec
    pool.model = spec if is_ngram(spec) else resolve_model_path(spec, Path.cwd())


@dataclass
class PoolConfig:
    model: str | None = None
    workers: int = 1
    max_batch: int = 8
    threads: int | None = None  # default: a share of the cores (with lend_cores, plus idle workers': nebula_flow.cores)
    device: str = "cpu"  # cpu | cuda | cuda:N | emulated; "cuda": one device per worker (deploy.place_devices)
    devices: list[str] | None = None  # GPUs for this pool's workers in order (["cuda:0", "cuda:0"]: two on one)
    dtype: str | None = None  # float32 | bfloat16 | float16 | auto (models.loader.auto_dtype); None: fp32 on CPU, bf16 on CUDA
    batch_invariant: bool | None = None  # bit-equal logits however a token is batched; None: on for bf16/fp16 CPU
    cuda_graphs: bool = True  # CUDA: replay decode steps and verify blocks from graphs (false: eager, vLLM's enforce_eager)
    profile: str | None = None  # latency profile for device = "emulated"
    max_kv_gb: float = 4.0  # KV memory budget per worker model
    kv_pool_gb: float | None = None  # finished requests' shared KV files kept for reuse (None: max_kv_gb / 8)
    prefix_cache: bool = True  # a request starts from the longest prefix of its tokens another's KV holds (kv/store.py)
    drafter: str | None = None  # draft pools: the drafter name (routing.drafter_name: default from the model)
    elastic: bool = True  # elastic mode: false keeps this pool's workers to their own stage (e.g. small draft devices)
    name: str | None = None  # what clients call this model (the target's: /v1/models); default: ``model`` as written


@dataclass
class DeployConfig:
    mode: str = "pooled"
    broker: BrokerOptions = field(default_factory=BrokerOptions)  # its ``policy`` is the [policy] table
    draft: PoolConfig = field(default_factory=PoolConfig)
    target: PoolConfig = field(default_factory=PoolConfig)
    drafters: list[PoolConfig] = field(default_factory=list)  # more draft pools: several drafters (pooled mode only)
    kv_transport: str = "auto"  # auto | ucx | zmq | shm | shm+zmq | none (kv.transport.resolve_transport)
    supervise: RestartPolicy = field(default_factory=RestartPolicy)  # how `serve` restarts what dies
    # CPU workers without a configured `threads` borrow idle workers' cores (nebula_flow.cores): a single
    # stream ~1.2x faster on 2 cores, no measured cost under load (docs/benchmarks.md, 2026-12-03).
    lend_cores: bool = True
    # Ask the host to keep idle CPUs within this many microseconds of waking while the deployment
    # runs (Linux PM QoS, nebula_flow/wake_latency.py; None: the host's own idle policy).
    cpu_wake_latency_us: int | None = None
    # Run every broker's and worker's ZeroMQ I/O thread on this CPU (nebula_flow/io_threads.py;
    # None: where the kernel puts them).
    zmq_io_cpu: int | None = None
    source: str = "<defaults>"

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        self.broker.mode = self.mode
        if self.target.model is None:
            raise ConfigError(f"{self.source}: [target] model is required")
        if self.mode != "autoregressive" and self.draft.model is None:
            raise ConfigError(f"{self.source}: [draft] model is required in {self.mode} mode")
        from nebula_flow.models.loader import DTYPE_CHOICES

        self._check_drafters()
        for name, pool in (("draft", self.draft), ("target", self.target),
                           *((f"drafters {i + 1}", p) for i, p in enumerate(self.drafters))):
            if pool.workers < 0 or pool.max_batch < 1 or (pool.threads is not None and pool.threads < 1):
                raise ConfigError(f"[{name}] workers must be >= 0, max_batch >= 1 and threads >= 1")
            # Colocated and autoregressive run M + N workers: one pool may be empty there.
            if pool.workers == 0 and self.mode in ("pooled", "paired"):
                raise ConfigError(f"[{name}] workers must be >= 1 in {self.mode} mode")
            for flag in ("elastic", "prefix_cache"):
                if not isinstance(getattr(pool, flag), bool):
                    raise ConfigError(f"[{name}] {flag} must be true or false, got {getattr(pool, flag)!r}")
            if pool.max_kv_gb <= 0 or (pool.kv_pool_gb is not None and pool.kv_pool_gb < 0):
                raise ConfigError(f"[{name}] max_kv_gb must be > 0 and kv_pool_gb >= 0")
            if pool.dtype not in (None, *DTYPE_CHOICES):
                raise ConfigError(f"[{name}] dtype must be one of {', '.join(DTYPE_CHOICES)}, got {pool.dtype!r}")
            try:
                check_device(pool.device)
            except ValueError as exc:
                raise ConfigError(f"[{name}] {exc}") from None
            if pool.device == "emulated" and not pool.profile:
                raise ConfigError(f"[{name}] device = \"emulated\" needs a profile")
            if pool.devices is not None and (not pool.devices or pool.device not in ("cuda", "cpu") or not all(
                    isinstance(d, str) and re.fullmatch(r"cuda:\d+", d) for d in pool.devices)):
                raise ConfigError(f"[{name}] devices must be a list of \"cuda:N\" (with device = \"cuda\"), "
                                  f"got {pool.devices!r}")
        if self.draft.workers + self.target.workers < 1:
            raise ConfigError("no workers: give [draft] or [target] workers >= 1")
        try:
            self.broker.check()
        except ValueError as exc:
            raise ConfigError(f"[broker] {exc}") from None
        from nebula_flow.kv.transport import TRANSPORTS

        if not isinstance(self.lend_cores, bool):
            raise ConfigError(f"lend_cores must be true or false, got {self.lend_cores!r}")
        from nebula_flow import io_threads, wake_latency

        try:
            wake_latency.check(self.cpu_wake_latency_us)
            io_threads.check(self.zmq_io_cpu)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.kv_transport not in TRANSPORTS:
            raise ConfigError(f"kv_transport must be one of {', '.join(TRANSPORTS)}, got {self.kv_transport!r}")
        try:
            self.supervise.check()
        except ValueError as exc:
            raise ConfigError(f"[supervise] {exc}") from None

    def _check_drafters(self) -> None:
        """Every draft pool has a model and a drafter name of its own (the workers of one drafter
        share KV: two models under one name would mix theirs)."""
        from nebula_flow.lookup import parse_ngram
        from nebula_flow.protocol import DRAFTER_NAME, DRAFTER_RULE
        from nebula_flow.routing import drafter_name

        seen: dict[str, str | None] = {}
        for i, pool in enumerate([self.draft, *self.drafters]):
            where = "[draft]" if i == 0 else f"[[drafters]] {i}"
            if i > 0 and pool.model is None:
                raise ConfigError(f"{self.source}: {where} needs a model (a checkpoint, or ngram)")
            if pool.drafter is not None and not DRAFTER_NAME.fullmatch(pool.drafter):
                raise ConfigError(f"{where} drafter must be {DRAFTER_RULE}, got {pool.drafter!r}")
            try:
                parse_ngram(pool.model or "")
            except ValueError as exc:
                raise ConfigError(f"{where} {exc}") from None
            name = drafter_name(pool.drafter, pool.model)
            if name in seen and seen[name] != pool.model:
                raise ConfigError(f"{where}: drafter {name!r} is already another pool's; give it its own drafter = \"...\"")
            seen[name] = pool.model

    def worker_plan(self) -> list[tuple[str, PoolConfig]]:
        """(role, pool) per worker process. Colocated and autoregressive use M+N workers, so
        every mode runs on the same devices. ``drafters`` pools run in pooled mode only (routing is
        pooled mode's); the baselines use the [draft] pool alone."""
        total = self.draft.workers + self.target.workers
        if self.mode == "elastic":  # workers holding both models run on the [target] pool's settings, as colocated
            fixed = [("draft", self.draft)] * self.draft.workers if not self.draft.elastic else []
            fixed += [("target", self.target)] * self.target.workers if not self.target.elastic else []
            return fixed + [("any", self.target)] * (total - len(fixed))
        if self.mode == "colocated":
            return [("colocated", self.target)] * total
        if self.mode == "autoregressive":
            return [("target", self.target)] * total
        plan = [("draft", self.draft)] * self.draft.workers
        for pool in self.drafters if self.mode == "pooled" else ():
            plan += [("draft", pool)] * pool.workers
        return plan + [("target", self.target)] * self.target.workers


def build_table(cls: type, raw: dict[str, Any], where: str) -> Any:
    """``cls`` from a TOML table: every key one of its fields, of the kind the field's annotation says."""
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}{did_you_mean(sorted(unknown), known, 0.75)} "
                          f"(known: {sorted(known)})")
    try:
        check_kinds(cls, raw)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return cls(**raw)


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file's contents, or a ``ConfigError`` that names the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None


DEPLOY_SECTIONS = frozenset({"mode", "kv_transport", "lend_cores", "cpu_wake_latency_us", "zmq_io_cpu", "policy",
                             "broker", "draft", "target", "drafters", "supervise"})  # (a deployment TOML's top level)


def load_config(path: str | Path | None) -> DeployConfig:
    if path is None:
        return DeployConfig()
    path = Path(path)
    raw = read_toml(path)
    base = path.resolve().parent.parent
    unknown = set(raw) - DEPLOY_SECTIONS
    if unknown:
        raise ConfigError(f"{path}: unknown sections {sorted(unknown)}")
    broker = dict(raw.get("broker", {}))
    if moved := sorted(set(broker) & set(knob_names())):
        raise ConfigError(f"{path} [broker]: {', '.join(moved)} are policy knobs: put them under [policy]")
    if "shard" in broker:
        raise ConfigError(f"{path} [broker]: a deployment numbers its shards itself; set shards = N (brokers)")
    try:
        broker["policy"] = PolicyConfig.from_table(raw.get("policy", {}), f"{path} [policy]")
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    cfg = DeployConfig(
        mode=raw.get("mode", "pooled"),
        kv_transport=raw.get("kv_transport", "auto"), lend_cores=raw.get("lend_cores", True),
        cpu_wake_latency_us=raw.get("cpu_wake_latency_us"), zmq_io_cpu=raw.get("zmq_io_cpu"),
        broker=build_table(BrokerOptions, broker, f"{path} [broker]"),
        draft=build_table(PoolConfig, raw.get("draft", {}), f"{path} [draft]"),
        target=build_table(PoolConfig, raw.get("target", {}), f"{path} [target]"),
        supervise=build_table(RestartPolicy, raw.get("supervise", {}), f"{path} [supervise]"),
        source=str(path),
    )
    extra = raw.get("drafters", [])
    if not isinstance(extra, list) or not all(isinstance(t, dict) for t in extra):
        raise ConfigError(f"{path}: drafters must be an array of tables ([[drafters]])")
    cfg.drafters = [build_table(PoolConfig, t, f"{path} [[drafters]] {i + 1}") for i, t in enumerate(extra)]
    from nebula_flow.lookup import is_ngram

    for pool in (cfg.draft, cfg.target, *cfg.drafters):
        pool.name = pool.name or pool.model
        if pool.model and not is_ngram(pool.model):
            pool.model = resolve_model_path(pool.model, base)
        if pool.profile:
            pool.profile = resolve_model_path(pool.profile, base)
    return cfg
