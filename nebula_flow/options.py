"""The settings of each process: the broker's and a worker's, as plain, JSON-safe data.

A deployment (``nebula_flow.deploy``) writes each child's options to a JSON file in its log
folder and starts the child with ``--options FILE``, so what a process ran with is on disk
beside its log, and no setting is spelled twice as a command-line flag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nebula_flow.params import is_int
from nebula_flow.policy import PolicyConfig
from nebula_flow.roles import MODEL_ROLES


@dataclass
class BrokerOptions:
    mode: str = "pooled"
    host: str = "127.0.0.1"
    client_port: int = 5555
    worker_port: int = 5556
    model: str | None = None  # the target checkpoint: tokenizer, context length, EOS ids
    model_name: str | None = None  # what clients call the target (the config's model as written; /v1/models)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    proposal_top_k: int = 16  # entries of the draft distribution q sent with each sampled draft token
    max_pending: int = 1024  # admission limit; beyond it clients get BUSY (or, more urgent, displace one: displace.py)
    # a limit of each client's own (None: none; max_pending bounds them all. An HTTP gateway is
    # one client for all its callers, so a limit under max_pending refused HTTP load the pool had room for)
    max_inflight_per_client: int | None = None
    max_new_tokens_limit: int = 4096
    # the context served, prompt and output (vLLM's max_model_len): below the model's own to bound a
    # request's KV (a 128k-token Llama prompt would not fit a worker's max_kv_gb); None: the model's
    max_model_len: int | None = None
    heartbeat_s: float = 1.0
    liveness_s: float = 10.0  # silence after which a worker is declared dead
    drain_s: float = 30.0  # on SIGTERM: how long in-flight requests may finish
    stats_log_s: float = 10.0  # a log line of what the last interval did, this often while serving (0: none)
    client_gone_s: float = 10.0  # a client a send failed to: how long its requests wait for it (intake.reap_clients)
    metrics_port: int | None = None  # HTTP port for Prometheus /metrics (None: off, 0: any free port)
    metrics_host: str = "127.0.0.1"  # off loopback only with metrics_token_file
    metrics_token_file: str | None = None  # a file holding the token scrapers send (Authorization: Bearer ...)
    keys: str | None = None  # CURVE key folder (see nebula_flow/security.py); required off loopback
    policy_log: str | None = None  # write every policy event and decision here (JSONL) at exit; see policy_log.py
    shard: int = 0  # this broker's slice of the requests: request numbers shard+1, shard+1+shards, ... (see deploy)
    shards: int = 1  # brokers sharing the deployment's requests (each with its own ports; no coordination)
    # every task carries its request's whole tokens, not only those its worker lacks (``broker/known.py``):
    # what the broker did before protocol version 6, kept to measure what the deltas save
    full_tokens: bool = False

    def check(self) -> None:
        """Refuse settings out of range, and timing that declares healthy workers dead: a worker beats
        once per heartbeat_s, so a liveness under two beats drops any worker whose beat is a little late."""
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard must be 0..{self.shards - 1} (of shards={self.shards}), got {self.shard}")
        for name in ("client_port", "worker_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be a port from 0 to 65535 (0: any free one), got {port}")
        for name in ("proposal_top_k", "max_pending", "max_inflight_per_client", "max_new_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:  # (a prompt token and an output token)
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        for name in ("drain_s", "client_gone_s", "stats_log_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.liveness_s < 2 * self.heartbeat_s:
            raise ValueError(f"liveness_s ({self.liveness_s}) must be at least twice heartbeat_s "
                             f"({self.heartbeat_s})")

    @property
    def client_address(self) -> str:
        return f"tcp://{self.host}:{self.client_port}"

    @property
    def worker_address(self) -> str:
        return f"tcp://{self.host}:{self.worker_port}"

    def to_json(self) -> dict[str, Any]:
        return dict(asdict(self), policy=self.policy.to_table())

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BrokerOptions:
        return cls(**dict(_known(cls, raw), policy=PolicyConfig.from_table(raw.get("policy", {}))))


@dataclass
class WorkerOptions:
    role: str
    broker: str
    model: str | None = None  # draft model for role draft, target model otherwise
    draft_model: str | None = None  # colocated and any (elastic) only
    name: str = ""
    capacity: int = 8
    threads: int = 1  # its share of the cores (with core_lease: more while other workers idle)
    device: str = "cpu"
    dtype: str | None = None
    batch_invariant: bool | None = None  # see models.invariant; None: on for bf16/fp16 on CPU
    cuda_graphs: bool = True  # CUDA: steps replayed from graphs (models/graphs.py); False: every forward eager
    heartbeat_s: float = 1.0
    liveness_s: float = 10.0  # broker silence after which the worker reconnects (with backoff)
    max_kv_gb: float = 4.0  # KV memory budget per model; least recently used requests are evicted
    kv_pool_gb: float | None = None  # finished requests' shared KV files kept for reuse (None: max_kv_gb / 8)
    kv_transport: str = "auto"  # see kv.transport.resolve_transport
    kv_host: str | None = None  # interface the KV server binds and advertises (None: the one reaching the broker)
    kv_overlap: bool = True  # pull a batch's KV while the previous batch computes (off: pull at start)
    kv_skip_slow_pulls: bool = True  # recompute where a pull is measured slower (kv/link_fit.py; off: always pull)
    prefix_cache: bool = True  # copy the longest prefix another request's KV here holds (kv/store.py)
    keys: str | None = None  # CURVE key folder (or NEBULA_FLOW_KEYS): authenticate to the broker and peers
    profile: str | None = None  # latency profile when device == "emulated"
    draft_profile: str | None = None  # colocated + emulated: the draft's profile
    drafter: str | None = None  # draft workers: the drafter name routing knows them by (default: from the model)
    draft_capacity: int | None = None  # any (elastic): a draft batch's most tasks (default: capacity)
    core_lease: str | None = None  # the host's core lease file (nebula_flow.cores), written by the deployment
    core_slot: int = 0  # this worker's slot in it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def check(self) -> None:
        """Refuse, in words, settings a worker cannot run with, before it loads anything."""
        if self.role not in MODEL_ROLES:  # (any: both models; a draft or a verify batch at each pull, elastic)
            raise ValueError(f"role must be one of {', '.join(MODEL_ROLES)}")
        if self.draft_capacity is not None and not (self.role == "any" and self.draft_capacity >= 1):
            raise ValueError("--draft-max-batch is for role any, and must be >= 1")
        if self.max_kv_gb <= 0 or (self.kv_pool_gb is not None and self.kv_pool_gb < 0):
            raise ValueError("--max-kv-gb must be > 0 and --kv-pool-gb >= 0")
        if self.kv_host in ("0.0.0.0", "::", "*", ""):  # (bound, every interface; advertised, no address at all)
            raise ValueError(f"--kv-host {self.kv_host!r} is no address peers can reach: give this host's address on "
                             "the network its peers share (or leave it out: the interface that reaches the broker)")
        both = len(MODEL_ROLES[self.role]) == 2
        if self.device != "emulated" and (self.model is None or (both and self.draft_model is None)):
            raise ValueError("--model is required (and --draft-model for a colocated or elastic worker)")
        check_device(self.device, present=True)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> WorkerOptions:
        return cls(**_known(cls, raw))


DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?|emulated")


def check_device(device: object, *, present: bool = False) -> None:
    """Refuse a device name that is none of ours (torch would say "Expected one of cpu, cuda, ipu,
    ..." from deep in a model load); ``present``: also a CUDA device torch does not see here."""
    if not isinstance(device, str) or not DEVICE_NAME.fullmatch(device):
        raise ValueError(f"device must be cpu, cuda, cuda:N or emulated, got {device!r}")
    if present and device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(device.partition(":")[2] or 0) >= count:
            seen = f"{count} CUDA device(s), cuda:0..cuda:{count - 1}" if count else "no CUDA device"
            raise ValueError(f"device {device}: torch {torch.__version__} sees {seen} here")


# What a value of each annotated kind must be (from TOML or JSON), and how an error names it: a
# string where a number belongs reached a comparison as a TypeError; 1.5 workers' batches the broker.
KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("a whole number", is_int),
    "float": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "str": ("text", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "list[str]": ("a list of text", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}


def check_kinds(cls: type, raw: dict[str, Any]) -> None:
    """Each of ``raw``'s values of the kind its field of ``cls`` is annotated with, else ``ValueError``
    naming it (kinds not in ``KINDS``, e.g. ``policy``, are the caller's to check)."""
    known = {f.name: f for f in fields(cls)}
    for name, value in raw.items():
        parts = str(known[name].type).replace(" ", "").split("|")
        kinds = [KINDS[k] for k in parts if k in KINDS]
        if kinds and not any(fits(value) for _, fits in kinds) and not (value is None and "None" in parts):
            raise ValueError(f"{name} must be {' or '.join(said for said, _ in kinds)}, got {value!r}")


def _known(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw``'s fields of ``cls`` other than ``policy``; an unknown one, or one of the wrong kind, is
    refused by name."""
    if not isinstance(raw, dict):
        raise ValueError(f"{cls.__name__} options must be a JSON object")
    names = {f.name for f in fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    kept = {k: v for k, v in raw.items() if k != "policy"}
    check_kinds(cls, kept)
    return kept


def write_options(opts: BrokerOptions | WorkerOptions, path: Path) -> Path:
    path.write_text(json.dumps(opts.to_json(), indent=2))
    return path


def read_options(cls: type[BrokerOptions] | type[WorkerOptions], path: str | Path) -> BrokerOptions | WorkerOptions:
    try:
        return cls.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot read {cls.__name__} from {path}: {exc}") from None
