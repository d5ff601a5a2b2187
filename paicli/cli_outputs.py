"""`pai outputs` and `pai get`: the files a job wrote (issue 17, cluster/outputs.py).

Registered by paicli.cli; the console has the same verbs. They read the store and
copy files that are here; `pai get` first brings what an ended job left on a node.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import threading
import time

import click

from paicli.commands import echo, open_store
from paicli.errors import UsageError
from paicli.private import ReplacingFile

COLUMNS = ("instance", "path", "size", "mtime_ns", "digest", "where", "node", "node_path", "why")
PROGRESS_FROM = 64 * 1024 * 1024     # a transfer this large shows a progress bar on a TTY


def rows_of(store, job_id: str) -> list[dict]:
    """Every output of the job as dicts (`where`: here / node / missing / replaced)."""
    return [dict(zip(COLUMNS, row[1:])) for row in store.outputs(job_id)]


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


def matches(row: dict, globs: tuple[str, ...], instance: str | None) -> bool:
    if instance and row["instance"] != instance:
        return False
    path = row["path"]
    if path == "*":
        return True   # what a node that did not answer holds is not known: it may match
    return not globs or any(fnmatch.fnmatch(path, g) or fnmatch.fnmatch(os.path.basename(path), g)
                            or fnmatch.fnmatch(path, f"*/{g}") for g in globs)


def common_root(paths: list[str]) -> str:
    if len(paths) == 1:
        return os.path.dirname(paths[0])
    return os.path.commonpath([os.path.dirname(p) for p in paths])


def copy_files(rows: list[dict], dest: str, progress) -> tuple[int, int]:
    """Copy the rows' files (here) under `dest`, keeping their layout below their
    common folder; each written aside, then renamed. (files, bytes) copied."""
    root = common_root([r["path"] for r in rows])
    done = total = 0
    for row in rows:
        target = os.path.join(dest, os.path.relpath(row["path"], root))
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with open(row["path"], "rb") as src, ReplacingFile(target) as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                total += len(chunk)
                progress(total)
        done += 1
    return done, total


def progress_bar(total: int):
    """A one-line bar on stderr for a large copy to a terminal; else nothing."""
    if total < PROGRESS_FROM or not sys.stderr.isatty():
        return lambda done: None
    started = time.monotonic()

    def show(done: int) -> None:
        width = 30
        filled = int(width * done / total) if total else width
        rate = done / max(time.monotonic() - started, 1e-6) / (1 << 20)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {human_size(done)}/{human_size(total)}"
                         f" {rate:.0f} MB/s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def plain_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """Aligned columns without rich: a job may have 10,000 files (rich takes seconds)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [headers, *rows]]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def archive_checkpoint_dir(value: str, code_dir: str) -> str:
    """An archive's job ran in its own code/ folder, which a resumed job does not share:
    a relative -DcheckpointDir becomes the first job's folder, absolute, so the
    resumed job starts from (and goes on writing) those checkpoints. A URL stays."""
    if "://" in value:
        return value
    return os.path.normpath(os.path.join(code_dir, os.path.expanduser(value)))


def fetch_left(store, job: dict, chosen: list[dict]) -> None:
    """Bring the chosen files still on a node of an ended job here (where they
    belong, as at the job's end: cluster/outputs.fetch_from_nodes)."""
    from paicli.cluster import outputs
    from paicli.cluster.backends import backend_for_job

    wanted = outputs.left_on_nodes(store.outputs(job["id"]), [(r["instance"], r["path"]) for r in chosen])
    if not wanted:
        return
    nodes = sorted({node for _, node in wanted})
    echo(f"bringing files of {job['id']} from node(s) {', '.join(nodes)}", err=True)
    log = outputs.job_log_note(job["job_dir"])

    def note(line: str) -> None:
        log(line)
        echo(line, err=True)

    # Files over the size limit are listed with their size: a large fetch shows a bar on
    # a terminal, as a large copy does (an unreachable node's files were never listed).
    total = sum(int(r.get("size") or 0) for r in chosen if r.get("where") == "node")
    bar, lock, got = progress_bar(total), threading.Lock(), [0]

    def arrived(size: int) -> None:   # the nodes' pump threads, several at once
        with lock:
            got[0] += size
            bar(min(got[0], total))

    # a node that does not answer is said by a note line; its files stay listed as on it
    outputs.fetch_from_nodes(store, job["id"], backend_for_job(job["job_dir"]), wanted, note, arrived)
    if 0 < got[0] < total and total >= PROGRESS_FROM and sys.stderr.isatty():
        sys.stderr.write("\n")   # the bar stopped short (a node did not answer): end its line


