"""`pai outputs`, `pai get` and `pai resume`: a job's files (paicli/job_outputs.py).

Registered by paicli.cli; the console has the same verbs. Each parses, calls the
library, renders.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from paicli.cli_statement import StatementCommand
from paicli.commands import echo, open_store, split_submit_options

PROGRESS_FROM = 64 * 1024 * 1024     # a transfer this large shows a progress bar on a TTY


def human_size(size: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if size < 1024 or unit == "G":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return str(size)


def where_text(row: dict) -> str:
    if row["where"] == "here":
        return "here"
    if row["where"] == "node":
        return f"still on node {row['node']} at {row['node_path']} ({row['why']})"
    return f"{row['where']}: {row['why']}"


class ProgressBar:
    """A one-line bar on stderr for a large transfer to a terminal; else nothing
    (job_outputs.Progress)."""

    def __init__(self, total: int):
        self.total = total
        self.shown = total >= PROGRESS_FROM and sys.stderr.isatty()
        self.done = 0
        self.started = time.monotonic()

    def update(self, done: int) -> None:
        self.done = done
        if not self.shown:
            return
        width = 30
        filled = int(width * done / self.total) if self.total else width
        rate = done / max(time.monotonic() - self.started, 1e-6) / (1 << 20)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {human_size(done)}/{human_size(self.total)}"
                         f" {rate:.0f} MB/s")
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown and 0 < self.done < self.total:
            sys.stderr.write("\n")   # the bar stopped short (a node did not answer): end its line
            sys.stderr.flush()


def say(line: str) -> None:
    echo(line, err=True)


def register(cli: click.Group) -> None:
    @cli.command()
    @click.argument("job_id")
    @click.option("--json", "as_json", is_flag=True, help="Print the files as JSON.")
    def outputs(job_id, as_json):
        """The files a job wrote, per instance: path, size, time, and where each is now
        (here / still on a node, and where / not brought back, and why)."""
        from paicli import job_outputs
        from paicli.jobstatus import aligned

        listing = job_outputs.list_outputs(open_store(), job_id)
        if as_json:
            # One file a line, each with the C encoder (indent= takes the pure-Python one,
            # slow for 10,000 files).
            head = json.dumps({"job": listing.job_id, **listing.totals}, sort_keys=True)[:-1]
            files = ",\n  ".join(json.dumps(row, sort_keys=True) for row in listing.rows)
            sys.stdout.write(f"{head}, \"files\": [\n  {files}\n]}}\n")
            return
        if not listing.rows:
            echo(f"{listing.job_id}: no files written (in its working folder, checkpointDir or PAI_OUTPUT_DIR)")
            return
        # Aligned columns, not a rich table: a job may have 10,000 files (rich takes seconds).
        echo("\n".join(aligned([("Instance", "Path", "Size", "Modified", "Where"),
                                *((r["instance"], r["path"], human_size(r["size"] or 0),
                                   time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((r["mtime_ns"] or 0) / 1e9)),
                                   where_text(r)) for r in listing.rows)])))

    @cli.command()
    @click.argument("job_id")
    @click.argument("globs", nargs=-1)
    @click.option("-o", "--output", "dest", default=".", show_default=True, type=click.Path(file_okay=False),
                  help="The folder to copy the files into.")
    @click.option("--instance", "-i", help="Only this instance's files, e.g. worker:0.")
    @click.option("--no-fetch", is_flag=True, help="Copy only what is here; files still on a node are named.")
    def get(job_id, globs, dest, instance, no_fetch):
        """Copy a job's files (those matching PATH_OR_GLOB..., default all) into a folder,
        keeping their layout. Files an ended job left on a node (it did not answer at
        the job's end, or the file was over -DoutputMaxSize) are brought here first,
        where they belong, and the node's job folder removed once nothing is left."""
        from paicli import job_outputs

        chosen = job_outputs.choose(open_store(), job_id, globs, instance, fetch=not no_fetch, say=say,
                                    progress=ProgressBar)
        for row in chosen.elsewhere:
            say(f"not copied: {row['path']} of {row['instance']} is {where_text(row)}")
        if not chosen.here:
            sys.exit(1)
        files, size = job_outputs.copy_outputs(chosen.here, dest, progress=ProgressBar)
        echo(f"{files} file(s), {human_size(size)} into {dest}")

    @cli.command(cls=StatementCommand)
    @click.argument("job_id")
    @click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
    @click.option("--detach", "-d", is_flag=True, help="Print the new job's ID and return.")
    def resume(job_id, overrides, detach):
        """Submit an ended job again, with its statement (-Dkey=value overrides it) and
        what its checkpointDir holds (synced from the nodes), so a cancelled, failed or
        timed-out job continues from its last checkpoint. Exits like the new job."""
        from paicli import job_outputs
        from paicli.cluster import lifecycle
        from paicli.commands import attach, echo_log_view, runtime_progress, submit_statement

        store = open_store()
        overrides, options = split_submit_options(overrides)
        resumed = job_outputs.resumption(store, job_id, overrides)
        here = os.getcwd()
        os.chdir(resumed.cwd)   # a plain script's files go where the first job's went
        try:
            new_id = submit_statement(resumed.statement, store, runtime_progress())
        finally:
            os.chdir(here)
        lifecycle.record_resume(store, resumed.job_id, new_id)
        if detach or options["detach"]:
            echo(new_id)
            return
        echo(f"ID = {new_id}")
        echo(f"Resumes {resumed.job_id}")
        echo_log_view(store, new_id, os.path.join(store.job(new_id)["job_dir"], "summary.txt"))
        sys.exit(attach(store, new_id, from_end=False))
