"""Measurement commands: `bench` (modes side by side), `bench-kv` (KV movement), `replay` (a trace),
`chaos` (a fault drill)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from nebula_flow import wake_latency
from nebula_flow.cli.common import (
    IntList,
    apply_overrides,
    broker_option,
    deploy_options,
    ensure_tiny_pair,
    load_deploy,
    model_options,
    pool_settings,
    prepare_models,
    start_deployment,
    structured_option,
    with_models,
    with_settings,
)
from nebula_flow.config import DeployConfig
from nebula_flow.roles import MODES


@click.command()
@click.option("--config", type=click.Path(), help="Deployment TOML (default: the bundled one).")
@model_options
@click.option("--modes", default="pooled,paired,colocated,autoregressive", show_default=True,
              help="Comma-separated modes, measured in turn; ratios are against the first. pooled+MODEL is pooled "
              "with one more drafter (as --add-drafter MODEL, e.g. pooled+ngram), pooled-NAME pooled without the "
              "config's [[drafters]] pool of that drafter name (e.g. pooled-ngram on the bundled config): routing "
              "measured side by side. A mode may end in @KNOB=VALUE (repeatable) to set a [policy] knob for "
              "it alone, e.g. pooled@fuse_ngram=0,pooled@fuse_ngram=8; @prefix_cache=false turns its workers' "
              "prefix cache off (with --shared-prefix, pooled@prefix_cache=false@prefix_affinity=false,pooled: what "
              "it saves). The peers a user would otherwise run: hf "
              "(HF transformers' generate() of the target alone), hf-assisted (its assisted generation with the "
              "config's draft) and hf-lookup (its prompt lookup decoding), each in a process of its own with "
              "torch's default threads, requests one after another.")
@click.option("--draft-workers", type=int, help="Override M.")
@click.option("--target-workers", type=int, help="Override N.")
@click.option("--concurrency", type=click.IntRange(1), default=1, show_default=True, help="Concurrent requests (1 = single stream).")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=8, show_default=True, help="Requests per repeat.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 100), default=0.0, show_default=True, help="Sampling temperature of every request (0: greedy).")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True,
              help="Nucleus sampling with --temperature > 0: each token drawn from the fewest most likely tokens "
              "whose probability reaches this (1: the whole distribution).")
@click.option("--unseeded", is_flag=True, help="With --temperature: send sampled requests without seeds, as most API "
              "clients do (by default each carries one: the same samples in every mode). The policy plans a seeded "
              "request as on any placement, so only an unseeded one is planned by load and measured costs.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Repeats per mode; figures are medians.")
@click.option("--chat", is_flag=True, help="Send code requests in the model's chat format (how an instruct model "
              "is used) instead of raw code and prose prompts.")
@click.option("--edit", is_flag=True, help="Send chat requests to change a given function (add type hints, a "
              "docstring): answers that repeat their prompt's code, where an n-gram drafter pays (pooled+ngram).")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Structured outputs: chat requests for JSON records, each answer bound to the JSON schema in this "
              "file (e.g. configs/schemas/person.json); answers end when their JSON is complete (greedy, every mode "
              "gives the same answers).")
@click.option("--breakdown", is_flag=True, help="Also print where a decode round's time goes, per mode: forward "
              "passes, KV, worker Python, hops, broker, queue (ms per round, medians over repeats; see "
              "docs/operations.md), and the CPU time per round of the broker and of the workers. --json always "
              "carries both.")
@click.option("--via", default="zmq", show_default=True, help="Front doors to measure, comma-separated: zmq (the "
              "client library) and api (the OpenAI-compatible HTTP API, started with each deployment, streamed). "
              "Both: each repeat runs both on the same deployment, in turns; rows \"MODE via api\".")
@click.option("--predict", is_flag=True, help="With --edit: each deployment also runs every request with the code "
              "it edits as its prediction (OpenAI's Predicted Outputs), in turns with the plain requests: rows "
              "\"MODE predicted\" beside \"MODE\".")
@click.option("--shared-prefix", type=click.IntRange(min=0), default=0, show_default=True, metavar="TOKENS",
              help="Every request's prompt starts with the same ~TOKENS tokens of code (cut from the stdlib's "
              "sources): a shared system prompt or document, which the workers' prefix cache computes once; "
              "compare MODE@prefix_cache=false@prefix_affinity=false and MODE.")
@click.option("--fresh-prefix", is_flag=True, help="With --shared-prefix: each repeat's requests share a start "
              "the deployment has not seen (another stretch of code each repeat; the warm-up's its own), so the "
              "first requests of a repeat arrive together on a new document, as a burst does: what the broker's "
              "wait_for_prefix saves (compare MODE@wait_for_prefix=0 and MODE with --concurrency above 1).")
@click.option("--turns", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --chat: each request is a conversation of this many turns (its prompt, then follow-up "
              "questions), each turn sent with the turns before it, as a chat user's are: what the prefix cache and "
              "placement by prefix keep. Figures count every turn.")
@click.option("--urgent", type=click.IntRange(min=2), default=None, metavar="N",
              help="Requests 1, N+1, 2N+1, ... are urgent: sent at priority -1 where the mode schedules by priority "
              "(MODE@priority_scheduling=true), at 0 elsewhere; their latency is printed beside the others'. "
              "Compare MODE and MODE@priority_scheduling=true with --concurrency above what the workers batch.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"modes\": {mode: {...}}} as JSON.")
def bench(config, target_model, draft_model, modes, draft_workers, target_workers, concurrency, n_requests,  # noqa: ANN001
          max_new_tokens, temperature, top_p, unseeded, repeats, chat, edit, json_schema, breakdown, via, predict, shared_prefix,
          fresh_prefix, turns, urgent, as_json) -> None:  # noqa: ANN001
    """Benchmark the modes side by side on one config and workload (medians over repeats)."""
    from nebula_flow.bench import (
        DEFAULT_CHAT_PROMPTS,
        DEFAULT_EDIT_PROMPTS,
        DEFAULT_JSON_PROMPTS,
        DEFAULT_PROMPTS,
        BenchWorkload,
        bench_mode,
        bench_peer,
        breakdown_table,
        table,
        urgent_lines,
        with_context,
    )
    from nebula_flow.hf_peer import PEERS

    def loaded() -> DeployConfig:  # (the config, with the command line's models)
        return with_models(load_deploy(config), target_model, draft_model)

    names = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in names if (base := m.split("@")[0]) not in MODES and m not in PEERS
           and not base.startswith(("pooled+", "pooled-"))]
    if bad or not names:
        raise click.ClickException(f"unknown modes {bad}; choose from {', '.join((*MODES, *PEERS))} (or "
                                   "pooled+MODEL, pooled-NAME; then @KNOB=VALUE)")
    vias = tuple(v.strip() for v in via.split(",") if v.strip())
    if not vias or set(vias) - {"zmq", "api"} or len(set(vias)) < len(vias):
        raise click.BadParameter("zmq, api, or both (zmq,api)", param_hint="--via")
    if twice := sorted({m for m in names if names.count(m) > 1}):  # (results are keyed by mode)
        raise click.ClickException(f"modes given more than once: {', '.join(twice)}; a mode's runs are --repeats")
    pool = DEFAULT_JSON_PROMPTS if json_schema else DEFAULT_EDIT_PROMPTS if edit else DEFAULT_CHAT_PROMPTS if chat \
        else DEFAULT_PROMPTS
    if predict and not edit:
        raise click.BadParameter("predictions are the code each edit request changes: give --edit too",
                                 param_hint="--predict")
    if turns > 1 and (not chat or edit or json_schema or predict):
        raise click.BadParameter("conversations are chat requests: give --chat (and no --edit, --json-schema or "
                                 "--predict)", param_hint="--turns")
    if turns > 1 and (peers := [m for m in names if m in PEERS]):
        raise click.ClickException(f"{', '.join(peers)} run one prompt at a time; bench them without --turns")
    if top_p < 1 and temperature == 0:
        raise click.BadParameter("top-p samples: give a --temperature above 0 too", param_hint="--top-p")
    if unseeded and temperature == 0:
        raise click.BadParameter("seeds are for sampled requests: give a --temperature above 0 too",
                                 param_hint="--unseeded")
    if urgent is not None and (urgent > n_requests or any(m in PEERS for m in names)):
        raise click.BadParameter("urgent requests need at least N requests, and modes of ours (HF's peers run "
                                 "one request at a time)", param_hint="--urgent")
    if fresh_prefix and (not shared_prefix or len(vias) > 1 or predict or turns > 1):
        raise click.BadParameter("a new shared start each repeat needs --shared-prefix, and one run a repeat (no "
                                 "--via zmq,api, --predict or --turns)", param_hint="--fresh-prefix")
    prompts, fresh = [pool[i % len(pool)] for i in range(n_requests)], None
    if shared_prefix:
        first = loaded()
        prepare_models(first)  # (its tokenizer cuts the prefix)
        if fresh_prefix:  # (the warm-up's stretch, then one per repeat; HF's peers run the first repeat's)
            fresh = [with_context(prompts, shared_prefix, first.target.model, True, i) for i in range(repeats + 1)]
        prompts = fresh[1] if fresh else with_context(prompts, shared_prefix, first.target.model, shared=True)
    wl = BenchWorkload(prompts, max_new_tokens, concurrency, temperature, chat=chat or edit or bool(json_schema),
                       top_p=top_p, turns=turns, urgent_every=urgent or 0, fresh=fresh, seeded=not unseeded)
    if json_schema:
        if peers := [m for m in names if m in PEERS]:
            raise click.ClickException(f"{', '.join(peers)} cannot follow a JSON schema; bench them without --json-schema")
        wl.structured = structured_option(json_schema, False, None, (), None)
        wl.ignore_eos = False
    results = {}
    # (held for the whole run, HF's modes too, so every mode wakes from idle alike; each deployment
    # also holds it, as `serve` does)
    wake_us = loaded().cpu_wake_latency_us
    with wake_latency.held(wake_us) as held:
        if held:
            click.echo(f"[bench] idle CPUs held within {wake_us} us of waking (the config's cpu_wake_latency_us)", err=True)
        for name in names:
            if name in PEERS:
                cfg = loaded()
                prepare_models(cfg)
                click.echo(f"[bench] {name}: {n_requests} requests x {max_new_tokens} tokens, one after another, "
                           f"{repeats} repeat{'' if repeats == 1 else 's'}", err=True)
                try:
                    results[name] = bench_peer(cfg, name, wl, repeats, log=lambda m: click.echo(m, err=True))
                except (ValueError, RuntimeError) as exc:
                    raise click.ClickException(str(exc)) from None
                continue
            base, *settings = name.split("@")
            mode, change, spec = base.partition("+") if "+" in base else base.partition("-")
            cfg = loaded()
            settings = pool_settings(cfg, settings, name)
            cfg.broker.policy = with_settings(cfg.broker.policy, settings, name)
            if change == "-":
                from nebula_flow.routing import drafter_name

                kept = [p for p in cfg.drafters if drafter_name(p.drafter, p.model) != spec]
                if len(kept) == len(cfg.drafters):
                    raise click.ClickException(f"{name}: the config has no [[drafters]] pool named {spec!r}")
                cfg.drafters = kept
            cfg = apply_overrides(cfg, mode, draft_workers, target_workers, None, (spec,) if change == "+" else ())
            prepare_models(cfg)
            click.echo(f"[bench] {name}: {n_requests} " + (f"conversations of {turns} turns" if turns > 1 else "requests")
                       + f" x {max_new_tokens} tokens, concurrency {concurrency}, "
                       f"{repeats} repeat{'' if repeats == 1 else 's'}", err=True)
            for side, res in bench_mode(cfg, mode, wl, repeats, log=lambda m: click.echo(m, err=True), label=name,
                                        vias=vias, predict=predict).items():
                door, predicted = side.split()[0], side.endswith("predicted")
                results[(name if vias == ("zmq",) else f"{name} via {door}") + (" predicted" if predicted else "")] = res
    if as_json:
        click.echo(json.dumps({"modes": results}))
    else:
        click.echo(table(results))
        if urgent:
            click.echo(urgent_lines(results))
        if breakdown:
            click.echo(breakdown_table(results))



@click.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@broker_option
@click.option("--tokenizer", type=click.Path(), help="Tokenizer folder for traces without text (default: the "
              "target of --config, else the broker's own where its folder is on this host, else the bundled config's "
              "target).")
@click.option("--config", type=click.Path(), help="Deployment TOML whose target tokenizer to use.")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Divide arrival times by this (2 = twice as fast).")
@click.option("--limit", type=click.IntRange(1), help="Replay only the first N requests (after --start/--end).")
@click.option("--start", "start_s", default=0.0, type=click.FloatRange(0),
              help="Window start, seconds from the trace's first request.")
@click.option("--end", "end_s", type=click.FloatRange(0), help="Window end, seconds from the trace's first request.")
@click.option("--poisson", type=click.FloatRange(0, min_open=True),
              help="Replace arrivals with a Poisson process of this many requests/s.")
@click.option("--concurrency", type=click.IntRange(1), help="At most this many requests in flight.")
@click.option("--max-prompt-tokens", type=click.IntRange(1), help="Clip longer prompts (the report counts them).")
@click.option("--max-new-tokens", type=click.IntRange(1), help="Clip longer outputs (the report counts them).")
@click.option("--out", type=click.Path(), default="runs/replay", show_default=True,
              help="Folder for requests.jsonl, summary.json and PNG plots.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Seed for prompt cutting and Poisson arrivals.")
@click.option("--api", "api_url", metavar="URL", help="Send the requests through the OpenAI-compatible HTTP API at URL "
              "(e.g. http://127.0.0.1:8000) instead of the client library; --broker is still asked for the context "
              "and may be left out when the API's /v1/models says it.")
@click.option("--api-key", envvar="NEBULA_FLOW_API_KEY", help="The HTTP API's key, where it wants one.")
def replay(trace, address, tokenizer, config, time_scale, limit, start_s, end_s, poisson, concurrency,
           max_prompt_tokens, max_new_tokens, out, as_json, seed, api_url, api_key) -> None:  # noqa: ANN001
    """Replay TRACE (JSONL, Mooncake's JSONL with hash_ids, or Azure CSV) against a broker, open loop, at its
    arrival times."""
    import asyncio

    from nebula_flow.api.http_client import served_model
    from nebula_flow.client import Client, NebulaError
    from nebula_flow.replay import replay as run_replay
    from nebula_flow.replay import summarize, write_outputs
    from nebula_flow.traces import PromptSource, Shaping, TraceError, load_trace, shape

    try:
        loaded = load_trace(trace)  # (a trace that cannot be replayed says so before any server is asked)
        served = served_model(api_url, api_key) if api_url else {}
        # (the broker's tokenizer folder: a trace without text is made into prompts of its token ids)
        context, served_tokenizer = served.get("max_model_len"), served.get("root")
        if context is None:
            with Client(address, timeout_s=5) as c:
                state = c.status()
            context, served_tokenizer = state.get("max_model_len", 1 << 30), state.get("tokenizer")
        reqs, report = shape(loaded, Shaping(time_scale, limit, start_s, end_s, poisson, max_prompt_tokens,
                                             max_new_tokens, seed), context)
    except (TraceError, NebulaError) as exc:
        raise click.ClickException(str(exc)) from None
    prompts = None
    if any(r.prompt_len is not None for r in reqs):
        tok_dir = tokenizer or (load_deploy(config).target.model if config else None)
        if tok_dir is None and isinstance(served_tokenizer, str) and Path(served_tokenizer).is_dir():
            tok_dir = served_tokenizer
        elif tok_dir is None:  # (the broker's folder is not on this host, or the API hides it)
            tok_dir = load_deploy(None).target.model
            click.echo(f"note: the trace holds no text; its prompts are made with the bundled config's target's "
                       f"tokenizer ({tok_dir}): give --tokenizer or --config where the server runs another model",
                       err=True)
        prompts = PromptSource(tok_dir, seed)
    click.echo(f"replaying {len(reqs)} requests over {reqs[-1].arrival_s if reqs else 0:.1f} s "
               f"(time scale {time_scale}); clipped prompts {report['clipped_prompts']}, "
               f"clipped outputs {report['clipped_outputs']}", err=True)
    records, wall = asyncio.run(run_replay(address, reqs, prompts, concurrency, progress=not as_json, api=api_url,
                                           api_key=api_key))
    summary = summarize(records, wall, report)
    paths = write_outputs(Path(out), records, summary)
    if as_json:
        click.echo(json.dumps(summary))
        return
    click.echo(f"{summary['completed']}/{summary['requests']} completed, {summary['errors']} errors in {wall:.1f} s")
    click.echo(f"throughput {summary['tokens_per_s']:.1f} tokens/s, {summary['requests_per_s']:.2f} requests/s, "
               f"{summary['round_rate']:.1f} rounds/s, {summary['tokens_per_round']:.2f} tokens/round, "
               f"prompt tokens cached {summary['prompt_cached'] * 100:.0f}%")
    for key in ("ttft_s", "inter_chunk_s", "latency_s"):
        p = summary[key]
        click.echo(f"{key:<14} p50 {p['p50']:.3f}  p90 {p['p90']:.3f}  p99 {p['p99']:.3f}")
    for priority, g in summary.get("by_priority", {}).items():  # (a trace of several priorities)
        click.echo(f"priority {priority:>4}: {g['completed']} completed, TTFT p50 {g['ttft_s']['p50']:.3f}, "
                   f"latency p50 {g['latency_s']['p50']:.3f}  p90 {g['latency_s']['p90']:.3f}")
    click.echo(f"wrote {out}/requests.jsonl, summary.json, " + ", ".join(p.name for p in paths))



@click.command("bench-broker")
@click.option("--modes", default="pooled,colocated", show_default=True, help="Broker modes, comma-separated "
              "(pooled, paired, colocated, elastic, autoregressive).")
@click.option("--workers", type=click.IntRange(1), default=4, show_default=True, help="Zero-cost workers per stage (pooled/paired: this many "
              "draft and this many target workers; elastic: this many elastic workers, each taking either stage).")
@click.option("--max-batch", type=click.IntRange(1), default=32, show_default=True, help="Each worker's batch capacity.")
@click.option("--concurrency", type=click.IntRange(1), default=64, show_default=True, help="Requests in flight.")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=256, show_default=True, help="Requests in all.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--k", type=click.IntRange(0), default=4, show_default=True, help="Draft tokens per round (fixed: no adaptive k).")
@click.option("--model", type=click.Path(), help="The target whose tokenizer the broker loads (default: the tiny "
              "pair's, built into the cache if missing).")
@click.option("--prompt-tokens", default=5, show_default=True, type=click.IntRange(1),
              help="Each request's prompt length: a task carries what its worker lacks of the request's tokens, "
              "so this shows what long contexts cost the broker (the tiny pair holds 1,024 tokens; give --model a "
              "longer-context target for more).")
@click.option("--full-tokens", is_flag=True, help="The broker sends every task its request's whole tokens, as before "
              "protocol version 6 (the broker's --full-tokens): to measure what sending only the new ones saves.")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False), help="Also run each broker under "
              "cProfile: write MODE.prof here and print its hottest functions.")
@click.option("--shards", "shard_counts", type=IntList(), default="1", show_default=True,
              help="Measure with this many brokers sharing the requests (comma-separated counts: each is a run of "
              "its own); with several shards the zero-cost workers serve them all and each shard's CPU per "
              "request-round of its own requests is printed too.")
@click.option("--scale-load", is_flag=True, help="With several shards, multiply --concurrency and --requests by the "
              "shard count, so each shard carries the load one broker does (a broker's CPU per round grows as its "
              "load falls: fewer messages per wake-up).")
@click.option("--api", is_flag=True, help="Send the requests through the HTTP API (a gateway, `nebula-flow api`, in "
              "front of the brokers, streamed) and also print the gateway's CPU time per token it streamed.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"modes\": {mode: {...}}, \"shards\": {count: {...}}} "
              "as JSON (modes: at the first shard count; shards: the first mode at each count).")
def bench_broker_cmd(modes, workers, max_batch, concurrency, n_requests, max_new_tokens, k, model, prompt_tokens,
                     full_tokens, profile_dir, shard_counts, scale_load, api, as_json) -> None:  # noqa: ANN001
    """Measure the broker alone: a real broker under zero-cost workers (forwards of 0 s, all in one
    light process) and clients; request-rounds/s, tasks/s and the broker's CPU time per
    request-round (its own user + system seconds over the rounds it ended: the figure that holds on
    bigger hosts, where a 2-core machine's wall clock does not)."""
    from nebula_flow.bench_broker import bench_broker, profile_table

    names = [m.strip() for m in modes.split(",") if m.strip()]
    if bad := [m for m in names if m not in MODES]:
        raise click.BadParameter(f"unknown modes {bad}", param_hint="--modes")
    counts = list(shard_counts)
    if model is None:
        model = str(ensure_tiny_pair() / "target")
    results: dict[tuple[str, int], dict] = {}
    for mode in names:
        for shards in counts:
            scale = shards if scale_load else 1
            click.echo(f"[bench-broker] {mode}, {shards} shard(s): {workers} zero-cost workers per stage, "
                       f"{n_requests * scale} requests of {prompt_tokens} + {max_new_tokens} tokens, "
                       f"{concurrency * scale} in flight, k = {k}" + (", whole tokens in every task" if full_tokens else ""),
                       err=True)
            prof = Path(profile_dir) / (f"{mode}.prof" if shards == 1 else f"{mode}-{shards}-shards.prof") \
                if profile_dir else None
            if prof is not None:
                prof.parent.mkdir(parents=True, exist_ok=True)
            try:
                results[mode, shards] = bench_broker(mode, model, workers, max_batch, concurrency * scale,
                                                     n_requests * scale, max_new_tokens, k, prof,
                                                     log=lambda m: click.echo(m, err=True), shards=shards, api=api,
                                                     prompt_tokens=prompt_tokens, full_tokens=full_tokens)
            except (RuntimeError, ValueError) as exc:
                raise click.ClickException(str(exc)) from None
            if prof is not None and not as_json:
                click.echo(profile_table(prof))
    if as_json:
        click.echo(json.dumps({"modes": {m: results[m, counts[0]] for m in names},
                               "shards": {str(n): results[names[0], n] for n in counts}}))
        return
    click.echo(f"{'mode':<16}{'shards':>7}{'rounds/s':>10}{'tasks/s':>10}{'broker CPU us/round':>22}"
               f"{'worst shard':>13}{'tokens/round':>14}" + (f"{'gateway CPU us/token':>22}" if api else ""))
    for (mode, shards), r in results.items():
        click.echo(f"{mode:<16}{shards:>7}{r['round_rate']:>10.0f}{r['tasks_per_s']:>10.0f}"
                   f"{r['broker_cpu_us_per_round']:>22.1f}{max(r['shard_cpu_us_per_round']):>13.1f}"
                   f"{r['tokens_per_round']:>14.2f}" + (f"{r['gateway_cpu_us_per_token']:>22.1f}" if api else ""))


@click.command("bench-kv")
@click.option("--config", type=click.Path(), help="Deployment TOML (default: the bundled one).")
@click.option("--transport", type=click.Choice(["auto", "ucx", "zmq", "shm", "shm+zmq"]), default="auto",
              show_default=True, help="KV transport to measure (auto: what the workers' auto picks).")
@click.option("--draft-workers", default=2, show_default=True)
@click.option("--target-workers", default=2, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=4, show_default=True)
@click.option("--requests", "n_requests", type=click.IntRange(1), default=8, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(1), default=48, show_default=True)
@click.option("--context-tokens", default=0, show_default=True, type=click.IntRange(0),
              help="Put about this many tokens of code (stdlib sources) before each prompt: long prompts, "
                   "whose KV moves in large pulls (code completion with a file open).")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1),
              help="Runs of each mode, in alternating order (A B B A ...); medians are reported.")
