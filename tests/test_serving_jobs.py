"""Models trained by paicli jobs, served from those jobs' outputs (`pai serve JOB_ID`):
a TF2 Keras model by `-name tensorflow` (as a SavedModel and as a .keras file), a Gluon
export by `-name mxnet`, a Caffe LeNet by `-name caffe`. Each service answers both
protocols (tests/serving_client.py) with the predictions the framework gives in its own
process, refuses bad input in each protocol's form and goes on serving.

Each model is trained once for the module. The reference predictions of the TensorFlow
and MXNet models come from their training job's process, which loads the saved files
back and predicts; the Caffe model's from pycaffe run on the job's .caffemodel."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import pai
from netns import kill_unfinished_jobs
from serving_client import Client, conformance
from test_serving import IN_PROCESS, caffe_python, free_port, replicas_of


# The rows every model is asked for; the training scripts make the same ones.
ROWS = np.random.RandomState(7).rand(3, 1, 28, 28).astype(np.float32)

TF_TRAIN = """import json, os
import numpy as np, keras, tensorflow as tf
out = os.environ["PAI_OUTPUT_DIR"]
rng = np.random.RandomState(0)
x = rng.rand(256, 28, 28).astype("float32")
y = x.reshape(256, -1).argmax(axis=1) % 10
model = keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy")
model.fit(x, y, epochs=1, batch_size=32, verbose=2)
model.save(os.path.join(out, "mnist.keras"))
model.export(os.path.join(out, "export", "mnist", "1"))   # TensorFlow Serving's layout
rows = np.random.RandomState(7).rand(3, 1, 28, 28).astype("float32")[:, 0]   # the test's ROWS
keras_rows = keras.saving.load_model(os.path.join(out, "mnist.keras")).predict(rows, verbose=0)
signature = tf.saved_model.load(os.path.join(out, "export", "mnist", "1")).signatures["serving_default"]
saved_rows = list(signature(tf.constant(rows)).values())[0].numpy()
json.dump({"keras": keras_rows.tolist(), "savedmodel": saved_rows.tolist()}, open(os.path.join(out, "expected.json"), "w"))
"""

MX_TRAIN = """import json, os
import numpy as np, mxnet as mx
from mxnet import autograd, gluon, nd
out = os.environ["PAI_OUTPUT_DIR"]
rng = np.random.RandomState(0)
x = rng.rand(128, 1, 28, 28).astype("float32")
y = (x.reshape(128, -1).argmax(axis=1) % 10).astype("float32")
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(4, 5, strides=2, activation="relu"), gluon.nn.Flatten(), gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
for step in range(8):
    xb, yb = nd.array(x[step * 16:(step + 1) * 16]), nd.array(y[step * 16:(step + 1) * 16])
    with autograd.record():
        loss = loss_fn(net(xb), yb)
    loss.backward()
    trainer.step(16)
    print(f"step={step} loss={loss.mean().asscalar():.4f}")
net.export(os.path.join(out, "lenet"), epoch=1)
block = gluon.SymbolBlock.imports(os.path.join(out, "lenet-symbol.json"), ["data"],
                                  os.path.join(out, "lenet-0001.params"))
