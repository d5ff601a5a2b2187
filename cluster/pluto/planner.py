"""The planner: enumerate strategies, forecast each, recommend one, say why.

`plan(profile, cluster, user)` considers, per framework:

- TensorFlow: ps 1..4, round-robin or greedy-by-size placement of the variables;
  the worker count too when the script's step target counts every worker's steps
  (global_step), since then more workers reach it sooner;
- MXNet: servers 1..4, big arrays sliced at MXNet's bound or at Pluto's (so the
  largest arrays spread over every server), 2bit compression or none;
- Caffe: the averaging period.

The worker count is otherwise the user's (more workers would train on more data).
Sync and async are both considered only where both are the script's own
(`switchable`); the mode the script does not default to must save 10%. The
learning rate follows the global batch (`apply_scaling`). The recommendation is
the fastest to the step target (or the most samples/s); among plans within 5% of
it, the fewest instances, no compression, the shortest averaging period. With a
budget: the cheapest plan that meets it, or why none does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paicli.cluster.pluto.model import forecast, ps_loads
from paicli.cluster.pluto.strategy import (GREEDY, MXNET_DEFAULT_BIGARRAY_BOUND, ROUND_ROBIN, SLICED, Cluster, Forecast,
                                           Knobs, Profile, Strategy)

TIE = 0.05            # plans within 5% of the best count as equally fast
MAX_PS = 4
MAX_WORKERS = 8
MA_PERIODS = (1, 2, 5, 10, 20, 50, 100)


@dataclass
class Choice:
    strategy: Strategy
    forecast: Forecast
    measured_step_s: float | None = None   # a verification run's step time, when one ran
    verify_job: str | None = None

    def step_s(self) -> float:
        """The step time the plan is judged by: measured when a verification run
        measured it, else the forecast."""
        return self.measured_step_s if self.measured_step_s is not None else self.forecast.step_s

    def samples_per_s(self) -> float:
        f = self.forecast
        return f.samples_per_s * f.step_s / self.step_s() if self.step_s() > 0 else f.samples_per_s

    def time_to_target_s(self) -> float | None:
        f = self.forecast
        return None if f.steps_per_worker is None else f.steps_per_worker * self.step_s()

    def score(self) -> float:
        to_target = self.time_to_target_s()
        return to_target if to_target is not None else 1.0 / max(self.samples_per_s(), 1e-12)

    def figure(self) -> str:
        return "measured" if self.measured_step_s is not None else "forecast"

    def to_json(self) -> dict[str, Any]:
        """A PLAN of `pai plan --json`: cluster, params, forecast_step_s (+ details);
        `step_s` is the figure the plan is judged by, `figure` says whether it was
        measured (`measured_step_s`, `verify_job`) or forecast."""
        f = self.forecast
        to_target = self.time_to_target_s()
        return {"cluster": self.strategy.cluster_value(), "params": self.strategy.params(),
                "forecast_step_s": round(f.step_s, 6),
                "measured_step_s": None if self.measured_step_s is None else round(self.measured_step_s, 6),
                "step_s": round(self.step_s(), 6), "figure": self.figure(), "verify_job": self.verify_job,
                "samples_per_s": round(self.samples_per_s(), 3),
                "time_to_target_s": None if to_target is None else round(to_target, 3),
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

    def to_json(self) -> dict[str, Any]:
        return {"recommended": self.recommended.to_json(),
                "alternatives": [c.to_json() for c in self.alternatives],
                "reasons": list(self.reasons),
                "default": self.default.to_json(),
                "budget_s": self.budget_s, "meets_budget": self.meets_budget}


def switchable(profile: Profile, knobs: Knobs) -> bool:
    """Both sync and async are the script's own: it takes the choice from outside
    (MXNet: the kvstore -Dkvstore names, or a --kv-store flag; TF: a --sync_replicas
    flag) and the user left it unset. Not for TF when the step target is global_step:
    sync counts one aggregated update of W batches where async counts every worker's,
    so the target would mean another thing."""
    if profile.framework not in ("tensorflow", "mxnet") or not knobs.sync_switch or knobs.sync_pinned:
        return False
    if profile.framework == "tensorflow":
        if profile.target_global:
            return False
        if profile.sync and not knobs.sync_flag_negation:
            return False   # a flag that is on by default and has no negation cannot be turned off
    return True


def with_mode(s: Strategy, sync: bool, knobs: Knobs) -> Strategy:
    """`s` set to sync or async the way the script takes it."""
    s = s.with_(sync=sync, mode_chosen=True)
    if knobs.sync_switch == "-Dkvstore":
        return s.with_(kvstore="dist_sync" if sync else "dist_async")
    if s.framework == "mxnet":   # the script's own --kv-store flag
        return s.with_(script_flags=s.script_flags + (f"{knobs.sync_switch}={'dist_sync' if sync else 'dist_async'}",))
    if sync:
        return s.with_(script_flags=s.script_flags + (knobs.sync_switch,))
    return s.with_(script_flags=s.script_flags + ((knobs.sync_flag_negation,) if knobs.sync_flag_negation else ()))


def candidates(profile: Profile, cluster: Cluster, user: Strategy, knobs: Knobs | None = None) -> list[Strategy]:
    knobs = knobs or Knobs()
    out = _candidates(profile, cluster, user)
    if not switchable(profile, knobs):
        return out
    moded = []
    for s in out:
        moded.append(with_mode(s, s.sync, knobs))
        if s.workers > 1:   # one worker: sync and async are the same thing
            moded.append(with_mode(s, not s.sync, knobs))
    return moded


def _candidates(profile: Profile, cluster: Cluster, user: Strategy) -> list[Strategy]:
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
    plain = {c.strategy: c for c in choices if c.strategy.compression == "none"}
    return _paying(choices, lambda c: plain.get(c.strategy.with_(compression="none"))
                   if c.strategy.compression != "none" else None, COMPRESSION_GAIN)


def _paying(choices: list[Choice], twin_of, gain: float) -> list[Choice]:
    """The choices less each that saves under `gain` over its twin (twin_of: the
    plan it is weighed against, or None)."""
    return [c for c in choices if (twin := twin_of(c)) is None or c.score() <= twin.score() * (1 - gain)]


MODE_GAIN = 0.10   # the mode the script does not default to must save this much


def _shape(s: Strategy) -> tuple:
    return (s.ps, s.workers, s.partition, s.compression, s.big_array_bound, s.ma_period)


def mode_twin(choice: Choice, choices: list[Choice]) -> Choice | None:
    """The same plan in the other mode (sync <-> async), when it was considered."""
    return next((c for c in choices if c.strategy.sync != choice.strategy.sync
                 and _shape(c.strategy) == _shape(choice.strategy)), None)


def worth_switching(choices: list[Choice], default_sync: bool) -> list[Choice]:
    """Drop plans in the mode the script does not default to that save under
    MODE_GAIN over the same plan in its default mode: async's stale updates (or
    sync's larger global batch) change convergence, so the switch must pay."""
    return _paying(choices, lambda c: mode_twin(c, choices) if c.strategy.sync != default_sync else None, MODE_GAIN)


