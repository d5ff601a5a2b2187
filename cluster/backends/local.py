"""Instances on this machine: a one-node cluster named "local".

Each instance runs under the node agent (runners/node_agent.py), its transport
the agent's stdin and stdout; a dead master closes the agent's stdin, and the
agent stops the group. prepare() starts the agents, so a start is one round trip.
"""

from __future__ import annotations

import fcntl
import os
import select
import sys
import traceback

from paicli.cluster import agent_link
from paicli.cluster.backends.base import Backend, NodeSpec
from paicli.cluster.procinfo import reap_children, reap_later
from paicli.cluster.scheduler import machine_cpu, machine_gpus, machine_memory_mb
from paicli.cluster.spawn import enter_process, must_exec
from paicli.runners import node_agent, node_outputs
from paicli.states import describe_exit

LOCAL_NODE = "local"
LOCAL_HOST = "127.0.0.1"
AGENT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))),
                     "runners", "node_agent.py")
START_TIMEOUT = 30.0
AGENT_EXIT = 10.0          # seconds a closed agent has to exit before it is SIGKILLed
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# The instances' output pipes: small, so that a burst of output does not sit in
# the kernel behind other instances' lines (the display delay).
PIPE_BYTES = 4096
AGENT_OUTPUT_FD = 3        # where a forked agent finds the instance's output pipe


class AgentProcess:
    """A node agent on this machine, waiting for its spec: its stdin and stdout
    are the link (`fileno()`: agent_link reads the frames itself), and the
    instance writes its output straight into `output_fd`, a small pipe the master
    reads, as if it were the master's own child."""

    def __init__(self, label: str):
        self.output_fd, out_w = os.pipe()
        try:
            fcntl.fcntl(self.output_fd, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
        self.pid, self._in, self._out = _spawn_agent(label, out_w)
        self.exit_code: int | None = None   # once closed (negative: the signal that ended it)
        self.agent_output_fd = AGENT_OUTPUT_FD
        os.close(out_w)
        os.set_blocking(self.output_fd, False)
        os.set_blocking(self._out, False)

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
        """The agent reads EOF and exits (stopping the group if it still runs), a
        forked process's teardown later: reaped then, not waited for (the job's cleanup waits, AGENT_EXIT). `output_fd` is
        the master's from the start on, not closed here."""
        for fd in (self._in, self._out):
            os.close(fd)
        reap_later(self.pid, lambda code: setattr(self, "exit_code", code))

    def ending(self) -> str:
        """How the agent ended, once closed: for the line of a start it never answered."""
        reap_children(AGENT_EXIT, only=self.pid)
        if self.exit_code is None:
            return ""

        return f"its agent (pid {self.pid}): {describe_exit(self.exit_code)}"

    def discard(self) -> None:
        """An agent started for an instance that never came (its link closed)."""
        self.close()
        os.close(self.output_fd)


def _spawn_agent(label: str, output_fd: int) -> tuple[int, int, int]:
    """`node_agent.py run LABEL` with `output_fd` as AGENT_OUTPUT_FD: (pid, its
    stdin, its stdout). Forked by a single-threaded master; a threaded one, where
    a fork is unsafe, spawns `python -I -S node_agent.py` as an SSH node runs it."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    moves = ((in_r, 0), (out_w, 1), (output_fd, AGENT_OUTPUT_FD))
    if must_exec():
        if output_fd == AGENT_OUTPUT_FD:
            os.set_inheritable(output_fd, True)   # a dup2 onto itself keeps close-on-exec
        pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", AGENT, "run", label], os.environ,
                             file_actions=[(os.POSIX_SPAWN_DUP2, fd, to) for fd, to in moves])
    else:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            _forked_agent(label, moves)
    os.close(in_r)
    os.close(out_w)
    return pid, in_w, out_r


def _forked_agent(label: str, moves) -> None:
    """In the forked child: nothing of the master's stays open; the agent runs."""
    code = 1
    try:
        enter_process(moves, keep=(AGENT_OUTPUT_FD,))
        with open("/proc/self/comm", "w") as comm:
            comm.write("pai-node-agent")   # what `ps` and `top` show for it
        code = node_agent.cmd_run(label)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class LocalBackend(Backend):
    name = "local"
    _job_id = "job"   # prepare()'s

    def _nodes(self):
        return [NodeSpec(LOCAL_NODE, LOCAL_HOST, machine_cpu(), machine_memory_mb(), tuple(machine_gpus()))]

    def _prepare(self, job_dir, plan, placements):
        # Every instance's agent now, waiting for its spec: a start is then one round
        # trip on a pipe.
        self._job_id = os.path.basename(str(job_dir).rstrip("/"))
        for p in placements:
            self._keep_warm(p, self._agent_for(p))

    def _agent_for(self, placed):
        return AgentProcess(f"{self._job_id}/{placed.role}:{placed.idx}")

    def _discard(self, agent):
        agent.discard()

    def _cleanup(self, job_dir):
        reap_children(AGENT_EXIT)   # no agent of the job's left, not even a zombie

    def _pick_ports(self, node, count, taken):
        return node_agent.free_ports(LOCAL_HOST, count, taken)

    def _begin_start(self, placed, spec, sink):
        # The spec goes down the agent's pipe now; its identity is read when asked
        # for: the agents start their instances while the master sends the next spec.
        agent = self._take_warm(placed) or self._agent_for(placed)

        starting = agent_link.send_spec(agent, spec, sink)
        return lambda: starting.started(backend=self.name, node=placed.node, host=placed.host,
                                        start_timeout=START_TIMEOUT)

    def _collect_outputs(self, job_dir, node, state_rel, request):
        request = dict(request, state=os.path.join(str(job_dir), state_rel), inplace=True)
        for frame in node_outputs.collect(request):
            yield node_outputs.frame_bytes([frame])

    def _stop_refs(self, node, refs, timeout):
        return node_agent.stop_refs(refs, timeout)

    def _alive(self, node, ref):
        return node_agent.alive(ref)
