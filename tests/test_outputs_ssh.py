"""Files a job writes come back from SSH nodes (issue 17): real sshd hosts in network
namespaces (tests/netns.py), each with its own /tmp, so a file reaches this machine
only if paicli brings it. One cluster for the module; tiny jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import PAI, job_id_from, pai, pai_json, wait_until, watchdog_of
from netns import can_build, module_cluster, module_nodes

REASON = can_build()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host tests skipped: {REASON}")

SCRIPT = r'''
import argparse, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--checkpointDir")
p.add_argument("--fail", action="store_true")
p.add_argument("--hang", action="store_true")
p.add_argument("--big", action="store_true")
a, _ = p.parse_known_args()
idx = int(os.environ["PAI_INDEX"])
os.makedirs("models", exist_ok=True)
with open(f"models/model-{idx}.txt", "w") as f:
    f.write(f"model of worker {idx}\n")
with open(os.path.join(os.environ["PAI_OUTPUT_DIR"], "out.txt"), "w") as f:
    f.write(f"out of worker {idx}\n")
with open(os.path.join(a.checkpointDir, f"ckpt-{idx}"), "w") as f:
    f.write(f"ckpt of worker {idx}\n")
if a.big:
    with open(f"big-{idx}.bin", "wb") as f:
        f.write(os.urandom(4096))
time.sleep(0.3 + 1.5 * idx)        # worker 1 ends last: its same.txt is kept
with open("same.txt", "w") as f:
    f.write(f"written by worker {idx}\n")
print(f"step=1 loss=0.5", flush=True)
if a.hang:
    time.sleep(600)
sys.exit(1 if a.fail and idx == 0 else 0)
'''


cluster = module_cluster(2, "pco", 160)
nodes = module_nodes(cpu=100)


def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    return work


def submit(work: Path, *extra: str, detach: bool = False) -> subprocess.CompletedProcess | subprocess.Popen:
    argv = [*PAI, "-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":2}}',
            f"-DcheckpointDir={work.parent / 'ckpt'}", "-DmaxRetries=0", *extra]
    if detach:
        return subprocess.Popen(argv, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=180)


def assert_files_back(work: Path, job_id: str, home: Path, workers=(0, 1)) -> None:
    for idx in workers:
        assert (work / "models" / f"model-{idx}.txt").read_text() == f"model of worker {idx}\n"
        assert (work.parent / "ckpt" / f"ckpt-{idx}").read_text() == f"ckpt of worker {idx}\n"
        out = home / "jobs" / job_id / "outputs" / f"worker-{idx}" / "out.txt"
        assert out.read_text() == f"out of worker {idx}\n"
    assert not [p for p in work.rglob("*") if p.name.startswith(".pai-part-")]


def running_hang_job(work: Path) -> tuple[subprocess.Popen, str]:
    """A job whose workers hang after writing their files, once both report metrics:
    the attached pai and the job's id (the caller ends it, then reaps the pai)."""
    proc = submit(work, "-DuserDefinedParameters=--hang", detach=True)
    job_id = proc.stdout.readline()[5:].strip()
    try:
        assert wait_until(lambda: len(pai_json("status", job_id).get("metric_series", {})) >= 2,
                          timeout=60, interval=0.3), pai_json("status", job_id)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, job_id


def clear(work: Path) -> None:
    """Remove what an earlier job of the test brought back."""
    for path in [work / "models", work.parent / "ckpt", work / "same.txt"]:
        subprocess.run(["rm", "-rf", str(path)], check=True)


def node_folders(cluster, job_id: str) -> list[str]:
    return [h.name for h in cluster.hosts
            if job_id in cluster.ssh(h.name, ["ls", f"/tmp/paicli-{cluster.user}"]).stdout]


