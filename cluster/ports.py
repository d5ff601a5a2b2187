"""Port assignment for listening instances, on the node each one was placed on.

The backend picks ports free ON the node (`Backend.pick_ports`); a port is taken
only once the store's claims table gives it to this job, so two jobs never share one.
"""

from __future__ import annotations

from paicli.cluster.backends import get_backend
from paicli.store import Store


def allocate_ports(store: Store, job_id: str, host: str, count: int, backend=None, node: str = "local") -> list[int]:
    """`count` ports on `node` (address `host`), claimed for `job_id`."""
    if backend is None:
        backend = get_backend({"backend": "local"})
    ports: list[int] = []
    refused: set[int] = set()
    for _ in range(50):
        if len(ports) == count:
            break
        for port in backend.pick_ports(node, count - len(ports), taken=set(ports) | refused):
            if store.claim_port(port, job_id, node):
                ports.append(port)
            else:
                refused.add(port)
    if len(ports) != count:
        raise OSError(f"could not find {count} free ports on {node} ({host})")
    return ports
