"""Simulation scenarios: a TOML file naming the pools, their cost models, the policy and the load.

    name = "paper-2d2t"
    modes = ["pooled", "paired", "colocated", "autoregressive"]   # measured in turn
    seed = 0
    # deploy = "../emulated-2d2t.toml"   # take mode knobs, pools and profiles from a deployment

    [policy]            # the live policy's knobs (nebula_flow/policy.py): k, locality, adaptive_k, ...
    k = 4

    [workload]
    requests = 512
    output_tokens = 128
    prompt_tokens = [96, 144]   # uniform in [lo, hi], or one number
    concurrency = 512           # closed loop: at most this many in flight (default: all at once)
    submit_gap_us = 0           # closed loop: the client sends its first requests this far apart
    # poisson_rate = 40.0       # open loop: Poisson arrivals (requests/s) instead
    # urgent_every = 4          # every 4th request urgent: priority -1 with [policy] priority_scheduling,
    #                           # its latency reported apart (urgent_latency_s beside other_latency_s)
    # trace = "../../traces/azure_code.csv"   # replay formats; time_scale, limit, max_prompt_tokens,
    #                                         # max_new_tokens shape it as in `nebula-flow replay`
    #                                         # (Mooncake's hash_ids: prompts that share their start)
    # shared_prefix = 2048      # each prompt starts with these many tokens of one of `documents`
    # documents = 4             #   (a system prompt, a document asked about): sim/prefix_cache.py

    [draft]             # one pool: workers, max_batch, a cost model [, elastic = false: in elastic mode,
                        # its workers keep to drafting (e.g. small devices); the rest hold both models]
    model = "qwen3-0.6b"        #   roofline: model (built-in name, checkpoint dir or config.json)
    hardware = "rtx4090"        #   + hardware (built-in) [+ hardware_overrides = {mbu = 0.7}]
    # profile = "configs/profiles/qwen3-0.6b-rtx4090.json"   # or a measured/emulated profile
    workers = 2
    max_batch = 64

    [target]
    ...

    [[drafters]]        # pooled mode: more draft pools, routed among per request (routing.py)
    name = "ngram"              #   its drafter name (not "draft": that is [draft]'s)
    profile = "..."             #   a cost model, workers and max_batch, as any pool
    workers = 1
    acceptance = { rate = 0.3 } #   its own acceptance model (default: [acceptance]'s)

    [acceptance]        # rate = 0.75 | per_position = [..] | histogram = {"1" = .., "2" = ..}
    rate = 0.75         # | status = "status.json" (a live broker's `nebula-flow status --json`)
    # concentration = 4 # requests differ: each one's rate from a Beta around the mean (0: alike)
    # token trees (policy first_alternatives, fuse_ngram; see sim/acceptance.py), from status too:
    # alternative_rate = 0.3, fused_match = 0.2, fused_win = 0.5, fused_gain = 4.0

    [kv]                # movement = "link" (the target hardware's interconnect) | "free"
    movement = "link"   # bandwidth_gbps / latency_us override the hardware's link
    prefix_cache = true # the workers' prefix cache, where prompts share their start (as a worker's option)

    [host]              # costs outside the devices (defaults: 50 us messages, nothing else)
    message_latency_us = 50     # one way, broker <-> worker and broker <-> client
    broker_service_us = 0       # broker time per message (one thread: messages queue)
    broker_task_us = 0          # broker time per task result taken or task sent
    broker_shards = 1           # brokers sharing the requests (nebula_flow/shards.py): each takes 1/shards of the work
    batch_overhead_us = 0       # worker time per batch outside the forward passes
    task_overhead_us = 0        # worker time per task outside the forward passes
    forward_overhead_us = 0     # added to every forward pass (e.g. an emulating host falling behind)

    [sweep]             # --sweep: pool sizes; the draft:target ratio of the pools above is kept
    draft_workers = [1, 2, 4, 8, 16, 32, 64]
    scale_workload = true       # requests and concurrency grow with the pools

Relative paths are relative to the scenario file's folder, then to the repository root.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from nebula_flow.config import DEPLOY_SECTIONS, ConfigError, build_table, load_config, read_toml
from nebula_flow.emulated import load_profile
from nebula_flow.params import is_int
from nebula_flow.policy import PolicyConfig, PolicyError
from nebula_flow.protocol import DRAFTER_NAME, DRAFTER_RULE
from nebula_flow.roles import DEFAULT_DRAFTER, MODES
from nebula_flow.sim.acceptance import AcceptanceModel
from nebula_flow.sim.costs import CostModel, Link, ProfileCost, RooflineCost
from nebula_flow.sim.hardware import GB, resolve_hardware, resolve_model
from nebula_flow.traces import HASH_BLOCK, Shaping, load_trace, shape


@dataclass
class Pool:
    workers: int
    max_batch: int
    cost: CostModel
    hardware: str | None = None  # the roofline hardware, for the default KV link
    elastic: bool = True  # elastic mode: false keeps this pool's workers to their own stage


def cost_on(model_pool: Pool, device_pool: Pool) -> CostModel:
    """``model_pool``'s model on ``device_pool``'s devices (a colocated or elastic worker, on a target
    device, runs the draft there too): both rooflines, the model's spec on the other hardware; else
    the model's own cost model (profiles are measured where they were measured)."""
    a, b = model_pool.cost, device_pool.cost
    if isinstance(a, RooflineCost) and isinstance(b, RooflineCost) and a.hw != b.hw:
        return RooflineCost(a.model, b.hw)
    return a