def recommend(choices: list[Choice], default_sync: bool | None = None) -> Choice:
    if default_sync is not None:
        choices = worth_switching(choices, default_sync) or choices
    choices = worth_it(choices) or choices
    best = min(c.score() for c in choices)
    near = [c for c in choices if c.score() <= best * (1 + TIE)]
    return min(near, key=_rank_key)


def plan(profile: Profile, cluster: Cluster, user: Strategy, budget_s: float | None = None,
         knobs: Knobs | None = None) -> Plan:
    knobs = knobs or Knobs()
    if user.framework == "tensorflow":
        # The script fixes TF's mode (profile.sync), which the statement cannot tell.
        user = user.with_(sync=profile.sync)
    default = Choice(user, forecast(profile, user, cluster))
    choices = [Choice(s, forecast(profile, s, cluster)) for s in candidates(profile, cluster, user, knobs)]
    if not choices:
        choices = [default]
    rec = recommend(choices, profile.sync)
    meets = None
    reasons: list[str] = []
    if budget_s is not None:
        if profile.step_target is None:
            reasons.append("budget: the script's step target is unknown (no --steps, --max_steps or "
                           "max_iter found), so no plan can be judged against it; recommending the fastest")
        else:
            fitting = [c for c in worth_it(worth_switching(choices, profile.sync))
                       if c.time_to_target_s() <= budget_s]
            if fitting:
                rec = min(fitting, key=lambda c: (c.strategy.instances, c.strategy.compression != "none",
                                                  c.score()))
                meets = True
                reasons.append(f"budget {duration_text(budget_s)}: the cheapest plan that meets it ({rec.strategy.instances} "
                               f"instances) reaches step {profile.step_target} in "
                               f"{duration_text(rec.time_to_target_s())}")
            else:
                meets = False
                fastest = min(choices, key=Choice.score)
                reasons.append(f"budget {duration_text(budget_s)}: no plan meets it; the fastest ({fastest.strategy.label()}) "
                               f"needs {duration_text(fastest.time_to_target_s())} to step {profile.step_target}, "
                               f"limited by {fastest.forecast.bottleneck}")
    # The batch/learning-rate rule applied to every plan (it changes no forecast).
    scaled = {id(c): apply_scaling(c.strategy, profile, knobs) for c in choices}
    twin = mode_twin(rec, choices)
    reasons += explain(profile, cluster, rec, default, knobs=knobs, twin=twin,
                       scaling=scaled[id(rec)][1])
    for c in choices:
        c.strategy = scaled[id(c)][0]
        if c.strategy.script_flags:   # appended to the user's own arguments, which stay first
            c.strategy = c.strategy.with_(user_args=knobs.user_args)
    alternatives = sorted((c for c in choices if c is not rec), key=Choice.score)
    return Plan(recommended=rec, alternatives=alternatives, reasons=reasons, default=default,
                budget_s=budget_s, meets_budget=meets)


