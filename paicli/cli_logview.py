"""`pai logview` and `pai plot` (the logview page, curves in the terminal).

Registered by paicli.cli; keep heavy imports inside the commands.
"""

from __future__ import annotations

import os
import re
import sys

import click

from paicli.errors import NotFound, UsageError

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PLAIN_MARKERS = ("*", "+", "o", "x", "#", "@", "%", "=")
STEP_KEYS = ("step", "iteration", "global_step")


def metric_series(store, job_id: str, metric: str | None, instances: tuple[str, ...]) -> tuple[str, dict]:
    """(metric, {instance: [(step, value), ...]}) for a plot: the metric asked for
    (default: loss, else the first one that is not a step counter), of the instances
    asked for (default: every instance that has it)."""
    rows = store.step_metrics(job_id)
    keys = list(dict.fromkeys(row["key"] for row in rows if row["key"] not in STEP_KEYS))
    if not keys:
        raise NotFound(f"job {job_id} has no metrics yet",
                       "metrics are key=number pairs in its log lines, e.g. step=3, loss=0.5")
    if metric is None:
        metric = "loss" if "loss" in keys else keys[0]
    elif metric not in keys:
        raise UsageError(f"--metric {metric}: job {job_id} has no such metric", f"it has {', '.join(keys)}")
    series: dict[str, list] = {}
    for row in rows:
        if row["key"] == metric:
            series.setdefault(f"{row['role']}:{row['idx']}", []).append((row["step"], row["value"]))
    if instances:
        missing = [name for name in instances if name not in series]
        if missing:
            raise UsageError(f"--instance {missing[0]}: no {metric} values from it",
                             f"instances with {metric}: {', '.join(series)}")
        series = {name: series[name] for name in instances}
    else:
        series = dict(sorted(series.items()))
    return metric, series


def render_plot(series: dict, metric: str, title: str, *, colour: bool, width: int, height: int) -> str:
    """The curves as text (plotext): coloured braille on a terminal, plain
    characters (one marker per instance, no escape codes) otherwise."""
    import plotext as plt

    plt.clear_figure()
    plt.plotsize(width, height)
    if not colour:
        plt.theme("clear")
    for i, (name, points) in enumerate(series.items()):
        plt.plot([p[0] for p in points], [p[1] for p in points], label=name,
                 marker="braille" if colour else PLAIN_MARKERS[i % len(PLAIN_MARKERS)])
    plt.title(title)
    plt.xlabel("step")
    text = plt.build()
    if not colour:
        text = "\n".join(ANSI.sub("", line).rstrip() for line in text.splitlines())
    return text


def register(cli: click.Group) -> None:
    @cli.command()
    @click.argument("job_id", required=False)
    @click.option("--stop", is_flag=True, help="Stop your logview server (it also stops by itself when idle).")
    def logview(job_id, stop):
        """Print the URL of a job's logview page (or of the job list).

        The page shows the job's instance block, the Fuxi summary, every
        instance, the events, each instance's log tail and live loss curves. It
        is served by your own logview server on 127.0.0.1 (PAI_LOGVIEW_HOST
        changes that), started here when it is not running and gone after
        PAI_LOGVIEW_IDLE seconds (default 900) without use. Every URL carries
        your token (kept 0600 under $PAI_HOME/logview; it lasts 7 days and is
        new whenever the server's port changes).
        """
        from paicli import client
        from paicli.store import Store
        from paicli.web import launch

        store = Store()
        if stop:
            stopped = launch.stop_server(store.home)
            click.echo("logview server stopped" if stopped else "no logview server was running")
            return
        job = client.resolve_job(store, job_id)["id"] if job_id else None
        click.echo(launch.url_for(launch.ensure_server(store.home), job))

    @cli.command()
    @click.argument("job_id")
    @click.option("--metric", "-m", help="The metric to draw (default: loss, else the first one).")
    @click.option("--instance", "-i", multiple=True, help="Only this instance, e.g. worker:0 (repeatable).")
    @click.option("--width", type=click.IntRange(min=20), help="Columns (default: the terminal's, or 80).")
    @click.option("--height", type=click.IntRange(min=5), default=20, show_default=True, help="Rows.")
    def plot(job_id, metric, instance, width, height):
        """Draw a job's metric against step in the terminal, one curve per instance.

        Coloured on a terminal; plain characters when piped (no escape codes).
        """
        from paicli import client
        from paicli.logtail import use_colour
        from paicli.store import Store

        store = Store()
        job = client.resolve_job(store, job_id)
        metric, series = metric_series(store, job["id"], metric, instance)
        colour = use_colour(sys.stdout)
        if width is None:
            width = os.get_terminal_size().columns if sys.stdout.isatty() else 80
        click.echo(render_plot(series, metric, f"{metric} of {job['id']} ({job['status']})",
                               colour=colour, width=width, height=height))
