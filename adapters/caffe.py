"""`-name caffe`: Caffe 1.0 solver jobs and multi-worker model averaging.

Every instance runs in the Caffe runtime (runners/caffe_rootfs.py). What runs:
- `-Dsolver=...` (or a -Dscript archive whose -DentryFile is a .prototxt) with one
  worker: runners/caffe_runner.py runs `caffe train --solver=...` (with --weights or
  --snapshot when given); Caffe's glog lines stream as they come.
- The same with N > 1 workers and a ps (-Dcluster='{"ps":{"count":1},"worker":{"count":2}}'):
  each worker steps its own pycaffe solver on its shard of the data and every -DmaPeriod
  iterations the ps averages their weights. One worker fails and every instance
  restarts (restart=job): the rounds must stay in step.
- `-Dscript=train.py`: a pycaffe script, run with the runtime's Python 3.9 on every
  instance of -Dcluster (PAI_* variables in its environment), PAI's flags after it.

Working directory of a solver job: the first of the solver's folder, its parent
folders, and the folder `pai` was started in, in which the solver's `net:` (or
`train_net:`) path exists, so the prototxt's relative paths resolve as for `caffe
train` run there.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from paicli.adapters.base import (NUMBER, REQUIRE_DISTRIBUTED, Adapter, StagedCode, cluster_roles, code_inputs,
                                  distribution_env, positive, script_args)
from paicli.errors import PaiError, SpecError
from paicli.jobplan import RESTART_INSTANCE, RESTART_JOB, JobPlan, RolePlan
from paicli.runners.caffe_runner import DEFAULT_MA_PERIOD, solver_cwd, solver_field
from paicli.runners.runtimes import RuntimeSetupError, get_runtime, runner_path
from paicli.spec import JobSpec, Param

RUNNER = "caffe_runner.py"
SOLVER_SUFFIXES = (".prototxt", ".pbtxt", ".txt")
ROLES = ("ps", "worker")

_N = NUMBER + r"|[-+]?(?:nan|inf)"
# I1122 ... solver.cpp:239] Iteration 20 (58.8 iter/s, 0.34s/20 iters), loss = 1.23
ITERATION_METRIC = (rf"\bIteration (?P<step>[1-9]\d*) \((?P<iter_per_s>{_N}) iter/s, "
                    rf"(?P<sec_per_display>{_N})s/\d+ iters\), loss = (?P<loss>{_N})")
# Iteration 0's rate is meaningless (Caffe divides by an unset timer): its loss only
FIRST_ITERATION_METRIC = rf"\bIteration (?P<step>0) \([^)]*\), loss = (?P<loss>{_N})"
# the last line of a run: "Iteration 200, loss = 0.0026"
LAST_ITERATION_METRIC = rf"\bIteration (?P<step>\d+), loss = (?P<loss>{_N})"
LR_METRIC = rf"\bIteration (?P<step>\d+), lr = (?P<lr>{_N})"
# Train outputs other than the loss (already above, smoothed), by their own names
TRAIN_OUTPUT_METRIC = rf"Train net output #\d+: (?P<key>(?!loss\b)[A-Za-z_][\w/.-]*) = (?P<value>{_N})"
# Test outputs: the test loss gets a name of its own so as not to mix with training's
TEST_LOSS_METRIC = rf"Test net output #\d+: (?:loss|test_loss) = (?P<test_loss>{_N})"
TEST_OUTPUT_METRIC = rf"Test net output #\d+: (?P<key>(?!loss\b|test_loss\b)[A-Za-z_][\w/.-]*) = (?P<value>{_N})"
# the runner's model-averaging summary (worker 0 and the ps)
AVERAGED_LOSS_METRIC = rf"Averaged model loss = (?P<averaged_loss>{_N}) \(starting loss = (?P<starting_loss>{_N})\)"
ROUND_METRIC = (rf"model averaging round (?P<ma_round>\d+) at iteration (?P<step>\d+): "
                rf"exchange took (?P<exchange_ms>{_N}) ms")
# the averaging ps: the model's size (Pluto's calibration reads it)
PS_ROUND_METRIC = rf"averaging round \d+ at iteration \d+: \d+ workers, (?P<model_mb>{_N}) MB"

# What pai reads from this framework's lines; tests/metric_lines.py holds a line captured
# from a real run for each, and what the whole list must read from it.
CAFFE_METRIC_PATTERNS = (ITERATION_METRIC, FIRST_ITERATION_METRIC, LAST_ITERATION_METRIC, LR_METRIC,
                         TRAIN_OUTPUT_METRIC, TEST_LOSS_METRIC, TEST_OUTPUT_METRIC, AVERAGED_LOSS_METRIC,
                         ROUND_METRIC, PS_ROUND_METRIC)

CAFFE_PARAMS: tuple[Param, ...] = (
    Param("solver", "path",
          help="The solver prototxt: a file:// URI or a path (or, in a -Dscript .tar.gz, name "
               "it with -DentryFile). Relative paths inside it resolve in the folder that holds "
               "its net (see docs/caffe.md)."),
    Param("weights", "path", help="A .caffemodel to fine-tune from (caffe train --weights)."),
    Param("snapshot", "path",
          help="A .solverstate to resume from (caffe train --snapshot); the iteration count continues."),
    Param("maPeriod", "int", default=DEFAULT_MA_PERIOD, minimum=1,
          help="With several workers: average the model through the ps every this many iterations."),
    Param("learningRate", "float", check=positive,
          help="base_lr for this job: written into the job's own copy of the solver (the file you "
               "gave is unchanged). Pluto sets it to scale the rate with the workers."),
    Param("batchSize", "int", minimum=1,
          help="Each worker's training batch: written into the job's own copy of the net (the first "
               "data layer's batch_size; your file is unchanged)."),
    Param("warmupIterations", "int", minimum=0,
          help="With several SGD/Nesterov workers: ramp the learning rate linearly from base_lr / "
               "workers to base_lr over this many iterations (the runner scales the gradients; "
               "BVLC Caffe's lr_policy has no warm-up)."),
    REQUIRE_DISTRIBUTED,
)
# -D values written into the job's copies of the solver and net: the runner's flag for each.
SOLVER_ONLY = {"learningRate": "--base-lr", "batchSize": "--batch-size", "warmupIterations": "--warmup-iters"}


class CaffeAdapter(Adapter):
    name = "caffe"
    task_name = "CaffeTask"
    runtime = "caffe"
    params = CAFFE_PARAMS
    metric_patterns = CAFFE_METRIC_PATTERNS
    requires_script = False   # a solver replaces the script

    def _solver(self, spec: JobSpec, code: StagedCode) -> Path | None:
        if spec.get("solver"):
            return Path(spec.get("solver"))
        if code.entry is not None and code.entry.suffix.lower() in SOLVER_SUFFIXES:
            return code.entry
        return None

    def validate(self, spec: JobSpec) -> None:
        script, solver = spec.get("script"), spec.get("solver")
        if not script and not solver:
            raise SpecError("-Dsolver", "missing",
                            "give the solver, e.g. -Dsolver=file:///home/me/lenet_solver.prototxt, "
                            "or a pycaffe script with -Dscript=file:///home/me/train.py")
        if script and solver and not script.lower().endswith((".tar.gz", ".tgz", ".tar")):
            raise SpecError("-Dsolver", f"given together with the script {script}",
                            "give -Dsolver for a solver job or -Dscript for a pycaffe script, not both")
        if spec.get("weights") and spec.get("snapshot"):
            raise SpecError("-Dweights", "given together with -Dsnapshot",
                            "resume from a snapshot (-Dsnapshot) or fine-tune from weights (-Dweights), not both")
        for role in (spec.get("cluster") or {}):
            if role not in ROLES:
                raise SpecError("-Dcluster", f'unknown role "{role}" for caffe',
                                'caffe jobs have "worker" instances and, to average models, "ps"')

    def plan(self, spec: JobSpec, code: StagedCode) -> JobPlan:
        self.validate(spec)
        solver = self._solver(spec, code)
        try:
            runtime = get_runtime(self.runtime)
            python = runtime.python()
            # `caffe train` (one worker) and the GPU check (solver_mode, any count) need the binary.
            caffe = runtime.caffe() if solver is not None else None
        except RuntimeSetupError as err:
            raise PaiError(f"the caffe runtime: {err}") from None
        roles = cluster_roles(spec, {"worker": {"count": 1}})
        if "worker" not in roles:
            raise SpecError("-Dcluster", 'has no "worker" role',
                            'add one, e.g. {"ps":{"count":1},"worker":{"count":2}}')
        workers = roles["worker"]["count"]
        notes: list[str] = [f"runtime: {runtime.description}"]
        if solver is None:
            return self._script_plan(spec, code, python, roles, notes)

        # The runner picks the working directory at run time (an archive's files are
        # only in place then): see runners/caffe_runner.py solver_cwd.
        cwd = code.cwd
        notes.append(f"solver {solver}; runs in the folder where its net path resolves")
        solve = [python, "-u", runner_path(RUNNER), "solve", "--solver", str(solver), "--caffe", caffe]
        if code.root is not None:
            solve += ["--top", str(code.root)]
        if spec.get("weights"):
            solve += ["--weights", spec.get("weights")]
        if spec.get("snapshot"):
            solve += ["--snapshot", spec.get("snapshot")]
        if spec.get("checkpointDir"):
            solve += ["--checkpoint-dir", str(Path(os.path.expanduser(spec.get("checkpointDir"))).resolve())]
        for key, flag in SOLVER_ONLY.items():
            if spec.get(key) is not None:
                solve += [flag, str(spec.get(key))]
        env = {"GLOG_logtostderr": "1", **distribution_env(spec)}
        plan_roles = []
        restart = RESTART_INSTANCE
        if workers == 1:
            if "ps" in roles:
                notes.append("one worker: nothing to average, the ps is not started")
            notes.append("one worker: caffe train")
        else:
            if "ps" not in roles:
                raise SpecError("-Dcluster", f"{workers} workers but no ps to average their models",
                                'add a ps: {"ps":{"count":1},"worker":{"count":%d}}' % workers)
            period = spec.get("maPeriod")
            # The averaging ps accepts only workers that know this job's secret.
            env["PAI_CAFFE_SECRET"] = secrets.token_hex(32)
            solve += ["--workers", str(workers), "--ma-period", str(period), "--python", python]
            ps = roles["ps"]
            plan_roles.append(RolePlan(
                name="ps", count=ps["count"], argv=[python, "-u", runner_path(RUNNER), "average",
                                                   "--workers", str(workers)],
                must_finish=False, cwd=str(cwd), env=dict(env), cpu=ps["cpu"], memory=ps["memory"],
                stop_grace=10.0))
            # Several Caffe processes share the cores: one BLAS thread each.
            env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
            restart = RESTART_JOB
            notes.append(f"{workers} workers, data shard = worker index, model averaged by "
                         f"{ps['count']} ps every {period} iterations")
        conf = roles["worker"]
        plan_roles.append(RolePlan(
            name="worker", count=workers, argv=solve, must_finish=True, listens=False,
            cwd=str(cwd), env=env, cpu=conf["cpu"], memory=conf["memory"],
            gpu=conf["gpu"] or spec.get("gpuRequired")))
        return self.job_plan(spec, solver.stem, plan_roles, restart=restart, notes=notes,
                             inputs=solver_inputs(solver, code, spec))

    def _script_plan(self, spec: JobSpec, code: StagedCode, python: str, roles: dict,
                     notes: list[str]) -> JobPlan:
        if code.entry is None:
            raise SpecError("-Dsolver", "missing", "give -Dsolver=... or a pycaffe -Dscript=...")
        for key in SOLVER_ONLY:
            if spec.get(key) is not None:
                raise SpecError(f"-D{key}", "applies to solver jobs, not to a pycaffe script",
                                "pass the value to your script with -DuserDefinedParameters instead")
        argv = [python, "-u", str(code.entry), *script_args(spec)]
        plan_roles = [
            RolePlan(name=role, count=conf["count"], argv=argv, cwd=str(code.cwd),
                     must_finish=role != "ps", env={"GLOG_logtostderr": "1"},
                     cpu=conf["cpu"], memory=conf["memory"], gpu=conf["gpu"])
            for role, conf in sorted(roles.items(), key=lambda kv: kv[0] != "ps")
        ]
        notes.append(f"pycaffe script {code.entry.name} on {', '.join(roles)}")
        return self.job_plan(spec, code.entry.stem, plan_roles, notes=notes, inputs=code_inputs(code))


def solver_inputs(solver: Path, code: StagedCode, spec: JobSpec) -> list[str]:
    """What `caffe train` reads besides the data: the solver, its net (where the
    runner will find it), the weights or snapshot given. Inside an archive they
    travel with it; data sources named in the net are not followed (an archive or a
    shared filesystem holds them; docs/multihost.md)."""
    if code.root is not None:
        return []
    found = [solver]
    try:
        text = solver.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    net = solver_field(text, "net") or solver_field(text, "train_net")
    if net:
        found.append(Path(solver_cwd(str(solver), str(code.cwd))) / net)
    found += [Path(spec.get(key)) for key in ("weights", "snapshot") if spec.get(key)]
    return [str(p.absolute()) for p in found if p.is_file()]
