"""Measured seconds per step: `step_seconds` in `pai status --json`, what Pluto's
calibration measures and what its forecast is checked against.

The master stores each metric line with its step and the time it was read, so one
rule fits every framework: per training instance, the seconds between step lines
divided by the steps between them, over stretches of at least MIN_SPAN_S, the first
interval dropped; the instance's median; then the median over instances. An
instance with fewer than two intervals falls back to the framework's own timing (a
per-step `duration`, or Caffe's `iter_per_s`).
"""

from __future__ import annotations

from collections.abc import Iterable


def median(values: list[float]) -> float:
    """statistics.median, without importing statistics (fractions, decimal,
    random) on the path of every `pai`. The project's one median (Pluto's
    calibration uses it too)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


TRAINING_ROLES = ("worker", "chief")


# The shortest stretch of time one rate is taken over: a step line is stored with the
# time the master read it, and lines close together are read at once, so intervals
# are joined until they span this long.
MIN_SPAN_S = 0.05


def instance_step_seconds(points: Iterable[tuple[float, float]]) -> float | None:
    """Median seconds per step from (step, time) points in the order they were read,
    each rate over at least MIN_SPAN_S (consecutive intervals joined), the first
    interval dropped. A step going backwards (a restarted attempt) starts the series
    again."""
    rates: list[float] = []
    previous = None
    first = True
    span_steps, span_s = 0.0, 0.0
    for step, ts in points:
        if previous is not None:
            dstep, dts = step - previous[0], ts - previous[1]
            if dstep < 0:
                previous, first = (step, ts), True
                span_steps, span_s = 0.0, 0.0
                continue
            if dstep == 0:
                continue
            if not first:
                span_steps, span_s = span_steps + dstep, span_s + max(0.0, dts)
                if span_s >= MIN_SPAN_S:
                    rates.append(span_s / span_steps)
                    span_steps, span_s = 0.0, 0.0
            first = False
        previous = (step, ts)
    if span_steps and (not rates or span_s >= MIN_SPAN_S / 2):
        rates.append(span_s / span_steps)   # the tail: whole when it is all there is, else if not a sliver
    return median(rates) if rates else None


def from_timing(values: dict[str, list[float]]) -> float | None:
    """The framework's own per-step timing, when step lines were too few."""
    durations = [v for v in values.get("duration", []) if v > 0]
    if durations:
        return median(durations[1:] or durations)
    rates = [v for v in values.get("iter_per_s", []) if v > 0]
    if rates:
        return 1.0 / median(rates)
    return None


def step_seconds(points: dict[str, list[tuple[float, float]]],
                 timing: dict[str, dict[str, list[float]]]) -> float | None:
    """The median over training instances (named "role:index") of their seconds per step."""
    per_instance = []
    for name in sorted(set(points) | set(timing)):
        value = instance_step_seconds(points.get(name, []))
        if value is None:
            value = from_timing(timing.get(name, {}))
        if value is not None:
            per_instance.append(value)
    return median(per_instance) if per_instance else None


def job_step_seconds(store, job_id: str, roles: tuple[str, ...] = TRAINING_ROLES) -> float | None:
    """step_seconds of a job, read from its stored metrics (two small queries)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for row in store.step_points(job_id, roles):
        points.setdefault(f"{row[0]}:{row[1]}", []).append((row[2], row[3]))
    timing: dict[str, dict[str, list[float]]] = {}
    for row in store.metric_values(job_id, ("duration", "iter_per_s"), roles):
        timing.setdefault(f"{row[0]}:{row[1]}", {}).setdefault(row[2], []).append(row[3])
    return step_seconds(points, timing)
