"""Pluto: the planner and its performance forecast.

    strategy.py   the typed Strategy (ps/worker counts, partitioning, compression,
                  averaging period, batch/LR scaling, sync/async) and the -D values it sets
    model.py      the cost model: forecast step time of a Strategy from a measured
                  Profile (calibration) and the Links between nodes. Pure functions.
    planner.py    enumerate alternatives, pick the recommended one (or, with a budget,
                  the cheapest that meets it), one line of reasoning per optimization
    calibrate.py  what a short calibration run measured -> Profile; the cache under
                  $PAI_HOME (0600); link bandwidth
    view.py       what `pai status`, the logview and the end-of-job summary show of a
                  planned job: its plan and forecast beside the measured step time

The user's side is paicli/pluto.py, `pai plan` paicli/cli_plan.py. Nothing here
imports an adapter or the CLI: frameworks are data here.
"""
