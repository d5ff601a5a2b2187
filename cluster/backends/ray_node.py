"""What runs ON a Ray node for the Ray backend: standard library only.

ray.py wraps `InstanceActor` with `ray.remote` and ships this module by value, so
a Ray node needs Ray and nothing of paicli. One actor per instance, in its bundle:

- `stage()`, `ensure_runtime()` and `pick_ports()`: the job's folder, its runtime
  and free ports on the node, with the node programs an SSH node runs;
- `open()` starts the node agent (runners/node_agent.py) and the actor relays
  bytes: `send()` to the agent's stdin, `recv()` from its stdout. When the actor
  dies the agent, in a session of its own out of reach of Ray's clean-up, reads
  EOF and stops the instance.

A process that holds no link (`pai kill`, the watchdog) stops instances with
node_agent.stop_refs, run on the node by a task pinned to it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading

from paicli.runners import node_agent, node_info, node_outputs, private_files, stage_writer

MAX_BUFFERED = 1 << 20   # agent output held in the actor before the agent is made to wait


def ship_by_value(cloudpickle) -> None:
    """Register what goes to Ray nodes by value: this module and the node agent's
    functions it uses (a Ray node needs Ray, not paicli)."""
    for module in (sys.modules[__name__], node_agent, node_info, node_outputs, private_files, stage_writer):
        cloudpickle.register_pickle_by_value(module)


def user_root() -> str:
    """Where this user's per-job folders go on a node (see job_folder)."""
    return os.path.join(tempfile.gettempdir(), f"paicli-ray-{os.getuid()}")


def job_folder(job_id: str, node_id: str) -> str:
    """The per-job folder on a node: under the node's temporary directory, one per
    (user, node), so that nodes sharing a filesystem never share it."""
    return os.path.join(user_root(), node_id[:16], job_id)


def _node_env() -> dict[str, str]:
    # What the agent and the provisioning inherit: not the Ray worker's own settings.
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


