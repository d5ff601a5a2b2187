"""The `pai` command. Thin: parse, make one library call, render.

    pai -name tensorflow -Dscript=file:///x/train.py -Dcluster='{"worker":{"count":2}}'
    pai run job.yaml
    pai status|wait|logs|kill|list ...

Heavy modules (the launcher, rich, yaml) are imported inside the commands that
need them, so `pai --help` starts fast.
"""

from __future__ import annotations

import os
import sys
import time

import click

from paicli import __version__, cli_logview, cli_nodes, cli_outputs, cli_plan
from paicli import cli_queue, cli_scale, cli_serve, cli_tune
from paicli.cli_statement import StatementCommand
from paicli.cli_tokens import is_bare_statement
from paicli.commands import (attach, echo_json, echo_log_view, finish, open_store, print_table, run_guarded,
                             runtime_progress, split_submit_options, statement_of, submit_and_follow, submit_tokens)
from paicli.errors import PaiError, UsageError


def _runtime(name: str):
    from paicli.runners.runtimes import RUNTIMES, get_runtime

    if name not in RUNTIMES:
        raise UsageError(f"no runtime named {name!r}", f"known: {', '.join(RUNTIMES)}")
    return get_runtime(name)


# -- the command group ------------------------------------------------------------


class PaiGroup(click.Group):
    """A group that also accepts PAI statements: `pai -name X -Dk=v ...`."""

    def parse_args(self, ctx, args):
        # `pai -name ...`, and `pai --detach -name ...` with submit options in front
        # (paicli.pai sends these past click; callers of cli.main still come here).
        if is_bare_statement(args):
            args = ["submit", *args]
        return super().parse_args(ctx, args)


@click.group(cls=PaiGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="pai")
def cli():
    """Submit and follow distributed deep-learning jobs, PAI style.

    \b
    Submit a job as in the PAI console (a trailing ; is fine):
      pai -name tensorflow -Dscript=file:///home/me/train.py \\
          -Dcluster='{"ps":{"count":1},"worker":{"count":2}}'
    or from a YAML file:
      pai run job.yaml -DmaxRetries=1

    The job runs under its own supervisor: closing the terminal does not stop
    it. `pai wait ID` re-attaches, `pai kill ID` cancels. Add --detach to
    return as soon as the job is started. `pai params` lists every -D key.

    \b
    Exit codes: 0 job succeeded, 1 job failed, 2 bad input, 130 cancelled.
    Environment: PAI_HOME (job store, default ~/.pai), NO_COLOR, PAI_DEBUG=1
    (show tracebacks).
    """


@cli.command(cls=StatementCommand, context_settings={"ignore_unknown_options": True})
@click.argument("statement", nargs=-1, type=click.UNPROCESSED)
def submit(statement):
    """Submit a PAI statement: -name FRAMEWORK [-project P] -Dkey=value ...

    This is what `pai -name ...` runs. Options: --detach (print the job ID and
    return), --no-progress (no progress lines).
    """
    sys.exit(submit_tokens(list(statement)))


@cli.command("run", cls=StatementCommand)
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--detach", "-d", is_flag=True, help="Print the job ID and return.")
@click.option("--no-progress", is_flag=True, help="Do not print progress lines.")
def run_job_file(job_file, overrides, detach, no_progress):
    """Run the job described by JOB_FILE (YAML); -Dkey=value overrides its values.

    \b
    Keys are PAI's names or their snake_case forms (max_retries = maxRetries);
    `name:` is the framework. Relative paths are relative to the file's folder.
      name: python
      script: train.py
      cluster: {ps: {count: 1}, worker: {count: 2}}
    """
    from paicli.statement import load_job_file, merge_overrides, parse_statement

    overrides, options = split_submit_options(overrides)
    stmt = load_job_file(job_file)
    if overrides:
        stmt = merge_overrides(stmt, parse_statement(overrides, require_name=False))
    sys.exit(submit_and_follow(stmt, detach or options["detach"], not (no_progress or options["no_progress"])))