@click.option("--idle-probe-s", default=8.0, show_default=True, type=click.FloatRange(0.5),
              help="Seconds of paced raw pulls on the idle machine after the runs (the idle baseline).")
@click.option("--json", "as_json", is_flag=True)
def bench_kv_cmd(config, transport, draft_workers, target_workers, concurrency, n_requests, max_new_tokens,
                 context_tokens, repeats, idle_probe_s, as_json) -> None:  # noqa: ANN001
    """KV movement cost in a pooled run with forced migration: stall as a fraction of compute,
    with and without overlap, and in-system bandwidth against the raw transport."""
    from nebula_flow.bench import DEFAULT_PROMPTS, BenchWorkload, with_context
    from nebula_flow.bench_kv import bench_kv, kv_report

    cfg = apply_overrides(load_deploy(config), "pooled", draft_workers, target_workers, None)
    from nebula_flow.kv.transport import resolve_transport

    transport = resolve_transport(transport, cfg.target.device)  # what the workers' auto picks
    prepare_models(cfg)
    prompts = with_context([DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(n_requests)], context_tokens,
                           cfg.target.model)
    wl = BenchWorkload(prompts, max_new_tokens, concurrency)
    res = bench_kv(cfg, wl, transport, log=lambda m: click.echo(m, err=True), repeats=repeats,
                   idle_probe_s=idle_probe_s)
    click.echo(json.dumps(res) if as_json else kv_report(res))



