"""`-name tensorflow`: distributed TensorFlow in its own runtime.

Roles come from -Dcluster: ps, worker, chief, evaluator (no -Dcluster: one worker).
Every instance runs runners/tensorflow_runner.py, which sets TF_CONFIG and runs the
user's script (or a plain tf.distribute.Server).

Who must finish (Kubeflow's default success policy): the chief if there is one,
else every worker; the others are stopped then.

Where the script runs (-DscriptRoles): `auto` runs it everywhere except on the ps
and workers of a job with a chief, which get the runner's tf.distribute.Server: a
TF2 ParameterServerStrategy script runs only on its coordinator. `all` runs it on
every instance (TF1 scripts that use a chief, or scripts that start their own servers).

Classic flags (-DclusterFlags: --ps_hosts --worker_hosts --job_name --task_index):
`auto` passes each only when the script or a module of its own defines it, since
absl and argparse reject flags they do not define; `always`/`never` force it.
PAI's own pass-through flags (--checkpointDir, --buckets, --tables, --outputs) are
passed when those parameters are given, then hyperParameters, then userDefinedParameters.
"""

from __future__ import annotations

from paicli.adapters import _load
from paicli.adapters.base import (NUMBER, PLUTO_SCALING_PARAMS, REQUIRE_DISTRIBUTED, Adapter, StagedCode,
                                  cluster_roles, distribution_env, pluto_scaling_env, script_args, script_inputs)
from paicli.errors import SpecError
from paicli.jobplan import KEY_VALUE_METRIC, RESTART_JOB, JobPlan, RolePlan
from paicli.runners.runtimes import TF_LEGACY_RUNTIME, get_runtime, runner_path
from paicli.spec import JobSpec, Param

ROLES = ("ps", "worker", "chief", "evaluator")     # also the start order: services first
RUNNER = "tensorflow_runner.py"

# The seed's `step=3, global_step=3, loss=6.97, duration=3.6s`: paicli's key=value
# pattern, except for ALL-CAPS keys, which are environment variables in TensorFlow's
# own messages (`set the environment variable TF_ENABLE_ONEDNN_OPTS=0`), not metrics,
# and tf_cnn_benchmarks' `(jitter = 10.1)`, the spread of its images/sec, not a metric.
TF_KEY_VALUE_METRIC = r"(?![A-Z][A-Z0-9_]*\s*=)(?!jitter\s*=)" + KEY_VALUE_METRIC
# tf.compat.v1.train.LoggingTensorHook / Estimator: `loss = 0.52, step = 100 (0.3 sec)`
LOGGING_TENSOR_HOOK_METRIC = rf"\bloss = (?P<loss>{NUMBER}), step = (?P<step>\d+)"
# ...and the StepCounterHook of MonitoredTrainingSession / Estimator: `global_step/sec: 41.2`
STEP_COUNTER_METRIC = rf"\bglobal_step/sec: (?P<global_steps_per_sec>{NUMBER})"
# tf_cnn_benchmarks (benchmark_cnn.py): `STEP\timages/sec: MEAN +/- UNCERTAINTY (jitter =
# JITTER)\tLOSS[\tTOP1\tTOP5]`; a diverged loss prints as nan/inf: the line still gives its
# step and images/sec (the parser keeps finite values only).
CNN_BENCHMARK_STEP_METRIC = (
    rf"^[ \t]*(?P<step>\d+)\timages/sec: (?P<images_per_sec>{NUMBER})"
    rf"(?: \+/- {NUMBER} \(jitter = {NUMBER}\))?\t(?P<loss>{NUMBER}|[-+]?(?:nan|inf))"
    rf"(?:\t(?P<top_1_accuracy>{NUMBER})\t(?P<top_5_accuracy>{NUMBER}))?[ \t]*$"
)
CNN_BENCHMARK_TOTAL_METRIC = rf"^total images/sec: (?P<total_images_per_sec>{NUMBER})[ \t]*$"
CNN_BENCHMARK_EVAL_METRIC = (rf"^Accuracy @ 1 = (?P<top_1_accuracy>{NUMBER}) "
                             rf"Accuracy @ 5 = (?P<top_5_accuracy>{NUMBER})")
