"""`-name mxnet`: MXNet 1.9 parameter-server jobs (ps-lite: scheduler, servers, workers).

Roles: one `scheduler`, added here because ps-lite needs exactly one; `server`
(-Dcluster may call it `ps`, as TensorFlow jobs do); `worker`, which runs the
user's script. Every instance runs runners/mxnet_runner.py in the MXNet runtime;
the runner derives DMLC_* from the launcher's PAI_* variables, runs the scheduler
and servers without user code, and runs the script on the workers.

Scheduler and servers exit by themselves once the workers finalise their
kvstores, so they are not must_finish: the job succeeds when the workers do, and
a short stop_grace lets the others leave on their own before being stopped.

ps-lite cannot take a restarted worker back (and in dist_sync the survivors wait
for it forever), so a retryable failure restarts the whole job: restart="job".
"""

from __future__ import annotations

from paicli.adapters.base import (PLUTO_SCALING_PARAMS, Adapter, StagedCode, cluster_roles, code_inputs,
                                  pluto_scaling_env, script_args)
from paicli.errors import SpecError
from paicli.plan import KEY_VALUE_METRIC, RESTART_JOB, JobPlan, RolePlan
from paicli.runners.runtimes import get_runtime, runner_path
from paicli.spec import JobSpec, Param

KVSTORES = ("dist_sync", "dist_async", "dist_device_sync")
COMPRESSIONS = ("none", "2bit")
DEFAULT_THRESHOLD = 0.5

# Seconds the scheduler and servers get to exit by themselves after the last
# worker is done; ps-lite's shutdown handshake takes well under a second.
SERVICE_STOP_GRACE = 5.0

# mx.callback.Speedometer: `Epoch[0] Batch [0-100]\tSpeed: 1234.56 samples/sec\taccuracy=0.91`
# (older releases print `Batch [100]`); the name=value pairs after it are caught
# by the key=value pattern.
SPEEDOMETER_METRIC = (
    r"Epoch\[(?P<epoch>\d+)\]\s+Batch\s+\[(?:\d+-)?(?P<batch>\d+)\]\s+"
    r"Speed:\s+(?P<speed>[-+]?\d+(?:\.\d+)?)\s+samples/sec"
)

# Module.fit's `Epoch[0] Time cost=0.455`: the epoch's wall time.
EPOCH_TIME_METRIC = r"Epoch\[(?P<epoch>\d+)\]\s+Time cost=(?P<epoch_seconds>\d+(?:\.\d+)?)"
# key=value pairs, except the `cost` of `Time cost=` (that is a time, not a loss).
KEY_VALUE_NOT_TIME_COST = r"(?<!Time )" + KEY_VALUE_METRIC

ROLE_ALIASES = {"ps": "server"}
KNOWN_ROLES = ("server", "worker")


def _positive(value: float) -> str | None:
    return None if value > 0 else f"must be greater than 0, not {value:g}"