@click.command()
@deploy_options
@click.option("--requests", "n_requests", type=click.IntRange(1), default=16, show_default=True,
              help="Concurrent greedy requests.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--kill", "kills", multiple=True, metavar="NAME[@SECONDS]",
              help="SIGKILL this process (broker, draft-0, target-3, ...; `status` and the log folder name them) "
              "SECONDS after the first streamed token (default 0). Repeatable. Default: the last draft worker at "
              "0 s and the last target worker at 3 s (no draft-only workers: the last two workers).")
@click.option("--chat", is_flag=True, help="Send the prompts in the model's chat format.")
@click.option("--no-reference", is_flag=True, help="Skip the reference run (the same prompts on the target "
              "alone, autoregressive mode) that the output is compared with.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def chaos(config, mode, draft_workers, target_workers, port, log_dir, target_model, draft_model, add_drafters,  # noqa: ANN001
          settings, n_requests, max_new_tokens, kills, chat, no_reference, as_json) -> None:  # noqa: ANN001
    """Fault drill: a supervised deployment (as `serve` runs it) under load, processes killed on a
    schedule; prints what completed, how soon each killed process served again, and whether the
    output equals the target alone's."""
    from nebula_flow.bench import DEFAULT_CHAT_PROMPTS, DEFAULT_PROMPTS
    from nebula_flow.chaos import Kill, default_kills, drill
    from nebula_flow.deploy import Deployment, worker_name

    pool = DEFAULT_CHAT_PROMPTS if chat else DEFAULT_PROMPTS
    prompts = [pool[i % len(pool)] for i in range(n_requests)]
    models = {"target": target_model, "draft": draft_model}
    plan = apply_overrides(load_deploy(config), mode, draft_workers, target_workers, port, add_drafters,
                           **models).worker_plan()
    names = ["broker", *(worker_name(role, i) for i, (role, _) in enumerate(plan))]
    try:
        schedule = [Kill.parse(k) for k in kills] or default_kills(names)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kill") from None
    if unknown := [k.name for k in schedule if k.name not in names]:
        raise click.BadParameter(f"no process {unknown}; this deployment has {', '.join(names)}", param_hint="--kill")
    dep = start_deployment(config, mode, draft_workers, target_workers, 0 if port is None else port, log_dir,
                           add_drafters, settings, **models)
    try:
        report = drill(dep, prompts, max_new_tokens, schedule, chat, log=lambda m: click.echo(m, err=True))
    finally:
        dep.stop()
    if not no_reference:
        cfg = apply_overrides(load_deploy(config), "autoregressive", 0, 1, 0, **models)
        prepare_models(cfg)  # (a hub id found in the hub cache, as for the drill)
        click.echo("[chaos] reference: the same prompts on the target alone (autoregressive)", err=True)
        with Deployment(cfg) as ref_dep:
            ref = drill(ref_dep, prompts, max_new_tokens, [], chat, log=lambda m: click.echo(m, err=True))
        report["equal_to_target_alone"] = sum(a == b for a, b in zip(report["token_ids"], ref["token_ids"]))
    report.pop("token_ids")
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"completed {report['completed']} of {report['requests']} in {report['wall_s']:.1f} s"
               + (f"; equal to the target alone: {report['equal_to_target_alone']} of {report['requests']}"
                  if "equal_to_target_alone" in report else ""))
    for k in report["kills"]:
        back = "not back" if k["recovered_s"] is None else f"serving again {k['recovered_s']:.1f} s later"
        late = "" if k["during_load"] else (" (after the requests had ended: no request saw it; more --requests or "
                                             "--max-new-tokens make a load that outlasts the kills)")
        since = f", {k['tasks_since']} tasks since" if k.get("tasks_since") is not None else ""
        click.echo(f"  killed {k['name']} at {k['at_s']:.1f} s: {back}{since}{late}")
    click.echo(f"restarts {report['restarts']}, counters {report['counters']}")
    for failure in report["failures"]:
        click.echo(f"  failed: {failure}")


COMMANDS = [bench, bench_broker_cmd, bench_kv_cmd, replay, chaos]
