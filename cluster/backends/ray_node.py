"""What runs ON a Ray node for the Ray backend: standard library only.

The Ray backend (ray.py) wraps `InstanceActor` with `ray.remote` and ships this
module to the cluster by value (cloudpickle), so a Ray node needs Ray and
nothing of paicli. One actor per instance, in the instance's placement-group
bundle:

- `stage()` writes what the instance needs (the runners, the job folder's code
  and plan files, a script that lives outside it) into a per-job folder on its
  node (0700 folders, 0600 files); `ensure_runtime()` provisions the framework
  runtime there on first use with the shipped runners/runtimes.py (or finds the
  node's own); `pick_ports()` finds ports free on the node;
- `start()` runs the instance under the paicli node agent (runners/node_agent.py,
  the same agent the SSH backend uses): the agent starts it in a session of its
  own with default signal dispositions, reports its identity, streams its output
  and its exit status, and stops its whole group when its stdin closes. The
  actor holds that stdin: when the actor dies (the master died and Ray killed
  the actors it owned, `ray stop`, a crash) the agent stops the instance.
  The agent runs in a session of its own, out of reach of Ray's clean-up of the
  worker's process group, so it always lives to do that;
- `read()` hands the output to the master, with the exit status at the end.

Stopping from any process is `stop_ref()`: the node agent's identity-checked
stop (pid + start time + boot id, see cluster/backends/base.py), run on the node
by the actor or by a task pinned to the node. The identity check, group members,
boot id and free ports are the node agent's own functions (one implementation for
SSH and Ray nodes), shipped by value with this module (`ship_by_value`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

from paicli.runners import node_agent
from paicli.runners.node_agent import boot_id
from paicli.runners.node_agent import free_ports as _agent_free_ports

def ship_by_value(cloudpickle) -> None:
    """Register what goes to Ray nodes by value: this module and the node agent's
    functions it uses (a Ray node needs Ray, not paicli)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(node_agent)


MAX_BUFFERED = 1 << 20   # output held in the actor before the agent is made to wait


def _as_list(ref: dict) -> list:
    """The node agent's form of a ref: [pid, pgid, start, boot]."""
    return [ref["pid"], ref["pgid"], ref.get("start") or "", ref.get("boot_id") or ""]


def is_ours(ref: dict) -> bool:
    """`ref` ({pid, pgid, start, boot_id}) still names the group we started here:
    the node agent's check (same boot; the leader gone, or the process that
    started at the recorded time and still leads that group)."""
    return node_agent.is_ours(_as_list(ref))


def signal_ref(ref: dict, signum: int) -> bool:
    return node_agent.signal_ref(_as_list(ref), signum)


def alive_ref(ref: dict) -> bool:
    return node_agent.alive(_as_list(ref))


def stop_ref(ref: dict, timeout: float) -> bool:
    """THE stop on a node (the node agent's stop_refs): identity check, SIGTERM to
    the group, up to `timeout` seconds, SIGKILL. True when the group was ours and
    was signalled."""
    return bool(node_agent.stop_refs([_as_list(ref)], timeout))


def free_ports(count: int, taken=()) -> list[int]:
    """`count` distinct ports this node can bind now (on every address), none in `taken`."""
    ports = _agent_free_ports("0.0.0.0", count, {int(p) for p in taken})
    if len(ports) != count:
        raise OSError(f"could not find {count} free ports")
    return ports


def user_root() -> str:
    """Where this user's per-job folders go on a node (see job_folder)."""
    return os.path.join(tempfile.gettempdir(), f"paicli-ray-{os.getuid()}")


def job_folder(job_id: str, node_id: str) -> str:
    """The per-job folder on a node: under the node's temporary directory, one per
    (user, node), so that nodes sharing a filesystem never share it."""
    return os.path.join(user_root(), node_id[:16], job_id)


