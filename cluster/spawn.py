"""Starting a job's JobMaster, and the master's watchdog, each in a session of its
own: forked (no new interpreter importing paicli again), or as a fresh interpreter
from a threaded caller, where fork() is unsafe."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

TYPE_CHECKING = False   # typing is not imported: `pai` forks its master before it imports more
if TYPE_CHECKING:
    from typing import BinaryIO

    from paicli.store import Store

# Nothing else of paicli at the top: `pai` forks the waiting master (fork_waiting_master)
# before it imports the rest of itself, and what this module imports is paid before it.


def spawn_master(home: Path, job_id: str, log_path: Path, fresh: bool = False) -> int:
    """Start the job's master in a session of its own and return its pid.

    From a single-threaded caller (the `pai` CLI) the master is forked: it starts
    supervising at once, without a new interpreter importing paicli again (about
    a tenth of a second saved on every submit). A double fork makes it a child of
    init, never of the CLI. A threaded caller (a program using the library) gets
    a fresh interpreter instead, since forking a threaded process is unsafe.
    """
    env_home = {"PAI_HOME": str(home)}
    if fresh or _must_exec():   # fresh: a caller whose signal set-up a fork would carry (a master)
        import subprocess   # here only: the CLI's fork needs none of it (~4 ms of imports)

        log = open_private(log_path)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "paicli.cluster.master", job_id],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=str(log_path.parent),
                                    start_new_session=True, close_fds=True, env={**os.environ, **env_home})
        finally:
            os.close(log)
        return proc.pid
    read_fd, write_fd = os.pipe()

    def master() -> int:
        os.write(write_fd, str(os.getpid()).encode())
        os.close(write_fd)
        return _run_forked_master(home, job_id, log_path)

    child = _double_fork((read_fd,), master)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        pid = pipe.read()
    os.waitpid(child, 0)
    if not pid:
        raise OSError("the job's master did not start")
    return int(pid)


class WaitingMaster:
    """A job's master forked before the job exists: `pai` forks it as it starts a
    submit, and it imports the master's modules on the other core while the CLI
    checks, stages and records the job; `start` then hands it the job, and it
    supervises at once. The fork happens before the CLI opens the store, so no
    SQLite connection is carried into it and none has to be closed (and
    checkpointed) and opened again around a fork, as spawn_master must. If the
    job is never handed over (bad input, Ctrl-C, any error, the CLI's death),
    the pipe reaches EOF and the waiting master leaves without a trace."""

    def __init__(self, command_fd: int, pid_fd: int, child: int):
        self._command_fd, self._pid_fd, self._child = command_fd, pid_fd, child

    def store_open(self, home: Path) -> None:
        """The store exists (the CLI has opened it): the waiting master opens its own
        connection now, while the CLI stages and records the job, instead of after
        the handover (a cold connection's open and first statements: ~2-3 ms)."""
        import json

        if self._command_fd >= 0:
            try:
                os.write(self._command_fd, (json.dumps(["store", str(home)]) + "\n").encode())
            except OSError:
                pass   # it is gone: start() says so

    def start(self, home: Path, job_id: str, log_path: Path, meanwhile=None) -> int:
        """Hand the recorded job over; the master's pid. `meanwhile()` runs between
        the two: the CLI's own work after a submit (its first lines, the log view)
        while the master may still be importing, not after it."""
        import json

        pid = b""
        try:
            job = ["job", str(home), job_id, str(log_path), _context()]
            os.write(self._command_fd, (json.dumps(job) + "\n").encode())
            os.close(self._command_fd)
            self._command_fd = -1
            if meanwhile is not None:
                meanwhile()
            pid = self._line()
        finally:
            self._reap_intermediate()
            if not pid.endswith(b"\n"):
                self.close()   # else the pipe stays, for take_recorded (or close())
        if not pid.endswith(b"\n"):
            raise OSError("the job's master did not start")
        return int(pid)

    def ask_nodes(self, config: dict) -> bool:
        """Have the waiting master probe the job's nodes (a backend that
        `probes_by_login`) while the submit stages the job: it keeps the
        connections, and the job stages and starts over them. False if it is gone."""
        import json

        try:
            os.write(self._command_fd, (json.dumps(["nodes", config, _context()]) + "\n").encode())
        except OSError:
            return False
        return True

    def nodes_answer(self) -> list | None:
        """The nodes with their resources (NodeSpecs) that ask_nodes() asked for. A
        node problem is raised here as the probe raised it; None if the waiting
        master could not answer (the caller probes itself)."""
        import json

        try:
            reply = json.loads(self._line())
        except (OSError, ValueError):
            return None
        if "error" in reply:
            from paicli.errors import PaiError, UsageError

            raise (UsageError if reply["error"] == "usage" else PaiError)(reply["message"], reply["hint"])
        if "nodes" not in reply:
            return None
        from paicli.cluster.backends.base import NodeSpec

        return [NodeSpec.from_dict(node) for node in reply["nodes"]]

    def _line(self) -> bytes:
        """A line from the master's pipe (what came, if it closed first)."""
        got = b""
        while not got.endswith(b"\n") and (chunk := os.read(self._pid_fd, 65536)):
            got += chunk
        return got

    def take_recorded(self) -> int:
        """Once started: the pipe the master wrote its pid to, which it closes when the
        job's record is complete (its verdict, its summary file): a follower's end of
        the job, before the master's own cleanup and exit. The caller closes it."""
        fd, self._pid_fd = self._pid_fd, -1
        return fd

    def close(self) -> None:
        """No job for it (or handed over already): the waiting master leaves at EOF."""
        if self._command_fd >= 0:
            os.close(self._command_fd)
            self._command_fd = -1
        self._reap_intermediate()
        if self._pid_fd >= 0:
            os.close(self._pid_fd)
            self._pid_fd = -1

    def _reap_intermediate(self) -> None:
        if self._child:
            os.waitpid(self._child, 0)   # the double fork's intermediate child, gone as soon as it forked
            self._child = 0


_spare: WaitingMaster | None = None   # forked ahead by a submit server's spare child


def keep_spare_master() -> None:
    """In a submit server's spare child: its job's waiting master forked now, before
    the statement, pre-faulted as it waits; the next fork_waiting_master() takes it."""
    global _spare
    _spare = fork_waiting_master(prefault=True)
    if _spare is not None:
        _spare._reap_intermediate()   # gone as soon as it forked: no zombie while the spare waits


def fork_waiting_master(prefault: bool = False) -> WaitingMaster | None:
    """A WaitingMaster, or None where forking is not safe: a threaded process, an
    open store in this process (a library caller's, the console's), or
    PAI_MASTER_EXEC set; the caller then starts the master with spawn_master.
    `prefault`: it pre-faults its pages as it waits (a spare, forked ahead)."""
    global _spare
    if _spare is not None:
        waiting, _spare = _spare, None
        return waiting
    store = sys.modules.get("paicli.store")   # not imported: no store can be open

    if _must_exec() or (store is not None and store.any_open()):
        return None
    fds: list[int] = []
    try:
        command_r, command_w = os.pipe()
        fds += [command_r, command_w]
        pid_r, pid_w = os.pipe()
        fds += [pid_r, pid_w]
        child = _double_fork((command_w, pid_r), lambda: _wait_for_job(command_r, pid_w, prefault))
    except OSError:
        for fd in fds:   # no fork (EAGAIN) or no pipe (EMFILE): the submit starts its master as before
            os.close(fd)
        return None
    os.close(command_r)
    os.close(pid_w)
    return WaitingMaster(command_w, pid_r, child)


def _wait_for_job(command_fd: int, pid_fd: int, prefault: bool = False) -> int:
    """The waiting master: nothing of the CLI's kept (its terminal, its pipes), the
    master's modules imported (and, forked by the submit itself, its SSH nodes
    probed ahead), then perhaps ["store", home] (the CLI has the store open: the
    master's own connection is opened now) and ["nodes", config, context] (the
    probe's answer is written on the pid pipe), then ["job", home, job_id, log,
    context], or EOF."""
    import fcntl
    import json

    # Above 0-2 first: a CLI started with stdin (or another of them) closed got one of
    # these pipes there, and taking the standard descriptors would close it.
    command_fd, pid_fd = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in (command_fd, pid_fd))
    devnull = os.open(os.devnull, os.O_RDWR)
    _take_stdio(devnull, devnull, devnull, keep=(command_fd, pid_fd))
    os.chdir("/")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP):
        signal.signal(signum, signal.SIG_DFL)
    try:
        import_run_modules()   # while the CLI stages the job
    except Exception:
        pass   # said where it matters: when the master runs, in master.log
    ahead = None if prefault else _probe_ahead()
    if prefault:
        import importlib

        from paicli.cluster import procinfo
        from paicli.cluster.backends import BACKENDS

        # The local backend's first agents, before the pre-fault: the master's pages are its own after it.
        try:
            importlib.import_module(BACKENDS["local"].partition(":")[0]).fork_agents_ahead()
        except OSError:
            pass   # no fork now (EAGAIN) or no pipe (EMFILE): the job forks its agents as before

        procinfo.prefault(until=lambda: procinfo.readable(command_fd))   # stops when the job comes
    store = backend = None
    how = "started by fork as the submit began"
    with os.fdopen(command_fd, "rb") as command:
        while (line := command.readline()).startswith((b'["store",', b'["nodes",')) and line.endswith(b"\n"):
            request = json.loads(line)
            if request[0] == "store":
                store = _open_store_early(request[1])
            else:
                backend, when = _answer_nodes(request[1], request[2], pid_fd, ahead)
                how += f"; its nodes probed {when}" if backend is not None else ""
    if not (line.startswith(b'["job",') and line.endswith(b"\n")):
        return 0   # no job for it
    _, home, job_id, log_path, context = json.loads(line)
    _take_context(context)
    try:
        # A line, and the pipe kept open: the master closes it once the job's record
        # is complete (WaitingMaster.take_recorded).
        os.write(pid_fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass   # the CLI is gone after handing the job over: the job is recorded, supervise it
    if store is not None and store.home != Path(home):
        store = None
    return _run_forked_master(Path(home), job_id, Path(log_path), how, store, waited=True, recorded_fd=pid_fd,
                              backend=backend)


def _context() -> dict:
    """What of the submitting process its waiting master takes on (_take_context)."""
    umask = os.umask(0o077)
    os.umask(umask)
    return {"env": dict(os.environ), "umask": umask,
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}


def _take_context(context: dict) -> None:
    # The submit's own: a waiting master forked ahead (a server's spare) has the server's.
    # Left alone when it is the same (the probe's threads may be reading it).
    if os.environ != context["env"]:
        os.environ.clear()
        os.environ.update(context["env"])
    os.umask(context["umask"])
    signal.pthread_sigmask(signal.SIG_SETMASK, context["blocked"])


def _probe_ahead() -> tuple | None:
    """(config, backend, reply): the probe a submit from this environment will ask
    for (WaitingMaster.ask_nodes), made before it asks. A waiting master forked by
    the submit itself has its environment (a spare, the server's: it waits to be
    asked). None where probing the nodes does not log in to them, or the nodes
    file cannot be read (the submit says why)."""
    import json

    try:
        from paicli.cluster import backends
        from paicli.store import pai_home

        config = json.loads(json.dumps(backends.submit_config(pai_home())))
        if not backends.backend_class(config).probes_by_login:
            return None
        backend = backends.get_backend(config)
    except Exception:  # noqa: BLE001 - the submit meets it again, and says it
        return None
    return (config, *_probe(backend))


def _answer_nodes(config: dict, context: dict, pid_fd: int, ahead: tuple | None) -> tuple:
    """The submit's probe of its job's nodes (WaitingMaster.ask_nodes): the one made
    ahead if it was of these nodes, else made now. The answer, one JSON line, goes
    on the pid pipe; (the backend, connected, for the job, or None if the probe
    failed; "ahead" or "when asked")."""
    import json

    _take_context(context)
    made_ahead = ahead is not None and ahead[0] == config
    if made_ahead:
        backend, reply = ahead[1:]
    else:
        if ahead is not None and ahead[1] is not None:
            ahead[1].let_go_of_connections()   # other nodes than the submit's
        try:
            from paicli.cluster.backends import get_backend

            backend, reply = _probe(get_backend(config))
        except Exception:  # noqa: BLE001 - the submit probes again, and meets it itself
            backend, reply = None, {}
    try:
        os.write(pid_fd, (json.dumps(reply) + "\n").encode())
    except OSError:
        pass   # the CLI is gone: EOF on the command pipe comes next
    return backend, "ahead" if made_ahead else "when asked"


def _probe(backend) -> tuple:
    """(backend, reply): its nodes probed, its connections kept for the job; (None,
    the error) if the probe failed ({} if it is not one the submit would say)."""
    from paicli.errors import PaiError, UsageError

    try:
        backend.keep_probe_connections = True
        return backend, {"nodes": [node.to_dict() for node in backend.nodes()]}
    except PaiError as err:   # the submit says it, as its own probe would have
        return None, {"error": "usage" if isinstance(err, UsageError) else "pai",
                      "message": err.message, "hint": err.hint}
    except Exception:  # noqa: BLE001 - the submit probes again, and meets it itself
        return None, {}


def _open_store_early(home: str):
    """The waiting master's own connection to a store the CLI has opened, warmed by
    one read (SQLite parses the schema at the first statement); None if that fails
    (the master opens it after the handover, and says what is wrong in master.log)."""
    try:
        from paicli.store import Store

        store = Store(Path(home))
        store.warm()
        return store
    except Exception:  # noqa: BLE001 - any failure here is met again, and reported, after the handover
        return None


def import_run_modules() -> None:
    """What a waiting master imports before it has its job: the master, the local
    backend (the one most jobs run on) and what a run imports lazily."""
    import importlib

    from paicli.cluster.backends import BACKENDS
    from paicli.cluster.master import RUN_MODULES

    for name in (BACKENDS["local"].partition(":")[0], *RUN_MODULES):
        importlib.import_module(name)


def _double_fork(close: tuple[int, ...], run) -> int:
    """`run()` in a grandchild in a session of its own (never the caller's child,
    never a session leader that could take a terminal); `close`d there first. The
    intermediate child's pid, for the caller's waitpid: it leaves at once."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:   # None: started with that descriptor closed
            stream.flush()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            import gc

            gc.freeze()   # the caller's objects: never collected here (procinfo.let_go_inherited)
            for fd in close:
                os.close(fd)
            os.setsid()
            code = run() if os.fork() == 0 else 0
        finally:
            os._exit(code)
    return child


def _must_exec() -> bool:
    import threading

    return threading.active_count() > 1 or bool(os.environ.get("PAI_MASTER_EXEC"))


def _take_stdio(stdin_fd: int, stdout_fd: int, stderr_fd: int, keep: tuple[int, ...] = (),
                let_go: bool = True) -> None:
    """In a forked child: these three descriptors become 0, 1 and 2, every other
    inherited one but `keep` is let go (the parent's store, pipes, sockets, a
    terminal: procinfo.let_go_inherited), and sys.stdin/stdout/stderr are opened
    anew over them (the parent's may be its own objects, a library user's or a
    test runner's capture). `let_go=False`: this process let go of what it
    inherited already (a waiting master, as it started): its own descriptors since
    (an early store connection) stay, and only the three given are closed."""
    from paicli.cluster.procinfo import let_go_inherited

    for target, fd in enumerate((stdin_fd, stdout_fd, stderr_fd)):
        os.dup2(fd, target)
    if let_go:
        let_go_inherited(keep)
    else:
        for fd in {stdin_fd, stdout_fd, stderr_fd} - {0, 1, 2}:
            os.close(fd)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


class Watchdog:
    __slots__ = ("pid", "stdin")

    def __init__(self, pid: int, stdin: BinaryIO):
        self.pid = pid
        self.stdin = stdin   # the master writes each instance's identity here; EOF without "done" = master lost


def spawn_watchdog(job_id: str, log_path: Path, store: Store) -> Watchdog:
    """Start the watchdog of a job (cluster/watchdog.py) with a pipe on its stdin,
    in a session of its own, stderr into `log_path`. Forked from a single-threaded
    master (about 70 ms of CPU saved at the very moment the instances start);
    a fresh interpreter from a threaded one."""
    log = open_private(log_path)
    try:
        if _must_exec():
            import subprocess

            proc = subprocess.Popen([sys.executable, "-m", "paicli.cluster.watchdog", job_id],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
                                    start_new_session=True, close_fds=True)
            assert proc.stdin is not None
            return Watchdog(proc.pid, proc.stdin)
        read_fd, write_fd = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        with store.closed_for_fork():
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.setsid()
                    # The write end is closed too: EOF must mean the master is gone.
                    _take_stdio(read_fd, os.open(os.devnull, os.O_WRONLY), log)
                    signal.set_wakeup_fd(-1)
                    for signum in (signal.SIGCHLD, signal.SIGTSTP):
                        signal.signal(signum, signal.SIG_DFL)
                    from paicli.cluster import watchdog

                    code = watchdog.main([job_id])
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(code)
        os.close(read_fd)
        return Watchdog(pid, os.fdopen(write_fd, "wb"))
    finally:
        os.close(log)


def open_private(path: Path) -> int:
    """An append-only log file only its owner can read (it holds argv and log tails)."""
    from paicli.private import open_append_fd

    fd = open_append_fd(path)
    os.fchmod(fd, 0o600)
    return fd


def _run_forked_master(home: Path, job_id: str, log_path: Path, how: str = "started by fork", store=None,
                       waited: bool = False, recorded_fd: int = -1, backend=None) -> int:
    """`waited`: a waiting master, which let go of the CLI's descriptors as it
    started; `store`, its own connection, opened while it waited; `recorded_fd`,
    closed once the job's record is complete (WaitingMaster.take_recorded);
    `backend`, the one that probed the job's nodes as it waited, if any."""
    log = open_private(log_path)
    # Nothing of the CLI's: not its descriptors (a terminal, a pipe someone waits
    # to see closed, the SQLite file), not its working directory (an unmount of it
    # would fail while the job runs).
    _take_stdio(os.open(os.devnull, os.O_RDONLY), log, log, let_go=not waited)
    os.chdir(log_path.parent)
    os.environ["PAI_HOME"] = str(home)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP):
        signal.signal(signum, signal.SIG_DFL)
    try:
        print(f"JobMaster for {job_id}: pid {os.getpid()}, {how}", flush=True)
        from paicli.cluster.master import JobMaster

        from paicli.store import Store

        if backend is not None:
            from paicli.cluster.backends import job_config

            if job_config(log_path.parent) != backend.config:   # not the nodes the job was recorded with
                backend.let_go_of_connections()
                backend = None
        return JobMaster(store or Store(home), job_id, backend=backend, recorded_fd=recorded_fd).run()
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