def resume_statement(store, job: dict, tokens: list[str]):
    """The ended job's statement (its spec.json), overridden by `tokens` (-Dk=v ...),
    and the folder it ran in (a plain script's working folder, where its files went)."""
    import json
    from pathlib import Path

    from paicli.spec import RawParam
    from paicli.statement import Statement, merge_overrides, parse_statement

    job_dir = Path(job["job_dir"])
    try:
        spec = json.loads((job_dir / "spec.json").read_text())
        plan = json.loads((job_dir / "plan.json").read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{job['id']}: its statement cannot be read ({err})", "submit it again by hand") from None
    cwd = next((r.get("cwd") for r in plan.get("roles", []) if r.get("cwd")), None)
    if cwd == str(job_dir / "code") and spec.get("checkpoint_dir"):
        spec["checkpoint_dir"] = archive_checkpoint_dir(spec["checkpoint_dir"], cwd)
    if not cwd or cwd == str(job_dir / "code") or not os.path.isdir(cwd):
        cwd = os.getcwd()
    stmt = Statement(framework=spec.pop("name"), project=spec.pop("project", None))
    stmt.params = [RawParam(key, value, f"job {job['id']}: {key}", Path(cwd)) for key, value in spec.items()]
    if tokens:
        stmt = merge_overrides(stmt, parse_statement(tokens, base=Path(cwd), require_name=False))
    return stmt, cwd


def register(cli: click.Group) -> None:
    """Add this module's commands to the `pai` group."""

    @cli.command()
    @click.argument("job_id")
    @click.option("--json", "as_json", is_flag=True, help="Print the files as JSON.")
    def outputs(job_id, as_json):
        """The files a job wrote, per instance: path, size, time, and where each is now
        (here / still on a node, and where / not brought back, and why)."""
        from paicli import client

        store = open_store()
        job = client.resolve_job(store, job_id)
        rows = rows_of(store, job["id"])
        if as_json:
            # One file a line, each with the C encoder (indent= takes the pure-Python one:
            # 0.5 s for 10,000 files).
            head = json.dumps({"job": job["id"], **store.output_totals(job["id"])}, sort_keys=True)[:-1]
            files = ",\n  ".join(json.dumps(row, sort_keys=True) for row in rows)
            sys.stdout.write(f"{head}, \"files\": [\n  {files}\n]}}\n")
            return
        if not rows:
            echo(f"{job['id']}: no files written (in its working folder, checkpointDir or PAI_OUTPUT_DIR)")
            return
        plain_table(("Instance", "Path", "Size", "Modified", "Where"),
                    [(r["instance"], r["path"], human_size(r["size"] or 0),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((r["mtime_ns"] or 0) / 1e9)),
                      where_text(r)) for r in rows])

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
        from paicli import client
        from paicli.states import JobStatus

        store = open_store()
        job = client.resolve_job(store, job_id)
        chosen = [r for r in rows_of(store, job["id"]) if matches(r, globs, instance)]
        if not no_fetch and any(r["where"] == "node" for r in chosen) and \
                JobStatus(client.refresh(store, job["id"])["status"]).is_terminal():
            fetch_left(store, dict(job), chosen)
            chosen = [r for r in rows_of(store, job["id"]) if matches(r, globs, instance)]
        chosen = [r for r in chosen if r["path"] != "*" or r["where"] == "node"]
        here = [r for r in chosen if r["where"] == "here" and r["path"] != "*"]
        if not chosen:
            raise UsageError(f"{job['id']}: no output matches {' '.join(globs) or '(all)'}"
                             + (f" for {instance}" if instance else ""), f"`pai outputs {job['id']}` lists them")
        for row in chosen:
            if row["where"] == "node":
                echo(f"not copied: {row['path']} of {row['instance']} is {where_text(row)}", err=True)
        if not here:
            sys.exit(1)
        total = sum(r["size"] or 0 for r in here)
        try:
            files, size = copy_files(here, dest, progress_bar(total))
        except OSError as err:
            raise UsageError(f"copying into {dest}: {err.strerror or err}", "check the folder and the free space")
        echo(f"{files} file(s), {human_size(size)} into {dest}")

    @cli.command(context_settings={"ignore_unknown_options": True})
    @click.argument("job_id")
    @click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
    @click.option("--detach", "-d", is_flag=True, help="Print the new job's ID and return.")
    def resume(job_id, overrides, detach):
        """Submit an ended job again, with its statement (-Dkey=value overrides it) and
        what its checkpointDir holds (synced from the nodes), so a cancelled, failed or
        timed-out job continues from its last checkpoint. Exits like the new job."""
        from paicli import client
        from paicli.commands import attach, echo_log_view, runtime_progress, submit_statement
        from paicli.states import JobStatus

        store = open_store()
        job = client.resolve_job(store, job_id)
        if not JobStatus(client.refresh(store, job["id"])["status"]).is_terminal():
            raise UsageError(f"{job['id']} has not ended", f"`pai kill {job['id']}` first, or wait for it")
        stmt, cwd = resume_statement(store, dict(job), list(overrides))
        here = os.getcwd()
        os.chdir(cwd)   # a plain script's files go where the first job's went
        try:
            new_id = submit_statement(stmt, store, runtime_progress())
        finally:
            os.chdir(here)
        store.event(new_id, "resumed-from", job["id"])
        store.event(job["id"], "resumed-by", new_id)
        if detach:
            echo(new_id)
            return
        echo(f"ID = {new_id}")
        echo(f"Resumes {job['id']}")
        echo_log_view(store, new_id, os.path.join(store.job(new_id)["job_dir"], "summary.txt"))
        sys.exit(attach(store, new_id, from_end=False))
