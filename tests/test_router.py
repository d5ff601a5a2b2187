"""The serving router (cluster/router.py): its policy as pure functions, and the
process as the master starts it (cluster/spawn.start_router), in front of small
real HTTP servers standing in for replicas."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, kill_groups, processes_in, wait_until
from paicli.adapters.serving import is_loopback
from paicli.cluster import policy, router, spawn
from paicli.cluster.procinfo import is_alive
from paicli.errors import UsageError
from paicli.jobplan import JobPlan, RolePlan, front_url
from paicli.runners.node_agent import free_ports

REPLICA = ROOT / "tests" / "scripts" / "http_replica.py"
TOKEN = "s3cret-token"


# -- the policy ---------------------------------------------------------------------


def test_control_lines_are_up_and_down_and_nothing_else():
    assert router.parse_control("up replica:0 10.0.0.2:8000\n") == ("up", "replica:0", "10.0.0.2:8000")
    assert router.parse_control("down replica:1") == ("down", "replica:1", None)
    for bad in ("", "up replica:0", "up replica:0 host", "sideways replica:0", "down"):
        with pytest.raises(ValueError):
            router.parse_control(bad)


def test_the_ready_replica_with_fewest_outstanding_is_chosen_and_equals_take_turns():
    a, b, c = router.Replica("r:0", "h:1", True), router.Replica("r:1", "h:2", True), router.Replica("r:2", "h:3")
    assert router.choose([]) is None
    assert router.choose([c]) is None            # not ready: never chosen
    a.outstanding = 2
    assert router.choose([a, b, c]) is b
    b.outstanding = 2
    a.picked, b.picked = 5, 3
    assert router.choose([a, b, c]) is b          # equal load: the one chosen longer ago
    order = []
    a.outstanding = b.outstanding = 0
    for turn in range(6, 10):
        pick = router.choose([a, b])
        pick.picked = turn
        order.append(pick.name)
    assert order == ["r:1", "r:0", "r:1", "r:0"]
    c.ready = True                                # new: its turn comes once, then it takes turns
    assert router.choose([a, b, c]) is c


def test_only_a_200_health_answer_keeps_a_replica_in():
    assert router.ready_after_check(200)
    for status in (None, 401, 500, 503):
        assert not router.ready_after_check(status)


def test_scaling_numbers_new_replicas_after_every_index_used_and_removes_the_highest():
    assert policy.scale_steps([0, 1], 2, 4) == ([2, 3], [])
    assert policy.scale_steps([0, 1, 2, 3], 4, 2) == ([], [3, 2])
    assert policy.scale_steps([0, 3], 5, 3) == ([5], [])      # 1, 2 and 4 were removed: never reused
    assert policy.scale_steps([0, 5], 6, 1) == ([], [5])
    assert policy.scale_steps([0, 1], 2, 2) == ([], [])


def test_the_url_and_the_error_form():
    assert front_url({"host": "0.0.0.0", "port": 8501}) == "http://0.0.0.0:8501"
    assert front_url({"host": "::1", "port": 9}) == "http://[::1]:9"
    assert json.loads(router.error_body("no")) == {"error": "no"}


def test_a_busy_port_is_one_line_naming_it_and_how_to_pick_another():
    port = free_ports("127.0.0.1", 1, set())[0]
    held = router.listen({"host": "127.0.0.1", "port": port})
    try:
        with pytest.raises(UsageError) as err:
            router.listen({"host": "127.0.0.1", "port": port})
        assert f"127.0.0.1:{port}" in str(err.value) and "--port" in err.value.hint
        assert "-DservingPort" in err.value.hint
    finally:
        held.close()


# -- the process --------------------------------------------------------------------


class Fixture:
    """A router started as the master starts it, and replicas it can be told about."""

    def __init__(self, tmp: Path, client_token: str | None = None):
        self.tmp = tmp
        self.replicas: dict[str, subprocess.Popen] = {}
        port, *self.ports = free_ports("127.0.0.1", 5, set())
        self.front = {"host": "127.0.0.1", "port": port, "role": "replica",
                      **({"token": client_token} if client_token else {})}
        plan = JobPlan("serve", "serving", "serve", [RolePlan("replica", 2, ["x"], env={router.TOKEN_ENV: TOKEN})],
                       front=self.front)
        (tmp / "plan.json").write_text(plan.to_json())
        sock = router.listen(self.front)
        try:
            self.proc = spawn.start_router(sock.fileno(), tmp / "plan.json", tmp / "router.log")
        finally:
            sock.close()
        self.url = front_url(self.front)

    def replica(self, idx: int, delay: float = 0.0) -> str:
        name = f"replica:{idx}"
        env = {**os.environ, router.TOKEN_ENV: TOKEN}
        proc = subprocess.Popen([sys.executable, str(REPLICA), str(self.ports[idx]), name, str(self.tmp / f"sick{idx}"),
                                 str(delay)], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert "ready" in proc.stdout.readline()
        self.replicas[name] = proc
        self.tell(f"up {name} 127.0.0.1:{self.ports[idx]}")
        return name

    def tell(self, line: str) -> None:
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()

    def log(self) -> str:
        return (self.tmp / "router.log").read_text()

    def close(self) -> None:
        with_pid = [p.pid for p in self.replicas.values()]
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        spawn.stop_router(self.proc.ref, 2.0)
        kill_groups([self.proc.ref.pgid, *with_pid])


@pytest.fixture
def front(tmp_path):
    fixture = Fixture(tmp_path)
    yield fixture
    fixture.close()


def post(url: str, body: bytes, timeout: float = 30.0, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def in_rotation(front: Fixture, *names: str) -> bool:
    """Every one of `names` has answered a request through the router."""
    seen = {post(f"{front.url}/v1/models/m:predict", b"{}")[1].get("replica") for _ in range(8)}
    return set(names) <= seen


def test_requests_are_spread_with_the_token_and_bodies_pass_unchanged(front):
    front.replica(0)
    front.replica(1)
    assert wait_until(lambda: in_rotation(front, "replica:0", "replica:1"), timeout=30)
    body = json.dumps({"instances": [[0.5, 1.25, -3e-7]], "note": "é\u00e9"}).encode()
    status, answer = post(f"{front.url}/v1/models/mnist/versions/2:predict?x=1", body)
    assert status == 200
    assert answer["body"].encode() == body
    assert answer["path"] == "/v1/models/mnist/versions/2:predict?x=1"
    assert answer["type"] == "application/json"
    seen = [post(f"{front.url}/v2/models/m/infer", b"{}")[1]["replica"] for _ in range(10)]
    assert seen.count("replica:0") == seen.count("replica:1") == 5   # one client at a time: turns
    assert TOKEN not in front.log()


def test_a_replica_killed_under_load_costs_no_request(front):
    front.replica(0, delay=0.05)
    front.replica(1, delay=0.05)
    assert wait_until(lambda: in_rotation(front, "replica:0", "replica:1"), timeout=30)
    results = []

    def client(n: int) -> None:
        for i in range(40):
            results.append(post(f"{front.url}/v1/models/m:predict", json.dumps({"n": n, "i": i}).encode()))

    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(client, n) for n in range(8)]
        assert wait_until(lambda: len(results) >= 40, timeout=60)
        front.replicas["replica:1"].kill()
        for future in running:
            future.result()
    assert [status for status, _ in results] == [200] * 320
    assert {answer["replica"] for _, answer in results[-40:]} == {"replica:0"}
    assert "replica:1 (127.0.0.1:" in front.log() and "out: " in front.log()


@pytest.mark.caffe
def test_real_replicas_behind_the_router_answer_as_pycaffe_and_a_kill_9_costs_no_request(front, tmp_path):
    from test_serving import LENET, MAKE, caffe_python, images, in_process, start_replica

    folder = tmp_path / "lenet"
    folder.mkdir()
    (folder / "deploy.prototxt").write_text(LENET)
    subprocess.run([caffe_python(), "-c", MAKE], cwd=folder, check=True, capture_output=True,
                   env={**os.environ, "GLOG_minloglevel": "2"})
    for idx in range(2):
        proc, url, _ = start_replica(folder, env={router.TOKEN_ENV: TOKEN})
        front.replicas[f"replica:{idx}"] = proc
        front.tell(f"up replica:{idx} {url.removeprefix('http://')}")
    rows = images(2)
    want = in_process(folder, rows)
    body = json.dumps({"instances": rows}).encode()
    assert wait_until(lambda: "replica:1 (" in front.log() and "replica:0 (" in front.log(), timeout=60)
    results = []

    def client() -> None:
        for _ in range(15):
            results.append(post(f"{front.url}/v1/models/lenet:predict", body))

    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(client) for _ in range(8)]
        assert wait_until(lambda: len(results) >= 20, timeout=120)
        front.replicas["replica:1"].kill()
        for future in running:
            future.result()
    assert [status for status, _ in results] == [200] * 120
    for _, answer in results:
        assert np.allclose(np.array(answer["predictions"]), np.array(want), atol=1e-6)


def test_a_replica_failing_its_health_check_is_taken_out_and_back(front):
    front.replica(0)
    front.replica(1)
    assert wait_until(lambda: in_rotation(front, "replica:0", "replica:1"), timeout=30)
    (front.tmp / "sick1").touch()
    assert wait_until(lambda: "replica:1 (127.0.0.1:" in front.log() and "out: health" in front.log(), timeout=30)
    assert {post(f"{front.url}/v1/models/m:predict", b"{}")[1]["replica"] for _ in range(6)} == {"replica:0"}
    (front.tmp / "sick1").unlink()
    assert wait_until(lambda: in_rotation(front, "replica:1"), timeout=30)


def test_down_takes_a_replica_out_at_once(front):
    front.replica(0)
    front.replica(1)
    assert wait_until(lambda: in_rotation(front, "replica:0", "replica:1"), timeout=30)
    front.tell("down replica:1")
    assert wait_until(lambda: "replica:1 (127.0.0.1:" in front.log(), timeout=30)
    assert {post(f"{front.url}/v1/models/m:predict", b"{}")[1]["replica"] for _ in range(6)} == {"replica:0"}


def test_no_ready_replica_is_503_in_the_protocols_form(front):
    status, answer = post(f"{front.url}/v1/models/m:predict", b"{}")
    assert status == 503 and "no replica" in answer["error"]


def test_a_request_waits_for_a_replica_that_comes_up(front):
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(post, f"{front.url}/v1/models/m:predict", b"{}")
        front.replica(0)
        assert asked.result() == (200, {"replica": "replica:0", "body": "{}", "path": "/v1/models/m:predict",
                                        "type": "application/json"})


def test_the_router_ends_when_the_masters_pipe_closes(front):
    ref = front.proc.ref
    assert is_alive(ref.pid, ref.start)
    front.proc.stdin.close()
    assert wait_until(lambda: not processes_in({ref.pgid}), timeout=30), front.log()
    assert "the master closed its pipe" in front.log()


def test_the_one_stop_path_ends_the_router(front):
    ref = front.proc.ref
    assert spawn.stop_router(ref, 5.0)
    assert not processes_in({ref.pgid})
    assert not spawn.stop_router(ref, 5.0)   # gone: nothing of ours to signal


# -- `pai serve scale` refusals (a serving job scales: tests/test_serving_router.py) ----


def test_scaling_a_job_that_is_not_a_service_is_refused_in_one_line(pai_home):
    from conftest import BEHAVE, pai

    assert pai("serve", "scale", "nosuch", "2").returncode == 2
    job_id = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "sleep:600"}).stdout.strip()
    try:
        result = pai("serve", "scale", job_id, "2")
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"pai: error: job {job_id} (behave) is a python job, not a service; only a serving job scales"]
        assert pai("serve", "scale", job_id, "0").returncode == 2     # at least one replica
    finally:
        pai("kill", job_id)


# -- where a service shows its URL and its request metrics ------------------------------


def record_service(tmp_path: Path, front: dict | None):
    from paicli.store import Store

    store = Store(tmp_path / "home")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    plan = JobPlan("serve", "serving", "serve", [RolePlan("replica", 1, ["x"])], front=front)
    (job_dir / "plan.json").write_text(plan.to_json())
    store.create_job("2026s", name="mnist", framework="serving", project=None, task_name="serve", job_dir=job_dir,
                     roles=[{"name": "replica", "count": 1, "must_finish": True}])
    return store


def test_a_live_service_has_its_url_and_no_other_job_has_one(tmp_path):
    from paicli import jobstatus
    from paicli.states import JobStatus

    store = record_service(tmp_path, {"host": "127.0.0.1", "port": 8501, "role": "replica"})
    assert jobstatus.service_url(store.job("2026s")) == "http://127.0.0.1:8501"
    store.set_job("2026s", JobStatus.RUNNING)
    store.set_job("2026s", JobStatus.CANCELLED, "cancelled by user")
    assert jobstatus.service_url(store.job("2026s")) is None     # ended: nothing answers there
    assert jobstatus.service_url(record_service(tmp_path / "other", None).job("2026s")) is None


def test_request_metrics_without_a_step_are_drawn_over_the_seconds_since_the_start(tmp_path):
    from paicli.states import JobStatus
    from paicli.web import data

    store = record_service(tmp_path, {"host": "127.0.0.1", "port": 8501, "role": "replica"})
    store.set_job("2026s", JobStatus.RUNNING)
    began = store.job("2026s")["started"]
    store.add_metrics([("2026s", "replica", 0, began + 1.5, None, "rps", 119.8),
                       ("2026s", "replica", 0, began + 1.5, None, "p99_ms", 3.4),
                       ("2026s", "worker", 0, began + 2.0, 7.0, "loss", 0.5)])
    points, _ = data.metric_points(store, "2026s")
    assert points == [["replica:0", "rps", 1.5, 119.8, "seconds"], ["replica:0", "p99_ms", 1.5, 3.4, "seconds"],
                      ["worker:0", "loss", 7.0, 0.5]]


def test_scaling_a_service_on_ray_is_refused_in_one_line(tmp_path):
    from paicli import client
    from paicli.cluster.backends import SNAPSHOT

    store = record_service(tmp_path, {"host": "127.0.0.1", "port": 8501, "role": "replica"})
    (tmp_path / "job" / SNAPSHOT).write_text(json.dumps({"backend": "ray", "address": "10.0.0.1:6379"}))
    with pytest.raises(UsageError) as err:
        client.scale(store, "mnist", 3)
    assert str(err.value).startswith("job 2026s (mnist) runs on Ray, where a serving job keeps the replicas")
    assert store.tasks("2026s")[0]["count"] == 1     # nothing asked of anyone


def test_a_client_token_is_asked_for_only_beyond_loopback_and_compared_whole():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("db.example")
    assert router.bearer_ok(None, None)
    assert router.bearer_ok("Bearer s3cret", "s3cret") and router.bearer_ok("bearer s3cret", "s3cret")
    for header in (None, "", "Bearer", "Bearer s3cre", "Bearer s3cretX", "Basic s3cret", "s3cret"):
        assert not router.bearer_ok(header, "s3cret"), header


def test_a_router_with_a_client_token_answers_401_without_it(tmp_path):
    fixture = Fixture(tmp_path, client_token="c1ient")
    try:
        fixture.replica(0)
        code, body = post(f"{fixture.url}/v1/models/m:predict", b"{}")
        assert code == 401 and "Authorization: Bearer" in body["error"]
        code, body = post(f"{fixture.url}/v1/models/m:predict", b"{}", headers={"Authorization": "Bearer wrong"})
        assert code == 401
        code, body = post(f"{fixture.url}/v1/models/m:predict", b"{}", headers={"Authorization": "Bearer c1ient"})
        assert code == 200 and body["replica"] == "replica:0"
    finally:
        fixture.close()