class InstanceActor:
    """One instance on one node (see the module docstring). `recv()` blocks while
    `send()` may be called, so the actor is created with max_concurrency > 1."""

    def __init__(self, job_id: str, label: str, node_id: str):
        self.label = label                  # JOB/role:idx, as the node agent shows it
        self.node_ip = ""
        if not node_id:   # inside a Ray worker: ask Ray where we are
            import ray

            node_id = ray.get_runtime_context().get_node_id()
            self.node_ip = ray.util.get_node_ip_address()
        self.node_id = node_id
        self.folder = job_folder(job_id, node_id)
        self.agent: subprocess.Popen | None = None
        self.buf = bytearray()
        self.eof = False
        self.cond = threading.Condition()

    # -- about the node ---------------------------------------------------------

    def info(self) -> dict:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return {"boot_id": node_agent.boot_id(), "python": sys.executable, "folder": self.folder,
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "hostname": socket.gethostname(),
                "node_id": self.node_id, "node_ip": self.node_ip,
                "runtime_dir": os.path.expanduser(os.environ.get("PAI_RUNTIME_DIR") or
                                                  os.path.join(cache, "paicli", "runtimes"))}

    def stage(self, tar: bytes) -> dict:
        """Write the staging list (a tar stream) with the node writer every backend
        uses (runners/stage_writer.py: a root of ours alone, files 0600/0700 created
        anew, links only inside). {"folder": ...}, or {"error": one line}."""
        try:
            if self.folder.startswith(user_root() + os.sep):
                # In a shared /tmp anyone may create the root first, and whoever can
                # write there could swap a job's folder (and its node agent) for theirs.
                stage_writer.check_root(user_root(), node_agent.root_fault)
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as archive:
                stage_writer.write(archive, self.folder)
        except (OSError, ValueError, tarfile.TarError, stage_writer.Refused) as err:
            return {"error": str(err)}
        return {"folder": self.folder}

    def ensure_runtime(self, name: str | None, layer: dict | None = None) -> dict:
        """The interpreter of runtime `name` on this node, provisioned here on first
        use by the staged runners/node_runtime.py (as on an SSH node); {"error": ...}
        when it cannot be. With `layer` (cluster/requirement_layers.py: layer_spec), the job's
        requirements layer is built here too (cached by digest): {"error": one line,
        "pip_log": ...} when pip cannot. "lines": the phases (not the tools' lines)."""
        got = self._node_runtime("runtime", name) if name else {"python": sys.executable, "lines": []}
        if not layer or "error" in got:
            return got
        links = {}
        for i, (local, items) in enumerate(sorted(layer.get("files", {}).items())):
            folder = os.path.join(self.folder, "layer-links", str(i))
            os.makedirs(folder, mode=0o700, exist_ok=True)
            for fname, data in items:
                if "/" in fname or fname.startswith("."):
                    continue
                with open(os.open(os.path.join(folder, fname), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                          "wb") as fh:
                    fh.write(data)
            links[local] = folder
        spec = {"base": layer["base"], "python": got["python"], "digest": layer["digest"],
                "lines": layer["lines"], "pins": layer["pins"], "links": links}
        built = self._node_runtime("layer", json.dumps(spec))
        return {**built, "python": got["python"], "lines": got["lines"] + built["lines"]}

    def _node_runtime(self, command: str, arg: str) -> dict:
        """`runners/node_runtime.py COMMAND ARG` of the staged folder: its result, its
        phase lines, or {"error": its one line, "pip_log": what follows}."""
        result = subprocess.run([sys.executable, os.path.join(self.folder, "runners", "node_runtime.py"), command, arg],
                                capture_output=True, text=True, env=_node_env(), start_new_session=True)
        lines = result.stdout.splitlines()
        failed = next((i for i, line in enumerate(lines) if line.startswith("ERROR ")), None)
        if failed is not None:
            got = {"error": lines[failed][len("ERROR "):],
                   "lines": [x for x in lines[:failed] if not x.startswith("  ")]}
            if command == "layer":   # what follows is pip's log (ray.py names it, kept in the job folder)
                got["pip_log"] = "\n".join(lines[failed + 1:]) + "\n"
            return got
        try:
            return {**json.loads(lines[-1]), "lines": [x for x in lines[:-1] if not x.startswith("  ")]}
        except (IndexError, ValueError):
            return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1], "lines": lines}

    def pick_ports(self, count: int, taken=()) -> list[int]:
        """Ports this node can bind now (on every address), none in `taken`."""
        return node_agent.free_ports("0.0.0.0", count, set(taken))

    # -- the relay to one node agent --------------------------------------------------

    def open(self) -> int:
        """Start a node agent for the instance (a restart on this node: a new one;
        the last one's stdin is closed, which stops whatever it left). Its pid: what
        close() is given, so that a late close of the last link spares this one."""
        self.close()
        agent = subprocess.Popen(
            [sys.executable, os.path.join(self.folder, "runners", "node_agent.py"), "run", self.label],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
            env=_node_env(), start_new_session=True, close_fds=True)
        with self.cond:
            # One step under the lock: the last agent's pump, which may still hold
            # its EOF, sees it is no longer the owner before the buffer is reset.
            self.agent = agent
            self.buf.clear()
            self.eof = False
        threading.Thread(target=self._pump, args=(agent,), daemon=True).start()
        return agent.pid

    def _pump(self, agent: subprocess.Popen) -> None:
        fd = agent.stdout.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            with self.cond:
                while agent is self.agent and data and len(self.buf) > MAX_BUFFERED:
                    self.cond.wait(0.5)
                if agent is self.agent:     # else a newer agent owns the buffer: drop, drain
                    self.buf += data
                    self.eof = not data
                    self.cond.notify_all()
            if not data:
                agent.wait()
                return

    def send(self, data: bytes) -> None:
        """Bytes to the agent's stdin; OSError once the agent is gone."""
        if self.agent is None:
            raise BrokenPipeError("no node agent")
        self.agent.stdin.write(data)

    def recv(self, max_bytes: int, wait: float) -> bytes | None:
        """Up to `max_bytes` of the agent's output, waiting up to `wait` seconds for
        some; b"" once it ended, None when nothing came meanwhile."""
        with self.cond:
            if not self.buf and not self.eof:
                self.cond.wait(wait)
            if self.buf:
                data = bytes(self.buf[:max_bytes])
                del self.buf[:max_bytes]
                self.cond.notify_all()
                return data
            return b"" if self.eof else None

    def close(self, pid: int = 0) -> None:
        """Close the agent's stdin (the agent `pid`'s, if given): it stops whatever
        is left of the group."""
        if self.agent is not None and self.agent.stdin and pid in (0, self.agent.pid):
            try:
                self.agent.stdin.close()
            except OSError:
                pass

    def cleanup(self) -> None:
        """Remove this job's folder on the node."""
        remove_job_folder(self.folder)


def remove_job_folder(folder: str) -> None:
    """The job's folder, and its node's folder once no job is left in it."""
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


def pinned_collect(job_id: str, state_rel: str, request: dict) -> bytes:
    """node_outputs' `collect` of an instance's files on this node (cluster/outputs.py),
    as one byte string of frames."""
    import ray

    folder = job_folder(job_id, ray.get_runtime_context().get_node_id())
    return node_outputs.frame_bytes(node_outputs.collect(dict(request, state=os.path.join(folder, state_rel))))