def explain(profile: Profile, cluster: Cluster, rec: Choice, default: Choice, knobs: Knobs | None = None,
            twin: Choice | None = None, scaling: str | None = None) -> list[str]:
    """One line per decision, each with the measured fact behind it."""
    s, f = rec.strategy, rec.forecast
    mb = profile.param_bytes / 1e6
    lines = []
    speedup = default.score() / rec.score() if rec.score() else 1.0
    goal = "to the step target" if f.time_to_target_s is not None else "in samples/s"
    lines.append(f"cluster: {s.label()} on {cluster.source}: {rec.figure()} {rec.step_s():.3f} s/step, "
                 f"{rec.samples_per_s():.1f} samples/s, {speedup:.2f}x faster {goal} than the default "
                 f"{default.strategy.label()} ({default.figure()}); model {mb:.1f} MB, step {_share(f)}")
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
    lines.append(scaling or apply_scaling(s, profile, knobs or Knobs())[1])
    lines.append(_mode_line(profile, rec, knobs or Knobs(), twin))
    return lines


def _mode_name(s: Strategy) -> str:
    return "sync" if s.sync else "async"


def _mode_line(profile: Profile, rec: Choice, knobs: Knobs, twin: Choice | None) -> str:
    s = rec.strategy
    mode = _mode_name(s)
    if s.framework == "caffe":
        return "sync/async: sync: the workers average their models in rounds, the runner's only way"
    if knobs.sync_pinned:
        return f"sync/async: {mode}, as you set it ({knobs.sync_pinned}): kept"
    if knobs.sync_switch and profile.framework == "tensorflow" and profile.target_global:
        return (f"sync/async: {mode}, the script's default: its {knobs.sync_switch} would change what "
                f"global_step counts (one update of {s.workers} batches in sync, one per worker in async), "
                f"so the step target would mean another thing: kept")
    if not switchable(profile, knobs):
        return (f"sync/async: {mode}, as the script does (it fixes the mode itself): switching would change "
                f"its convergence, not only its speed")
    how = {"-Dkvstore": "it creates the kvstore -Dkvstore names (PAI_MXNET_KVSTORE) and -Dkvstore was left unset"}\
        .get(knobs.sync_switch, f"it takes the mode from its own {knobs.sync_switch} flag, which was not given")
    if s.workers <= 1 or twin is None:
        return f"sync/async: {mode}: one worker, so sync and async are the same thing ({how})"
    gain = 1.0 - rec.score() / twin.score() if twin.score() else 0.0
    applied = (f"-Dkvstore={s.kvstore}" if s.kvstore else
               " ".join(f for f in s.script_flags if "sync" in f or "kv" in f) or "the script's default")
    if s.sync == profile.sync:
        return (f"sync/async: {mode} ({applied}), the script's default: both are the script's ({how}); "
                f"{_mode_name(twin.strategy)} would forecast {twin.forecast.step_s:.3f} s/step against "
                f"{rec.forecast.step_s:.3f}, {-gain:+.0%} to the target, under the {MODE_GAIN:.0%} a switch "
                f"must save (it changes convergence)")
    return (f"sync/async: {mode} ({applied}), switched from the script's default {_mode_name(twin.strategy)}: "
            f"both are the script's ({how}); forecast {rec.forecast.step_s:.3f} s/step against "
            f"{twin.forecast.step_s:.3f}, {gain:.0%} faster to the target (a switch must save {MODE_GAIN:.0%})")


