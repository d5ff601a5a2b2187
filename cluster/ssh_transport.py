"""SSH to the nodes of a nodes file, with paramiko (imported here only, lazily).

- Host keys are checked against the nodes file's known_hosts (RejectPolicy): an
  unknown or changed key is refused with one line naming the node and saying
  `pai nodes trust NAME`; `trust_node` shows the fingerprint and records the key.
- Commands are argv lists; what crosses SSH as a string is shlex.quote'd.
- Nothing secret is logged: key files are named, never read into a message.

`run_agent` runs a node agent subcommand by passing its source to the node's
python3 (nothing needs to be there first). A job's files are written by SFTP, or
as a tar stream into runners/stage_writer.py where sshd has no SFTP (`open_files`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
import shlex
import socket
import sys
import threading
from contextlib import suppress
from pathlib import Path

from paicli.cluster import node_files
from paicli.cluster.node_files import tar_stream
from paicli.cluster.nodes import NodeEntry
from paicli.errors import PaiError, UsageError
from paicli.private import write_private
from paicli.runners.node_agent import root_fault

CONNECT_TIMEOUT = 8.0
RUNNERS_DIR = node_files.RUNNERS_DIR
AGENT_SOURCE = RUNNERS_DIR / "node_agent.py"
INFO_SOURCE = RUNNERS_DIR / "node_info.py"


class NodeUnreachable(PaiError):
    """The node does not answer (network, sshd down). Retryable elsewhere."""


class HostKeyError(UsageError):
    """The node's host key is unknown or has changed: refused, exit 2."""


class NodeAuthError(UsageError):
    """The node refused our user/key: exit 2."""


def quote_argv(argv: list[str]) -> str:
    """The one way an argv becomes the command string the remote shell parses."""
    return " ".join(shlex.quote(str(a)) for a in argv)


def fingerprint(key) -> str:
    """OpenSSH's SHA256 fingerprint of a paramiko key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def host_key_name(node: NodeEntry) -> str:
    return node.host if node.port == 22 else f"[{node.host}]:{node.port}"


_IMPORTING = threading.Lock()


def _paramiko():
    with _IMPORTING:   # the first call may come from several probe threads at once
        if "paramiko" not in sys.modules and "invoke" not in sys.modules:
            # paramiko.config imports invoke if it can, only for ssh_config's `Match exec`;
            # no ssh_config is read here, so invoke would only slow every process that logs in.
            sys.modules["invoke"] = None
            try:
                import paramiko
            finally:
                del sys.modules["invoke"]
    import paramiko

    # paramiko logs a refused channel (a node's MaxSessions reached, handled by
    # Connections.session) and dropped links at ERROR; our errors say it in one line.
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    return paramiko


def connect(node: NodeEntry, known_hosts: str, timeout: float = CONNECT_TIMEOUT):
    """An authenticated paramiko SSHClient, or one of the errors above."""
    paramiko = _paramiko()
    client = paramiko.SSHClient()
    if os.path.exists(known_hosts):
        try:
            client.load_host_keys(known_hosts)
        except (OSError, paramiko.SSHException, ValueError) as err:
            raise UsageError(f"known_hosts file {known_hosts}: cannot read it ({err.__class__.__name__})",
                             "fix or remove the bad line") from None
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    where = f"node {node.name} ({node.user}@{node.host}:{node.port})"
    try:
        try:
            client.connect(node.host, port=node.port, username=node.user, key_filename=node.key,
                           look_for_keys=node.key is None, allow_agent=node.key is None,
                           timeout=timeout, banner_timeout=timeout, auth_timeout=timeout)
        except BaseException:
            client.close()
            raise
    except paramiko.BadHostKeyException as err:
        raise HostKeyError(f"{where}: host key CHANGED (now {fingerprint(err.key)}; {known_hosts} "
                           "records another); refused",
                           f"if the node was reinstalled, check the key and run: pai nodes trust {node.name}") from None
    except paramiko.PasswordRequiredException:
        raise NodeAuthError(f"{where}: key {node.key} is protected by a passphrase, which paicli does not ask for",
                            "load it into ssh-agent and leave `key:` out for this node, or use a key "
                            "without a passphrase") from None
    except paramiko.AuthenticationException:
        key = f"key {node.key}" if node.key else "the agent's and ~/.ssh's keys"
        raise NodeAuthError(f"{where}: authentication failed: user {node.user!r} with {key} was refused",
                            "check `user:` and `key:` for this node in the nodes file") from None
    except FileNotFoundError:
        raise UsageError(f"{where}: key file {node.key} does not exist",
                         "fix `key:` for this node in the nodes file") from None
    except paramiko.SSHException as err:
        text = str(err)
        if "not found in known_hosts" in text:
            raise HostKeyError(f"{where}: host key unknown (not in {known_hosts}); refused",
                               f"check it and run: pai nodes trust {node.name}") from None
        if "private key" in text.lower() or "key" in text.lower() and "invalid" in text.lower():
            raise NodeAuthError(f"{where}: cannot use key {node.key}: {text}",
                                "fix `key:` for this node in the nodes file") from None
        raise NodeUnreachable(f"{where}: SSH failed: {text}", "check that sshd runs there") from None
    except (OSError, EOFError) as err:
        reason = "timed out" if isinstance(err, (socket.timeout, TimeoutError)) else \
            (getattr(err, "strerror", None) or err.__class__.__name__)
        raise NodeUnreachable(f"{where}: unreachable ({reason})",
                              "check the address, the network and that sshd runs there") from None
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(5)
    return client


def scan_host_key(node: NodeEntry, timeout: float = CONNECT_TIMEOUT):
    """The key the node's sshd presents (no authentication)."""
    paramiko = _paramiko()
    try:
        sock = socket.create_connection((node.host, node.port), timeout=timeout)
    except OSError as err:
        raise NodeUnreachable(f"node {node.name} ({node.host}:{node.port}): unreachable "
                              f"({getattr(err, 'strerror', None) or err.__class__.__name__})",
                              "check the address and that sshd runs there") from None
    transport = paramiko.Transport(sock)
    try:
        transport.start_client(timeout=timeout)
        return transport.get_remote_server_key()
    except (paramiko.SSHException, OSError, EOFError) as err:
        raise NodeUnreachable(f"node {node.name}: SSH handshake failed: {err}") from None
    finally:
        transport.close()