@cli.command(cls=StatementCommand, context_settings={"ignore_unknown_options": True})
@click.argument("statement", nargs=-1, type=click.UNPROCESSED)
def export(statement):
    """Print the YAML job file for a statement (the same arguments as a submit).

    `pai export -name python -Dscript=x.py > job.yaml` then `pai run job.yaml`
    runs the identical job. Paths are written absolute.
    """
    from paicli import client

    click.echo(client.export_yaml(client.prepare(statement_of(list(statement)))), nl=False)


@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(job_id, as_json):
    """Show a job's state, its tasks (Fatal/Finished/Total) and instances."""
    from paicli import client, jobview

    store = open_store()
    job_id = client.resolve_job(store, job_id)["id"]
    st = client.status(store, job_id, with_series=as_json)
    if as_json:  # log_view as the text form prints it (the page's URL); summary_file is always the file
        from paicli.web.launch import log_view_line

        st["summary_file"] = st["log_view"]
        st["log_view"], note = log_view_line(store.home, job_id, st["summary_file"])
        if note:
            click.echo(note, err=True)
        echo_json(st)
        return
    click.echo(f"ID = {st['id']}  {st['name']}  ({st['framework']})")
    click.echo(f"Status: {st['status']}" + (f"  {st['reason']}" if st["reason"] else ""))
    if st["url"]:
        click.echo(f"Serving: {st['url']}" + (f"  (clients send `Authorization: Bearer {st['token']}`)"
                                               if st.get("token") else ""))
    echo_log_view(store, job_id, st["log_view"])
    for line in jobview.notice_lines(st):  # idle workers, servers reachable from outside
        click.echo(line)
    click.echo("\n" + "\n".join(jobview.summary_lines(st)) + "\n")
    rows = []
    for inst in st["instances"]:
        name = f"{inst['role']}:{inst['index']}"
        metrics = ", ".join(f"{k}={v:g}" for k, v in list(st["metrics"].get(name, {}).items())[:4])
        rows.append((name, inst["status"], "" if inst["exit_code"] is None else str(inst["exit_code"]),
                     str(inst["attempts"]), inst.get("node") or "", inst.get("host") or "", str(inst["pid"] or ""),
                     str(inst["port"] or ""), metrics))
    print_table(("Instance", "Status", "Exit", "Attempts", "Node", "Host", "PID", "Port", "Last metrics"), rows)
    from paicli.cluster.pluto.view import status_lines

    pluto = status_lines(st)
    if pluto:
        click.echo("\n" + "\n".join(pluto))


@cli.command()
@click.argument("job_id")
@click.option("--no-progress", is_flag=True, help="Do not print progress lines.")
def wait(job_id, no_progress):
    """Re-attach to a job: follow its lines from now to its end.

    Exits like the job: 0 succeeded, 1 failed, 130 cancelled.
    """
    from paicli import client

    store = open_store()
    job = client.resolve_job(store, job_id)
    echo_log_view(store, job["id"], os.path.join(job["job_dir"], "summary.txt"))
    sys.exit(attach(store, job["id"], from_end=True, progress=not no_progress))


@cli.command()
@click.argument("job_id")
@click.option("--instance", "-i", help="One instance's log, e.g. worker:1 (default: every instance, prefixed).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--tail", "-n", type=click.IntRange(min=0), help="Only the last N lines.")
@click.option("--attempt", type=click.IntRange(min=0), help="With --instance: that attempt (default: the latest).")
@click.option("--json", "as_json", is_flag=True,
              help='One JSON object a line: {"instance": "worker:1", "line": "..."}.')
def logs(job_id, instance, follow, tail, attempt, as_json):
    """Print a job's log, or one instance's."""
    from paicli import client, logtail
    from paicli.logview import log_path, print_log

    store = open_store()
    job = client.resolve_job(store, job_id)
    path = log_path(store, job, instance, attempt)
    print_log(store, job["id"], path, logtail.binary_stdout(), tail=tail, follow=follow,
              colour=logtail.use_colour(sys.stdout) and instance is None, as_json=as_json, instance=instance)


