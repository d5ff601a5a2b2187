"""TensorFlow through `pai -name tensorflow`: real jobs in the real runtime.

The first test to need it provisions the TensorFlow runtime (about a minute, cached
under ~/.cache/paicli/runtimes). Jobs are kept tiny: other suites share the 2 cores.
The planning tests at the top start no process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import broken_lines, chatty_script

from paicli.adapters import get_adapter
from paicli.adapters.base import StagedCode
from paicli.adapters.tensorflow import TensorflowAdapter
from paicli.runners.tensorflow_runner import choose_classic_flags, defined_classic_flags
from paicli.errors import SpecError
from paicli.spec import CORE_PARAMS, JobSpec

pytestmark = pytest.mark.tensorflow

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "tensorflow"
JOB_TIMEOUT = 300


# ---------------------------------------------------------------------------
# Planning: no processes


def make_spec(**params) -> JobSpec:
    table = {p.name: p for p in (*CORE_PARAMS, *TensorflowAdapter.params)}
    return JobSpec(framework=params.pop("framework", "tensorflow"), params=params, table=table)


def plan_for(tmp_path: Path, cluster=None, source="print('hi')\n", **params):
    script = tmp_path / "train.py"
    script.write_text(source)
    if cluster is not None:
        params["cluster"] = cluster
    spec = make_spec(script=str(script), **params)
    adapter = TensorflowAdapter()
    adapter.validate(spec)
    return adapter.plan(spec, StagedCode(script, None, tmp_path))


def test_versioned_names_are_the_same_adapter():
    for name in ("tensorflow", "TensorFlow", "tensorflow1120", "tensorflow1150", "tensorflow1120_ext"):
        assert isinstance(get_adapter(name), TensorflowAdapter)


def test_no_cluster_is_one_worker(tmp_path):
    plan = plan_for(tmp_path)
    assert [(r.name, r.count, r.must_finish) for r in plan.roles] == [("worker", 1, True)]
    assert plan.task_name == "TensorflowTask"


def test_without_chief_workers_must_finish_and_ps_is_a_service(tmp_path):
    plan = plan_for(tmp_path, {"ps": {"count": 1}, "worker": {"count": 2}, "evaluator": {"count": 1}})
    by_name = {r.name: r for r in plan.roles}
    assert [r.name for r in plan.roles][0] == "ps"  # services start first
    assert by_name["worker"].must_finish and not by_name["ps"].must_finish
    assert not by_name["evaluator"].must_finish and not by_name["evaluator"].listens
    # no chief: the user's script runs everywhere, the ps included (TF1 style)
    assert all("--serve" not in r.argv for r in plan.roles)
    assert plan.restart == "job"


def test_with_chief_only_the_chief_must_finish_and_ps_workers_serve(tmp_path):
    plan = plan_for(tmp_path, {"chief": {"count": 1}, "ps": {"count": 1}, "worker": {"count": 2}})
    by_name = {r.name: r for r in plan.roles}
    assert by_name["chief"].must_finish
    assert not by_name["worker"].must_finish and not by_name["ps"].must_finish
    assert "--serve" in by_name["ps"].argv and "--serve" in by_name["worker"].argv
    assert str(tmp_path / "train.py") in by_name["chief"].argv
    every = plan_for(tmp_path, {"chief": {"count": 1}, "worker": {"count": 1}}, scriptRoles="all")
    assert all("--serve" not in r.argv for r in every.roles)


def test_gpu_goes_on_training_roles_only(tmp_path):
    plan = plan_for(tmp_path, {"ps": {"count": 1}, "worker": {"count": 2}}, gpuRequired=100)
    assert {r.name: r.gpu for r in plan.roles} == {"ps": 0, "worker": 100}


@pytest.mark.parametrize("cluster, message", [
    ({"master": {"count": 1}}, 'unknown TensorFlow role "master"'),
    ({"chief": {"count": 2}, "worker": {"count": 1}}, "at most one chief"),
    ({"ps": {"count": 1}}, "no worker or chief"),
    ({"chief": {"count": 1}, "ps": {"count": 1}}, "add"),
])
def test_bad_clusters_are_refused_with_a_hint(tmp_path, cluster, message):
    with pytest.raises(SpecError) as err:
        plan_for(tmp_path, cluster)
    assert "-Dcluster" in str(err.value) and message in str(err.value)


CLASSIC_ABSL = """
import tensorflow as tf
flags = tf.compat.v1.app.flags
flags.DEFINE_string("ps_hosts", "", "")
flags.DEFINE_string('worker_hosts', "", "")
flags.DEFINE_string("job_name", "", "")
flags.DEFINE_integer(name="task_index", default=0, help="")
"""
CLASSIC_ARGPARSE = """
import argparse
p = argparse.ArgumentParser()
p.add_argument("--job_name"); p.add_argument('--task_index', type=int)
"""


def test_classic_flags_are_passed_only_when_the_script_defines_them(tmp_path):
    for source, expected in [(CLASSIC_ABSL, ["ps_hosts", "worker_hosts", "job_name", "task_index"]),
                             (CLASSIC_ARGPARSE, ["job_name", "task_index"]),
                             ("import os\nprint(os.environ['TF_CONFIG'])\n", [])]:
        script = tmp_path / "s.py"
        script.write_text(source)
        assert defined_classic_flags(str(script)) == expected
        assert choose_classic_flags("auto", str(script), None, {"ps": ["h:1"]}) == expected
    assert choose_classic_flags("never", str(script), None, {}) == []
    assert "chief_hosts" in choose_classic_flags("always", str(script), None, {"chief": ["h:1"]})
    plan = plan_for(tmp_path, {"ps": {"count": 1}, "worker": {"count": 1}}, clusterFlags="never")
    assert "--cluster-flags=never" in plan.role("worker").argv


def test_flags_defined_in_another_module_of_an_archive_are_found(tmp_path):
    root = tmp_path / "code"
    (root / "pkg").mkdir(parents=True)
    (root / "main.py").write_text("import pkg.flags\n")
    (root / "pkg" / "flags.py").write_text(CLASSIC_ABSL)
    assert "ps_hosts" in defined_classic_flags(str(root / "main.py"))   # its own import
    assert "ps_hosts" in defined_classic_flags(str(root / "main.py"), str(root))
    plan = TensorflowAdapter().plan(make_spec(script=str(root / "main.py")),
                                    StagedCode(root / "main.py", root, root))
    assert f"--code-root={root}" in plan.role("worker").argv


@pytest.mark.parametrize("line, expected", [
    ("step=3, global_step=3, loss=6.977772, duration=3.645903s.",
     {"step": 3, "global_step": 3, "loss": 6.977772, "duration": 3.645903}),
    ("INFO:tensorflow:loss = 0.52, step = 100 (0.311 sec)", {"loss": 0.52, "step": 100}),
    ("32/32 - 0s - 2ms/step - accuracy: 0.9644 - loss: 0.0973", {"accuracy": 0.9644, "loss": 0.0973}),
    ("Epoch 3/5", {"epoch": 3}),
])
def test_metric_patterns(tmp_path, line, expected):
    """Through the parser the master runs on every log line, with the plan's patterns."""
    from paicli.cluster.logsink import MetricParser

    plan = plan_for(tmp_path)
    step, found = MetricParser(plan.metric_patterns).parse(line)
    assert found == expected
    assert step == expected.get("step")