WARMUP_SHARE = 0.05      # warm-up over the first 5% of the step target (Goyal et al.: 5 of 90 epochs)
WARMUP_DEFAULT = 100     # steps, when the script has no step target
SCALED_SOLVERS = ("SGD", "Nesterov")   # Caffe solvers whose step is lr x gradient


def warmup_steps(profile: Profile) -> int:
    if not profile.step_target:
        return WARMUP_DEFAULT
    return max(1, round(profile.step_target * WARMUP_SHARE))


def apply_scaling(s: Strategy, profile: Profile, knobs: Knobs) -> tuple[Strategy, str]:
    """The per-worker batch and learning-rate rule for `s`, applied (the strategy
    with the -D values that carry it) and said (one reason line).

    The per-worker batch is kept; the learning rate follows the global batch
    linearly, with a warm-up, where nothing scales it already:

    - Caffe averaging (W models that each took a step of batch B, averaged, are one
      step of batch W x B): base_lr x W, warm-up, in the job's own solver copy;
    - TF SyncReplicasOptimizer and MXNet's Module API (the mean over W workers):
      x W through the script's learning-rate flag, else -DlrScale for
      pluto_helpers.learning_rate;
    - MXNet dist_sync with a Gluon Trainer (the servers SUM the workers' gradients,
      each normalised by its own batch): already W x, nothing to do;
    - async (each worker's update applied alone) and one worker: nothing to scale."""
    w, b = s.workers, s.batch_per_worker or profile.batch_size
    base = profile.learning_rate
    head = f"batch/learning rate: per-worker batch {b} kept"
    if w <= 1:
        return s, f"{head}; learning rate kept: one worker, nothing is combined"
    head += f" (global batch {w} x {b} = {w * b})"
    if knobs.lr_pinned:
        return s, f"{head}; learning rate kept: you set it"
    warm = warmup_steps(profile)
    if s.framework == "caffe":
        if knobs.solver_type not in SCALED_SOLVERS:
            return s, (f"{head}; learning rate kept: the {knobs.solver_type} solver adapts its own step size, "
                       f"so linear scaling does not apply")
        if base is None:
            return s, f"{head}; learning rate kept: the solver's base_lr was not found"
        s = s.with_(learning_rate=base * w, lr_scale=float(w), warmup_steps=warm)
        return s, (f"{head}; base_lr {base:g} -> {base * w:g} (x{w}, linear scaling: averaging {w} models that "
                   f"each took a step of batch {b} is one step of batch {w * b}), reached by a linear warm-up "
                   f"over the first {warm} iterations; the runner writes it into the job's own copy of the "
                   f"solver and ramps it (your files are unchanged): -DlearningRate={base * w:g} "
                   f"-DwarmupIterations={warm}")
    if not s.sync:
        return s, (f"{head}; learning rate kept: async applies each worker's update alone (batch {b} at the "
                   f"script's rate), nothing is combined")
    if s.framework == "mxnet" and knobs.aggregation == "sum":
        return s, (f"{head}; learning rate kept: dist_sync SUMS the {w} workers' gradients on the servers "
                   f"(each normalised by its own batch {b}), so the script's rate already acts {w}x on the "
                   f"global batch: linear scaling holds unchanged (without a warm-up)")
    what = ("SyncReplicasOptimizer averages" if s.framework == "tensorflow"
            else "the Module API averages")
    if base is not None and knobs.lr_flag:
        flag = f"{knobs.lr_flag}={base * w:g}"
        s = s.with_(script_flags=s.script_flags + (flag,), lr_scale=float(w))
        return s, (f"{head}; learning rate {base:g} -> {base * w:g} (x{w}, linear scaling: {what} the {w} "
                   f"workers' gradients into one step of batch {w * b}), set through the script's own "
                   f"{knobs.lr_flag} ({flag}); a flag cannot ramp it, so the warm-up needs "
                   f"lr = pluto_helpers.learning_rate(base_lr, step) in the script (one line)")
    s = s.with_(helper_scale=True, lr_scale=float(w), warmup_steps=warm)
    return s, (f"{head}; the learning rate should be x{w} (linear scaling: {what} the {w} workers' "
               f"gradients into one step of batch {w * b}) with a warm-up over {warm} steps, but the script "
               f"exposes no learning-rate flag: -DlrScale={w} -DwarmupSteps={warm} take effect where it calls "
               f"lr = pluto_helpers.learning_rate(base_lr, step) (one line)")


