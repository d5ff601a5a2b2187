"""The resident submit server: one per user, interpreter, checkout and environment
(paicli/submit_client.py names it), with everything a submit and its master import
already imported. Each accepted statement gets a forked child that becomes that
`pai`: the client's standard descriptors, working folder, environment, umask and
signal dispositions, its argv; then the ordinary bare-statement path (pai.run_bare).

Who it serves: a peer of its own user (SO_PEERCRED) on a socket in a 0700 folder,
whose process runs the same interpreter in the same namespaces, cgroup, limits,
CPU affinity, priority, groups and capabilities, with the same environment (but
PAI_HOME and the shell's volatile variables) and with paicli's code on disk
unchanged since the server imported it. Anything else is declined and the client
submits cold, as without a server.

Lifetimes: the child ends when its client does (SIGIO on the client's hang-up: it
never outlives the `pai` it stands for); the server leaves after IDLE seconds
without a child, at once when the code changed (after its children, which it
still reaps), and on SIGTERM. `python -m paicli.submit_server` runs one.
"""

from __future__ import annotations

import fcntl
import gc
import marshal
import os
import selectors
import signal
import socket
import sys
import time

from paicli import submit_client
from paicli.cluster.procinfo import proc_status


def _idle_seconds() -> float:
    try:
        return max(1.0, float(os.environ.get("PAI_SUBMIT_SERVER_IDLE", "900")))
    except ValueError:
        return 900.0


IDLE = _idle_seconds()   # seconds without a child before the server leaves
# A spare child takes the next statement with no fork on that submit's path, its
# job's waiting master forked and both of them pre-faulted already. It is forked
# once the server has no child left and its last statement came this long ago
# (spare_delay), and this long after the server's warm-up.
SPARE_DELAY = 1.0
# What a bare submit imports (pai.py, the CLI) beyond the master's own (spawn.import_run_modules).
SUBMIT_MODULES = ("paicli.pai", "paicli.commands", "paicli.statement", "paicli.client", "paicli.store",
                  "paicli.progress", "paicli.jobplan", "paicli.jobstatus", "paicli.staging",
                  "paicli.cluster.lifecycle", "paicli.cluster.queue", "paicli.cluster.datasets",
                  "paicli.cluster.scheduler", "paicli.web.launch", "paicli.jobview", "paicli.logtail",
                  "paicli.cluster.pluto.view", "paicli.adapters")
