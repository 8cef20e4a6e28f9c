"""The HTTP front door: `nebula-flow api` runs the OpenAI-compatible gateway in front of a broker
(`serve --http-port` starts one with the deployment)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import click

from nebula_flow.api.access_log import LEVELS as ACCESS_LOG_LEVELS
from nebula_flow.api.reasoning import PARSERS as REASONING_PARSERS
from nebula_flow.api.tools import PARSERS
from nebula_flow.cli.common import broker_option
from nebula_flow.listen import listening_socket
from nebula_flow.security import is_loopback

API_KEY_ENV = "NEBULA_FLOW_API_KEY"  # (the key travels in the environment: argv is visible to every local user)


def check_exposure(host: str, api_key: str | None) -> None:
    """Off loopback the gateway takes requests only with an API key."""
    if not is_loopback(host) and not api_key:
        raise click.UsageError(f"--http-host {host} is reachable from other hosts: give --api-key (or set "
                               f"{API_KEY_ENV}) so that only callers with the key get answers")


def check_port_free(host: str, port: int) -> None:
    """The gateway's port (0: any) can be bound on ``host``: what `serve` checks before it starts a
    deployment, which it would otherwise start only to fail at the gateway."""
    if port:
        try:
            listening_socket(host, port).close()
        except OSError as exc:
            raise click.ClickException(str(exc)) from None


def http_options(f: Callable) -> Callable:
    """The gateway's address and key, for `api` and `serve`."""
    for opt in reversed([
        click.option("--http-host", default="127.0.0.1", show_default=True,
                     help="Interface the HTTP API binds; anything but loopback requires --api-key."),
        click.option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                     help="Require `Authorization: Bearer KEY` on /v1/* and /metrics (/health stays open)."),
        click.option("--served-model-name", help="The name /v1/models lists and requests must use (default: the "
                     "target's name in the config, as written)."),
        click.option("--tool-call-parser", type=click.Choice(PARSERS), help="The model's own tool-call format, for "
                     "tool_choice \"auto\" (hermes: <tool_call>{...}</tool_call>, Qwen2.5, Qwen3, Hermes). Without it "
                     "\"auto\" is refused; a named function, \"required\" and \"none\" need none."),
        click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), help="The model's thinking format: "
                     "chat answers carry it apart as reasoning_content (qwen3: <think>...</think> first; deepseek_r1: "
                     "thinking until </think>)."),
        click.option("--access-log", type=click.Choice(ACCESS_LOG_LEVELS), default="errors", show_default=True,
                     help="Which requests get a line in the gateway's log when their answer ends (client, path, "
                     "status, time, request id, tokens, finish reason or error): errors = those that failed (status "
                     "400 and up, a stream that failed or whose client left), at most 20 lines a second; all = every "
                     "request (health, metrics and version probes only when they fail); off = none."),
        click.option("--allowed-origins", multiple=True, metavar="ORIGIN", help="Web pages of this origin (e.g. "
                     "https://chat.example.com, or * for any) may call the API from a browser (CORS); repeatable. By "
                     "default none may: a page the user opens could otherwise use a gateway on their own host."),
    ]):
        f = opt(f)
    return f


@click.command()
@broker_option
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="HTTP port (0: any free port, printed).")
@click.option("--keys", type=click.Path(file_okay=False), help="CURVE key folder, where the broker uses keys "
              "(default: $NEBULA_FLOW_KEYS).")
@click.option("--timeout-s", type=click.FloatRange(0, min_open=True), default=600.0, show_default=True, help="Longest wait for the broker's next message.")
@click.option("--drain-s", type=click.FloatRange(0), default=35.0, show_default=True, help="On Ctrl-C / SIGTERM: "
              "how long requests in flight may finish (new connections are refused); above the broker's drain_s "
              "(30 s by default), so that its shutting-down errors still reach the callers.")
@http_options
def api(address: str, port: int, keys: str | None, timeout_s: float, drain_s: float, http_host: str,
        api_key: str | None, served_model_name: str | None, tool_call_parser: str | None,
        reasoning_parser: str | None, allowed_origins: tuple[str, ...], access_log: str) -> None:
    """Serve the OpenAI-compatible HTTP API in front of a broker, until Ctrl-C / SIGTERM.

    Endpoints: POST /v1/completions, /v1/chat/completions and /v1/responses (streamed as
    server-sent events with "stream": true; GET and DELETE /v1/responses/ID for stored responses),
    GET /v1/models, /health and /metrics (Prometheus), POST /tokenize and /detokenize. /health
    answers 503 while the broker does not answer, drains, or has no worker for a stage its mode
    needs (a load balancer's readiness check). Several gateways may share one broker (each keeps
    its own stored responses). Try it:

        curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
          -d '{"model": "NAME", "prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'
    """
    from nebula_flow.api.app import Gateway
    from nebula_flow.api.server import serve_api

    check_exposure(http_host, api_key)
    gateway = Gateway(address, keys=keys or os.environ.get("NEBULA_FLOW_KEYS"), api_key=api_key,
                      model_name=served_model_name, timeout_s=timeout_s, tool_parser=tool_call_parser,
                      reasoning_parser=reasoning_parser, allowed_origins=allowed_origins, access_log=access_log)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s api %(levelname)s %(message)s")
    logging.getLogger("nebula_flow.api").setLevel(logging.INFO)  # (the request log: ``api/access_log.py``)
    try:
        serve_api(gateway, http_host, port, drain_s=drain_s,
                  ready=lambda p: click.echo(f"HTTP API on http://{http_host}:{p}/v1 (broker {address})", err=True))
    except OSError as exc:  # (its port: taken, or not this host's)
        raise click.ClickException(str(exc)) from None


def curl_line(url: str, model: str, api_key: str | None = None) -> str:
    """A command that asks the gateway at ``url`` for a chat completion (what `serve` and `run` print)."""
    auth = " -H 'Authorization: Bearer $NEBULA_FLOW_API_KEY'" if api_key else ""
    return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{{\"model\": "
            f"\"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Write a haiku about the sea\"}}], "
            f"\"max_tokens\": 48}}'")


COMMANDS = [api]
