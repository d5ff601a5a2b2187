"""`pai serve scale NAME_OR_JOB N`: a serving job's replicas added or removed while
it serves (docs/serving.md). Registered by paicli.cli under `pai serve`, whose
group (ServeGroup) hands any first word that is not a subcommand to the serve
command itself."""

from __future__ import annotations

import click

from paicli.commands import echo_json, open_store


class ServeGroup(click.Group):
    """`pai serve MODEL ...` and `pai serve scale ...` under one name: a first word
    naming a subcommand runs it, anything else is `default`'s (the serve command)."""

    default: click.Command | None = None

    def parse_args(self, ctx, args):
        if self.default is not None and args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = [self.default.name, *args]
        return super().parse_args(ctx, args)

    def set_default(self, command: click.Command) -> None:
        self.default = command
        self.add_command(command)


@click.command("scale")
@click.argument("name_or_job")
@click.argument("count", type=click.IntRange(min=1, max=1024))
@click.option("--json", "as_json", is_flag=True, help="Print the change as JSON.")
def scale_command(name_or_job, count, as_json):
    """Run COUNT replicas of a serving job (its name or ID): new ones are placed and
    join the router once ready; removed ones (the highest-numbered) leave the router
    first, finish what they serve, then stop. No request is dropped."""
    from paicli import client

    change = client.scale(open_store(), name_or_job, count)
    if as_json:
        echo_json(change)
        return
    click.echo(f"{change['id']}: {change['role']} {change['from']} -> {change['to']} "
               f"(`pai status {change['id']}` shows them)")


serve = ServeGroup("serve", help="""Serve a model: `pai serve MODEL [options]` (that is, `pai serve start`);
    `pai serve scale NAME N` changes its replicas.

    \b
    MODEL: a path or file:// URL of a SavedModel folder, .keras file, Gluon
    export, Caffe deploy prototxt (beside its .caffemodel) or .onnx file, or
    JOB_ID[:PATH], the model a job saved among its outputs. The service is a
    job: `pai list`, `pai status`, `pai logs` and `pai kill` work on it.
    """)
serve.add_command(scale_command)


def register(cli: click.Group) -> None:
    cli.add_command(serve)
