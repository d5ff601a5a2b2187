"""A job's files for the commands and the console: list them, choose some, bring
what an ended job left on a node, copy them into a folder; and the statement
`pai resume` submits again. The master's side (files arriving as the job runs) is
cluster/outputs.py.
"""

from __future__ import annotations

import fnmatch
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from paicli import client
from paicli.cluster import outputs
from paicli.cluster.backends import backend_for_job
from paicli.errors import UsageError
from paicli.private import ReplacingFile
from paicli.spec import RawParam
from paicli.states import JobStatus
from paicli.statement import Statement, merge_overrides, parse_statement

COLUMNS = ("instance", "path", "size", "mtime_ns", "digest", "where", "node", "node_path", "why")
Say = Callable[[str], None]


class Progress(Protocol):
    """Bytes moved so far out of a total the caller was told (a bar on a terminal)."""

    def update(self, done: int) -> None: ...

    def close(self) -> None: ...


class Quiet:
    def update(self, done: int) -> None:
        pass

    def close(self) -> None:
        pass


ProgressFor = Callable[[int], Progress]   # given the total bytes


def quiet(total: int) -> Progress:
    return Quiet()


@dataclass
class Listing:
    job_id: str
    rows: list[dict]      # COLUMNS; `where`: here / node / missing / replaced
    totals: dict          # count, bytes, missing (store.output_totals)


@dataclass
class Chosen:
    job_id: str
    here: list[dict] = field(default_factory=list)        # to copy
    elsewhere: list[dict] = field(default_factory=list)   # still on a node: named, not copied


@dataclass
class Resumption:
    job_id: str           # the ended job
    statement: Statement  # its statement with the overrides
    cwd: str              # where it is submitted from: where the ended job's files went


def rows_of(store, job_id: str) -> list[dict]:
    """Every output of the job as dicts."""
    return [dict(zip(COLUMNS, row[1:])) for row in store.outputs(job_id)]


def list_outputs(store, job_id: str) -> Listing:
    job = client.resolve_job(store, job_id)
    return Listing(job["id"], rows_of(store, job["id"]), store.output_totals(job["id"]))


def matches(row: dict, globs: tuple[str, ...], instance: str | None) -> bool:
    if instance and row["instance"] != instance:
        return False
    path = row["path"]
    if path == "*":
        return True   # what a node that did not answer holds is not known: it may match
    return not globs or any(fnmatch.fnmatch(path, g) or fnmatch.fnmatch(os.path.basename(path), g)
                            or fnmatch.fnmatch(path, f"*/{g}") for g in globs)


def choose(store, job_id: str, globs: tuple[str, ...] = (), instance: str | None = None, fetch: bool = True,
           say: Say = lambda line: None, progress: ProgressFor = quiet) -> Chosen:
    """The job's files matching `globs` (default all) and `instance`. With `fetch`, the
    chosen files an ended job left on a node are brought here first (bring_back).
    No file matches: UsageError."""
    job = dict(client.resolve_job(store, job_id, to="get the files of"))
    chosen = [r for r in rows_of(store, job["id"]) if matches(r, globs, instance)]
    if fetch and any(r["where"] == "node" for r in chosen) and \
            JobStatus(client.refresh(store, job["id"])["status"]).is_terminal():
        bring_back(store, job, chosen, say, progress)
        chosen = [r for r in rows_of(store, job["id"]) if matches(r, globs, instance)]
    chosen = [r for r in chosen if r["path"] != "*" or r["where"] == "node"]
    if not chosen:
        raise UsageError(f"{job['id']}: no output matches {' '.join(globs) or '(all)'}"
                         + (f" for {instance}" if instance else ""), f"`pai outputs {job['id']}` lists them")
    return Chosen(job["id"], here=[r for r in chosen if r["where"] == "here" and r["path"] != "*"],
                  elsewhere=[r for r in chosen if r["where"] == "node"])


def bring_back(store, job: dict, chosen: list[dict], say: Say, progress: ProgressFor = quiet) -> None:
    """Bring the chosen files still on a node of an ended job here, where they belong,
    as at the job's end (cluster/outputs.fetch_from_nodes). What happens is said to
    `say` and the job's log; a node that does not answer is said, and its files stay
    listed as on it."""
    wanted = outputs.left_on_nodes(store.outputs(job["id"]), [(r["instance"], r["path"]) for r in chosen])
    if not wanted:
        return
    nodes = sorted({node for _, node in wanted})
    say(f"bringing files of {job['id']} from node(s) {', '.join(nodes)}")
    log = outputs.job_log_note(job["job_dir"])

    def note(line: str) -> None:
        log(line)
        say(line)

    # Files over the size limit are listed with their size (an unreachable node's never were).
    total = sum(int(r.get("size") or 0) for r in chosen if r.get("where") == "node")
    bar, lock, got = progress(total), threading.Lock(), [0]

    def arrived(size: int) -> None:   # the nodes' pump threads, several at once
        with lock:
            got[0] += size
            bar.update(min(got[0], total))

    try:
        outputs.fetch_from_nodes(store, job["id"], backend_for_job(job["job_dir"]), wanted, note, arrived)
    finally:
        bar.close()


def common_root(paths: list[str]) -> str:
    if len(paths) == 1:
        return os.path.dirname(paths[0])
    return os.path.commonpath([os.path.dirname(p) for p in paths])


def copy_outputs(rows: list[dict], dest: str, progress: ProgressFor = quiet) -> tuple[int, int]:
    """Copy the rows' files (here) under `dest`, keeping their layout below their
    common folder, each written whole (ReplacingFile). (files, bytes) copied; a
    folder that cannot take them: UsageError."""
    root = common_root([r["path"] for r in rows])
    bar = progress(sum(r["size"] or 0 for r in rows))
    done = total = 0
    try:
        for row in rows:
            target = os.path.join(dest, os.path.relpath(row["path"], root))
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            with open(row["path"], "rb") as src, ReplacingFile(target) as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    total += len(chunk)
                    bar.update(total)
            done += 1
    except OSError as err:
        raise UsageError(f"copying into {dest}: {err.strerror or err}", "check the folder and the free space") from None
    finally:
        bar.close()
    return done, total


# -- pai resume ----------------------------------------------------------------------------


def archive_checkpoint_dir(value: str, code_dir: str) -> str:
    """An archive's job ran in its own code/ folder, which a resumed job does not share:
    a relative -DcheckpointDir becomes the first job's folder, absolute, so the
    resumed job starts from (and goes on writing) those checkpoints. A URL stays."""
    if "://" in value:
        return value
    return os.path.normpath(os.path.join(code_dir, os.path.expanduser(value)))


def resumption(store, job_id: str, tokens: list[str]) -> Resumption:
    """An ended job's statement (its spec.json), overridden by `tokens` (-Dk=v ...),
    and the folder it ran in (a plain script's working folder, where its files
    went). A job that has not ended, or whose statement is unreadable: UsageError."""
    job = client.resolve_job(store, job_id, to="resume")
    if not JobStatus(client.refresh(store, job["id"])["status"]).is_terminal():
        raise UsageError(f"{job['id']} has not ended", f"`pai kill {job['id']}` first, or wait for it")
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
    return Resumption(job["id"], stmt, cwd)
