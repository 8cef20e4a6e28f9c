"""The ``nebula-flow`` command line."""

from __future__ import annotations

import json
import sys
import time
import tomllib
from pathlib import Path

import click

from nebula_flow.config import ConfigError, DeployConfig, PoolConfig, cache_dir, load_config
from nebula_flow.scheduler import MODES, POLICY_KNOBS

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "default.toml"
DEFAULT_BROKER = "tcp://127.0.0.1:5555"


def _load(config: str | None) -> DeployConfig:
    try:
        return load_config(config or DEFAULT_CONFIG)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def prepare_models(cfg: DeployConfig) -> None:
    """Build project-made models the config names but the cache lacks (the bundled target,
    the tiny pair), then check that the draft can serve the target."""
    from nebula_flow.bundled import prepare_target, target_dir
    from nebula_flow.models.compat import IncompatiblePair, check_pair
    from nebula_flow.models.config import ModelConfigError
    from nebula_flow.routing import is_ngram

    tiny = cache_dir() / "tiny-pair"
    drafts = [p for p in (cfg.draft, *cfg.drafters) if p.model and not is_ngram(p.model)]
    for pool in (*drafts, cfg.target):
        if not pool.model:
            continue
        if Path(pool.model).is_relative_to(tiny) and not (tiny / "READY").exists():
            from nebula_flow.tiny import build_tiny_pair

            click.echo(f"building the tiny model pair in {tiny} ...", err=True)
            build_tiny_pair(tiny)
        if Path(pool.model) == target_dir():
            prepare_target(log=lambda m: click.echo(m, err=True))
    for pool in drafts if cfg.mode != "autoregressive" else ():
        try:
            check_pair(pool.model, cfg.target.model)
        except (IncompatiblePair, ModelConfigError) as exc:
            raise click.ClickException(f"draft {pool.model} cannot serve target {cfg.target.model}: {exc}") from None


def _apply_overrides(cfg: DeployConfig, mode: str | None, draft_workers: int | None,
                     target_workers: int | None, port: int | None, add_drafters: tuple[str, ...] = ()) -> DeployConfig:
    if mode:
        cfg.mode = mode
    for spec in add_drafters:  # one more draft pool (one worker) per spec: several drafters, routed
        cfg.drafters.append(PoolConfig(model=spec, workers=1, max_batch=cfg.draft.max_batch, dtype=cfg.draft.dtype,
                                       device=cfg.draft.device))
    if draft_workers:
        cfg.draft.workers = draft_workers
    if target_workers:
        cfg.target.workers = target_workers
    if port is not None:
        cfg.broker.client_port, cfg.broker.worker_port = port, (port + 1 if port else 0)
    try:
        cfg.validate()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return cfg


def _set_knob(cfg: DeployConfig, setting: str, where: str) -> None:
    """Set a [broker] policy knob from ``KNOB=VALUE`` (a bench mode's @ suffix); validated with the config."""
    knob, eq, value = setting.partition("=")
    if knob not in POLICY_KNOBS or not eq:
        raise click.ClickException(f"{where}: @{setting} must be KNOB=VALUE with KNOB one of {', '.join(POLICY_KNOBS)}")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        raise click.ClickException(f"{where}: @{setting}: {value!r} is not a TOML value (true, 3, [1.0, 2.0, 1.0])") from None
    current = getattr(cfg.broker, knob)
    if type(parsed) is not type(current) and not (isinstance(current, list) and isinstance(parsed, list)):
        raise click.ClickException(f"{where}: @{setting}: {knob} takes a {type(current).__name__}")
    setattr(cfg.broker, knob, parsed)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """nebula-flow: speculative decoding as a dataflow pipeline on a ZeroMQ bus.

    A broker holds the request pool; draft and target workers pull request-round tasks.
    Start a whole deployment with `serve` (or `run` for a one-shot demo); talk to it with
    `generate` and `status`.
    """


@main.command()
@click.option("--mode", type=click.Choice(list(MODES)), default="pooled", show_default=True,
              help="Scheduling mode: pooled (M-for-N), paired, colocated or autoregressive.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--client-port", default=5555, show_default=True, help="Port for clients.")
@click.option("--worker-port", default=5556, show_default=True, help="Port for workers.")
@click.option("--model", type=click.Path(), help="Target checkpoint directory: tokenizer, context length, EOS.")
@click.option("--k", default=4, show_default=True, help="Draft tokens proposed per round (the most, with --adaptive-k).")
@click.option("--adaptive-k/--fixed-k", default=False, show_default=True,
              help="Choose each round's k in 0..K from the request's recent acceptance, for the most tokens per "
              "cost (nebula_flow/speclen.py).")
@click.option("--spec-costs", default=None, metavar="DRAFT,ROW,ROUND",
              help="Costs --adaptive-k weighs, in target decode steps: a draft step, a verify row, a round's "
              "fixed cost; with --measure-costs the first two are only where it starts [default: 0.073,0.03,1.1, "
              "measured for the bundled pair on a 2-core CPU with AMX, in bf16].")
@click.option("--measure-costs/--fixed-costs", default=True, show_default=True,
              help="With --adaptive-k: weigh draft steps and verify blocks by the forward times the workers measure "
              "(they differ by device and dtype far more than by model); status shows the costs in use.")