@cli.command()
@click.argument("job_id")
def kill(job_id):
    """Cancel a job: every instance is stopped (SIGTERM, then SIGKILL) within 5 s."""
    from paicli import client

    store = open_store()
    job = client.resolve_job(store, job_id, to="kill")
    if client.kill(store, job["id"]):
        ended = store.job(job["id"])   # a job whose master was gone is recorded lost, not cancelled
        click.echo(f"{job['id']} cancelled" if ended["status"] == "Cancelled" else
                   f"{job['id']} recorded {ended['status']}: {ended['reason']}")
    else:
        click.echo(f"{job['id']} had already ended ({client.refresh(store, job['id'])['status']})")


@cli.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON.")
@click.option("--limit", "-n", default=50, show_default=True, type=click.IntRange(min=1), help="How many jobs.")
@click.option("--all", "everyone", is_flag=True,
              help="Every user's jobs in a team store (PAI_STORE): user, project, state, where, since.")
def list_(as_json, limit, everyone):
    """List recent jobs, newest first (like PAI's `show instances`): one's own in a
    team store (PAI_STORE), --all the team's."""
    from paicli import client

    jobs = client.list_jobs(open_store(), limit, everyone)
    if as_json:
        echo_json(jobs)
        return
    if everyone:
        print_table(("User", "Project", "Status", "InstanceID", "Name", "Where", "Since"),
                    [(job["user"] or "", job["project"] or "", job["status"], job["id"], job["name"] or "",
                      ",".join(job["nodes"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["start_time"])))
                     for job in jobs])
        return
    # A Waiting job's reason (its place in the queue) and a service's URL are last
    # columns, shown only when a job has one.
    waiting = any(job["status"] == "Waiting" and job["reason"] for job in jobs)
    serving = any(job["url"] for job in jobs)
    print_table(("StartTime", "RunTime", "Status", "InstanceID", "Name", "Framework", *(("Reason",) if waiting else ()),
                 *(("URL",) if serving else ())),
                [(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["start_time"])),
                  f"{job['run_time']:.0f}s", job["status"], job["id"], job["name"] or "", job["framework"],
                  *((job["reason"] or "" if job["status"] == "Waiting" else "",) if waiting else ()),
                  *((job["url"] or "",) if serving else ()))
                 for job in jobs])


