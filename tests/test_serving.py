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
from conftest import pai, wait_until
from netns import kill_unfinished_jobs
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
    # Health checks (the router's, four a second) are neither access lines nor counted.
    assert "/v2/health/" not in read(out)


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
    proc, url, out = start_replica(lenet, "--max-batch-size", "64", "--batch-timeout-micros", "3000000",
                                   "--request-log", "off")
    try:
        answer = {}
        asking = threading.Thread(target=lambda: answer.update(rows=Client(url).tf_predict_rows("lenet", images(1))))
        asking.start()
        time.sleep(1)   # the request read and waiting in its batch
        os.kill(proc.pid, signal.SIGTERM)
        asking.join(30)
        assert len(answer["rows"]) == 1
        assert proc.wait(30) == 0
        assert "serving lenet: stopped" in read(out) and "POST /v1" not in read(out)   # no access lines
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5).close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the model found, the plan, `pai serve` ---------------------------------------------------


def touch(folder, *names, text="x"):
    paths = []
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths.append(str(path))
    return paths


def test_each_kind_of_model_is_found_among_files(tmp_path):
    from paicli.adapters.serving import detect

    saved = touch(tmp_path, "models/mnist/1/saved_model.pb", "models/mnist/1/variables/variables.index")
    model = detect(saved + touch(tmp_path, "train.py"))
    assert (model.kind, model.name, model.main) == ("savedmodel", "mnist", saved[0]) and sorted(model.files) == saved
    assert detect(touch(tmp_path, "net.keras")).kind == "keras"
    gluon = detect(touch(tmp_path, "lenet-symbol.json", "lenet-0001.params", "lenet-0004.params"))
    assert (gluon.kind, gluon.name, gluon.weights.endswith("lenet-0004.params")) == ("gluon", "lenet", True)
    deploy = touch(tmp_path, "deploy.prototxt", text='layer { name: "data" type: "Input" top: "data" }')
    solver = touch(tmp_path, "solver.prototxt", text='net: "train.prototxt"\nbase_lr: 0.01')
    caffe = detect(deploy + solver + touch(tmp_path, "lenet_iter_200.caffemodel", "lenet_iter_1000.caffemodel"))
    assert (caffe.kind, caffe.main, caffe.name) == ("caffe", deploy[0], "lenet")
    assert caffe.weights.endswith("lenet_iter_1000.caffemodel")
    assert detect(touch(tmp_path, "m.onnx")).kind == "onnx"
    assert detect(solver + touch(tmp_path, "notes.txt")) is None
    from paicli.errors import UsageError
    with pytest.raises(UsageError, match="2 .keras models"):
        detect(touch(tmp_path, "a.keras", "b.keras"))


def test_the_plan_of_a_served_model(tmp_path, pai_home, monkeypatch):
    from paicli import client, serving
    from paicli.adapters.base import StagedCode
    from paicli.statement import parse_statement
    from paicli.store import Store

    monkeypatch.chdir(tmp_path)
    onnx = touch(tmp_path, "mnist.onnx")[0]
    prepared = client.prepare(parse_statement(["-name", "serving", f"-Dmodel=file://{onnx}", "-DmaxBatchSize=16",
                                               '-Dcluster={"replica":{"count":3}}', "-DservingPort=9000"]))
    serving.resolve(prepared, Store())
    plan = prepared.adapter.plan(prepared.spec, StagedCode(None, None, tmp_path))
    (role,) = plan.roles
    assert (role.name, role.count, role.listens, role.must_finish) == ("replica", 3, True, True)
    assert role.argv[role.argv.index("--kind") + 1] == "onnx" and role.argv[role.argv.index("--name") + 1] == "mnist"
    assert role.argv[role.argv.index("--max-batch-size") + 1] == "16" and len(role.env["PAI_SERVING_TOKEN"]) == 32
    assert plan.inputs == [onnx] and plan.front == {"host": "127.0.0.1", "port": 9000, "role": "replica",
                                                     "max_body": 64 << 20}
    assert plan.max_retries == 1000 and prepared.adapter.runtime is None
    assert prepared.spec.get("requirements") == ["onnxruntime==1.32.0", "numpy"]
    # a pin of the user's own wins over ours, whatever its spelling
    pinned = client.prepare(parse_statement(["-name", "serving", f"-Dmodel=file://{onnx}"]))
    pinned.spec.params["requirements"] = ["ONNXRuntime[extra]>=1.20"]
    serving.resolve(pinned, Store())
    assert pinned.spec.get("requirements") == ["ONNXRuntime[extra]>=1.20", "numpy"]
    # Told to listen beyond this machine, the router asks clients for a token of its own.
    wide = client.prepare(parse_statement(["-name", "serving", f"-Dmodel=file://{onnx}", "-DservingHost=0.0.0.0"]))
    serving.resolve(wide, Store())
    front = wide.adapter.plan(wide.spec, StagedCode(None, None, tmp_path)).front
    assert len(front["token"]) >= 32 and front["token"] != role.env["PAI_SERVING_TOKEN"]


def test_the_summary_line_is_the_services_metrics_and_nothing_else_is():
    from paicli.adapters.serving import ServingAdapter
    from paicli.cluster.logsink import MetricParser

    parse = MetricParser(list(ServingAdapter.metric_patterns)).parse
    summary = "serving: requests=120, rps=119.8, p50_ms=1.2, p90_ms=2.0, p99_ms=3.4, errors=0\n"
    assert parse(summary)[1] == {"requests": 120, "rps": 119.8, "p50_ms": 1.2, "p90_ms": 2.0, "p99_ms": 3.4,
                                 "errors": 0}
    for line in ("POST /v1/models/mnist:predict 200 1.84ms 8 rows in a batch of 32\n",
                 "set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"):
        assert parse(line)[1] == {}, line


