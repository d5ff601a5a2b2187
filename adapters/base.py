"""The Adapter contract: a framework's knowledge, and nothing about processes.

An adapter turns a validated JobSpec into a JobPlan: which roles exist, how many
instances each has, which roles must finish for the job to succeed (the others
are services, stopped afterwards), the argv/env every instance of a role starts
with, the runtime it runs in, and regexes that pick metrics out of its log lines.
What depends on assigned ports is derived by the adapter's runner from the PAI_*
variables (see paicli.jobplan).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import ClassVar
from dataclasses import dataclass

from paicli.errors import SpecError
from paicli.jobplan import KEY_VALUE_METRIC, JobPlan
from paicli.runners.script_imports import local_modules
from paicli.spec import JobSpec, Param


@dataclass(frozen=True)
class StagedCode:
    """Where the user's code is once submitted.

    entry: absolute path of the script to run (None when the job has no script).
    root:  the directory an archive was extracted into (None for a plain script).
    cwd:   the working directory instances start in.

    The paths are final when the adapter plans: an archive is already extracted
    into the job folder, so its files can be read.
    """

    entry: Path | None
    root: Path | None
    cwd: Path


class Adapter:
    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    task_name: ClassVar[str] = "Task"
    runtime: ClassVar[str | None] = None          # a name in paicli.runners.runtimes, or None
    params: ClassVar[tuple[Param, ...]] = ()      # framework-specific rows of the param table
    metric_patterns: ClassVar[tuple[str, ...]] = (KEY_VALUE_METRIC,)
    requires_script: ClassVar[bool] = True

    def validate(self, spec: JobSpec) -> None:
        """Raise SpecError for combinations a single parameter's row cannot judge."""
        if self.requires_script and not spec.get("script"):
            raise SpecError("-Dscript", "missing",
                            "give the training script, e.g. -Dscript=file:///home/me/train.py")

    def plan(self, spec: JobSpec, code: StagedCode) -> JobPlan:
        raise NotImplementedError

    def job_plan(self, spec: JobSpec, name: str, roles: list, **more) -> JobPlan:
        """The plan with what every adapter's shares: -DjobName (else `name`), retries,
        timeout and this adapter's metric patterns."""
        return JobPlan(job_name=spec.get("jobName") or name, framework=self.name, task_name=self.task_name,
                       roles=roles, max_retries=spec.get("maxRetries"), timeout=spec.get("timeout"),
                       metric_patterns=list(self.metric_patterns), **more)


# ---------------------------------------------------------------------------
# Helpers every adapter shares


def cluster_roles(spec: JobSpec, default: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """-Dcluster as role -> {count, cpu, memory, gpu}, with `default` when absent."""
    return {role: {"count": conf.get("count", 1), "cpu": conf.get("cpu", 100), "memory": conf.get("memory", 0),
                   "gpu": conf.get("gpu", 0)} for role, conf in (spec.get("cluster") or default).items()}


# PAI handed these parameters to the script as flags when they were given.
PASSTHROUGH_FLAGS = ("checkpointDir", "buckets", "tables", "outputs")


def hyper_parameter_flags(path: str | None) -> list[str]:
    """A key=value file as ["--key=value", ...]; blank lines and # comments skipped."""
    if not path:
        return []
    flags = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key or any(c.isspace() for c in key):
            raise SpecError(f"-DhyperParameters: {path} line {lineno}",
                            f"expected key=value, got {line[:60]!r}", "write one key=value per line")
        flags.append(f"--{key}={value.strip()}")
    return flags


def code_inputs(code: StagedCode) -> list[str]:
    """The files of the user's code the instances read: a plain script (an archive's
    files travel as its whole extracted folder)."""
    return [str(code.entry)] if code.entry is not None and code.root is None else []


def script_inputs(code: StagedCode) -> list[str]:
    """A plain script and the modules of its own it imports, found as `import`
    would, and the packages it loads by name (importlib.import_module('pkg.' + ...)):
    every node needs them, e.g. tf_cnn_benchmarks.py's benchmark_cnn.py or the peer
    train_mnist.py's common/ and symbols/. An archive travels whole."""
    return local_modules(str(code.entry), by_name=True) if code_inputs(code) else []


def script_args(spec: JobSpec, passthrough: tuple[str, ...] = PASSTHROUGH_FLAGS) -> list[str]:
    """The arguments after the script: the PAI pass-through flags that were given,
    then hyperParameters as --key=value, then userDefinedParameters verbatim."""
    args = [f"--{name}={spec.get(name)}" for name in passthrough if spec.get(name)]
    args += hyper_parameter_flags(spec.get("hyperParameters"))
    udp = spec.get("userDefinedParameters")
    if udp:
        args += shlex.split(udp)
    return args


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be greater than 0, not {value:g}"


# Pluto's linear learning-rate scaling for scripts that call
# pluto_helpers.learning_rate(base_lr, step) (runners/pluto_helpers.py); a plan sets
# them when the script exposes no learning-rate flag of its own.
PLUTO_SCALING_PARAMS = (
    Param("lrScale", "float", check=positive,
          help="The factor pluto_helpers.learning_rate(base_lr, step) multiplies the script's "
               "learning rate by (PAI_PLUTO_LR_SCALE; linear scaling for sync data parallelism). "
               "Only a script that calls the helper sees it."),
    Param("warmupSteps", "int", minimum=0,
          help="Steps over which pluto_helpers.learning_rate ramps from the script's rate to "
               "-DlrScale times it (PAI_PLUTO_WARMUP_STEPS)."),
)


def pluto_scaling_env(spec: JobSpec) -> dict[str, str]:
    """PAI_PLUTO_LR_SCALE / PAI_PLUTO_WARMUP_STEPS for the instances, when set."""
    env = {}
    if spec.get("lrScale") is not None:
        env["PAI_PLUTO_LR_SCALE"] = repr(float(spec.get("lrScale")))
    if spec.get("warmupSteps") is not None:
        env["PAI_PLUTO_WARMUP_STEPS"] = str(int(spec.get("warmupSteps")))
    return env


# A number as frameworks print it in their progress lines (1, -0.5, .25, 3e-05): the
# metric patterns' one spelling (Caffe adds nan/inf to it).
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


# ---------------------------------------------------------------------------
# "Not distributed": the runners report it (paicli/cluster/distribution.py);
# -DrequireDistributed=true, through the roles' environment, turns it into a failure.

REQUIRE_DISTRIBUTED = Param(
    "requireDistributed", "choice", default="false", choices=("true", "false"),
    help="true: a job whose workers never trained with their servers or ps (MXNet servers "
         "that received no push, a Caffe ps that averaged nothing, a TensorFlow ps that served "
         "no variable) fails, naming the cause. false: it succeeds, and the summary, `pai "
         "status` and the attached view say it was not distributed.")


def distribution_env(spec: JobSpec) -> dict[str, str]:
    """PAI_REQUIRE_DISTRIBUTED=1 for every role when -DrequireDistributed=true."""
    return {"PAI_REQUIRE_DISTRIBUTED": "1"} if spec.get("requireDistributed") == "true" else {}
