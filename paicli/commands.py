"""What the `pai` commands, the console and the program share: output (the
table, JSON), the submit of a statement followed to its verdict, and the error
boundary with the quick exit.

The console runs a statement with these functions, so it behaves as the `pai`
command would. No click here: a bare statement (`pai -name ...`) is submitted
through this module alone; heavy modules are imported inside the functions.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from paicli.cli_tokens import SUBMIT_OPTIONS
from paicli.errors import Cancelled, PaiError, UsageError
STATUS_STYLES = {"Succeeded": "green", "Terminated": "green", "Running": "cyan", "Waiting": "yellow",
                 "Failed": "red", "Killed": "red", "Cancelled": "magenta"}


def open_store():
    from paicli.store import Store

    return Store()


# -- rendering ------------------------------------------------------------------------


def echo(text: str = "", err: bool = False) -> None:
    """A line on stdout (stderr with err=True), flushed at once, as click.echo does."""
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{text}\n")
    stream.flush()


def echo_json(data) -> None:
    echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def print_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """Columns never wrap (a pipe gets whole rows); statuses coloured on a TTY."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False)
    for header in headers:
        table.add_column(header, no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell, style=STATUS_STYLES.get(cell, "")) for cell in row))
    # In a pipe, rows stay whole however long (a script reads them), without trailing padding.
    console = Console(no_color=bool(os.environ.get("NO_COLOR")),
                      width=None if sys.stdout.isatty() else 10_000)
    with console.capture() as captured:
        console.print(table)
    echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def runtime_progress():
    """Provisioning progress: a bar redrawn in place on a TTY, one line per phase in a
    pipe (paicli/progress.py)."""
    from paicli.progress import provisioning_progress

    return provisioning_progress(sys.stderr)


# -- statements ----------------------------------------------------------------------------


def split_submit_options(tokens: tuple[str, ...] | list[str]) -> tuple[list[str], dict[str, bool]]:
    options = {"detach": False, "no_progress": False}
    rest = []
    for token in tokens:
        if token in SUBMIT_OPTIONS:
            options[SUBMIT_OPTIONS[token]] = True
        elif token.startswith("--"):
            raise UsageError(f"unknown option {token}", "options here: --detach, --no-progress")
        else:
            rest.append(token)
    return rest, options


def statement_of(tokens: list[str]):
    """A statement from `job.yaml [-Dk=v ...]` (the file, overridden) or from PAI tokens."""
    from paicli.statement import load_job_file, merge_overrides, parse_statement

    if tokens and not tokens[0].startswith("-") and tokens[0].endswith((".yaml", ".yml")):
        stmt = load_job_file(tokens[0])
        if tokens[1:]:
            stmt = merge_overrides(stmt, parse_statement(tokens[1:], require_name=False))
        return stmt
    return parse_statement(tokens)


# -- submit and follow -------------------------------------------------------------------


def submit_statement(stmt, store, progress, meanwhile=None) -> str:
    """Prepare and submit; with -DautoStrategy=true, Pluto plans the job first.
    `meanwhile(job_id, recorded_fd)`: what to do while its master takes it over
    (client.hand_over)."""
    from paicli import client

    prepared = client.prepare(stmt)
    if prepared.adapter.name == "serving":
        from paicli.serving import resolve  # the model found here, before the plan

        resolve(prepared, store, progress)
    if prepared.spec.get("autoStrategy") == "true":
        from paicli.pluto import auto_strategy  # calibrate, plan, apply its recommendation

        prepared = auto_strategy(prepared, store, progress)
    return client.submit(prepared, store, progress=progress, meanwhile=meanwhile)


def submit_and_follow(stmt, detach: bool = False, progress: bool = True) -> int:
    recorded = -1

    def first_lines(job_id: str, recorded_fd: int) -> None:
        # While the master takes the job over: the ID and the log view (a server
        # started if none runs).
        nonlocal recorded
        recorded = recorded_fd
        echo(f"ID = {job_id}")
        echo_log_view(store, job_id, str(store.jobs_dir / job_id / "summary.txt"))

    store = open_store()
    job_id = submit_statement(stmt, store, runtime_progress(), None if detach else first_lines)
    if detach:
        echo(job_id)
        return 0
    return attach(store, job_id, from_end=False, progress=progress, recorded_fd=recorded)