STATUS_FIELDS = ("Groups", "NoNewPrivs", "Seccomp", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
NAMESPACES = ("mnt", "net", "pid", "user", "ipc", "uts", "cgroup")


def import_submit_modules() -> None:
    import importlib

    from paicli.adapters import ADAPTER_MODULES
    from paicli.cluster.spawn import import_run_modules

    for name in (*SUBMIT_MODULES, *ADAPTER_MODULES, "paicli.web.standby"):
        importlib.import_module(name)
    import_run_modules()


def warm_up() -> None:
    """What a submit does first, once, with no side effect (client.prepare): the
    regular expressions it compiles, the tables it builds on first use, cached here
    for every child instead of paid by each (~2-4 ms of a served submit); the
    frameworks' metric patterns, which the job's master compiles before it starts
    an instance (0.5 ms for a python job, 4-5 ms for TensorFlow or Caffe); a new
    store's bytes (store.keep_new_store_image); whether the logview server's libraries
    are installed (~1.5 ms); and libc through ctypes, which an attached submit's
    follower watches its job folder with (~5 ms)."""
    from paicli.adapters import adapter_names, get_adapter
    from paicli.client import prepare
    from paicli.cluster.logsink import compiled_pattern
    from paicli.logtail import inotify_libc
    from paicli.statement import parse_statement
    from paicli.store import keep_new_store_image
    from paicli.web.launch import web_libraries_present

    keep_new_store_image()   # a first submit in a new PAI_HOME copies it (the bench's every submit)
    web_libraries_present()   # ... and starts its logview server
    try:
        inotify_libc()   # what an attached submit's follower loads (ctypes, libc) as its job starts
    except OSError:
        pass
    for name in ("python", "tensorflow", "mxnet", "caffe"):
        # A script given as a URI and as a path, with roles and parameters: each
        # form checks its value with a pattern of its own.
        for params in (["-Dscript=file:///dev/null"],
                       ['-Dcluster={"ps":{"count":1},"worker":{"count":2}}', "-DuserDefinedParameters=--steps=1",
                        "-Dscript=/dev/null"]):
            try:
                prepare(parse_statement(["-name", name, *params]))
            except Exception:
                pass   # /dev/null is no script: what mattered ran before that was found
    for name in adapter_names():
        for pattern in get_adapter(name).metric_patterns:
            compiled_pattern(pattern)   # cached for the masters forked from here


def process_traits(pid: int | str) -> dict[str, object]:
    """What a forked child would carry from this process but a submit must take from
    its client's: compared, never copied."""
    base = f"/proc/{pid}"
    # Not /proc/PID/exe: the compiled client (submit_client.c) is no interpreter. The
    # interpreter is in the key a client computes, and code_files() stamps its binary.
    traits: dict[str, object] = {}
    for ns in NAMESPACES:
        try:
            traits[ns] = os.readlink(f"{base}/ns/{ns}")
        except OSError:
            traits[ns] = None
    for name in ("cgroup", "limits", "oom_score_adj"):
        with open(f"{base}/{name}", encoding="utf-8", errors="replace") as f:
            traits[name] = f.read()
    status = proc_status(pid)
    for field in STATUS_FIELDS:
        traits[field] = status.get(field)
    number = os.getpid() if pid == "self" else int(pid)
    traits["affinity"] = sorted(os.sched_getaffinity(number))
    traits["nice"] = os.getpriority(os.PRIO_PROCESS, number)
    traits["scheduler"] = os.sched_getscheduler(number)   # chrt --batch / --idle
    return traits


def code_files() -> dict[str, tuple[int, int]]:
    """paicli's files this process imported, and the folders they are in (a module
    added or removed changes its folder), and the interpreter's binary: their mtime
    and size."""
    paths: set[str] = set()
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        path = getattr(module, "__file__", None)
        if path and (name == "paicli" or name.startswith("paicli.")):
            paths.add(path)
            paths.add(os.path.dirname(path))
    paths.add(os.path.realpath(sys.executable))   # a venv rebuilt on another Python
    return {path: _stamp(path) for path in paths}


def _stamp(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_size)


class Request:
    """One client's statement: its argv, environment and what its process is."""

    def __init__(self, argv0: str, args: list[str], environ: dict[bytes, bytes], fds: list[int],
                 peer: tuple[int, int, int]):
        self.argv0, self.args, self.environ, self.fds = argv0, args, environ, fds
        self.pid, self.uid, self.gid = peer


def spare_delay(since_statement: float) -> float:
    """How long after its last child ended the server forks its spare, the last
    statement having come `since_statement` seconds ago: at once when that is
    SPARE_DELAY or more (a job that statement started is past its start: an
    attached one has ended, a detached one is under way), else the rest of it, so
    the spare's forks and pre-fault do not take the cores a starting job needs. A
    script's next statement right after an attached job then finds a spare."""
    return max(0.0, SPARE_DELAY - since_statement)


def _rights(*fds: int) -> list:
    """sendmsg's ancillary data that passes `fds` (SCM_RIGHTS): _received_fds reads it."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds))]


def _received_fds(ancillary) -> list[int]:
    """The descriptors an SCM_RIGHTS message brought (recvmsg's ancillary data)."""
    fds: list[int] = []
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += [int.from_bytes(raw[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(raw) - 3, 4)]
    return fds


def read_request(conn: socket.socket) -> Request:
    data, ancillary, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
    fds = _received_fds(ancillary)
    try:
        while len(data) < 4:
            more = conn.recv(65536)
            if not more:
                raise ValueError("the request ended early")
            data += more
        size = int.from_bytes(data[:4], "big")
        if size > 16 << 20:
            raise ValueError("the request is too large")
        while len(data) < 4 + size:
            more = conn.recv(65536)
            if not more:
                raise ValueError("the request ended early")
            data += more
        fields = data[4:4 + size].split(b"\0")
        if fields[0] != submit_client.PROTOCOL or len(fds) != 4:
            raise ValueError("not a paicli submit request")
        count = int(fields[2])
        args = [os.fsdecode(a) for a in fields[3:3 + count]]
        environ = dict(entry.partition(b"=")[::2] for entry in fields[3 + count:] if entry)
        return Request(os.fsdecode(fields[1]), args, environ, fds, _peer(conn))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    import struct

    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


class Server:
    def __init__(self, directory: str):
        self.directory = directory
        self.environ = dict(os.environ)
        self.key = submit_client.key(self.environ)
        self.path = os.path.join(directory, f"submit-{self.key}.sock")
        self.lock_path = os.path.join(directory, f"submit-{self.key}.lock")
        self.children: dict[int, tuple[int, socket.socket]] = {}   # pidfd -> (pid, conn)
        self.last_statement = 0.0   # time.monotonic() of the last statement served
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.lock_fd = -1
        self.leaving = False
        self.traits: dict[str, object] = {}
        self.code: dict[str, tuple[int, int]] = {}
        self.spare: tuple[int, socket.socket, int] | None = None   # (pid, our end of its socket, pidfd)
        self.spare_ready = False   # it said so: a statement handed to it waits for nothing
        self.spare_due: float | None = None

    def take_lock(self) -> bool:
        """One server per socket: the lock file holds the pid of the one that runs."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.lock_fd = fd
        return True

    def start(self) -> None:
        import_submit_modules()
        warm_up()
        self.traits = process_traits("self")
        self.code = code_files()
        try:
            os.unlink(self.path)   # a server that died left it; the lock says none runs
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        listener.listen(64)
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ)
        gc.freeze()   # what every child shares with this process stays shared
        log(f"serving {self.path} (pid {os.getpid()})")
        self.spare_due = time.monotonic() + SPARE_DELAY

    def run(self) -> None:
        last = time.monotonic()
        while True:
            now = time.monotonic()
            timeout = None if self.children else max(0.0, IDLE - (now - last))
            if self.spare_due is not None and not self.children and not self.leaving:
                timeout = max(0.0, min(timeout if timeout is not None else IDLE, self.spare_due - now))
            if self.leaving and not self.children:
                return
            events = self.selector.select(timeout)
            if self.spare_due is not None and time.monotonic() >= self.spare_due and not self.children \
                    and not self.leaving:
                self.make_spare()
                continue
            if not events and not self.children and not self.leaving:
                log("idle: leaving")
                self.leave()
                return
            # The listener last: a spare's "ready" in the same round takes this round's statement.
            for selected, _mask in sorted(events, key=lambda event: event[0].fileobj is self.listener):
                if selected.fileobj is self.listener:
                    self.accept()
                elif selected.fd in self.children:
                    self.reap(selected.fd)
                elif self.spare is not None and selected.fd == self.spare[1].fileno():
                    self.spare_ready = self.spare[1].recv(16) == b"ready"
                    if not self.spare_ready:
                        self.drop_spare()   # it ended (EOF) or said something else
                elif self.spare is not None and selected.fd == self.spare[2]:
                    self.drop_spare()
                # else: the other event of a spare dropped in this round
            last = time.monotonic()

    def make_spare(self) -> None:
        """A child forked ahead of its statement (spare_child)."""
        self.spare_due = None
        if self.spare is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError as err:
            log(f"no spare: {err}")
            ours.close()
            theirs.close()
            return
        if pid == 0:
            ours.close()
            self.spare_child(theirs)   # never returns
        theirs.close()
        pidfd = os.pidfd_open(pid)
        self.spare = (pid, ours, pidfd)
        self.spare_ready = False
        self.selector.register(pidfd, selectors.EVENT_READ)
        self.selector.register(ours, selectors.EVENT_READ)

    def drop_spare(self) -> None:
        """The spare ended, or is let go (SIGKILL through its pidfd: it holds no job
        yet, and its waiting master leaves at the EOF of its command pipe); reaped,
        and none until the next is due."""
        pid, ours, pidfd = self.spare
        self.spare, self.spare_ready = None, False
        self.selector.unregister(ours)
        ours.close()
        self.selector.unregister(pidfd)
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass   # ended already
        os.close(pidfd)
        os.waitpid(pid, 0)

    def spare_child(self, link: socket.socket) -> None:
        """A child waiting for its statement: it forks its job's waiting master and
        pre-faults its pages and the master's, then takes the connection and the
        request the server read (or EOF: the server left) and is that client's child."""
        code = 0
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.close_inherited()
            from paicli.cluster import spawn
            from paicli.cluster.procinfo import prefault, readable

            spawn.keep_spare_master()
            standby = keep_standby_ahead(link)
            # Ready before the pre-fault, which stops when the statement comes: a script's
            # next statement right after a job finds the spare (~5 ms of forks, not ~30).
            link.sendall(b"ready")
            log(f"spare pid {os.getpid()} waits" + (f" (standby ahead {standby})" if standby else ""))
            prefault(until=lambda: readable(link.fileno()))
            data, ancillary, _flags, _addr = link.recvmsg(4 << 20, socket.CMSG_SPACE(5 * 4))
            if not data:
                return
            fds = _received_fds(ancillary)
            link.close()
            argv0, args, environ, peer = marshal.loads(data)
            request = Request(argv0, args, environ, fds[1:], peer)
            self.become_child(socket.socket(fileno=fds[0]), request)   # never returns
        except BaseException as err:
            log(f"spare failed: {type(err).__name__}: {err}")
            code = 1
        finally:
            os._exit(code)

    def hand_to_spare(self, conn: socket.socket, request: Request) -> bool:
        """The request to the ready spare (marshal: a builtin module, and a socket pair
        between this process and its own child), the connection and the client's
        descriptors with it; False when it cannot be reached (it is dropped)."""
        pid, ours, pidfd = self.spare
        data = marshal.dumps((request.argv0, request.args, request.environ, (request.pid, request.uid, request.gid)))
        try:
            ours.sendmsg([data], _rights(conn.fileno(), *request.fds))
        except OSError as err:
            log(f"spare not reached: {err}")
            self.drop_spare()
            return False
        self.spare, self.spare_ready = None, False
        self.selector.unregister(ours)
        ours.close()
        self.children[pidfd] = (pid, conn)   # its pidfd is registered already
        log(f"served pid {request.pid} as {pid} (a spare)")
        return True

    def leave(self) -> None:
        """Stop taking statements: the socket goes first (no new client finds it), the
        ones already waiting hear "no leaving" (they submit cold and start a new
        server), the lock is let go for that server."""
        if self.listener is None:
            return
        try:
            os.unlink(self.path)   # ours: we hold the lock
        except OSError:
            pass
        self.listener.setblocking(False)
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                break
            _answer(conn, b"no leaving")
            conn.close()
        self.selector.unregister(self.listener)
        self.listener.close()
        self.listener = None
        os.close(self.lock_fd)
        self.lock_fd = -1
        self.leaving = True
        self.spare_due = None
        if self.spare is not None:
            self.drop_spare()   # its link closed: it leaves, and its waiting master with it

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(5.0)   # a client that says nothing does not hold the server
        try:
            request = read_request(conn)
        except (OSError, ValueError) as err:
            log(f"bad request: {err}")
            conn.close()
            return
        try:
            reason = self.decline_reason(request)
            if reason:
                log(f"declined pid {request.pid}: {reason}")
                _answer(conn, b"no leaving" if reason == "code changed" else f"no {reason}".encode())
                conn.close()
                if reason == "code changed":
                    self.leave()
                return
            self.last_statement = time.monotonic()
            if self.spare is not None and self.spare_ready and self.hand_to_spare(conn, request):
                return
            try:
                pid = os.fork()
            except OSError as err:
                log(f"no fork: {err}")
                _answer(conn, b"no fork failed")
                conn.close()
                return
            if pid == 0:
                self.become_child(conn, request)   # never returns
            log(f"served pid {request.pid} as {pid}")   # pids only: a statement can hold secrets
            pidfd = os.pidfd_open(pid)
            self.children[pidfd] = (pid, conn)
            self.selector.register(pidfd, selectors.EVENT_READ)
        finally:
            for fd in request.fds:
                os.close(fd)

    def decline_reason(self, request: Request) -> str | None:
        if (request.uid, request.gid) != (os.getuid(), os.getgid()):
            return "another user"
        environ = {os.fsdecode(k): os.fsdecode(v) for k, v in request.environ.items()}
        if _stable(environ) != _stable(self.environ):
            return "another environment"
        if code_files() != self.code:
            return "code changed"
        try:
            theirs = process_traits(request.pid)
        except (OSError, ValueError):
            return "its process could not be read"
        for name, value in self.traits.items():
            if theirs.get(name) != value:
                return f"another {name}"
        return None

    def reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if not self.children and not self.leaving:
            self.spare_due = time.monotonic() + spare_delay(time.monotonic() - self.last_statement)
        if os.WIFSIGNALED(status):
            _answer(conn, f"signal {os.WTERMSIG(status)}".encode())
        else:
            _answer(conn, f"exit {os.waitstatus_to_exitcode(status)}".encode())
        conn.close()

    def close_inherited(self) -> None:
        """In a child: nothing of the server's (its socket, lock, other clients, the
        spare's link). Safe twice: a spare calls it as it starts and as it becomes
        a client's child."""
        for pidfd, (_pid, other) in self.children.items():
            os.close(pidfd)
            other.close()
        self.children.clear()
        if self.spare is not None:
            _pid, ours, pidfd = self.spare
            ours.close()
            os.close(pidfd)
            self.spare = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.selector is not None:
            self.selector.close()
            self.selector = None

    def become_child(self, conn: socket.socket, request: Request) -> None:
        code = 1
        try:
            status = proc_status(request.pid)
            self.close_inherited()
            _become(conn, request, status)
            from paicli.pai import run_bare

            run_bare(request.args, before_exit=lambda code: _answer(conn, f"exit {code}".encode(), clear_async=True))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException as err:
            if request.fds:   # before the client's descriptors were taken: this log is still ours
                log(f"child for pid {request.pid} failed: {type(err).__name__}: {err}")
            code = 1
        finally:
            os._exit(code)


def _stable(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in submit_client.VOLATILE}


def _become(conn: socket.socket, request: Request, status: dict[str, str]) -> None:
    """This forked child takes the client's place: descriptors, folder, environment,
    umask, signals, argv; then it says "ok" with a pidfd of itself (the client relays
    its signals through it), unless the client is already gone."""
    os.setpgid(0, 0)
    for target, fd in enumerate(request.fds[:3]):
        os.dup2(fd, target)
    os.fchdir(request.fds[3])
    for fd in request.fds:
        if fd > 2:
            os.close(fd)
    request.fds = []
    os.environ.clear()
    os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in request.environ.items()})
    os.umask(int(status.get("Umask", "0022"), 8))
    ignored, blocked = _mask(status.get("SigIgn", "0")), _mask(status.get("SigBlk", "0"))
    for signum in range(1, signal.NSIG):
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signum in ignored:
                signal.signal(signum, signal.SIG_IGN)
            elif signum == signal.SIGINT:
                signal.signal(signum, signal.default_int_handler)
            elif signal.getsignal(signum) not in (signal.SIG_DFL, None):
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _new_stdio()
    sys.argv = [request.argv0, *request.args]
    # The client's hang-up (its end, however it came) ends this child: SIGIO, whose
    # default action ends a process, sent on the socket's hang-up to its owner only.
    fd = conn.fileno()
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLRDHUP)
    if poller.poll(0):
        os._exit(1)   # gone before we began: nothing submitted
    inode = os.fstat(fd).st_ino

    def close_in_forks() -> None:
        # The job's master (forked from here) must not hold the client's socket.
        try:
            if os.fstat(fd).st_ino == inode:
                os.close(fd)
        except OSError:
            pass

    os.register_at_fork(after_in_child=close_in_forks)
    from paicli.web import launch

    launch.STANDBY_IN_PLACE = _standby_in_place   # a logview standby forked from here needs no interpreter
    launch.STANDBY_AHEAD = hand_standby           # ... or none at all: the spare forked it ahead
    pidfd = os.pidfd_open(os.getpid())
    try:
        conn.sendmsg([b"ok\n"], _rights(pidfd))
    finally:
        os.close(pidfd)


