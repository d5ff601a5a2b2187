"""Files a job writes come back from Ray nodes (issue 17): the real Ray cluster of
tests/ray_cluster.py (a head and a worker node, each in its own network namespace).
`pai` runs on the head node, in a working folder of the test's own; the instances
run in per-job folders on their nodes, so a file reaches that working folder only
if paicli brings it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_cluster import RayCluster, cannot_run, job_processes, node_job_folders  # noqa: E402
from conftest import watchdog_of  # noqa: E402
from test_outputs_ssh import SCRIPT  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_cluster():
    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    with RayCluster(prefix="oray", subnet="10.213.77", nodes=2) as cluster:
        yield cluster


def pai_ray(cluster, home: Path, work: Path, *args: str, timeout: float = 300, popen: bool = False):
    env = dict(os.environ, PAI_HOME=str(home), PAI_RAY_ADDRESS=cluster.address, NO_COLOR="1", PAI_DEBUG="")
    argv = cluster.exec_argv([sys.executable, "-m", "paicli", *args], None)
    if popen:
        return subprocess.Popen(argv, env=env, cwd=str(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(argv, env=env, cwd=str(work), capture_output=True, text=True, timeout=timeout)


def status(cluster, home: Path, work: Path, job_id: str) -> dict:
    result = pai_ray(cluster, home, work, "status", job_id, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


def clear(tmp_path: Path) -> None:
    """Remove what an earlier job of the test brought back."""
    for path in (tmp_path / "work" / "models", tmp_path / "ckpt", tmp_path / "work" / "same.txt"):
        subprocess.run(["rm", "-rf", str(path)], check=True)


def assert_worker_0_back(tmp_path: Path, home: Path, job_id: str) -> None:
    assert (tmp_path / "work" / "models" / "model-0.txt").read_text() == "model of worker 0\n"
    assert (tmp_path / "ckpt" / "ckpt-0").read_text() == "ckpt of worker 0\n"
    assert (home / "jobs" / job_id / "outputs" / "worker-0" / "out.txt").read_text() == "out of worker 0\n"
    assert not [p for p in (tmp_path / "work").rglob("*") if p.name.startswith(".pai-part-")]


def test_files_come_back_from_ray_nodes_however_the_job_ends(ray_cluster, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    statement = ["-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":2}}',
                 f"-DcheckpointDir={tmp_path / 'ckpt'}", "-DmaxRetries=0"]
    result = pai_ray(ray_cluster, home, work, *statement)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    job_id = result.stdout.split("ID = ", 1)[1].split()[0]
    for idx in (0, 1):
        assert (work / "models" / f"model-{idx}.txt").read_text() == f"model of worker {idx}\n"
        assert (tmp_path / "ckpt" / f"ckpt-{idx}").read_text() == f"ckpt of worker {idx}\n"
        assert (home / "jobs" / job_id / "outputs" / f"worker-{idx}" / "out.txt").read_text() == \
            f"out of worker {idx}\n"
    assert (work / "same.txt").read_text() == "written by worker 1\n"
    assert "worker:0 and worker:1 both wrote" in result.stdout
    assert status(ray_cluster, home, work, job_id)["outputs"]["missing"] == 0
    assert wait_for(lambda: not node_job_folders(job_id)), node_job_folders(job_id)

    # a failure, then `pai kill`: one instance each, its files back, its folder gone
    one = [arg.replace('"count":2', '"count":1') for arg in statement]
    clear(tmp_path)
    failed = pai_ray(ray_cluster, home, work, *one, "-DuserDefinedParameters=--fail --big", "-DoutputMaxSize=1K")
    assert failed.returncode != 0, failed.stdout[-3000:]
    job_id = failed.stdout.split("ID = ", 1)[1].split()[0]
    assert status(ray_cluster, home, work, job_id)["status"] == "Failed"
    assert_worker_0_back(tmp_path, home, job_id)
    # the file over the size limit kept the node's folder; `pai get` brings it and the folder goes
    assert not (work / "big-0.bin").exists() and len(node_job_folders(job_id)) == 1
    got = pai_ray(ray_cluster, home, work, "get", job_id, "big-*", "-o", str(tmp_path / "got"), timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    assert (work / "big-0.bin").stat().st_size == 4096 and (tmp_path / "got" / "big-0.bin").stat().st_size == 4096
    assert status(ray_cluster, home, work, job_id)["outputs"]["missing"] == 0
    assert wait_for(lambda: not node_job_folders(job_id)), node_job_folders(job_id)

    clear(tmp_path)
    proc = pai_ray(ray_cluster, home, work, *one, "-DuserDefinedParameters=--hang", popen=True)
    try:
        job_id = proc.stdout.readline()[5:].strip()
        assert wait_for(lambda: status(ray_cluster, home, work, job_id).get("metric_series"), 120)
        killed = pai_ray(ray_cluster, home, work, "kill", job_id, timeout=120)
        assert killed.returncode == 0, killed.stdout + killed.stderr
        proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert status(ray_cluster, home, work, job_id)["status"] == "Cancelled"
    assert_worker_0_back(tmp_path, home, job_id)
    assert status(ray_cluster, home, work, job_id)["outputs"]["missing"] == 0
    assert wait_for(lambda: not node_job_folders(job_id)), node_job_folders(job_id)

    clear(tmp_path)
    proc = pai_ray(ray_cluster, home, work, *one, "-DuserDefinedParameters=--hang", popen=True)
    try:
        job_id = proc.stdout.readline()[5:].strip()
        deadline = time.monotonic() + 120
        while not status(ray_cluster, home, work, job_id).get("metric_series"):
            assert time.monotonic() < deadline, status(ray_cluster, home, work, job_id)
            time.sleep(0.5)
        watchdog_of(status(ray_cluster, home, work, job_id)["job_dir"], job_id)   # what cleans up below
        os.kill(status(ray_cluster, home, work, job_id)["master_pid"], signal.SIGKILL)
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
    assert status(ray_cluster, home, work, job_id)["status"] == "Failed"
    assert wait_for(lambda: not node_job_folders(job_id)), node_job_folders(job_id)
