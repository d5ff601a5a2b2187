"""Models trained by paicli jobs, served by a replica on each of two SSH nodes (real
hosts, tests/netns.py): the model staged to the nodes, each replica answering as the
framework does in process, the router on this machine in front of both."""

from __future__ import annotations

from urllib.parse import urlsplit

import numpy as np
import pytest

from netns import module_cluster, module_nodes
from serving_client import Client
from test_serving_jobs import ROWS, check_service, serve, trained

cluster = module_cluster(2, "psv", 240)
nodes = module_nodes(cpu=100)   # one replica fits a node: two replicas, two nodes


@pytest.mark.parametrize("framework, kind", [
    pytest.param("tensorflow", "savedmodel", marks=pytest.mark.tensorflow),
    pytest.param("mxnet", "gluon", marks=pytest.mark.mxnet),
    pytest.param("caffe", "caffe", marks=pytest.mark.caffe),
])
def test_a_trained_model_is_served_by_a_replica_on_each_node(cluster, nodes, tmp_path, framework, kind):
    (tmp_path / "here").mkdir()
    job_id, expected = trained(framework, tmp_path, env={"PAI_NODES": ""})   # trained on this machine
    started = serve([], tmp_path, job_id, "--replicas", "2")   # the nodes fixture kills it afterwards
    ready = check_service(started, expected[kind], replicas=2)
    hosts = {urlsplit(url).hostname for url, _headers in ready}
    assert len(hosts) == 2 and all(h.startswith(cluster.subnet) for h in hosts), ready
    rows = ROWS[:, 0].tolist() if kind == "savedmodel" else ROWS.tolist()
    for url, headers in ready:
        got = Client(url, headers).tf_predict_rows(started["name"], rows)
        assert np.allclose(np.array(got), np.array(expected[kind]), atol=1e-5), url
