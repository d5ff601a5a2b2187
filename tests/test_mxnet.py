"""MXNet through `pai -name mxnet`: real ps-lite jobs (scheduler, server, two workers).

Two tiers: fast checks of the adapter's plan, its parameter errors and the
runner's DMLC_* mapping; then real jobs through the `pai` command in the MXNet
runtime (provisioned on first use, cached afterwards). Each job trains a few
dozen tiny steps so that the file stays within a few minutes on two cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import broken_lines, chatty_script, instance_groups, job_id_from, pai, processes_in, wait_until

from paicli.adapters import get_adapter
from paicli.adapters.base import StagedCode
from paicli.errors import SpecError
from paicli.jobplan import RESTART_JOB
from paicli.runners import mxnet_runner
from paicli.spec import CORE_PARAMS, RawParam, build_spec

pytestmark = pytest.mark.mxnet

REPO = Path(__file__).resolve().parent.parent
GLUON = REPO / "examples" / "mxnet" / "gluon_dist_sync.py"
MODULE = REPO / "examples" / "mxnet" / "module_speedometer.py"
CLUSTER = '{"server":{"count":1},"worker":{"count":2}}'
INSTANCES = {"scheduler:0", "server:0", "worker:0", "worker:1"}


# ---------------------------------------------------------------------------
# Fast tier: plan, parameters, runner environment


def spec_of(**params):
    adapter = get_adapter("mxnet")
    params.setdefault("script", str(GLUON))
    raw = [RawParam(key, value, f"-D{key}", REPO) for key, value in params.items()]
    spec = build_spec("mxnet", raw, params=(*CORE_PARAMS, *adapter.params))
    adapter.validate(spec)
    return adapter, spec


def plan_of(**params):
    adapter, spec = spec_of(**params)
    return adapter.plan(spec, StagedCode(entry=GLUON, root=None, cwd=REPO))


def test_plan_adds_a_scheduler_and_restarts_whole_jobs():
    plan = plan_of(cluster='{"ps":{"count":2},"worker":{"count":3}}', kvstore="dist_async")
    roles = {r.name: r for r in plan.roles}
    assert [r.name for r in plan.roles] == ["scheduler", "server", "worker"]
    assert (roles["scheduler"].count, roles["server"].count, roles["worker"].count) == (1, 2, 3)
    # Scheduler and servers exit by themselves; only the workers decide success.
    assert not roles["scheduler"].must_finish and not roles["server"].must_finish
    assert roles["worker"].must_finish
    assert roles["scheduler"].stop_grace > 0 and roles["server"].stop_grace > 0
    assert plan.restart == RESTART_JOB
    assert roles["worker"].argv[-1] == str(GLUON)
    assert str(GLUON) not in roles["server"].argv
    assert all(r.env["PAI_MXNET_KVSTORE"] == "dist_async" for r in plan.roles)
    assert plan.task_name == "MXNetTask"


def test_compression_reaches_every_role_with_its_threshold():
    plan = plan_of(gradientCompression="2bit", gradientCompressionThreshold="0.25")
    for role in plan.roles:
        assert role.env["PAI_MXNET_GRADIENT_COMPRESSION"] == "2bit"
        assert float(role.env["PAI_MXNET_COMPRESSION_THRESHOLD"]) == 0.25
    default = plan_of(gradientCompression="2bit")
    assert float(default.roles[-1].env["PAI_MXNET_COMPRESSION_THRESHOLD"]) == 0.5


@pytest.mark.parametrize("params, where, words", [
    ({"kvstore": "dist_snyc"}, "-Dkvstore", "did you mean dist_sync"),
    ({"kvstore": "local"}, "-Dkvstore", "dist_sync, dist_async, dist_device_sync"),
    ({"gradientCompression": "1bit"}, "-DgradientCompression", "none, 2bit"),
    ({"gradientCompressionThreshold": "0.3"}, "-DgradientCompressionThreshold", "-DgradientCompression=2bit"),
    ({"gradientCompression": "2bit", "gradientCompressionThreshold": "0"},
     "-DgradientCompressionThreshold", "greater than 0"),
    ({"cluster": '{"chief":{"count":1},"worker":{"count":1}}'}, "-Dcluster", 'no role "chief"'),
    ({"cluster": '{"server":{"count":1}}'}, "-Dcluster", "no workers"),
    ({"cluster": '{"scheduler":{"count":1},"worker":{"count":1}}'}, "-Dcluster", "added by pai"),
    ({"cluster": '{"ps":{"count":1},"server":{"count":1},"worker":{"count":1}}'}, "-Dcluster", "same role"),
])
def test_bad_parameters_name_the_key_and_the_fix(params, where, words):
    with pytest.raises(SpecError) as err:
        spec_of(**params)
    assert err.value.where == where
    assert words in str(err.value)


def test_runner_derives_dmlc_variables_from_the_pai_ones():
    cluster = {"scheduler": ["127.0.0.1:9000"], "server": ["127.0.0.1:9001", "127.0.0.1:9002"],
               "worker": ["127.0.0.1:9003", "127.0.0.1:9004", "127.0.0.1:9005"]}
    base = {"PAI_CLUSTER": json.dumps(cluster), "PAI_HOST": "127.0.0.1"}
    worker = mxnet_runner.dmlc_environment({**base, "PAI_ROLE": "worker", "PAI_INDEX": "1",
                                            "PAI_PORT": "9004"})
    assert worker == {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1",
                      "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3",
                      "DMLC_NODE_HOST": "127.0.0.1", "PORT": "9004"}
    scheduler = mxnet_runner.dmlc_environment({**base, "PAI_ROLE": "scheduler", "PAI_PORT": "9000"})
    # The scheduler binds DMLC_PS_ROOT_PORT; it must not be handed a PORT of its own.
    assert scheduler["DMLC_PS_ROOT_PORT"] == "9000" and "PORT" not in scheduler


def test_speedometer_and_step_lines_are_metrics():
    """Through the parser the master runs on every log line, with the plan's patterns."""
    from paicli.cluster.logsink import MetricParser

    parser = MetricParser(plan_of().metric_patterns)
    step, found = parser.parse("Epoch[1] Batch [10-20]\tSpeed: 9494.07 samples/sec\taccuracy=0.968750")
    assert found == {"epoch": 1, "batch": 20, "speed": 9494.07, "accuracy": 0.96875} and step == 20
    assert parser.parse("step=3, loss=0.25") == (3, {"step": 3, "loss": 0.25})
    # Module.fit's epoch time is a time, not a metric called `cost`.
    assert parser.parse("Epoch[0] Time cost=0.455") == (None, {"epoch": 0, "epoch_seconds": 0.455})


