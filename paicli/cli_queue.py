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


def register(cli: click.Group) -> None:
    cli.add_command(queue_command)
    cli.add_command(store_group)
