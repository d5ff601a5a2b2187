"""A job's env and requirements on real SSH hosts (network namespaces, tests/netns.py)
and on the real Ray cluster (tests/ray_cluster.py): the declared variables reach
every instance, an undeclared one of the submitting shell does not (the one rule),
secret values never reach a log; the layer is built on each node before any
instance starts, and a second job with the same requirements installs nothing. PAI's
tables and buckets on Ray nodes run here too, so that one two-node Ray cluster serves both.

Each node keeps its layers somewhere this machine does not (SSH: the node's own
/tmp; Ray: a runtime dir of the nodes' own), so what is reused is really the
node's copy. The package is a tiny wheel built by tests/test_envs.py's helper and
shipped from a local --find-links folder: nothing comes from an index.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, pai, wait_until
from netns import module_cluster
from test_envs import SECRET, wheelhouse

from paicli.runners.runtimes import runtime_root

MASK = "***"
SHARED_RUNTIMES = runtime_root()   # at import: before any fixture changes PAI_RUNTIME_DIR
SCRIPT = """\
import os, paienvtiny
print("ON %s FOO=%s TOKEN=%s SHELL_ONLY=%s SHELL_PATH=%s VALUE=%s" % (os.environ["PAI_NODE"], os.environ.get("FOO"),
      os.environ.get("MY_TOKEN"), os.environ.get("ENVS_SHELL_ONLY"),
      "/envs-shell-only-path" in os.environ.get("PYTHONPATH", ""), paienvtiny.VALUE), flush=True)
"""
TWO_WORKERS = '{"worker":{"count":2,"cpu":100}}'


def job_args(tmp_path: Path) -> list[str]:
    script = tmp_path / "uses_tiny.py"
    script.write_text(SCRIPT)
    req = tmp_path / "requirements.txt"
    req.write_text(f"--no-index\n--find-links {wheelhouse(tmp_path)}\npaienvtiny==1.0\n")
    return ["-name", "python", f"-Dscript={script}", f"-Drequirements=file://{req}", "-Denv=FOO=bar,MY_TOKEN",
            f"-Dcluster={TWO_WORKERS}"]


def check_first_and_second(run, tmp_path: Path, nodes: set[str], builds: int) -> tuple[float, float]:
    """Two jobs with the same requirements: the first builds the layer on every node,
    the second installs nothing anywhere. Their wall times."""
    args = job_args(tmp_path)
    started = time.monotonic()
    first = run(*args)
    first_time = time.monotonic() - started
    out = first.stdout
    assert first.returncode == 0, out[-3000:] + first.stderr[-2000:]
    seen = {line.split()[2] for line in out.splitlines() if " ON " in f" {line}" and "VALUE=42" in line}
    assert seen == nodes, out[-3000:]
    # Neither an undeclared variable nor this shell's PYTHONPATH reaches a node.
    assert out.count(f"FOO=bar TOKEN={MASK} SHELL_ONLY=None SHELL_PATH=False VALUE=42") == 2, out[-3000:]
    assert SECRET not in out and SECRET not in first.stderr
    built = [line for line in out.splitlines() if "installing 1 package(s): paienvtiny==1.0" in line]
    assert len(built) == builds, out[-3000:]   # on each node (its own layers folder), once
    started = time.monotonic()
    second = run(*args)
    second_time = time.monotonic() - started
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    assert second.stdout.count("VALUE=42") == 2
    assert "installing" not in second.stdout + second.stderr and "resolving" not in second.stdout + second.stderr
    return first_time, second_time


# -- SSH ------------------------------------------------------------------------------



ssh_cluster = module_cluster(2, "pce", 150, name="ssh_cluster")


def test_env_and_requirements_on_ssh_nodes(ssh_cluster, tmp_path, monkeypatch, pai_home):
    # /tmp is each host's own: the nodes' layers are theirs, not this machine's cache.
    path = ssh_cluster.write_nodes_file(tmp_path / "nodes.yaml", cpu=100, runtime_dir="/tmp/paicli-envs-runtimes")
    env = {"PAI_NODES": str(path), "PAI_RUNTIME_DIR": str(tmp_path / "local-runtimes"), "MY_TOKEN": SECRET,
           "ENVS_SHELL_ONLY": "not declared", "PYTHONPATH": "/envs-shell-only-path"}
    times = check_first_and_second(lambda *a: pai(*a, env=env, timeout=300), tmp_path,
                                   {h.name for h in ssh_cluster.hosts}, builds=2)
    print(f"ssh: first job {times[0]:.1f}s, second (layer reused) {times[1]:.1f}s")
    for host in ssh_cluster.hosts:
        listed = ssh_cluster.ssh(host.name, ["sh", "-c", "ls /tmp/paicli-envs-runtimes/layers"]).stdout
        assert "python-" in listed, listed


# -- Caffe: its root filesystem's Python 3.9, a layer built for it on each node ------------


def caffe_runtime() -> Path:
    """The shared Caffe runtime (built once: root and 3 minutes), or a skip. Shared:
    SHARED_RUNTIMES, as this process found it before a fixture pointed
    PAI_RUNTIME_DIR at a node's own folder."""
    from paicli.runners.runtimes import RuntimeSetupError, get_runtime

    saved = os.environ.get("PAI_RUNTIME_DIR")
    os.environ["PAI_RUNTIME_DIR"] = str(SHARED_RUNTIMES)
    try:
        runtime = get_runtime("caffe")
        runtime.ensure()
        return runtime.path.resolve()
    except RuntimeSetupError as err:
        pytest.skip(f"the Caffe runtime: {err}")
    finally:
        if saved is None:
            os.environ.pop("PAI_RUNTIME_DIR", None)
        else:
            os.environ["PAI_RUNTIME_DIR"] = saved