@click.option("--first-alternatives", default=0, show_default=True, type=click.IntRange(0, 8),
              help="The draft also proposes this many runner-ups to its first token, verified "
              "in the same forward as siblings in a token tree (one more verify row each); a runner-up the target "
              "picks is kept with the target's next token (sampled requests: its most likely tokens besides the one "
              "it drew, each accepted with its probability under what the rejected ones leave: exact). With --adaptive-k, only in rounds where that pays for "
              "the rows, by the costs and how often a runner-up has won for the request.")
@click.option("--fuse-ngram", default=0, show_default=True, type=click.IntRange(0, 16), metavar="N",
              help="Beside each model draft, also verify the prompt-lookup chain of up to N "
              "tokens (what followed the context's last 2-4 tokens before; the draft worker looks it up, or the "
              "target in a round without a draft), fused with the draft into one token tree: a greedy round keeps "
              "the path the target agrees with longest, a sampled one samples down the tree (exact). It costs "
              "verify rows only in rounds with a match the draft does not already have; with --adaptive-k only "
              "where it pays for them. Not in autoregressive mode. 0: off.")
@click.option("--disable-by-batch-size", default=0, show_default=True, type=click.IntRange(0),
              help="While more requests than this are in the pool, rounds start without drafts (plain decoding): "
              "a target batching many requests gains little from speculation. 0: always speculate.")
@click.option("--proposal-top-k", default=16, show_default=True,
              help="Entries of the draft distribution q sent with each sampled draft token.")
@click.option("--max-pending", default=1024, show_default=True, help="Admission limit; beyond it clients get BUSY.")
@click.option("--heartbeat-s", default=1.0, show_default=True, help="Heartbeat interval.")
@click.option("--liveness-s", default=10.0, show_default=True, help="Silence after which a worker is declared dead.")
@click.option("--locality/--no-locality", default=True, show_default=True,
              help="Prefer giving a worker the tasks whose KV it already holds (never waiting for it).")
@click.option("--migrate", is_flag=True, help="Never give a request the same worker twice in a row (forces KV moves).")
@click.option("--merge-batches/--no-merge-batches", default=True, show_default=True,
              help="Give a busy worker no small batch beside a bigger running one (it would alternate two half "
              "batches for ever); the tasks join the returning ones instead.")
@click.option("--metrics-port", type=int, help="Serve Prometheus text at http://HOST:PORT/metrics (0: a free port).")
@click.option("--keys", type=click.Path(), help="CURVE key folder (`nebula-flow keys`); required off loopback. "
              "Also read from NEBULA_FLOW_KEYS.")
@click.option("--policy-log", type=click.Path(), help="At exit, write every scheduling event and decision here "
              "(JSONL), for `nebula-flow simulate --check-policy-log`.")
def broker(mode: str, host: str, client_port: int, worker_port: int, model: str | None, k: int,
           adaptive_k: bool, spec_costs: str | None, measure_costs: bool, first_alternatives: int,
           fuse_ngram: int, disable_by_batch_size: int,
           proposal_top_k: int, max_pending: int, heartbeat_s: float, liveness_s: float,
           locality: bool, migrate: bool, merge_batches: bool, metrics_port: int | None, keys: str | None,
           policy_log: str | None) -> None:
    """Run the broker: the request pool, the draft and target topics, the two sockets."""
    from broker.server import BrokerOptions, serve_broker
    from nebula_flow.speclen import DEFAULT_COSTS

    try:
        costs = [float(c) for c in spec_costs.split(",")] if spec_costs else list(DEFAULT_COSTS)
    except ValueError:
        raise click.BadParameter("three numbers: DRAFT,ROW,ROUND", param_hint="--spec-costs") from None
    try:
        sys.exit(serve_broker(BrokerOptions(mode, host, client_port, worker_port, model, k, proposal_top_k,
                                            max_pending, heartbeat_s=heartbeat_s, liveness_s=liveness_s,
                                            locality=locality, migrate=migrate, merge_batches=merge_batches,
                                            adaptive_k=adaptive_k, spec_costs=costs, measure_costs=measure_costs,
                                            first_alternatives=first_alternatives, fuse_ngram=fuse_ngram,
                                            disable_by_batch_size=disable_by_batch_size, metrics_port=metrics_port,
                                            keys=keys, policy_log=policy_log)))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--role", type=click.Choice(["draft", "target", "colocated"]), required=True,
              help="Which topic to serve; colocated workers hold both models.")
@click.option("--model", required=True, type=click.Path(),
              help="Checkpoint directory (the draft's for role draft). A draft may also be ngram, ngram:MAX or "
              "ngram:MIN-MAX: prompt lookup, no model (proposes what followed the context's last n tokens before; "
              "default n 2..4).")
@click.option("--draft-model", type=click.Path(), help="Draft checkpoint (colocated workers only; ngram as for --model).")
@click.option("--drafter", default=None, metavar="NAME",
              help="Draft workers: the drafter name the broker routes rounds by (several drafters: each round goes "
              "to the one that pays best for its request). Workers of one drafter must run the same model. "
              "[default: the model folder's name; ngram for the n-gram drafter]")
@click.option("--broker", "broker_addr", default="tcp://127.0.0.1:5556", show_default=True,
              help="The broker's worker address.")
@click.option("--name", default="", help="Name shown in status and logs.")
@click.option("--max-batch", default=8, show_default=True, help="Tasks per batch (the credits of each PULL).")
@click.option("--threads", default=1, show_default=True, help="torch threads for this worker.")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:N, or emulated (forward passes take the time --profile predicts).")
@click.option("--dtype", default=None, help="float32, bfloat16, float16, or auto: bf16 on CUDA and on CPUs that compute "
              "bf16 natively (AMX-BF16, AVX512-BF16, Arm BF16), fp32 on other CPUs (default: fp32 on CPU, bf16 on CUDA).")
