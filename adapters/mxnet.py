"""`-name mxnet`: MXNet 1.9 parameter-server jobs (ps-lite: scheduler, servers, workers).

Roles: one `scheduler` (ps-lite needs exactly one); `server` (or `ps`); `worker`,
which runs the user's script. Every instance runs runners/mxnet_runner.py in the
MXNet runtime. The job succeeds when the workers do; the others leave by themselves
within a short stop_grace.

ps-lite cannot take a restarted worker back (and in dist_sync the survivors wait
for it forever), so a retryable failure restarts the whole job: restart="job".
"""

from __future__ import annotations

from paicli.adapters.base import (NUMBER, PLUTO_SCALING_PARAMS, REQUIRE_DISTRIBUTED, Adapter, StagedCode,
                                  cluster_roles, distribution_env, pluto_scaling_env, positive, script_args,
                                  script_inputs)
from paicli.errors import SpecError
from paicli.jobplan import RESTART_JOB, JobPlan, RolePlan
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
    rf"Speed:\s+(?P<speed>{NUMBER})\s+samples/sec"
)
# Module.fit's `Epoch[0] Time cost=0.455`: the epoch's wall time.
EPOCH_TIME_METRIC = rf"Epoch\[(?P<epoch>\d+)\]\s+Time cost=(?P<epoch_seconds>{NUMBER})"
# Module.fit's end-of-epoch `Epoch[0] Train-accuracy=0.77` / `Validation-cross-entropy=0.3`:
# the epoch here, the scores by the key=value pattern under MXNet's own names.
EPOCH_SCORE_METRIC = r"Epoch\[(?P<epoch>\d+)\]\s+(?:Train|Validation)-[A-Za-z_]"
# Gluon examples: `[Epoch 3] training: accuracy=0.91`, `[Epoch 3] time cost: 12.3`,
# `[Epoch 3] validation: accuracy=0.88` (image_classification.py, mnist.py).
GLUON_EPOCH_METRIC = r"\[Epoch (?P<epoch>\d+)\]\s+(?:[Tt]raining|[Vv]alidation|[Tt]ime cost):"
# ...and per batch: `[Epoch 0 Batch 10] Training: accuracy=0.33` (mnist.py)
GLUON_BATCH_METRIC = r"\[Epoch (?P<epoch>\d+) Batch (?P<batch>\d+)\]\s+[Tt]raining:"
GLUON_EPOCH_TIME_METRIC = rf"\[Epoch \d+\]\s+[Tt]ime cost:\s+(?P<epoch_seconds>{NUMBER})"
# A validation line's every score, as validation_<name> (the line is claimed: the
# key=value pattern does not read it under the training scores' names).
GLUON_VALIDATION_METRIC = r"\[Epoch \d+\]\s+[Vv]alidation:\s+(?P<validation_pairs>[^\n]*)"
# name=number pairs, MXNet's metric names included (`cross-entropy`, `top_k_accuracy_5`), except:
# the `cost` of `Time cost=` (a time), anything inside a flag (`--lr=0.1`), and the arguments of a printed
# argparse Namespace (`start with arguments Namespace(batch_size=32, ...)`: pairs
# `, k=v` up to a `)` that ends the line; at most 128 looked at, so a long line
# costs linear time), which are settings, not metrics.
MX_KEY_VALUE_METRIC = (
    r"(?<![\w.\-])(?<!Time )(?P<key>[A-Za-z_][\w.\-]*)\s*=\s*"
    rf"(?P<value>{NUMBER})s?(?![\w.])(?!(?:, [A-Za-z_]\w*=(?:'[^'\n]*'|[^,\n()]*)){{0,128}}+\)[ \t]*$)"
)

# What pai reads from this framework's lines; tests/metric_lines.py holds a line captured
# from a real run for each, and what the whole list must read from it.
MXNET_METRIC_PATTERNS = (SPEEDOMETER_METRIC, EPOCH_TIME_METRIC, EPOCH_SCORE_METRIC, GLUON_EPOCH_METRIC,
                         GLUON_BATCH_METRIC, GLUON_EPOCH_TIME_METRIC, GLUON_VALIDATION_METRIC,
                         MX_KEY_VALUE_METRIC)

ROLE_ALIASES = {"ps": "server"}
KNOWN_ROLES = ("server", "worker")


class MxnetAdapter(Adapter):
    name = "mxnet"
    aliases = ("mx",)
    task_name = "MXNetTask"
    runtime = "mxnet"
    params = (
        Param("kvstore", "choice", default="dist_sync", choices=KVSTORES,
              help="The kvstore type the script should create; it reaches the script as the "
                   "environment variable PAI_MXNET_KVSTORE (mx.kv.create(os.environ"
                   "['PAI_MXNET_KVSTORE'])), and as --kv-store/--kvstore when the script (or a "
                   "module of its folder it imports) defines that flag and it was not given. "
                   "dist_sync: synchronous SGD over all workers; "
                   "dist_async: servers apply each worker's update as it comes; "
                   "dist_device_sync: dist_sync with aggregation on the device."),
        Param("gradientCompression", "choice", default="none", choices=COMPRESSIONS,
              help="2bit: quantise gradients to {-threshold, 0, +threshold} before they are "
                   "sent to the servers (the residual is kept locally). Applied by the runner "
                   "to every dist kvstore the script creates; the script needs no change."),
        Param("gradientCompressionThreshold", "float", check=positive,
              help=f"The 2bit compression threshold (default {DEFAULT_THRESHOLD}); only with "
                   "-DgradientCompression=2bit."),
        Param("bigArrayBound", "int", minimum=1,
              help="Arrays with more elements than this are sliced evenly across every server "
                   "(MXNET_KVSTORE_BIGARRAY_BOUND; MXNet's default 1000000). Smaller arrays go "
                   "whole to one server."),
        *PLUTO_SCALING_PARAMS,
        REQUIRE_DISTRIBUTED,
    )
    metric_patterns = MXNET_METRIC_PATTERNS

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
        env.update(distribution_env(spec))
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
            f"kvstore {spec.get('kvstore')} reaches the script as PAI_MXNET_KVSTORE, and as its own "
            "--kv-store/--kvstore when it defines one and it was not given (decided by the runner at start)",
            "restart=job: ps-lite cannot take a restarted worker back, so a retry "
            "restarts every instance",
        ]
        if "ps" in (spec.get("cluster") or {}):
            notes.insert(1, 'role "ps" runs as MXNet servers')
        if compression != "none":
            notes.append(f"2bit gradient compression, threshold {threshold:g}, applied by the runner")
        if spec.get("bigArrayBound"):
            notes.append(f"arrays over {spec.get('bigArrayBound')} elements sliced across the servers")
        return self.job_plan(spec, code.entry.stem, plan_roles, restart=RESTART_JOB, notes=notes,
                             inputs=script_inputs(code))
