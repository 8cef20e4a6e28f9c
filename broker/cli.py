"""`nebula-flow broker`: run the broker process (a plugin command; see nebula_flow/cli)."""

from __future__ import annotations

import json
import logging
import sys

import click

from nebula_flow import io_threads
from nebula_flow.cli.common import policy_options
from nebula_flow.config import ConfigError
from nebula_flow.hub import local_folder
from nebula_flow.options import BrokerOptions, read_options
from nebula_flow.policy import PolicyConfig
from nebula_flow.roles import MODES
from nebula_flow.security import SecurityError

_D = BrokerOptions()


@click.command()
@click.option("--options", "options_file", type=click.Path(exists=True, dir_okay=False),
              help="Take every setting from this JSON file (what `serve` writes for its broker); no other option "
              "may be given with it.")
@click.option("--mode", type=click.Choice(list(MODES)), default=None,
              help=f"Scheduling mode: pooled (M-for-N), paired, colocated, autoregressive, or elastic (workers of role any "
              f"take a draft or a verify batch at each pull). [default: {_D.mode}]")
@click.option("--host", default=None, help=f"Interface to bind. [default: {_D.host}]")
@click.option("--client-port", type=click.IntRange(0, 65535), default=None, help=f"Port for clients. [default: {_D.client_port}]")
@click.option("--worker-port", type=click.IntRange(0, 65535), default=None, help=f"Port for workers. [default: {_D.worker_port}]")
@click.option("--model", help="The target checkpoint (its tokenizer, context length, EOS), as a config names it: a "
              "folder, a hub id (Qwen/Qwen3-0.6B) or cache:NAME; clients call the model by it as written.")
@click.option("--proposal-top-k", type=click.IntRange(1), default=None,
              help=f"Entries of the draft distribution q sent with each sampled draft token. [default: {_D.proposal_top_k}]")
@click.option("--max-pending", type=click.IntRange(1), default=None,
              help=f"Admission limit; beyond it clients get BUSY (with priority scheduling, a more urgent "
                   f"request takes the place of the least urgent one not started). [default: {_D.max_pending}]")
@click.option("--heartbeat-s", type=click.FloatRange(0, min_open=True), default=None, help=f"Heartbeat interval. [default: {_D.heartbeat_s}]")
@click.option("--liveness-s", type=float, default=None,
              help=f"Silence after which a worker is declared dead. [default: {_D.liveness_s}]")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Serve Prometheus text at http://METRICS_HOST:PORT/metrics (0: a free "
              "port).")
@click.option("--metrics-host", default=None, help=f"Interface the metrics server binds; off loopback only with "
              f"--metrics-token-file. [default: {_D.metrics_host}]")
@click.option("--metrics-token-file", type=click.Path(exists=True, dir_okay=False),
              help="A file holding the token scrapers must send (Authorization: Bearer TOKEN).")
@click.option("--keys", type=click.Path(), help="CURVE key folder (`nebula-flow keys`); required off loopback. "
              "Also read from NEBULA_FLOW_KEYS.")
@click.option("--shard", type=click.IntRange(0), default=None,
              help=f"This broker's slice of a sharded deployment's requests (0..shards-1). [default: {_D.shard}]")
@click.option("--shards", type=click.IntRange(1), default=None,
              help=f"Brokers sharing the requests; clients and workers are given every shard's address. "
              f"[default: {_D.shards}]")
@click.option("--full-tokens", is_flag=True, default=None, help="Send every task its request's whole tokens (by "
              "default a task carries only the tokens its worker lacks): to measure what that saves.")
@click.option("--policy-log", type=click.Path(), help="At exit, write every scheduling event and decision here "
              "(JSONL), for `nebula-flow simulate --check-policy-log`.")
@click.option("--print-options", is_flag=True, help="Print the settings this broker would run with (JSON, the "
              "format of --options) and exit.")
@policy_options
def broker(options_file: str | None, print_options: bool, policy: PolicyConfig, **given: object) -> None:
    """Run the broker: the request pool, the draft and target topics, the two sockets."""
    given = {name: value for name, value in given.items() if value is not None}
    if options_file:
        if given or policy != PolicyConfig():
            raise click.UsageError("--options takes every setting from its file: give no other option")
        try:
            opts = read_options(BrokerOptions, options_file)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    else:
        if spec := given.get("model"):  # (as a config names it: a hub id, cache:NAME, a folder)
            try:
                given["model"] = local_folder(spec, log=lambda m: click.echo(m, err=True))
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
            given["model_name"] = spec  # (what clients call it, as written: /v1/models)
        opts = BrokerOptions(policy=policy, **given)
    if print_options:
        click.echo(json.dumps(opts.to_json(), indent=2))
        return
    try:
        sys.exit(serve_broker(opts))
    except (ValueError, OSError) as exc:  # (a bad setting; a port that is taken)
        raise click.ClickException(str(exc)) from None


def serve_broker(opts: BrokerOptions) -> int:
    """Run a broker until it stops; its exit code. Keys or settings it cannot serve with (a
    ``max_model_len`` beyond the model's, say) are an error in its log and exit code 2, which a
    deployment's supervisor does not restart (restarting cannot help)."""
    from nebula_flow_broker.server import Broker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s broker %(levelname)s %(message)s")
    io_threads.pin_from_env()  # (before the first socket: the deployment's zmq_io_cpu)
    try:
        return Broker(opts).run()
    except (SecurityError, ConfigError) as exc:
        logging.getLogger("nebula_flow.broker").error("%s", exc)
        return 2