def own_root(path: str) -> None:
    """`path` exists (made 0700 if missing) and is ours alone: a directory, not a
    link, owned by us, not writable by others. In a shared /tmp anyone may create
    it first; whoever could write there could swap a job's folder (and the node
    agent in it) for theirs. PermissionError naming what is wrong."""
    private_dirs(path)
    st = os.lstat(path)
    what = node_agent.root_fault(st.st_mode, st.st_uid, os.getuid())
    if what is None:
        return
    raise PermissionError(f"the per-job folder root {path} is {what}; refused (remove it on the node)")


def private_dirs(path: str) -> None:
    """Create `path` and its missing parents 0700, whatever the umask."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        os.chmod(folder, 0o700)


def write_files(root: str, files: dict[str, bytes], executable=()) -> None:
    """Write {relative path: content} under `root` (0700 folders, 0600 files,
    0700 for `executable`), each file whole or absent (written aside, renamed)."""
    private_dirs(root)
    real_root = os.path.realpath(root)
    for rel, data in files.items():
        path = os.path.realpath(os.path.join(root, rel))
        if not path.startswith(real_root + os.sep):
            raise ValueError(f"refusing to write outside the job folder: {rel!r}")
        private_dirs(os.path.dirname(path))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700 if rel in executable else 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


class InstanceActor:
    """One instance on one node (see the module docstring). The master calls it
    through Ray; `read()` blocks while `stop()` may be called, so the actor is
    created with max_concurrency > 1."""

    def __init__(self, job_id: str, label: str, node_id: str):
        self.job_id = job_id
        self.label = label                  # JOB/role:idx, as the node agent shows it
        self.node_ip = ""
        if not node_id:   # inside a Ray worker: ask Ray where we are
            import ray

            node_id = ray.get_runtime_context().get_node_id()
            self.node_ip = ray.util.get_node_ip_address()
        self.node_id = node_id
        self.folder = job_folder(job_id, node_id)
        self.agent: subprocess.Popen | None = None
        self.ref: dict | None = None
        self.status: int | None = None
        self.ended = False
        self.buf = bytearray()
        self.cond = threading.Condition()

    # -- about the node ---------------------------------------------------------

    def info(self) -> dict:
        return {"pid": os.getpid(), "boot_id": boot_id(), "python": sys.executable, "folder": self.folder,
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "hostname": socket.gethostname(),
                "node_id": self.node_id, "node_ip": self.node_ip}

    def stage(self, files: dict[str, bytes], executable=()) -> dict:
        """{"folder": ...}, or {"error": one line} when the node's folder is not safe
        to use or cannot be written."""
        try:
            if self.folder.startswith(user_root() + os.sep):
                own_root(user_root())
            write_files(self.folder, files, executable)
        except (OSError, ValueError) as err:
            return {"error": str(err)}
        return {"folder": self.folder}

    def ensure_runtime(self, name: str | None) -> dict:
        """The interpreter of runtime `name` on this node, provisioned here on first
        use by the shipped runtimes code (pkg/paicli/runners, run in a process of
        its own); {"error": ...} when it cannot be."""
        if not name:
            return {"python": sys.executable, "lines": []}
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
                "from paicli.runners.runtimes import get_runtime; "
                "rt = get_runtime(sys.argv[2]); rt.ensure(lambda line: print(line, flush=True)); "
                "print(json.dumps({'python': rt.python()}))")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        result = subprocess.run([sys.executable, "-c", code, os.path.join(self.folder, "pkg"), name],
                                capture_output=True, text=True, env=env, start_new_session=True)
        lines = result.stdout.splitlines()
        if result.returncode == 0 and lines:
            try:
                return {"python": json.loads(lines[-1])["python"], "lines": lines[:-1]}
            except (ValueError, KeyError):
                pass
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": last, "lines": lines}

    def pick_ports(self, count: int, taken=()) -> list[int]:
        return free_ports(count, taken)

    # -- one instance ---------------------------------------------------------------

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None) -> dict:
        """Start the instance under the node agent. Its identity {pid, pgid, start,
        boot_id}, or {"error": message} when it could not start."""
        with self.cond:
            if self.agent is not None and not self.ended:
                return {"error": "this actor's instance is still running"}
            # A restart on the same node: the last run is over; start afresh.
            self.release()
            self.ref, self.status, self.ended = None, None, False
            self.buf.clear()
        agent_path = os.path.join(self.folder, "runners", "node_agent.py")
        agent_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.agent = subprocess.Popen(
            [sys.executable, agent_path, "run", self.label],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=agent_env, start_new_session=True, close_fds=True)
        spec = {"argv": list(argv), "env": dict(env), "cwd": cwd, "heartbeat": 0}
        self.agent.stdin.write((json.dumps(spec) + "\n").encode())
        self.agent.stdin.flush()
        first = threading.Event()
        threading.Thread(target=self._frames, args=(first,), daemon=True).start()
        first.wait(30)
        with self.cond:
            if self.ref is not None:
                return dict(self.ref)
            text = bytes(self.buf).decode(errors="replace").strip()
        return {"error": text or "the node agent did not start", "status": self.status}

    def _frames(self, first: threading.Event) -> None:
        out = self.agent.stdout
        try:
            while True:
                head = out.read(5)
                if len(head) < 5:
                    break
                kind, size = head[:1], struct.unpack(">I", head[1:])[0]
                payload = out.read(size) if size else b""
                with self.cond:
                    if kind == b"I":
                        ident = json.loads(payload)
                        self.ref = {"pid": ident["pid"], "pgid": ident["pgid"], "start": ident.get("start"),
                                    "boot_id": ident.get("boot") or boot_id()}
                        first.set()
                    elif kind == b"O":
                        while len(self.buf) > MAX_BUFFERED and not self.ended:
                            self.cond.wait(0.5)
                        self.buf += payload
                    elif kind == b"X":
                        self.status = int(json.loads(payload)["status"])
                    self.cond.notify_all()
        finally:
            with self.cond:
                if self.status is None:
                    self.status = -int(signal.SIGKILL)   # the agent died without a word
                self.ended = True
                self.cond.notify_all()
            first.set()

    def read(self, wait: float = 0.5) -> tuple[bytes, int | None, bool]:
        """(output since the last read, exit status or None, nothing more will come).
        Blocks up to `wait` seconds for something to say."""
        with self.cond:
            if not self.buf and not self.ended:
                self.cond.wait(wait)
            data = bytes(self.buf)
            self.buf.clear()
            self.cond.notify_all()
            return data, (self.status if self.ended else None), self.ended

    def stop(self, timeout: float) -> bool:
        return stop_ref(self.ref, timeout) if self.ref else False

    def signal(self, signum: int) -> bool:
        return signal_ref(self.ref, signum) if self.ref else False

    def alive(self) -> bool:
        return alive_ref(self.ref) if self.ref else False

    def release(self) -> None:
        """Close the agent's stdin: it stops whatever is left of the group."""
        if self.agent is not None and self.agent.stdin:
            try:
                self.agent.stdin.close()
            except OSError:
                pass

    def cleanup(self) -> None:
        """Remove this job's folder on the node."""
        remove_job_folder(self.folder)


def pinned_stop(ref: dict, timeout: float) -> bool:
    """Run on the instance's node by a pinned task (the watchdog, `pai kill`)."""
    return stop_ref(ref, timeout)


def pinned_signal(ref: dict, signum: int) -> bool:
    return signal_ref(ref, signum)


def pinned_alive(ref: dict) -> bool:
    return alive_ref(ref)


def pinned_ports(count: int, taken) -> list[int]:
    return free_ports(count, taken)


def pinned_info() -> dict:
    """The node agent's `info` (cores, memory, GPUs, Python, runtimes, the paicli
    instances agents run here), run on this node (the agent travels by value)."""
    return node_agent.info()


def remove_job_folder(folder: str) -> None:
    """The job's folder, and its node's folder once no job is left in it."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(folder))
    except OSError:
        pass   # other jobs' folders are there


def pinned_cleanup(job_id: str) -> None:
    """Run on a node by a task pinned to it (a backend that has no actor there:
    the watchdog after the master died)."""
    import ray

    remove_job_folder(job_folder(job_id, ray.get_runtime_context().get_node_id()))