def known_key(node: NodeEntry, known_hosts: str):
    """The key known_hosts records for the node, or None."""
    if not os.path.exists(known_hosts):
        return None
    entry = _paramiko().HostKeys(known_hosts).lookup(host_key_name(node))
    return next(iter(entry.values()), None) if entry else None


def record_host_key(node: NodeEntry, known_hosts: str, key) -> None:
    """Replace the node's entries in known_hosts with `key` (0600 file, 0700 dir)."""
    name = host_key_name(node)
    path = Path(known_hosts)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = path.read_text().splitlines() if path.exists() else []
    # A line is the node's when a host field of it (before the first space) names it.
    lines = [line for line in old if line.startswith("#")
             or not any(_names(entry, name) for entry in line.split(" ", 1)[0].split(","))]
    lines.append(f"{name} {key.get_name()} {key.get_base64()}")
    write_private(path, "\n".join(lines) + "\n")


def _names(entry: str, name: str) -> bool:
    """A known_hosts host field names `name`, plainly or hashed (`|1|salt|hash`)."""
    if entry.startswith("|1|"):
        salt = entry.split("|")[2] if entry.count("|") >= 3 else ""
        return _paramiko().HostKeys.hash_host(name, salt) == entry
    return entry == name


def exec_command(client, argv: list[str], stdin: bytes | None = None,
                 timeout: float = 60.0) -> tuple[int, bytes, bytes]:
    """Run argv on the node; (exit status, stdout, stderr). `client` is an SSHClient,
    or a fresh session channel (Connections.session)."""
    chan = client.get_transport().open_session(timeout=timeout) if hasattr(client, "open_sftp") else client
    chan.settimeout(timeout)
    err = bytearray()
    failed: list[BaseException] = []

    def drain_stderr() -> None:
        # Read alongside stdout: both share the channel's window, so a command
        # writing more to stderr than the window holds would otherwise stall
        # while we wait for its stdout to end.
        try:
            while True:
                data = chan.recv_stderr(65536)
                if not data:
                    return
                err.extend(data)
        except (socket.timeout, OSError, EOFError) as exc:
            failed.append(exc)

    try:
        chan.exec_command(quote_argv(argv))
        for at in range(0, len(stdin or b""), 1 << 18):
            # In slices: paramiko's sendall copies what is left after every packet it sends.
            chan.sendall(stdin[at:at + (1 << 18)])
        chan.shutdown_write()
        reader = threading.Thread(target=drain_stderr, name="ssh-stderr", daemon=True)
        reader.start()
        out = bytearray()
        while True:
            data = chan.recv(65536)
            if not data:
                break
            out += data
        reader.join(timeout)
        if reader.is_alive() or any(isinstance(exc, socket.timeout) for exc in failed):
            raise socket.timeout
        return chan.recv_exit_status(), bytes(out), bytes(err)
    except socket.timeout:
        raise NodeUnreachable(f"command on the node timed out after {timeout:.0f}s") from None
    finally:
        chan.close()


def _transport_active(obj) -> bool:
    """Whether a client's (or a channel's) connection is up."""
    transport = obj.get_transport()
    return transport is not None and transport.is_active()


