"""Instances as local processes, each in a session (and process group) of its own."""

from __future__ import annotations

import fcntl
import os
import subprocess

from paicli.cluster.backends.base import Backend, Handle
from paicli.cluster.procinfo import live_members


def signal_group(pgid: int, signum: int) -> bool:
    """False when the group no longer exists."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def group_exists(pgid: int) -> bool:
    """True while any process of the group is alive (zombies excluded)."""
    try:
        os.killpg(pgid, 0)  # cheap first answer; it also succeeds for zombies
    except (ProcessLookupError, PermissionError):
        return False
    return live_members(pgid)


F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_BYTES = 4096


class LocalBackend(Backend):
    host = "127.0.0.1"

    def start(self, argv, env, cwd):
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=write_fd, stderr=write_fd, start_new_session=True,
                                    close_fds=True)
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
        return Handle(pid=proc.pid, pgid=proc.pid, output_fd=read_fd, host=self.host, native=proc)

    def poll(self, handle):
        return handle.native.poll()

    def wait(self, handle):
        return handle.native.wait()

    def signal(self, handle, signum):
        signal_group(handle.pgid, signum)
