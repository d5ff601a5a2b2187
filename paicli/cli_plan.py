"""`pai plan` (Pluto: the planner and its forecast): parse, one call to the
planning library (paicli/pluto.py), render.

    pai plan -name tensorflow -Dscript=train.py [-D...] [--json] [--budget 10m]
    pai plan job.yaml [-Dkey=value ...] [--json] [--budget 10m]

Registered by paicli.cli; heavy imports stay inside the functions.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from paicli.cli_statement import StatementCommand
from paicli.commands import print_table, statement_of


# -- rendering ------------------------------------------------------------------------


def _dur(seconds) -> str:
    from paicli.cluster.pluto.planner import duration_text as dur
    return dur(seconds)


def _d_args(choice_json: dict) -> str:
    import shlex

    parts = [f"-Dcluster={shlex.quote(json.dumps(choice_json['cluster'], separators=(',', ':')))}"]
    parts += [f"-D{k}={shlex.quote(str(v))}" for k, v in choice_json["params"].items()]
    return " ".join(parts)


def render_text(result) -> list[str]:
    """The plan as text (a pluto.PlanResult): calibration, the recommendation, why."""
    data = result.plan.to_json()
    rec = data["recommended"]
    p = result.profile
    lines = []
    model = f"model {p.param_bytes / 1e6:.2f} MB in {len(p.var_bytes)} arrays" if p.var_bytes else "model size unknown"
    target = (f"step target {p.step_target} ({'all workers together' if p.target_global else 'per worker'})"
              if p.step_target else "no step target found")
    lines.append(f"calibration: {'cached' if result.cached else 'measured by ' + ', '.join(result.calibration_jobs)}; "
                 f"{model}, {p.compute_s_per_sample * 1000:.3f} ms compute per sample, batch {p.batch_size}, {target}")
    # a calibration run the fit could not use is said, with why (calibrate.build_profile)
    lines += [f"  note: {note}" for note in p.notes if "left out of the fit" in note]
    lines.append(f"recommended: {rec['label']} on {result.cluster.source}")
    lines.append(f"  {_d_args(rec)}")
    lines.append(f"  {_figure(rec)}, {rec['samples_per_s']:.1f} samples/s"
                 + (f", step target in {_dur(rec['time_to_target_s'])}" if rec["time_to_target_s"] is not None else ""))
    if result.verification:
        v = result.verification
        lines.append(f"verified: {len(v['jobs'])} plan{'s' if len(v['jobs']) != 1 else ''} run briefly through pai "
                     f"({v['why']}; jobs {', '.join(v['jobs'])}"
                     + (f", {v['cached']} from the cache" if v["cached"] else "") + ")")
    lines.append("why:")
    lines += [f"  - {reason}" for reason in data["reasons"]]
    lines.append("alternatives:")
    return lines


def _figure(choice_json: dict) -> str:
    """'measured 0.41 s/step (forecast 0.35)' or 'forecast 0.35 s/step'."""
    if choice_json.get("measured_step_s") is not None:
        return (f"measured {choice_json['measured_step_s']:.4f} s/step (job {choice_json['verify_job']}; "
                f"forecast {choice_json['forecast_step_s']:.4f})")
    return f"forecast {choice_json['forecast_step_s']:.4f} s/step"


def alternatives_rows(result) -> list[tuple[str, ...]]:
    """One row per plan; STEP(s) is the figure it is judged by, FIGURE says which."""
    data = result.plan.to_json()
    return [(mark, choice["label"], f"{choice['step_s']:.4f}", choice["figure"], f"{choice['samples_per_s']:.1f}",
             _dur(choice["time_to_target_s"]), choice["bottleneck"])
            for mark, choice in [("*", data["recommended"])] + [("", c) for c in data["alternatives"]]]


# -- the command ---------------------------------------------------------------------------


def _split_plan_options(tokens: tuple[str, ...]) -> tuple[list[str], bool, str | None, bool]:
    from paicli.errors import UsageError

    rest, as_json, budget, verify = [], False, None, True
    items = list(tokens)
    while items:
        token = items.pop(0)
        if token == "--json":
            as_json = True
        elif token == "--no-verify":
            verify = False
        elif token == "--budget":
            if not items:
                raise UsageError("--budget needs a duration", "e.g. --budget 10m")
            budget = items.pop(0)
        elif token.startswith("--budget="):
            budget = token.split("=", 1)[1]
        elif token.startswith("--"):
            raise UsageError(f"unknown option {token}", "options here: --json, --budget DURATION, --no-verify")
        else:
            rest.append(token)
    return rest, as_json, budget, verify


def register(cli: click.Group) -> None:
    @cli.command("plan", cls=StatementCommand, context_settings={"ignore_unknown_options": True})
    @click.argument("statement", nargs=-1, type=click.UNPROCESSED)
    def plan_command(statement):
        """Plan a job without submitting it: the cluster, the optimizations and the forecast.

        \b
        pai plan -name tensorflow -Dscript=train.py [-D...] [--json] [--budget 10m] [--no-verify]
        pai plan job.yaml [-Dkey=value ...] [--json] [--budget 10m] [--no-verify]

        Pluto runs the script briefly through pai (a calibration, cached per
        script and cluster) to measure its model size and compute per sample,
        then prints the recommended -Dcluster and -D values, one line per
        optimization and why, and the alternatives it considered with their
        forecast step time, samples/s and time to the script's step target.
        --budget: the cheapest plan that reaches the step target within it (or
        why none does). --json: {"recommended": PLAN, "alternatives": [...],
        "reasons": [...]}, each PLAN with cluster, params and forecast_step_s.
        On the nodes of the nodes file when one is set (their link rate
        measured by a probe job; PAI_PLUTO_BANDWIDTH=100mbit overrides it),
        else on this machine.

        When the best forecast is within 15% of other plans, or the plan lies
        outside the shapes calibration ran, those plans run briefly through pai
        (cached like calibration) and the recommendation goes by their measured
        step time; the output says which figures are measured and which
        forecast. --no-verify skips that; with --budget its runs count against
        the budget.
        """
        from paicli.errors import UsageError
        from paicli.pluto import make_plan
        from paicli.spec import Param, convert

        tokens, as_json, budget_text, verify = _split_plan_options(statement)
        budget_s = None
        if budget_text is not None:
            try:
                budget_s = convert(Param("budget", "duration"), budget_text, Path.cwd())
            except ValueError as err:
                raise UsageError(f"--budget: {err}", "e.g. --budget 10m") from None
        say = (lambda line: None) if as_json else (lambda line: click.echo(f"pluto: {line}", err=True))
        result = make_plan(statement_of(tokens), budget_s=budget_s, say=say, verify=verify)
        if as_json:
            click.echo(json.dumps(result.to_json(), indent=2, sort_keys=True))
            return
        click.echo("\n".join(render_text(result)))
        print_table(("", "PLAN", "STEP(s)", "FIGURE", "SAMPLES/S", "TO TARGET", "BOUND BY"), alternatives_rows(result))
