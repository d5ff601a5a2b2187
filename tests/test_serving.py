"""The serving replica (runners/serving_runner.py): its protocol functions, and a real
replica of a Caffe LeNet in the Caffe runtime (Python 3.9) answering both protocols,
refusing bad input in each protocol's form while it goes on serving, batching
concurrent requests, and draining on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from paicli.runners import serving_runner as sr
from paicli.runners.runtimes import get_runtime, runner_path
from conftest import wait_until
from serving_client import Client, conformance, flatten

# -- the protocol functions ---------------------------------------------------------------

IMAGE = sr.Tensor("image", "float32", [-1, 2, 3])
MASK = sr.Tensor("mask", "int64", [-1])


def test_routes_of_both_protocols():
    cases = {
        ("GET", "/v1/models/m"): ("v1", "status", "m", ""),
        ("GET", "/v1/models/m/versions/3"): ("v1", "status", "m", "3"),
        ("GET", "/v1/models/m/versions/3/metadata"): ("v1", "metadata", "m", "3"),
        ("POST", "/v1/models/m:predict"): ("v1", "predict", "m", ""),
        ("POST", "/v1/models/m/versions/2:predict"): ("v1", "predict", "m", "2"),
        ("GET", "/v2/health/live"): ("v2", "live", "", ""),
        ("GET", "/v2/health/ready"): ("v2", "ready", "", ""),
        ("GET", "/v2"): ("v2", "server", "", ""),
        ("GET", "/v2/models/m/versions/1"): ("v2", "model", "m", "1"),
        ("GET", "/v2/models/m/ready"): ("v2", "model_ready", "m", ""),
        ("POST", "/v2/models/m/versions/1/infer"): ("v2", "infer", "m", "1"),
    }
    for (method, path), want in cases.items():
        got = sr.route(method, path)
        assert (got.protocol, got.action, got.name, got.version) == want, path
    for method, path, status in (("GET", "/v1/models/m:predict", 405), ("POST", "/v2/models/m", 405),
                                 ("GET", "/v3/x", 404), ("POST", "/v1/models/m:classify", 400),
                                 ("GET", "/v1/models/m/labels/stable", 404)):
        with pytest.raises(sr.HttpError) as err:
            sr.route(method, path)
        assert err.value.status == status, path
    with pytest.raises(sr.HttpError) as err:
        sr.route("GET", "/v2/models/m/infer")
    assert err.value.allow == "POST"


def test_tf_row_and_column_forms():
    rows = [[[1, 2, 3], [4, 5, 6]], [[0, 0, 0], [1, 1, 1]]]
    arrays, form = sr.parse_tf_predict({"instances": rows}, [IMAGE])
    assert form == "row" and arrays["image"].dtype == np.float32 and arrays["image"].shape == (2, 2, 3)
    arrays, form = sr.parse_tf_predict({"inputs": {"image": rows}}, [IMAGE])
    assert form == "column" and arrays["image"].shape == (2, 2, 3)
    # several inputs: an object per row, named
    arrays, _ = sr.parse_tf_predict({"instances": [{"image": rows[0], "mask": 1}, {"image": rows[1], "mask": 0}]},
                                    [IMAGE, MASK])
    assert arrays["mask"].tolist() == [1, 0] and arrays["mask"].dtype == np.int64
    out = {"p": np.array([[0.5, 0.5], [1.0, 0.0]], np.float32)}
    assert sr.tf_response(out, "row") == {"predictions": [[0.5, 0.5], [1.0, 0.0]]}
    assert sr.tf_response(out, "column") == {"outputs": [[0.5, 0.5], [1.0, 0.0]]}
    two = {**out, "k": np.array([1, 0])}
    assert sr.tf_response(two, "row") == {"predictions": [{"p": [0.5, 0.5], "k": 1}, {"p": [1.0, 0.0], "k": 0}]}
    assert sr.tf_response(two, "column") == {"outputs": {"p": [[0.5, 0.5], [1.0, 0.0]], "k": [1, 0]}}


@pytest.mark.parametrize("body, words", [
    ([1, 2], "JSON object"),
    ({"instances": [1], "inputs": [1]}, "exactly one"),
    ({"instances": []}, "non-empty"),
    ({"instances": [[[1, 2, 3]]]}, "shape [1, 1, 3]"),
    ({"instances": [[[1, 2, 3], [4, 5]]]}, "rectangular"),
    ({"instances": [[["a", "b", "c"], ["d", "e", "f"]]]}, "strings given"),
    ({"instances": [{"image": [[1, 2, 3], [4, 5, 6]], "extra": 1}]}, "unknown input(s) ['extra']"),
    ({"signature_name": "other", "instances": [1]}, "signature_name"),
])
def test_tf_bad_bodies_are_400s_that_say_why(body, words):
    with pytest.raises(sr.HttpError) as err:
        sr.parse_tf_predict(body, [IMAGE])
    assert err.value.status == 400 and words in err.value.message


def test_v2_tensors_flat_or_nested_and_the_answer():
    flat = {"name": "image", "shape": [1, 2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}
    arrays, wanted, echo = sr.parse_v2_infer({"id": "42", "inputs": [flat]}, [IMAGE], [MASK])
    assert arrays["image"].tolist() == [[[1, 2, 3], [4, 5, 6]]] and wanted == ["mask"] and echo == {"id": "42"}
    arrays, _, echo = sr.parse_v2_infer({"inputs": [{**flat, "data": [[[1, 2, 3], [4, 5, 6]]]}]}, [IMAGE], [MASK])
    assert arrays["image"].shape == (1, 2, 3) and echo == {}
    answer = sr.v2_response("m", "1", {"mask": np.array([[1, 2]], np.int64)}, ["mask"], {"id": "7"})
    assert answer == {"model_name": "m", "model_version": "1", "id": "7",
                      "outputs": [{"name": "mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}]}


@pytest.mark.parametrize("change, words", [
    ({"datatype": "INT32"}, "datatype INT32, the model takes FP32"),
    ({"data": [1, 2, 3]}, "3 values for shape [1, 2, 3] (6 expected)"),
    ({"shape": [2, 3]}, "shape [2, 3], the model takes [-1, 2, 3]"),
    ({"name": "other"}, "no input 'other'"),
    ({"shape": "1,2,3"}, "shape must be a list"),
    ({"data": [True] * 6}, "booleans given"),
])
def test_v2_bad_tensors_are_400s_that_say_why(change, words):
    tensor = {"name": "image", "shape": [1, 2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6], **change}
    with pytest.raises(sr.HttpError) as err:
        sr.parse_v2_infer({"inputs": [tensor]}, [IMAGE], [MASK])
    assert err.value.status == 400 and words in err.value.message
    with pytest.raises(sr.HttpError, match="no output"):
        sr.parse_v2_infer({"inputs": [{**tensor, **{"name": "image", "shape": [1, 2, 3], "datatype": "FP32",
                                                   "data": [0] * 6}}], "outputs": [{"name": "x"}]},
                          [IMAGE], [MASK])


def test_requests_combine_into_one_batch_and_split_back():
    parts = [{"x": np.full((n, 2), n, np.float32)} for n in (1, 3, 2)]
    joined, sizes = sr.combine(parts)
    assert joined["x"].shape == (6, 2) and sizes == [1, 3, 2]
    back = sr.split({"y": joined["x"] * 2}, sizes)
    assert [b["y"].tolist() for b in back] == [(p["x"] * 2).tolist() for p in parts]
    assert sr.batch_key(parts[0]) == sr.batch_key(parts[1]) != sr.batch_key({"x": np.zeros((1, 3), np.float32)})


def test_the_batcher_calls_the_model_once_for_concurrent_requests_and_isolates_a_bad_one():
    calls = []

    def model(arrays):
        calls.append(len(arrays["x"]))
        if (arrays["x"] < 0).any():
            raise ValueError("negative input")
        return {"y": arrays["x"] + 1}

    batcher = sr.Batcher(model, max_rows=8, timeout=0.5, threads=1)
    answers, errors = {}, {}

    def ask(i, value):
        try:
            answers[i] = batcher.run({"x": np.full((2, 1), value, np.float32)})["y"].ravel().tolist()
        except ValueError as err:
            errors[i] = str(err)

    threads = [threading.Thread(target=ask, args=(i, v)) for i, v in enumerate((1, 2, -1, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == {0: [2, 2], 1: [3, 3], 3: [5, 5]} and errors == {2: "negative input"}
    assert calls[0] == 8   # all four at once, then each alone again after the failure
    assert sorted(calls[1:]) == [2, 2, 2, 2]


# -- a real replica: Caffe's LeNet in the Caffe runtime ------------------------------------

LENET = """name: "LeNet"
layer { name: "data" type: "Input" top: "data" input_param { shape: { dim: 1 dim: 1 dim: 28 dim: 28 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 5 stride: 2 weight_filler { type: "xavier" } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
"""
# The model's answer in pycaffe's own process: the reference the replica must match.
IN_PROCESS = """import json, sys, numpy as np, caffe
net = caffe.Net(sys.argv[1], caffe.TEST, weights=sys.argv[2])
rows = np.array(json.load(open(sys.argv[3])), np.float32)
net.blobs["data"].reshape(*rows.shape)
net.blobs["data"].data[...] = rows
print(json.dumps(net.forward()["prob"].tolist()))
"""
MAKE = """import caffe
caffe.Net("deploy.prototxt", caffe.TEST).save("lenet.caffemodel")
"""


def caffe_python() -> str:
    runtime = get_runtime("caffe")
    if not runtime.is_installed():
        pytest.skip("the caffe runtime is not provisioned (`pai runtime install caffe`)")
    return runtime.python()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(folder, *flags, env=None):
    """The runner started by hand as an instance would be: (process, URL, its output file)."""
    port = free_port()
    out = open(folder / f"replica-{port}.log", "w+")
    proc = subprocess.Popen([caffe_python(), "-u", runner_path("serving_runner.py"), "--model",
                             str(folder / "deploy.prototxt"), "--weights", str(folder / "lenet.caffemodel"),
                             "--kind", "caffe", "--name", "lenet", *flags],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PAI_HOST": "127.0.0.1", "PAI_PORT": str(port),
                                 "GLOG_minloglevel": "2", **(env or {})})
    wait_until(lambda: "ready on" in read(out) or proc.poll() is not None, timeout=60)
    assert proc.poll() is None, read(out)
    return proc, f"http://127.0.0.1:{port}", out


def read(out) -> str:
    out.flush()
    with open(out.name) as f:
        return f.read()


@pytest.fixture(scope="module")
def lenet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lenet")
    (folder / "deploy.prototxt").write_text(LENET)
    subprocess.run([caffe_python(), "-c", MAKE], cwd=folder, check=True, capture_output=True,
                   env={**os.environ, "GLOG_minloglevel": "2"})
    return folder


@pytest.fixture(scope="module")
def replica(lenet):
    proc, url, out = start_replica(lenet, "--max-batch-size", "8", "--batch-timeout-micros", "200000",
                                   "--max-body-bytes", "65536", env={"PAI_SERVING_TOKEN": "s3cret"})
    yield url, out
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def in_process(folder, rows) -> list:
    (folder / "rows.json").write_text(json.dumps(rows))
    done = subprocess.run([caffe_python(), "-c", IN_PROCESS, "deploy.prototxt", "lenet.caffemodel", "rows.json"],
                          cwd=folder, check=True, capture_output=True, text=True,
                          env={**os.environ, "GLOG_minloglevel": "2"})
    return json.loads(done.stdout)


def images(n: int, seed: int = 0) -> list:
    return np.random.RandomState(seed).rand(n, 1, 28, 28).astype(np.float32).tolist()


@pytest.mark.caffe
def test_a_replica_answers_both_protocols_as_pycaffe_does(lenet, replica):
    url, out = replica
    rows = images(3)
    client = Client(url, {"X-Pai-Token": "s3cret"})
    got = conformance(client, "lenet", rows)
    want = np.array(in_process(lenet, rows))
    for way, predictions in got.items():
        assert np.allclose(np.array(predictions), want, atol=1e-6), way
    assert "POST /v1/models/lenet:predict 200" in read(out)


@pytest.mark.caffe
def test_bad_requests_get_their_errors_and_the_replica_goes_on(lenet, replica):
    url, out = replica
    client = Client(url, {"X-Pai-Token": "s3cret"})
    good = {"instances": images(1)}
    tensor = {"name": "data", "shape": [1, 1, 28, 28], "datatype": "FP32", "data": flatten(images(1))}
    cases = [
        (400, "POST", "/v1/models/lenet:predict", None, b"{not json"),
        (400, "POST", "/v2/models/lenet/infer", None, b"{not json"),
        (400, "POST", "/v1/models/lenet:predict", {"instances": [[1, 2, 3]]}, None),
        (400, "POST", "/v2/models/lenet/infer", {"inputs": [{**tensor, "datatype": "FP64"}]}, None),
        (400, "POST", "/v1/models/lenet:predict", {"instances": [[[["x"] * 28] * 28]]}, None),
        (404, "POST", "/v1/models/other:predict", good, None),
        (404, "POST", "/v1/models/lenet/versions/9:predict", good, None),
        (404, "GET", "/v2/models/other", None, None),
        (404, "POST", "/v2/models/lenet/versions/9/infer", {"inputs": [tensor]}, None),
        (413, "POST", "/v1/models/lenet:predict", {"instances": images(20)}, None),
        (405, "GET", "/v1/models/lenet:predict", None, None),
        (405, "DELETE", "/v2/models/lenet", None, None),
    ]
    for status, method, path, body, raw in cases:
        answer = client.tf_error(method, path, body, raw)
        assert answer.status == status, (path, answer.body)
        # ...and the next request is served
        assert len(client.tf_predict_rows("lenet", good["instances"])) == 1
    no_token = Client(url)
    assert no_token.tf_error("GET", "/v2/health/ready").status == 401
    assert Client(url, {"X-Pai-Token": "wrong"}).tf_error("POST", "/v1/models/lenet:predict", good).status == 401
    assert client.v2_infer("lenet", [tensor])["prob"]["shape"] == [1, 10]
    assert "POST /v1/models/other:predict 404" in read(out)


@pytest.mark.caffe
def test_concurrent_requests_are_one_call_of_the_model(lenet, replica):
    url, out = replica
    rows = images(8, seed=1)
    want = np.array(in_process(lenet, rows))
    answers = {}

    def ask(i):
        client = Client(url, {"X-Pai-Token": "s3cret"})
        answers[i] = client.tf_predict_rows("lenet", rows[2 * i:2 * i + 2])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = np.array([p for i in range(4) for p in answers[i]])
    assert np.allclose(got, want, atol=1e-6)
    wait_until(lambda: "2 rows in a batch of" in read(out))


@pytest.mark.caffe
def test_sigterm_answers_the_requests_in_flight_then_exits_0(lenet):
    # A batch that waits 3 s for company: the request is surely in flight when SIGTERM comes.
    proc, url, out = start_replica(lenet, "--max-batch-size", "64", "--batch-timeout-micros", "3000000")
    try:
        answer = {}
        asking = threading.Thread(target=lambda: answer.update(rows=Client(url).tf_predict_rows("lenet", images(1))))
        asking.start()
        time.sleep(1)   # the request read and waiting in its batch
        os.kill(proc.pid, signal.SIGTERM)
        asking.join(30)
        assert len(answer["rows"]) == 1
        assert proc.wait(30) == 0
        assert "serving lenet: stopped" in read(out)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5).close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
