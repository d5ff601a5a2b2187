"""The local backend's first node agents, forked by a master forked ahead of its job.

A submit server's spare child forks its job's waiting master, which pre-faults its
pages as it waits (cluster/spawn.py). Just before that pre-fault it forks the
first node agents (cluster/backends/local.py's fork_agents_ahead, each waiting
for its spec): a fork of the master, and the copy-on-write faults it
leaves the master as the master goes on writing its pages, are then paid before
the job, not as its instances start (~1.5 ms of a core a fork, and ~1,300 faults
between Running and the instances started, here).

An agent forked ahead has the server's folder, umask and signal mask, not the
job's: its spec carries what a fork of the master now would have inherited
(`ahead_spec`), and the agent applies it before it starts the instance. The
agents no instance takes (a smaller job, a job on SSH or Ray nodes) read EOF and
leave by themselves (`discard_agents_ahead`).
"""

from __future__ import annotations

import os
import signal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

AGENTS_AHEAD = 3         # a ps and two workers
_AHEAD: list[Any] = []   # local AgentProcesses, forked by local.fork_agents_ahead


def keep(agent) -> None:
    _AHEAD.append(agent)


def take():
    """An agent forked ahead that still waits (None when there is none left)."""
    while _AHEAD:
        agent = _AHEAD.pop(0)
        if _waiting(agent.pid):
            return agent
        agent.discard()   # gone meanwhile (killed): reaped, never handed a spec
    return None


def _waiting(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


def discard_agents_ahead() -> None:
    """The agents forked ahead that no instance took: EOF, and reaped with the job's."""
    while _AHEAD:
        _AHEAD.pop().discard()


def ahead_spec(spec: dict) -> dict:
    """`spec` for an agent forked ahead: the master's folder (when the instance has
    none), umask, blocked signals and log (for the agent's own errors)."""
    extra = {"cwd": spec.get("cwd") or os.getcwd(), "umask": own_umask(),
             "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ()))}
    try:
        log = os.readlink("/proc/self/fd/2")
        if log.startswith("/"):
            extra["stderr"] = log
    except OSError:
        pass
    return {**spec, **extra}


def own_umask() -> int:
    """This process's umask, read without setting it (a thread may be creating files)."""
    from paicli.cluster.procinfo import proc_status

    return int(proc_status("self")["Umask"], 8)