@click.option("--batch-invariant/--no-batch-invariant", default=None,
              help="Give a token's logits the same bits whatever it is batched with, so speculative output "
              "equals plain decoding exactly in reduced precision (costs a little speed). Default: on for "
              "bfloat16/float16 on CPU, off otherwise.")
@click.option("--kv-transport", type=click.Choice(["auto", "ucx", "zmq", "shm", "shm+zmq", "none"]), default="auto",
              show_default=True,
              help="How KV moves between workers: auto = UCX on CUDA (if ucxx is installed, else ZeroMQ), shm+zmq "
              "on CPU; shm = peers on this host read the holder's KV files (CPU, one host); shm+zmq = shm with "
              "same-host peers, ZeroMQ with the others. With --keys: ZeroMQ (CURVE) only.")
@click.option("--kv-host", default="127.0.0.1", show_default=True, help="Interface the KV server binds and advertises.")
@click.option("--kv-overlap/--no-kv-overlap", default=True, show_default=True,
              help="Pull a batch's KV while the previous batch computes (off: at the start of its compute).")
@click.option("--profile", type=click.Path(), help="Latency profile for --device emulated.")
@click.option("--draft-profile", type=click.Path(), help="The draft's latency profile (colocated + emulated).")
@click.option("--max-kv-gb", default=4.0, show_default=True, help="KV memory budget per model (LRU eviction).")
@click.option("--kv-pool-gb", type=float, help="Memory per model for finished requests' shared KV files, kept "
              "(pages in) for later requests, beyond --max-kv-gb; 0: none kept. Same-host (shm) KV only. "
              "[default: --max-kv-gb / 8]")
@click.option("--keys", type=click.Path(), help="CURVE key folder (or NEBULA_FLOW_KEYS).")
def worker(role: str, model: str, draft_model: str | None, drafter: str | None, broker_addr: str, name: str,
           max_batch: int, threads: int, device: str, dtype: str | None, batch_invariant: bool | None,
           kv_transport: str, kv_host: str, kv_overlap: bool, profile: str | None, draft_profile: str | None, max_kv_gb: float,
           kv_pool_gb: float | None, keys: str | None) -> None:
    """Run one worker: register, pull tasks, run them, return results."""
    from nebula_flow.models.config import ModelConfigError
    from nebula_flow.protocol import DRAFTER_NAME, DRAFTER_RULE
    from workers.worker import WorkerOptions, serve_worker

    if drafter is not None and (role != "draft" or not DRAFTER_NAME.fullmatch(drafter)):
        raise click.BadParameter(f"a draft worker's name for its drafter: {DRAFTER_RULE}",
                                 param_hint="--drafter")

    try:
        sys.exit(serve_worker(WorkerOptions(role, broker_addr, model, draft_model, name, max_batch,
                                            threads, device, dtype, batch_invariant, kv_transport=kv_transport,
                                            kv_host=kv_host,
                                            kv_overlap=kv_overlap, profile=profile, draft_profile=draft_profile,
                                            max_kv_gb=max_kv_gb, kv_pool_gb=kv_pool_gb, keys=keys,
                                            drafter=drafter)))
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False), help="Checkpoint directory.")
@click.option("--out", type=click.Path(), help="Profile JSON to write (default: print it).")
@click.option("--batches", default="1,2,4,8", show_default=True)
@click.option("--tokens", default="1,5", show_default=True, help="New tokens per sequence (1 = decode, k+1 = verify).")
@click.option("--contexts", default="64,256", show_default=True, help="Context lengths.")
@click.option("--threads", default=1, show_default=True)
@click.option("--acceptance", type=float, help="Record a per-position acceptance rate (for draft profiles).")
def profile(model, out, batches, tokens, contexts, threads, acceptance) -> None:  # noqa: ANN001
    """Measure MODEL's forward latency over a grid and write a profile for --device emulated."""
    from nebula_flow.emulated import measure_profile

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    prof = measure_profile(model, ints(batches), ints(tokens), ints(contexts), threads,
                           log=lambda m: click.echo(m, err=True))
    if acceptance is not None:
        prof["acceptance"] = acceptance
    text = json.dumps(prof, indent=2)
    if out:
        Path(out).write_text(text)
        click.echo(f"wrote {out}: {prof['latency']}", err=True)
    else:
        click.echo(text)


_deploy_options = [
    click.option("--config", type=click.Path(), help=f"Deployment TOML (default {DEFAULT_CONFIG.relative_to(REPO)})."),
    click.option("--mode", type=click.Choice(list(MODES)), help="Override the config's mode."),
    click.option("--draft-workers", type=int, help="Override the number of draft workers (M)."),
    click.option("--target-workers", type=int, help="Override the number of target workers (N)."),
    click.option("--port", type=int, help="Client port (workers use port+1); 0 picks free ports."),
    click.option("--log-dir", type=click.Path(), help="Where child process logs go (default: a temp folder)."),
    click.option("--add-drafter", "add_drafters", multiple=True, metavar="MODEL",
                 help="Pooled mode: one more draft worker with this drafter (ngram, ngram:MAX, ngram:MIN-MAX, or a "
                 "draft checkpoint); each round goes to the drafter that pays best for its request. Repeatable."),
]


def deploy_options(f):  # noqa: ANN001, ANN201 - click decorator
    for opt in reversed(_deploy_options):
        f = opt(f)
    return f