# Keras progress lines, Keras 3 and legacy Keras 2 (verbose=2, and a verbose=1 bar's
# last redraw): `6/6 - 0s - 12ms/step - accuracy: 0.5156 - loss: 0.6621`
# ...and the loss on its own, in case a line yields only its first key/value match.
KERAS_LOSS_METRIC = rf"\s-\sloss: (?P<loss>{NUMBER})"
KERAS_METRIC = rf"(?:^|\s-\s)(?P<key>[a-z][a-z0-9_]*): (?P<value>{NUMBER})(?![\w.])"
KERAS_EPOCH_METRIC = r"^Epoch (?P<epoch>\d+)/\d+\s*$"

# What pai reads from this framework's lines; tests/metric_lines.py holds a line captured
# from a real run for each, and what the whole list must read from it.
TF_METRIC_PATTERNS = (TF_KEY_VALUE_METRIC, CNN_BENCHMARK_STEP_METRIC, CNN_BENCHMARK_TOTAL_METRIC,
                      CNN_BENCHMARK_EVAL_METRIC, LOGGING_TENSOR_HOOK_METRIC, STEP_COUNTER_METRIC,
                      KERAS_METRIC, KERAS_LOSS_METRIC, KERAS_EPOCH_METRIC)

TF_PARAMS: tuple[Param, ...] = (
    Param("scriptRoles", "choice", default="auto", choices=("auto", "all"),
          help="Where the script runs. auto: on every instance, except that with a chief the ps "
               "and workers run a plain tf.distribute.Server (TF2 ParameterServerStrategy). "
               "all: on every instance."),
    Param("clusterFlags", "choice", default="auto", choices=("auto", "always", "never"),
          help="Pass --ps_hosts --worker_hosts --job_name --task_index to the script. auto: those "
               "the script defines (tf.app.flags/absl DEFINE_* or argparse add_argument)."),
    Param("psStrategy", "choice", default="roundRobin", choices=("roundRobin", "greedy"),
          help="How replica_device_setter spreads variables over the ps. roundRobin: TF's "
               "default, variable i on ps i mod P. greedy: each variable on the ps holding the "
               "fewest bytes so far (Pluto's load balancing; the script needs no change)."),
    *PLUTO_SCALING_PARAMS,
    REQUIRE_DISTRIBUTED,   # the runner prints the cause, cluster/distribution.py judges it
)


# PAI's versioned names (the TensorFlow each ran): every one of them shipped Keras 2 as
# tf.keras and most scripts of their era use tf.compat.v1 / tf.layers, so they select
# the legacy-Keras runtime; `tensorflow` and `tf` the current one.
VERSIONED_NAMES = {
    "tensorflow140": "1.4", "tensorflow180": "1.8", "tensorflow1100": "1.10", "tensorflow1120": "1.12",
    "tensorflow1120_ext": "1.12", "tensorflow1150": "1.15", "tensorflow1150_ext": "1.15",
    "tensorflow200": "2.0", "tensorflow210": "2.1", "tensorflow220": "2.2",
}
CURRENT_RUNTIME = "tensorflow"


def runtime_for(framework: str) -> str:
    """The runtime a -name selects: the legacy-Keras one for PAI's versioned names."""
    return TF_LEGACY_RUNTIME if framework.strip().lower() in VERSIONED_NAMES else CURRENT_RUNTIME


def names_by_runtime() -> dict[str, list[str]]:
    """runtime -> the `-name`s that select it, every adapter's (for `pai runtime list`):
    PAI's versioned TensorFlow names select the legacy-Keras runtime."""
    out: dict[str, list[str]] = {}
    for name, cls in _load().items():
        runtime = runtime_for(name) if cls is TensorflowAdapter else cls.runtime
        if runtime:
            out.setdefault(runtime, []).append(name)
    return out


