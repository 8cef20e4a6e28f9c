"""Serving commands: start a deployment (`serve`, `run`), talk to one (`generate`, `status`)."""

from __future__ import annotations

import json
import signal
import threading

import click

from nebula_flow.cli.api import check_exposure, check_port_free, curl_line, http_options
from nebula_flow.cli.common import (
    broker_option,
    deploy_options,
    gen_options,
    generate_from,
    start_deployment,
)
from nebula_flow.cli.status_text import status_lines


@click.command()
@deploy_options
@click.option("--secure-local", is_flag=True,
              help="CURVE keys on loopback too (made in the log folder unless the config's [broker] keys names "
              "a folder): without it every local user can reach the broker and the workers' KV (docs/security.md).")
@click.option("--shards", type=click.IntRange(min=1),
              help="Brokers sharing the requests, each owning a slice by request id (for more request-rounds per "
              "second than one broker's core gives); shard i binds port+2i and port+2i+1, and the address printed "
              "lists them all, comma-separated. [default: the config's [broker] shards, 1]")
@click.option("--max-model-len", type=click.IntRange(min=2), help="The context served, prompt and output (vLLM's): "
              "longer requests are refused (400 over HTTP), which bounds a request's KV; at most the target's own. "
              "[default: the config's [broker] max_model_len, else the target's max_position_embeddings]")
@click.option("--http-port", type=click.IntRange(0, 65535), help="Also serve the OpenAI-compatible HTTP API on this port (0: any free "
              "port); see `nebula-flow api --help`.")
@http_options
def serve(config, mode, draft_workers, target_workers, port, log_dir, target_model, draft_model, add_drafters,  # noqa: ANN001
          settings, secure_local, shards, max_model_len, http_port, http_host, api_key, served_model_name, tool_call_parser,  # noqa: ANN001
          reasoning_parser, allowed_origins, access_log) -> None:  # noqa: ANN001
    """Start a broker and its workers; print the client address; stop on Ctrl-C / SIGTERM.

    serve supervises what it started: a worker or the broker that dies is started again after a
    backoff (1 s, doubling, at most 30 s); one that dies 6 times within 5 minutes, or is refused
    for its configuration, is given up while the rest keep serving (a broker given up stops the
    deployment); the config's [supervise] table changes these numbers (max_restarts = 0: never
    restart). Each event is printed here; `nebula-flow status` counts restarts.

    With --http-port, the OpenAI-compatible HTTP API runs beside it (supervised too) and a curl
    line to try it is printed.
    """
    if http_port is not None:
        check_exposure(http_host, api_key)
        check_port_free(http_host, http_port)
    dep = start_deployment(config, mode, draft_workers, target_workers, port, log_dir, add_drafters, settings,
                           secure_local, shards, max_model_len, target=target_model, draft=draft_model)
    click.echo(dep.address)
    again = threading.Event()
    try:
        if http_port is not None:
            start_http(dep, http_host, http_port, api_key, served_model_name, tool_call_parser, reasoning_parser,
                       allowed_origins, access_log)
        supervise_until_stopped(dep, again)
    finally:
        stop_deployment(dep, again)


def supervise_until_stopped(dep, again: threading.Event) -> None:  # noqa: ANN001
    """Supervise ``dep`` (restart what dies, print each event) until Ctrl-C or SIGTERM; a broker
    given up ends it with its error. A second Ctrl-C or SIGTERM sets ``again``: stop at once
    (``stop_deployment``), where the first lets each process finish what it holds."""
    from nebula_flow.deploy import DeploymentError

    stop = threading.Event()

    def on_signal(*_: object) -> None:  # (an event, never an exception: one can land anywhere, even in a finally)
        (again if stop.is_set() else stop).set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        dep.watch(stop, lambda event: click.echo(event, err=True), every_s=0.5)
    except DeploymentError as exc:
        raise click.ClickException(str(exc)) from None


def stop_deployment(dep, again: threading.Event) -> None:  # noqa: ANN001
    """Stop ``dep``: every process is told to stop and waited for (in-flight requests finish, up
    to the broker's drain time), and killed once ``again`` is set (Ctrl-C again)."""
    try:
        click.echo(f"stopping: requests in flight may finish (drain_s {dep.drain_s:g} s) ... (a Ctrl-C now stops at "
                   "once)", err=True)
    finally:  # (whatever interrupts the message, the deployment's processes never outlive serve)
        dep.stop(now=again, log=lambda line: click.echo(line, err=True))  # (how the brokers' drain goes)