class MxnetAdapter(Adapter):
    name = "mxnet"
    aliases = ("mx",)
    task_name = "MXNetTask"
    runtime = "mxnet"
    params = (
        Param("kvstore", "choice", default="dist_sync", choices=KVSTORES,
              help="The kvstore type the script should create; it reaches the script as the "
                   "environment variable PAI_MXNET_KVSTORE (mx.kv.create(os.environ"
                   "['PAI_MXNET_KVSTORE'])). dist_sync: synchronous SGD over all workers; "
                   "dist_async: servers apply each worker's update as it comes; "
                   "dist_device_sync: dist_sync with aggregation on the device."),
        Param("gradientCompression", "choice", default="none", choices=COMPRESSIONS,
              help="2bit: quantise gradients to {-threshold, 0, +threshold} before they are "
                   "sent to the servers (the residual is kept locally). Applied by the runner "
                   "to every dist kvstore the script creates; the script needs no change."),
        Param("gradientCompressionThreshold", "float", check=_positive,
              help=f"The 2bit compression threshold (default {DEFAULT_THRESHOLD}); only with "
                   "-DgradientCompression=2bit."),
        Param("bigArrayBound", "int", minimum=1,
              help="Arrays with more elements than this are sliced evenly across every server "
                   "(MXNET_KVSTORE_BIGARRAY_BOUND; MXNet's default 1000000). Smaller arrays go "
                   "whole to one server."),
        *PLUTO_SCALING_PARAMS,
    )
    metric_patterns = (SPEEDOMETER_METRIC, EPOCH_TIME_METRIC, KEY_VALUE_NOT_TIME_COST)

    def validate(self, spec: JobSpec) -> None:
        super().validate(spec)
        if spec.get("gradientCompressionThreshold") is not None and \
                spec.get("gradientCompression") != "2bit":
            raise SpecError("-DgradientCompressionThreshold", "only applies to 2bit compression",
                            "add -DgradientCompression=2bit, or drop the threshold")
        self.roles(spec)

    def roles(self, spec: JobSpec) -> dict[str, dict[str, int]]:
        """-Dcluster as {"server": {...}, "worker": {...}}; `ps` read as `server`,
        one server and one worker by default."""
        given = cluster_roles(spec, {"server": {"count": 1}, "worker": {"count": 1}})
        roles: dict[str, dict[str, int]] = {}
        for role, conf in given.items():
            if role == "scheduler":
                raise SpecError("-Dcluster", "the scheduler is added by pai",
                                'give only "server" (or "ps") and "worker" roles')
            canonical = ROLE_ALIASES.get(role, role)
            if canonical not in KNOWN_ROLES:
                raise SpecError("-Dcluster", f'MXNet jobs have no role "{role}"',
                                'use "server" (or "ps") and "worker", e.g. '
                                '{"server":{"count":1},"worker":{"count":2}}')
            if canonical in roles:
                raise SpecError("-Dcluster", '"ps" and "server" name the same role in MXNet jobs',
                                "keep one of them")
            roles[canonical] = conf
        roles.setdefault("server", {"count": 1, "cpu": 100, "memory": 0, "gpu": 0})
        if "worker" not in roles:
            raise SpecError("-Dcluster", "no workers",
                            'add a worker role, e.g. {"server":{"count":1},"worker":{"count":2}}')
        return roles

    def plan(self, spec: JobSpec, code: StagedCode) -> JobPlan:
        roles = self.roles(spec)
        python = get_runtime(self.runtime).python()
        runner = runner_path("mxnet_runner.py")
        service_argv = [python, "-u", runner]
        worker_argv = [*service_argv, str(code.entry), *script_args(spec)]

        compression = spec.get("gradientCompression")
        threshold = spec.get("gradientCompressionThreshold") or DEFAULT_THRESHOLD
        env = {"PAI_MXNET_KVSTORE": spec.get("kvstore"),
               "PAI_MXNET_GRADIENT_COMPRESSION": compression}
        if compression != "none":
            env["PAI_MXNET_COMPRESSION_THRESHOLD"] = repr(float(threshold))
        if spec.get("bigArrayBound"):
            env["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(spec.get("bigArrayBound"))
        env.update(pluto_scaling_env(spec))
        # The scheduler and servers only route and sum; one OpenMP thread each
        # leaves the cores to the workers.
        service_env = {**env, "OMP_NUM_THREADS": "1"}

        server, worker = roles["server"], roles["worker"]
        cwd = str(code.cwd)
        plan_roles = [
            RolePlan(name="scheduler", count=1, argv=service_argv, env=service_env, cwd=cwd,
                     must_finish=False, stop_grace=SERVICE_STOP_GRACE, cpu=10),
            RolePlan(name="server", count=server["count"], argv=service_argv, env=service_env,
                     cwd=cwd, must_finish=False, stop_grace=SERVICE_STOP_GRACE,
                     cpu=server["cpu"], memory=server["memory"], gpu=0),
            RolePlan(name="worker", count=worker["count"], argv=worker_argv, env=env, cwd=cwd,
                     cpu=worker["cpu"], memory=worker["memory"],
                     gpu=worker["gpu"] or spec.get("gpuRequired")),
        ]
        notes = [
            "added one scheduler: ps-lite needs exactly one",
            f"kvstore {spec.get('kvstore')} reaches the script as PAI_MXNET_KVSTORE",
            "restart=job: ps-lite cannot take a restarted worker back, so a retry "
            "restarts every instance",
        ]
        if "ps" in (spec.get("cluster") or {}):
            notes.insert(1, 'role "ps" runs as MXNet servers')
        if compression != "none":
            notes.append(f"2bit gradient compression, threshold {threshold:g}, applied by the runner")
        if spec.get("bigArrayBound"):
            notes.append(f"arrays over {spec.get('bigArrayBound')} elements sliced across the servers")
        return JobPlan(job_name=spec.get("jobName") or code.entry.stem, framework=self.name,
                       task_name=self.task_name, roles=plan_roles, restart=RESTART_JOB,
                       max_retries=spec.get("maxRetries"), timeout=spec.get("timeout"),
                       metric_patterns=list(self.metric_patterns), notes=notes, inputs=code_inputs(code))
