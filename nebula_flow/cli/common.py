"""What the command-line modules share: loading a deployment config, applying overrides and
policy settings, starting a deployment, and the option sets several commands take."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from nebula_flow.config import ConfigError, DeployConfig, PoolConfig, cache_dir, load_config, set_model
from nebula_flow.policy import PolicyConfig, PolicyError, knob_help, knob_names
from nebula_flow.roles import MODES

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "default.toml"
DEFAULT_BROKER = "tcp://127.0.0.1:5555"
CONNECT_WAIT_S = 10.0  # `generate`: how long the connection to the broker may take before it says none answers


def checked_addresses(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A ``--broker`` value as given, once each comma-separated address is one ZeroMQ connects to."""
    from nebula_flow.shards import addresses

    try:
        addresses(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


broker_option = click.option(
    "--broker", "address", default=DEFAULT_BROKER, show_default=True, callback=checked_addresses,
    help="The broker's client address (a sharded deployment's: every shard's, comma-separated, as `serve` prints it).")


def load_deploy(config: str | None) -> DeployConfig:
    try:
        return load_config(config or DEFAULT_CONFIG)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def prepare_models(cfg: DeployConfig) -> None:
    """Find hub ids in the hub cache (or download them), build project-made models the config
    names but the cache lacks (the bundled target, the tiny pair), then check that the draft can
    serve the target."""
    from nebula_flow import hub
    from nebula_flow.bundled import prepare_target, target_dir
    from nebula_flow.lookup import is_ngram
    from nebula_flow.models.compat import IncompatiblePair, check_pair
    from nebula_flow.models.config import ModelConfigError

    tiny = cache_dir() / "tiny-pair"
    drafts = [p for p in (cfg.draft, *cfg.drafters) if p.model and not is_ngram(p.model)]
    for pool in (*drafts, cfg.target):
        if not pool.model:
            continue
        if hub.is_hub_id(pool.model):
            try:
                pool.model = hub.resolve(pool.model, log=lambda m: click.echo(m, err=True))
            except hub.HubError as exc:
                raise click.ClickException(str(exc)) from None
        if Path(pool.model).is_relative_to(tiny):
            ensure_tiny_pair()
        if Path(pool.model) == target_dir():
            prepare_target(log=lambda m: click.echo(m, err=True))
    for role, pool in (("target", cfg.target), *(("draft", p) for p in drafts if cfg.mode != "autoregressive")):
        if pool.model and not Path(pool.model).is_dir():
            raise click.ClickException(f"{role} model {pool.model}: no such folder (give a checkpoint folder, a hub id "
                                       "such as Qwen/Qwen3-8B, or cache:NAME)")
    for pool in drafts if cfg.mode != "autoregressive" else ():
        try:
            check_pair(pool.model, cfg.target.model)
        except (IncompatiblePair, ModelConfigError) as exc:
            raise click.ClickException(f"draft {pool.model} cannot serve target {cfg.target.model}: {exc} (name a "
                                       "draft of the target's tokenizer: [draft] model or --draft, ngram for prompt "
                                       "lookup, or run --mode autoregressive)") from None


def ensure_tiny_pair() -> Path:
    """The project's tiny pair in the cache, built there (with a progress line) if missing."""
    tiny = cache_dir() / "tiny-pair"
    if not (tiny / "READY").exists():
        from nebula_flow.tiny import build_tiny_pair

        click.echo(f"building the tiny model pair in {tiny} ...", err=True)
        build_tiny_pair(tiny)
    return tiny


def with_models(cfg: DeployConfig, target: str | None, draft: str | None) -> DeployConfig:
    """``cfg`` with the command line's ``--target`` and ``--draft`` models, where given."""
    for pool, spec in ((cfg.target, target), (cfg.draft, draft)):
        if spec is not None:
            set_model(pool, spec)
    return cfg


MODEL_OPTIONS = [
    click.option("--target", "target_model", metavar="MODEL",
                 help="The target model, in place of the config's [target] model: a checkpoint folder, a hub id "
                 "(Qwen/Qwen3-8B: found in the hub cache, or downloaded), or cache:NAME; clients call it by this "
                 "name (the HTTP API's /v1/models) unless --served-model-name says otherwise."),
    click.option("--draft", "draft_model", metavar="MODEL",
                 help="The draft model, in place of the config's [draft] model: as --target, or ngram (prompt "
                 "lookup, no model). It must share the target's tokenizer (checked at start)."),
]


def apply_overrides(cfg: DeployConfig, mode: str | None, draft_workers: int | None,
                    target_workers: int | None, port: int | None, add_drafters: tuple[str, ...] = (),
                    settings: tuple[str, ...] = (), *, target: str | None = None,
                    draft: str | None = None) -> DeployConfig:
    """The command line's changes to a deployment config (``settings``: ``KNOB=VALUE`` policy knobs;
    ``target``, ``draft``: the models, in place of the config's)."""
    if mode:
        cfg.mode = mode
    with_models(cfg, target, draft)
    for spec in add_drafters:  # one more draft pool (one worker) per spec: several drafters, routed
        cfg.drafters.append(PoolConfig(model=spec, workers=1, max_batch=cfg.draft.max_batch, dtype=cfg.draft.dtype,
                                       device=cfg.draft.device))
    if draft_workers is not None:  # (0 is an answer: no draft workers, for the target-only modes)
        cfg.draft.workers = draft_workers
    if target_workers is not None:
        cfg.target.workers = target_workers
    if port is not None:
        cfg.broker.client_port, cfg.broker.worker_port = port, (port + 1 if port else 0)
    cfg.broker.policy = with_settings(cfg.broker.policy, settings)
    try:
        cfg.validate()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return cfg


POOL_KNOBS = ("prefix_cache",)  # a bench mode's @KNOB=VALUE that sets its worker pools', not a [policy] knob


def split_pool_settings(settings: list[str], where: str) -> tuple[dict[str, bool], list[str]]:
    """The ``KNOB=VALUE`` settings that name a worker pool's switch (``POOL_KNOBS``: true or false,
    as a policy knob's), and the others (policy knobs)."""
    switches, rest = {}, []
    for setting in settings:
        key, _, value = (part.strip() for part in setting.partition("="))
        if key not in POOL_KNOBS:
            rest.append(setting)
        elif value not in ("true", "false"):
            raise click.BadParameter(f"{key} must be true or false, got {value!r}", param_hint=where)
        else:
            switches[key] = value == "true"
    return switches, rest


def pool_settings(cfg: DeployConfig, settings: list[str], where: str) -> list[str]:
    """Apply the pool switches among ``settings`` (``split_pool_settings``) to every pool of ``cfg``;
    returns the others (policy knobs)."""
    switches, rest = split_pool_settings(settings, where)
    for key, on in switches.items():
        for pool in (cfg.draft, cfg.target, *cfg.drafters):
            setattr(pool, key, on)
    return rest


def with_settings(policy: PolicyConfig, settings: tuple[str, ...] | list[str], where: str = "--set") -> PolicyConfig:
    """``policy`` with each ``KNOB=VALUE`` applied (``--set``, a bench mode's ``@KNOB=VALUE``)."""
    for setting in settings:
        try:
            policy = policy.with_setting(setting)
        except PolicyError as exc:
            raise click.BadParameter(str(exc), param_hint=where) from None
    return policy


def set_option(f: Callable) -> Callable:
    return click.option("--set", "settings", multiple=True, metavar="KNOB=VALUE",
                        help="Set a scheduling-policy knob (repeatable), e.g. --set fuse_ngram=0; the knobs, "
                        "their meaning and defaults: `nebula-flow broker --help`.")(f)


def policy_options(f: Callable) -> Callable:
    """One ``--KNOB`` option per ``PolicyConfig`` field (help and default from the field), plus
    ``--set``; the command gets ``policy`` (a ``PolicyConfig``) in their place."""
    defaults = PolicyConfig()

    @functools.wraps(f)
    def build(**kw: Any) -> Any:  # noqa: ANN401
        given = {n: v for n in knob_names() if (v := kw.pop(n)) is not None}
        if "spec_costs" in given:
            try:
                given["spec_costs"] = tuple(float(c) for c in given["spec_costs"].split(","))
            except ValueError:
                raise click.BadParameter("three numbers: DRAFT,ROW,ROUND", param_hint="--spec-costs") from None
        try:
            policy = PolicyConfig(**given)
        except PolicyError as exc:
            raise click.UsageError(str(exc)) from None
        return f(policy=with_settings(policy, kw.pop("settings")), **kw)

    for fd in reversed(dataclasses.fields(PolicyConfig)):
        flag, value = fd.name.replace("_", "-"), getattr(defaults, fd.name)
        text = knob_help(fd.name)
        if isinstance(value, bool):
            decl = click.option(f"--{flag}/--no-{flag}", fd.name, default=None, help=f"{text} [default: {value}]")
        elif isinstance(value, tuple):
            decl = click.option(f"--{flag}", fd.name, default=None, metavar="A,B,C",
                                help=f"{text} [default: {','.join(map(str, value))}]")
        else:
            decl = click.option(f"--{flag}", fd.name, type=type(value), default=None, help=f"{text} [default: {value}]")
        build = decl(build)
    return set_option(build)


DEPLOY_OPTIONS = [
    click.option("--config", type=click.Path(), help=f"Deployment TOML (default {DEFAULT_CONFIG.relative_to(REPO)})."),
    click.option("--mode", type=click.Choice(list(MODES)), help="Override the config's mode."),
    click.option("--draft-workers", type=int, help="Override the number of draft workers (M)."),
    click.option("--target-workers", type=int, help="Override the number of target workers (N)."),
    click.option("--port", type=click.IntRange(0, 65535), help="Client port (workers use port+1); 0 picks free ports."),
    click.option("--log-dir", type=click.Path(), help="Where child process logs go (default: a temp folder)."),
    *MODEL_OPTIONS,
    click.option("--add-drafter", "add_drafters", multiple=True, metavar="MODEL",
                 help="Pooled mode: one more draft worker with this drafter (ngram, ngram:MAX, ngram:MIN-MAX, or a "
                 "draft checkpoint); each round goes to the drafter that pays best for its request. Repeatable."),
]


def model_options(f: Callable) -> Callable:
    """``--target`` and ``--draft``: the models, in place of the config's (``with_models``)."""
    for opt in reversed(MODEL_OPTIONS):
        f = opt(f)
    return f


def deploy_options(f: Callable) -> Callable:
    for opt in reversed(DEPLOY_OPTIONS):
        f = opt(f)
    return set_option(f)


def start_deployment(config: str | None, mode: str | None, draft_workers: int | None, target_workers: int | None,
                     port: int | None, log_dir: str | None, add_drafters: tuple[str, ...] = (),
                     settings: tuple[str, ...] = (), secure_local: bool = False, shards: int | None = None,
                     max_model_len: int | None = None, *, target: str | None = None,
                     draft: str | None = None):  # noqa: ANN201
    """Start the deployment ``deploy_options`` describe, printing progress; returns it running.
    ``secure_local``: CURVE keys on loopback too (a private key folder in the log folder unless
    the config names one), for hosts whose other users must not reach the deployment. ``shards``:
    brokers sharing the requests (the config's ``[broker] shards`` otherwise); ``max_model_len``:
    the context served (the config's ``[broker] max_model_len`` otherwise)."""
    from nebula_flow.deploy import Deployment, DeploymentError
    from nebula_flow.security import generate_keys

    cfg = load_deploy(config)
    if shards is not None:
        cfg.broker.shards = shards
    if max_model_len is not None:
        cfg.broker.max_model_len = max_model_len
    cfg = apply_overrides(cfg, mode, draft_workers, target_workers, port, add_drafters, settings, target=target,
                          draft=draft)
    prepare_models(cfg)
    try:
        dep = Deployment(cfg, log_dir)
    except DeploymentError as exc:
        raise click.ClickException(str(exc)) from None
    if secure_local and not cfg.broker.keys:
        cfg.broker.keys = str(generate_keys(dep.log_dir / "keys"))
    if cfg.broker.keys:
        click.echo(f"CURVE keys in {cfg.broker.keys}: clients need NEBULA_FLOW_KEYS={cfg.broker.keys} "
                   "(and their key: `nebula-flow keys DIR add-client NAME`, NEBULA_FLOW_CLIENT_KEY=NAME)", err=True)
    plan = cfg.worker_plan()
    brokers = "broker" if cfg.broker.shards == 1 else f"{cfg.broker.shards} brokers (shards)"
    click.echo(f"starting {cfg.mode}: {brokers} + {len(plan)} workers "
               f"({', '.join(sorted({r for r, _ in plan}))}); logs in {dep.log_dir}", err=True)
    t0 = time.monotonic()
    try:
        dep.start()
    except DeploymentError as exc:
        dep.stop()
        raise click.ClickException(str(exc)) from None
    click.echo(f"ready in {time.monotonic() - t0:.1f} s", err=True)
    if dep.wake_fd is not None:
        click.echo(f"idle CPUs held within {cfg.cpu_wake_latency_us} us of waking (cpu_wake_latency_us)", err=True)
    return dep


def print_completion(out, as_json: bool) -> None:  # noqa: ANN001
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
    if out.stats.get("cached_tokens"):  # the prefix cache: prompt positions copied from earlier requests' KV
        click.echo(f"[prefix cache: {out.stats['cached_tokens']} of the prompt's {out.stats['prompt_tokens']} "
                   "tokens]", err=True)
    if "prediction_tokens" in out.stats:  # Predicted Outputs: how much of the prediction the output holds
        click.echo(f"[prediction: {out.stats['prediction_accepted']} of its {out.stats['prediction_tokens']} tokens "
                   "in the output]", err=True)
    for name, entries in (("prompt", (out.prompt_logprobs or [])[1:]), ("output", out.logprobs or ())):
        if out.prompt_logprobs is not None and entries:
            click.echo(f"[{name} logprobs]", err=True)
        for _, text, logprob, top, *rank in entries:  # (a prompt token's entry ends with its rank)
            click.echo(f"  {text!r:>16} {logprob:9.4f}" + (f"  rank {rank[0]}" if rank else "")
                       + ("   top: " + ", ".join(f"{t!r} {v:.4f}" for _, t, v in top) if top else ""), err=True)


def structured_option(json_schema: str | None, json_object: bool, regex: str | None, choice: tuple[str, ...],
                      grammar: str | None) -> dict | None:
    """The ``structured`` parameter the CLI's structured-output options ask for (at most one)."""
    given = {k: v for k, v in (("json", json_schema), ("json_object", json_object or None), ("regex", regex),
                               ("choice", list(choice) or None), ("grammar", grammar)) if v is not None}
    if len(given) > 1:
        raise click.UsageError("use one of --json-schema, --json-object, --regex, --choice and --grammar")
    for kind in ("json", "grammar"):  # (files, read here: a worker never reads the caller's files)
        if kind in given:
            try:
                text = Path(given[kind]).read_text()
                given[kind] = json.loads(text) if kind == "json" else text
            except (OSError, ValueError) as exc:
                raise click.BadParameter(str(exc), param_hint=f"--{'json-schema' if kind == 'json' else kind}") from None
    return given or None


def generate_from(address: str, prompt: str, as_json: bool, **params) -> None:  # noqa: ANN003
    from nebula_flow.client import Client, Completion, NebulaError, build_submit

    spec = structured_option(*(params.pop(k) for k in ("json_schema", "json_object", "regex", "choice", "grammar")))
    if spec is not None:
        params["structured"] = spec
    if params.pop("think_first", False):
        if spec is None:
            raise click.UsageError("--think-first goes with a structured output (--json-schema, --regex, ...)")
        params["think_first"] = True
    if bias := params.pop("logit_bias", ()):
        params["logit_bias"] = dict(bias)
    params["allowed_token_ids"] = params.pop("allowed_token_ids", ()) or None
    try:
        timeout_s = params.pop("timeout_s")
        checked = dict(params)  # (parameters the broker would refuse: said before any broker is asked;
        build_submit("", prompt, None, checked.pop("chat", False), compile_grammar=False, **checked)  # compiled once)
        with Client(address, timeout_s=timeout_s) as client:
            client.wait_connected(min(CONNECT_WAIT_S, client.timeout_s))
            for item in client.stream(prompt, **params):
                if isinstance(item, Completion):
                    print_completion(item, as_json)
                elif not as_json:
                    click.echo(item.text, nl=False)
    except (NebulaError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


class TokenBias(click.ParamType):
    """``ID=BIAS``: a token id and the number added to its logit."""

    name = "ID=BIAS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, float]:  # noqa: ANN401
        if isinstance(value, tuple):
            return value
        token, _, bias = str(value).partition("=")
        try:
            return int(token), float(bias)
        except ValueError:
            self.fail(f"{value!r} is not ID=BIAS (e.g. 198=-100)", param, ctx)


TOKEN_BIAS = TokenBias()


class IntList(click.ParamType):
    """Comma-separated integers, each at least ``minimum`` (e.g. ``1,2,4``): a tuple, in order."""

    name = "N[,N...]"

    def __init__(self, minimum: int = 1) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:  # noqa: ANN401
        if isinstance(value, tuple):
            return value
        try:
            numbers = tuple(int(x) for x in str(value).split(","))
        except ValueError:
            numbers = ()
        if not numbers or min(numbers) < self.minimum:
            self.fail(f"{value!r} is not comma-separated integers >= {self.minimum} (e.g. 1,2,4)", param, ctx)
        return numbers

GEN_OPTIONS = [
    click.option("--max-new-tokens", type=click.IntRange(1), default=64, show_default=True),
    click.option("--temperature", type=click.FloatRange(0, 100), default=0.0, show_default=True, help="0 = greedy."),
    click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 = off."),
    click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True),
    click.option("--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                 help="vLLM's: drop tokens less likely than this times the most likely one (0 = off)."),
    click.option("--seed", type=click.IntRange(0, (1 << 63) - 1), help="Fixes the output for sampled generation."),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--stop-token-id", "stop_token_ids", type=click.IntRange(0), multiple=True,
                 help="End the output at this token id, kept among the ids but not in the text (repeatable)."),
    click.option("--logprobs", type=click.IntRange(0, 20), default=None,
                 help="Report each output token's log-probability (the target's own) and this many most likely "
                      "tokens beside it: a line per token after the text, or \"logprobs\" in --json."),
    click.option("--prompt-logprobs", type=click.IntRange(0, 20), default=None,
                 help="The same for each prompt token after the first (vLLM's prompt_logprobs): lines before the "
                      "output's, or \"prompt_logprobs\" in --json. Such a request computes its whole prompt (it "
                      "does not read the prefix cache)."),
    click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
                 help="OpenAI's: lowers the logit of each token the output already holds."),
    click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
                 help="OpenAI's: lowers a token's logit by this much per time the output holds it."),
    click.option("--repetition-penalty", type=click.FloatRange(0, 10, min_open=True), default=1.0, show_default=True,
                 help="HF's and vLLM's: divides (multiplies, if negative) the logits of tokens in the prompt or output."),
    click.option("--min-tokens", type=click.IntRange(0), default=0, show_default=True,
                 help="No EOS, stop token id or stop string ends the output before it has this many tokens."),
    click.option("--logit-bias", type=TOKEN_BIAS, multiple=True, metavar="ID=BIAS",
                 help="Add BIAS (-100 to 100) to token ID's logit (repeatable); -100 all but bans it."),
    click.option("--json-schema", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="The output is JSON that follows the JSON schema in this file (written compactly)."),
    click.option("--json-object", is_flag=True, help="The output is a JSON object (any)."),
    click.option("--regex", default=None, help="The output matches this regular expression (Rust regex syntax)."),
    click.option("--choice", multiple=True, help="The output is one of these strings (repeatable)."),
    click.option("--grammar", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="The output follows the Lark grammar in this file (llguidance's Lark)."),
    click.option("--think-first", is_flag=True, help="A reasoning model thinks freely first: the structured output "
                 "binds only what follows its </think> (or all of it where the prompt closed the thinking)."),
    click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template."),
    click.option("--priority", type=int, default=0, show_default=True, help="Lower goes first where the broker "
                 "schedules by priority ([policy] priority_scheduling); elsewhere only 0 is taken."),
    click.option("--cache-salt", default=None, help="Share prefix-cached KV only with requests of this salt "
                 "(vLLM's cache_salt; none: with requests that give none)."),
    click.option("--include-stop-str-in-output", is_flag=True,
                 help="vLLM's: the text keeps the stop string (or stop token) that ended it."),
    click.option("--keep-special-tokens", "skip_special_tokens", flag_value=False, default=True,
                 help="vLLM's skip_special_tokens false: special tokens' text stays in the output."),
    click.option("--allowed-token-id", "allowed_token_ids", type=click.IntRange(0), multiple=True,
                 help="vLLM's allowed_token_ids: only these ids may be picked (repeatable)."),
    click.option("--bad-word", "bad_words", multiple=True,
                 help="vLLM's bad_words: a word the output may not write (repeatable)."),
    click.option("--truncate-prompt-tokens", type=click.IntRange(1), default=None,
                 help="vLLM's: only the prompt's last this many tokens run."),
    click.option("--timeout-s", type=click.FloatRange(0, min_open=True), default=300.0, show_default=True),
]


def gen_options(f: Callable) -> Callable:
    for opt in reversed(GEN_OPTIONS):
        f = opt(f)
    return f