def runtime_dir_with_caffe(folder: Path, caffe: Path) -> Path:
    """A runtime dir of its own (its layers are its own) whose caffe is the shared one."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "caffe").symlink_to(caffe)
    return folder


def caffe_job(tmp_path: Path) -> list[str]:
    """A pycaffe script (2 workers) that imports caffe, the layer's package and
    paitables in Caffe's own Python, then reads its slice (tests/scripts/table_worker.py)."""
    from test_tables import WORKER, make_tables

    script = tmp_path / "caffe_tables.py"
    script.write_text("import os, sys\nimport caffe, paienvtiny\n"
                      "print('CAFFE py=%d.%d VALUE=%s' % (sys.version_info[0], sys.version_info[1], paienvtiny.VALUE), "
                      "flush=True)\n" + WORKER.read_text())
    req = tmp_path / "requirements.txt"
    req.write_text(f"--no-index\n--find-links {wheelhouse(tmp_path)}\npaienvtiny==1.0\n")
    return ["-name", "caffe", f"-Dscript={script}", f"-Drequirements=file://{req}", f"-Dcluster={TWO_WORKERS}",
            f"-Dtables={make_tables(tmp_path, 11)[0]}"]


def check_caffe_jobs(run, tmp_path: Path, builds: int) -> tuple[float, float]:
    """The first job builds the Caffe layer (`builds` times) and each worker reads
    its slice through paitables; the second, without tables, installs nothing and
    imports paitables all the same. Their wall times."""
    from test_tables import assert_disjoint_and_complete

    args = caffe_job(tmp_path)
    started = time.monotonic()
    first = run(*args)
    first_time = time.monotonic() - started
    out = first.stdout
    assert first.returncode == 0, out[-3000:] + first.stderr[-2000:]
    assert out.count("CAFFE py=3.9 VALUE=42") == 2, out[-3000:]
    assert_disjoint_and_complete(out, args[-1][len("-Dtables="):], 11)
    assert len([x for x in out.splitlines() if "installing 1 package(s): paienvtiny==1.0" in x]) == builds, out[-3000:]
    started = time.monotonic()
    second = run(*args[:-1])     # the same requirements (and wheels), no -Dtables
    second_time = time.monotonic() - started
    both = second.stdout + second.stderr
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    assert second.stdout.count("CAFFE py=3.9 VALUE=42") == 2 and "installing" not in both and "resolving" not in both
    assert second.stdout.count("imported=data/py/paitables.py role=worker") == 2, second.stdout[-3000:]
    return first_time, second_time


