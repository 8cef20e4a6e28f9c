"""The ``nebula-flow`` command line.

The core's commands live in the modules beside this one, by job; the processes built on the core
(the broker, the workers) add theirs through the ``nebula_flow.commands`` entry point, so the
core imports neither. Plugins load only when their command runs (or for ``--help``).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import click

from nebula_flow.cli import api, measure, serving, simulate, tools

PLUGINS = "nebula_flow.commands"


class Commands(click.Group):
    """The core's commands plus the plugins' (loaded on demand)."""

    def _plugins(self) -> dict:
        return {ep.name: ep for ep in entry_points(group=PLUGINS)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and (ep := self._plugins().get(name)) is not None:
            command = ep.load()
        return command


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """nebula-flow: speculative decoding as a dataflow pipeline on a ZeroMQ bus.

    A broker holds the request pool; draft and target workers pull request-round tasks.
    Start a whole deployment with `serve` (or `run` for a one-shot demo); talk to it with
    `generate` and `status`.
    """


for _module in (serving, api, measure, simulate, tools):
    for _command in _module.COMMANDS:
        main.add_command(_command)