@pytest.mark.parametrize("model, words", [
    ("/no/such/model", "-Dmodel: /no/such/model does not exist; give a SavedModel folder"),
    ("{here}/train.py", "train.py is no model paicli serves; give"),
    ("20260101000000000zzzzzzz", "-Dmodel: no job 20260101000000000zzzzzzz in"),
    ("a" * 5000, "-Dmodel: cannot use 'aaaa"),
])
def test_a_bad_model_is_one_line_and_exit_2(tmp_path, pai_home, model, words):
    touch(tmp_path, "train.py")
    done = pai("serve", model.format(here=tmp_path), cwd=str(tmp_path))
    assert done.returncode == 2 and words in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert not (pai_home / "jobs").exists() or not list((pai_home / "jobs").iterdir())


def replicas_of(job_id: str, count: int, home=None) -> list:
    """(URL, headers) of each ready replica of a serving job, from `pai status` and its plan."""
    env = {"PAI_HOME": str(home)} if home else None

    def ready():
        status = json.loads(pai("status", job_id, "--json", env=env).stdout)
        up = [i for i in status["instances"] if i["status"] == "Running" and i["port"]]
        logs = pai("logs", job_id, env=env).stdout
        if status["status"] in ("Failed", "Cancelled"):
            raise AssertionError(f"{job_id} ended: {status['status']}\n{logs}")
        return up if len(up) == count and logs.count(" ready on ") >= count else None

    up = wait_until(ready, timeout=180, interval=0.5)
    plan = json.loads(open(os.path.join(json.loads(pai("status", job_id, "--json", env=env).stdout)["job_dir"],
                                        "plan.json")).read())
    token = plan["roles"][0]["env"]["PAI_SERVING_TOKEN"]
    return [(f"http://{i['host']}:{i['port']}", {"X-Pai-Token": token}) for i in up]


@pytest.fixture
def services(pai_home):
    """Whatever happens in the test, every job of its home that has not ended is killed after it."""
    yield
    kill_unfinished_jobs()


@pytest.mark.caffe
def test_pai_serve_starts_a_service_that_pai_kill_ends(lenet, pai_home, services, tmp_path):
    port, here = free_port(), tmp_path / "here"
    here.mkdir()
    done = pai("serve", str(lenet), "--name", "digits", "--port", str(port), "--replicas", "2",
               "--max-batch-size", "4", "--json", cwd=str(here))
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout)
    try:
        assert (started["url"], started["kind"], started["name"], started["replicas"]) == \
            (f"http://127.0.0.1:{port}", "caffe", "digits", 2)
        rows = images(2, seed=3)
        want = np.array(in_process(lenet, rows))
        for url, headers in replicas_of(started["id"], 2) + [(started["url"], {})]:   # each replica, the router
            for way, got in conformance(Client(url, headers), "digits", rows).items():
                assert np.allclose(np.array(got), want, atol=1e-6), (url, way)
        # The replicas' summary lines are the service's metrics (`pai status`, the logview).
        wait_until(lambda: "p99_ms" in json.loads(pai("status", started["id"], "--json").stdout)["metrics"]
                   .get("replica:0", {}), timeout=30)
    finally:
        assert pai("kill", started["id"]).returncode == 0
    assert json.loads(pai("status", started["id"], "--json").stdout)["status"] == "Cancelled"
    assert not list(here.iterdir())   # nothing written where pai ran


def test_a_serving_statement_exports_to_yaml_and_needs_its_model(tmp_path, pai_home):
    exported = pai("export", "-name", "serving", "-Dmodel=file:///models/mnist", "-DmaxBatchSize=8",
                   '-Dcluster={"replica":{"count":2}}', cwd=str(tmp_path))
    assert exported.returncode == 0, exported.stderr
    assert "max_batch_size: 8" in exported.stdout and "model: file:///models/mnist" in exported.stdout
    missing = pai("-name", "serving", "--detach", cwd=str(tmp_path))
    assert missing.returncode == 2 and missing.stderr.startswith("pai: error: -Dmodel: missing; give a SavedModel")


@pytest.mark.caffe
def test_a_net_caffe_cannot_load_is_exit_1_not_an_abort_restarted_for_ever(lenet, tmp_path):
    (tmp_path / "deploy.prototxt").write_text(LENET.replace("num_output: 10", "num_output: 7"))
    done = subprocess.run([caffe_python(), "-u", runner_path("serving_runner.py"), "--model",
                           str(tmp_path / "deploy.prototxt"), "--weights", str(lenet / "lenet.caffemodel"),
                           "--kind", "caffe", "--name", "lenet"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PAI_HOST": "127.0.0.1", "PAI_PORT": str(free_port())})
    assert done.returncode == 1, done.stdout + done.stderr   # not -6 (SIGABRT): that is retried
    assert "serving: cannot load the caffe model" in done.stdout and "shape mismatch" in done.stderr


def test_a_model_file_brings_its_partners(tmp_path):
    from paicli.adapters.serving import detect, files_under

    deploy = touch(tmp_path, "deploy.prototxt", text='layer { type: "Input" }')[0]
    weights = touch(tmp_path, "lenet_iter_100.caffemodel")[0]
    touch(tmp_path, "gl-symbol.json", "gl-0003.params", "notes.txt")
    for given in (deploy, weights):
        model = detect(files_under(given))
        assert (model.kind, model.main, model.weights) == ("caffe", deploy, weights), given
    gluon = detect(files_under(str(tmp_path / "gl-0003.params")))
    assert (gluon.kind, gluon.weights) == ("gluon", str(tmp_path / "gl-0003.params"))
