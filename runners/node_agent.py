"""The paicli node agent: runs on a node with the node's own python3, over SSH.

Standard library only; imports nothing of paicli (the node has no paicli).

    python3 node_agent.py run LABEL        start one instance; the spec comes on stdin
    python3 node_agent.py info [RUNTIME_DIR [HOST COUNT]]   cores, memory, GPUs, Python,
                                               runtimes, instances (and COUNT free ports)
    python3 node_agent.py stop TIMEOUT REFS       identity-checked stop of groups
    python3 node_agent.py signal SIGNUM REFS      identity-checked signal to groups
    python3 node_agent.py alive REFS              which groups still run
    python3 node_agent.py ports HOST COUNT [TAKEN,...]   free ports on this node
REFS is a JSON list of [pid, pgid, start ticks, boot id].

`run` reads one JSON line from stdin: {"argv": [...], "env": {...}, "cwd": "...",
"heartbeat": seconds}. It starts the instance in a session (process group) of its
own with default signal dispositions, then writes frames to stdout, each
    1 byte type, 4 bytes big-endian length, payload:
    I  identity JSON {pid, pgid, start, boot}     (first)
    O  output bytes (stdout and stderr, merged)
    H  heartbeat (empty)                           (every second)
    X  exit JSON {status}   status < 0: killed by that signal  (last)
    E  JSON {errno, strerror}: the program could not be started (instead of I)
From stdin it takes single bytes: h heartbeat, t SIGTERM the group, k SIGKILL it.
When stdin ends (the SSH channel closed: a dead master, a killed `pai`, a dropped
connection) or no byte came for `heartbeat` seconds (a dropped link), the whole
group is stopped (SIGTERM, a short wait, SIGKILL) and the agent exits: no process
is left on the node. When the instance's main process ends, whatever else is left
in its group is stopped the same way.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from stat import S_ISDIR

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
MAX_BUFFERED = 256 * 1024
GRACE = 1.5


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


def group_members(pgid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(name)
            if stat and stat[1] == pgid and stat[0] != "Z":
                found.append(int(name))
    return found


def stop_group(pgid: int, grace: float, reap=None) -> bool:
    """SIGTERM the group, wait up to `grace` s for it to go, then SIGKILL.
    `reap` collects our own child so that it does not linger as a zombie.
    True when something was signalled."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if reap:
            reap()
        if not group_members(pgid):
            return True
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and group_members(pgid):
        if reap:
            reap()
        time.sleep(0.02)
    return True


def _default_signals():
    # Instances start with default dispositions whatever the agent inherited.
    for name in ("SIGINT", "SIGHUP", "SIGTERM", "SIGQUIT", "SIGPIPE", "SIGUSR1", "SIGUSR2"):
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, signal.SIG_DFL)


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


