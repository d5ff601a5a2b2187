"""`pai queue`: the jobs waiting for room, in the order they will start
(docs/queue.md), and `pai store upgrade`, the store they wait in (docs/team.md).
Registered by paicli.cli; `show queue;` in the console."""

from __future__ import annotations

import time

import click

from paicli.commands import echo_json, open_store


@click.command("queue")
@click.option("--json", "as_json", is_flag=True, help="Print the queue as JSON.")
@click.option("--revive", is_flag=True,
              help="First give each waiting job whose supervisor is gone (after a reboot) a new one.")
def queue_command(as_json, revive):
    """List the jobs waiting for room: position, priority, project, what each needs
    and what it waits for (PAI's Waiting List). Jobs start by themselves, in this
    order, when room frees (`pai kill ID` takes one out). Listing writes nothing;
    after a reboot, `--revive` restarts the waiting jobs' supervisors (so does the
    next submit)."""
    from paicli import client

    store = open_store()
    if revive:
        for job_id in client.revive_queued(store):
            click.echo(f"{job_id}: a new supervisor takes its place in the queue", err=True)
    rows = client.queue(store)
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no job is waiting")
        return
    from paicli.jobstatus import aligned

    # Plain aligned columns, not a rich table: a queue of hundreds prints at once.
    lines = aligned([("Position", "InstanceID", "Name", "Priority", "Project", "Submitted", "Needs", "Waiting for"),
                     *((str(r["position"]), r["id"], r["name"] or "", str(r["priority"]), r["project"] or "",
                        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["submitted"] or 0)),
                        " ".join(f"{key} {r['needs'][key]}" for key in ("cpu", "memory", "gpu") if r["needs"].get(key)),
                        r["waiting_for"]) for r in rows)])
    click.echo("\n".join(lines))


@click.group("store")
def store_group():
    """The job store: SQLite under PAI_HOME, or a team's PostgreSQL (PAI_STORE)."""


@store_group.command("upgrade")
def store_upgrade():
    """Bring the store's schema up to this pai's version (once, for the whole team,
    when a newer paicli is rolled out; older clients are refused after)."""
    from paicli.store import SCHEMA_VERSION, Store

    store = Store(upgrade=True)
    click.echo(f"the job store {store.where} is at schema version {SCHEMA_VERSION}")


@click.group("quota")
def quota_group():
    """The quotas each project's jobs are held to, across users (docs/queue.md)."""


@quota_group.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print the quotas and admins as JSON.")
def quota_show(as_json):
    """Each project's quota (PAI units) and the admins: a team store's, else the quota file's."""
    from paicli.cluster import queue_turns

    store = open_store()
    quotas, admins = queue_turns.load_quotas(store), sorted(queue_turns.load_admins(store))
    if as_json:
        echo_json({"quotas": quotas, "admins": admins})
        return
    for project, caps in quotas.items():
        click.echo(f"{project}: " + ", ".join(f"{key} {value}" for key, value in caps.items()))
    click.echo(f"admins: {', '.join(admins) or '-'}")


@quota_group.command("set")
@click.argument("project", required=False)
@click.argument("limits", nargs=-1)
@click.option("--file", "path", type=click.Path(dir_okay=False, exists=True),
              help="Load a quota file (projects and admins:) in place of every quota.")
def quota_set(project, limits, path):
    """Set a project's quota in the team store, e.g. `pai quota set vision cpu=800 gpu=200`,
    or load a quota file into it (--file). Once the store has admins, only they may."""
    from pathlib import Path

    from paicli.cluster import queue as policy, queue_turns
    from paicli.errors import UsageError

    store = open_store()
    if not store.postgres:
        raise UsageError("the quotas of a store under PAI_HOME are its quota file's",
                         f"edit {queue_turns.quota_path(store.home) or store.home / 'quota.yaml'} (docs/queue.md)")
    if bool(path) == bool(project):
        raise UsageError("give a project and its limits, or --file", "e.g. pai quota set vision cpu=800 gpu=200")
    quotas, admins = (queue_turns.read_quota_file(Path(path)) if path else
                      (policy.parse_quota({project: policy.parse_limits(limits)}, "pai quota set"), None))
    def allowed(current: frozenset[str]) -> None:
        if current and not policy.is_admin(store.me(), current):
            raise UsageError(f"only an admin may set quotas ({', '.join(sorted(current))})",
                             "ask one of them, or `pai quota show`")

    store.set_quotas(quotas, admins, replace=bool(path), allowed=allowed)
    click.echo(f"quotas set: {', '.join(quotas) or 'none'}" + (f"; admins: {', '.join(sorted(admins))}" if admins else ""))


def register(cli: click.Group) -> None:
    cli.add_command(queue_command)
    cli.add_command(store_group)
    cli.add_command(quota_group)