def test_files_come_back_with_a_conflict_named_and_outputs_listed(cluster, nodes, tmp_path, pai_home):
    work = workdir(tmp_path)
    result = submit(work, "-DoutputMaxSize=1K", "-DuserDefinedParameters=--big")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    job_id = job_id_from(result.stdout)
    assert_files_back(work, job_id, pai_home)
    # the last to finish wins, and the job log names both
    assert (work / "same.txt").read_text() == "written by worker 1\n"
    assert "worker:0 and worker:1 both wrote" in result.stdout, result.stdout[-3000:]
    # a file over -DoutputMaxSize stays on its node, whose job folder is kept, and is said so
    assert not list(work.glob("big-*.bin"))
    assert "big-0.bin of worker:0 not brought back (over the size limit (1024 bytes))" in result.stdout
    assert len(node_folders(cluster, job_id)) == 2
    listed = pai_json("outputs", job_id)
    paths = {(f["instance"], os.path.basename(f["path"])): f for f in listed["files"]}
    assert paths[("worker:1", "same.txt")]["where"] == "here"
    assert paths[("worker:0", "same.txt")]["where"] == "replaced"
    assert paths[("worker:0", "model-0.txt")]["size"] == len("model of worker 0\n")
    assert paths[("worker:1", "big-1.bin")]["where"] == "node"
    assert paths[("worker:1", "big-1.bin")]["node_path"].endswith(f"/{job_id}/code/big-1.bin")
    totals = pai_json("status", job_id)["outputs"]
    assert totals["count"] >= 9 and totals["missing"] == 2
    # asked for, they come: where they belong, then copied; nothing is left on the nodes
    got = pai("get", job_id, "big-*.bin", "-o", str(tmp_path / "got"))
    assert got.returncode == 0, got.stdout + got.stderr
    for idx in (0, 1):
        assert (work / f"big-{idx}.bin").stat().st_size == 4096
        assert (tmp_path / "got" / f"big-{idx}.bin").read_bytes() == (work / f"big-{idx}.bin").read_bytes()
    listed = pai_json("outputs", job_id)
    assert listed["missing"] == 0 and {f["where"] for f in listed["files"]} == {"here", "replaced"}
    assert wait_until(lambda: not node_folders(cluster, job_id), timeout=20), node_folders(cluster, job_id)


