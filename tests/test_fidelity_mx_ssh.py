"""Framework fidelity over SSH (issue 20): MXNet's own image-classification example,
unmodified, from ../shared/peer, on the SSH test cluster (network namespaces with
their own sshd and /tmp, tests/netns.py). The cells of tests/mx_cells.py that do not run
locally (mx_cells.SSH_CELLS: both scripts; dist_sync, dist_async, 2bit) with the workers on
two nodes. The
plain script reaches the nodes with the modules of its folder it imports (common/,
symbols/); -Dkvstore reaches it through its own --kv-store; its own --gc-type 2bit
trains through the runner's pushpull work-around. Skipped where namespaces cannot be built."""

from __future__ import annotations

import pytest

import mx_cells
from netns import can_build, module_cluster, module_nodes

REASON = can_build()
PEER_MX = mx_cells.PEER_MX
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"multi-host tests skipped: {REASON}"),
              pytest.mark.skipif(not PEER_MX.is_dir(), reason="the peer examples are not on this machine"),
              pytest.mark.mxnet]

cluster = module_cluster(3, "pmx", 180)


# 150 cpu units a node: the scheduler and the server share one, each worker has its own.
nodes = module_nodes(cpu=150, runtime="mxnet")


@pytest.mark.parametrize("cell", mx_cells.SSH_CELLS)
def test_every_cell_of_the_peer_example_runs_across_nodes(cell, cluster, nodes, tmp_path):
    """Each of mx_cells.SSH_CELLS with the workers on two nodes (train_mnist as
    the archive with our data, the nodes' /tmp being their own)."""
    info = mx_cells.check_cell(cell, mx_cells.run_cell(cell, tmp_path, archive=True))
    hosts = {f"{i['role']}:{i['index']}": i["host"] for i in info["instances"]}
    assert hosts["worker:0"] != hosts["worker:1"], hosts
    assert all(host.startswith(cluster.subnet + ".") for host in hosts.values()), hosts