def _start(config, mode, draft_workers, target_workers, port, log_dir, add_drafters=()):  # noqa: ANN001, ANN202
    from nebula_flow.deploy import Deployment, DeploymentError

    cfg = _apply_overrides(_load(config), mode, draft_workers, target_workers, port, add_drafters)
    prepare_models(cfg)
    dep = Deployment(cfg, log_dir)
    plan = cfg.worker_plan()
    click.echo(f"starting {cfg.mode}: broker + {len(plan)} workers "
               f"({', '.join(sorted({r for r, _ in plan}))}); logs in {dep.log_dir}", err=True)
    t0 = time.monotonic()
    try:
        dep.start()
    except DeploymentError as exc:
        dep.stop()
        raise click.ClickException(str(exc)) from None
    click.echo(f"ready in {time.monotonic() - t0:.1f} s", err=True)
    return dep


@main.command()
@deploy_options
def serve(config, mode, draft_workers, target_workers, port, log_dir, add_drafters) -> None:  # noqa: ANN001
    """Start a broker and its workers; print the client address; stop on Ctrl-C / SIGTERM."""
    import signal

    dep = _start(config, mode, draft_workers, target_workers, port, log_dir, add_drafters)
    click.echo(dep.address)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
            dep.check_alive()
    except KeyboardInterrupt:
        pass
    finally:
        click.echo("stopping ...", err=True)
        dep.stop()


def _print_completion(out, as_json: bool) -> None:  # noqa: ANN001
    if as_json:
        click.echo(json.dumps(out.to_json()))
        return
    click.echo(f"\n[{len(out.token_ids)} tokens, {out.rounds} rounds, {out.mean_tokens_per_round:.2f} tokens/round, "
               f"TTFT {out.ttft_s * 1000:.0f} ms, latency {out.latency_s:.2f} s, "
               f"{len(out.token_ids) / max(out.latency_s, 1e-9):.1f} tokens/s, finish: {out.finish_reason}]", err=True)
    drafters = out.stats.get("drafter_rounds") or {}
    if len(drafters) > 1:  # several drafters: which drafted how many of its rounds
        click.echo("[rounds by drafter: " + ", ".join(f"{d} {n}" for d, n in sorted(drafters.items())) + "]", err=True)
    if out.stats.get("fused_accepted"):  # token trees: what fused prompt-lookup chains added beyond the drafts
        click.echo(f"[fused chains added {out.stats['fused_accepted']} tokens]", err=True)