# ---------------------------------------------------------------------------
# Real jobs


@pytest.fixture(scope="module")
def tf_runtime():
    from paicli.runners.runtimes import get_runtime

    runtime = get_runtime("tensorflow")
    runtime.ensure(lambda line: print(line, file=sys.stderr))
    return runtime


def pai_command() -> str:
    beside = Path(sys.executable).with_name("pai")
    return str(beside) if beside.exists() else (shutil.which("pai") or "pai")


class Pai:
    def __init__(self, home: Path):
        self.env = {**os.environ, "PAI_HOME": str(home)}
        self.env.pop("PAI_DEBUG", None)

    def __call__(self, *args: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
        return subprocess.run([pai_command(), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def run_job(self, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
        done = self("-name", "tensorflow", *args)
        match = re.search(r"^ID = (\S+)", done.stdout, re.M)
        assert match, f"no job ID in the output:\n{done.stdout}\n{done.stderr}"
        status = self("status", match.group(1), "--json", timeout=60)
        assert status.returncode == 0, status.stderr
        return done, json.loads(status.stdout)


@pytest.fixture
def pai(tmp_path, tf_runtime):
    return Pai(tmp_path / "pai-home")


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def assert_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0 and last_line(done) == "OK", \
        f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-2000:]}"


def assert_no_process_left(status: dict) -> None:
    deadline = time.monotonic() + 10
    for inst in status["instances"]:
        for pgid in {inst.get("pgid"), inst.get("pid")} - {None}:
            while True:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:  # the id went to someone else's process
                    break
                assert time.monotonic() < deadline, f"{inst['role']}:{inst['index']} left group {pgid}"
                time.sleep(0.2)


def loss_series(status: dict, instance: str) -> list[float]:
    return [value for _step, value in status["metric_series"].get(instance, {}).get("loss", [])]


def test_async_ps_worker_example_runs_the_seed_picture(pai):
    done, status = pai.run_job(f"-Dscript=file://{EXAMPLES / 'async_ps_worker.py'}",
                               '-Dcluster={"ps":{"count":1},"worker":{"count":2}}',
                               "-DuserDefinedParameters=--steps 300 --log_every 20")
    assert_ok(done)
    out = done.stdout
    by_global_step = []
    for worker in ("worker:0", "worker:1"):
        assert re.search(rf"^\[{worker}\] step=\d+, global_step=\d+, loss=[\d.]+, duration=[\d.]+s\.",
                         out, re.M), out[-3000:]
        assert status["metrics"][worker]["global_step"] >= 300
        series = status["metric_series"][worker]
        by_global_step += [(g, loss) for (_, g), (_, loss) in zip(series["global_step"], series["loss"])]
    # Async training: a worker that imports TensorFlow late may only see the end of it,
    # so judge the loss along the shared global step.
    by_global_step.sort()
    assert len(by_global_step) >= 4 and by_global_step[-1][1] < by_global_step[0][1] / 5, by_global_step
    assert re.search(r"^train: \S+ \S+ TensorflowTask_job:\d+/\d+/\d+\[\d+%\]", out, re.M)
    assert "oneDNN custom operations" not in out  # the runner drops TF's import banner
    assert "Local rendezvous is aborting" not in out   # TF's C++ warnings as the job ends: below its errors
    assert status["status"] == "Succeeded"
    by_name = {f"{i['role']}:{i['index']}": i for i in status["instances"]}
    assert by_name["worker:0"]["exit_code"] == 0 and by_name["worker:1"]["exit_code"] == 0
    # the ps never exits by itself: it was stopped, and the runner made that a clean exit
    assert by_name["ps:0"]["exit_code"] == 0, by_name["ps:0"]
    assert "ps stopped by SIGTERM" in pai("logs", status["id"], "--instance", "ps:0").stdout
    assert_no_process_left(status)


def test_parameter_server_strategy_with_chief(pai):
    done, status = pai.run_job(
        f"-Dscript=file://{EXAMPLES / 'ps_strategy_chief.py'}",
        '-Dcluster={"chief":{"count":1},"ps":{"count":1},"worker":{"count":2}}',
        "-DuserDefinedParameters=--rounds 4 --steps_per_round 10")
    assert_ok(done)
    assert re.search(r"^\[chief:0\] step=3, global_step=40, loss=", done.stdout, re.M), done.stdout[-3000:]
    assert status["metrics"]["chief:0"]["global_step"] == 40
    losses = loss_series(status, "chief:0")
    assert len(losses) == 4 and losses[-1] < losses[0] / 3, losses
    servers = [i for i in status["instances"] if i["role"] in ("ps", "worker")]
    assert len(servers) == 3
    for inst in servers:  # the runner's tf.distribute.Server exits 0 on SIGTERM
        assert inst["exit_code"] == 0, inst
        log = pai("logs", status["id"], "--instance", f"{inst['role']}:{inst['index']}").stdout
        assert "serving at 127.0.0.1:" in log and "server stopped by SIGTERM" in log
    assert_no_process_left(status)


TF_CONFIG_PROBE = """
import json, os, sys, time
import tensorflow as tf

out = sys.argv[1]
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
me = f"{os.environ['PAI_ROLE']}:{os.environ['PAI_INDEX']}"
record = {"tf_config": json.loads(os.environ["TF_CONFIG"]), "task_type": resolver.task_type,
          "task_id": resolver.task_id, "cluster": resolver.cluster_spec().as_dict(),
          "port": os.environ.get("PAI_PORT")}
with open(os.path.join(out, me + ".tmp"), "w") as f:
    json.dump(record, f)
os.rename(os.path.join(out, me + ".tmp"), os.path.join(out, me + ".json"))
if resolver.task_type != "chief":
    time.sleep(600)  # a service: the launcher stops it once the chief is done
deadline = time.time() + 120
while len([n for n in os.listdir(out) if n.endswith(".json")]) < 4 and time.time() < deadline:
    time.sleep(0.2)
"""


def test_tf_config_per_instance_is_what_tensorflow_expects(pai, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(TF_CONFIG_PROBE)
    out = tmp_path / "out"
    out.mkdir()
    done, status = pai.run_job(
        f"-Dscript={script}", "-DscriptRoles=all", f"-DuserDefinedParameters={out}",
        '-Dcluster={"chief":{"count":1},"ps":{"count":1},"worker":{"count":1},"evaluator":{"count":1}}')
    assert_ok(done)
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(records) == {"chief:0", "ps:0", "worker:0", "evaluator:0"}
    cluster = records["chief:0"]["cluster"]
    assert set(cluster) == {"chief", "ps", "worker"}  # the evaluator stays out of the cluster
    for name, record in records.items():
        role, index = name.split(":")
        assert record["task_type"] == role and record["task_id"] == int(index)
        assert record["tf_config"]["task"] == {"type": role, "index": int(index)}
        assert record["cluster"] == cluster  # every instance sees the same cluster
        if role != "evaluator":
            assert cluster[role][int(index)] == f"127.0.0.1:{record['port']}"
    assert_no_process_left(status)


CLASSIC_SCRIPT = """
import tensorflow as tf

flags = tf.compat.v1.app.flags
flags.DEFINE_string("ps_hosts", "", "comma-separated host:port")
flags.DEFINE_string("worker_hosts", "", "comma-separated host:port")
flags.DEFINE_string("job_name", "", "ps or worker")
flags.DEFINE_integer("task_index", 0, "index within the job")
flags.DEFINE_integer("steps", 10, "global steps to train")
FLAGS = flags.FLAGS


def main(_):
    cluster = tf.train.ClusterSpec({"ps": FLAGS.ps_hosts.split(","),
                                    "worker": FLAGS.worker_hosts.split(",")})
    server = tf.compat.v1.train.Server(cluster, job_name=FLAGS.job_name, task_index=FLAGS.task_index)
    if FLAGS.job_name == "ps":
        server.join()
    tf.compat.v1.disable_eager_execution()
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            worker_device="/job:worker/task:%d" % FLAGS.task_index, cluster=cluster)):
        step = tf.compat.v1.train.get_or_create_global_step()
        v = tf.compat.v1.get_variable("v", [], initializer=tf.compat.v1.constant_initializer(5.0))
        loss = tf.square(v)
        train = tf.compat.v1.train.GradientDescentOptimizer(0.05).minimize(loss, global_step=step)
    manager = tf.compat.v1.train.SessionManager(
        ready_op=tf.compat.v1.report_uninitialized_variables(), recovery_wait_secs=0.2)
    config = tf.compat.v1.ConfigProto(
        device_filters=["/job:ps", "/job:worker/task:%d" % FLAGS.task_index])
    if FLAGS.task_index == 0:
        sess = manager.prepare_session(server.target, config=config,
                                       init_op=tf.compat.v1.global_variables_initializer())
    else:
        sess = manager.wait_for_session(server.target, config=config, max_wait_secs=120)
    print("classic %s:%d of %s" % (FLAGS.job_name, FLAGS.task_index, FLAGS.worker_hosts), flush=True)
    while True:
        _, value, global_step = sess.run([train, loss, step])
        print("INFO:tensorflow:loss = %f, step = %d" % (value, global_step), flush=True)
        if global_step >= FLAGS.steps:
            break


if __name__ == "__main__":
    tf.compat.v1.app.run()
"""


def test_a_classic_flags_script_runs_unmodified_with_its_flags_in_an_archive_module(pai, tmp_path):
    """1 ps + 2 workers of a 2016-style script whose flags are defined in a module of its
    archive, not in the entry file (the entry-file case is the parser's, above; a plain
    script importing its flags is tf_cnn_benchmarks in test_fidelity_tf.py)."""
    import tarfile

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("")
    head, body = CLASSIC_SCRIPT.split("FLAGS = flags.FLAGS\n")
    (src / "pkg" / "cluster_flags.py").write_text(head + "FLAGS = flags.FLAGS\n")
    (src / "main.py").write_text("import tensorflow as tf\nfrom pkg.cluster_flags import FLAGS\n" + body)
    archive = tmp_path / "code.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=".")
    done, status = pai.run_job(f"-Dscript={archive}", "-DentryFile=main.py",
                               "-DuserDefinedParameters=--steps 12",
                               '-Dcluster={"ps":{"count":1},"worker":{"count":2}}')
    assert_ok(done)
    assert "[worker:0] classic worker:0 of 127.0.0.1:" in done.stdout
    assert re.search(r"^\[worker:1\] classic worker:1 of 127\.0\.0\.1:\d+,127\.0\.0\.1:\d+$", done.stdout, re.M)
    for worker in ("worker:0", "worker:1"):
        assert f"[{worker}] [tensorflow runner] passing --ps_hosts --worker_hosts --job_name --task_index" \
            in done.stdout
    # LoggingTensorHook-style lines became metrics
    steps = [status["metrics"][w]["step"] for w in ("worker:0", "worker:1")]
    assert max(steps) >= 12
    assert_no_process_left(status)


ARGPARSE_SCRIPT = """
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--checkpointDir")
p.add_argument("--lr", type=float)
p.add_argument("--name")
p.add_argument("--batch", type=int)
args = p.parse_args()  # strict: any flag it does not define fails the job
print("ARGS " + json.dumps(vars(args), sort_keys=True))
print("TASK " + json.dumps(json.loads(os.environ["TF_CONFIG"])["task"], sort_keys=True))
"""


def test_argparse_script_gets_its_own_flags_and_no_cluster_flags(pai, tmp_path):
    script = tmp_path / "strict.py"
    script.write_text(ARGPARSE_SCRIPT)
    hyper = tmp_path / "hyper.txt"
    hyper.write_text("# batch size\nbatch=64\n")
    ckpt = tmp_path / "ckpt"   # (the job makes its checkpoint folder: not one in this machine's /tmp)
    done, status = pai.run_job(f"-Dscript={script}", f"-DhyperParameters={hyper}",
                               f"-DcheckpointDir={ckpt}", "-DuserDefinedParameters=--lr=0.1 --name 'a b'")
    assert_ok(done)
    args = json.loads(re.search(r"^\[worker:0\] ARGS (.*)$", done.stdout, re.M).group(1))
    assert args == {"checkpointDir": str(ckpt), "lr": 0.1, "name": "a b", "batch": 64}
    assert '[worker:0] TASK {"index": 0, "type": "worker"}' in done.stdout
    assert [f"{i['role']}:{i['index']}" for i in status["instances"]] == ["worker:0"]


RECOVERY_SCRIPT = """
import tensorflow as tf

v1 = tf.compat.v1
v1.disable_eager_execution()
for given in ({}, {"recovery_wait_secs": 7}):
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        sv = v1.train.Supervisor(logdir=None, global_step=step, **given)
        print("SUPERVISOR", sv._recovery_wait_secs, sv.session_manager._recovery_wait_secs)
print("SESSION_MANAGER", v1.train.SessionManager()._recovery_wait_secs,
      v1.train.SessionManager(None, None, None, None, 5)._recovery_wait_secs)
"""


def test_a_tf1_worker_looks_for_its_chief_every_second_unless_the_script_says(pai, tmp_path):
    """TF1's Supervisor and SessionManager look again for the chief's initialised
    variables every 30 s by default: the peer tf_cnn_benchmarks' second worker lost half
    a minute in 7 of 8 runs. Under the runner the default is 1 s; a script's own value,
    by keyword or by position, is kept."""
    script = tmp_path / "recovery.py"
    script.write_text(RECOVERY_SCRIPT)
    done, _ = pai.run_job(f"-Dscript={script}")
    assert_ok(done)
    assert "[worker:0] SUPERVISOR 1 1" in done.stdout, done.stdout[-3000:]
    assert "[worker:0] SUPERVISOR 7 7" in done.stdout, done.stdout[-3000:]
    assert "[worker:0] SESSION_MANAGER 1 5" in done.stdout, done.stdout[-3000:]


def test_a_step_line_is_never_broken_by_a_threads_stderr_line(pai, tmp_path):
    """Under `python -u` print writes a line and its newline apart, and stderr shares the
    instance's pipe: a thread's log line landed inside a step line (the peer
    tf_cnn_benchmarks lost its step-1 line so: its GlobalStepWatcher thread logs "Starting
    real work" as a worker prints step 1). Under the runner every line is whole."""
    script = tmp_path / "chatty.py"
    step_format = "%i\timages/sec: 12.5 +/- 0.0 (jitter = 0.0)\t7.25"
    script.write_text(chatty_script("I1128 chatter on stderr", step_format))
    done, _ = pai.run_job(f"-Dscript={script}")
    assert_ok(done)
    broken, whole = broken_lines(done.stdout, "worker:0", "I1128 chatter on stderr", step_format)
    assert not broken, broken[:5]
    assert whole == 4000


FAILING_SCRIPT = """
import os, time

def load_shard(n):
    raise ValueError(f"shard {n} is corrupt")

if os.environ["PAI_INDEX"] == "1":
    load_shard(7)
time.sleep(120)  # worker:0 would go on; the failure of worker:1 must end it
"""


def test_a_script_that_raises_fails_the_job_naming_the_worker(pai, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(FAILING_SCRIPT)
    started = time.monotonic()
    done, status = pai.run_job(f"-Dscript={script}", '-Dcluster={"worker":{"count":2}}')
    assert done.returncode == 1, done.stdout[-3000:]
    assert time.monotonic() - started < 90  # did not wait for worker:0's sleep
    final = last_line(done)
    assert final.startswith("FAILED:") and "worker:1" in final, final
    assert "ValueError: shard 7 is corrupt" in done.stdout
    assert status["status"] == "Failed" and "worker:1" in status["reason"]
    assert "ValueError: shard 7 is corrupt" in status["reason"]  # the traceback's last lines
    assert_no_process_left(status)


PORT_STEALER = """
import os, socket, sys
import tensorflow as tf

marker = sys.argv[1]
role, index = os.environ["PAI_ROLE"], int(os.environ["PAI_INDEX"])
cluster = json_cluster = __import__("json").loads(os.environ["TF_CONFIG"])["cluster"]
held = None
if role == "ps" and not os.path.exists(marker):
    open(marker, "w").close()
    # Someone else took the port between its assignment and our bind.
    held = socket.socket()
    held.bind(("0.0.0.0", int(os.environ["PAI_PORT"])))
    held.listen()
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=role, task_index=index)
if role == "ps":
    server.join()
tf.compat.v1.disable_eager_execution()
with tf.compat.v1.device("/job:ps/task:0"):
    v = tf.compat.v1.get_variable("v", [], initializer=tf.compat.v1.constant_initializer(3.0))
with tf.compat.v1.Session(server.target) as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    print("value from the ps:", sess.run(v), flush=True)
"""


def test_a_taken_port_is_retried_on_a_fresh_one(pai, tmp_path):
    script = tmp_path / "steal.py"
    script.write_text(PORT_STEALER)
    marker = tmp_path / "stolen"
    done, status = pai.run_job(f"-Dscript={script}", f"-DuserDefinedParameters={marker}",
                               '-Dcluster={"ps":{"count":1},"worker":{"count":1}}')
    assert marker.exists()  # the first attempt did find its port taken
    assert_ok(done)
    assert "[worker:0] value from the ps: 3.0" in done.stdout
    ps = next(i for i in status["instances"] if i["role"] == "ps")
    assert ps["attempts"] >= 2, ps
    assert_no_process_left(status)


def test_keras_single_worker_loss_becomes_metrics(pai):
    done, status = pai.run_job(f"-Dscript=file://{EXAMPLES / 'keras_single_worker.py'}",
                               "-DuserDefinedParameters=--epochs 4 --samples 1024")
    assert_ok(done)
    assert re.search(r"^\[worker:0\] .* - loss: [\d.]+", done.stdout, re.M), done.stdout[-2000:]
    losses = loss_series(status, "worker:0")
    assert len(losses) >= 4 and losses[-1] < losses[0], losses
    assert status["metrics"]["worker:0"]["epoch"] == 4


def test_own_interpreter_through_the_environment(pai, tmp_path, tf_runtime):
    """PAI_TENSORFLOW_PYTHON points the framework at an interpreter of the user's own
    (here: the provisioned one, seen from an empty runtime directory): nothing is
    provisioned and the job runs with that interpreter."""
    script = tmp_path / "which.py"
    script.write_text("import sys\nprint('python is', sys.executable)\n")
    empty = tmp_path / "no-runtimes"
    pai.env.update(PAI_RUNTIME_DIR=str(empty), PAI_TENSORFLOW_PYTHON=tf_runtime.python())
    done, _status = pai.run_job(f"-Dscript={script}")
    assert_ok(done)
    assert f"[worker:0] python is {tf_runtime.python()}" in done.stdout
    assert not (empty / "tensorflow").exists()