def cmd_run(label: str) -> int:
    del label  # only there so that `ps` and `info` can tell which instance this is
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0     # started ahead of time and never used: the channel closed
    spec = json.loads(line)
    heartbeat = float(spec.get("heartbeat") or 0)
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    out = Channel(sys.stdout.fileno())
    stdin_fd = sys.stdin.fileno()
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(spec["argv"], cwd=spec.get("cwd") or None, env=env,
                                stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd,
                                start_new_session=True, close_fds=True, preexec_fn=_default_signals)
    except OSError as err:
        os.close(write_fd)
        out.frame(b"E", json.dumps({"errno": err.errno, "strerror": err.strerror or str(err)}).encode())
        out.drain(5)
        return 0
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    stat = proc_stat(proc.pid)
    out.frame(b"I", json.dumps({"pid": proc.pid, "pgid": proc.pid, "start": stat[2] if stat else "",
                                "boot": boot_id()}).encode())
    pgid = proc.pid
    state = {"stopping": None}

    def on_signal(signum, frame):
        state["stopping"] = signum

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, on_signal)

    last_in = time.monotonic()
    last_beat = 0.0
    output_open = True
    status = None
    while True:
        if state["stopping"] is not None:
            stop_group(pgid, GRACE, proc.poll)
            return 1
        now = time.monotonic()
        if now - last_beat >= 1.0:
            out.frame(b"H")
            last_beat = now
        out.flush()
        if out.closed:
            stop_group(pgid, GRACE, proc.poll)
            return 1
        if heartbeat and now - last_in > heartbeat:
            stop_group(pgid, GRACE, proc.poll)   # the master stopped answering: a dropped link
            return 1
        readers = [stdin_fd]
        if output_open and len(out.buf) < MAX_BUFFERED:
            readers.append(read_fd)
        writers = [out.fd] if out.buf else []
        try:
            ready_r, _, _ = select.select(readers, writers, [], 0.2 if status is None else 0.05)
        except InterruptedError:
            continue
        if stdin_fd in ready_r:
            try:
                data = os.read(stdin_fd, 1024)
            except OSError:
                data = b""
            if not data:
                stop_group(pgid, GRACE, proc.poll)   # the channel closed
                return 1
            last_in = time.monotonic()
            if b"k" in data:
                _killpg(pgid, signal.SIGKILL)
            elif b"t" in data:
                _killpg(pgid, signal.SIGTERM)
        if read_fd in ready_r:
            try:
                chunk = os.read(read_fd, 65536)
            except BlockingIOError:
                chunk = None
            except OSError:
                chunk = b""
            if chunk:
                out.frame(b"O", chunk)
            elif chunk == b"":
                output_open = False
        if status is None:
            status = proc.poll()
        if status is not None:
            # The main process ended: take what is left in the pipe, stop the rest of
            # its group (nothing outlives an instance), then report the exit.
            if group_members(pgid):
                stop_group(pgid, GRACE, None)
            while output_open:
                try:
                    chunk = os.read(read_fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    output_open = False
                    break
                out.frame(b"O", chunk)
            out.frame(b"X", json.dumps({"status": status}).encode())
            out.drain(10)
            return 0


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def is_ours(ref: list) -> bool:
    """`ref` = [pid, pgid, start, boot] names a group we started: same boot, and the
    leader either still has its start time or is gone (Linux gives no new process
    the number of a live group, so members of `pgid` are the original group's)."""
    pid, pgid, start, boot = int(ref[0]), int(ref[1]), str(ref[2] or ""), str(ref[3] or "")
    if boot and boot != boot_id():
        return False
    stat = proc_stat(pid)
    if stat is not None and stat[0] != "Z":
        return stat[2] == start and stat[1] == pgid
    return True


def alive(ref: list) -> bool:
    """`ref` names a group we started that still has a live member."""
    return is_ours(ref) and bool(group_members(int(ref[1])))


def signal_ref(ref: list, signum: int) -> bool:
    """Send `signum` to `ref`'s group if it is ours and alive; whether it was."""
    ok = alive(ref)
    if ok:
        _killpg(int(ref[1]), signum)
    return ok


def stop_refs(refs: list, timeout: float) -> list:
    """THE stop on a node: the refs that are ours and alive get SIGTERM, one bounded
    wait, then SIGKILL (identity checked again). The refs that were stopped."""
    ours = [ref for ref in refs if alive(ref)]
    for ref in ours:
        _killpg(int(ref[1]), signal.SIGTERM)
    deadline = time.monotonic() + max(0.0, float(timeout))
    while time.monotonic() < deadline and any(alive(ref) for ref in ours):
        time.sleep(0.05)
    for ref in ours:
        signal_ref(ref, signal.SIGKILL)
    return ours


def cmd_stop(timeout: str, refs: str) -> int:
    """Identity-checked stop of every ref (JSON list of [pid, pgid, start, boot]),
    see stop_refs. Prints the list of the refs that were ours and had something to stop."""
    print(json.dumps(stop_refs(json.loads(refs), float(timeout))))
    return 0


def cmd_signal(signum: str, refs: str) -> int:
    """Send `signum` to each ref's group if it is ours; prints [true|false, ...]."""
    print(json.dumps([signal_ref(ref, int(signum)) for ref in json.loads(refs)]))
    return 0


def cmd_alive(refs: str) -> int:
    print(json.dumps([alive(ref) for ref in json.loads(refs)]))
    return 0


def root_fault(mode: int, uid: int, ours: int) -> str | None:
    """What makes a per-job folder root unsafe, from its lstat (`mode`, `uid`) and our
    uid: not a directory (a link, say), someone else's, or writable by others (who
    could swap a job's folder for theirs). None when it is ours alone. One check for
    SSH nodes (ssh_transport.Sftp.private_root) and Ray nodes (ray_node.own_root)."""
    if not S_ISDIR(mode):
        return "not a directory"
    if uid != ours:
        return f"owned by uid {uid}, not by us ({ours})"
    if mode & 0o022:
        return f"writable by others (mode {mode & 0o777:o})"
    return None


def runtimes_in(root: str) -> dict:
    found = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return found
    for name in names:
        marker = os.path.join(root, name, "paicli-runtime.json")
        try:
            with open(marker) as f:
                found[name] = json.load(f).get("version", "")
        except (OSError, ValueError):
            continue
    return found


def gpus() -> list[str]:
    for path in ("/usr/bin/nvidia-smi", "/usr/local/bin/nvidia-smi"):
        if os.path.exists(path):
            try:
                out = subprocess.run([path, "--query-gpu=index", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10).stdout
                return [line.strip() for line in out.splitlines() if line.strip()]
            except (OSError, subprocess.SubprocessError):
                return []
    return sorted(name[len("nvidia"):] for name in _listdir("/dev") if name[6:].isdigit() and name.startswith("nvidia"))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def instances() -> list[str]:
    """Labels (JOB/role:index) of the paicli instances this agent runs here."""
    found = []
    me = os.path.basename(__file__) if "__file__" in globals() else "node_agent.py"
    try:
        # Hosts that share a kernel (containers, network namespaces) share /proc:
        # only agents in this host's network namespace are this host's.
        own_net = os.readlink("/proc/self/ns/net")
    except OSError:
        own_net = None
    for name in _listdir("/proc"):
        if not name.isdigit():
            continue
        if own_net is not None:
            try:
                if os.readlink(f"/proc/{name}/ns/net") != own_net:
                    continue
            except OSError:
                continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) >= 4 and argv[1].endswith(me.encode()) and argv[2] == b"run":
            found.append(argv[3].decode(errors="replace"))
    return sorted(found)


def info(runtime_dir: str = "", host: str = "", count: int = 0) -> dict:
    """This node: cores, memory, GPUs, Python, runtimes, the paicli instances here;
    also `count` free ports on `host` when asked (one call while staging a job)."""
    mem_total = mem_avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) // 1024
                elif line.startswith("MemAvailable:"):
                    mem_avail = int(line.split()[1]) // 1024
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    root = os.path.expanduser(runtime_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "paicli", "runtimes"))
    return {
        "cores": cores, "memory": mem_total, "memory_available": mem_avail, "gpus": gpus(),
        "python": "%d.%d.%d" % sys.version_info[:3], "python_path": sys.executable,
        "runtime_dir": root, "runtimes": runtimes_in(root), "instances": instances(),
        "boot": boot_id(), "hostname": socket.gethostname(),
        "ports": free_ports(host, count, set()) if host and count > 0 else [],
    }


def cmd_info(runtime_dir: str = "", host: str = "", count: str = "0") -> int:
    print(json.dumps(info(runtime_dir, host, int(count))))
    return 0


def cmd_ports(host: str, count: str, taken: str = "") -> int:
    print(json.dumps(free_ports(host, int(count), {int(p) for p in taken.split(",") if p.strip().isdigit()})))
    return 0


def free_ports(host: str, count: int, avoid: set) -> list:
    """`count` distinct ports free on `host` now (bound together, then released)."""
    socks, ports = [], []
    try:
        while len(ports) < count and len(socks) < count + 200:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            sock.bind((host, 0))
            socks.append(sock)
            port = sock.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
    finally:
        for sock in socks:
            sock.close()
    return ports


COMMANDS = {"run": cmd_run, "stop": cmd_stop, "signal": cmd_signal, "alive": cmd_alive, "info": cmd_info,
            "ports": cmd_ports}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: node_agent.py {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