@cli.command()
@click.option("--name", "-n", "framework", help="Also list this framework's own parameters.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def params(framework, as_json):
    """List the -D parameters: name, YAML name, type, default, meaning."""
    from paicli.docs import param_rows

    rows = param_rows(framework)
    if as_json:
        echo_json(rows)
        return
    for row in rows:
        default = "" if row["default"] is None else f" (default {row['default']})"
        click.echo(f"-D{row['name']}  [{row['kind']}]{default}  yaml: {row['yaml']}  ({row['scope']})")
        click.echo(f"    {row['help']}")


@cli.group()
def runtime():
    """Framework runtimes: install, list, remove (cached under ~/.cache/paicli)."""


@runtime.command("install")
@click.argument("name")
@click.option("--node", help="Provision it on this node of the nodes file instead (over SSH).")
def runtime_install(name, node):
    """Provision a framework's runtime now (jobs also do it on first use)."""
    from paicli.runners.runtimes import RuntimeSetupError

    rt = _runtime(name)
    if node:
        from paicli.cli_nodes import install_on_node

        path = install_on_node(name, node, runtime_progress())
        click.echo(f"{name}: ready on {node} at {path} ({rt.version})")
        return
    try:
        rt.ensure(runtime_progress())
    except RuntimeSetupError as err:
        raise PaiError(str(err)) from None
    info = rt.info()
    click.echo(f"{name}: ready at {info['path']} ({info['version']})")


@runtime.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def runtime_list(as_json):
    """Show each runtime (installed or not, path, version, size) and each
    requirements layer (its runtime, size, last use, the packages it adds)."""
    from paicli.adapters.tensorflow import names_by_runtime
    from paicli.cli_runtime import layer_line, layer_rows
    from paicli.runners.runtimes import RUNTIMES, get_runtime

    infos = []
    for name in RUNTIMES:
        try:
            infos.append(get_runtime(name).info())
        except Exception as err:  # one broken runtime must not hide the others
            infos.append({"name": name, "installed": False, "path": "", "version": "", "size": None,
                          "source": f"unavailable: {err}"})
    layers = layer_rows()
    selected_by = names_by_runtime()
    for info in infos:
        info["names"] = selected_by.get(info["name"], [])
    if as_json:
        echo_json([{"kind": "runtime", **info} for info in infos] + layers)
        return
    for info in infos:
        size = f"{info['size'] / 1e6:.0f} MB" if info.get("size") else "-"
        state = "installed" if info["installed"] else "not installed"
        click.echo(f"{info['name']:<11} {state:<14} {size:>8}  {info['version']}  {info['path']}  [{info['source']}]")
        if info["names"]:
            click.echo(f"{'':<11} -name {' '.join(info['names'])}")
    for row in layers:
        click.echo(layer_line(row))


@runtime.command("remove")
@click.argument("name")
def runtime_remove(name):
    """Delete a provisioned runtime or a requirements layer (`pai runtime list` names
    them); the next job that needs it builds it again. Refused while a job uses it."""
    from paicli.cli_runtime import remove_layer
    from paicli.runners.runtimes import RUNTIMES, RuntimeSetupError

    if name not in RUNTIMES and "-" in name:   # a layer's name (runtimes have none)
        removed = remove_layer(name)
        click.echo(f"{removed}: removed" if removed else f"{name}: was not there")
        return
    try:
        removed = _runtime(name).remove()
    except RuntimeSetupError as err:  # in use by a running job
        raise PaiError(str(err)) from None
    click.echo(f"{name}: removed" if removed else f"{name}: was not installed")


@cli.command()
@click.option("-project", "--project", "project", help="The project of this session (`use P;` changes it).")
def console(project):
    """An interactive console like odpscmd: statements end in ; and may span lines.

    \b
      pai@ test8> pai -name python -Dscript=train.py
                >   -Dcluster={"ps":{"count":1},"worker":{"count":2}};
      pai@ test8> show instances;
      pai@ test8> desc instance 20261122...;
      pai@ test8> set maxRetries=1;
      pai@ test8> quit;

    Type help; for every statement. Tab completes statements, frameworks, -D
    keys and recent job IDs; history is kept in $PAI_HOME/console_history.
    Ctrl-C clears the line or cancels the job being followed; Ctrl-D quits.
    """
    from paicli.console import run_console

    sys.exit(run_console(project, commands=cli))


# Commands that live in rooms of their own (multi-host nodes, the Pluto planner,
# the logview page and plots); each module imports its heavy dependencies inside
# its commands, so `pai --help` stays fast.
for _module in (cli_nodes, cli_plan, cli_logview, cli_queue, cli_tune, cli_outputs, cli_scale, cli_serve):
    _module.register(cli)


# -- the error boundary ---------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """`pai` through click (paicli.pai.main sends a bare statement past it). Click's
    own errors become one line and exit code 2; ours go through the shared boundary
    (commands.run_guarded)."""
    finish(lambda: run_guarded(lambda: _run_click(argv)))


def _run_click(argv: list[str] | None) -> None:
    try:
        cli.main(args=argv, prog_name="pai", standalone_mode=False)
    except click.exceptions.Exit as exit_:
        sys.exit(exit_.exit_code)
    except click.ClickException as err:
        err.show()
        sys.exit(2 if isinstance(err, click.UsageError) else err.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