@pytest.mark.caffe
def test_a_caffe_layer_and_paitables_on_ssh_nodes(ssh_cluster, tmp_path, pai_home):
    caffe = caffe_runtime()
    node_dir = f"/tmp/paicli-envs-caffe-{os.getpid()}"     # each host's own /tmp: its own layers
    for host in ssh_cluster.hosts:
        made = ssh_cluster.ssh(host.name, ["sh", "-c", f"mkdir -p {node_dir} && ln -sfn {caffe} {node_dir}/caffe"])
        assert made.returncode == 0, made.stderr
    path = ssh_cluster.write_nodes_file(tmp_path / "nodes.yaml", cpu=100, runtime_dir=node_dir)
    env = {"PAI_NODES": str(path), "PAI_RUNTIME_DIR": str(runtime_dir_with_caffe(tmp_path / "local-rt", caffe))}
    times = check_caffe_jobs(lambda *a: pai(*a, env=env, timeout=300), tmp_path, builds=2)
    print(f"ssh caffe: first job {times[0]:.1f}s, second (layer reused) {times[1]:.1f}s")
    for host in ssh_cluster.hosts:
        listed = ssh_cluster.ssh(host.name, ["sh", "-c", f"ls {node_dir}/layers; rm -rf {node_dir}"]).stdout
        assert "caffe-" in listed, listed


def test_a_bad_requirement_fails_at_submit_before_any_node_is_touched(ssh_cluster, tmp_path, pai_home):
    path = ssh_cluster.write_nodes_file(tmp_path / "nodes.yaml", cpu=100, runtime_dir="/tmp/paicli-envs-runtimes")
    req = tmp_path / "bad.txt"
    req.write_text("--no-index\nno-such-package-paicli==9\n")
    result = pai("-name", "python", f"-Dscript={ROOT}/tests/scripts/behave.py", f"-Drequirements={req}",
                 env={"PAI_NODES": str(path), "PAI_RUNTIME_DIR": str(tmp_path / "local-runtimes")})
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("pai: error:")] == [
        line for line in result.stderr.splitlines() if "no-such-package-paicli==9" in line]
    # Nothing on any node: the job's master, which logged in to look at the nodes as the
    # submit began (docs/multihost.md, "Logins"), has left with its connections.
    assert wait_until(lambda: not ssh_cluster.all_leftovers(), 10), ssh_cluster.all_leftovers()
    assert not (pai_home / "jobs").exists() or not any((pai_home / "jobs").iterdir())


# -- Ray ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory):
    from ray_cluster import RayCluster, cannot_run

    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    node_runtimes = tmp_path_factory.mktemp("ray-node-runtimes")
    # The Ray nodes inherit this environment when they start: their runtime dir is theirs.
    old = os.environ.get("PAI_RUNTIME_DIR")
    os.environ["PAI_RUNTIME_DIR"] = str(node_runtimes)
    try:
        with RayCluster(prefix="eray", subnet="10.213.31", nodes=2) as cluster:
            yield cluster, node_runtimes
    finally:
        if old is None:
            os.environ.pop("PAI_RUNTIME_DIR", None)
        else:
            os.environ["PAI_RUNTIME_DIR"] = old


def test_env_and_requirements_on_ray_nodes(ray_nodes, tmp_path):
    cluster, node_runtimes = ray_nodes
    home = tmp_path / "home"
    env = {"PAI_HOME": str(home), "PAI_RAY_ADDRESS": cluster.address, "NO_COLOR": "1", "PAI_DEBUG": "",
           "PAI_RUNTIME_DIR": str(tmp_path / "local-runtimes"), "MY_TOKEN": SECRET, "ENVS_SHELL_ONLY": "no",
           "PYTHONPATH": "/envs-shell-only-path"}

    def run(*args):
        return cluster.run([sys.executable, "-m", "paicli", *args], env=env, timeout=300, cwd=str(ROOT))

    nodes = {h.addr for h in cluster.net.hosts}
    # Both Ray nodes share this machine's filesystem, their runtime dir with it: one builds.
    times = check_first_and_second(run, tmp_path, nodes, builds=1)
    print(f"ray: first job {times[0]:.1f}s, second (layer reused) {times[1]:.1f}s")
    layers = list((node_runtimes / "layers").glob("python-*/paicli-layer.json"))
    assert len(layers) == 1 and json.loads(layers[0].read_text())["installed"] == ["paienvtiny==1.0"]


