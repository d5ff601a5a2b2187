"""The Ray backend (issue 9): the same `pai -name ...` jobs on a real Ray cluster.

The module starts one Ray cluster for all its cluster tests (tests/ray_cluster.py):
a head and two worker nodes with `ray start`, each in its own network namespace
with its own address, one CPU each, dashboard off; torn down at the end even when
a test fails. `pai` runs on the head node (the master is the Ray driver there).
Every test that needs a Ray cluster of this shape is here, the files a job writes
coming back from the nodes included, so the cluster is started once. The unit tests
at the top start nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from paicli.cluster.backends import ray as rb
from paicli.cluster.backends import ray_node
from paicli.cluster.backends.base import agent_ref
from paicli.errors import UsageError
from paicli.jobplan import JobPlan, RolePlan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import wait_until, watchdog_of, watchdog_says  # noqa: E402
from ray_cluster import RayCluster, cannot_run, job_processes, node_job_folders  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Two runs of this module on one machine need two clusters: PAI_TEST_RAY=PREFIX,SUBNET picks another.
PREFIX, SUBNET = (os.environ.get("PAI_TEST_RAY") or "fray,10.213.9").split(",")


# ---------------------------------------------------------------------------
# Pure parts: no Ray, no processes


def plan_of(*roles: RolePlan) -> JobPlan:
    return JobPlan(job_name="j", framework="python", task_name="PythonTask", roles=list(roles))


def test_bundles_from_pai_units():
    assert rb.bundle_for(100, 0, 0) == {"CPU": 1.0}
    assert rb.bundle_for(250, 2000, 100) == {"CPU": 2.5, "memory": 2000.0 * 1024 * 1024, "GPU": 1.0}
    assert rb.bundle_for(0, 0, 0) == {"CPU": 0.01}   # a bundle may not be empty
    plan = plan_of(RolePlan("ps", 1, ["x"], must_finish=False, cpu=50), RolePlan("worker", 2, ["x"]))
    assert rb.job_bundles(plan) == [("ps", 0, {"CPU": 0.5}), ("worker", 0, {"CPU": 1.0}),
                                    ("worker", 1, {"CPU": 1.0})]


def test_services_spread_workers_pack():
    assert rb.strategy_for(plan_of(RolePlan("ps", 1, ["x"], must_finish=False), RolePlan("worker", 2, ["x"]))) \
        == "SPREAD"
    assert rb.strategy_for(plan_of(RolePlan("worker", 4, ["x"]))) == "PACK"


def test_waiting_list_names_what_cannot_be_placed():
    wanted = [("worker", i, {"CPU": 1.0}) for i in range(4)]
    line = rb.waiting_list(wanted, {"10.0.0.1": {"CPU": 1.0}, "10.0.0.2": {"CPU": 1.0}})
    assert "2 instance(s) cannot be placed now: worker:2 (cpu 100), worker:3 (cpu 100)" in line
    assert "the freest node has cpu 100" in line
    gpu = rb.waiting_list([("worker", 0, {"CPU": 1.0, "GPU": 1.0})], {"n": {"CPU": 4.0}})
    assert "worker:0 (cpu 100, gpu 100)" in gpu and "0 GPU(s) free" in gpu
    assert "no node is up" in rb.waiting_list(wanted, {})


def test_only_what_the_master_set_goes_to_the_node(monkeypatch):
    """base.Backend builds every remote backend's agent spec: the node gets the
    entries the master set or changed, not the master's own PATH, HOME, ..."""
    from paicli.cluster.backends.base import Backend, Placement

    class Remote(Backend):
        def _mapping(self, placed, argv0):
            return []

    monkeypatch.setenv("PAI_DEBUG", "1")
    for name in ("PAI_ROLE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    env = dict(os.environ, PAI_ROLE="worker", CUDA_VISIBLE_DEVICES="")
    spec = Remote()._agent_spec(Placement("worker", 0, "n1", "10.0.0.1"), ["python3"], env, None, None)
    assert spec["env"] == {"PAI_ROLE": "worker", "CUDA_VISIBLE_DEVICES": ""}


def tar_of(manifest) -> bytes:
    """What the Ray backend puts in the object store for a job's staging list."""
    from paicli.cluster import node_files

    return node_files.tar_stream(manifest.files)


def manifest_of(tmp_path: Path, *files):
    """A Manifest of NodeFiles (dst, kind, target) whose sources are made here."""
    from paicli.cluster import node_files

    out = []
    for dst, kind, target in files:
        src = tmp_path / "src" / dst
        if kind == "file":
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_text(f"content of {dst}")
        out.append(node_files.NodeFile(str(src), dst, 0o700 if kind != "file" else 0o600, kind, target))
    return node_files.Manifest(out)


def test_the_actor_writes_the_staging_list_and_nothing_outside(tmp_path, monkeypatch):
    """The actor writes what staging put into the object store with the node writer
    of every backend: folders 0700, files 0600, links that stay inside; a member
    or a link that would leave the job's folder is refused in one line."""
    monkeypatch.setattr(ray_node.tempfile, "gettempdir", lambda: str(tmp_path))
    actor = ray_node.InstanceActor("job1", "job1/worker:0", "n" * 20)
    tar = tar_of(manifest_of(tmp_path, ("code", "dir", ""), ("code/t.py", "file", ""),
                                     ("code/l.py", "link", "t.py")))
    assert actor.stage(tar) == {"folder": actor.folder}
    folder = Path(actor.folder)
    assert (folder / "code").stat().st_mode & 0o777 == 0o700
    assert (folder / "code" / "t.py").stat().st_mode & 0o777 == 0o600
    assert (folder / "code" / "l.py").read_text() == "content of code/t.py"
    escape = tar_of(manifest_of(tmp_path, ("code/out", "link", "../../escape")))
    assert "leaves the folder" in actor.stage(escape)["error"]
    assert not (folder / "code" / "out").exists()


def test_what_staging_ships_is_the_one_list_and_no_secret(tmp_path):
    """Ray ships the staging list of cluster/node_files.py, whole and nothing else:
    not plan.json, which holds a Caffe job's averaging secret."""
    import tarfile
    from io import BytesIO

    from paicli.cluster import node_files

    job_dir = tmp_path / "job1"
    (job_dir / "code").mkdir(parents=True)
    (job_dir / "code" / "train.py").write_text("print(1)")
    secret = "s3cr3t" * 8
    plan = plan_of(RolePlan("worker", 1, [sys.executable, "train.py"], env={"PAI_CAFFE_SECRET": secret}))
    (job_dir / "plan.json").write_text(plan.to_json())
    (job_dir / "spec.json").write_text("{}")
    manifest = node_files.manifest(job_dir, plan)
    shipped = tar_of(manifest)
    with tarfile.open(fileobj=BytesIO(shipped)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert list(members) == [f.dst for f in manifest.files]
        assert tar.extractfile(members["code/train.py"]).read() == b"print(1)"
    assert "plan.json" not in members and "spec.json" not in members
    assert secret.encode() not in shipped


def test_the_actor_relays_bytes_to_a_real_node_agent(tmp_path, monkeypatch):
    """The actor's relay (open/send/recv/close) under agent_link, without Ray: the
    instance starts, its output and exit status come back through the relay, and
    closing the relay stops a group that still runs (a late close of an earlier
    relay on the same actor, a restart's, does not)."""
    from paicli.cluster import agent_link, node_files

    monkeypatch.setattr(ray_node.tempfile, "gettempdir", lambda: str(tmp_path))
    actor = ray_node.InstanceActor("job1", "job1/worker:0", "n" * 20)
    assert actor.stage(tar_of(node_files.Manifest(node_files.runner_files()))) == {"folder": actor.folder}

    class Direct:   # the RayTransport's calls, made on the actor in this process
        def send(self, data):
            actor.send(data)

        def recv(self, max_bytes, timeout):
            data = actor.recv(max_bytes, timeout)
            if data is None:
                raise TimeoutError
            return data

        def close(self):
            actor.close()

    def run(argv):
        agents.append(actor.open())
        return agent_link.start_instance(Direct(), {"argv": argv, "env": {}, "cwd": None, "heartbeat": 0},
                                         backend="ray", node="n", host="n", start_timeout=30)

    agents = []
    handle = run([sys.executable, "-c", "print('x' * 300000); raise SystemExit(3)"])
    out = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            chunk = os.read(handle.output_fd, 65536)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        if not chunk:
            break
        out += chunk
    assert out == b"x" * 300000 + b"\n"
    assert handle.native.wait(30) == 3
    handle = run([sys.executable, "-c", "import time; time.sleep(60)"])
    ref = agent_ref(handle.ref)
    assert handle.ref.pid > 0 and ray_node.node_agent.alive(ref)
    actor.close(agents[0])   # the first link's close, arriving late: this agent is not its
    time.sleep(1)
    assert ray_node.node_agent.alive(ref)
    actor.close()   # what Ray killing the actor does to the agent's stdin
    deadline = time.monotonic() + 10
    while ray_node.node_agent.alive(ref):
        assert time.monotonic() < deadline, "the group outlived its relay"
        time.sleep(0.1)


def test_a_restarts_relay_is_not_ended_by_the_last_agents_late_eof(tmp_path, monkeypatch):
    """A restart opens a new relay on the same actor while the last node agent is
    still ending: its EOF, however late, must not read as the new agent's end (it
    did once in CI: the restart came back as a lost node). The last
    agent's EOF is made to land while the new one is being started, the widest
    window there is."""
    monkeypatch.setattr(ray_node.tempfile, "gettempdir", lambda: str(tmp_path))
    actor = ray_node.InstanceActor("job1", "job1/worker:0", "n" * 20)
    real_popen = subprocess.Popen
    started = []

    def popen(argv, **kw):   # an "agent" that ends, EOF on its stdout, once its stdin closes
        if started:
            started[-1].wait(10)
            deadline = time.monotonic() + 10
            while not actor.eof and time.monotonic() < deadline:
                time.sleep(0.01)     # the last agent's pump has taken its EOF
            assert actor.eof
        proc = real_popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read()"], **kw)
        started.append(proc)
        return proc

    monkeypatch.setattr(ray_node.subprocess, "Popen", popen)
    try:
        actor.open()
        actor.open()
        assert actor.recv(100, 0.3) is None    # nothing yet; b"" would mean "the agent ended"
        actor.send(b"")
        actor.close()
        assert actor.recv(100, 10) == b""      # now it has
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_heartbeat_to_an_actor_that_does_not_answer_does_not_wait():
    """One thread beats every link in turn: a send that waited on the actor of a node
    that stopped answering (10 s each) starved the other links' agents, which then
    stopped their healthy instances for want of a heartbeat."""

    class NeverAnswers:
        sent: list[bytes] = []

        class send:
            @staticmethod
            def remote(data):
                NeverAnswers.sent.append(data)
                return object()   # an ObjectRef that never resolves

    class Backend:
        _ray = None

        def _get(self, *args, **kwargs):
            time.sleep(10)   # what waiting on that actor costs

    link = rb.RayTransport(Backend(), NeverAnswers, agent=1)
    began = time.monotonic()
    for _ in range(5):
        link.send(b"h")
    assert time.monotonic() - began < 1.0
    assert NeverAnswers.sent == [b"h"] * 5


def test_a_control_store_call_that_never_answers_ends_at_its_deadline():
    """ray.nodes(), ray.put() and removing a placement group wait as long as Ray keeps
    trying to reach its GCS: each runs with a deadline of ours, and a cancel ends it."""
    from paicli.errors import PaiError

    backend = object.__new__(rb.RayBackend)
    backend._interrupted, backend._deadline, backend._timeout = (lambda: None), None, None
    began = time.monotonic()
    with pytest.raises(PaiError, match="listing the nodes: no answer from Ray within 0.5s"):
        backend._bounded(lambda: time.sleep(30), "listing the nodes", timeout=0.5)
    assert time.monotonic() - began < 2.0
    backend._interrupted = lambda: "cancelled by user"
    with pytest.raises(rb.RayWaitStopped, match="cancelled by user"):
        backend._bounded(lambda: time.sleep(30), "listing the nodes", timeout=30)
    assert time.monotonic() - began < 4.0
    assert backend._bounded(lambda: 42, "a quick call") == 42


def test_a_runners_input_that_the_object_store_never_takes_ends_at_the_calls_deadline():
    """run_runner puts its stdin in Ray's object store before the pinned task runs:
    that put waits on the control store like ray.nodes, so it has a deadline too
    (the call's own), and one line names what did not answer."""
    import threading
    import types

    from paicli.errors import PaiError

    released = threading.Event()
    fake_ray = types.SimpleNamespace(
        cloudpickle=types.SimpleNamespace(register_pickle_by_value=lambda module: None),
        put=lambda data: released.wait(20))   # a control store that never answers
    backend = object.__new__(rb.RayBackend)
    backend._interrupted, backend._deadline, backend._timeout = (lambda: None), None, None
    backend._ray, backend._unusable = fake_ray, False
    backend._instances = {("worker", 0): rb._Instance("worker", 0, object(), node_id="n1", host="10.0.0.1",
                                                      info={"folder": "/tmp/job"})}
    began = time.monotonic()
    try:
        with pytest.raises(PaiError, match="node_cache.py's input in Ray's object store: no answer from Ray "
                                           "within 0.5s"):
            backend.run_runner("10.0.0.1", "node_cache.py", ["parts", "/tmp/job"], b"data", timeout=0.5)
        assert time.monotonic() - began < 3.0
    finally:
        released.set()


def test_node_stop_checks_identity():
    """The pinned stop refuses a ref whose pid now has another start time or whose
    boot id is another's, and stops a group that is ours."""
    node_agent = ray_node.node_agent
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ref = [proc.pid, proc.pid, node_agent.proc_stat(proc.pid)[2], node_agent.boot_id()]
        assert not node_agent.stop_refs([[*ref[:2], str(int(ref[2]) + 1), ref[3]]], 1)
        assert not node_agent.stop_refs([[*ref[:3], "another-boot"]], 1)
        assert proc.poll() is None
        assert node_agent.stop_refs([ref], 2) == [ref]
        assert proc.wait(5) == -15
        assert not node_agent.alive(ref)
    finally:
        proc.kill()
        proc.wait()


def test_the_actor_code_needs_no_paicli_on_the_node():
    """What the backend ships to Ray nodes (by value) loads and runs in an
    interpreter where paicli cannot be imported."""
    pytest.importorskip("ray")
    import ray.cloudpickle as cloudpickle

    ray_node.ship_by_value(cloudpickle)
    agent = ray_node.node_agent   # its functions run pinned to a node as they are
    data = cloudpickle.dumps((ray_node.InstanceActor, ray_node.node_info.info, agent.free_ports, agent.alive))
    code = ("import os, sys, pickle; sys.modules['paicli'] = None; "
            "cls, info, ports, alive = pickle.loads(sys.stdin.buffer.read()); "
            "start = open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]; "
            "me = [os.getpid(), os.getpgid(0), start, '']; "
            "print(cls.__name__, len(ports('0.0.0.0', 2, set())), alive(me), info()['boot'] != '', "
            "'paicli' in sys.modules and sys.modules['paicli'] is not None)")
    result = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.decode().split() == ["InstanceActor", "2", "True", "True", "False"]


def test_address_errors_are_one_line():
    with pytest.raises(UsageError, match="needs an address"):
        rb.ray_address({"backend": "ray"})
    assert rb.ray_address({"backend": "ray", "ray": {"address": " 10.0.0.1:6379 "}}) == "10.0.0.1:6379"
    with pytest.raises(UsageError, match="does not answer"):
        rb.probe_address("127.0.0.1:1", timeout=1)
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        rb.probe_address("nohostport")


def test_without_ray_a_ray_address_says_how_to_install(tmp_path):
    """Ray hidden from the interpreter (sys.modules['ray'] = None makes `import ray`
    fail as if it were not installed): one line, exit 2, nothing recorded."""
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    code = "import sys; sys.modules['ray'] = None; from paicli.cli import main; sys.exit(main())"
    env = dict(os.environ, PAI_HOME=str(tmp_path / "home"), PAI_RAY_ADDRESS="127.0.0.1:6379", NO_COLOR="1")
    env.pop("PAI_DEBUG", None)
    result = subprocess.run([sys.executable, "-c", code, "-name", "python", f"-Dscript={script}"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Ray is not installed" in lines[0] and "pip install 'paicli[ray]'" in lines[0]
    assert "Traceback" not in result.stderr
    jobs = tmp_path / "home" / "jobs"
    assert not (jobs.exists() and any(jobs.iterdir()))   # nothing recorded, no job folder left


# ---------------------------------------------------------------------------
# A real Ray cluster: head + 2 workers, each in its own network namespace


@pytest.fixture(scope="module")
def ray_cluster():
    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    with RayCluster(prefix=PREFIX, subnet=SUBNET, gpus={"h3": 1}) as cluster:
        yield cluster


@pytest.fixture
def home(tmp_path, request):
    home = tmp_path / "pai-home"
    cluster = request.getfixturevalue("ray_cluster") if "ray_cluster" in request.fixturenames else None
    yield home
    if cluster is not None and (home / "jobs").exists():
        # A test that failed half-way may have left a job on the cluster the next
        # tests share: cancel whatever has not ended.
        listed = pai_ray(cluster, home, "list", "--json", "-n", "200", timeout=60)
        jobs = json.loads(listed.stdout) if listed.returncode == 0 else []
        for job in jobs:
            if job["status"] not in ("Succeeded", "Failed", "Cancelled"):
                pai_ray(cluster, home, "kill", job["id"], timeout=60)


def pai_ray(cluster: RayCluster, home: Path, *args: str, timeout: float = 300,
            env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`pai ARGS` on the head node with PAI_RAY_ADDRESS set (the master runs there)."""
    full = {"PAI_HOME": str(home), "PAI_RAY_ADDRESS": cluster.address, "NO_COLOR": "1",
            "PAI_DEBUG": ""}
    full.update(env or {})
    return cluster.run([sys.executable, "-m", "paicli", *args], env=full, timeout=timeout, cwd=str(cwd))


def job_id_of(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("ID = "):
            return line[5:].strip()
    if re.fullmatch(r"[0-9a-z]{12,40}", output.strip()):
        return output.strip()   # --detach prints the ID alone
    raise AssertionError(f"no 'ID = ' line in:\n{output}")


def status_of(cluster: RayCluster, home: Path, job_id: str) -> dict:
    result = pai_ray(cluster, home, "status", job_id, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def losses(output: str, role: str = "worker") -> list[float]:
    return [float(m.group(1)) for m in re.finditer(rf"\[{role}:\d+\].*?loss[=:]\s*([-+0-9.eE]+)", output)]


def staged_paths(folder: str) -> set[str]:
    """Every file and link under a node's per-job folder, relative to it (but outputs/,
    where the node agent lists what was there before an instance started: issue 17)."""
    return {os.path.relpath(os.path.join(top, name), folder) for top, _, files in os.walk(folder) for name in files
            if not os.path.relpath(top, folder).startswith("outputs")}


def assert_nothing_left(job_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    left = job_processes(job_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = job_processes(job_id)
    assert not left, f"processes of {job_id} left behind: {left}"


def test_python_job_runs_on_three_nodes(ray_cluster, home):
    result = pai_ray(ray_cluster, home, "-name", "python", f"-Dscript={REPO}/examples/python/ps_worker.py",
                     '-Dcluster={"ps":{"count":1},"worker":{"count":2}}')
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert result.stdout.rstrip().endswith("OK")
    job_id = job_id_of(result.stdout)
    status = status_of(ray_cluster, home, job_id)
    hosts = {i["host"] for i in status["instances"]}
    assert len(hosts) == 3 and all(h.startswith(SUBNET + ".") for h in hosts), status["instances"]
    assert {i["node"] for i in status["instances"]} == hosts
    series = losses(result.stdout)
    assert series and series[-1] < series[0]
    assert_nothing_left(job_id)
    assert not node_job_folders(job_id)   # the per-job folders on the nodes went with the job


def test_the_project_folder_travels_to_ray_nodes(ray_cluster, home, tmp_path):
    """The three-file project (tests/test_workdir_nodes.py) with the statement that
    runs it here: its data and configuration reach the Ray nodes beside the script."""
    from test_workdir_nodes import project

    proj = project(tmp_path / "proj")
    result = pai_ray(ray_cluster, home, "-name", "python", "-Dscript=train.py",
                     '-Dcluster={"worker":{"count":2}}', cwd=proj)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert result.stdout.count("rows 100 lr 0.1 on") == 2, result.stdout
    assert len(re.findall(r"workdir: \S+: 3 file\(s\) sent", result.stdout)) >= 1, result.stdout
    assert (proj / "out-0.txt").read_text() == (proj / "out-1.txt").read_text() == "100 rows\n"
    assert_nothing_left(job_id_of(result.stdout))


def loss_falls_along_steps(status: dict, instances: list[str]) -> None:
    for name in instances:
        series = [v for _s, v in status["metric_series"].get(name, {}).get("loss", [])]
        assert len(series) >= 2 and series[-1] < series[0], f"{name}: {series}"


@pytest.mark.tensorflow
def test_tensorflow_ps_and_two_workers_over_three_nodes(ray_cluster, home):
    result = pai_ray(ray_cluster, home, "-name", "tensorflow",
                     f"-Dscript=file://{REPO}/examples/tensorflow/async_ps_worker.py",
                     '-Dcluster={"ps":{"count":1},"worker":{"count":2}}',
                     "-DuserDefinedParameters=--steps 200 --log_every 20", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    job_id = job_id_of(result.stdout)
    status = status_of(ray_cluster, home, job_id)
    assert status["status"] == "Succeeded"
    assert len({i["host"] for i in status["instances"]}) == 3, status["instances"]
    by_global_step = []
    for worker in ("worker:0", "worker:1"):
        series = status["metric_series"][worker]
        by_global_step += [(g, loss) for (_, g), (_, loss) in zip(series["global_step"], series["loss"])]
    by_global_step.sort()
    assert len(by_global_step) >= 4 and by_global_step[-1][1] < by_global_step[0][1], by_global_step
    assert_nothing_left(job_id)


@pytest.mark.mxnet
def test_mxnet_dist_sync_over_three_nodes(ray_cluster, home):
    # scheduler (cpu 10) + server (cpu 50) + 2 workers (cpu 100): 2.6 of the cluster's 3 CPUs
    result = pai_ray(ray_cluster, home, "-name", "mxnet",
                     f"-Dscript=file://{REPO}/examples/mxnet/gluon_dist_sync.py",
                     '-Dcluster={"server":{"count":1,"cpu":50},"worker":{"count":2}}',
                     "-DuserDefinedParameters=--steps 30", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    job_id = job_id_of(result.stdout)
    status = status_of(ray_cluster, home, job_id)
    assert status["status"] == "Succeeded"
    workers = [i for i in status["instances"] if i["role"] == "worker"]
    assert len({i["host"] for i in workers}) == 2
    assert all(i["host"].startswith(SUBNET + ".") for i in status["instances"])
    loss_falls_along_steps(status, ["worker:0", "worker:1"])
    assert_nothing_left(job_id)


@pytest.mark.mxnet
def test_a_gluon_model_is_served_by_a_replica_on_each_of_two_ray_nodes(ray_cluster, home, tmp_path):
    import numpy as np
    from serving_client import Client, conformance
    from test_serving_jobs import MX_TRAIN, ROWS

    script = tmp_path / "train_mx.py"
    script.write_text(MX_TRAIN)
    # Trained on the head node itself (no Ray for it), then served on the Ray nodes.
    trained = pai_ray(ray_cluster, home, "-name", "mxnet", f"-Dscript={script}", env={"PAI_RAY_ADDRESS": ""},
                      cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-2000:]
    train_id = job_id_of(trained.stdout)
    want = json.loads((home / "jobs" / train_id / "outputs" / "worker-0" / "expected.json").read_text())["gluon"]
    port = 18000 + int.from_bytes(os.urandom(2), "big") % 2000
    served = pai_ray(ray_cluster, home, "serve", train_id, "--replicas", "2", "--host", "0.0.0.0",
                     "--port", str(port), "--json", cwd=tmp_path)
    assert served.returncode == 0, served.stderr
    job_id = json.loads(served.stdout)["id"]
    try:
        def ready():
            status = status_of(ray_cluster, home, job_id)
            assert status["status"] not in ("Failed", "Cancelled"), status
            up = [i for i in status["instances"] if i["status"] == "Running" and i["port"]]
            logs = pai_ray(ray_cluster, home, "logs", job_id, timeout=60).stdout
            return up if len(up) == 2 and logs.count(" ready on ") >= 2 else None

        replicas = wait_until(ready, timeout=180, interval=1)
        assert len({i["host"] for i in replicas}) == 2 and all(i["host"].startswith(SUBNET + ".") for i in replicas)
        plan = json.loads((home / "jobs" / job_id / "plan.json").read_text())
        token = plan["roles"][0]["env"]["PAI_SERVING_TOKEN"]
        # The router, on the head node: listening beyond loopback, it asks clients for its own token.
        assert Client(f"http://{ray_cluster.head.addr}:{port}").request("GET", "/v2/health/live").status == 401
        clients = [Client(f"http://{ray_cluster.head.addr}:{port}", {"Authorization": f"Bearer {plan['front']['token']}"})]
        clients += [Client(f"http://{i['host']}:{i['port']}", {"X-Pai-Token": token}) for i in replicas]
        for client in clients:
            for way, got in conformance(client, "lenet", ROWS.tolist()).items():
                assert np.allclose(np.array(got), np.array(want), atol=1e-5), way
    finally:
        pai_ray(ray_cluster, home, "kill", job_id, timeout=60)
    assert_nothing_left(job_id)


LONG_SCRIPT = """
import os, sys, time
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 40
for step in range(steps):
    print(f"step={step}, loss={1.0 / (step + 1):.4f}, host={os.environ['PAI_HOST']}", flush=True)
    time.sleep(0.5)
"""


def wait_running(cluster: RayCluster, home: Path, job_id: str, count: int, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = status_of(cluster, home, job_id)
        running = [i for i in status["instances"] if i["status"] == "Running" and i["pid"]]
        if len(running) == count and "step=" in pai_ray(cluster, home, "logs", job_id).stdout:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def test_kill_9_of_the_master_leaves_no_process_on_any_node(ray_cluster, home, tmp_path):
    script = tmp_path / "long.py"
    script.write_text(LONG_SCRIPT)
    result = pai_ray(ray_cluster, home, "--detach", "-name", "python", f"-Dscript={script}",
                     '-Dcluster={"ps":{"count":1},"worker":{"count":2}}', "-DuserDefinedParameters=--steps 600")
    assert result.returncode == 0, result.stderr
    job_id = job_id_of(result.stdout)
    status = wait_running(ray_cluster, home, job_id, 3)
    assert len({i["host"] for i in status["instances"]}) == 3
    assert len(job_processes(job_id)) >= 3
    # `pai nodes` lists the Ray nodes, their resources and this job's instance on each
    nodes = pai_ray(ray_cluster, home, "nodes", "--json", timeout=120)
    assert nodes.returncode == 0, nodes.stderr
    rows = json.loads(nodes.stdout)
    assert sorted(r["host"] for r in rows if r["state"] == "up") == sorted(h.addr for h in ray_cluster.net.hosts)
    assert all(r["cores"] == 1 and r["error"] is None for r in rows)
    assert sorted(label for r in rows for label in r["instances"] if label.startswith(job_id)) == \
        [f"{job_id}/ps:0", f"{job_id}/worker:0", f"{job_id}/worker:1"]
    os.kill(status["master_pid"], 9)
    assert_nothing_left(job_id, timeout=10)
    after = status_of(ray_cluster, home, job_id)
    assert after["status"] == "Failed" and "master lost" in (after["reason"] or "")
    # the watchdog removed the per-job folders on the nodes (tasks pinned to each node)
    deadline = time.monotonic() + 30
    while node_job_folders(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not node_job_folders(job_id)


def test_kill_9_of_a_ray_client_master_leaves_no_instance(ray_cluster, home, tmp_path):
    """Through Ray Client, Ray keeps a lost client's driver, and so the job's actors, for
    its reconnect grace: the watchdog, seeing its master die, stops the instances itself
    through the identity-checked stop, as on SSH, without waiting for Ray."""
    script = tmp_path / "long.py"
    script.write_text(LONG_SCRIPT)
    env = dict(os.environ, PAI_HOME=str(home), PAI_RAY_ADDRESS=ray_cluster.client_address, NO_COLOR="1")
    env.pop("PAI_DEBUG", None)
    result = subprocess.run([sys.executable, "-m", "paicli", "--detach", "-name", "python", f"-Dscript={script}",
                             '-Dcluster={"ps":{"count":1},"worker":{"count":2}}', "-DuserDefinedParameters=--steps 600"],
                            capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    job_id = job_id_of(result.stdout)
    status = wait_running(ray_cluster, home, job_id, 3)
    assert len({i["host"] for i in status["instances"]}) == 3 and len(job_processes(job_id)) >= 3
    # (its own Ray Client connection: a client server that fails to start costs Ray's 30 s, then a retry)
    watchdog_says(status["job_dir"], "ready to stop the job's instances", timeout=240)
    os.kill(status["master_pid"], 9)
    assert_nothing_left(job_id, timeout=10)
    after = status_of(ray_cluster, home, job_id)
    assert after["status"] == "Failed" and "master lost" in (after["reason"] or "")


def test_a_lost_node_runs_its_instance_again_elsewhere(ray_cluster, home, tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(LONG_SCRIPT)
    proc = subprocess.Popen(
        ray_cluster.exec_argv([sys.executable, "-m", "paicli", "-name", "python", f"-Dscript={script}",
                               '-Dcluster={"worker":{"count":2}}', "-DuserDefinedParameters=--steps 30"]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
        env=dict(os.environ, PAI_HOME=str(home), PAI_RAY_ADDRESS=ray_cluster.address, NO_COLOR="1"))
    stopped = None
    try:
        job_id = None
        deadline = time.monotonic() + 60
        while job_id is None and time.monotonic() < deadline:
            jobs = list((home / "jobs").glob("2*")) if (home / "jobs").exists() else []
            job_id = jobs[0].name if jobs else None
            time.sleep(0.2)
        assert job_id, "no job was recorded"
        status = wait_running(ray_cluster, home, job_id, 2)
        head = ray_cluster.head.addr
        victim = next(i for i in status["instances"] if i["host"] != head)
        stopped = next(h.name for h in ray_cluster.net.hosts if h.addr == victim["host"])
        ray_cluster.stop_node(stopped)
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:] + err[-2000:]
        assert out.rstrip().endswith("OK")
        after = status_of(ray_cluster, home, job_id)
        moved = next(i for i in after["instances"] if (i["role"], i["index"]) == (victim["role"], victim["index"]))
        assert moved["attempts"] >= 2 and moved["host"] != victim["host"], moved
        assert after["status"] == "Succeeded"
        assert_nothing_left(job_id)
        # only the dead node's folder is left (nobody was there to remove it; on a real
        # host it would be on that host's own disk): the sandbox removes it
        left = node_job_folders(job_id)
        assert len(left) <= 1, left
        for folder in left:
            ray_node.remove_job_folder(folder)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if stopped:
            ray_cluster.start_node(stopped)
            ray_cluster.wait_nodes(3)


def test_a_job_bigger_than_the_cluster_waits_then_times_out(ray_cluster, home, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print('never')\n")
    began = time.monotonic()
    result = pai_ray(ray_cluster, home, "-name", "python", f"-Dscript={script}",
                     '-Dcluster={"worker":{"count":4}}', "-Dtimeout=12", timeout=120)
    took = time.monotonic() - began
    assert result.returncode == 130, result.stdout[-3000:] + result.stderr[-2000:]
    out = result.stdout + result.stderr
    assert "waiting for resources" in out                      # the Waiting List while it waited
    assert "cannot be placed now" in out and "worker:3 (cpu 100)" in out
    assert re.search(r"CANCELLED: timeout after 12s while waiting for Ray", out), out[-2000:]
    assert took >= 12
    job_id = job_id_of(result.stdout)
    assert not job_processes(job_id)


def test_pai_kill_stops_every_instance_on_every_node(ray_cluster, home, tmp_path):
    script = tmp_path / "long.py"
    script.write_text(LONG_SCRIPT)
    result = pai_ray(ray_cluster, home, "--detach", "-name", "python", f"-Dscript={script}",
                     '-Dcluster={"worker":{"count":2}}', "-DuserDefinedParameters=--steps 600")
    assert result.returncode == 0, result.stderr
    job_id = job_id_of(result.stdout)
    wait_running(ray_cluster, home, job_id, 2)
    # each node's per-job folder holds the one staging list (cluster/node_files.py), exactly
    from paicli.cluster import node_files

    job_dir = home / "jobs" / job_id
    listed = node_files.manifest(job_dir, JobPlan.from_json((job_dir / "plan.json").read_text())).files
    folders = node_job_folders(job_id)
    assert len(folders) == 2
    for folder in folders:
        # on the node's TMPDIR (the cluster's), so nothing of the node stays in this machine's /tmp
        assert not os.path.exists(os.path.join(tempfile.gettempdir(), f"paicli-ray-{os.getuid()}",
                                               os.path.basename(os.path.dirname(folder)))), folder
        assert staged_paths(folder) == {f.dst for f in listed if f.kind != "dir"}, folder
        assert all(os.path.isdir(f"{folder}/{f.dst}") for f in listed if f.kind == "dir")
    killed = pai_ray(ray_cluster, home, "kill", job_id, timeout=60)
    assert killed.returncode == 0, killed.stderr
    assert_nothing_left(job_id, timeout=5)
    assert status_of(ray_cluster, home, job_id)["status"] == "Cancelled"


def test_ray_client_from_a_machine_that_is_not_a_ray_node(ray_cluster, home):
    """`ray://HEAD:10001` from this machine (no Ray node here: its only way to the
    cluster is the sandbox's bridge)."""
    env = dict(os.environ, PAI_HOME=str(home), PAI_RAY_ADDRESS=ray_cluster.client_address, NO_COLOR="1")
    env.pop("PAI_DEBUG", None)
    result = subprocess.run([sys.executable, "-m", "paicli", "-name", "python",
                             f"-Dscript={REPO}/examples/python/ps_worker.py",
                             '-Dcluster={"ps":{"count":1},"worker":{"count":2}}'],
                            capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    job_id = job_id_of(result.stdout)
    status = json.loads(subprocess.run([sys.executable, "-m", "paicli", "status", job_id, "--json"],
                                       capture_output=True, text=True, env=env, timeout=60).stdout)
    assert len({i["host"] for i in status["instances"]}) == 3
    series = losses(result.stdout)
    assert series and series[-1] < series[0]
    assert_nothing_left(job_id)


RETRY_SCRIPT = """
import os, signal, time
if os.environ["PAI_INDEX"] == "1" and os.environ["PAI_ATTEMPT"] == "0":
    print("worker:1 dies by SIGKILL on its first attempt", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
for step in range(5):
    print(f"step={step}, loss={1.0 / (step + 1):.4f}", flush=True)
    time.sleep(0.1)
"""


def test_a_retryable_exit_restarts_the_instance_on_its_node(ray_cluster, home, tmp_path):
    script = tmp_path / "retry.py"
    script.write_text(RETRY_SCRIPT)
    result = pai_ray(ray_cluster, home, "-name", "python", f"-Dscript={script}", '-Dcluster={"worker":{"count":2}}')
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "dies by SIGKILL" in result.stdout and "restarting it (retry 1 of 3)" in result.stdout
    job_id = job_id_of(result.stdout)
    by_name = {f"{i['role']}:{i['index']}": i for i in status_of(ray_cluster, home, job_id)["instances"]}
    assert by_name["worker:1"]["attempts"] == 2 and by_name["worker:0"]["attempts"] == 1
    assert by_name["worker:1"]["exit_code"] == 0
    logs = pai_ray(ray_cluster, home, "logs", job_id, "--instance", "worker:1", timeout=60)
    assert "step=4, loss=0.2000" in logs.stdout
    assert_nothing_left(job_id)


def test_services_spread_and_workers_pack(ray_cluster, home, tmp_path):
    """Small instances (cpu 10) all fit on one node: a job with services spreads
    (two ps on two nodes), a job without packs (three workers on one node)."""
    script = tmp_path / "short.py"
    script.write_text("import os; print('host', os.environ['PAI_HOST'])\n")
    spread = pai_ray(ray_cluster, home, "-name", "python", f"-Dscript={script}",
                     '-Dcluster={"ps":{"count":2,"cpu":10},"worker":{"count":1,"cpu":10}}')
    assert spread.returncode == 0, spread.stdout[-3000:] + spread.stderr[-2000:]
    ps_hosts = {i["host"] for i in status_of(ray_cluster, home, job_id_of(spread.stdout))["instances"]
                if i["role"] == "ps"}
    assert len(ps_hosts) == 2
    # this one through a nodes file whose top level is `ray:` (JSON is YAML)
    nodes_file = tmp_path / "nodes.yaml"
    nodes_file.write_text(json.dumps({"ray": {"address": ray_cluster.address}}))
    pack = pai_ray(ray_cluster, home, "-name", "python", f"-Dscript={script}",
                   '-Dcluster={"worker":{"count":3,"cpu":10}}',
                   env={"PAI_RAY_ADDRESS": "", "PAI_NODES": str(nodes_file)})
    assert pack.returncode == 0, pack.stdout[-3000:] + pack.stderr[-2000:]
    pack_hosts = {i["host"] for i in status_of(ray_cluster, home, job_id_of(pack.stdout))["instances"]}
    assert len(pack_hosts) == 1 and pack_hosts.pop().startswith(SUBNET + "."), pack_hosts   # on Ray, one node


def test_pai_kill_of_a_job_waiting_for_room(ray_cluster, home, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print('never')\n")
    result = pai_ray(ray_cluster, home, "--detach", "-name", "python", f"-Dscript={script}",
                     '-Dcluster={"worker":{"count":5}}')
    assert result.returncode == 0, result.stderr
    job_id = job_id_of(result.stdout)
    deadline = time.monotonic() + 60
    while "waiting for resources" not in pai_ray(ray_cluster, home, "logs", job_id, timeout=60).stdout:
        assert time.monotonic() < deadline, "no Waiting List line"
        time.sleep(1)
    assert status_of(ray_cluster, home, job_id)["status"] == "Running"
    began = time.monotonic()
    killed = pai_ray(ray_cluster, home, "kill", job_id, timeout=60)
    assert killed.returncode == 0, killed.stderr
    deadline = time.monotonic() + 20
    while True:
        status = status_of(ray_cluster, home, job_id)
        if status["status"] == "Cancelled" and not os.path.exists(f"/proc/{status['master_pid']}"):
            break   # cancelled, and its master (the Ray driver) has exited
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert time.monotonic() - began < 20
    assert not job_processes(job_id)


def test_a_gpu_instance_goes_where_ray_has_a_gpu(ray_cluster, home, tmp_path):
    """Node h3 tells Ray it has one GPU (`ray start --num-gpus=1`; there is no card
    behind it here): a worker asking for gpu 100 is placed there and gets the card
    Ray gave its bundle in CUDA_VISIBLE_DEVICES; the others get none."""
    script = tmp_path / "gpu.py"
    script.write_text("import os; print('cuda=' + repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n")
    result = pai_ray(ray_cluster, home, "-name", "python", f"-Dscript={script}",
                     '-Dcluster={"worker":{"count":1,"gpu":100},"eval":{"count":1}}')
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "[worker:0] cuda='0'" in result.stdout and "[eval:0] cuda=''" in result.stdout
    by_role = {i["role"]: i for i in status_of(ray_cluster, home, job_id_of(result.stdout))["instances"]}
    assert by_role["worker"]["host"] == ray_cluster.net.host("h3").addr
    # two GPU workers cannot be placed: the Waiting List says what is short
    too_many = pai_ray(ray_cluster, home, "-name", "python", f"-Dscript={script}",
                       '-Dcluster={"worker":{"count":2,"gpu":100}}', "-Dtimeout=7")
    assert too_many.returncode == 130
    assert "worker:1 (cpu 100, gpu 100)" in too_many.stdout + too_many.stderr


# ---------------------------------------------------------------------------
# Files a job writes come back from Ray nodes (issue 17): `pai` runs on the head node in a
# working folder of the test's own; the instances run in per-job folders on their nodes,
# so a file reaches that working folder only if paicli brings it.


def pai_ray_attached(cluster: RayCluster, home: Path, work: Path, *args: str) -> subprocess.Popen:
    """An attached `pai ARGS` on the head node, its output read as it comes."""
    env = dict(os.environ, PAI_HOME=str(home), PAI_RAY_ADDRESS=cluster.address, NO_COLOR="1", PAI_DEBUG="")
    return subprocess.Popen(cluster.exec_argv([sys.executable, "-m", "paicli", *args]), env=env, cwd=str(work),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def clear_outputs(tmp_path: Path) -> None:
    """Remove what an earlier job of the test brought back."""
    for path in (tmp_path / "work" / "models", tmp_path / "ckpt", tmp_path / "work" / "same.txt"):
        subprocess.run(["rm", "-rf", str(path)], check=True)


def assert_worker_0_back(tmp_path: Path, home: Path, job_id: str) -> None:
    assert (tmp_path / "work" / "models" / "model-0.txt").read_text() == "model of worker 0\n"
    assert (tmp_path / "ckpt" / "ckpt-0").read_text() == "ckpt of worker 0\n"
    assert (home / "jobs" / job_id / "outputs" / "worker-0" / "out.txt").read_text() == "out of worker 0\n"
    assert not [p for p in (tmp_path / "work").rglob("*") if p.name.startswith(".pai-part-")]


def test_files_come_back_from_ray_nodes_however_the_job_ends(ray_cluster, home, tmp_path):
    from test_outputs_ssh import SCRIPT

    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    statement = ["-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":2}}',
                 f"-DcheckpointDir={tmp_path / 'ckpt'}", "-DmaxRetries=0"]

    def status(job_id: str) -> dict:
        return status_of(ray_cluster, home, job_id)

    def no_node_folder(job_id: str) -> bool:
        return wait_until(lambda: not node_job_folders(job_id), 30, 0.3)

    result = pai_ray(ray_cluster, home, *statement, cwd=work)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    job_id = job_id_of(result.stdout)
    for idx in (0, 1):
        assert (work / "models" / f"model-{idx}.txt").read_text() == f"model of worker {idx}\n"
        assert (tmp_path / "ckpt" / f"ckpt-{idx}").read_text() == f"ckpt of worker {idx}\n"
        assert (home / "jobs" / job_id / "outputs" / f"worker-{idx}" / "out.txt").read_text() == \
            f"out of worker {idx}\n"
    assert (work / "same.txt").read_text() == "written by worker 1\n"
    assert "worker:0 and worker:1 both wrote" in result.stdout
    assert status(job_id)["outputs"]["missing"] == 0
    assert no_node_folder(job_id), node_job_folders(job_id)

    # a failure, then `pai kill`: one instance each, its files back, its folder gone
    one = [arg.replace('"count":2', '"count":1') for arg in statement]
    clear_outputs(tmp_path)
    failed = pai_ray(ray_cluster, home, *one, "-DuserDefinedParameters=--fail --big", "-DoutputMaxSize=1K", cwd=work)
    assert failed.returncode != 0, failed.stdout[-3000:]
    job_id = job_id_of(failed.stdout)
    assert status(job_id)["status"] == "Failed"
    assert_worker_0_back(tmp_path, home, job_id)
    # the file over the size limit kept the node's folder; `pai get` brings it and the folder goes
    assert not (work / "big-0.bin").exists() and len(node_job_folders(job_id)) == 1
    got = pai_ray(ray_cluster, home, "get", job_id, "big-*", "-o", str(tmp_path / "got"), timeout=120, cwd=work)
    assert got.returncode == 0, got.stdout + got.stderr
    assert (work / "big-0.bin").stat().st_size == 4096 and (tmp_path / "got" / "big-0.bin").stat().st_size == 4096
    assert status(job_id)["outputs"]["missing"] == 0
    assert no_node_folder(job_id), node_job_folders(job_id)

    clear_outputs(tmp_path)
    proc = pai_ray_attached(ray_cluster, home, work, *one, "-DuserDefinedParameters=--hang")
    try:
        job_id = proc.stdout.readline()[5:].strip()
        assert wait_until(lambda: status(job_id).get("metric_series"), 120, 0.3)
        killed = pai_ray(ray_cluster, home, "kill", job_id, timeout=120, cwd=work)
        assert killed.returncode == 0, killed.stdout + killed.stderr
        proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert status(job_id)["status"] == "Cancelled"
    assert_worker_0_back(tmp_path, home, job_id)
    assert status(job_id)["outputs"]["missing"] == 0
    assert no_node_folder(job_id), node_job_folders(job_id)

    clear_outputs(tmp_path)
    proc = pai_ray_attached(ray_cluster, home, work, *one, "-DuserDefinedParameters=--hang")
    try:
        job_id = proc.stdout.readline()[5:].strip()
        deadline = time.monotonic() + 120
        while not status(job_id).get("metric_series"):
            assert time.monotonic() < deadline, status(job_id)
            time.sleep(0.5)
        watchdog_of(status(job_id)["job_dir"], job_id)   # what cleans up below
        os.kill(status(job_id)["master_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120   # Ray under load: the watchdog's connect can be slow
        while not (tmp_path / "ckpt" / "ckpt-0").exists():
            if time.monotonic() > deadline:
                for log in (home / "jobs" / job_id).glob("*.log"):
                    print(f"--- {log.name}\n{log.read_text()[-3000:]}")
                print(sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "jobs" not in str(p)))
            assert time.monotonic() < deadline
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while job_processes(job_id):
            assert time.monotonic() < deadline, job_processes(job_id)
            time.sleep(0.3)
    finally:
        proc.kill()
        proc.wait()
    assert_worker_0_back(tmp_path, home, job_id)
    assert status(job_id)["status"] == "Failed"
    assert no_node_folder(job_id), node_job_folders(job_id)


def test_a_ray_address_nobody_answers_is_one_line(tmp_path):
    """Submit and `pai nodes` with PAI_RAY_ADDRESS where nothing listens: exit 2,
    one line naming the address, nothing recorded."""
    pytest.importorskip("ray")
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    env = dict(os.environ, PAI_HOME=str(tmp_path / "home"), PAI_RAY_ADDRESS="127.0.0.1:1", NO_COLOR="1")
    env.pop("PAI_DEBUG", None)
    for args in (["-name", "python", f"-Dscript={script}"], ["nodes"]):
        result = subprocess.run([sys.executable, "-m", "paicli", *args], capture_output=True, text=True,
                                env=env, timeout=60)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "the Ray cluster at 127.0.0.1:1 does not answer" in lines[0], lines
    jobs = tmp_path / "home" / "jobs"
    assert not (jobs.exists() and any(jobs.iterdir()))


def test_a_node_folder_root_someone_else_could_swap_is_refused(tmp_path, monkeypatch):
    """The actor writes a job's files only under a root of ours alone (0700 if it
    makes it): one writable by others is refused in one line, nothing written."""
    monkeypatch.setattr(ray_node.tempfile, "gettempdir", lambda: str(tmp_path))
    actor = ray_node.InstanceActor("job1", "job1/worker:0", "n" * 20)

    def stage(name):
        return actor.stage(tar_of(manifest_of(tmp_path, (f"runners/{name}", "file", ""))))

    assert stage("a.py") == {"folder": actor.folder}
    root = Path(ray_node.user_root())
    assert root.stat().st_mode & 0o777 == 0o700
    os.chmod(root, 0o777)
    assert "writable by others (mode 777); refused" in stage("b.py")["error"]
    assert not (Path(actor.folder) / "runners" / "b.py").exists()
    os.chmod(root, 0o700)
    root.rename(tmp_path / "elsewhere")
    root.symlink_to(tmp_path / "elsewhere")      # a link in its place is refused too
    assert "not a directory" in stage("c.py")["error"]


SECRET_DRIVER = r"""
import hashlib, json, os, pickle, sys, time
from pathlib import Path
import ray
from paicli.cluster.backends.ray import RayBackend
from paicli.jobplan import JobPlan, RolePlan

address, secret, job_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
argv = [sys.executable, "-c", "import hashlib, os; "
        "print('sha=' + hashlib.sha256(os.environ['PAI_CAFFE_SECRET'].encode()).hexdigest(), flush=True)"]
roles = [RolePlan(name, 1, argv, env={"PAI_CAFFE_SECRET": secret}) for name in ("ps", "worker")]
plan = JobPlan(job_name="s", framework="caffe", task_name="CaffeTask", roles=roles)
(job_dir / "plan.json").write_text(plan.to_json())   # as a Caffe job's: the secret in a role's env
put = []
real_put = ray.put

def spy(value, **kw):   # the real put, and a copy of what went into the object store
    put.append(pickle.dumps(value))
    return real_put(value, **kw)

ray.put = spy
backend = RayBackend({"backend": "ray", "address": address})
placements = backend.place_job(plan, job_dir.name, lambda line: None, time.monotonic() + 120)
backend.prepare(str(job_dir), plan, placements)
outputs = []
for placed in placements:
    role = plan.role(placed.role)
    handle = backend.begin_start(placed, role.argv, dict(os.environ, **role.env), None)()
    code = backend.wait(handle, 60)
    out = b""
    while True:
        try:
            chunk = os.read(handle.output_fd, 65536)
        except BlockingIOError:
            time.sleep(0.05)
            continue
        if not chunk:
            break
        out += chunk
    outputs.append([code, out.decode()])
backend.cleanup(str(job_dir))
print(json.dumps({"puts": len(put), "secret_put": any(secret.encode() in blob for blob in put),
                  "outputs": outputs}))
"""


def test_a_jobs_secret_never_goes_into_rays_object_store(ray_cluster, tmp_path):
    """A Caffe job's averaging secret (PAI_CAFFE_SECRET, in plan.json's role env)
    reaches each instance in its own spec and nothing else: what staging put into
    Ray's object store (readable by any client of the cluster) does not hold it,
    nor do the nodes' Ray logs. The backend driven as the master drives it, on the
    head node, with ray.put watched."""
    import secrets

    secret = secrets.token_hex(32)
    job_dir = tmp_path / "jobs" / "secretjob1"
    job_dir.mkdir(parents=True)
    result = ray_cluster.run([sys.executable, "-c", SECRET_DRIVER, ray_cluster.address, secret, str(job_dir)],
                             timeout=240, cwd=str(REPO))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert report["outputs"] == [[0, f"sha={digest}\n"]] * 2   # each instance got it in its spec
    assert report["puts"] >= 1 and not report["secret_put"]
    for path in ray_cluster.net.state.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 64 << 20:
            assert secret.encode() not in path.read_bytes(), f"the secret is in {path}"


def test_a_gcs_address_from_a_machine_that_is_not_a_ray_node_is_one_line(ray_cluster, tmp_path):
    """PAI_RAY_ADDRESS=HEAD:6379 (what `ray start` prints) from this machine, which
    is not a Ray node: Ray could not call the driver back, and every call that
    needs it would wait forever. The job ends within 60 s, on one line saying to use
    ray://HEAD:10001, and its master is gone."""
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    home = tmp_path / "outside-home"
    env = dict(os.environ, PAI_HOME=str(home), PAI_RAY_ADDRESS=ray_cluster.address, NO_COLOR="1")
    env.pop("PAI_DEBUG", None)
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "paicli", "-name", "python", f"-Dscript={script}",
                             '-Dcluster={"ps":{"count":1},"worker":{"count":2}}'],   # on every node
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
    try:
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for master in (home / "jobs").glob("*/master.log") if (home / "jobs").exists() else ():
            status = subprocess.run([sys.executable, "-m", "paicli", "status", master.parent.name, "--json"],
                                    capture_output=True, text=True, env=env, timeout=60)
            pid = json.loads(status.stdout or "{}").get("master_pid") if status.returncode == 0 else None
            deadline = time.monotonic() + 10
            while pid and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid and os.path.exists(f"/proc/{pid}"):
                os.kill(pid, 9)
                raise AssertionError(f"the master {pid} was still running")
    assert took < 60
    assert proc.returncode != 0, out[-2000:] + err[-2000:]
    hint = f"PAI_RAY_ADDRESS=ray://{ray_cluster.head.addr}:10001"
    lines = [line for line in (out + err).splitlines() if line.startswith("FAILED:")]
    assert len(lines) == 1 and "is not a node of the Ray cluster" in lines[0] and hint in lines[0], \
        out[-2000:] + err[-2000:]


WAIT_DRIVER = r"""
import signal, sys, time
from paicli.cluster.backends.ray import RayBackend, RayWaitStopped
from paicli.errors import PaiError

backend = RayBackend({"backend": "ray", "address": sys.argv[1]})
ray = backend.connect()
never = ray.remote(num_cpus=0)(lambda: time.sleep(3600)).remote()
began = time.monotonic()
try:
    backend._get(never, "a task that never ends", timeout=2)
except PaiError as err:
    print("deadline", round(time.monotonic() - began, 1), err, flush=True)
reasons = []
backend._interrupted = lambda: reasons[0] if reasons else None   # the master's cancel_reason
signal.signal(signal.SIGTERM, lambda signum, frame: reasons.append("cancelled"))
print("waiting", flush=True)
try:
    backend._get(never, "a task that never ends", timeout=None)
except RayWaitStopped as err:
    print("stopped", time.monotonic(), err, flush=True)
"""


def test_a_ray_call_that_never_answers_ends_at_its_deadline_or_at_a_cancel(ray_cluster):
    """Every wait on Ray goes through one bounded wait: a call that never answers
    ends at its deadline with one line naming it, and a wait with no deadline of
    its own ends within a second of the SIGTERM a cancel sends the master."""
    proc = subprocess.Popen(ray_cluster.exec_argv([sys.executable, "-c", WAIT_DRIVER, ray_cluster.address]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        first = proc.stdout.readline()
        assert first.startswith("deadline "), first + proc.stderr.read()[-2000:]
        took = float(first.split()[1])
        assert 2 <= took < 5 and "a task that never ends: no answer from Ray within 2s" in first
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(1)
        sent = time.monotonic()
        proc.send_signal(15)   # `ip netns exec` runs the driver in its own process
        out, err = proc.communicate(timeout=30)
        assert out.startswith("stopped "), out + err[-2000:]
        _, at, reason = out.split(" ", 2)
        assert float(at) - sent < 1.5 and reason.strip() == "cancelled"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_port_that_is_not_rays_ends_ray_init_at_its_deadline(tmp_path):
    """A GCS address whose port accepts connections but is not Ray's (the Ray Client
    or the dashboard port given by mistake): ray.init alone would wait forever. The
    backend's connect ends at its deadline on one line, and the process exits."""
    pytest.importorskip("ray")
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)   # the kernel accepts; nobody ever answers
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    code = ("import sys, time; from paicli.cluster.backends import ray as rb; from paicli.errors import PaiError\n"
            "rb.INIT_TIMEOUT = 3\n"
            "began = time.monotonic()\n"
            "try:\n"
            "    rb.RayBackend({'backend': 'ray', 'address': sys.argv[1]}).connect()\n"
            "except PaiError as err:\n"
            "    print(round(time.monotonic() - began, 1), err, flush=True)\n")
    try:
        result = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60,
                                cwd=str(tmp_path))
    finally:
        listener.close()
    took, _, line = result.stdout.strip().partition(" ")
    assert took and 3 <= float(took) < 10, result.stdout + result.stderr[-2000:]
    assert line == (f"cannot reach the Ray cluster at {address}: no answer as a Ray cluster within 3s; check "
                    "PAI_RAY_ADDRESS / the nodes file's ray.address and that `ray status` answers there")


def test_what_goes_to_ray_nodes_by_value_pickles_without_paicli_on_the_node(tmp_path):
    """The actor and the pinned tasks travel by value (a Ray node has no paicli): every
    global they reach must pickle, and they load where no module of paicli imports."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    ray_node.ship_by_value(cloudpickle)
    blocked = ("import sys, pickle\n"
               "class NoPaicli:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'paicli' or name.startswith('paicli.'):\n"
               "            raise ImportError('no paicli on this node: ' + name)\n"
               "sys.meta_path.insert(0, NoPaicli())\n"
               "print(pickle.loads(sys.stdin.buffer.read()).__name__)\n")
    for shipped in (ray_node.InstanceActor, ray_node.pinned_collect, ray_node.pinned_cleanup):
        loaded = subprocess.run([sys.executable, "-c", blocked], input=cloudpickle.dumps(shipped),
                                capture_output=True, cwd=tmp_path, timeout=60)
        assert loaded.returncode == 0 and loaded.stdout.decode().strip() == shipped.__name__, loaded.stderr.decode()