class Arrival(NamedTuple):
    """A simulated request as its workload sends it."""

    at: float | None  # arrival time (None: closed loop)
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()  # its prompt starts with these blocks' tokens (sim/prefix_cache.py) ...
    shared: int = 0  # ... this many of them (the rest its own)


@dataclass
class HostCosts:
    message_latency_us: float = 50.0
    broker_service_us: float = 0.0
    broker_task_us: float = 0.0
    broker_shards: int = 1
    batch_overhead_us: float = 0.0
    task_overhead_us: float = 0.0
    forward_overhead_us: float = 0.0  # added to every forward (an emulating host's late wake-ups)


@dataclass
class Workload:
    requests: int = 128
    output_tokens: int = 128
    prompt_tokens: tuple[int, int] = (128, 128)
    concurrency: int | None = None
    submit_gap_us: float = 0.0  # closed loop: time between the client's first submissions
    poisson_rate: float | None = None
    trace: str | None = None
    time_scale: float = 1.0
    limit: int | None = None
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    urgent_every: int = 0  # requests 0, N, 2N, ... are urgent (priority -1 where the policy schedules by priority)
    shared_prefix: int = 0  # each prompt starts with this many tokens of one of ``documents`` (sim/prefix_cache.py)
    documents: int = 1  # ... drawn uniformly per request, seeded

    def scaled(self, factor: float) -> Workload:
        """The same load for ``factor`` times the workers (closed loop or all-at-once only)."""
        w = Workload(**{f.name: getattr(self, f.name) for f in fields(self)})
        w.requests = max(1, round(self.requests * factor))
        if self.concurrency is not None:
            w.concurrency = max(1, round(self.concurrency * factor))
        if self.poisson_rate is not None:
            w.poisson_rate = self.poisson_rate * factor
        return w

    def arrivals(self, seed: int) -> list[Arrival]:
        """Each request's arrival, prompt and output tokens, and the start it shares with others."""
        rng = random.Random(seed)
        if self.trace:
            reqs, _ = shape(load_trace(self.trace), Shaping(self.time_scale, self.limit, max_prompt_tokens=self.max_prompt_tokens,
                                                            max_new_tokens=self.max_new_tokens, seed=seed), 1 << 30)
            return [Arrival(r.arrival_s, n := r.prompt_len or len(r.prompt_tokens or []) or max(1, len(r.prompt or "") // 4),
                            r.max_new_tokens, tuple(r.blocks or ()), n if r.blocks else 0) for r in reqs]
        lo, hi = self.prompt_tokens
        out, t = [], 0.0
        docs = random.Random(f"documents {seed}")  # (apart: the other draws stay what they were without)
        per_doc = -(-self.shared_prefix // HASH_BLOCK)
        for _ in range(self.requests):
            arrival = None
            if self.poisson_rate:
                t += rng.expovariate(self.poisson_rate)
                arrival = t
            blocks = ()
            if self.shared_prefix:
                first = docs.randrange(self.documents) * per_doc
                blocks = tuple(range(first, first + per_doc))
            out.append(Arrival(arrival, self.shared_prefix + rng.randint(lo, hi), self.output_tokens, blocks,
                               self.shared_prefix))
        return out


@dataclass
class Drafter:
    """A further draft pool (``[[drafters]]``): its drafter name, pool and acceptance model."""

    name: str
    pool: Pool
    acceptance: AcceptanceModel


@dataclass
class Scenario:
    name: str
    draft: Pool
    target: Pool
    acceptance: AcceptanceModel
    link: Link
    workload: Workload = field(default_factory=Workload)
    drafters: list[Drafter] = field(default_factory=list)  # pooled mode only, as in a deployment
    modes: list[str] = field(default_factory=lambda: list(MODES))
    # the live policy's knobs. Simulated workers report their forward times by rows from their cost
    # model, as live ones do (measure_costs); token-tree rows cost what the target's cost model says,
    # and their wins follow [acceptance]
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    seed: int = 0
    host: HostCosts = field(default_factory=HostCosts)
    sweep_draft_workers: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    sweep_scale_workload: bool = True
    source: str = "<built>"
    prefix_cache: bool = True  # the workers' prefix cache ([kv]), where prompts share their start


def _path(spec: str, base: Path) -> str:
    """A relative path against the scenario's folder, then the repository root (configs/..)."""
    p = Path(spec).expanduser()
    if p.is_absolute():
        return str(p)
    for root in (base, base.parent, base.parent.parent):
        if (root / p).exists():
            return str(root / p)
    return str(p)


def _pool(raw: dict[str, Any], where: str, base: Path) -> Pool:
    known = {"model", "hardware", "hardware_overrides", "profile", "workers", "max_batch", "elastic"}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    workers, max_batch = raw.get("workers", 1), raw.get("max_batch", 8)
    if not is_int(workers) or not is_int(max_batch) or workers < 1 or max_batch < 1:
        raise ConfigError(f"{where}: workers and max_batch must be whole numbers >= 1, got {workers!r} and {max_batch!r}")
    elastic = raw.get("elastic", True)
    if not isinstance(elastic, bool):
        raise ConfigError(f"{where}: elastic must be true or false")
    try:
        if "profile" in raw:
            return Pool(workers, max_batch, ProfileCost(load_profile(_path(raw["profile"], base))), elastic=elastic)
        if "model" in raw and "hardware" in raw:
            model = raw["model"]
            model = _path(model, base) if ("/" in model or model.endswith(".json")) else model
            hw = resolve_hardware(raw["hardware"], raw.get("hardware_overrides"))
            return Pool(workers, max_batch, RooflineCost(resolve_model(model), hw), hw.name, elastic)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    raise ConfigError(f"{where}: give a cost model: profile = PATH, or model = NAME and hardware = NAME")


def _from_deploy(path: str) -> dict[str, Any]:
    """Pools and policy knobs of a deployment config (its devices must be emulated: profiles)."""
    cfg = load_config(path)
    out: dict[str, Any] = {"policy": cfg.broker.policy.to_table()}
    for name, pool in (("draft", cfg.draft), ("target", cfg.target)):
        if not pool.profile:
            raise ConfigError(f"{path} [{name}]: simulating a deployment needs a latency profile "
                              "(device = \"emulated\", or measure one with `nebula-flow profile`)")
        out[name] = {"profile": pool.profile, "workers": pool.workers, "max_batch": pool.max_batch}
    out["mode"] = cfg.mode
    return out


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    raw = read_toml(path, "scenario")
    known = {"name", "description", "modes", "seed", "deploy", "policy", "workload", "draft", "target",
             "drafters", "acceptance", "kv", "host", "sweep"}
    unknown = set(raw) - known
    if unknown and unknown <= DEPLOY_SECTIONS and "workload" not in raw:
        raise ConfigError(f"{path} is a deployment config, not a scenario: simulate takes a scenario "
                          "(configs/sim/*.toml), which may name an emulated deployment with deploy = \"PATH\" (as "
                          "configs/sim/emulated-2d2t.toml does)")
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    base = path.resolve().parent
    if "deploy" in raw:  # the deployment's pools and knobs; the scenario's own entries win
        dep = _from_deploy(_path(raw["deploy"], base))
        for key in ("draft", "target", "policy"):
            raw[key] = {**dep[key], **raw.get(key, {})}
    try:
        policy = PolicyConfig.from_table(raw.get("policy", {}), f"{path} [policy]")
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    modes = raw.get("modes", list(MODES))
    if not isinstance(modes, list):
        raise ConfigError(f"{path}: modes must be a list, e.g. [\"pooled\", \"colocated\"], got {modes!r}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"{path}: unknown modes {bad}; choose from {', '.join(MODES)}")
    for name in ("draft", "target"):
        if name not in raw:
            raise ConfigError(f"{path}: [{name}] is required")
    draft = _pool(raw["draft"], f"{path} [draft]", base)
    target = _pool(raw["target"], f"{path} [target]", base)
    seed, name = raw.get("seed", 0), raw.get("name", path.stem)
    if not is_int(seed) or not isinstance(name, str):
        raise ConfigError(f"{path}: seed must be a whole number and name text, got {seed!r} and {name!r}")
    try:
        acceptance = AcceptanceModel.from_config(raw.get("acceptance", {}), seed, base)
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"{path} [acceptance]: {exc}") from None
    drafters = _drafters(raw.get("drafters", []), acceptance, seed, base, path)
    wl_raw = dict(raw.get("workload", {}))
    if "trace" in wl_raw:
        wl_raw["trace"] = _path(wl_raw["trace"], base)
        if not Path(wl_raw["trace"]).is_file():
            raise ConfigError(f"{path} [workload]: trace {wl_raw['trace']} not found")
    if isinstance(wl_raw.get("prompt_tokens"), int):
        wl_raw["prompt_tokens"] = (wl_raw["prompt_tokens"], wl_raw["prompt_tokens"])
    elif "prompt_tokens" in wl_raw:
        pair = wl_raw["prompt_tokens"]
        if not isinstance(pair, list) or len(pair) != 2 or not all(is_int(n) for n in pair):
            raise ConfigError(f"{path} [workload]: prompt_tokens must be N or [LO, HI], got {pair!r}")
        wl_raw["prompt_tokens"] = tuple(pair)
    workload = build_table(Workload, wl_raw, f"{path} [workload]")
    host = build_table(HostCosts, raw.get("host", {}), f"{path} [host]")
    if negative := [f.name for f in fields(HostCosts) if getattr(host, f.name) < 0]:
        raise ConfigError(f"{path} [host]: {', '.join(negative)} must be >= 0")
    urgent, shared, docs = workload.urgent_every, workload.shared_prefix, workload.documents
    if workload.requests < 1 or workload.output_tokens < 1 or workload.prompt_tokens[0] < 1 \
            or workload.prompt_tokens[0] > workload.prompt_tokens[1] \
            or type(urgent) is not int or urgent < 0 or urgent == 1 \
            or type(shared) is not int or shared < 0 or type(docs) is not int or docs < 1:
        raise ConfigError(f"{path} [workload]: requests, output_tokens >= 1, 1 <= prompt_tokens lo <= hi, "
                          "urgent_every 0 (none) or >= 2, shared_prefix >= 0 and documents >= 1 (integers)")
    if not isinstance(host.broker_shards, int) or host.broker_shards < 1:
        raise ConfigError(f"{path} [host]: broker_shards must be an integer >= 1")
    sweep, kv = raw.get("sweep", {}), raw.get("kv", {})
    for section, table, known in (("sweep", sweep, {"draft_workers", "scale_workload"}),
                                  ("kv", kv, {"movement", "bandwidth_gbps", "latency_us", "prefix_cache"})):
        if unknown := set(table) - known:
            raise ConfigError(f"{path} [{section}]: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    sizes = sweep.get("draft_workers", [1, 2, 4, 8, 16, 32, 64])
    if not isinstance(sizes, list) or not sizes or not all(is_int(n) and n >= 1 for n in sizes) \
            or not isinstance(sweep.get("scale_workload", True), bool):
        raise ConfigError(f"{path} [sweep]: draft_workers must be a list of whole numbers >= 1 and scale_workload "
                          f"true or false, got {sizes!r} and {sweep.get('scale_workload')!r}")
    prefix_cache = kv.get("prefix_cache", True)
    if not isinstance(prefix_cache, bool):
        raise ConfigError(f"{path} [kv]: prefix_cache must be true or false")
    return Scenario(
        name=name, draft=draft, target=target, acceptance=acceptance, drafters=drafters,
        link=_link(kv, target, f"{path} [kv]"), workload=workload, modes=list(modes),
        policy=policy,
        seed=seed, host=host,
        sweep_draft_workers=sizes, sweep_scale_workload=sweep.get("scale_workload", True), source=str(path), prefix_cache=prefix_cache)


def _drafters(raw: Any, acceptance: AcceptanceModel, seed: int, base: Path, path: Path) -> list[Drafter]:  # noqa: ANN401
    """The ``[[drafters]]`` pools: each a pool (``_pool``'s keys), a name and its own acceptance."""
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        raise ConfigError(f"{path}: drafters must be [[drafters]] tables")
    out: list[Drafter] = []
    for i, entry in enumerate(raw, 1):
        where = f"{path} [[drafters]] {i}"
        entry = dict(entry)
        name, acc = entry.pop("name", None), entry.pop("acceptance", None)
        if not isinstance(name, str) or not DRAFTER_NAME.fullmatch(name) or name == DEFAULT_DRAFTER \
                or name in {d.name for d in out}:
            raise ConfigError(f"{where}: name must be a drafter name of its own ({DRAFTER_RULE}; not "
                              f"{DEFAULT_DRAFTER!r}, which is [draft]'s)")
        try:
            # (a seed of its own: each drafter's per-request rates and accept draws apart from the others')
            own = AcceptanceModel.from_config(acc, seed + i, base) if acc is not None else acceptance
        except (ValueError, OSError, AttributeError) as exc:
            raise ConfigError(f"{where} acceptance: {exc}") from None
        out.append(Drafter(name, _pool(entry, where, base), own))
    return out


def _link(raw: dict[str, Any], target: Pool, where: str) -> Link:
    movement = raw.get("movement", "link")
    if movement == "free":
        return Link.free()
    if movement != "link":
        raise ConfigError(f"{where}: movement must be \"link\" or \"free\", got {movement!r}")
    hw = resolve_hardware(target.hardware) if target.hardware else None
    bw = raw.get("bandwidth_gbps", hw.link_bw / GB if hw else None)
    lat = raw.get("latency_us", hw.link_latency_s * 1e6 if hw else None)
    if bw is None or lat is None:
        raise ConfigError(f"{where}: with profile cost models give bandwidth_gbps and latency_us (or movement = \"free\")")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (bw, lat)) or bw <= 0 or lat < 0:
        raise ConfigError(f"{where}: bandwidth_gbps must be a number > 0 and latency_us >= 0, got {bw!r} and {lat!r}")
    return Link(float(bw) * GB, float(lat) * 1e-6)


def describe(sc: Scenario) -> dict[str, Any]:
    """What a result was computed from, for reports."""
    return {"name": sc.name, "source": sc.source, "k": sc.policy.k, "policy": sc.policy.to_table(), "seed": sc.seed,
            "draft": {"workers": sc.draft.workers, "max_batch": sc.draft.max_batch, "cost": sc.draft.cost.name},
            "target": {"workers": sc.target.workers, "max_batch": sc.target.max_batch, "cost": sc.target.cost.name},
            "drafters": {d.name: {"workers": d.pool.workers, "max_batch": d.pool.max_batch, "cost": d.pool.cost.name}
                         for d in sc.drafters},
            "kv_link": "free" if sc.link.bandwidth == float("inf") else
            {"gbps": sc.link.bandwidth / GB, "latency_us": sc.link.latency_s * 1e6},
            "expected_tokens_per_round": sc.acceptance.expected_tokens_per_round(sc.policy.k), "prefix_cache": sc.prefix_cache,
            "workload": json.loads(json.dumps({f.name: getattr(sc.workload, f.name) for f in fields(sc.workload)}))}