def test_files_come_back_after_a_failure_pai_kill_and_kill_9_of_the_master(cluster, nodes, tmp_path, pai_home):
    work = workdir(tmp_path)
    failed = submit(work, "-DuserDefinedParameters=--fail")
    assert failed.returncode != 0
    job_id = job_id_from(failed.stdout)
    assert pai_json("status", job_id)["status"] == "Failed"
    assert (work / "models" / "model-0.txt").read_text() == "model of worker 0\n"
    assert (work.parent / "ckpt" / "ckpt-0").read_text() == "ckpt of worker 0\n"
    assert wait_until(lambda: not node_folders(cluster, job_id), timeout=20), node_folders(cluster, job_id)

    # `pai kill`: the master stops the instances through their agents, which send first
    clear(work)
    proc, job_id = running_hang_job(work)
    try:
        assert pai("kill", job_id, timeout=60).returncode == 0
        proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert pai_json("status", job_id)["status"] == "Cancelled"
    assert_files_back(work, job_id, pai_home)
    assert pai_json("outputs", job_id)["missing"] == 0
    assert wait_until(lambda: not node_folders(cluster, job_id), timeout=20), node_folders(cluster, job_id)

    clear(work)
    proc, job_id = running_hang_job(work)
    try:
        watchdog_of(pai_json("status", job_id)["job_dir"], job_id)   # what removes the node folders
        os.kill(pai_json("status", job_id)["master_pid"], signal.SIGKILL)
        assert wait_until(lambda: not node_folders(cluster, job_id), timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert_files_back(work, job_id, pai_home)
    assert pai_json("status", job_id)["status"] == "Failed"


def test_an_unreachable_nodes_files_are_reported_missing_and_its_folder_kept(cluster, nodes, tmp_path, pai_home):
    work = workdir(tmp_path)
    proc = subprocess.Popen([*PAI, "-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":1}}',
                             f"-DcheckpointDir={tmp_path / 'ckpt'}", "-DmaxRetries=0",
                             "-DuserDefinedParameters=--hang"], cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lost = None
    try:
        job_id = proc.stdout.readline()[5:].strip()
        assert wait_until(lambda: pai_json("status", job_id).get("metric_series"), timeout=60, interval=0.3)
        host = pai_json("status", job_id)["instances"][0]["host"]
        lost = next(h.name for h in cluster.hosts if h.addr == host)
        cluster.link_down(lost)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost:
            cluster.link_up(lost)
    assert proc.returncode == 1, out[-3000:]
    assert f"could not be brought back from node {lost}" in out and "its job folder there is kept" in out, out[-3000:]
    summary = (pai_home / "jobs" / job_id / "summary.txt").read_text()
    assert f"1 not brought back (pai outputs {job_id} says where)" in summary, summary
    listed = pai_json("outputs", job_id)
    assert listed["missing"] == 1 and listed["files"][0]["where"] == "node" and listed["files"][0]["node"] == lost
    # the folder is still there, with the files
    assert wait_until(lambda: node_folders(cluster, job_id) == [lost], timeout=20)
    found = cluster.ssh(lost, ["cat", f"/tmp/paicli-{cluster.user}/{job_id}/code/models/model-0.txt"])
    assert found.stdout == "model of worker 0\n"
    assert not (work / "models").exists()
    # the node answers again: `pai get` brings them where they belong, and removes its folder
    got = pai("get", job_id, "-o", str(tmp_path / "got"))
    assert got.returncode == 0, got.stdout + got.stderr
    assert_files_back(work, job_id, pai_home, workers=(0,))
    assert (tmp_path / "got" / "work" / "models" / "model-0.txt").read_text() == "model of worker 0\n"
    listed = pai_json("outputs", job_id)
    assert listed["missing"] == 0 and {f["where"] for f in listed["files"]} == {"here"}, listed
    assert "*" not in {f["path"] for f in listed["files"]}
    summary = (pai_home / "jobs" / job_id / "summary.txt").read_text()   # says so too, now
    assert "Outputs: " in summary and "not brought back" not in summary, summary
    assert wait_until(lambda: not node_folders(cluster, job_id), timeout=20), node_folders(cluster, job_id)


RESUMING = r'''
import argparse, os, time
p = argparse.ArgumentParser()
p.add_argument("--checkpointDir")
a, _ = p.parse_known_args()
path = os.path.join(a.checkpointDir, "step")
start = int(open(path).read()) if os.path.exists(path) else 0
print(f"first step {start}", flush=True)
for step in range(start, 60):
    time.sleep(0.1)
    with open(path + ".tmp", "w") as f:
        f.write(str(step + 1))
    os.replace(path + ".tmp", path)
    print(f"step={step + 1} loss={1.0 / (step + 2):.4f}", flush=True)
'''


