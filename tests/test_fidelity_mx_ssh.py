"""Framework fidelity over SSH (issue 20): MXNet's own image-classification example,
unmodified, from ../shared/peer, on the SSH test cluster (network namespaces with
their own sshd and /tmp, tests/netns.py). The plain script reaches the nodes with
the modules of its folder it imports (common/, symbols/); -Dkvstore reaches it
through its own --kv-store; its own --gc-type 2bit trains through the runner's
pushpull work-around. Skipped where namespaces cannot be built."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT, job_id_from, pai, pai_json
from netns import can_build, module_cluster, module_nodes

REASON = can_build()
PEER_MX = ROOT.parent / "shared" / "peer" / "mxnet" / "image-classification"
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"multi-host tests skipped: {REASON}"),
              pytest.mark.skipif(not PEER_MX.is_dir(), reason="the peer examples are not on this machine"),
              pytest.mark.mxnet]

IMAGENET_ARGS = ("--benchmark 1 --network lenet --image-shape 1,28,28 --num-classes 10 --num-examples 1280 "
                 "--batch-size 32 --num-epochs 1 --disp-batches 5 --gc-type 2bit")


cluster = module_cluster(3, "pmx", 180)


# 150 cpu units a node: the scheduler and the server share one, each worker has its own.
nodes = module_nodes(cpu=150, runtime="mxnet")


def test_peer_train_imagenet_with_its_own_2bit_flag_across_nodes(cluster, nodes, tmp_path):
    result = pai("-name", "mxnet", f"-Dscript=file://{PEER_MX / 'train_imagenet.py'}",
                 '-Dcluster={"server":{"count":1},"worker":{"count":2}}', f"-DuserDefinedParameters={IMAGENET_ARGS}",
                 cwd=tmp_path, timeout=300)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines[-1] == "OK", result.stdout[-3000:] + result.stderr[-2000:]
    info = pai_json("status", job_id_from(result.stdout))
    hosts = {f"{i['role']}:{i['index']}": i["host"] for i in info["instances"]}
    assert hosts["worker:0"] != hosts["worker:1"], hosts
    for worker in ("worker:0", "worker:1"):
        assert {"epoch", "batch", "speed", "accuracy", "epoch_seconds"} <= set(info["metrics"][worker])
        assert re.search(rf"\[{worker}\] mxnet_runner: distributed: {worker} made \d+ pushes to kvstore 'dist_sync'",
                         result.stdout)
    assert "passing --kv-store=dist_sync (-Dkvstore)" in result.stdout
    assert info["step_seconds"] and info["not_distributed"] is None