def start_http(dep, host: str, port: int, api_key: str | None, model_name: str | None,  # noqa: ANN001
               tool_parser: str | None = None, reasoning_parser: str | None = None,
               allowed_origins: tuple[str, ...] = (), access_log: str = "errors") -> str:
    """Start the deployment's HTTP API; print its URL and a curl line to try it."""
    from nebula_flow.deploy import DeploymentError

    try:
        url = dep.start_api(host, port, api_key, model_name, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                            allowed_origins=allowed_origins, access_log=access_log)
    except DeploymentError as exc:
        raise click.ClickException(str(exc)) from None
    name = model_name or dep.cfg.broker.model_name
    click.echo(f"HTTP API (OpenAI-compatible) on {url}/v1, model {name!r}; try:\n  {curl_line(url, name, api_key)}",
               err=True)
    return url


@click.command()
@click.argument("prompt")
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--prediction-file", type=click.File("r"), help="What the output is expected to be, mostly (e.g. the "
              "file an edit rewrites; OpenAI's Predicted Outputs): drafts are looked up in it, so matching stretches "
              "come many tokens a round. The output is the same with or without it.")
@gen_options
def generate(prompt: str, address: str, as_json: bool, prediction_file, **params) -> None:  # noqa: ANN001, ANN003
    """Generate from PROMPT: stream the text, then print rounds, tokens/round, TTFT, latency."""
    if prediction_file is not None:
        params["prediction"] = prediction_file.read()
    generate_from(address, prompt, as_json, stop=tuple(params.pop("stop")), **params)


@click.command()
@click.argument("prompts", nargs=-1)
@deploy_options
@gen_options
@click.option("--http-port", type=click.IntRange(0, 65535), help="Also start the OpenAI-compatible HTTP API on this port (0: any free "
              "port) and, after the demo, keep serving it until Ctrl-C, with a curl line to try it.")
def run(prompts, config, mode, draft_workers, target_workers, port, log_dir, target_model, draft_model,  # noqa: ANN001
        add_drafters, settings, http_port, **params) -> None:  # noqa: ANN001, ANN003
    """One-shot demo: start the deployment, generate from PROMPTS (a default set if none), stop
    (with --http-port: keep serving the HTTP API until Ctrl-C)."""
    prompts = prompts or ("def fibonacci(n):", "import os\n\ndef list_files(path):", "The quick brown fox")
    dep = start_deployment(config, mode, draft_workers, target_workers, 0 if port is None else port, log_dir,
                           add_drafters, settings, target=target_model, draft=draft_model)
    again = threading.Event()
    try:
        url = start_http(dep, "127.0.0.1", http_port, None, None) if http_port is not None else None
        for prompt in prompts:
            click.echo(f"\n>>> {prompt}")
            generate_from(dep.address, prompt, False, stop=tuple(params["stop"]),
                          **{k: v for k, v in params.items() if k != "stop"})
        if url is not None:
            name = dep.cfg.broker.model_name
            click.echo(f"\nserving the HTTP API on {url}/v1 until Ctrl-C; try:\n  {curl_line(url, name)}", err=True)
            # (its broker listens on a port of its own choosing, not the config's: the other commands need it)
            click.echo(f"the broker's client address: {dep.address} (e.g. nebula-flow status --broker {dep.address})",
                       err=True)
            supervise_until_stopped(dep, again)
    finally:
        stop_deployment(dep, again)


@click.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print the raw state as JSON.")
@click.option("--ready", is_flag=True, help="Print nothing and exit 0 if the deployment can take requests now, else "
              "say why and exit 1 (no broker answers, it is draining, or no worker takes a stage its mode needs: what "
              "the HTTP API's /health answers 503 for): a readiness probe for deployments without the HTTP API.")
def status(address: str, as_json: bool, ready: bool) -> None:
    """Show the broker's workers, topics and counters."""
    from nebula_flow.client import Client, NebulaError
    from nebula_flow.roles import unserved_in

    try:
        with Client(address, timeout_s=5) as client:
            client.wait_connected(5)  # (no broker there, or not a broker: said as such)
            state = client.status()
    except NebulaError as exc:
        raise click.ClickException(str(exc)) from None
    if ready:
        why = "draining: it is stopping and refuses new requests" if state.get("draining") else unserved_in(state)
        if why:
            raise click.ClickException(f"not ready: {why}")
        return
    if as_json:
        click.echo(json.dumps(state, indent=2))
        return
    for line in status_lines(state):
        click.echo(line)


COMMANDS = [serve, run, generate, status]
