"""Port assignment for listening instances.

A port is free when it can be bound now and no live paicli job holds it in the
store's `ports` table; the claim in the store is what keeps two concurrent jobs
from picking the same port between the probe and the instance's own bind.
"""

from __future__ import annotations

import socket

from paicli.store import Store


def probe_free_port(host: str) -> int:
    """A port the kernel considers free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def allocate_ports(store: Store, job_id: str, host: str, count: int) -> list[int]:
    ports: list[int] = []
    for _ in range(count * 50):
        if len(ports) == count:
            break
        port = probe_free_port(host)
        # Instances may bind 0.0.0.0 rather than the host they were given.
        if port in ports or not can_bind("0.0.0.0", port):
            continue
        if store.claim_port(port, job_id):
            ports.append(port)
    if len(ports) != count:
        raise OSError(f"could not find {count} free ports on {host}")
    return ports