def test_an_instance_moved_off_a_lost_node_resumes_from_its_synced_checkpoint(cluster, nodes, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "resume.py").write_text(RESUMING)
    proc = subprocess.Popen([*PAI, "-name", "python", "-Dscript=resume.py", '-Dcluster={"worker":{"count":1}}',
                             f"-DcheckpointDir={tmp_path / 'ckpt'}", "-DcheckpointSyncSeconds=1", "-DmaxRetries=1"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lost = None
    try:
        job_id = proc.stdout.readline()[5:].strip()
        # a checkpoint past step 10 has come back by the periodic sync
        assert wait_until(lambda: (tmp_path / "ckpt" / "step").exists()
                          and int((tmp_path / "ckpt" / "step").read_text() or 0) >= 10, timeout=60, interval=0.2)
        host = pai_json("status", job_id)["instances"][0]["host"]
        lost = next(h.name for h in cluster.hosts if h.addr == host)
        cluster.link_down(lost)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost:
            cluster.link_up(lost)
    assert proc.returncode == 0 and out.strip().endswith("OK"), out[-3000:]
    firsts = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "first step" in line]
    assert firsts[0] == 0 and firsts[1] >= 10, out[-3000:]
    assert (tmp_path / "ckpt" / "step").read_text() == "60"
    losses = [float(line.rsplit("=", 1)[1]) for line in out.splitlines() if "loss=" in line]
    assert losses[-1] < losses[0]
    if lost:
        cluster.ssh(lost, ["rm", "-rf", f"/tmp/paicli-{cluster.user}/{job_id}"])


TF_SAVING = r'''
import argparse, json, os
import numpy as np
import tensorflow as tf
p = argparse.ArgumentParser()
p.add_argument("--checkpointDir")
p.add_argument("--steps", type=int, default=60)
a, _ = p.parse_known_args()
tf.compat.v1.disable_eager_execution()
config = json.loads(os.environ["TF_CONFIG"])
kind, index = config["task"]["type"], int(config["task"]["index"])
spec = tf.train.ClusterSpec(config["cluster"])
server = tf.compat.v1.train.Server(spec, job_name=kind, task_index=index)
if kind == "ps":
    server.join()
with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(worker_device=f"/job:worker/task:{index}",
                                                                  cluster=spec)):
    step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable("w", [4, 1], initializer=tf.compat.v1.zeros_initializer())
    x = tf.compat.v1.placeholder(tf.float32, [None, 4])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    train = tf.compat.v1.train.GradientDescentOptimizer(0.05).minimize(loss, global_step=step)
    init, ready = tf.compat.v1.global_variables_initializer(), tf.compat.v1.report_uninitialized_variables()
manager = tf.compat.v1.train.SessionManager(ready_op=ready, recovery_wait_secs=0.2)
session_config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{index}"])
sess = (manager.prepare_session(server.target, init_op=init, config=session_config) if index == 0 else
        manager.wait_for_session(server.target, config=session_config, max_wait_secs=300))
rng = np.random.default_rng(index)
true_w = np.arange(1, 5, dtype=np.float32).reshape(4, 1)
while True:
    bx = rng.normal(size=(16, 4)).astype(np.float32)
    _, value, g = sess.run([train, loss, step], {x: bx, y: bx @ true_w})
    print(f"step={g} loss={value:f}", flush=True)
    if g >= a.steps:
        break
if index == 0:
    tf.compat.v1.train.Saver([w, step]).save(sess, os.path.join(a.checkpointDir, "model.ckpt"))
    print("saved", flush=True)
'''


@pytest.mark.tensorflow
def test_a_tensorflow_ps_and_two_workers_job_brings_its_saved_model_back(cluster, tmp_path, monkeypatch, pai_home):
    from paicli.runners.runtimes import get_runtime, runtime_root

    runtime = get_runtime("tensorflow")
    if not runtime.is_installed():
        runtime.ensure(lambda line: None)
    nodes_file = cluster.write_nodes_file(tmp_path / "nodes.yaml", cpu=100, runtime_dir=str(runtime_root()))
    monkeypatch.setenv("PAI_NODES", str(nodes_file))
    work = tmp_path / "work"
    work.mkdir()
    (work / "tf_save.py").write_text(TF_SAVING)
    result = subprocess.run([*PAI, "-name", "tensorflow", "-Dscript=tf_save.py",
                             '-Dcluster={"ps":{"count":1,"cpu":50},"worker":{"count":2,"cpu":50}}',
                             f"-DcheckpointDir={tmp_path / 'model'}"], cwd=work, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert len({i["host"] for i in pai_json("status", job_id_from(result.stdout))["instances"]}) == 2
    load = ("import sys, tensorflow as tf; r = tf.train.load_checkpoint(sys.argv[1]); "
            "print(r.get_tensor('w').ravel().round(1).tolist(), r.get_tensor('global_step'))")
    loaded = subprocess.run([str(runtime.python()), "-c", load, str(tmp_path / "model" / "model.ckpt")],
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    weights = json.loads(loaded.stdout.split("]")[0] + "]")
    assert weights != [0.0, 0.0, 0.0, 0.0] and abs(weights[3] - 4.0) < 1.5, loaded.stdout


@pytest.mark.mxnet
def test_an_mxnet_worker_moved_off_a_lost_node_resumes_from_its_own_checkpoint(cluster, nodes, tmp_path):
    """The MXNet worker restores its latest synced `save_parameters` file on another node."""
    script = Path(__file__).parent / "scripts" / "mx_resume.py"
    proc = subprocess.Popen([*PAI, "-name", "mxnet", f"-Dscript=file://{script}",
                             '-Dcluster={"server":{"count":1,"cpu":50},"worker":{"count":1,"cpu":50}}',
                             f"-DcheckpointDir={tmp_path / 'ckpt'}", "-DcheckpointSyncSeconds=1", "-DmaxRetries=1"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    saved = lambda: sorted((tmp_path / "ckpt").glob("linear-*.params")) if (tmp_path / "ckpt").exists() else []
    lost = None
    try:
        job_id = proc.stdout.readline()[5:].strip()
        # a checkpoint past step 10 has come back by the periodic sync
        assert wait_until(lambda: saved() and int(saved()[-1].stem[7:]) >= 10, timeout=90, interval=0.2)
        worker = next(i for i in pai_json("status", job_id)["instances"] if i["role"] == "worker")
        lost = next(h.name for h in cluster.hosts if h.addr == worker["host"])
        cluster.link_down(lost)
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost:
            cluster.link_up(lost)
    assert proc.returncode == 0 and out.strip().endswith("OK"), out[-3000:]
    moved = [i for i in pai_json("status", job_id)["instances"] if i["role"] == "worker"][-1]
    assert moved["host"] != worker["host"], moved
    firsts = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "first step" in line]
    assert firsts[0] == 0 and firsts[-1] >= 10, out[-3000:]
    losses = [float(line.rsplit("=", 1)[1]) for line in out.splitlines() if "loss=" in line]
    after_move = out[out.rindex("first step"):]
    assert losses[-1] < losses[0] and "step=120," in after_move, out[-3000:]
    assert f"step={firsts[-1] + 1}," in after_move and f"step=1," not in after_move
    if lost:
        cluster.ssh(lost, ["rm", "-rf", f"/tmp/paicli-{cluster.user}/{job_id}"])


BIG = r'''
import os
os.makedirs("models", exist_ok=True)
with open("models/big.bin", "wb") as f:
    for block in range(200):
        f.write(bytes([block]) * (1 << 20))
print("step=1 loss=0.5", flush=True)
'''


def _agents_of(job_id: str) -> list[int]:
    """The node agents (on any namespace host) running an instance of `job_id`."""
    found = []
    for name in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if b"node_agent.py" in cmdline and job_id.encode() in cmdline:
            found.append(int(name))
    return found


def _parts(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".pai-part-")]


def _is_big(path: Path) -> bool:
    with open(path, "rb") as f:
        return all(f.read(1 << 20) == bytes([block]) * (1 << 20) for block in range(200)) and not f.read(1)


def _big_job(tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    """A one-worker job writing a 200 MB output, attached: its folder and its `pai`."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(BIG)
    return work, subprocess.Popen([*PAI, "-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":1}}',
                                   "-DmaxRetries=0"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)


def test_kill_9_of_a_node_agent_sending_200_mb_leaves_nothing_half_written_and_pai_get_brings_it(
        cluster, nodes, tmp_path, pai_home):
    work, proc = _big_job(tmp_path)
    try:
        job_id = proc.stdout.readline()[5:].strip()
        # a partial copy here means the agent is in the middle of sending the file
        assert wait_until(lambda: _parts(work), timeout=120, interval=0.02)
        agents = _agents_of(job_id)
        assert agents
        for pid in agents:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    status = pai_json("status", job_id)
    assert status["status"] == "Failed", status
    assert not _parts(work), _parts(work)
    assert not (work / "models" / "big.bin").exists()   # absent, never a short copy
    # the whole instance's files are named as still on the node, and the file under way by name
    listed = pai_json("outputs", job_id)
    assert listed["missing"] == 1 and listed["files"][0]["where"] == "node", listed
    lost = listed["files"][0]["node"]
    log = (pai_home / "jobs" / job_id / "job.log").read_text()
    assert f"could not be brought back from node {lost}" in log and "models/big.bin" in log, log[-3000:]
    got = pai("get", job_id, "-o", str(tmp_path / "got"))
    assert got.returncode == 0, got.stdout + got.stderr
    assert _is_big(work / "models" / "big.bin")
    assert not _parts(work)
    assert pai_json("outputs", job_id)["missing"] == 0
    assert wait_until(lambda: not node_folders(cluster, job_id), timeout=20), node_folders(cluster, job_id)


def test_a_link_dropped_while_200_mb_come_back_names_the_file_and_pai_get_brings_it_later(
        cluster, nodes, tmp_path, pai_home):
    work, proc = _big_job(tmp_path)
    lost = None
    try:
        job_id = proc.stdout.readline()[5:].strip()
        assert wait_until(lambda: _parts(work), timeout=120, interval=0.02)
        host = pai_json("status", job_id)["instances"][0]["host"]
        lost = next(h.name for h in cluster.hosts if h.addr == host)
        cluster.link_down(lost)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if lost:
            cluster.link_up(lost)
    assert proc.returncode == 1, out[-3000:]
    assert not _parts(work) and not (work / "models" / "big.bin").exists()
    listed = pai_json("outputs", job_id)
    assert listed["missing"] == 1 and listed["files"][0]["node"] == lost, listed
    log = (pai_home / "jobs" / job_id / "job.log").read_text()
    assert f"could not be brought back from node {lost}" in log and "models/big.bin" in log, log[-3000:]
    got = pai("get", job_id, "-o", str(tmp_path / "got"))
    assert got.returncode == 0, got.stdout + got.stderr
    assert _is_big(work / "models" / "big.bin") and not _parts(work)
    assert pai_json("outputs", job_id)["missing"] == 0


def test_a_full_disk_here_while_200_mb_come_back_leaves_nothing_half_written(cluster, nodes, tmp_path, pai_home):
    pai_home.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(pai_home)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.strip()}")
    try:
        work = tmp_path / "work"
        work.mkdir()
        (work / "train.py").write_text(BIG.replace('"models/big.bin"', 'os.environ["PAI_OUTPUT_DIR"] + "/big.bin"'))
        done = subprocess.run([*PAI, "-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":1}}',
                               "-DmaxRetries=0"], cwd=work, capture_output=True, text=True, timeout=180)
        job_id = job_id_from(done.stdout)
        outputs = pai_home / "jobs" / job_id / "outputs" / "worker-0"
        assert not (outputs / "big.bin").exists() and not _parts(pai_home)
        log = (pai_home / "jobs" / job_id / "job.log").read_text()
        assert "big.bin of worker:0 not brought back (disk full on this machine)" in log, log[-3000:]
        listed = pai_json("outputs", job_id)
        assert listed["missing"] == 1 and listed["files"][0]["where"] == "node", listed
        # room again: `pai get` brings the file where it belongs
        subprocess.run(["mount", "-o", "remount,size=512m", str(pai_home)], check=True)
        got = pai("get", job_id, "-o", str(tmp_path / "got"))
        assert got.returncode == 0, got.stdout + got.stderr
        assert _is_big(outputs / "big.bin") and not _parts(pai_home)
        assert pai_json("outputs", job_id)["missing"] == 0
    finally:
        subprocess.run(["umount", "-l", str(pai_home)], capture_output=True)


HOSTILE_AGENT = r'''
import json, os, struct, sys, threading
if os.getpgid(0) != os.getpid():
    os.setsid()   # a group of its own, as an instance: the one stop path finds it
json.loads(sys.stdin.buffer.readline())
out = sys.stdout.buffer
def frame(kind, payload=b""):
    out.write(kind + struct.pack(">I", len(payload)) + payload)
    out.flush()
def send(key, rel, data, size=None):
    frame(b"F", json.dumps({"key": key, "rel": rel, "size": len(data) if size is None else size,
                            "mtime": 1, "at": rel}).encode())
    frame(b"D", data)
    frame(b"S", json.dumps({"digest": "crc32:00000000"}).encode())
with open("/proc/self/stat") as f:
    start = f.read().rsplit(")", 1)[1].split()[19]
with open("/proc/sys/kernel/random/boot_id") as f:
    frame(b"I", json.dumps({"pid": os.getpid(), "pgid": os.getpid(), "start": start, "boot": f.read().strip()}).encode())
for rel in (".ssh/authorized_keys", ".venv/lib/python3.11/site-packages/zz.pth", ".pai/nodes.yaml",
            "evil\n[pai] job Succeeded", "../escape.txt", sys.argv[-1] + "/abs.txt", "models/../../escape.txt"):
    send("cwd", rel, b"ssh-ed25519 AAAA planted\n")
send("out", "big.bin", b"z" * 100_000, size=10)
send("ckpt", "big.bin", b"z" * 2000)       # over -DoutputMaxSize=1K
out.write(b"D" + struct.pack(">I", 0xFFFFFFF0) + b"z" * 1_000_000)   # a frame of ~4 GiB
out.flush()
# as a real agent does, end when the master closes this connection (bounded, should it never)
threading.Timer(600, os._exit, (0,)).start()
sys.stdin.buffer.read()
os._exit(0)
'''


def test_a_hostile_node_writes_nothing_here_and_fails_the_job_naming_it(cluster, nodes, tmp_path, pai_home,
                                                                         monkeypatch):
    """A node agent that sends crafted frames (hidden names, a newline, '..', an
    absolute path, more bytes than announced or allowed, a frame of ~4 GiB): each
    is refused, nothing lands outside the job's targets, the job fails in one line
    that names the node."""
    room = Path(f"/var/tmp/paicli-hostile-{os.getpid()}")   # the hosts share all but /tmp
    room.mkdir(exist_ok=True)
    try:
        (room / "agent.py").write_text(HOSTILE_AGENT)
        wrapper = room / "python3"
        wrapper.write_text('#!/bin/sh\ncase "$1" in */node_agent.py) [ "$2" = run ] && '
                           f'exec python3 {room}/agent.py "$@" {room};; esac\nexec python3 "$@"\n')
        wrapper.chmod(0o755)
        monkeypatch.setenv("PAI_NODES", str(cluster.write_nodes_file(tmp_path / "hostile.yaml", cpu=100,
                                                                     python=str(wrapper))))
        work = workdir(tmp_path)
        before = sorted(p.name for p in tmp_path.iterdir())
        result = submit(work, "-DoutputMaxSize=1K")
        job_id = job_id_from(result.stdout)
        status = pai_json("status", job_id)
        assert status["status"] == "Failed" and result.returncode != 0, result.stdout[-3000:]
        reason = status["reason"]
        assert re.match(r"node h[12] sent what a node may not send \(worker:[01]\): '\.ssh/authorized_keys'", reason)
        assert "\n" not in reason and not [line for line in result.stdout.splitlines() if "job Succeeded" in line]
        assert {p.name for p in tmp_path.iterdir()} <= {*before, "ckpt", "pai-home"} and not list(room.glob("abs*"))
        assert sorted(p.name for p in work.iterdir()) == ["train.py"]
        assert not (work.parent / "ckpt").exists() or not list((work.parent / "ckpt").iterdir())
        assert not list((pai_home / "jobs" / job_id / "outputs").rglob("big.bin"))
        assert not (pai_home / "nodes.yaml").exists()
    finally:
        subprocess.run(["rm", "-rf", str(room)], check=True)
