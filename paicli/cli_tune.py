"""`pai tune`: a hyperparameter sweep whose trials are paicli jobs. Parse, one call
into paicli/tune.py, render (a live table on a terminal, plain lines in a pipe).

    pai tune job.yaml --space space.yaml [--trials N] [--parallel P] [--metric loss] [--mode min]
    pai tune -name python -Dscript=train.py --space space.yaml ...
    pai tune status STUDY [--json]      re-attach (follows a running study to its end)
    pai tune list [--json]
    pai tune stop STUDY

Registered by paicli.cli; Optuna is imported only by the study's creation and its tuner.
"""

from __future__ import annotations

import sys
import time

import click

from paicli.cli_statement import StatementCommand
from paicli.commands import echo, echo_json, open_store, print_table, statement_of

FOLLOW_EVERY = 0.5
EXIT = {"Succeeded": 0, "Cancelled": 130}


class TuneGroup(click.Group):
    """`pai tune ARGS` is `pai tune start ARGS` unless ARGS begins with a subcommand."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["start", *args]
        return super().parse_args(ctx, args)


# -- rendering -------------------------------------------------------------------------


def _fmt(value) -> str:
    if value is None:
        return ""
    return f"{value:.5g}" if isinstance(value, float) else str(value)


def params_text(params: dict) -> str:
    return " ".join(f"{k}={_fmt(v)}" for k, v in params.items())


def best_line(view: dict) -> str:
    best = view["best"]
    if not best:
        return "best so far: none yet"
    return f"best so far: trial {best['number']} {view['metric']}={_fmt(best['value'])} ({params_text(best['params'])})"


def table_rows(view: dict) -> list[tuple[str, ...]]:
    rows = []
    for t in view["trials"]:
        rows.append((str(t["number"]), t["state"], "" if t["step"] is None else f"{t['step']:g}",
                     _fmt(t["value"]), _fmt(t["best"]), params_text(t["params"]), t["job_id"] or ""))
    return rows


HEADERS = ("Trial", "State", "Step", "Value", "Best", "Params", "Job")


def rich_table(view: dict):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    styles = {"Complete": "green", "Running": "cyan", "Waiting": "yellow", "Pruned": "magenta",
              "Failed": "red", "Cancelled": "red"}
    table = Table(box=None, pad_edge=False, title=f"study {view['name']}: {view['metric']} ({view['mode']}), "
                  f"{len(view['trials'])}/{view['trials_planned']} trials, {view['pruned']} pruned", title_justify="left")
    for header in HEADERS:
        table.add_column(header.replace("Value", view["metric"]), no_wrap=True)
    for row in table_rows(view):
        table.add_row(*(Text(cell, style=styles.get(cell, "")) for cell in row))
    return Group(table, Text(best_line(view)))


def trial_line(view: dict, t: dict) -> str:
    line = f"trial {t['number']}: {t['state']}"
    if t["state"] in ("Waiting", "Running"):
        line += f"  {params_text(t['params'])}" + (f"  job {t['job_id']}" if t["job_id"] else "")
    elif t["state"] == "Complete":
        line += f"  {view['metric']}={_fmt(t['value'])} at step {_fmt(t['step'])}; {best_line(view)}"
    elif t["state"] == "Pruned":
        line += f" {t['reason'] or ''}  {view['metric']}={_fmt(t['value'])}"
    elif t["reason"]:
        line += f": {t['reason']}"
    return line


def final_lines(view: dict) -> list[str]:
    states = [t["state"] for t in view["trials"]]
    counts = ", ".join(f"{states.count(s)} {s.lower()}" for s in ("Complete", "Pruned", "Failed", "Cancelled")
                       if states.count(s))
    # Bad input (code 2) is said once, on stderr, by the caller.
    reason = view["reason"] if view["reason"] and view["code"] != 2 else ""
    lines = [f"study {view['name']}: {view['status']}" + (f" ({reason})" if reason else "")
             + f"; {len(states)} trials" + (f" ({counts})" if counts else "")]
    if view["note"]:
        lines.append(view["note"])
    best = view["best"]
    if best:
        lines.append(f"best: trial {best['number']} {view['metric']}={_fmt(best['value'])}  "
                     f"{params_text(best['params'])}  (job {best['job_id']})")
    if view["rerun"]:
        lines.append(f"rerun: {view['rerun']}")
    return lines


# -- following a study -------------------------------------------------------------------


def follow(store, name: str) -> int:
    """Show the study until it ends; Ctrl-C stops it (a second one stops watching)."""
    from paicli import tune

    stopping = False

    def look_again():
        nonlocal stopping
        try:
            time.sleep(FOLLOW_EVERY)
        except KeyboardInterrupt:
            if stopping:
                raise
            stopping = True
            echo(f"stopping study {name} (Ctrl-C; press it again to stop waiting)...", err=True)
            tune.stop(store, name)
        return tune.study_view(store, name)

    view = tune.study_view(store, name)
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.live import Live

        with Live(rich_table(view), console=Console(), refresh_per_second=4, auto_refresh=False) as live:
            while not view["over"]:
                view = look_again()
                live.update(rich_table(view), refresh=True)
    else:
        shown: dict[int, str] = {}
        while True:
            for t in view["trials"]:
                if shown.get(t["number"]) != t["state"]:
                    shown[t["number"]] = t["state"]
                    echo(trial_line(view, t))
            if view["over"]:
                break
            view = look_again()
    for line in final_lines(view):
        echo(line)
    if view["status"] == "Failed" and view["code"] == 2:
        echo(f"pai: error: {view['reason']}", err=True)
    return EXIT.get(view["status"], view["code"] or 1)


# -- the commands --------------------------------------------------------------------------


def register(cli: click.Group) -> None:
    @cli.group("tune", cls=TuneGroup)
    def tune_group():
        """Hyperparameter sweeps (Optuna): every trial is an ordinary paicli job.

        \b
        pai tune job.yaml --space space.yaml [--trials 20] [--parallel 1]
                 [--metric loss] [--mode min|max] [--budget 2h] [--storage URL]
                 [--sampler tpe|random|grid] [--pruner median|sha|hyperband|none]
                 [--seed N] [--study NAME] [--detach]
        pai tune -name python -Dscript=train.py ... --space space.yaml
        pai tune status STUDY [--json]    re-attach to a study (or show a finished one)
        pai tune list [--json]            the studies
        pai tune stop STUDY               stop a study (its running trials are cancelled)

        \b
        space.yaml, one entry per parameter:
          lr:     {type: loguniform, low: 1e-5, high: 1e-1}
          wd:     {type: uniform, low: 0.0, high: 0.1}
          layers: {type: int, low: 1, high: 4}
          opt:    {type: choice, values: [sgd, adam]}
        A parameter that names a -D key (batchSize) sets it; any other reaches the
        script as --name=value. Intermediate values are the metric lines the job
        prints (`step=3, loss=0.25`); a pruned trial is cancelled and shown Pruned.
        The study is kept in $PAI_HOME/studies/NAME (Optuna's SQLite file there,
        unless --storage). Needs the `tune` extra: pip install 'paicli[tune]'.
        """

    @tune_group.command("start", cls=StatementCommand, context_settings={"ignore_unknown_options": True},
                        hidden=True)
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def start(args):
        """Start a sweep (what `pai tune STATEMENT_OR_JOB.yaml --space ...` runs)."""
        from paicli import tune

        tokens, opts = tune.split_options(list(args))
        if not tokens:
            from paicli.errors import UsageError

            raise UsageError("missing the job: a job YAML file or a statement",
                             "e.g. pai tune job.yaml --space space.yaml")
        _need_optuna()
        store = open_store()
        name = tune.create(statement_of(tokens), opts, store, say=lambda line: echo(line, err=True))
        if opts.detach:
            echo(name)
            return
        echo(f"study = {name}   (pai tune status {name} re-attaches)")
        echo_study_url(store, name)
        sys.exit(follow(store, name))

    @tune_group.command("status")
    @click.argument("study")
    @click.option("--json", "as_json", is_flag=True, help="Print the study as JSON (once) instead of following it.")
    def status(study, as_json):
        """Re-attach to a study: its table until it ends, then the best trial."""
        from paicli import tune

        store = open_store()
        if as_json:
            echo_json(tune.study_view(store, study))
            return
        store.study(study)
        echo_study_url(store, study)
        sys.exit(follow(store, study))

    @tune_group.command("list")
    @click.option("--json", "as_json", is_flag=True, help="Print the studies as JSON.")
    def list_studies(as_json):
        """The studies, newest first."""
        from paicli import tune

        store = open_store()
        views = [tune.study_view(store, row["name"]) for row in store.studies()]
        if as_json:
            echo_json([{k: v[k] for k in ("name", "status", "metric", "best", "pruned", "trials_planned")}
                       for v in views])
            return
        print_table(("Study", "Status", "Trials", "Pruned", "Best"),
                    [(v["name"], v["status"], f"{len(v['trials'])}/{v['trials_planned']}", str(v["pruned"]),
                      f"{v['metric']}={_fmt(v['best']['value'])}" if v["best"] else "") for v in views])

    @tune_group.command("stop")
    @click.argument("study")
    def stop_study(study):
        """Stop a study: no new trials, its running trials cancelled."""
        from paicli import tune

        store = open_store()
        if tune.stop(store, study):
            echo(f"study {study}: stopping")
        else:
            echo(f"study {study}: not running ({tune.study_view(store, study)['status']})")


def echo_study_url(store, name: str) -> None:
    """`Log view:` the study's page (nothing with PAI_LOGVIEW=file)."""
    from paicli.web.study import study_url_line

    url, note = study_url_line(store.home, name)
    if url:
        echo(f"Log view: {url}")
    if note:
        echo(note, err=True)


def _need_optuna() -> None:
    import importlib.util

    from paicli.errors import PaiError

    if importlib.util.find_spec("optuna") is None:
        raise PaiError("pai tune needs Optuna, which is not installed", "pip install 'paicli[tune]'")