def _generate(address: str, prompt: str, as_json: bool, **params) -> None:  # noqa: ANN003
    from nebula_flow.client import Client, Completion, NebulaError

    try:
        with Client(address, timeout_s=params.pop("timeout_s")) as client:
            for item in client.stream(prompt, **params):
                if isinstance(item, Completion):
                    _print_completion(item, as_json)
                elif not as_json:
                    click.echo(item.text, nl=False)
    except (NebulaError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


_gen_options = [
    click.option("--max-new-tokens", default=64, show_default=True),
    click.option("--temperature", default=0.0, show_default=True, help="0 = greedy."),
    click.option("--top-k", default=0, show_default=True, help="0 = off."),
    click.option("--top-p", default=1.0, show_default=True),
    click.option("--seed", type=int, help="Fixes the output for sampled generation."),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template."),
    click.option("--timeout-s", default=300.0, show_default=True),
]


def gen_options(f):  # noqa: ANN001, ANN201 - click decorator
    for opt in reversed(_gen_options):
        f = opt(f)
    return f


@main.command()
@click.argument("prompt")
@click.option("--broker", "address", default=DEFAULT_BROKER, show_default=True, help="The broker's client address.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@gen_options
def generate(prompt: str, address: str, as_json: bool, **params) -> None:  # noqa: ANN003
    """Generate from PROMPT: stream the text, then print rounds, tokens/round, TTFT, latency."""
    _generate(address, prompt, as_json, stop=tuple(params.pop("stop")), **params)


@main.command()
@click.argument("prompts", nargs=-1)
@deploy_options
@gen_options
def run(prompts, config, mode, draft_workers, target_workers, port, log_dir, add_drafters, **params) -> None:  # noqa: ANN001, ANN003
    """One-shot demo: start the deployment, generate from PROMPTS (a default set if none), stop."""
    prompts = prompts or ("def fibonacci(n):", "import os\n\ndef list_files(path):", "The quick brown fox")
    dep = _start(config, mode, draft_workers, target_workers, 0 if port is None else port, log_dir, add_drafters)
    try:
        for prompt in prompts:
            click.echo(f"\n>>> {prompt}")
            _generate(dep.address, prompt, False, stop=tuple(params["stop"]),
                      **{k: v for k, v in params.items() if k != "stop"})
    finally:
        dep.stop()


@main.command()
@click.option("--broker", "address", default=DEFAULT_BROKER, show_default=True, help="The broker's client address.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw state as JSON.")
def status(address: str, as_json: bool) -> None:
    """Show the broker's workers, topics and counters."""
    from nebula_flow.client import Client, NebulaError

    try:
        with Client(address, timeout_s=5) as client:
            state = client.status()
    except NebulaError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(state, indent=2))
        return
    click.echo(f"mode {state['mode']}, up {state['uptime_s']:.0f} s, {state['pool']} requests in the pool, "
               f"topics {state['topics']}")
    for w in state["workers"]:
        drafter = f" drafter {w['drafter']}" if w.get("drafter") and len(state.get("drafters", {})) > 1 else ""
        click.echo(f"  worker {w['id']:>3} {w['role']:<9} slot {w['slot']:<3} {w['name']:<16} "
                   f"tasks {w['tasks']:<8} busy {w['busy_s']:.1f} s{drafter}")
    if len(state.get("drafters", {})) > 1:  # several drafters: how routing shares the rounds out
        for name, d in state["drafters"].items():
            rates = ", ".join(f"{kind} {rate:.2f}" for kind, rate in d.get("acceptance", {}).items())
            click.echo(f"  drafter {name:<16} workers {d['workers']:<3} rounds {d['rounds']:<7} "
                       f"drafts accepted {d['accepted']}/{d['proposed']}" + (f"; recent acceptance {rates}" if rates else ""))
    if "draft" in state["roles"] or "colocated" in state["roles"]:
        draft, row, fixed = state["spec_costs"]
        blocks = " ".join("-" if v is None else f"{v:.2f}" for v in state["verify_costs"]) or "not measured yet"
        click.echo(f"speculation costs in target decode steps: draft step {draft:.3f}, verify row {row:.3f}, "
                   f"round {fixed:.2f}; verify blocks by rows: {blocks}")
    click.echo(f"counters {state['counters']}")
    if state["errors"]:
        click.echo(f"errors {state['errors']}")


@main.command()
@click.option("--config", type=click.Path(), help="Deployment TOML (default: the bundled one).")
@click.option("--modes", default="pooled,paired,colocated,autoregressive", show_default=True,
              help="Comma-separated modes, measured in turn; ratios are against the first. pooled+MODEL is pooled "
              "with one more drafter (as --add-drafter MODEL, e.g. pooled+ngram), pooled-NAME pooled without the "
              "config's [[drafters]] pool of that drafter name (e.g. pooled-ngram on the bundled config): routing "
              "measured side by side. A mode may end in @KNOB=VALUE (repeatable) to set a [broker] policy knob for "
              "it alone, e.g. pooled@fuse_ngram=0,pooled@fuse_ngram=8.")
@click.option("--draft-workers", type=int, help="Override M.")
@click.option("--target-workers", type=int, help="Override N.")
@click.option("--concurrency", default=1, show_default=True, help="Concurrent requests (1 = single stream).")
@click.option("--requests", "n_requests", default=8, show_default=True, help="Requests per repeat.")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Repeats per mode; figures are medians.")
@click.option("--chat", is_flag=True, help="Send code requests in the model's chat format (how an instruct model "
              "is used) instead of raw code and prose prompts.")
@click.option("--edit", is_flag=True, help="Send chat requests to change a given function (add type hints, a "
              "docstring): answers that repeat their prompt's code, where an n-gram drafter pays (pooled+ngram).")
@click.option("--json", "as_json", is_flag=True, help="Print {\"modes\": {mode: {...}}} as JSON.")
def bench(config, modes, draft_workers, target_workers, concurrency, n_requests, max_new_tokens,
          temperature, repeats, chat, edit, as_json) -> None:  # noqa: ANN001
    """Benchmark the modes side by side on one config and workload (medians over repeats)."""
    from nebula_flow.bench import (
        DEFAULT_CHAT_PROMPTS,
        DEFAULT_EDIT_PROMPTS,
        DEFAULT_PROMPTS,
        Workload,
        bench_mode,
        table,
    )

    names = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in names if (base := m.split("@")[0]) not in MODES and not base.startswith(("pooled+", "pooled-"))]
    if bad or not names:
        raise click.ClickException(f"unknown modes {bad}; choose from {', '.join(MODES)} (or pooled+MODEL, "
                                   "pooled-NAME; then @KNOB=VALUE)")
    if twice := sorted({m for m in names if names.count(m) > 1}):  # (results are keyed by mode)
        raise click.ClickException(f"modes given more than once: {', '.join(twice)}; a mode's runs are --repeats")
    pool = DEFAULT_EDIT_PROMPTS if edit else DEFAULT_CHAT_PROMPTS if chat else DEFAULT_PROMPTS
    wl = Workload([pool[i % len(pool)] for i in range(n_requests)], max_new_tokens, concurrency, temperature,
                  chat=chat or edit)
    results = {}
    for name in names:
        base, *settings = name.split("@")
        mode, change, spec = base.partition("+") if "+" in base else base.partition("-")
        cfg = _load(config)
        for setting in settings:
            _set_knob(cfg, setting, name)
        if change == "-":
            from nebula_flow.routing import drafter_name

            kept = [p for p in cfg.drafters if drafter_name(p.drafter, p.model) != spec]
            if len(kept) == len(cfg.drafters):
                raise click.ClickException(f"{name}: the config has no [[drafters]] pool named {spec!r}")
            cfg.drafters = kept
        cfg = _apply_overrides(cfg, mode, draft_workers, target_workers, None, (spec,) if change == "+" else ())
        prepare_models(cfg)
        click.echo(f"[bench] {name}: {n_requests} requests x {max_new_tokens} tokens, concurrency {concurrency}, "
                   f"{repeats} repeats", err=True)
        results[name] = bench_mode(cfg, mode, wl, repeats, log=lambda m: click.echo(m, err=True), label=name)
    if as_json:
        click.echo(json.dumps({"modes": results}))
    else:
        click.echo(table(results))


@main.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--broker", "address", default=DEFAULT_BROKER, show_default=True, help="The broker's client address.")
@click.option("--tokenizer", type=click.Path(), help="Tokenizer folder for traces without text (default: the "
              "target of --config or of the bundled config).")
