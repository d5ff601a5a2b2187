"""The paicli node agent: runs on a node with the node's own python3, over SSH.

Standard library only; imports nothing of paicli (the node has no paicli).

    python3 node_agent.py run LABEL        start one instance; the spec comes on stdin
    python3 node_agent.py stop TIMEOUT REFS       identity-checked stop of groups
    python3 node_agent.py ports HOST COUNT [TAKEN,...]   free ports on this node
REFS is a JSON list of [pid, pgid, start ticks, boot id].

`run` reads one JSON line from stdin: {"argv": [...], "env": {...}, "cwd": "...",
"heartbeat": seconds} and optionally "inherit": false (the environment is `env`
alone, not the agent's own plus `env`) and "output_fd": N (an inherited pipe the
instance writes its output to: no O frames). It starts the instance in a session
of its own with default signal dispositions, then writes frames to stdout, each
    1 byte type, 4 bytes big-endian length, payload:
    I  identity JSON {pid, pgid, start, boot}     (first)
    O  output bytes (stdout and stderr, merged)
    H  heartbeat (empty)                           (every second, with "heartbeat")
    X  exit JSON {status}   status < 0: killed by that signal  (last)
    F, D, S, L, Z  files the instance wrote (spec "watch", see runners/node_outputs.py)
    E  JSON {errno, strerror}: the program could not be started (instead of I)
From stdin it takes single bytes: h heartbeat, t SIGTERM the group, k SIGKILL it.
When stdin ends (a dead master, a dropped connection) or no byte came for
`heartbeat` seconds, the whole group is stopped (SIGTERM, a short wait, SIGKILL)
and the agent exits; so is what is left in the group when the main process ends.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from contextlib import suppress
from stat import S_ISDIR

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
# Output read from the instance while the master has not taken the last of it: more
# would only sit here, behind other instances' lines (the display delay).
MAX_BUFFERED = 64 * 1024
GRACE = 1.5
# A file's times come from the kernel's coarse clock, up to a tick (1-10 ms) behind
# time.time_ns(): a file the instance changed at once may read a little earlier.
CLOCK_SLACK_NS = 10_000_000


def boot_id() -> str:
    try:
        with open(BOOT_ID_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


def proc_stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[0].decode(), int(fields[2]), fields[19].decode()   # state, pgid, start ticks


def live_groups(pgids: set) -> set:
    """Which of `pgids` still have a live member: one pass over /proc for all."""
    pgids = {pgid for pgid in pgids if _group_exists(pgid)}
    if not pgids:
        return set()
    stats = (proc_stat(name) for name in os.listdir("/proc") if name.isdigit())
    return {stat[1] for stat in stats if stat and stat[1] in pgids and stat[0] != "Z"}


def _group_exists(pgid: int) -> bool:
    """False only when no process at all (not even a zombie) is in group `pgid`:
    one signal-0 instead of a pass over /proc (paid by every instance's exit
    before its status is reported, and longer the more processes run)."""
    if pgid <= 0:
        return True    # not a group of ours to ask about: the pass over /proc decides
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # someone else's process is in it: the pass over /proc decides
    return True


def stop_group(pgid: int, reap) -> None:
    """SIGTERM the group, wait up to GRACE s for it to go, then SIGKILL (and up to
    2 s more). `reap` collects our own child so that it does not linger as a zombie."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    for wait, then in ((GRACE, signal.SIGKILL), (2.0, None)):
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and live_groups({pgid}):
            reap()
            time.sleep(0.02)
        if then is not None:
            _killpg(pgid, then)


def instance_env(spec: dict) -> dict:
    """The instance's environment: ours (unless the spec says not to inherit) under
    the spec's. PAI_INHERIT_PYTHONPATH=1 (cluster/datasets.py) adds this process's
    own PYTHONPATH after the spec's: the submitting shell's locally, the node's own
    on a node, never the submitting shell's on another machine."""
    inherit = spec.get("inherit", True)
    env = dict(os.environ) if inherit else {}
    env.update(spec.get("env") or {})
    own = os.environ.get("PYTHONPATH") if inherit else None
    if env.pop("PAI_INHERIT_PYTHONPATH", None) == "1" and own:
        env["PYTHONPATH"] = ":".join(p for p in (env.get("PYTHONPATH"), own) if p)
    return env


