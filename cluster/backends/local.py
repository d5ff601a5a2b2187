"""Instances on this machine: a one-node cluster named "local".

Each instance runs under the node agent (runners/node_agent.py), as on an SSH
host or a Ray node; the transport is the agent's stdin and stdout, and the
master reads the agent's frames straight from that pipe (cluster/agent_link.py).
A dead master closes the agent's stdin, and the agent stops the instance's
group. The agents are started by prepare(), ahead of the instances, so a start
is one round trip on a pipe, not a new interpreter.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import threading

from paicli.cluster import agent_link
from paicli.cluster.backends.base import Backend, NodeSpec, agent_ref
from paicli.runners import node_agent

LOCAL_NODE = "local"
LOCAL_HOST = "127.0.0.1"
AGENT = os.path.join(os.path.dirname(node_agent.__file__), "node_agent.py")
START_TIMEOUT = 30.0
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# Small pipes keep a burst of output from sitting in the kernel behind other
# instances' lines (the display delay), at the price of the writer waiting sooner.
PIPE_BYTES = 4096
# Signals a shell, nohup or a CI runner may leave ignored (SIG_IGN survives exec).
IGNORABLE_SIGNALS = ("SIGINT", "SIGHUP", "SIGTERM", "SIGQUIT", "SIGPIPE", "SIGUSR1", "SIGUSR2",
                     "SIGTTIN", "SIGTTOU", "SIGTSTP")


def unignore_signals(keep: tuple[int, ...] = ()) -> None:
    """In the process that starts instances (the master), put every ignored
    signal back to its default so that children exec with default dispositions:
    an ignored signal stays ignored across exec, a caught one is reset. SIGPIPE,
    which Python ignores, is restored in the child by Popen (restore_signals).
    `keep`: signals the caller will catch itself right after."""
    for name in IGNORABLE_SIGNALS:
        signum = getattr(signal, name)
        if signum not in keep and signum != signal.SIGPIPE and signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)


def machine_cpu() -> int:
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) * 100


def local_node() -> NodeSpec:
    from paicli.cluster.scheduler import machine_gpus, machine_memory_mb

    return NodeSpec(LOCAL_NODE, LOCAL_HOST, machine_cpu(), machine_memory_mb(), tuple(machine_gpus()))


class AgentProcess:
    """A node agent on this machine, waiting for its spec; its stdin and stdout are
    the link. `fileno()`: the master reads the frames itself (agent_link)."""

    def __init__(self, label: str):
        # -I -S: the agent is stdlib only; no site, no user paths, a fast start.
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", AGENT, "run", label], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, close_fds=True)
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        try:
            fcntl.fcntl(self._out, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass

    def fileno(self) -> int:
        return self._out

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._in, view):]

    def recv(self, max_bytes: int, timeout: float) -> bytes:
        if not select.select([self._out], [], [], timeout)[0]:
            raise TimeoutError
        return os.read(self._out, max_bytes)

    def close(self) -> None:
        """The agent reads EOF and exits (stopping the group if it still runs)."""
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LocalBackend(Backend):
    name = "local"

    def __init__(self, config=None):
        super().__init__(config)
        self._warm: dict[tuple[str, int], AgentProcess] = {}
        self._lock = threading.Lock()

    def nodes(self):
        return [local_node()]

    def prepare(self, job_dir, plan, placements):
        job_id = os.path.basename(str(job_dir).rstrip("/"))
        for p in placements:
            agent = AgentProcess(f"{job_id}/{p.role}:{p.idx}")
            with self._lock:
                old, self._warm[(p.role, p.idx)] = self._warm.get((p.role, p.idx)), agent
            if old is not None:
                old.close()

    def cleanup(self, job_dir):
        with self._lock:
            warm, self._warm = list(self._warm.values()), {}
        for agent in warm:
            agent.close()

    def pick_ports(self, node, count, taken=()):
        ports = node_agent.free_ports(LOCAL_HOST, count, set(taken))
        if len(ports) != count:
            raise OSError(f"could not find {count} free ports on {node}")
        return ports

    def _start(self, placed, argv, env, cwd):
        with self._lock:
            agent = self._warm.pop((placed.role, placed.idx), None)
        if agent is None:
            agent = AgentProcess(f"{env.get('PAI_JOB_ID', 'job')}/{placed.role}:{placed.idx}")
        spec = {"argv": list(argv), "env": dict(env), "inherit": False, "cwd": cwd, "heartbeat": 0,
                "pipe": PIPE_BYTES}
        return agent_link.start_instance(agent, spec, backend=self.name, node=placed.node, host=placed.host,
                                         start_timeout=START_TIMEOUT)

    def _stop_refs(self, node, refs, timeout):
        stopped = {tuple(r) for r in node_agent.stop_refs([agent_ref(ref) for ref in refs], timeout)}
        return [ref for ref in refs if tuple(agent_ref(ref)) in stopped]

    def _signal(self, ref, signum):
        return node_agent.signal_ref(agent_ref(ref), signum)

    def _alive(self, ref):
        return node_agent.alive(agent_ref(ref))