@pytest.mark.caffe
def test_a_caffe_layer_and_paitables_on_ray_nodes(ray_nodes, tmp_path):
    cluster, node_runtimes = ray_nodes
    caffe = caffe_runtime()
    if not (node_runtimes / "caffe").exists():
        runtime_dir_with_caffe(node_runtimes, caffe)
    home = tmp_path / "home"
    env = {"PAI_HOME": str(home), "PAI_RAY_ADDRESS": cluster.address, "NO_COLOR": "1", "PAI_DEBUG": "",
           "PAI_RUNTIME_DIR": str(runtime_dir_with_caffe(tmp_path / "local-rt", caffe))}

    def run(*args):
        return cluster.run([sys.executable, "-m", "paicli", *args], env=env, timeout=300, cwd=str(ROOT))

    times = check_caffe_jobs(run, tmp_path, builds=1)   # both Ray nodes share the runtime dir: one builds
    print(f"ray caffe: first job {times[0]:.1f}s, second (layer reused) {times[1]:.1f}s")
    assert len(list((node_runtimes / "layers").glob("caffe-*/paicli-layer.json"))) == 1


def test_ray_slices_outputs_and_a_bucket_that_goes_once(ray_nodes, tmp_path):
    """PAI's tables and buckets on the Ray nodes (the SSH side is tests/test_tables_nodes.py):
    each worker's slice goes to its node only (two nodes of one CPU each: a 2-worker job
    has one worker on each), the output table comes home whole, a bucket goes once."""
    from test_tables import TWO, WORKER, assert_disjoint_and_complete, make_tables
    from test_tables_nodes import READER, assert_bucket_job, make_bucket, ok, sent_records

    cluster, _node_runtimes = ray_nodes
    home = tmp_path / "home"
    env = {"PAI_HOME": str(home), "PAI_RAY_ADDRESS": cluster.address, "NO_COLOR": "1", "PAI_DEBUG": "",
           "PAI_NODES": ""}

    def run(*args):
        return cluster.run([sys.executable, "-m", "paicli", *args], env=env, timeout=300, cwd=str(ROOT))

    csv_url, db_url = make_tables(tmp_path, 101)
    bucket = make_bucket(tmp_path)
    first = run("-name", "python", f"-Dscript={WORKER}", TWO, f"-Dtables={csv_url}",
                f"-Doutputs=file://{tmp_path}/pred.csv", f"-Dbuckets=file://{bucket}")
    job = ok(first)
    assert_disjoint_and_complete(first.stdout, csv_url, 101)
    rows = list(csv.reader(open(tmp_path / "pred.csv")))
    assert rows[1:] == [[str(i), str(2 * i)] for i in range(101)]
    [sent] = sent_records(home, job)
    share = (tmp_path / "train.csv").stat().st_size / 2
    files = sum(p.stat().st_size for p in bucket.rglob("*") if p.is_file())
    assert len(sent) == 2 and all(share * 0.9 + files < n < share * 1.05 + files + 2048 for n in sent.values()), sent
    second = run("-name", "python", f"-Dscript={READER}", TWO, f"-Dtables={csv_url}", f"-Dbuckets=file://{bucket}/")
    [sent] = sent_records(home, ok(second))
    assert len(sent) == 2 and all(n < 4096 for n in sent.values()), sent     # the index alone
    assert_bucket_job(second, bucket)
    third = run("-name", "python", f"-Dscript={WORKER}", TWO, f"-Dtables={db_url}")
    ok(third)
    assert_disjoint_and_complete(third.stdout, db_url, 101)


def test_a_layer_a_node_cannot_build_fails_the_job_before_any_instance_starts(ssh_cluster, tmp_path, pai_home):
    # /proc takes no new folder: building the layer on the nodes fails, after it was fine here.
    path = ssh_cluster.write_nodes_file(tmp_path / "nodes.yaml", cpu=100, runtime_dir="/proc/paicli-no-layers")
    result = pai(*job_args(tmp_path), env={"PAI_NODES": str(path), "MY_TOKEN": SECRET,
                                           "PAI_RUNTIME_DIR": str(tmp_path / "local-runtimes")}, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:]
    status = json.loads(pai("status", next(line[5:] for line in result.stdout.splitlines()
                                           if line.startswith("ID = ")), "--json").stdout)
    assert "-Drequirements on node" in status["reason"] and "\n" not in status["reason"], status["reason"]
    assert all(i["pid"] is None for i in status["instances"]), status["instances"]   # none started
    assert "ON " not in result.stdout