_standby: tuple[int, socket.socket] | None = None   # a spare's logview standby, forked ahead


def keep_standby_ahead(link: socket.socket) -> int | None:
    """In a spare, before its pre-fault: the logview standby a statement in a new
    PAI_HOME forks (web.launch), forked now; it waits for its socket and log
    (hand_standby). Unused (the home has its server, the log view is a file), it
    reads EOF as the served child ends, and leaves. Its pid, or None (file mode)."""
    global _standby
    from paicli.web import launch

    if launch.mode() == "file":
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        link.close()   # the spare's own link: the server must see the spare's EOF, not ours
        _standby_waits(theirs)   # never returns
    theirs.close()
    _standby = (pid, ours)
    os.register_at_fork(after_in_child=lambda: ours.close())   # a later fork holds no link to it
    return pid


def hand_standby(argv: list[str], env: dict[str, str], log: int, sock_fd: int) -> int | None:
    """web.launch's standby started by the one forked ahead: its pid; None when there
    is none (or it cannot be reached), and the caller forks."""
    global _standby
    if _standby is None:
        return None
    (pid, ours), _standby = _standby, None
    try:
        ours.sendmsg([marshal.dumps((argv, env))], _rights(sock_fd, log))
        return pid
    except OSError:
        return None
    finally:
        ours.close()