@click.option("--config", type=click.Path(), help="Deployment TOML whose target tokenizer to use.")
@click.option("--time-scale", default=1.0, show_default=True, help="Divide arrival times by this (2 = twice as fast).")
@click.option("--limit", type=int, help="Replay only the first N requests (after --start/--end).")
@click.option("--start", "start_s", default=0.0, help="Window start, seconds from the trace's first request.")
@click.option("--end", "end_s", type=float, help="Window end, seconds from the trace's first request.")
@click.option("--poisson", type=float, help="Replace arrivals with a Poisson process of this many requests/s.")
@click.option("--concurrency", type=int, help="At most this many requests in flight.")
@click.option("--max-prompt-tokens", type=int, help="Clip longer prompts (the report counts them).")
@click.option("--max-new-tokens", type=int, help="Clip longer outputs (the report counts them).")
@click.option("--out", type=click.Path(), default="runs/replay", show_default=True,
              help="Folder for requests.jsonl, summary.json and PNG plots.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--seed", default=0, show_default=True, help="Seed for prompt cutting and Poisson arrivals.")
def replay(trace, address, tokenizer, config, time_scale, limit, start_s, end_s, poisson, concurrency,
           max_prompt_tokens, max_new_tokens, out, as_json, seed) -> None:  # noqa: ANN001
    """Replay TRACE (JSONL or Azure CSV) against a broker, open loop, at its arrival times."""
    import asyncio

    from nebula_flow.client import Client, NebulaError
    from nebula_flow.replay import replay as run_replay
    from nebula_flow.replay import summarize, write_outputs
    from nebula_flow.traces import PromptSource, Shaping, TraceError, load_trace, shape

    try:
        with Client(address, timeout_s=5) as c:
            context = c.status().get("max_model_len", 1 << 30)
        reqs, report = shape(load_trace(trace), Shaping(time_scale, limit, start_s, end_s, poisson,
                                                        max_prompt_tokens, max_new_tokens, seed), context)
    except (TraceError, NebulaError) as exc:
        raise click.ClickException(str(exc)) from None
    prompts = None
    if any(r.prompt_len is not None for r in reqs):
        tok_dir = tokenizer or _load(config).target.model
        prompts = PromptSource(tok_dir, seed)
    click.echo(f"replaying {len(reqs)} requests over {reqs[-1].arrival_s if reqs else 0:.1f} s "
               f"(time scale {time_scale}); clipped prompts {report['clipped_prompts']}, "
               f"clipped outputs {report['clipped_outputs']}", err=True)
    records, wall = asyncio.run(run_replay(address, reqs, prompts, concurrency, progress=not as_json))
    summary = summarize(records, wall, report)
    paths = write_outputs(Path(out), records, summary)
    if as_json:
        click.echo(json.dumps(summary))
        return
    click.echo(f"{summary['completed']}/{summary['requests']} completed, {summary['errors']} errors in {wall:.1f} s")
    click.echo(f"throughput {summary['tokens_per_s']:.1f} tokens/s, {summary['requests_per_s']:.2f} requests/s, "
               f"{summary['round_rate']:.1f} rounds/s, {summary['tokens_per_round']:.2f} tokens/round")
    for key in ("ttft_s", "inter_chunk_s", "latency_s"):
        p = summary[key]
        click.echo(f"{key:<14} p50 {p['p50']:.3f}  p90 {p['p90']:.3f}  p99 {p['p99']:.3f}")
    click.echo(f"wrote {out}/requests.jsonl, summary.json, " + ", ".join(p.name for p in paths))


@main.command("bench-kv")
@click.option("--config", type=click.Path(), help="Deployment TOML (default: the bundled one).")
@click.option("--transport", type=click.Choice(["auto", "ucx", "zmq", "shm", "shm+zmq"]), default="auto",
              show_default=True, help="KV transport to measure (auto: what the workers' auto picks).")
@click.option("--draft-workers", default=2, show_default=True)
@click.option("--target-workers", default=2, show_default=True)
@click.option("--concurrency", default=4, show_default=True)
@click.option("--requests", "n_requests", default=8, show_default=True)
@click.option("--max-new-tokens", default=48, show_default=True)
@click.option("--context-tokens", default=0, show_default=True, type=click.IntRange(0),
              help="Put about this many tokens of code (stdlib sources) before each prompt: long prompts, "
                   "whose KV moves in large pulls (code completion with a file open).")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1),
              help="Runs of each mode, in alternating order (A B B A ...); medians are reported.")
@click.option("--json", "as_json", is_flag=True)
def bench_kv_cmd(config, transport, draft_workers, target_workers, concurrency, n_requests, max_new_tokens,
                 context_tokens, repeats, as_json) -> None:  # noqa: ANN001
    """KV movement cost in a pooled run with forced migration: stall as a fraction of compute,
    with and without overlap, and in-system bandwidth against the raw transport."""
    from nebula_flow.bench import DEFAULT_PROMPTS, Workload, bench_kv, kv_report, with_context

    cfg = _apply_overrides(_load(config), "pooled", draft_workers, target_workers, None)
    from nebula_flow.kv.transport import resolve_transport

    transport = resolve_transport(transport, cfg.target.device)  # what the workers' auto picks
    prepare_models(cfg)
    prompts = with_context([DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(n_requests)], context_tokens,
                           cfg.target.model)
    wl = Workload(prompts, max_new_tokens, concurrency)
    res = bench_kv(cfg, wl, transport, log=lambda m: click.echo(m, err=True), repeats=repeats)
    click.echo(json.dumps(res) if as_json else kv_report(res))


