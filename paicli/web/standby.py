"""The logview server's first life: a bare interpreter holding the listening socket.

    main(["--home", "~/.pai", "--fd", "N"])   (started by paicli.web.launch, cluster.spawn)

Most printed URLs are never opened, so the process imports no web library until
the first connection (queued by the kernel meanwhile); then it becomes the aiohttp
server (paicli.web.server) in the same process, keeping the pid and state file
`launch` recorded. It leaves by the server's rules: idle too long, or its state
file gone or taken over.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import time
from pathlib import Path

from paicli.web.launch import check_every, forget_state, idle_limit, reason_to_exit


def wait_for_first_visit(home: Path, sock: socket.socket) -> bool:
    """True when a connection is waiting on the socket; False when the standby
    should leave instead (said in server.log)."""
    idle = idle_limit()
    born = time.monotonic()
    while True:
        ready, _, _ = select.select([sock], [], [], check_every(idle))
        if ready:
            return True
        age = time.monotonic() - born
        why = reason_to_exit(home, os.getpid(), age, age, 0, idle)
        if why:
            print(f"{why} before any visit: exiting", flush=True)
            forget_state(home, os.getpid())
            return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="paicli.web.standby")
    parser.add_argument("--home", required=True, type=Path)
    parser.add_argument("--fd", required=True, type=int, help="an already listening socket")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # its own session: no terminal to lose anyway
    sock = socket.socket(fileno=args.fd)
    print(f"logview standing by for {args.home} on {sock.getsockname()}", flush=True)
    if not wait_for_first_visit(args.home, sock):
        return 0

    from paicli.web import server   # aiohttp: only once a page is asked for

    return server.run(args.home, sock)

