"""Starting a process of paicli in a session of its own (a job's master, its
watchdog, the logview server): `start_in_session` starts them all, and
`enter_process` sets up every new process (a local node agent's too).

The process is a double fork of a single-threaded caller, and a fresh interpreter
(`python -m paicli.cluster.spawn MODULE ...`) where a fork is unsafe (a threaded
caller, or PAI_MASTER_EXEC set). Either way it runs MODULE's `main(args)` with the
caller's environment, umask and signal mask, default signal dispositions, and
nothing of the caller's open but the descriptors it is given.

A job's master starts before the job is recorded (`start_master`): asked for the
nodes, it probes them and keeps those connections for the job; then it gets its
job, or reads EOF and leaves without a trace.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from paicli.cluster.backends.base import InstanceRef, NodeSpec, agent_ref
from paicli.cluster.procinfo import boot_id, let_go_inherited, proc_stat
from paicli.errors import PaiError, UsageError
from paicli.private import open_append_fd
from paicli.runners import node_agent
from paicli.store import every_store_closed


def start_in_session(module: str, args: list[str], log_path: Path, cwd: Path | str = "/",
                     stdin_fd: int | None = None, keep: tuple[int, ...] = ()) -> int:
    """Run `module`'s main(args) in a new session, its stdout and stderr appended to
    `log_path` (0600), its stdin `stdin_fd` (else /dev/null), `keep` left open (same
    numbers); its pid. The caller's stores are closed across a fork."""
    log = above_stdio(open_append_fd(log_path))
    os.fchmod(log, 0o600)   # its owner's alone, whatever it was: it holds argv and log tails
    stdin = above_stdio(os.open(os.devnull, os.O_RDONLY)) if stdin_fd is None else stdin_fd
    try:
        if must_exec():
            proc = subprocess.Popen([sys.executable, "-m", "paicli.cluster.spawn", module, *args],
                                    stdin=stdin, stdout=log, stderr=log, cwd=str(cwd), pass_fds=keep,
                                    start_new_session=True, close_fds=True)
            proc.returncode = 0   # never waited for here: it outlives the caller
            return proc.pid
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:   # None: started with that descriptor closed
                stream.flush()
        read_fd, write_fd = pipe()
        with every_store_closed():
            child = os.fork()
            if child == 0:
                code = 1
                try:
                    os.close(read_fd)
                    os.setsid()
                    if os.fork() == 0:   # the grandchild: never the caller's child, never a session leader
                        os.write(write_fd, str(os.getpid()).encode())
                        os.close(write_fd)
                        enter_process(((stdin, 0), (log, 1), (log, 2)), keep, cwd)
                        code = _run(module, args, "started by fork")
                    else:
                        code = 0
                finally:
                    os._exit(code)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pid_pipe:
            pid = pid_pipe.read()
        os.waitpid(child, 0)
        if not pid:
            raise OSError(f"{module} did not start")
        return int(pid)
    finally:
        os.close(log)
        if stdin_fd is None:
            os.close(stdin)


def above_stdio(fd: int) -> int:
    """`fd`, moved above 2 if it is one of them, so setting up 0-2 cannot close it."""
    if fd > 2:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def pipe() -> tuple[int, int]:
    """os.pipe(), both ends above 2."""
    read_fd, write_fd = os.pipe()
    return above_stdio(read_fd), above_stdio(write_fd)


def must_exec() -> bool:
    """A fork is unsafe here (another thread may hold a lock the child would need)."""
    return threading.active_count() > 1 or bool(os.environ.get("PAI_MASTER_EXEC"))


def enter_process(moves: tuple[tuple[int, int], ...], keep: tuple[int, ...] | None,
                  cwd: Path | str | None = None) -> None:
    """A new process's set-up: each (descriptor, number) of `moves` in place, nothing
    else above 2 open but `keep` (None: an exec closed the rest already), default
    signal dispositions, `cwd` (None: the caller's)."""
    for fd, target in moves:
        if fd != target:
            os.dup2(fd, target)
    if keep is not None:
        let_go_inherited(keep)
    signal.set_wakeup_fd(-1)   # a master's (its self-pipe): not this process's
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    # Streams anew over 0-2: the caller's may be its own objects (a test runner's capture).
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if cwd is not None:
        os.chdir(cwd)


def _run(module: str, args: list[str], how: str) -> int:
    print(f"{module}: pid {os.getpid()}, {how}", flush=True)
    try:
        return importlib.import_module(module).main(args) or 0
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


# -- a job's master ---------------------------------------------------------------