@main.command("train-draft")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target checkpoint directory.")
@click.option("--out", required=True, type=click.Path(), help="Where the draft checkpoint goes (resumes if a checkpoint is there).")
@click.option("--corpus", multiple=True, type=click.Path(exists=True), help="Text files/folders (*.py); default: the stdlib sources.")
@click.option("--max-tokens", default=400_000, show_default=True, help="Corpus tokens to use.")
@click.option("--seq-len", default=256, show_default=True)
@click.option("--steps", default=1500, show_default=True)
@click.option("--batch-size", default=16, show_default=True)
@click.option("--lr", default=2e-3, show_default=True)
@click.option("--hidden-size", default=256, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--intermediate-size", default=704, show_default=True)
@click.option("--head-vocab", default=8192, show_default=True, help="Tokens the draft's output head scores (0 = all).")
@click.option("--teacher-dtype", default="bfloat16", show_default=True, help="dtype of the cached teacher pass.")
@click.option("--eval-tokens", default=48, show_default=True, help="Tokens per prompt in the acceptance evaluation.")
@click.option("--generate-seqs", default=0, show_default=True,
              help="Also distil on this many sequences the target writes itself (its own style).")
@click.option("--generate-len", default=192, show_default=True, help="Tokens per generated sequence.")
@click.option("--generate-chat", default=0, show_default=True,
              help="Also distil on the target's answers to this many code requests sent in its chat format "
              "(made from the corpus's documented functions): how an instruct model is used.")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False), help="Fine-tune this draft instead of "
              "starting from scratch.")
@click.option("--seed", default=0, show_default=True,
              help="Seeds initialisation, batches and generation (a new seed writes new generated sequences).")
def train_draft(target, out, corpus, **kw) -> None:  # noqa: ANN001, ANN003
    """Distil a draft model for TARGET: cached teacher logits, resumable training, evaluation."""
    from nebula_flow.distill import DistillConfig
    from nebula_flow.distill import train_draft as run_training

    report = run_training(DistillConfig(target=target, out=out, corpus=list(corpus) or None, **kw))
    click.echo(json.dumps({"held_out_loss": report["held_out_loss"], "acceptance": report["acceptance"],
                           "parameters": report["parameters"]}, indent=2))


@main.command("eval-draft")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target checkpoint directory.")
@click.option("--draft", required=True, type=click.Path(exists=True, file_okay=False), help="Draft checkpoint directory.")
@click.option("--target-dtype", default=None, help="The target's dtype as deployed (float32, bfloat16, or auto as "
              "workers pick it; default fp32 on CPU). bf16 runs batch-invariant, as workers run it.")
@click.option("--ks", default="2,4,6", show_default=True, help="Speculation lengths to measure.")
@click.option("--max-new-tokens", default=48, show_default=True, help="Tokens per prompt.")
@click.option("--alternatives", default=0, show_default=True, type=click.IntRange(0, 8),
              help="Runner-ups to the first draft token verified beside the chain (a token tree; the broker's "
              "--first-alternatives).")
@click.option("--fuse-ngram", default=0, show_default=True, type=click.IntRange(0, 16),
              help="Also verify a prompt-lookup chain of up to this many tokens beside each draft (the broker's "
              "--fuse-ngram).")
@click.option("--chat", is_flag=True, help="Send the built-in code requests in the target's chat format (how an "
              "instruct model is used) instead of raw code prompts; an answer ends at the end-of-turn token.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 100),
              help="Sample at this temperature instead of decoding greedily (rejection sampling: tokens per round "
              "only, there is no output to compare).")
@click.option("--seeds", default=3, show_default=True, type=click.IntRange(1, 1000),
              help="With --temperature: samples of each prompt (each request draws from its own seed).")
def eval_draft(target: str, draft: str, target_dtype: str | None, ks: str, max_new_tokens: int,
               alternatives: int, fuse_ngram: int, chat: bool, temperature: float, seeds: int) -> None:
    """Committed tokens per round of a draft/target pair at each k, on the built-in code prompts
    (not from the training corpus). Greedy by default, checking the output equals the target
    alone; --temperature samples."""
    from nebula_flow.distill import EVAL_CHAT_PROMPTS, EVAL_PROMPTS, evaluate_pair
    from nebula_flow.models.compat import IncompatiblePair, check_pair
    from nebula_flow.models.config import ModelConfigError

    try:
        check_pair(draft, target)
    except (IncompatiblePair, ModelConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{len(EVAL_CHAT_PROMPTS if chat else EVAL_PROMPTS)} {'chat' if chat else 'code'} prompts x "
               f"{max_new_tokens} tokens, target {target_dtype or 'default dtype'}"
               + (f", sampled at temperature {temperature}, {seeds} seeds" if temperature else ""), err=True)
    res = evaluate_pair(target, draft, max_new_tokens, tuple(int(k) for k in ks.split(",")), target_dtype,
                        alternatives, chat, fuse_ngram, temperature, seeds)
    click.echo(json.dumps(res, indent=2))


@main.command()
@click.argument("folder", type=click.Path())
def keys(folder: str) -> None:
    """Create CURVE keypairs for the broker, workers and clients in FOLDER (with authorized/)."""
    from nebula_flow.security import generate_keys

    path = generate_keys(folder)
    click.echo(f"wrote broker, worker and client keypairs to {path}; pass --keys {path} "
               "(or set NEBULA_FLOW_KEYS) on every broker, worker and client")


