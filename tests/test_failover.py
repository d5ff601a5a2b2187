"""The master's side of failover, on this machine: an instance whose node stops
answering (poll -> NODE_LOST) fails retryably and runs again on another node with
room, never that one again for this job; without room or retries the job fails
naming the node.

The two "nodes" are two loopback addresses of this machine (127.0.0.1 and
127.0.0.2) served by the real local backend; a node is lost when the test says so:
its processes are killed (as a dead host's would be) and polls answer NODE_LOST,
as the SSH and Ray backends do for a host that stops answering. The real thing
over network namespaces is tests/test_multihost.py's link-down test.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from conftest import BEHAVE, processes_in, wait_until
from paicli import client
from paicli.cluster import backends
from paicli.cluster.backends.base import NODE_LOST, NodeSpec
from paicli.cluster.backends.local import LocalBackend
from paicli.statement import parse_statement
from paicli.store import Store

LOST_DIR_ENV = "B_TEST_LOST_DIR"


class TwoLoopbackNodes(LocalBackend):
    name = "local"

    def __init__(self, config=None):
        super().__init__(config)
        self.lost_dir = Path(os.environ[LOST_DIR_ENV])

    def nodes(self):
        return [NodeSpec("n1", "127.0.0.1", 200, 8000), NodeSpec("n2", "127.0.0.2", 200, 5000)]

    def _lost(self, node: str) -> bool:
        return (self.lost_dir / node).exists()

    def poll(self, handle):
        if self._lost(handle.ref.node):
            try:
                os.killpg(handle.ref.pgid, signal.SIGKILL)  # a dead host takes its processes with it
            except ProcessLookupError:
                pass
            handle.native.wait(None)   # the agent reports the group gone
            return NODE_LOST
        return super().poll(handle)

    def wait(self, handle, timeout=None):
        code = super().wait(handle, timeout)
        return NODE_LOST if code is not None and self._lost(handle.ref.node) else code

    def _stop_refs(self, node, refs, timeout):
        return [] if self._lost(node) else super()._stop_refs(node, refs, timeout)


@pytest.fixture
def two_nodes(pai_home, tmp_path, monkeypatch):
    lost = tmp_path / "lost"
    lost.mkdir()
    monkeypatch.setenv(LOST_DIR_ENV, str(lost))
    # The master is forked from this process, so it builds the same backend.
    monkeypatch.setattr(backends, "get_backend", lambda config: TwoLoopbackNodes(config))
    monkeypatch.setenv("PAI_MASTER_EXEC", "")
    # ... which it is only from a single-threaded process (cluster/spawn.py): a
    # thread an earlier test left running would make it a fresh interpreter.
    assert wait_until(lambda: threading.active_count() == 1, timeout=5), \
        f"threads left in the test process: {[t.name for t in threading.enumerate()]}"
    return lost


def submit(*tokens: str, env: dict[str, str]) -> tuple[Store, str]:
    os.environ.update(env)
    store = Store()
    job_id = client.submit(client.prepare(parse_statement(list(tokens))), store)
    return store, job_id


def wait_over(store: Store, job_id: str, timeout: float = 60) -> dict:
    assert wait_until(lambda: client.job_over(store.job(job_id)), timeout=timeout)
    return client.status(store, job_id)


def test_instances_of_a_lost_node_run_again_on_the_other_node(two_nodes, tmp_path, monkeypatch):
    pidfile = tmp_path / "pids"
    for key, value in {"BEHAVE": f"pidfile:{pidfile},print:2,sleep:3,print:1", "SLEEP": "0.05"}.items():
        monkeypatch.setenv(key, value)
    store, job_id = submit("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2,"memory":2000}}',
                           env={})
    try:
        assert wait_until(lambda: pidfile.exists() and len(pidfile.read_text().splitlines()) == 2, timeout=20)
        first = client.status(store, job_id)
        assert {i["node"] for i in first["instances"]} == {"n1"}  # bin-packed on the first node
        (two_nodes / "n1").touch()
        status = wait_over(store, job_id)
        assert status["status"] == "Succeeded", status["reason"]
        assert {(i["node"], i["host"]) for i in status["instances"]} == {("n2", "127.0.0.2")}
        assert all(i["attempts"] == 2 for i in status["instances"])
        events = [(e["kind"], e["message"]) for e in store.events(job_id)]
        assert ("node-lost", "worker:0: node n1 stopped answering") in events
        assert ("moved", "worker:1: n1 -> n2") in events
        # the lost attempt names the node it was lost with, not the one it moved to
        assert ("instance", "Waiting: lost with its node n1, job restart 1") in events, events
        log = (Path(status["job_dir"]) / "job.log").read_text()
        assert "worker:0 lost with its node n1; restarting the whole job (retry 1 of 3)" in log
        placements = json.loads((Path(status["job_dir"]) / "placement.json").read_text())
        assert {p["node"] for p in placements} == {"n2"}
    finally:
        client.kill(store, job_id)
    groups = {int(line.split()[2]) for line in pidfile.read_text().splitlines()}
    assert wait_until(lambda: processes_in(groups) == [], timeout=5)


def test_without_room_elsewhere_the_job_fails_naming_the_node(two_nodes, tmp_path, monkeypatch):
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("BEHAVE", f"pidfile:{pidfile},print:1,sleep:30")
    # Two workers of 3000 MB: n2 (5000 MB) cannot take both.
    store, job_id = submit("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2,"memory":3000}}',
                           env={})
    try:
        assert wait_until(lambda: pidfile.exists() and len(pidfile.read_text().splitlines()) == 2, timeout=20)
        (two_nodes / "n1").touch()
        status = wait_over(store, job_id)
        assert status["status"] == "Failed"
        assert "lost node n1" in status["reason"] or "lost with its node n1" in status["reason"], status["reason"]
        assert "no other node has room" in status["reason"]
    finally:
        client.kill(store, job_id)


def test_an_instance_no_other_node_can_take_fails_naming_the_node_it_was_lost_with(two_nodes, tmp_path,
                                                                                     monkeypatch):
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("BEHAVE", f"pidfile:{pidfile},print:1,sleep:30")
    # 6000 MB: only n1 (8000 MB) can hold it.
    store, job_id = submit("-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":1,"memory":6000}}',
                           env={})
    try:
        assert wait_until(lambda: pidfile.exists(), timeout=20)
        (two_nodes / "n1").touch()
        status = wait_over(store, job_id)
        assert status["status"] == "Failed" and "no other node has room" in status["reason"], status["reason"]
        rows = [e["message"] for e in store.events(job_id) if e["kind"] == "instance"]
        assert "Failed: lost with its node n1" in rows, rows
    finally:
        client.kill(store, job_id)


def test_without_retries_the_job_fails_naming_the_node(two_nodes, tmp_path, monkeypatch):
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("BEHAVE", f"pidfile:{pidfile},print:1,sleep:30")
    store, job_id = submit("-name", "python", f"-Dscript={BEHAVE}", "-DmaxRetries=0", env={})
    try:
        assert wait_until(lambda: pidfile.exists(), timeout=20)
        (two_nodes / "n1").touch()
        status = wait_over(store, job_id)
        assert status["status"] == "Failed"
        assert status["reason"].startswith("worker:0 lost with its node n1 (no retries left of 0)")
    finally:
        client.kill(store, job_id)
