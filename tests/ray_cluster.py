"""A real Ray cluster for tests and benchmarks: a head and worker nodes started
with `ray start`, each in its own network namespace of the multi-host harness
(tests/netns.py: veth pairs on a bridge, addresses that exist only inside this
sandbox).

    with RayCluster(prefix="fray", subnet="10.213.9") as ray_cluster:
        ray_cluster.address            # "10.213.9.11:6379", the head's GCS
        ray_cluster.run_argv(["pai", ...])  # a command on the head node (the driver's machine)
        ray_cluster.stop_node("h3")    # the node dies (every Ray process on it killed)
        ray_cluster.start_node("h3")   # and comes back

Each node: `--num-cpus=1 --include-dashboard=false --disable-usage-stats`, its own
`--temp-dir` (session folders, sockets and logs never collide between nodes that
share this machine's filesystem), a small object store, and Ray's health checks
tightened so that a dead node is declared dead within a few seconds. The nodes'
TMPDIR is the cluster's state folder too (`node_tmp`): what paicli keeps on a node
beside its job folders (the node's cache, TMP/paicli-ray-UID/NODE/.cache) goes with
the cluster instead of staying in this machine's /tmp after every test.

`ray stop` is NOT used: it finds Ray's processes by name on the whole machine, so
run in one namespace it would stop every node here (and any other Ray on the
machine). A node is stopped by killing the processes of its own namespace.
Teardown (also at exit, and on a failed start) kills every process in the
namespaces, then removes them, the bridge and the state folder.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from netns import CLUSTER_PREFIX, STATE_ROOT, TestCluster, _default_signals, can_build

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
GCS_PORT = 6379
CLIENT_PORT = 10001
# A dead node is declared dead after about period * threshold (+ timeout).
# A test Ray node's TMPDIR, in its cluster's state folder (gone with the teardown).
NODE_TMP = "tmp"
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
               "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}


def node_job_folders(job_id: str) -> list[str]:
    """The job's per-job folders on the test clusters' Ray nodes (under each node's
    TMPDIR, the cluster's `node_tmp`)."""
    return glob.glob(f"{STATE_ROOT}/{CLUSTER_PREFIX}*/{NODE_TMP}/paicli-ray-{os.getuid()}/*/{job_id}")


def ray_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "the Ray tests need Ray: pip install 'paicli[ray]' (the test extra has it)"
    if not os.path.exists(RAY):
        return f"the Ray tests need the ray command next to {sys.executable}"
    return None


def cannot_run() -> str | None:
    return ray_missing() or can_build()


class RayCluster:
    __test__ = False

    def __init__(self, prefix: str = "fray", subnet: str = "10.213.9", nodes: int = 3, cpus: int = 1,
                 gpus: dict[str, int] | None = None):
        self.net = TestCluster(prefix=prefix, hosts=nodes, subnet=subnet)
        self.cpus = cpus
        # GPUs Ray is told a node has (`--num-gpus`): Ray's own accounting and
        # CUDA_VISIBLE_DEVICES, with no card behind them on this machine.
        self.gpus = dict(gpus or {})
        self.started: dict[str, float] = {}       # node -> seconds its `ray start` took

    # -- build ------------------------------------------------------------------

    def __enter__(self) -> "RayCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def head(self):
        return self.net.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.addr}:{GCS_PORT}"

    @property
    def client_address(self) -> str:
        return f"ray://{self.head.addr}:{CLIENT_PORT}"

    @property
    def node_tmp(self) -> Path:
        return self.net.state / NODE_TMP

    def start(self) -> None:
        self.net.start()
        self.node_tmp.mkdir(mode=0o700, exist_ok=True)
        self.start_node(self.head.name)
        errors: list[BaseException] = []

        def start(name: str) -> None:
            try:
                self.start_node(name)
            except BaseException as err:  # noqa: BLE001 - raised below, in this thread
                errors.append(err)

        threads = [threading.Thread(target=start, args=(h.name,)) for h in self.net.hosts[1:]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        self.wait_nodes(len(self.net.hosts))

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(FAST_HEALTH)
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        env["TMPDIR"] = str(self.node_tmp)   # the raylet's, and so its workers' (see node_job_folders)
        return env

    def temp_dir(self, name: str) -> Path:
        return self.net.state / name / "ray"

    def start_node(self, name: str) -> float:
        """`ray start` on node `name` (the head when it is the first host); the
        seconds it took."""
        host = self.net.host(name)
        temp = self.temp_dir(name)
        temp.mkdir(parents=True, exist_ok=True)
        argv = [RAY, "start", f"--node-ip-address={host.addr}", f"--num-cpus={self.cpus}", f"--num-gpus={self.gpus.get(name, 0)}",
                "--disable-usage-stats", f"--temp-dir={temp}", "--object-store-memory=100000000"]
        if host is self.head:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false",
                     f"--ray-client-server-port={CLIENT_PORT}"]
        else:
            argv += [f"--address={self.address}"]
        began = time.monotonic()
        log = self.net.state / name / "ray-start.log"
        with open(log, "ab") as out:
            code = subprocess.run(host.exec_argv(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                  env=self._env(), timeout=120, start_new_session=True,
                                  preexec_fn=_default_signals).returncode
        if code != 0:
            raise RuntimeError(f"ray start on {name} failed ({code}): {log.read_text()[-1500:]}")
        self.started[name] = time.monotonic() - began
        return self.started[name]

    def wait_nodes(self, count: int, timeout: float = 60.0) -> None:
        """Until the head sees `count` live nodes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_nodes() == count:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Ray cluster has {self.alive_nodes()} live nodes, not {count}")

    def alive_nodes(self) -> int:
        code = ("import ray, logging; ray.init(address=%r, logging_level=logging.ERROR, log_to_driver=False); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))" % self.address)
        out = self.run([sys.executable, "-c", code], timeout=60)
        try:
            return int(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return -1

    # -- use --------------------------------------------------------------------

    def exec_argv(self, argv: list[str], node: str | None = None) -> list[str]:
        """`argv` run on a node (the head by default): inside its network namespace."""
        host = self.net.host(node) if node else self.head
        return host.exec_argv(argv)

    def run(self, argv: list[str], node: str | None = None, env: dict | None = None, timeout: float = 300,
            **kw) -> subprocess.CompletedProcess:
        full = dict(os.environ)
        full.update(env or {})
        kw.setdefault("preexec_fn", _default_signals)   # whatever the shell that started the tests ignores
        return subprocess.run(self.exec_argv(argv, node), capture_output=True, text=True, env=full,
                              timeout=timeout, **kw)

    def ray_pids(self, name: str) -> list[int]:
        """Processes on node `name` other than its sshd: Ray's and whatever runs there."""
        return [pid for pid, _ in self.net.leftovers(name)]

    def stop_node(self, name: str) -> None:
        """The node dies: every process in its namespace but the harness's sshd is
        killed (SIGKILL, as a power cut would)."""
        for _ in range(50):
            pids = self.ray_pids(name)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        for host in list(self.net.hosts):
            try:
                self.stop_node(host.name)
            except Exception:  # noqa: BLE001 - close() below kills what is left
                pass
        self.net.close()   # the namespaces, and the state folder with each node's Ray temp dir


def job_processes(job_id: str) -> list[tuple[int, str]]:
    """Live processes anywhere on this machine (every namespace node included)
    whose environment says they belong to paicli job `job_id`."""
    found = []
    needle = f"PAI_JOB_ID={job_id}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in environ and state != b"Z":
            found.append((int(name), cmd.strip()))
    return found