@main.command()
@click.argument("scenario", type=click.Path(), required=False)
@click.option("--modes", help="Comma-separated modes (default: the scenario's); ratios are against the first.")
@click.option("--draft-workers", type=int, help="Override the draft pool size.")
@click.option("--target-workers", type=int, help="Override the target pool size.")
@click.option("--sweep", is_flag=True, help="Also scale both pools together (draft:target ratio kept) and "
              "report capacity against worker count.")
@click.option("--sweep-workers", help="Draft pool sizes for --sweep, e.g. 1,2,4,8 (default: the scenario's [sweep]).")
@click.option("--sweep-targets", help="Target pool sizes: with it --sweep runs every draft x target pair (a grid) "
              "instead of keeping the scenario's draft:target ratio.")
@click.option("--gpus", "devices", type=int, help="Also plan N devices: pooled with every draft/target split, "
              "paired N/2 + N/2, colocated and autoregressive on all N, ranked by tokens/s.")
@click.option("--seed", type=int, help="Override the scenario's seed (acceptance draws, prompt lengths, arrivals).")
@click.option("--out", type=click.Path(), help="Write result.json and PNG plots (modes, scaling) into this folder.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"modes\": {...}, \"sweep\": [...]} as JSON.")
@click.option("--check-policy-log", type=click.Path(exists=True, dir_okay=False),
              help="Instead of simulating: replay a broker's --policy-log into the simulator's policy and "
              "say whether every decision is identical.")
def simulate(scenario, modes, draft_workers, target_workers, sweep, sweep_workers, sweep_targets, devices, seed,
             out, as_json, check_policy_log) -> None:  # noqa: ANN001
    """Simulate a deployment: the live scheduling policy on a virtual clock, with profiled or
    roofline device costs. SCENARIO is a TOML file (see configs/sim/)."""
    from dataclasses import replace

    if check_policy_log:
        from nebula_flow import policy_log

        records = policy_log.load(check_policy_log)
        report = policy_log.replay(records, policy_log.policy_of(records))
        click.echo(f"{report.events} events, {report.decisions} dispatch decisions: "
                   + ("all identical" if report.identical else f"{len(report.mismatches)} differ"))
        for m in report.mismatches[:5]:
            click.echo(f"  {m}")
        sys.exit(0 if report.identical else 1)
    if not scenario:
        raise click.UsageError("give a SCENARIO file (e.g. configs/sim/paper-2d2t.toml)")
    from nebula_flow.bench import table
    from nebula_flow.sim import engine, report
    from nebula_flow.sim.acceptance import Acceptance
    from nebula_flow.sim.scenario import describe, load_scenario

    try:
        sc = load_scenario(scenario)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if seed is not None:
        acc = sc.acceptance
        sc = replace(sc, seed=seed, acceptance=Acceptance(acc.rates, dict(acc.histogram) if acc.histogram else None, seed,
                                                         **acc.tree()))
    names = [m.strip() for m in modes.split(",")] if modes else sc.modes
    bad = [m for m in names if m not in MODES]
    if bad:
        raise click.ClickException(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    def log(m):
        return (click.echo(m, err=True))
    result: dict = {"scenario": describe(sc), "modes": {}}
    for mode in names:
        t0 = time.monotonic()
        try:
            result["modes"][mode] = engine.simulate(sc, mode, draft_workers, target_workers)
        except (ValueError, RuntimeError) as exc:
            raise click.ClickException(f"{mode}: {exc}") from None
        r = result["modes"][mode]
        log(f"[simulate] {mode}: {r['round_rate']:,.1f} rounds/s, {r['tokens_per_s']:,.1f} tokens/s "
            f"({r['requests']} requests, {time.monotonic() - t0:.1f} s of simulation)")
    base = names[0]
    result["ratios"] = {m: r["round_rate"] / result["modes"][base]["round_rate"] for m, r in result["modes"].items()}
    if sweep:
        try:
            sizes = [int(x) for x in sweep_workers.split(",")] if sweep_workers else None
            targets = [int(x) for x in sweep_targets.split(",")] if sweep_targets else None
        except ValueError:
            raise click.BadParameter("pool sizes are comma-separated integers, e.g. 1,2,4") from None
        if any(n < 1 for n in (sizes or []) + (targets or [])):
            raise click.BadParameter("pool sizes must be >= 1")
        log(f"[simulate] sweep ({names[0]}):")
        result["sweep"] = engine.sweep(sc, names[0], sizes, log=log, targets=targets)
    if devices is not None:
        if devices < 2:
            raise click.BadParameter("--gpus needs at least 2 devices")
        log(f"[simulate] plan for {devices} devices:")
        result["plan"] = engine.plan(sc, devices, log=log)
    if out:
        folder = Path(out)
        paths = report.plot(folder, result["modes"], result.get("sweep"), sc.name)
        (folder / "result.json").write_text(json.dumps(result, indent=2))
        log(f"[simulate] wrote {folder / 'result.json'} and {', '.join(p.name for p in paths)}")
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(table(result["modes"]))
    if sweep:
        click.echo(report.sweep_table(result["sweep"]))
    if devices is not None:
        click.echo(report.plan_table(result["plan"]))


@main.command("tiny-pair")
@click.argument("out", type=click.Path(), default=None, required=False)
def tiny_pair(out: str | None) -> None:
    """Build the project's tiny draft/target pair (random weights) into OUT (default: the cache)."""
    from nebula_flow.tiny import build_tiny_pair

    path = build_tiny_pair(out or cache_dir() / "tiny-pair")
    click.echo(f"wrote {path}/target and {path}/draft")


if __name__ == "__main__":
    main()
