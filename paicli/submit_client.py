"""The client side of the resident submit server (paicli/submit_server.py).

A bare statement (`pai -name X -D...`) is the most common run of `pai`, and most of
its time before the job starts is a cold interpreter importing the standard library
and paicli, twice (the CLI and the job's master). A per-user server keeps them
imported: the client hands it the statement, its standard descriptors, its working
folder and its environment, and the server forks a child that runs the submit
exactly as `pai` would, writing to the client's terminal. The client relays the
signals it gets (Ctrl-C, Ctrl-Z, hang-up) to that child and leaves with its exit
status. Where no server answers, `pai` submits as before and starts one for the
next submit (PAI_SUBMIT_SERVER=0 turns all of it off).

This module imports nothing but builtin modules (`_socket`, `_signal`, `binascii`):
the launcher `.ci/setup` writes (`write_launcher`) runs it from an interpreter
started without site (`-S`), ~10 ms before any other import. It never imports
the rest of paicli; `offer` runs site for the ordinary `pai` when it is not served.
"""

import os   # no `from __future__ import annotations`: one module more to import
import sys

PROTOCOL = b"paicli-submit-1"
SOCKET_ENV = "PAI_SUBMIT_SERVER_DIR"
SWITCH_ENV = "PAI_SUBMIT_SERVER"
SERVED_ENV = "PAI_SUBMIT_SERVED"   # from the compiled client to the Python launcher it runs
OUTCOMES = ("off", "absent", "declined", "other")
# What differs between two shells of one user without changing what a submit does.
# PAI_HOME is the job store: each child gets the client's own.
VOLATILE = frozenset({"PAI_HOME", "PWD", "OLDPWD", "_", "SHLVL"})
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSWER_TIMEOUT = 20.0   # the server's first answer; a wedged server never holds a submit longer
RELAYED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def enabled(environ=os.environ) -> bool:
    return environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def server_dir(create: bool = False) -> str | None:
    """The server's folder: PAI_SUBMIT_SERVER_DIR, else $XDG_RUNTIME_DIR/paicli-submit,
    else /tmp/paicli-submit-UID. Only a real folder of ours that no one else can
    enter is used (None otherwise: the submit goes without a server)."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        path = os.path.join(runtime, "paicli-submit") if runtime else f"/tmp/paicli-submit-{os.getuid()}"
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if (st.st_mode & 0o170000) != 0o040000 or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def key(environ) -> str:
    """The server that may serve this process: one per interpreter, checkout, user and
    environment (but VOLATILE), so two shells with different variables never share one."""
    import binascii

    parts = [sys.executable, ROOT, str(os.getuid())]
    parts += sorted(f"{k}={v}" for k, v in environ.items() if k not in VOLATILE)
    return "%08x" % binascii.crc32("\0".join(parts).encode("utf-8", "surrogateescape"))


def socket_path(directory: str, environ=os.environ) -> str:
    return os.path.join(directory, f"submit-{key(environ)}.sock")


def submit(args: list[str]) -> str:
    """Hand the bare statement `args` to the server. Served: never returns (the
    process leaves with the child's status). Otherwise why not, for the caller's
    cold submit: "off", "absent" (no server: start one), "declined"."""
    if not enabled():
        return "off"
    directory = server_dir()
    if directory is None:
        return "absent"
    import _socket

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    sock.settimeout(ANSWER_TIMEOUT)   # a wedged server's full backlog blocks connect() too
    try:
        sock.connect(socket_path(directory))
    except OSError:   # none there (or none that takes us): nothing was sent, a cold submit is safe
        sock.close()
        return "absent"
    try:
        fds = [os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    except OSError:
        sock.close()
        return "declined"   # a working folder that is gone: the cold path says so
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
        _send_request(sock, [0, 1, 2, *fds], args)
        first, pidfd = _read_line(sock, want_fd=True)
    except TimeoutError:
        _say("the submit server did not answer within %d s; nothing was submitted "
             "(PAI_SUBMIT_SERVER=0 submits without it)" % ANSWER_TIMEOUT)
        os._exit(1)
    except OSError:
        sock.close()
        return "declined"   # a standard descriptor closed, or the server went away first
    finally:
        os.close(fds[0])
    if not first.startswith(b"ok"):
        sock.close()
        if os.environ.get("PAI_DEBUG"):
            _say("submit server: " + first.decode("utf-8", "replace"))
        return "absent" if first.startswith(b"no leaving") else "declined"
    sock.settimeout(None)
    if pidfd >= 0:   # the child sends it with its "ok"; from here on the submit is its
        _relay_signals(pidfd)
    _follow(sock)


def _send_request(sock, fds: list[int], args: list[str]) -> None:
    fields = [PROTOCOL, os.fsencode(sys.argv[0] if sys.argv else "pai"), str(len(args)).encode()]
    fields += [os.fsencode(a) for a in args]
    fields += [k + b"=" + v for k, v in os.environb.items()]
    payload = b"\0".join(fields)
    body = len(payload).to_bytes(4, "big") + payload
    import _socket

    rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)
    sent = sock.sendmsg([body], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
    if sent < len(body):
        sock.sendall(body[sent:])


_pending = bytearray()


def _read_line(sock, want_fd: bool = False) -> tuple[bytes, int]:
    """One answer line (and the descriptor sent with it); b"" at EOF."""
    import _socket

    fd = -1
    while b"\n" not in _pending:
        if want_fd:
            data, ancillary, _flags, _addr = sock.recvmsg(4096, _socket.CMSG_SPACE(4))
            for level, kind, raw in ancillary:
                if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS and len(raw) >= 4:
                    fd = int.from_bytes(raw[:4], sys.byteorder, signed=True)
        else:
            data = sock.recv(4096)
        if not data:
            return b"", fd
        _pending.extend(data)
    line, _, rest = bytes(_pending).partition(b"\n")
    _pending[:] = rest
    return line, fd


def _relay_signals(pidfd: int) -> None:
    """What the terminal (or a kill) sends this process goes to the child, as it would
    have reached a cold `pai`; a signal this process ignores (nohup) is left alone."""
    import _signal

    def relay(signum, frame):
        try:
            _signal.pidfd_send_signal(pidfd, signum)
        except OSError:
            pass   # the child has just ended: its status is on its way

    def stop(signum, frame):
        # Ctrl-Z: the child stops with us and goes on when we do.
        try:
            _signal.pidfd_send_signal(pidfd, _signal.SIGSTOP)
        except OSError:
            pass
        _signal.signal(_signal.SIGTSTP, _signal.SIG_DFL)
        os.kill(os.getpid(), _signal.SIGTSTP)
        _signal.signal(_signal.SIGTSTP, stop)
        try:
            _signal.pidfd_send_signal(pidfd, _signal.SIGCONT)
        except OSError:
            pass

    for name in RELAYED:
        signum = getattr(_signal, name)
        if _signal.getsignal(signum) is not _signal.SIG_IGN:
            _signal.signal(signum, relay)
    if _signal.getsignal(_signal.SIGTSTP) is not _signal.SIG_IGN:
        _signal.signal(_signal.SIGTSTP, stop)


def _follow(sock) -> None:
    """Wait for the child's end and leave as it did."""
    import _signal

    while True:
        line, _fd = _read_line(sock)
        if line.startswith(b"exit "):
            os._exit(int(line[5:]))
        if line.startswith(b"signal "):
            signum = int(line[7:])
            _signal.signal(signum, _signal.SIG_DFL)
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)
        if not line:
            _say("the submit's process ended without a status (its server was stopped); "
                 "`pai list` shows whether the job was submitted")
            os._exit(1)