@dataclass
class MasterProcess:
    """The CLI's end of a job's master: ask it for the nodes, then hand it the job
    (`start`) or let it go (`close`). It keeps the answer pipe open until the job's
    record is complete (`take_recorded`)."""
    command_fd: int
    answer_fd: int

    def nodes(self, config: dict[str, Any]) -> list[NodeSpec] | None:
        """The nodes of `config` with their resources, probed by the master (None: a
        backend that places jobs itself); a node problem raised as the probe raised it."""
        self._send(["nodes", config])
        try:
            reply = json.loads(self._line())
        except ValueError:
            raise PaiError("the job's master ended before it answered", "see master.log in the job folder") from None
        if "error" in reply:
            raise (UsageError if reply["error"] == "usage" else PaiError)(reply["message"], reply["hint"])
        return None if reply["nodes"] is None else [NodeSpec.from_dict(node) for node in reply["nodes"]]

    def start(self, job_id: str) -> int:
        """Hand the recorded job over; the master's pid."""
        self._send(["job", job_id])
        os.close(self.command_fd)
        self.command_fd = -1
        pid = self._line()
        if not pid.endswith(b"\n"):
            self.close()
            raise OSError("the job's master did not start")
        return int(pid)

    def take_recorded(self) -> int:
        """The answer pipe, closed by the master once the job's record is complete."""
        fd, self.answer_fd = self.answer_fd, -1
        return fd

    def close(self) -> None:
        """No job for it (or handed over already): a master without one leaves at EOF."""
        for name in ("command_fd", "answer_fd"):
            if getattr(self, name) >= 0:
                os.close(getattr(self, name))
                setattr(self, name, -1)

    def _send(self, request: list) -> None:
        try:
            os.write(self.command_fd, (json.dumps(request) + "\n").encode())
        except OSError:
            raise OSError("the job's master is gone") from None

    def _line(self) -> bytes:
        got = b""
        while not got.endswith(b"\n") and (chunk := os.read(self.answer_fd, 65536)):
            got += chunk
        return got


def start_master(home: Path, job_dir: Path) -> MasterProcess:
    """The master of the job being prepared in `job_dir` (cluster.master.serve)."""
    command_r, command_w = pipe()
    answer_r, answer_w = pipe()
    try:
        start_in_session("paicli.cluster.master", [str(home), str(command_r), str(answer_w)],
                         job_dir / "master.log", cwd=job_dir, keep=(command_r, answer_w))
    except BaseException:
        for fd in (command_w, answer_r):
            os.close(fd)
        raise
    finally:
        os.close(command_r)
        os.close(answer_w)
    return MasterProcess(command_w, answer_r)


# -- a job's watchdog ---------------------------------------------------------------


@dataclass
class Watchdog:
    pid: int
    stdin: BinaryIO   # the master writes each instance's identity here; EOF without "done" = master lost


def spawn_watchdog(job_id: str, log_path: Path) -> Watchdog:
    """The watchdog of a job (cluster/watchdog.py), a pipe on its stdin, its stderr
    into `log_path`. The write end stays the master's alone: EOF means it is gone."""
    read_fd, write_fd = pipe()
    os.set_inheritable(write_fd, False)
    try:
        pid = start_in_session("paicli.cluster.watchdog", [job_id], log_path, stdin_fd=read_fd)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return Watchdog(pid, os.fdopen(write_fd, "wb"))


# -- a serving job's router ---------------------------------------------------------


@dataclass
class RouterProcess:
    ref: InstanceRef   # its identity, for the one stop path (the watchdog's too)
    stdin: BinaryIO    # the master's lines (`up NAME HOST:PORT`, `down NAME`); EOF ends it


def start_router(sock_fd: int, plan_path: Path, log_path: Path) -> RouterProcess:
    """The router of a serving job (cluster/router.py) on the listening socket
    `sock_fd`, a pipe on its stdin whose write end stays the caller's alone."""
    read_fd, write_fd = pipe()
    os.set_inheritable(write_fd, False)
    try:
        pid = start_in_session("paicli.cluster.router", [str(sock_fd), str(plan_path)], log_path,
                               cwd=plan_path.parent, stdin_fd=read_fd, keep=(sock_fd,))
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    stat = proc_stat(pid)   # a forked one leads no group: its session's first process does
    ref = InstanceRef(backend="local", node="local", host="127.0.0.1", pid=pid, pgid=stat.pgid if stat else pid,
                      start=stat.start if stat else None, boot_id=boot_id())
    return RouterProcess(ref, os.fdopen(write_fd, "wb"))


def stop_router(ref: InstanceRef, timeout: float) -> bool:
    """The one stop, identity checked, on this machine (where every router runs,
    whatever the job's backend): SIGTERM, `timeout` seconds, SIGKILL."""
    return bool(node_agent.stop_refs([agent_ref(ref)], timeout))


if __name__ == "__main__":
    # The fresh-interpreter way of start_in_session: the same set-up, then MODULE's main.
    enter_process((), None)
    sys.exit(_run(sys.argv[1], sys.argv[2:], "started as a new interpreter"))