# ---------------------------------------------------------------------------
# Real jobs through `pai`


@pytest.fixture(scope="module")
def runtime():
    from paicli.runners.runtimes import get_runtime

    rt = get_runtime("mxnet")
    rt.ensure(print)
    return rt


@pytest.fixture
def home(pai_home):
    return pai_home


def submit_args(script: Path, *extra: str, steps: int | None = None, cluster: str = CLUSTER) -> list[str]:
    args = ["-name", "mxnet", f"-Dscript=file://{script}", f"-Dcluster={cluster}", *extra]
    if steps is not None:
        args.append(f"-DuserDefinedParameters=--steps {steps}")
    return args


def status(job_id: str) -> dict:
    result = pai("status", job_id, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def instance_log(job_id: str, name: str) -> str:
    result = pai("logs", job_id, "--instance", name)
    assert result.returncode == 0, result.stderr
    return result.stdout


def losses(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step=\d+, loss=([-\d.e+]+)", log, re.M)]


def assert_loss_fell(name: str, series: list[float]) -> None:
    """The mean of the last five steps is well under that of the first five."""
    assert len(series) >= 10, f"{name}: too few steps: {series}"
    first, last = sum(series[:5]) / 5, sum(series[-5:]) / 5
    assert last < 0.75 * first, f"{name} loss did not fall: {series}"


def digest(log: str) -> str:
    match = re.search(r"final weights sha256 ([0-9a-f]{64})", log)
    assert match, f"no final digest in:\n{log[-2000:]}"
    return match.group(1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose: it runs nothing.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_all_gone(info: dict) -> None:
    names = {f"{i['role']}:{i['index']}" for i in info["instances"]}
    assert names == INSTANCES
    # Nothing left in any instance's process group either.
    assert not processes_in(instance_groups(info))
    for inst in info["instances"]:
        if inst.get("pid"):
            assert not alive(inst["pid"]), f"{inst['role']}:{inst['index']} (pid {inst['pid']}) still runs"


def assert_ok(result: subprocess.CompletedProcess) -> dict:
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines and lines[-1] == "OK", \
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}"
    info = status(job_id_from(result.stdout))
    assert info["status"] == "Succeeded" and info["framework"] == "mxnet"
    assert_all_gone(info)
    return info


def assert_services_exited_by_themselves(info: dict) -> None:
    for inst in info["instances"]:
        assert inst["exit_code"] == 0, f"{inst['role']}:{inst['index']} ended with {inst['exit_code']}"


def test_dist_sync_job_trains_and_both_workers_end_with_identical_weights(runtime, home):
    result = pai(*submit_args(GLUON, "-Dkvstore=dist_sync", steps=25))
    info = assert_ok(result)
    assert_services_exited_by_themselves(info)
    assert "[worker:1] step=" in result.stdout
    logs = {w: instance_log(info["id"], w) for w in ("worker:0", "worker:1")}
    for name, log in logs.items():
        assert "kvstore dist_sync" in log
        series = losses(log)
        assert len(series) == 25, name
        assert_loss_fell(name, series)
    assert digest(logs["worker:0"]) == digest(logs["worker:1"])
    loss_series = info["metric_series"]["worker:0"]["loss"]
    assert loss_series[-1][1] < loss_series[0][1]


def test_dist_async_job_trains_with_ps_as_the_server_role(runtime, home):
    # `ps`, as TensorFlow jobs call it, runs as MXNet's server role (server:0).
    info = assert_ok(pai(*submit_args(GLUON, "-Dkvstore=dist_async", steps=25,
                                      cluster='{"ps":{"count":1},"worker":{"count":2}}')))
    assert_services_exited_by_themselves(info)
    for name in ("worker:0", "worker:1"):
        log = instance_log(info["id"], name)
        assert "kvstore dist_async" in log
        series = losses(log)
        assert_loss_fell(name, series)


def test_two_bit_compression_trains_a_gluon_script_unchanged(runtime, home):
    info = assert_ok(pai(*submit_args(GLUON, "-DgradientCompression=2bit",
                                      "-DgradientCompressionThreshold=0.25", steps=25)))
    logs = [instance_log(info["id"], name) for name in ("worker:0", "worker:1")]
    for log in logs:
        # The runner turned compression on (Gluon's Trainer then calls pushpull,
        # which MXNet 1.9.1 refuses under compression without the work-around).
        assert "2bit gradient compression on kvstore dist_sync (threshold 0.25)" in log
        assert "not supported with PushPull" not in log
        series = losses(log)
        assert_loss_fell("worker", series)
    assert digest(logs[0]) == digest(logs[1])


def test_a_script_that_sets_compression_itself_trains_through_the_work_around(runtime, home, tmp_path):
    # Without the runner's push+pull work-around, MXNet 1.9.1 fails this script's
    # first Trainer.step with "Compression not supported with PushPull".
    source = GLUON.read_text()
    marker = "kvstore=kv)"
    assert source.count(marker) == 1
    script = tmp_path / "own_compression.py"
    script.write_text(source.replace(
        marker, 'kvstore=kv, compression_params={"type": "2bit", "threshold": 0.5})'))
    info = assert_ok(pai(*submit_args(script, steps=20)))
    log = instance_log(info["id"], "worker:0")
    assert "gradient compression on kvstore" not in log  # pai did not turn it on
    assert_loss_fell("worker:0", losses(log))


def test_module_api_speedometer_lines_become_metrics(runtime, home):
    info = assert_ok(pai(*submit_args(MODULE, "-Dkvstore=dist_device_sync")))
    metrics = info["metrics"]["worker:0"]
    assert float(metrics["speed"]) > 0
    assert 0.5 < float(metrics["accuracy"]) <= 1.0
    assert float(metrics["epoch"]) == 1 and float(metrics["epoch_seconds"]) > 0
    assert "cost" not in metrics
    assert "kvstore dist_device_sync" in instance_log(info["id"], "worker:0")


def test_a_step_line_is_never_broken_by_a_threads_stderr_line(runtime, home, tmp_path):
    """Under `python -u` print writes a line and its newline apart, and stderr shares the
    instance's pipe: before the runner made lines whole (runners/script_output.py), 35 of
    these 4000 step lines came out as `step=413, loss=7.25[23:00:00] chatter on stderr`
    (MXNet's engine threads log through dmlc so, from threads)."""
    script = tmp_path / "chatty.py"
    script.write_text(chatty_script("[23:00:00] chatter on stderr", "step=%i, loss=7.25"))
    result = pai(*submit_args(script, cluster='{"worker":{"count":1}}'))
    assert result.returncode == 0, result.stdout[-3000:]
    broken, whole = broken_lines(result.stdout, "worker:0", "[23:00:00] chatter on stderr", "step=%i, loss=7.25")
    assert not broken, broken[:5]
    assert whole == 4000


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    value = wait_until(predicate, timeout, interval)
    assert value, f"timed out after {timeout:.0f}s waiting for {what}"
    return value


def start_slow_job(*extra: str) -> str:
    result = pai(*submit_args(GLUON, *extra, "-DuserDefinedParameters=--steps 60 --step-sleep 0.1"),
                 "--detach")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def kill_worker_mid_run(job_id: str) -> tuple[float, list[int]]:
    """SIGKILL worker:1 once it has trained a few steps; returns when, and the
    pids of the attempt it belonged to."""
    def running_with_steps():
        info = status(job_id)
        assert info["status"] in ("Waiting", "Running"), info
        insts = {f"{i['role']}:{i['index']}": i for i in info["instances"]}
        log = Path(insts["worker:1"].get("log") or "/nonexistent")
        steps = len(losses(log.read_text(errors="replace"))) if log.is_file() else 0
        if steps >= 3 and all(i.get("pid") and i.get("status") == "Running" for i in insts.values()):
            return insts
        return None

    insts = wait_for(running_with_steps, 90, "worker:1 to train a few steps")
    pids = [i["pid"] for i in insts.values()]
    os.kill(insts["worker:1"]["pid"], signal.SIGKILL)
    return time.monotonic(), pids


def test_killed_worker_stops_the_job_at_once_without_retries(runtime, home):
    job_id = start_slow_job("-DmaxRetries=0")
    killed_at, pids = kill_worker_mid_run(job_id)
    # In dist_sync the survivors would wait for the dead worker forever.
    wait_for(lambda: not any(alive(p) for p in pids), 10, "every process of the job to be gone")
    assert time.monotonic() - killed_at < 10
    result = pai("wait", job_id, timeout=60)
    assert result.returncode == 1
    assert result.stdout.strip().splitlines()[-1].startswith("FAILED")
    info = status(job_id)
    assert info["status"] == "Failed" and "worker:1" in (info["reason"] or "")


def test_killed_worker_restarts_the_whole_job_which_then_succeeds(runtime, home):
    job_id = start_slow_job("-DmaxRetries=1")
    killed_at, pids = kill_worker_mid_run(job_id)
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the first attempt's processes to be gone")
    assert time.monotonic() - killed_at < 10
    result = pai("wait", job_id, timeout=150)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "OK", result.stdout[-3000:]
    info = status(job_id)
    assert info["status"] == "Succeeded"
    assert_all_gone(info)
    # A job-level restart: every instance ran twice, not just the killed worker.
    assert all(inst["attempts"] == 2 for inst in info["instances"]), info["instances"]
    assert not set(pids) & {inst["pid"] for inst in info["instances"]}
    log = instance_log(job_id, "worker:0")
    assert len(losses(log)) >= 60


@pytest.mark.parametrize("flag, key", [
    ("-Dkvstore=dist_synch", "-Dkvstore"),
    ("-DgradientCompression=4bit", "-DgradientCompression"),
    ("-DgradientCompressionThreshold=abc", "-DgradientCompressionThreshold"),
])
def test_bad_values_are_one_line_errors_from_pai(home, flag, key):
    result = pai(*submit_args(GLUON, flag), timeout=60)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert key in lines[0] and "Traceback" not in result.stderr
    assert not (home / "jobs").exists() or not any((home / "jobs").iterdir())


NO_WAITALL = REPO / "tests" / "scripts" / "mx_no_waitall.py"


def test_a_dist_sync_script_without_waitall_ends(runtime, home):
    """Without the runner's exit wait this job hung 3 times out of 3: every
    worker printed its last line and never exited."""
    submitted = pai(*submit_args(NO_WAITALL, "-Dkvstore=dist_sync"), "--detach")
    job_id = submitted.stdout.strip()
    assert submitted.returncode == 0, submitted.stderr
    try:
        result = pai("wait", job_id, timeout=60)
        assert result.returncode == 0, result.stdout[-2000:]
        assert pai("logs", job_id).stdout.count("finished its steps") == 2
        assert_all_gone(status(job_id))
    except subprocess.TimeoutExpired:
        raise AssertionError("the job did not end within 60 s: the workers hang at exit") from None
    finally:
        pai("kill", job_id)