class TensorflowAdapter(Adapter):
    name = "tensorflow"
    aliases = ("tf", *VERSIONED_NAMES)
    task_name = "TensorflowTask"
    runtime = "tensorflow"
    params = TF_PARAMS
    metric_patterns = TF_METRIC_PATTERNS

    def roles(self, spec: JobSpec) -> dict[str, dict[str, int]]:
        roles = cluster_roles(spec, {"worker": {"count": 1}})
        unknown = [r for r in roles if r not in ROLES]
        if unknown:
            raise SpecError("-Dcluster", f'unknown TensorFlow role "{unknown[0]}"',
                            "TensorFlow roles are ps, worker, chief and evaluator")
        for role in ("chief", "evaluator"):
            if roles.get(role, {}).get("count", 0) > 1:
                raise SpecError("-Dcluster", f'"{role}" count is {roles[role]["count"]}',
                                f"TensorFlow takes at most one {role}; use workers for more")
        if "worker" not in roles and "chief" not in roles:
            raise SpecError("-Dcluster", "no worker or chief to run the training",
                            'add one, e.g. {"ps":{"count":1},"worker":{"count":2}}')
        if ("chief" in roles and "ps" in roles and "worker" not in roles
                and spec.get("scriptRoles") == "auto"):
            raise SpecError("-Dcluster", "a chief with ps but no workers",
                            "ParameterServerStrategy schedules its steps on workers: add "
                            '"worker":{"count":1} or more')
        return roles

    def spec_framework(self, requested: str) -> str:
        """The -name a spec keeps: a versioned name selects a runtime, so it stays."""
        name = requested.strip().lower()
        return name if name in VERSIONED_NAMES else self.name

    def validate(self, spec: JobSpec) -> None:
        super().validate(spec)
        self.runtime = runtime_for(spec.framework)  # read by the submit, which provisions it
        self.roles(spec)

    def plan(self, spec: JobSpec, code: StagedCode) -> JobPlan:
        self.runtime = runtime_for(spec.framework)
        roles = self.roles(spec)
        has_chief = "chief" in roles
        serve_roles = {"ps", "worker"} if has_chief and spec.get("scriptRoles") == "auto" else set()
        python = get_runtime(self.runtime).python()
        runner = [python, "-u", runner_path(RUNNER)]
        # The runner decides the classic flags at start: only there is the code surely
        # in place (an archive is unpacked into the job directory after planning).
        script = [f"--cluster-flags={spec.get('clusterFlags')}",
                  *([f"--code-root={code.root}"] if code.root else []), "--",
                  str(code.entry), *script_args(spec)]
        finishing = "chief" if has_chief else "worker"
        env = dict(getattr(get_runtime(self.runtime), "env", {}))  # TF_USE_LEGACY_KERAS=1 for legacy Keras
        if spec.get("psStrategy") != "roundRobin":
            env["PAI_TF_PS_STRATEGY"] = spec.get("psStrategy")
        env.update(pluto_scaling_env(spec))
        env.update(distribution_env(spec))

        plans = []
        for role in (r for r in ROLES if r in roles):
            conf = roles[role]
            trains = role in ("worker", "chief")
            plans.append(RolePlan(
                name=role, count=conf["count"],
                argv=runner + (["--serve"] if role in serve_roles else script),
                cwd=str(code.cwd), env=dict(env),
                must_finish=role == finishing,
                listens=role != "evaluator",  # TF keeps the evaluator out of the cluster
                cpu=conf["cpu"], memory=conf["memory"],
                gpu=conf["gpu"] or (spec.get("gpuRequired") if trains else 0),
            ))

        notes = [
            f"roles: {', '.join(f'{r.name} x{r.count}' for r in plans)}; "
            f"the job succeeds when every {finishing} exits 0, the others are then stopped",
            "every instance gets TF_CONFIG (the evaluator stays out of its cluster)",
            (f"the script runs on {', '.join(r.name for r in plans if r.name not in serve_roles)}; "
             f"{' and '.join(sorted(serve_roles))} run a plain tf.distribute.Server"
             if serve_roles else "the script runs on every instance"),
            {"auto": "classic flags --ps_hosts --worker_hosts --job_name --task_index: passed "
                     "when the script defines them (decided by the runner at start)",
             "always": "classic flags --ps_hosts --worker_hosts --job_name --task_index: passed",
             "never": "classic cluster flags: not passed"}[spec.get("clusterFlags")],
            "a failure that a restart can cure restarts the whole job on fresh ports "
            "(TF's cluster spec is fixed at start)",
        ]
        if "PAI_TF_PS_STRATEGY" in env:
            notes.append("variables placed on the ps by size, greedily (-DpsStrategy=greedy)")
        if self.runtime != CURRENT_RUNTIME:
            era = VERSIONED_NAMES[spec.framework.strip().lower()]
            notes.append(f"-name {spec.framework} (TensorFlow {era} era): the {self.runtime} runtime, "
                         f"{get_runtime(self.runtime).description}")
        return self.job_plan(spec, code.entry.stem if code.entry else "tensorflow", plans, restart=RESTART_JOB,
                             notes=notes, inputs=script_inputs(code))