rows = nd.array(np.random.RandomState(7).rand(3, 1, 28, 28).astype("float32"))   # the test's ROWS
json.dump({"gluon": block(rows).asnumpy().tolist()}, open(os.path.join(out, "expected.json"), "w"))
"""

# An ONNX model written with the onnx package by a `-name python` job (its -Drequirements),
# which also runs it with onnxruntime in its own process for the reference.
ONNX_MAKE = """import json, os
import numpy as np, onnx, onnxruntime
from onnx import TensorProto, helper, numpy_helper
rng = np.random.RandomState(0)
w, b = rng.rand(784, 10).astype("float32") - 0.5, rng.rand(10).astype("float32")
graph = helper.make_graph(
    [helper.make_node("Flatten", ["image"], ["flat"]), helper.make_node("Gemm", ["flat", "w", "b"], ["logits"]),
     helper.make_node("Softmax", ["logits"], ["prob"])], "mlp",
    [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 28, 28])],
    [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N", 10])],
    initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 9
out = os.environ["PAI_OUTPUT_DIR"]
onnx.save(model, os.path.join(out, "mlp.onnx"))
rows = np.random.RandomState(7).rand(3, 1, 28, 28).astype("float32")   # the test's ROWS
session = onnxruntime.InferenceSession(os.path.join(out, "mlp.onnx"), providers=["CPUExecutionProvider"])
json.dump({"onnx": session.run(None, {"image": rows})[0].tolist()}, open(os.path.join(out, "expected.json"), "w"))
"""

CAFFE_LAYERS = """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 5 stride: 2 weight_filler { type: "xavier" } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
"""
CAFFE_TRAIN = ('name: "LeNet"\nlayer { name: "data" type: "HDF5Data" top: "data" top: "label" '
               'hdf5_data_param { source: "list.txt" batch_size: 16 } }\n' + CAFFE_LAYERS +
               'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }\n')
CAFFE_DEPLOY = ('name: "LeNet"\nlayer { name: "data" type: "Input" top: "data" '
                'input_param { shape: { dim: 1 dim: 1 dim: 28 dim: 28 } } }\n' + CAFFE_LAYERS +
                'layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }\n')
CAFFE_SOLVER = ('net: "train.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmomentum: 0.9\ndisplay: 10\n'
                'max_iter: 20\nsnapshot_prefix: "lenet"\n')
CAFFE_DATA = """import h5py, numpy as np
rng = np.random.RandomState(0)
x = rng.rand(64, 1, 28, 28).astype(np.float32)
with h5py.File("records.h5", "w") as f:
    f["data"] = x
    f["label"] = (x.reshape(64, -1).argmax(axis=1) % 10).astype(np.float32)
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One PAI_HOME for the module's jobs, and a folder `pai` runs in that must stay empty."""
    folder = tmp_path_factory.mktemp("serving-jobs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAI_HOME", str(folder / "home"))
        patch.setenv("NO_COLOR", "1")
        patch.delenv("PAI_DEBUG", raising=False)
        (folder / "here").mkdir()
        yield folder
    assert not list((folder / "here").iterdir())   # nothing written where pai ran


@pytest.fixture
def services(home):
    """The serving jobs a test starts; when it ends, whatever happened, every job of the
    module's home that has not ended is killed: a replica holds a core, and the next
    test's training job needs one."""
    started: list[str] = []
    yield started
    kill_unfinished_jobs()


def train(home: Path, *statement: str, env: dict | None = None) -> tuple[str, Path]:
    """A training job run from HOME/here to its end (killed if the test ends first): its ID
    and job folder."""
    done = pai(*statement, "--detach", cwd=str(home / "here"), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split()[-1]
    try:
        waited = pai("wait", job_id, "--no-progress", timeout=600, env=env)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    except BaseException:
        pai("kill", job_id, env=env)
        raise
    return job_id, Path(json.loads(pai("status", job_id, "--json", env=env).stdout)["job_dir"])


def trained(framework: str, home: Path, env: dict | None = None) -> tuple[str, dict]:
    """A model trained by a `-name FRAMEWORK` job: its ID, and kind -> the predictions the
    framework gives for ROWS in its own process."""
    if framework == "caffe":
        folder = home / "caffe"
        folder.mkdir()
        for name, text in (("train.prototxt", CAFFE_TRAIN), ("deploy.prototxt", CAFFE_DEPLOY),
                           ("solver.prototxt", CAFFE_SOLVER), ("list.txt", "records.h5\n")):
            (folder / name).write_text(text)
        subprocess.run([caffe_python(), "-c", CAFFE_DATA], cwd=folder, check=True, capture_output=True)
        # Snapshots go to -DcheckpointDir, which comes back as the job's outputs; the deploy
        # net is found beside the solver.
        job_id, _ = train(home, "-name", "caffe", f"-Dsolver={folder / 'solver.prototxt'}",
                          f"-DcheckpointDir={home / 'ck'}", env=env)
        (home / "rows.json").write_text(json.dumps(ROWS.tolist()))
        reference = subprocess.run([caffe_python(), "-c", IN_PROCESS, "deploy.prototxt",
                                    str(home / "ck" / "lenet_iter_20.caffemodel"), str(home / "rows.json")],
                                   cwd=folder, check=True, capture_output=True, text=True,
                                   env={**os.environ, "GLOG_minloglevel": "2"})
        return job_id, {"caffe": json.loads(reference.stdout)}
    script = home / f"train_{framework}.py"
    script.write_text({"tensorflow": TF_TRAIN, "mxnet": MX_TRAIN}[framework])
    job_id, job_dir = train(home, "-name", framework, f"-Dscript={script}", env=env)
    return job_id, json.loads((job_dir / "outputs" / "worker-0" / "expected.json").read_text())


def serve(services: list, home: Path, model: str, *options: str) -> dict:
    done = pai("serve", model, "--port", str(free_port()), "--json", *options, cwd=str(home / "here"))
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout)
    services.append(started["id"])
    return started


def check_service(started: dict, want: list, replicas: int = 1, datatype: str = "FP32") -> list:
    """Both protocols give `want` through the service's router; bad input gets its error
    and the next request is served. The replicas' (URL, headers)."""
    ready = replicas_of(started["id"], replicas)
    client = Client(started["url"])
    name = started["name"]
    rows = ROWS[:, 0].tolist() if started["kind"] in ("keras", "savedmodel") else ROWS.tolist()
    for way, got in conformance(client, name, rows, datatype).items():
        assert np.allclose(np.array(got), np.array(want), atol=1e-5), way
    meta = client.v2_metadata(name)
    tensor = {"name": meta["inputs"][0]["name"], "shape": [1, 3], "datatype": datatype, "data": [1, 2, 3]}
    for path, body, raw in ((f"/v1/models/{name}:predict", None, b'{"instances": [1,'),
                            (f"/v1/models/{name}:predict", {"instances": [[1, 2, 3]]}, None),
                            (f"/v2/models/{name}/infer", {"inputs": [tensor]}, None),
                            (f"/v2/models/{name}/infer", {"inputs": [{**tensor, "datatype": "BYTES"}]}, None),
                            (f"/v1/models/{name}/versions/7:predict", {"instances": rows[:1]}, None)):
        answer = client.tf_error("POST", path, body, raw)
        assert answer.status == (404 if "versions/7" in path else 400), answer.body
        assert np.allclose(np.array(client.tf_predict_rows(name, rows[:1])), np.array(want[:1]), atol=1e-5)
    return ready


@pytest.mark.tensorflow
def test_a_keras_model_trained_by_a_tensorflow_job_is_served_from_its_outputs(home, services):
    job_id, expected = trained("tensorflow", home)
    saved = serve(services, home, job_id)                       # the SavedModel comes first
    keras_file = serve(services, home, f"{job_id}:mnist.keras", "--name", "mnist_keras")
    assert (saved["kind"], saved["name"], keras_file["kind"]) == ("savedmodel", "mnist", "keras")
    check_service(saved, expected["savedmodel"])
    check_service(keras_file, expected["keras"])


@pytest.mark.parametrize("framework, kind", [pytest.param("mxnet", "gluon", marks=pytest.mark.mxnet),
                                             pytest.param("caffe", "caffe", marks=pytest.mark.caffe)])
def test_a_lenet_trained_by_an_mxnet_or_caffe_job_is_served_from_its_outputs(home, services, framework, kind):
    job_id, expected = trained(framework, home)
    started = serve(services, home, job_id)
    assert (started["kind"], started["name"]) == (kind, "lenet")
    check_service(started, expected[kind])


def test_an_onnx_model_a_job_wrote_is_served_by_onnxruntime_from_a_layer(home, services):
    (home / "make_onnx.py").write_text(ONNX_MAKE)
    (home / "onnx-requirements.txt").write_text("onnx==1.23.2\nonnxruntime==1.32.0\n")
    job_id, job_dir = train(home, "-name", "python", f"-Dscript={home / 'make_onnx.py'}",
                            f"-Drequirements=file://{home / 'onnx-requirements.txt'}")
    expected = json.loads((job_dir / "outputs" / "worker-0" / "expected.json").read_text())
    started = serve(services, home, job_id)
    assert (started["kind"], started["name"]) == ("onnx", "mlp")
    check_service(started, expected["onnx"])
    job = json.loads(pai("status", started["id"], "--json").stdout)["job_dir"]
    assert json.loads((Path(job) / "layer.json").read_text())["lines"] == ["onnxruntime==1.32.0", "numpy"]


def test_a_job_without_a_model_is_one_line_naming_dmodel(home):
    (home / "no_model.py").write_text("import os\nopen(os.path.join(os.environ['PAI_OUTPUT_DIR'], 'x.txt'), 'w')\n")
    job_id, _ = train(home, "-name", "python", f"-Dscript={home / 'no_model.py'}")
    done = pai("serve", job_id, cwd=str(home / "here"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"-Dmodel: no model among the outputs of job {job_id} (1 file(s)" in done.stderr