def _share(f: Forecast) -> str:
    if f.step_s <= 0:
        return "nothing to share"
    return (f"{f.compute_s / f.step_s:.0%} compute, {f.comm_s / f.step_s:.0%} network, "
            f"{f.overhead_s / f.step_s:.0%} overhead")


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


# -- checking before recommending ------------------------------------------------------------
# When the best forecast is within VERIFY_MARGIN of the next, or outside the shapes
# calibration ran, paicli/pluto.py runs the plans `to_verify` picks briefly, and
# `apply_measured` recommends by what they measured.

VERIFY_MARGIN = 0.15   # forecasts this close to the best are too close to call
VERIFY_MAX = 4         # plans one verification runs at most


def structure(choice: Choice) -> tuple:
    """What a plan is beside its counts: ps placement (MXNet: its own slicing bound or
    Pluto's), compression, sync or async, averaging period. Plans of one structure
    share the model's errors (all forecast too fast, say), so a verification that
    runs two plans of one structure learns little about the others."""
    s = choice.strategy
    return (s.partition, s.big_array_bound is not None, s.compression, s.sync, s.ma_period)


def plan_key(choice: Choice) -> str:
    """What a run of the plan submits that changes its speed (cluster and -D values)."""
    return json.dumps([choice.strategy.cluster_value(), choice.strategy.params()], sort_keys=True)


