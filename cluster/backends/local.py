"""Instances as processes on this machine: a one-node cluster named "local".

Each instance runs in a session (and process group) of its own with default
signal dispositions, whatever the master inherited (a `pai` started from nohup
ignores SIGHUP; its instances must not).
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess

from paicli.cluster.backends.base import Backend, Handle, InstanceRef, NodeSpec
from paicli.cluster.procinfo import boot_id, live_groups, live_members, proc_stat

LOCAL_NODE = "local"
LOCAL_HOST = "127.0.0.1"
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_BYTES = 4096
# Signals a shell, nohup or a CI runner may leave ignored (SIG_IGN survives exec).
IGNORABLE_SIGNALS = ("SIGINT", "SIGHUP", "SIGTERM", "SIGQUIT", "SIGPIPE", "SIGUSR1", "SIGUSR2",
                     "SIGTTIN", "SIGTTOU", "SIGTSTP")


def unignore_signals(keep: tuple[int, ...] = ()) -> None:
    """In the process that starts instances (the master), put every ignored
    signal back to its default so that children exec with default dispositions:
    an ignored signal stays ignored across exec, a caught one is reset. SIGPIPE,
    which Python ignores, is restored in the child by Popen (restore_signals).
    `keep`: signals the caller will catch itself right after."""
    for name in IGNORABLE_SIGNALS:
        signum = getattr(signal, name)
        if signum not in keep and signum != signal.SIGPIPE and signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)


def machine_cpu() -> int:
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) * 100


def local_node() -> NodeSpec:
    from paicli.cluster.scheduler import machine_gpus, machine_memory_mb

    return NodeSpec(LOCAL_NODE, LOCAL_HOST, machine_cpu(), machine_memory_mb(), tuple(machine_gpus()))


def still_ours(ref: InstanceRef) -> bool:
    """The identity check on this machine (see base.py): same boot, and the
    group's leader is either the process we started or gone."""
    if ref.boot_id and ref.boot_id != boot_id():
        return False
    leader = proc_stat(ref.pgid)
    if leader is not None and leader.state != "Z" and ref.pgid == ref.pid and ref.start is not None \
            and leader.start != ref.start:
        return False  # the number was recycled: another process leads that group now
    return True


def group_exists(pgid: int) -> bool:
    """True while any process of the group is alive (zombies excluded)."""
    try:
        os.killpg(pgid, 0)  # cheap first answer; it also succeeds for zombies
    except (ProcessLookupError, PermissionError):
        return False
    return live_members(pgid)


class LocalBackend(Backend):
    name = "local"

    def nodes(self):
        return [local_node()]

    def pick_ports(self, node, count, taken=()):
        taken = set(taken)
        ports: list[int] = []
        for _ in range(count * 50):
            if len(ports) == count:
                break
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((LOCAL_HOST, 0))
                port = sock.getsockname()[1]
            # Instances may bind 0.0.0.0 rather than the host they were given.
            if port in ports or port in taken or not can_bind("0.0.0.0", port):
                continue
            ports.append(port)
        if len(ports) != count:
            raise OSError(f"could not find {count} free ports on {node}")
        return ports

    def start(self, placed, argv, env, cwd):
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=write_fd, stderr=write_fd, start_new_session=True,
                                    close_fds=True, restore_signals=True)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        try:
            # A small pipe keeps a burst of output from sitting in the kernel behind
            # other instances' lines (the display delay), at the price of the writer
            # waiting sooner for the master.
            fcntl.fcntl(read_fd, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
        stat = proc_stat(proc.pid)
        ref = InstanceRef(backend=self.name, node=placed.node, host=placed.host, pid=proc.pid, pgid=proc.pid,
                          start=stat.start if stat else None, boot_id=boot_id())
        return Handle(ref=ref, output_fd=read_fd, native=proc)

    def poll(self, handle):
        return handle.native.poll()

    def wait(self, handle, timeout=None):
        try:
            return handle.native.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, ref, signum):
        if not still_ours(ref):
            return False
        try:
            os.killpg(ref.pgid, signum)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _alive(self, ref):
        return still_ours(ref) and group_exists(ref.pgid)

    def _any_alive(self, refs):
        # One pass over /proc for every group, not one per group: stopping 64
        # instances polls this every few tens of milliseconds.
        groups = {ref.pgid for ref in refs if still_ours(ref)}
        return bool(groups) and bool(live_groups(groups))


def can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
