"""The planner: enumerate strategies, forecast each, recommend one, say why.

`plan(profile, cluster, user)` considers, per framework:

- TensorFlow: ps 1..4, round-robin or greedy-by-size placement of the variables;
  the worker count too when the script's step target counts every worker's steps
  (global_step), since then more workers reach it sooner;
- MXNet: servers 1..4, big arrays sliced at MXNet's bound or at Pluto's (so the
  largest arrays spread over every server), 2bit compression or none;
- Caffe: the averaging period.

The worker count is the user's when each worker runs the script's steps on its own
shard (sync data parallelism): more workers would train on more data, which changes
what the job does, not how fast. Sync stays sync and async stays async for the same
reason. The recommendation is the fastest to the step target (or the most
samples/s when the script has none); among plans within 5% of it, the one with the
fewest instances, without compression, with the shortest averaging period. With a
budget: the cheapest plan that meets it, or why none does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paicli.cluster.pluto.model import forecast, ps_loads
from paicli.cluster.pluto.strategy import (GREEDY, MXNET_DEFAULT_BIGARRAY_BOUND, ROUND_ROBIN, SLICED, Cluster,
                                           Forecast, Profile, Strategy)

TIE = 0.05            # plans within 5% of the best count as equally fast
MAX_PS = 4
MAX_WORKERS = 8
MA_PERIODS = (1, 2, 5, 10, 20, 50, 100)


@dataclass
class Choice:
    strategy: Strategy
    forecast: Forecast

    def score(self) -> float:
        f = self.forecast
        return f.time_to_target_s if f.time_to_target_s is not None else 1.0 / max(f.samples_per_s, 1e-12)

    def to_json(self) -> dict[str, Any]:
        """A PLAN of `pai plan --json`: cluster, params, forecast_step_s (+ details)."""
        f = self.forecast
        return {"cluster": self.strategy.cluster_value(), "params": self.strategy.params(),
                "forecast_step_s": round(f.step_s, 6),
                "samples_per_s": round(f.samples_per_s, 3),
                "time_to_target_s": None if f.time_to_target_s is None else round(f.time_to_target_s, 3),
                "bottleneck": f.bottleneck, "ps_bytes": [round(b) for b in f.ps_bytes],
                "label": self.strategy.label()}


@dataclass
class Plan:
    recommended: Choice
    alternatives: list[Choice]
    reasons: list[str]
    default: Choice
    budget_s: float | None = None
    meets_budget: bool | None = None
    helpers: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"recommended": self.recommended.to_json(),
                "alternatives": [c.to_json() for c in self.alternatives],
                "reasons": list(self.reasons),
                "default": self.default.to_json(),
                "budget_s": self.budget_s, "meets_budget": self.meets_budget}


def candidates(profile: Profile, cluster: Cluster, user: Strategy) -> list[Strategy]:
    fw = profile.framework
    out: list[Strategy] = []
    if fw == "caffe":
        if user.workers <= 1:
            return [user]
        return [user.with_(ps=1, ma_period=p) for p in MA_PERIODS]
    max_workers = max(user.workers, min(MAX_WORKERS, int(cluster.total_cores)))
    worker_counts = range(1, max_workers + 1) if profile.target_global else (user.workers,)
    var_bytes = profile.var_bytes or (profile.param_bytes,)
    # On several nodes each instance asks a core (cpu 100), and placement refuses what
    # does not fit: only plans that fit are considered. One machine runs them all.
    fits = (lambda n: True) if len(cluster.nodes) <= 1 else \
        (lambda n: n <= max(user.instances, int(sum(int(node.cores) for node in cluster.nodes))))
    for workers in worker_counts:
        for ps in range(1, MAX_PS + 1):
            if not fits(ps + workers):
                continue
            if fw == "tensorflow":
                parts = (ROUND_ROBIN, GREEDY) if ps > 1 else (ROUND_ROBIN,)
                out += [Strategy(fw, ps, workers, partition=p, sync=profile.sync) for p in parts]
            elif fw == "mxnet":
                bounds: list[int | None] = [None]
                ours = pluto_bound(var_bytes, ps)
                if ps > 1 and ours < MXNET_DEFAULT_BIGARRAY_BOUND:
                    bounds.append(ours)
                for bound in bounds:
                    for comp in ("none", "2bit"):
                        out.append(Strategy(fw, ps, workers, partition=SLICED, big_array_bound=bound,
                                            compression=comp, threshold=user.threshold, sync=profile.sync))
            else:
                out.append(user.with_(ps=ps, workers=workers))
    return out


def pluto_bound(var_bytes, ps: int) -> int:
    """MXNet's slicing bound (elements) that splits every array bigger than a fair
    share of a server (the model / 2P) over all servers."""
    total = sum(var_bytes)
    return max(1, int(total / (2 * max(1, ps)) / 4))


def _rank_key(choice: Choice) -> tuple:
    s = choice.strategy
    return (s.instances, s.compression != "none", s.ma_period or 0, s.ps,
            s.partition != ROUND_ROBIN, choice.score())


COMPRESSION_GAIN = 0.10   # 2bit must save this much over the same plan uncompressed


def worth_it(choices: list[Choice]) -> list[Choice]:
    """Drop compressed plans that save under COMPRESSION_GAIN over the same plan
    uncompressed: compression changes the numbers the model trains on, so it is
    used only when the links really are the bottleneck."""
    plain = {c.strategy.with_(compression="none"): c for c in choices if c.strategy.compression == "none"}
    kept = []
    for c in choices:
        twin = plain.get(c.strategy.with_(compression="none")) if c.strategy.compression != "none" else None
        if twin is not None and c.score() > twin.score() * (1 - COMPRESSION_GAIN):
            continue
        kept.append(c)
    return kept


def recommend(choices: list[Choice]) -> Choice:
    choices = worth_it(choices) or choices
    best = min(c.score() for c in choices)
    near = [c for c in choices if c.score() <= best * (1 + TIE)]
    return min(near, key=_rank_key)


def plan(profile: Profile, cluster: Cluster, user: Strategy, budget_s: float | None = None) -> Plan:
    default = Choice(user, forecast(profile, user, cluster))
    choices = [Choice(s, forecast(profile, s, cluster)) for s in candidates(profile, cluster, user)]
    if not choices:
        choices = [default]
    rec = recommend(choices)
    meets = None
    reasons: list[str] = []
    if budget_s is not None:
        if profile.step_target is None:
            reasons.append("budget: the script's step target is unknown (no --steps, --max_steps or "
                           "max_iter found), so no plan can be judged against it; recommending the fastest")
        else:
            fitting = [c for c in worth_it(choices) if c.forecast.time_to_target_s <= budget_s]
            if fitting:
                rec = min(fitting, key=lambda c: (c.strategy.instances, c.strategy.compression != "none",
                                                  c.score()))
                meets = True
                reasons.append(f"budget {_dur(budget_s)}: the cheapest plan that meets it ({rec.strategy.instances} "
                               f"instances) reaches step {profile.step_target} in "
                               f"{_dur(rec.forecast.time_to_target_s)}")
            else:
                meets = False
                fastest = min(choices, key=Choice.score)
                reasons.append(f"budget {_dur(budget_s)}: no plan meets it; the fastest ({fastest.strategy.label()}) "
                               f"needs {_dur(fastest.forecast.time_to_target_s)} to step {profile.step_target}, "
                               f"limited by {fastest.forecast.bottleneck}")
    reasons += explain(profile, cluster, rec, default)
    alternatives = sorted((c for c in choices if c is not rec), key=Choice.score)
    return Plan(recommended=rec, alternatives=alternatives, reasons=reasons, default=default,
                budget_s=budget_s, meets_budget=meets)


def explain(profile: Profile, cluster: Cluster, rec: Choice, default: Choice) -> list[str]:
    """One line per decision, each with the measured fact behind it."""
    s, f = rec.strategy, rec.forecast
    mb = profile.param_bytes / 1e6
    lines = []
    speedup = default.score() / rec.score() if rec.score() else 1.0
    goal = "to the step target" if f.time_to_target_s is not None else "in samples/s"
    lines.append(f"cluster: {s.label()} on {cluster.source}: forecast {f.step_s:.3f} s/step, "
                 f"{f.samples_per_s:.1f} samples/s, {speedup:.2f}x faster {goal} than the default "
                 f"{default.strategy.label()}; model {mb:.1f} MB, step {_share(f)}")
    if s.framework in ("tensorflow", "mxnet"):
        if profile.target_global:
            lines.append(f"workers: {s.workers}: the step target counts every worker's steps, "
                         f"so the count is chosen by the forecast")
        else:
            lines.append(f"workers: {s.workers}, as given: each worker runs the script's steps on its "
                         f"own data, so more workers would change what is trained")
        if s.ps > 1:
            loads = f.ps_bytes
            rr = ps_loads(profile.var_bytes or (profile.param_bytes,), s.ps, ROUND_ROBIN)
            if s.partition == GREEDY:
                lines.append(f"partitioning: variables placed by size on the least-loaded ps (greedy): the "
                             f"fullest ps holds {max(loads) / 1e6:.2f} MB, round-robin {max(rr) / 1e6:.2f} MB")
            elif s.partition == SLICED:
                bound = s.big_array_bound or MXNET_DEFAULT_BIGARRAY_BOUND
                lines.append(f"partitioning: arrays over {bound:,} elements sliced across the {s.ps} servers; "
                             f"the fullest server holds {max(loads) / 1e6:.2f} MB")
            else:
                lines.append(f"partitioning: round-robin (TF's default) already balances: the fullest ps "
                             f"holds {max(loads) / 1e6:.2f} MB")
            biggest = max(profile.var_bytes or (profile.param_bytes,))
            if s.framework == "tensorflow" and biggest > 1.5 * profile.param_bytes / s.ps:
                lines.append(f"script change: one variable holds {biggest / 1e6:.2f} MB, more than a ps' "
                             f"share; split it with partitioner=pluto_helpers.tf_partitioner() in "
                             f"get_variable (one line)")
        else:
            lines.append("partitioning: one ps holds the whole model (more ps do not pay: "
                         f"{_share(f)})")
    if s.framework == "mxnet":
        if s.compression == "2bit":
            lines.append(f"compression: 2bit, threshold {s.threshold:g}: the links are the bottleneck "
                         f"(network {f.comm_s:.3f} s of {f.step_s:.3f} s per step); pushes shrink 16x")
        else:
            lines.append(f"compression: none: 2bit would save under {COMPRESSION_GAIN:.0%} "
                         f"(network {f.comm_s:.3f} s of {f.step_s:.3f} s per step)")
    if s.framework == "caffe" and s.workers > 1:
        lines.append(f"model averaging: every {s.ma_period} iterations: a round costs "
                     f"{f.comm_s * (s.ma_period or 1):.3f} s against {f.compute_s:.3f} s of compute per "
                     f"iteration; the shortest period within {TIE:.0%} of the fastest")
    lines.append(_scaling_line(profile, s))
    lines.append(f"sync/async: {'sync' if s.sync else 'async'}, as the script does: switching would "
                 f"change its convergence, not only its speed")
    return lines


def _scaling_line(profile: Profile, s: Strategy) -> str:
    if s.sync and s.workers > 1:
        return (f"batch/learning rate: {s.workers} workers x batch {s.batch_per_worker or profile.batch_size} = "
                f"global batch {s.workers * (s.batch_per_worker or profile.batch_size)}; linear scaling "
                f"would multiply the learning rate by {s.workers} with a warm-up; the script sets its own, "
                f"so call lr = pluto_helpers.learning_rate(base_lr, step) (one line) to apply it")
    return ("batch/learning rate: kept (linear scaling applies to sync data parallelism over several "
            "workers)")


def _share(f: Forecast) -> str:
    if f.step_s <= 0:
        return "nothing to share"
    return (f"{f.compute_s / f.step_s:.0%} compute, {f.comm_s / f.step_s:.0%} network, "
            f"{f.overhead_s / f.step_s:.0%} overhead")


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
