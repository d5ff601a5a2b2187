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
from ray_cluster import RayCluster, cannot_run, job_processes  # noqa: E402
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


def test_files_come_back_from_ray_nodes_at_the_end_and_after_kill_9_of_the_master(ray_cluster, tmp_path):
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

    for path in (work / "models", tmp_path / "ckpt", work / "same.txt"):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    one = [arg.replace('"count":2', '"count":1') for arg in statement]
    proc = pai_ray(ray_cluster, home, work, *one, "-DuserDefinedParameters=--hang", popen=True)
    try:
        job_id = proc.stdout.readline()[5:].strip()
        deadline = time.monotonic() + 120
        while not status(ray_cluster, home, work, job_id).get("metric_series"):
            assert time.monotonic() < deadline, status(ray_cluster, home, work, job_id)
            time.sleep(0.5)
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
    assert (work / "models" / "model-0.txt").read_text() == "model of worker 0\n"
    assert (tmp_path / "ckpt" / "ckpt-0").read_text() == "ckpt of worker 0\n"
    assert status(ray_cluster, home, work, job_id)["status"] == "Failed"
