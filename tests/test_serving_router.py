"""A serving job's router as the master runs it (docs/serving.md): real Caffe LeNet
replicas behind it, its URL where `pai list`, `pai status` and the logview show it,
`pai serve scale` under a client loop, and no router left behind however the job ends."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import pytest

from conftest import kill_groups, pai, pai_json, processes_in, wait_until, watchdog_of
from paicli.runners.node_agent import free_ports
from test_router import post
from test_serving import images, lenet  # noqa: F401 - the module's LeNet model folder, a fixture

pytestmark = pytest.mark.caffe


def serve(lenet_folder: Path, replicas: int = 2, *extra: str) -> tuple[str, str, Path]:
    """A serving job of the LeNet with `replicas` replicas, once every one is in its
    router: (job ID, URL, job folder)."""
    port = free_ports("127.0.0.1", 1, set())[0]
    result = pai("--detach", "-name", "serving", f"-Dmodel={lenet_folder}", "-DmodelName=lenet",
                 f'-Dcluster={{"replica":{{"count":{replicas}}}}}', f"-DservingPort={port}", *extra)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    job_dir = Path(pai_json("status", job_id)["job_dir"])
    assert wait_until(lambda: len(set(re.findall(r"(replica:\d+) \(\S+\) in", router_log(job_dir)))) == replicas,
                      timeout=120), router_log(job_dir)
    return job_id, f"http://127.0.0.1:{port}", job_dir


def router_log(job_dir: Path) -> str:
    log = job_dir / "router.log"
    return log.read_text() if log.exists() else ""


def router_group(job_dir: Path) -> int:
    pid = int(re.search(r"paicli.cluster.router: pid (\d+)", router_log(job_dir)).group(1))
    return os.getpgid(pid)


def predict(url: str) -> tuple[int, dict]:
    return post(f"{url}/v1/models/lenet:predict", json.dumps({"instances": images(1)}).encode())


def test_a_service_shows_its_url_and_replicas_and_pai_kill_leaves_no_router(pai_home, lenet):  # noqa: F811
    job_id, url, job_dir = serve(lenet)
    group = router_group(job_dir)
    try:
        status, answer = predict(url)
        assert status == 200 and len(answer["predictions"]) == 1
        listed = pai("list")
        assert "URL" in listed.stdout and url in listed.stdout
        shown = pai("status", job_id).stdout
        assert f"Serving: {url}" in shown
        st = pai_json("status", job_id)
        assert st["url"] == url
        assert [(i["role"], i["index"], i["status"]) for i in st["instances"]] == \
            [("replica", 0, "Running"), ("replica", 1, "Running")]
        assert all(i["node"] and i["host"] and i["port"] for i in st["instances"])
        assert pai("kill", job_id).returncode == 0
        assert wait_until(lambda: processes_in({group}) == [], timeout=30), processes_in({group})
        assert pai_json("status", job_id)["url"] is None
    finally:
        kill_groups([group])


def test_scaling_up_and_down_under_a_client_loop_drops_no_request(pai_home, lenet):  # noqa: F811
    job_id, url, job_dir = serve(lenet, 1)
    group = router_group(job_dir)
    results: list[int] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            results.append(predict(url)[0])

    loop = threading.Thread(target=client)
    loop.start()
    try:
        scaled = pai("serve", "scale", job_id, "3")
        assert scaled.returncode == 0, scaled.stderr
        assert wait_until(lambda: "replica:2 (" in router_log(job_dir) and "replica:1 (" in router_log(job_dir),
                          timeout=120), router_log(job_dir)
        assert pai("serve", "scale", job_id, "1").returncode == 0
        assert wait_until(lambda: [i["status"] for i in pai_json("status", job_id)["instances"]]
                          == ["Running", "Killed", "Killed"], timeout=60)
        asked = len(results)
        assert wait_until(lambda: len(results) > asked + 10, timeout=60)
    finally:
        done.set()
        loop.join(120)
        pai("kill", job_id)
        kill_groups([group])
    assert results and set(results) == {200}, [s for s in results if s != 200]
    assert "replica:2 (" in router_log(job_dir) and "out: down" in router_log(job_dir)


def test_no_router_is_left_when_the_replica_fails_for_good(pai_home, lenet):  # noqa: F811
    job_id, url, job_dir = serve(lenet, 1, "-DmaxRetries=0")
    group = router_group(job_dir)
    try:
        replica = pai_json("status", job_id)["instances"][0]
        os.killpg(replica["pgid"], signal.SIGKILL)
        assert wait_until(lambda: pai_json("status", job_id)["status"] == "Failed", timeout=60)
        assert wait_until(lambda: processes_in({group}) == [], timeout=30), processes_in({group})
    finally:
        kill_groups([group])


def test_no_router_is_left_after_a_kill_9_of_the_master(pai_home, lenet):  # noqa: F811
    job_id, url, job_dir = serve(lenet, 1)
    group = router_group(job_dir)
    st = pai_json("status", job_id)
    groups = {group, *(i["pgid"] for i in st["instances"])}
    try:
        watchdog_of(job_dir, job_id)
        os.kill(st["master_pid"], signal.SIGKILL)
        assert wait_until(lambda: processes_in(groups) == [], timeout=60), processes_in(groups)
    finally:
        kill_groups(groups)


def test_a_busy_serving_port_fails_the_job_in_one_line_naming_it(pai_home, lenet):  # noqa: F811
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = pai("-name", "serving", f"-Dmodel={lenet}", f"-DservingPort={port}", timeout=120)
    assert result.returncode != 0
    assert f"the serving port 127.0.0.1:{port} cannot be bound" in result.stdout + result.stderr
    assert "-DservingPort" in result.stdout + result.stderr