def _standby_waits(link: socket.socket) -> None:
    """The standby forked ahead: it waits for its argv, environment, socket and log,
    then goes on as web.launch's forked standby does (its own session, then in place)."""
    code = 0
    try:
        from paicli.cluster.procinfo import let_go_inherited

        let_go_inherited(keep=(link.fileno(),))   # the waiting master's pipes, the spare's link
        data, ancillary, _flags, _addr = link.recvmsg(1 << 20, socket.CMSG_SPACE(2 * 4))
        if not data:
            return   # none wanted: the served child ended
        sock_fd, log_fd = _received_fds(ancillary)
        link.close()
        argv, env = marshal.loads(data)
        argv[argv.index("--fd") + 1] = str(sock_fd)   # the socket's number here, not in the served child
        from paicli.web import launch

        launch.STANDBY_IN_PLACE = _standby_in_place
        launch._standby_child(argv, env, os.open(os.devnull, os.O_RDONLY), log_fd, sock_fd)   # never returns
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _standby_in_place(argv: list[str], env: dict[str, str]) -> None:
    """In a logview standby forked from a served child (web.launch): what
    `python -m paicli.web.standby ARGS` would run, run here; then this process ends."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        from paicli.web import standby

        code = standby.main(argv[argv.index("paicli.web.standby") + 1:])
    except BaseException:
        import traceback

        traceback.print_exc()   # into the logview's server.log, as the interpreter would
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code or 0)


def _mask(hex_mask: str) -> set[int]:
    bits = int(hex_mask, 16)
    return {n for n in range(1, 65) if bits >> (n - 1) & 1}


def _new_stdio() -> None:
    """sys.stdin/stdout/stderr over the client's descriptors, made as the interpreter
    makes them at start: stdout line-buffered on a terminal, stderr always, both
    written through under -u / PYTHONUNBUFFERED (as this server's were)."""
    import io

    made = []
    for fd, old, mode in ((0, sys.__stdin__, "r"), (1, sys.__stdout__, "w"), (2, sys.__stderr__, "w")):
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict")
        unbuffered = mode == "w" and bool(getattr(old, "write_through", False))
        binary = io.open(fd, mode + "b", buffering=0 if unbuffered else -1, closefd=False)
        made.append(io.TextIOWrapper(binary, encoding=encoding, errors=errors, newline="\n",
                                     line_buffering=fd == 2 or (fd == 1 and os.isatty(fd)),
                                     write_through=unbuffered))
    sys.stdin, sys.stdout, sys.stderr = made
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def _answer(conn: socket.socket, line: bytes, clear_async: bool = False) -> None:
    try:
        if clear_async:   # our own end is not the client's: no SIGIO for it
            fd = conn.fileno()
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_ASYNC)
        conn.sendall(line + b"\n")
    except OSError:
        pass   # the client is gone


def log(text: str) -> None:
    try:
        sys.stderr.write(time.strftime("%Y-%m-%d %H:%M:%S ") + text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main() -> int:
    os.chdir("/")   # never the folder of the submit that started it (a mount kept busy)
    directory = submit_client.server_dir(create=True)
    if directory is None:
        log("no private folder for the socket: not serving")
        return 1
    server = Server(directory)
    if not server.take_lock():
        return 0   # one runs already
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        server.start()
        server.run()
    except SystemExit:
        pass
    finally:
        if server.listener is not None:
            try:
                os.unlink(server.path)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