def echo_log_view(store, job_id: str, summary_file: str) -> None:
    """The `Log view:` line: the job page's URL (the logview server is started,
    detached, if it is not running; nothing waits for it), or the summary file
    with a one-line note when no server can be had."""
    from paicli.web.launch import log_view_line

    line, note = log_view_line(store.home, job_id, summary_file)
    echo(f"Log view: {line}")
    if note:
        echo(note, err=True)


def attach(store, job_id: str, from_end: bool, progress: bool = True, recorded_fd: int = -1) -> int:
    """Follow a job to its end and render the verdict; Ctrl-C cancels it.
    `recorded_fd`: the pipe the master closes once the job's record is complete
    (client.hand_over), closed here."""
    from paicli import client, jobview, logtail
    from paicli.cluster.pluto.view import forecast_line

    out = logtail.binary_stdout()
    colour = logtail.use_colour(sys.stdout)

    def cancel() -> None:
        sys.stderr.write(f"\ncancelling {job_id} (Ctrl-C; press it again to stop waiting)...\n")
        client.kill(store, job_id, reason="cancelled (Ctrl-C)")

    status = logtail.follow_job(store, job_id, out, from_end=from_end, progress=progress, colour=colour,
                                on_interrupt=cancel, recorded_fd=recorded_fd)
    for line in jobview.summary_lines(status):
        echo(line)
    forecast = forecast_line(status)
    if forecast:
        echo(forecast)
    if status["status"] == "Failed":
        for event in store.events(job_id):
            if event["kind"] == "last-lines":
                echo(f"last lines of {event['role']}:{event['idx']}:")
                for line in event["message"].splitlines():
                    echo(f"  {line}")
    echo(jobview.verdict_line(status))
    return {"Succeeded": 0, "Cancelled": Cancelled.exit_code}.get(status["status"], 1)


def submit_tokens(args: list[str]) -> int:
    """`pai submit TOKENS`: split the submit options off, parse, submit and follow."""
    from paicli.statement import parse_statement

    tokens, options = split_submit_options(args)
    stmt = parse_statement(tokens)
    return submit_and_follow(stmt, options["detach"], not options["no_progress"])


# -- the error boundary and the exit ---------------------------------------------------------


def run_guarded(action: Callable[[], None]) -> None:
    """Known errors become one line on stderr and an exit code; tracebacks only
    with PAI_DEBUG=1."""
    debug = bool(os.environ.get("PAI_DEBUG"))
    try:
        if not os.environ.get("PAI_STORE") and (os.environ.get("PAI_NODES") or os.path.exists(
                os.path.join(os.path.expanduser(os.environ.get("PAI_HOME") or "~/.pai"), "nodes.yaml"))):
            from paicli.cluster.nodes import select_store   # only where a nodes file may name a store

            select_store()
        action()
    except PaiError as err:
        if debug:
            raise
        echo(f"pai: error: {err}", err=True)  # one line: what, where, and the fix
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.stderr.close()
        sys.exit(0)
    except Exception as err:
        if debug:
            raise
        echo(f"pai: internal error: {type(err).__name__}: {err} (run with PAI_DEBUG=1 for the traceback)", err=True)
        sys.exit(1)


def finish(action: Callable[[], None]) -> None:
    """`pai`: run the action inside the error boundary, then exit with its code,
    skipping the interpreter's clean-up (output is flushed here; the store commits
    as it goes) unless a thread, a profiler or tracer, or PAI_DEBUG=1 wants it."""
    import threading

    try:
        run_guarded(action)
        code: object = 0
    except SystemExit as exit_:
        code = exit_.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:   # None: started with that descriptor closed
                stream.flush()
        except (OSError, ValueError):
            pass   # a closed pipe (`pai ... | head`)
    if threading.active_count() > 1 or sys.getprofile() or sys.gettrace() or os.environ.get("PAI_DEBUG"):
        sys.exit(code)
    os._exit(code)