class Channel:
    """Framed, non-blocking writes to stdout with a bounded buffer."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()
        self.closed = False
        os.set_blocking(fd, False)

    def frame(self, kind: bytes, payload: bytes = b"") -> None:
        self.buf += kind + struct.pack(">I", len(payload)) + payload

    def flush(self) -> None:
        while self.buf and not self.closed:
            try:
                sent = os.write(self.fd, self.buf[:65536])
            except BlockingIOError:
                return
            except OSError:
                self.closed = True   # EPIPE: the channel is gone
                return
            del self.buf[:sent]

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.buf and not self.closed and time.monotonic() < deadline:
            select.select([], [self.fd], [], max(0.0, deadline - time.monotonic()))
            self.flush()


class Instance:
    """`run`: one instance under the agent. start() launches it and sends I (or E);
    loop() is one select() over the master's bytes, the instance's output and
    SIGCHLD, with one short method per event, until the exit is reported."""

    def __init__(self, spec: dict, stdin_fd: int, out: Channel):
        self.spec = spec
        self.stdin_fd = stdin_fd
        self.out = out
        self.heartbeat = float(spec.get("heartbeat") or 0)
        self.proc: subprocess.Popen | None = None
        self.read_fd = -1
        self.output_open = True
        self.status: int | None = None
        self.stopping: int | None = None
        self.last_in = self.last_beat = time.monotonic()
        self.wake_fd = -1
        self.files = None               # node_outputs.Watch: the folders whose files go back

    def start(self) -> bool:
        env = instance_env(self.spec)
        if self.spec.get("output_fd") is not None:
            write_fd, self.output_open = int(self.spec["output_fd"]), False   # the master reads it itself
        else:
            self.read_fd, write_fd = os.pipe()
            os.set_blocking(self.read_fd, False)
        self._catch_signals()
        watch = self.spec.get("watch")
        late = bool(watch and watch.get("inplace"))
        if late:
            _outputs_room().make_folders(watch)
        elif watch:
            self.files = _outputs_room().Watch(watch)
        began = time.time_ns()
        try:
            self.proc = subprocess.Popen(self.spec["argv"], cwd=self.spec.get("cwd") or None, env=env,
                                         stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd,
                                         start_new_session=True, close_fds=True, restore_signals=True)
        except OSError as err:
            self.out.frame(b"E", json.dumps({"errno": err.errno, "strerror": err.strerror or str(err)}).encode())
            self.out.drain(5)
            return False
        finally:
            os.close(write_fd)   # the instance's alone: its end is the output's end
        stat = proc_stat(self.proc.pid)
        self.out.frame(b"I", json.dumps({"pid": self.proc.pid, "pgid": self.proc.pid,
                                         "start": stat[2] if stat else "", "boot": boot_id()}).encode())
        if late:
            # This machine's folders (the user's, possibly huge) are listed once, at
            # the end: what changed since the start is the instance's. A node's are
            # listed before the start, as the staged files are not its.
            self.out.flush()
            self.files = _outputs_room().Watch(watch, since_ns=began - CLOCK_SLACK_NS)
        return True

    def _catch_signals(self) -> None:
        """The agent's dispositions back to the defaults, so the instance execs with
        them whatever the agent inherited (an ignored signal stays ignored across
        exec). Then SIGTERM, SIGHUP and SIGINT are caught: one between the start and
        the identity must not leave the instance running unwatched."""
        for name in ("SIGINT", "SIGHUP", "SIGTERM", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGTTIN", "SIGTTOU", "SIGTSTP"):
            signum = getattr(signal, name, None)
            if signum is not None:
                signal.signal(signum, signal.SIG_DFL)
        # SIGCHLD wakes select() at once: the exit is reported without a polling delay.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self.wake_fd = wake_r
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.stopping = signum

    def loop(self) -> int:
        while True:
            ended = self._check()
            if ended is not None:
                return ended
            readers = [self.stdin_fd, self.wake_fd]
            if self.output_open and len(self.out.buf) < MAX_BUFFERED:
                readers.append(self.read_fd)
            writers = [self.out.fd] if self.out.buf else []
            try:
                ready, _, _ = select.select(readers, writers, [], 0.05 if self.files and self.files.sender else 0.5)
            except InterruptedError:
                continue
            if self.wake_fd in ready:
                os.read(self.wake_fd, 512)
            if self.stdin_fd in ready and not self.on_input():
                return self.stop()     # the link closed: a dead master
            if self.read_fd in ready:
                self.on_output()
            if self.files:
                self.files.sync(self.out, MAX_BUFFERED)
            if self.status is None:
                self.status = self.proc.poll()
            if self.status is not None:
                return self.on_exit()

    def _check(self) -> int | None:
        """Beat, flush, and end on a signal, a closed channel or a silent master."""
        now = time.monotonic()
        if self.heartbeat and now - self.last_beat >= 1.0:
            self.out.frame(b"H")
            self.last_beat = now
        self.out.flush()
        silent = self.heartbeat and now - self.last_in > self.heartbeat   # a dropped link
        return self.stop() if self.stopping is not None or self.out.closed or silent else None

    def on_input(self) -> bool:
        """A byte from the master: h heartbeat, t SIGTERM, k SIGKILL; False at EOF."""
        try:
            data = os.read(self.stdin_fd, 1024)
        except OSError:
            data = b""
        if not data:
            return False
        self.last_in = time.monotonic()
        if b"k" in data:
            _killpg(self.proc.pid, signal.SIGKILL)
        elif b"t" in data:
            _killpg(self.proc.pid, signal.SIGTERM)
        return True

    def on_output(self) -> None:
        try:
            chunk = os.read(self.read_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self.out.frame(b"O", chunk)
        else:
            self.output_open = False

    def on_exit(self) -> int:
        """The main process ended: stop the rest of its group (nothing outlives an
        instance), take what is left in the pipe, then report the exit."""
        if live_groups({self.proc.pid}):
            stop_group(self.proc.pid, self.proc.poll)
        while self.output_open:
            before = len(self.out.buf)
            self.on_output()
            if len(self.out.buf) == before:
                break
        if self.files:
            self.files.send_all(self.out, MAX_BUFFERED)
        self.out.frame(b"X", json.dumps({"status": self.status}).encode())
        self.out.drain(10)
        return 0

    def stop(self) -> int:
        stop_group(self.proc.pid, self.proc.poll)
        return 1


def _outputs_room():
    """runners/node_outputs.py, the room of a job's files, next to this file: imported
    only for an instance that watches folders (every other instance starts without
    it). As the package it is in (a local agent forked from the master) or from the
    folder this file is in (a node's staged runners, run as a script, also with -I)."""
    if __package__:
        return importlib.import_module(f"{__package__}.node_outputs")
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import node_outputs

    return node_outputs


def cmd_run(label: str) -> int:
    del label  # only there so that `ps` and `info` can tell which instance this is
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0     # started for an instance that never came: the channel closed
    instance = Instance(json.loads(line), sys.stdin.fileno(), Channel(sys.stdout.fileno()))
    return instance.loop() if instance.start() else 0


def _killpg(pgid: int, signum: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def is_ours(ref: list) -> bool:
    """`ref` = [pid, pgid, start, boot] names a group we started: same boot, and the
    leader either still has its start time or is gone (Linux gives no new process
    the number of a live group, so members of `pgid` are the original group's).
    A ref without a start time cannot be told from a stranger: never ours."""
    pid, pgid, start, boot = int(ref[0]), int(ref[1]), str(ref[2] or ""), str(ref[3] or "")
    if not start or (boot and boot != boot_id()):
        return False
    stat = proc_stat(pid)
    if stat is not None and stat[0] != "Z":
        return stat[2] == start and stat[1] == pgid
    return True


def alive(ref: list) -> bool:
    """`ref` names a group we started that still has a live member."""
    return is_ours(ref) and bool(live_groups({int(ref[1])}))


def stop_refs(refs: list, timeout: float) -> list:
    """THE stop on a node: the refs that are ours and alive get SIGTERM, one bounded
    wait, then SIGKILL (identity checked again). The refs that were stopped."""
    ours = [ref for ref in refs if alive(ref)]
    for ref in ours:
        _killpg(int(ref[1]), signal.SIGTERM)
    deadline = time.monotonic() + max(0.0, float(timeout))
    groups = {int(ref[1]) for ref in ours}
    while groups and time.monotonic() < deadline:
        time.sleep(0.05)
        groups = live_groups(groups)
    for ref in ours:
        if int(ref[1]) in groups and alive(ref):
            _killpg(int(ref[1]), signal.SIGKILL)
    return ours


def cmd_stop(timeout: str, refs: str) -> int:
    print(json.dumps(stop_refs(json.loads(refs), float(timeout))))
    return 0


def root_fault(mode: int, uid: int, ours: int) -> str | None:
    """What makes a per-job folder root unsafe, from its lstat (`mode`, `uid`) and our
    uid: not a directory (a link, say), someone else's, or writable by others (who
    could swap a job's folder for theirs). None when it is ours alone. One check for
    SSH nodes (ssh_transport.Sftp.private_root) and Ray nodes (ray_node.InstanceActor.stage)."""
    if not S_ISDIR(mode):
        return "not a directory"
    if uid != ours:
        return f"owned by uid {uid}, not by us ({ours})"
    if mode & 0o022:
        return f"writable by others (mode {mode & 0o777:o})"
    return None


def cmd_ports(host: str, count: str, taken: str = "") -> int:
    print(json.dumps(free_ports(host, int(count), {int(p) for p in taken.split(",") if p.strip().isdigit()})))
    return 0


def free_ports(host: str, count: int, avoid: set, candidates=None) -> list:
    """`count` distinct ports free on this node now, on every address: an instance
    may bind 0.0.0.0 rather than `host`. Each is bound on the wildcard address
    (which fails while any address holds the port) and held until all are found.
    `candidates`: ports to try instead of the kernel's choice (tests steer it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
    wanted = iter(candidates) if candidates is not None else None
    socks, ports = [], []
    try:
        for _ in range(count + 200):
            port = 0 if wanted is None else next(wanted, None)
            if len(ports) == count or port is None:
                break
            sock = socket.socket(family)
            try:
                sock.bind((wildcard, port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
            port = sock.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
    finally:
        for sock in socks:
            sock.close()
    return ports


COMMANDS = {"run": cmd_run, "stop": cmd_stop, "ports": cmd_ports}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: node_agent.py {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