def _say(text: str) -> None:
    try:
        os.write(2, f"pai: error: {text}\n".encode())
    except OSError:
        pass


def start_server() -> None:
    """Start a server for the next submit, in a session of its own, its output
    nowhere; the caller does not wait for it (it leaves at once if one runs)."""
    directory = server_dir(create=True)
    if directory is None:
        return
    log = os.path.join(directory, f"submit-{key(os.environ)}.log")
    try:
        os.posix_spawn(sys.executable, [sys.executable, "-P", "-m", "paicli.submit_server"], os.environ,
                       setsid=True,
                       file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                     (os.POSIX_SPAWN_OPEN, 1, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
                                     (os.POSIX_SPAWN_DUP2, 1, 2),
                                     *((os.POSIX_SPAWN_CLOSE, fd) for fd in _inherited())])
    except OSError:
        pass   # no server: every submit stays cold, as before


def _inherited() -> list[int]:
    """This process's descriptors above 2 that an exec keeps (what its own caller
    passed on: a lock `flock` holds, a pipe someone waits to see closed, a make
    jobserver's): the server, which lives on for minutes, must not hold them."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    fds = []
    for name in names:
        try:
            if int(name) > 2 and os.get_inheritable(int(name)):
                fds.append(int(name))
        except (OSError, ValueError):
            pass   # the listing's own descriptor, closed by now
    return fds


def offer() -> str:
    """The launcher's first step: a bare statement goes to the server (served: never
    returns). Otherwise site runs, as it would have at start, and the launcher goes
    on into the ordinary `pai` with what this said (pai.main's `served`)."""
    from paicli.cli_tokens import is_bare_statement   # imports nothing

    args = sys.argv[1:]
    # The compiled client (submit_client.c) tried already and says why it went on here.
    outcome = os.environ.pop(SERVED_ENV, None)
    if outcome not in OUTCOMES:
        outcome = submit(args) if is_bare_statement(args) else "other"
    for name in [m for m in sys.modules if m == "paicli" or m.startswith("paicli.")]:
        del sys.modules[name]   # imported from ROOT without site: paicli proper comes through site
    if sys.path and sys.path[0] == ROOT:
        del sys.path[0]
    import site

    site.main()
    return outcome


LAUNCHER = """#!{python} -S
# `pai` in Python, written by .ci/setup (python -m paicli.submit_client --write-launcher):
# tries the resident submit server from an interpreter without site, then runs the
# ordinary `pai`. The compiled client (submit_client.c) runs it when it does not hand
# a statement over itself.
import sys
sys.path.insert(0, {root!r})
from paicli.submit_client import offer
served = offer()
from paicli.pai import main
main(served=served)
"""


def write_launcher(path: str) -> str:
    """`pai` at `path`: the compiled client, with the Python launcher at PATH-py for
    what it does not serve itself; where no C compiler works, the Python launcher
    itself. Which one it wrote ("compiled" or "python")."""
    fallback = f"{path}-py"
    launcher = LAUNCHER.format(python=sys.executable, root=ROOT).encode()
    _write_file(fallback, launcher, 0o755)
    compiled = compile_client(fallback)
    if compiled is None:
        _write_file(path, launcher, 0o755)
        return "python"
    _write_file(path, compiled, 0o755)
    return "compiled"


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def compile_client(fallback: str, answer_timeout: int | None = None) -> bytes | None:
    """submit_client.c built for this interpreter and checkout, or None (no compiler:
    `CC`, else cc). `answer_timeout`: other than ANSWER_TIMEOUT (a test's)."""
    import shutil
    import subprocess
    import tempfile

    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory(prefix="paicli-client-") as folder:
        out = os.path.join(folder, "pai")
        defines = {"PAI_PYTHON": sys.executable, "PAI_ROOT": ROOT, "PAI_FALLBACK": os.path.abspath(fallback)}
        argv = [compiler, "-O2", "-Wall", "-o", out, *(f"-D{k}={_c_string(v)}" for k, v in defines.items()),
                *([f"-DANSWER_TIMEOUT={int(answer_timeout)}"] if answer_timeout else []),
                os.path.join(ROOT, "paicli", "submit_client.c")]
        try:
            built = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if built.returncode != 0:
            sys.stderr.write(f"pai: the compiled client did not build; `pai` stays in Python:\n{built.stderr}")
            return None
        with open(out, "rb") as f:
            return f.read()


def _write_file(path: str, data: bytes, mode: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write-launcher":
        sys.exit("usage: python -m paicli.submit_client --write-launcher PATH")
    print(f"pai: {sys.argv[2]} written ({write_launcher(sys.argv[2])})")