def agent_argv(python: str, command: str, *args: str) -> list[str]:
    """The agent run from its source, passed with -c (nothing staged first); `info`
    is runners/node_info.py's, run from its source too, handed the agent loaded
    from its own (as writer_argv hands the stage writer the agent's root check)."""
    if command != "info":
        return [python, "-c", AGENT_SOURCE.read_text(), command, *args]
    program = (
        "import sys, types\n"
        "agent = types.ModuleType('paicli_node_agent')\n"
        f"exec(compile({AGENT_SOURCE.read_text()!r}, 'node_agent.py', 'exec'), agent.__dict__)\n"
        "info = {'__name__': 'paicli_node_info', 'node_agent': agent}\n"
        f"exec(compile({INFO_SOURCE.read_text()!r}, 'node_info.py', 'exec'), info)\n"
        "sys.exit(info['main'](['info', *sys.argv[1:]]))\n")
    return [python, "-c", program, *args]


def run_agent(client, node: NodeEntry, command: str, *args: str, timeout: float = 60.0):
    status, out, err = exec_command(client, agent_argv(node.python, command, *args), timeout=timeout)
    if status != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {status}"]
        if status == 127:
            raise NodeUnreachable(f"node {node.name}: {node.python} not found there",
                                  "install python3 on the node or set `python:` in the nodes file")
        raise NodeUnreachable(f"node {node.name}: the paicli agent failed: {tail[0]}")
    return json.loads(out)


class NoSftp(UsageError):
    """The node's sshd runs no SFTP server: nothing can be staged there until its
    administrator enables it (a node's setup, like its host key: exit 2)."""


NO_SFTP_HINT = ("add `Subsystem sftp internal-sftp` (or the path of its sftp-server) to the node's "
                "/etc/ssh/sshd_config and reload sshd")
ROOT_HINT = "remove it on the node, or set `work_dir:` for the node to a folder of your own"
WRITER_SOURCE = RUNNERS_DIR / "stage_writer.py"


def open_files(session, node: NodeEntry):
    """Where a job's files are written on the node: SFTP, or, when its sshd has no
    SFTP subsystem, a tar stream over an exec channel (ExecFiles). `session()` opens
    a fresh session channel."""
    try:
        return Sftp(session(), node.name)
    except NoSftp:
        return ExecFiles(session, node)