def to_verify(plan: Plan, shapes: tuple[tuple[int, int], ...], default_sync: bool | None = None,
              margin: float = VERIFY_MARGIN, most: int = VERIFY_MAX) -> tuple[list[Choice], str]:
    """The plans to run before recommending, and why ('' and [] when the forecast can
    stand): the recommendation and every plan the rules would pick from (no
    compression or mode switch that does not pay) whose forecast is within `margin`
    of it, up to `most`; a recommendation outside the calibrated (ps, workers)
    `shapes` is run beside the next best plan. With a budget only the recommended
    plan is checked, when it is outside the shapes or within `margin` of the budget."""
    rec = plan.recommended
    # Calibration runs no compression: a 2bit plan's cost of quantising is a guess too.
    compressed = rec.strategy.compression != "none"
    outside = (rec.strategy.ps, rec.strategy.workers) not in shapes or compressed
    if plan.budget_s is not None:
        to_target = rec.time_to_target_s()
        near = to_target is not None and to_target >= plan.budget_s * (1 - margin)
        why = ("outside the calibrated shapes" if outside else
               f"within {margin:.0%} of the budget" if near else "")
        return ([rec] if why else []), why
    pool = worth_it(worth_switching([rec, *plan.alternatives], default_sync) if default_sync is not None
                    else [rec, *plan.alternatives]) or [rec]
    seen = {plan_key(rec)}
    others = []
    for c in sorted((c for c in pool if c is not rec), key=Choice.score):
        if plan_key(c) not in seen:
            seen.add(plan_key(c))
            others.append(c)
    # a compressed recommendation is run beside the same plan uncompressed
    plain = rec.strategy.with_(compression="none")
    twin = next((c for c in others if compressed and c.strategy == plain), None)
    close = [c for c in others if c.score() <= rec.score() * (1 + margin)]
    if close:
        why = f"{len(close)} other plan{'s' if len(close) > 1 else ''} forecast within {margin:.0%} of it"
        picks = [rec, *([twin] if twin else [])]
        # the best of every structure not yet picked first, then the rest by forecast
        tried = {structure(c) for c in picks}
        for c in close:
            if c is not twin and structure(c) not in tried:
                tried.add(structure(c))
                picks.append(c)
        picks += [c for c in close if c is not twin and all(c is not p for p in picks)]
        return picks[:most], why
    if outside:
        shape = (f"{rec.strategy.compression} (calibration runs uncompressed)" if compressed else
                 f"{rec.strategy.ps} {rec.strategy.ps_role()} + {rec.strategy.workers} worker")
        return [rec, twin or others[0]][:most] if (twin or others) else [rec], \
            f"{shape} is outside the shapes calibration ran"
    return [], ""


def apply_measured(plan: Plan, measured: dict[str, tuple[float, str]], why: str,
                   default_sync: bool | None = None) -> Choice:
    """Record what the verification runs measured (plan_key -> (step seconds, job))
    on the plan's choices and recommend by it: among the plans that ran, the rules
    of `recommend` on measured step times (the others keep their forecast). Returns
    the recommendation (the plan is updated in place, reasons first)."""
    choices = [plan.recommended, *plan.alternatives]
    ran = []
    for c in choices:
        hit = measured.get(plan_key(c))
        if hit is not None and hit[0]:
            c.measured_step_s, c.verify_job = hit
            ran.append(c)
    hit = measured.get(plan_key(plan.default))
    if hit is not None and hit[0]:   # the default ran too (it was one of the plans checked)
        plan.default.measured_step_s, plan.default.verify_job = hit
    if not ran:
        return plan.recommended
    old = plan.recommended
    rec = recommend(ran, default_sync)
    if plan.budget_s is not None and rec.time_to_target_s() is not None:
        plan.meets_budget = rec.time_to_target_s() <= plan.budget_s
    figures = "; ".join(f"{c.strategy.label()}: measured {c.measured_step_s:.3f} s/step, forecast "
                        f"{c.forecast.step_s:.3f} ({(c.forecast.step_s - c.measured_step_s) / c.measured_step_s:+.0%})"
                        for c in ran)
    verdict = (f"recommending {rec.strategy.label()}, the fastest measured" if rec is not old else
               f"the forecast's choice holds")
    if plan.budget_s is not None and plan.meets_budget is False:
        verdict += f"; measured, it does not meet the budget {duration_text(plan.budget_s)} " \
                   f"({duration_text(rec.time_to_target_s())} to the target)"
    plan.reasons.insert(0, f"verified ({why}): ran {len(ran)} plan{'s' if len(ran) > 1 else ''} briefly through "
                           f"pai: {figures}; {verdict} (the plans not run keep their forecast)")
    plan.recommended = rec
    plan.alternatives = sorted((c for c in choices if c is not rec), key=Choice.score)
    return rec


def explain_again(plan: Plan, profile: Profile, cluster: Cluster, knobs: Knobs | None = None) -> None:
    """The reasons for a recommendation a verification changed: its own lines, after
    the verification's and the budget's."""
    kept = [r for r in plan.reasons if r.startswith(("verified", "budget"))]
    everything = [plan.recommended, *plan.alternatives]
    plan.reasons = kept + explain(profile, cluster, plan.recommended, plan.default, knobs=knobs,
                                  twin=mode_twin(plan.recommended, everything))
