"""`pai nodes` (multi-host: the nodes file, host keys, resources).

Registered by paicli.cli; keep heavy imports inside the commands.
"""

from __future__ import annotations

import json
import os
import sys

import click

from paicli.commands import print_table
from paicli.errors import UsageError


def _config():
    from paicli.cluster.nodes import load_nodes, nodes_file_path

    config = load_nodes()
    if config is None:
        raise UsageError("no nodes file: jobs run on this machine alone",
                         f"write one (see docs/multihost.md) at {nodes_file_path({'PAI_NODES': ''}) or '$PAI_HOME/nodes.yaml'}"
                         " or set PAI_NODES")
    if not config.nodes:
        raise UsageError(f"nodes file {config.path} lists no SSH nodes", "add a `nodes:` list")
    return config


def _ray_config() -> dict | None:
    """The Ray cluster jobs go to (PAI_RAY_ADDRESS, or a nodes file with `ray:`), if any."""
    if os.environ.get("PAI_RAY_ADDRESS"):
        return {"backend": "ray", "address": os.environ["PAI_RAY_ADDRESS"]}
    from paicli.cluster.nodes import load_nodes

    config = load_nodes()
    return {"backend": "ray", "ray": config.ray} if config is not None and config.ray is not None else None


def _list_nodes(as_json: bool) -> None:
    ray_config = _ray_config()
    if ray_config is not None:
        from paicli.cluster import backends

        rows = backends.list_nodes(ray_config)
    else:
        from paicli.cluster.node_admin import probe_nodes

        rows = probe_nodes(_config())
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    table = []
    for r in rows:
        up = r["state"] == "up"
        table.append((
            r["name"], f"{r['host']}:{r['port']}", r["state"],
            str(r["cores"]) if up else "-",
            f"{r['memory']} MB" if up and r["memory"] is not None else "-",
            (",".join(r["gpus"]) or "none") if up else "-",
            r["python"] or "-",
            (",".join(sorted(r["runtimes"])) or "none") if up else "-",
            str(len(r["instances"])) if up else "-",
        ))
    print_table(("NODE", "ADDRESS", "STATE", "CORES", "MEMORY", "GPUS", "PYTHON", "RUNTIMES", "INSTANCES"),
                 table)
    for r in rows:
        if r["error"]:
            click.echo(f"{r['name']}: {r['error']}", err=True)


def _trust(name: str, yes: bool) -> None:
    from paicli.cluster.node_admin import trust_node

    config = _config()

    def confirm(fp: str, old_fp: str | None) -> bool:
        if old_fp:
            click.echo(f"{name}: host key CHANGED: known_hosts has {old_fp}, the node now shows {fp}")
        else:
            click.echo(f"{name}: host key {fp}")
        if yes:
            return True
        if not sys.stdin.isatty():
            raise UsageError(f"not recording {name}'s key without confirmation",
                             "compare the fingerprint with the node's (ssh-keygen -lf on it), then add --yes")
        return click.confirm(f"Record it in {config.known_hosts}?", default=False)

    fp, outcome = trust_node(config, name, confirm)
    click.echo({"recorded": f"{name}: recorded {fp} in {config.known_hosts}",
                "known": f"{name}: {fp} is already trusted ({config.known_hosts})",
                "declined": f"{name}: not recorded"}[outcome])


def install_on_node(runtime: str, node: str, progress) -> str:
    """`pai runtime install NAME --node NODE` (called from paicli.cli)."""
    from paicli.cluster.node_admin import provision_runtime

    return provision_runtime(_config(), node, runtime, progress)


def register(cli: click.Group) -> None:
    @cli.group(invoke_without_command=True)
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @click.pass_context
    def nodes(ctx, as_json):
        """The nodes jobs run on (PAI_NODES, else $PAI_HOME/nodes.yaml).

        Without a subcommand: each node's state (up / unreachable / host key
        unknown), cores, memory, GPUs, Python version, runtimes and the paicli
        instances running on it.
        """
        if ctx.invoked_subcommand is None:
            _list_nodes(as_json)

    @nodes.command("trust")
    @click.argument("name")
    @click.option("--yes", is_flag=True, help="Record the key without asking.")
    def trust(name, yes):
        """Show NAME's SSH host key fingerprint and record it in known_hosts."""
        _trust(name, yes)