class Sftp:
    """Per-job folders on a node: 0700 dirs, files 0700 when executable, else 0600."""

    def __init__(self, chan, node_name: str = "the node"):
        paramiko = _paramiko()
        try:
            chan.invoke_subsystem("sftp")   # a session channel (Connections.session)
            self.sftp = paramiko.SFTPClient(chan)
        except paramiko.SSHException:
            # OpenSSH closes the channel when it has no `Subsystem sftp` line; paramiko
            # then says only "Channel closed.".
            if not _transport_active(chan):
                raise
            raise NoSftp(f"node {node_name}: its sshd has no SFTP subsystem (paicli copies a job's files "
                         "over SFTP)", NO_SFTP_HINT) from None

    def close(self) -> None:
        self.sftp.close()

    def makedirs(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        current = ""
        for part in parts:
            current += "/" + part
            try:
                self.sftp.stat(current)
            except FileNotFoundError:
                self.sftp.mkdir(current, mode=0o700)
                self.sftp.chmod(current, 0o700)

    def private_root(self, path: str, node_name: str) -> None:
        """`path` (a node's work_dir, by default /tmp/paicli-USER) exists and is
        ours alone: a directory, not a link, owned by the user we log in as, not
        writable by others. Anyone else who owns it, or may write to it, could swap
        a job's folder for theirs between our copy and our start of the agent."""
        self.makedirs(path)
        attrs = self.sftp.lstat(path)
        probe = f"{path}/.paicli-owner-{secrets.token_hex(4)}"
        try:
            with self.sftp.open(probe, "w") as f:
                f.chmod(0o600)   # ours alone before it exists for anyone else to open
            ours = self.sftp.lstat(probe).st_uid
        finally:
            with suppress(OSError):
                self.sftp.remove(probe)

        what = root_fault(attrs.st_mode, attrs.st_uid, ours)
        if what is not None:
            raise UsageError(f"node {node_name}: the per-job folder root {path} is {what}; refused", ROOT_HINT)

    def put_files(self, files, folder: str, made: set[str]) -> None:
        """node_files.NodeFile entries under `folder`: folders, files and inner links.
        `made` holds folders known to exist (a private root at least): any other
        folder on the way is created 0700 (one round trip each, no look first)."""
        for f in files:
            target = f"{folder}/{f.dst}" if f.dst else folder
            if f.kind == "dir":
                self._ensure(target, made)
                continue
            self._ensure(target.rsplit("/", 1)[0], made)
            if f.kind == "link":
                self.sftp.symlink(f.target, target)
            else:
                self.sftp.put(f.src, target)
                self.sftp.chmod(target, f.mode)

    def _ensure(self, path: str, made: set[str]) -> None:
        if path in made or "/" not in path.strip("/"):
            return   # known, or a top folder (/tmp): there
        self._ensure(path.rsplit("/", 1)[0], made)
        with suppress(OSError):   # there already (in our private root: ours); a real fault fails the next write
            self.sftp.mkdir(path, mode=0o700)
        made.add(path)


class ExecFiles:
    """Sftp's staging calls for a node whose sshd has no SFTP: each put_files is one
    tar stream into runners/stage_writer.py, run with the node's python (the root is
    checked there, with the agent's own root_fault, before anything is written)."""

    def __init__(self, session, node: NodeEntry):
        self.session = session
        self.node = node
        self.root = node.job_root

    def private_root(self, path: str, node_name: str) -> None:
        self.root = path   # checked by the writer with every batch

    def put_files(self, files, folder: str, made: set[str]) -> None:
        status, _out, err = exec_command(self.session(), writer_argv(self.node.python, self.root, folder),
                                         stdin=tar_stream(files), timeout=120)
        if status == 0:
            return
        last = (err.decode(errors="replace").strip().splitlines() or [f"exit {status}"])[-1]
        if last.startswith("refused: "):
            raise UsageError(f"node {self.node.name}: {last[len('refused: '):]}", ROOT_HINT)
        raise PaiError(f"node {self.node.name}: writing the job's files (no SFTP there) failed: {last}")

    def close(self) -> None:
        pass


def writer_argv(python: str, root: str, folder: str) -> list[str]:
    """stage_writer.main run from its source, handed the agent's root check: both
    loaded as modules of their own (not __main__), nothing staged first."""
    program = (
        "import sys\n"
        "agent, writer = {'__name__': 'paicli_node_agent'}, {'__name__': 'paicli_stage_writer'}\n"
        f"exec(compile({AGENT_SOURCE.read_text()!r}, 'node_agent.py', 'exec'), agent)\n"
        f"exec(compile({WRITER_SOURCE.read_text()!r}, 'stage_writer.py', 'exec'), writer)\n"
        "sys.exit(writer['main'](sys.argv[1:], agent['root_fault']))\n")
    return [python, "-c", program, root, folder]


class Connections:
    """SSH connections per node, opened on first use, shared by threads;
    `session()` opens another connection when the node refuses one more channel
    (MaxSessions)."""

    MAX_PER_NODE = 32

    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts
        self._clients: dict[str, object] = {}
        self._extra: dict[str, list] = {}
        self._lock = threading.Lock()

    def session(self, node: NodeEntry, timeout: float = 30.0):
        """A new session channel to the node."""
        paramiko = _paramiko()
        tried = [self.get(node)]
        with self._lock:
            tried += [c for c in self._extra.get(node.name, []) if _transport_active(c)]
        for client in tried:
            try:
                return client.get_transport().open_session(timeout=timeout)
            except paramiko.ChannelException:
                continue   # this connection has its MaxSessions channels
        with self._lock:
            if len(self._extra.get(node.name, [])) + 1 >= self.MAX_PER_NODE:
                raise NodeUnreachable(f"node {node.name}: refuses more SSH sessions "
                                      f"({self.MAX_PER_NODE} connections open)",
                                      "raise MaxSessions in its sshd_config") from None
        client = connect(node, self.known_hosts)
        with self._lock:
            self._extra.setdefault(node.name, []).append(client)
        return client.get_transport().open_session(timeout=timeout)

    def get(self, node: NodeEntry):
        with self._lock:
            client = self._clients.get(node.name)
            if client is not None:
                if _transport_active(client):
                    return client
                client.close()
                del self._clients[node.name]
        new = connect(node, self.known_hosts)
        with self._lock:
            client = self._clients.setdefault(node.name, new)   # another thread's, if it was quicker
        if client is not new:
            new.close()
        return client

    def drop(self, node: NodeEntry) -> None:
        with self._lock:
            clients = [self._clients.pop(node.name, None), *self._extra.pop(node.name, [])]
        for client in clients:
            if client is not None:
                client.close()

    def close(self) -> None:
        """Close every connection and wait for paramiko's threads to end (so that a
        process that only probed nodes can fork without threads)."""
        with self._lock:
            clients = [*self._clients.values(), *(c for extra in self._extra.values() for c in extra)]
            self._clients, self._extra = {}, {}
        for client in clients:
            transport = client.get_transport()
            client.close()
            if transport is not None and transport is not threading.current_thread():
                transport.join(2.0)
