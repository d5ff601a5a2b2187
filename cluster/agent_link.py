"""The master's side of the node agent's wire protocol (runners/node_agent.py), once.

A backend provides only a *transport* for one instance's agent (a pipe, an SSH
channel, a Ray actor); this module sends the spec, reads the identity (or the E
frame) with a deadline, turns O frames into output and X into the exit status,
keeps the heartbeat both ways, and stops the instance with t/k bytes.

    class Transport(Protocol):
        send(data)                  raises (OSError, EOFError, ...) when the link is gone
        recv(max_bytes, timeout)    b"" at EOF; raises TimeoutError (socket.timeout
                                    is one) when nothing came in `timeout` seconds,
                                    anything else when the link is gone
        close()
        OPTIONAL, a transport on this machine (the local backend's pipes):
        fileno()                    the agent's frames, readable without blocking:
                                    read by the link itself, no pump thread
        output_fd, agent_output_fd  a pipe (read end here; write end as the agent
                                    knows it) the agent hands to the instance as its
                                    stdout and stderr: output crosses no extra hop
        ending()                    once closed, how the agent ended ("" unknown):
                                    said in the line of a start it never answered

    start_instance(transport, spec, *, backend, node, host, start_timeout, sink=None) -> Handle
        spec = {"argv", "env", "cwd", "heartbeat"} (+ "inherit", "output_fd",
        "watch": see the agent). `sink(kind, payload)` takes the file frames (F, D,
        S, L, Z: cluster/outputs.py). Raises OSError for an E frame (the program
        could not be started); a transport failure gives a Handle whose poll()
        reports NODE_LOST.
    send_spec(transport, spec, sink=None) -> Starting; .started(backend=, node=, host=, start_timeout=)
        the same in two halves: the spec goes now, the identity is read later
        (the master sends every instance's spec before it reads any identity).

The Handle's `native` is a Link: `poll()` is the exit status (None while it runs),
`wait()` blocks for it, `signal(signum)` asks the agent to signal the group.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import threading
import time
from typing import Protocol

from paicli.cluster.backends.base import NODE_LOST, Handle, InstanceRef
from paicli.runners.node_outputs import FRAME_FORMAT, MAX_FRAME

HEAD = struct.Struct(FRAME_FORMAT)
FILE_FRAMES = (b"F", b"D", b"S", b"L", b"Z")
PUMP_READ = 1 << 20           # a read of the pump: files travel in 256 KB frames (output in small ones)
TRANSFER_QUIET = 30.0         # seconds without a file frame after which a wait stops extending
BEAT_EVERY = 1.0              # seconds between the master's heartbeat bytes


class Transport(Protocol):
    def send(self, data: bytes) -> None: ...
    def recv(self, max_bytes: int, timeout: float) -> bytes: ...
    def close(self) -> None: ...


class Link:
    """One live instance: its transport, the frames read so far, its status. Where
    the transport carries the output (SSH, Ray), a thread turns O frames into a pipe
    the master select()s on; locally (`fileno()`) poll()/wait() read the frames."""

    def __init__(self, transport: Transport, node: str, heartbeat: float = 0.0):
        self.transport = transport
        self.node = node
        self.heartbeat = heartbeat      # seconds of silence that mean a dropped link
        self.status: int | None = None
        self.first: tuple[bytes, bytes] | None = None   # the I or E frame
        self._buf = bytearray()         # bytes of an incomplete frame
        self._pending = bytearray()     # output decoded before the pump started
        self._lock = threading.Lock()
        self._closed = False
        self.fd = -1                    # what the master select()s on, reads and closes
        self._write_fd = -1             # pump mode: our end of the master's pipe
        self.thread: threading.Thread | None = None
        fileno = getattr(transport, "fileno", None)
        self._control = fileno() if fileno is not None else -1   # local mode: the frames' fd
        self.sink = None                # file frames go there (cluster/outputs.py)
        self.last_file = 0.0            # when the last file frame came: a transfer under way
        self.refused: str | None = None   # why the stream was dropped: a frame no agent sends

    def feed(self, data: bytes) -> bytes:
        """Decode `data` (any slice of the stream); the output bytes it completes.
        A file's data goes to the sink as a view of what was read (no copy: a
        gigabyte of outputs passes through here). A frame longer than MAX_FRAME
        ends the link: nothing more is read, and the sink is told."""
        if self.refused:
            return b""
        if self._buf:
            self._buf += data
            data = self._buf
        out = []
        pos, end = 0, len(data)
        with memoryview(data) as view:
            while end - pos >= 5:
                kind, length = HEAD.unpack_from(view, pos)
                if length > MAX_FRAME:
                    self.refused = f"a frame of {length} bytes (at most {MAX_FRAME})"
                    break
                if end - pos - 5 < length:
                    break
                payload = view[pos + 5:pos + 5 + length]
                pos += 5 + length
                if kind == b"D" and self.sink is not None:
                    self.last_file = time.monotonic()
                    self.sink(kind, payload)
                elif kind == b"O":
                    out.append(bytes(payload))
                elif kind == b"X":
                    self.status = int(json.loads(bytes(payload))["status"])
                elif kind in (b"I", b"E"):
                    self.first = (kind, bytes(payload))
                elif kind in FILE_FRAMES and self.sink is not None:
                    self.last_file = time.monotonic()
                    self.sink(kind, bytes(payload))
                payload.release()
            kept = data is self._buf and pos == 0   # a frame still incomplete: nothing to copy
            rest = b"" if kept or pos >= end else bytes(view[pos:])
        if self.refused:
            self._buf, self.status = bytearray(), NODE_LOST if self.status is None else self.status
            if self.sink is not None:
                self.sink(b"!", self.refused.encode())
        elif not kept:
            self._buf = bytearray(rest)
        return b"".join(out)

    def _recv(self, timeout: float) -> bytes | None:
        """The next bytes of the stream; None when none came within `timeout`."""
        if self._control < 0:
            try:
                return self.transport.recv(65536, timeout)
            except TimeoutError:
                return None
        if not select.select([self._control], [], [], timeout)[0]:
            return None
        try:
            return os.read(self._control, 65536)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _read_first(self, deadline: float) -> None:
        """Read until the I or E frame (output after it, pump mode, waits in _pending)."""
        while self.first is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the node agent")
            data = self._recv(min(left, 1.0))
            if data == b"":
                raise EOFError("the node agent ended before it started the instance")
            self._pending += self.feed(data or b"")

    def _take(self, timeout: float) -> None:
        """Local mode: read the agent's frames (no output travels there)."""
        data = self._recv(timeout) if not self._closed else b""
        if data == b"":
            self._ended()
        elif data:
            self.feed(data)

    @property
    def frames_fd(self) -> int:
        """Local mode: the agent's frames (the exit status comes there), for the
        master's select(); -1 otherwise, and once the link is closed."""
        return -1 if self._closed else self._control

    def poll(self) -> int | None:
        if self.thread is not None and self.thread.is_alive():
            return None    # pump mode: the status counts once every byte before it is in the pipe
        if self.status is None and self._control >= 0:
            self._take(0)
        if self.status is not None:
            self._finish()
        return self.status

    def wait(self, timeout: float | None = None) -> int | None:
        """Block up to `timeout` (None: for ever) for the status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() - self.last_file < TRANSFER_QUIET:
                deadline = max(deadline, time.monotonic() + 0.2)   # files are still coming back
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                break
            if self._control >= 0:
                self._take(left)
            elif self.thread is not None:
                self.thread.join(left)
            else:
                time.sleep(left)
        return self.status if self._closed else None

    def signal(self, signum: int) -> bool:
        """SIGKILL or SIGTERM to the instance's group, by the agent; False once it has ended."""
        return self.send(b"k" if signum == signal.SIGKILL else b"t")

    def send(self, data: bytes) -> bool:
        with self._lock:
            if self.status is not None or self._closed:
                return False
            try:
                self.transport.send(data)
                return True
            except Exception:  # noqa: BLE001 - OSError, EOFError or a transport's own (paramiko's)
                return False

    # -- ending ---------------------------------------------------------------------

    def _ended(self) -> None:
        """The stream ended: without an X frame the agent or its link is gone."""
        if self.status is None:
            self.status = NODE_LOST

    def _finish(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.heartbeat:
            _beat_link_ended()
        try:
            self.transport.close()
        except Exception:  # noqa: BLE001 - a transport already gone
            pass

    def pump(self) -> None:
        """Pump mode (a transport without an fd): frames -> the master's pipe, in a thread.
        Silence longer than the heartbeat means the link dropped: NODE_LOST."""
        silence = self.heartbeat or 3600.0
        try:
            data = bytes(self._pending)
            del self._pending[:]
            while True:
                _write_all(self._write_fd, data)
                if self.status is not None:
                    break
                data = self.transport.recv(PUMP_READ, silence)
                if not data:
                    break
                data = self.feed(data)
        except Exception:  # noqa: BLE001 - the link's end: OSError, TimeoutError, a transport's own
            pass
        finally:
            self._ended()
            try:
                os.close(self._write_fd)   # EOF wakes the master, which then polls
            except OSError:
                pass
            self._finish()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- the heartbeat: one thread for every live link that asks for it ---------------------

_beating: list[Link] = []
_beat_changed = threading.Condition()   # a link ended: the thread looks at once
_beat_thread: threading.Thread | None = None


def _beat() -> None:
    global _beat_thread
    while True:
        with _beat_changed:
            _beat_changed.wait(BEAT_EVERY)
            _beating[:] = [link for link in _beating if link.status is None and not link._closed]
            if not _beating:
                # Only while a link beats: spawn.py forks only a single-threaded caller.
                _beat_thread = None
                return
            links = list(_beating)
        for link in links:
            link.send(b"h")


def _keep_beating(link: Link) -> None:
    global _beat_thread
    with _beat_changed:
        _beating.append(link)
        if _beat_thread is None:
            _beat_thread = threading.Thread(target=_beat, name="agent-heartbeat", daemon=True)
            _beat_thread.start()


def _beat_link_ended() -> None:
    with _beat_changed:
        _beat_changed.notify()


# -- starting ----------------------------------------------------------------------------

def start_instance(transport: Transport, spec: dict, *, backend: str, node: str, host: str,
                   start_timeout: float, sink=None) -> Handle:
    return send_spec(transport, spec, sink).started(backend=backend, node=node, host=host,
                                                    start_timeout=start_timeout)


class Starting:
    """An instance whose spec is on its way to the agent: `started()` reads its
    identity. A master starting several instances sends every spec first, so the
    agents start them together instead of one round trip after another."""

    def __init__(self, link: Link, output_fd: int, error: Exception | None):
        self.link, self.output_fd, self.error = link, output_fd, error

    def started(self, *, backend: str, node: str, host: str, start_timeout: float) -> Handle:
        link, output_fd = self.link, self.output_fd
        link.node = node
        try:
            if self.error is not None:
                raise self.error
            link._read_first(time.monotonic() + start_timeout)
        except Exception as err:  # noqa: BLE001 - OSError, EOFError, TimeoutError or a transport's own
            _give_up(link, output_fd)
            ending = getattr(link.transport, "ending", None)   # a local agent: how it ended
            how = ending() if ending is not None else ""
            return lost_handle(backend, node, host, f"{err.__class__.__name__}: {err}" + (f" ({how})" if how else ""))
        kind, payload = link.first
        if kind == b"E":
            _give_up(link, output_fd)
            data = json.loads(payload)
            raise OSError(data.get("errno") or 0, data.get("strerror") or "cannot start")   # ENOENT: FileNotFoundError
        ident = json.loads(payload)
        ref = InstanceRef(backend=backend, node=node, host=host, pid=int(ident["pid"]), pgid=int(ident["pgid"]),
                          start=ident.get("start") or None, boot_id=ident.get("boot") or None)
        if output_fd >= 0:
            link.fd = output_fd
        else:
            link.fd, link._write_fd = os.pipe()
            os.set_blocking(link.fd, False)
            link.thread = threading.Thread(target=link.pump, name=f"agent-pump-{node}-{ref.pid}", daemon=True)
            link.thread.start()
        if link.heartbeat:
            _keep_beating(link)
        return Handle(ref=ref, output_fd=link.fd, native=link)


def send_spec(transport: Transport, spec: dict, sink=None) -> Starting:
    """The first half of start_instance: the spec goes to the agent, nothing is
    waited for (a failure to send is reported by `started()`)."""
    link = Link(transport, "", float(spec.get("heartbeat") or 0))
    link.sink = sink
    output_fd = getattr(transport, "output_fd", -1)
    if output_fd >= 0:
        spec = dict(spec, output_fd=transport.agent_output_fd)
    try:
        transport.send(json.dumps(spec).encode() + b"\n")
    except Exception as err:  # noqa: BLE001 - OSError, EOFError or a transport's own
        return Starting(link, output_fd, err)
    return Starting(link, output_fd, None)


def _give_up(link: Link, output_fd: int) -> None:
    link._finish()
    if output_fd >= 0:
        os.close(output_fd)


class _Gone:
    """The transport of an instance that never started."""

    def send(self, data: bytes) -> None:
        raise OSError("closed")

    def recv(self, max_bytes: int, timeout: float) -> bytes:
        return b""

    def close(self) -> None:
        pass


def lost_handle(backend: str, node: str, host: str, why: str) -> Handle:
    """The node did not take the instance: a handle that says why and reports NODE_LOST."""
    link = Link(_Gone(), node)
    link.status = NODE_LOST
    read_fd, write_fd = os.pipe()
    os.write(write_fd, f"paicli: node {node} did not start the instance: {why}\n".encode()[:4000])
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    link.fd = read_fd
    ref = InstanceRef(backend=backend, node=node, host=host, pid=0, pgid=0, start=None, boot_id=None)
    return Handle(ref=ref, output_fd=read_fd, native=link)
