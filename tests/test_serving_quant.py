"""Quantised serving (paicli/serving_quant.py): models trained here in their real
runtimes (tests/scripts/serving_models.py), converted to ONNX, quantised to int8 with
ONNX Runtime and checked on a labelled CSV; an int8 model that loses too much is
refused in one line with exit 2; `pai serve --quantize int8` serves the int8 model."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import pai, wait_until
from paicli.errors import UsageError
from paicli.runners.node_agent import free_ports
from paicli.runners.runtimes import get_runtime
from paicli.serving_quant import accuracy_refusal, quantize

SCRIPT = Path(__file__).parent / "scripts" / "serving_models.py"


def _train(kind: str, runtime: str, folder: Path) -> Path:
    rt = get_runtime(runtime)
    rt.ensure(lambda line: print(line, file=sys.stderr))
    folder.mkdir()
    done = subprocess.run([rt.python(), str(SCRIPT), kind, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def keras_cnn(tmp_path_factory):
    return _train("keras-cnn", "tensorflow", tmp_path_factory.mktemp("quant") / "keras")


@pytest.mark.tensorflow
def test_a_keras_cnn_is_quantised_checked_and_kept(keras_cnn, pai_home):
    lines = []
    path, report = quantize(str(keras_cnn / "model.keras"), "keras", str(keras_cnn / "check.csv"), 1.0, lines.append)
    assert report["rows"] == 500
    assert report["float_accuracy"] > 80   # the rule is learnt: the check means something
    assert report["float_accuracy"] - report["int8_accuracy"] <= 1.0
    assert report["int8_bytes"] < report["float_bytes"] / 2
    assert Path(path).name == "int8.onnx" and Path(path).is_file() and Path(path).is_relative_to(pai_home)
    assert report["line"] in lines and f"{report['float_accuracy']:.2f}% float" in report["line"]
    assert any("converting the keras model to ONNX" in line for line in lines)

    again = []
    assert quantize(str(keras_cnn / "model.keras"), "keras", str(keras_cnn / "check.csv"), 1.0,
                    again.append)[0] == path
    assert not any("converting" in line for line in again)   # the same model and CSV: kept


@pytest.mark.tensorflow
def test_an_int8_model_losing_accuracy_is_refused_in_one_line(keras_cnn, pai_home):
    # One row of huge values in the calibration sample stretches the input's int8
    # range until every ordinary pixel rounds to zero: the float model is still right.
    with pytest.raises(UsageError) as caught:
        quantize(str(keras_cnn / "model.keras"), "keras", str(keras_cnn / "outlier.csv"), 1.0, lambda line: None)
    err = caught.value
    assert err.exit_code == 2 and "\n" not in str(err)
    assert str(err).startswith("-DmaxAccuracyDrop=1: the int8 model's accuracy ")
    assert "points below the float model's" in str(err) and "on 501 rows of outlier.csv" in str(err)
    kept = list((pai_home / "serving-models").iterdir())
    assert len(kept) == 1 and (kept[0] / "report.json").is_file()   # the check's result whole, nothing staged


@pytest.mark.tensorflow
def test_a_savedmodel_is_converted_from_its_serving_signature(keras_cnn):
    _, keras = quantize(str(keras_cnn / "model.keras"), "keras", str(keras_cnn / "check.csv"), 1.0, lambda line: None)
    path, report = quantize(str(keras_cnn / "savedmodel"), "savedmodel", str(keras_cnn / "check.csv"), 1.0,
                            lambda line: None)
    assert report["float_accuracy"] == keras["float_accuracy"]   # the same network, the same answers
    assert Path(path).is_file()
    assert quantize(str(keras_cnn / "savedmodel" / "saved_model.pb"), "savedmodel", str(keras_cnn / "check.csv"),
                    1.0, lambda line: None)[0] == path   # its saved_model.pb names the same model


@pytest.mark.mxnet
def test_a_gluon_cnn_is_converted_and_quantised(tmp_path):
    folder = _train("gluon-cnn", "mxnet", tmp_path / "gluon")
    path, report = quantize(str(folder / "model-symbol.json"), "gluon", str(folder / "check.csv"), 1.0,
                            lambda line: None)
    assert report["float_accuracy"] > 80
    assert report["float_accuracy"] - report["int8_accuracy"] <= 1.0
    assert Path(path).is_file()


@pytest.mark.tensorflow
def test_a_bad_check_csv_is_one_line(keras_cnn, tmp_path, pai_home):
    path, _ = quantize(str(keras_cnn / "model.keras"), "keras", str(keras_cnn / "check.csv"), 1.0, lambda line: None)
    float_model = str(Path(path).parent / "float.onnx")
    rows = (keras_cnn / "check.csv").read_text().splitlines()
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(rows[:3] + ["x" + rows[3]]) + "\n")
    with pytest.raises(UsageError, match=rf"^-Dquantize=int8: {bad}: line 4 holds a value that is not a number; "):
        quantize(float_model, "onnx", str(bad), 1.0, lambda line: None)
    narrow = tmp_path / "narrow.csv"
    narrow.write_text("0.5,0.5,1\n")
    with pytest.raises(UsageError, match=r"input row has shape \[28, 28, 1\], the check rows 2 values"):
        quantize(float_model, "onnx", str(narrow), 1.0, lambda line: None)
    assert sorted(p.name for p in (pai_home / "serving-models").iterdir()) == [Path(path).parent.name]   # no log
    with pytest.raises(UsageError, match=r"^-DcheckData: .*/missing.csv: no such file"):
        quantize(float_model, "onnx", str(tmp_path / "missing.csv"), 1.0, lambda line: None)


def test_a_caffe_model_is_refused_before_any_work(tmp_path):
    with pytest.raises(UsageError, match=r"^-Dquantize=int8: a caffe model has no ONNX converter here"):
        quantize(str(tmp_path / "deploy.prototxt"), "caffe", str(tmp_path / "check.csv"), 1.0, lambda line: None)


def test_the_allowed_drop_is_inclusive():
    report = {"rows": 200, "float_accuracy": 97.5, "int8_accuracy": 96.5}
    assert accuracy_refusal(report, 1.0, "/d/check.csv") is None
    assert accuracy_refusal({**report, "int8_accuracy": 98.0}, 0, "/d/check.csv") is None
    assert accuracy_refusal(report, 0.5, "/d/check.csv") == (
        "-DmaxAccuracyDrop=0.5: the int8 model's accuracy 96.50% is 1.00 points below the float model's "
        "97.50% on 200 rows of check.csv")


# -- through `pai serve` -----------------------------------------------------------------


@pytest.mark.tensorflow
def test_pai_serve_refuses_a_lossy_int8_model_in_one_line_and_starts_nothing(keras_cnn, pai_home):
    done = pai("serve", str(keras_cnn / "model.keras"), "--quantize", "int8", "--check", str(keras_cnn / "outlier.csv"),
               timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("pai: error: ")]
    assert errors == [done.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith("pai: error: -DmaxAccuracyDrop=1: the int8 model's accuracy ")
    assert json.loads(pai("list", "--json").stdout) == []


@pytest.mark.tensorflow
def test_pai_serve_int8_serves_the_quantised_onnx_model(keras_cnn, pai_home):
    port = free_ports("127.0.0.1", 1, set())[0]
    done = pai("serve", str(keras_cnn / "model.keras"), "--quantize", "int8", "--check", str(keras_cnn / "check.csv"),
               "--port", str(port), "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout)
    try:
        assert started["kind"] == "onnx"
        assert "quantize int8: accuracy " in done.stderr
        rows = np.loadtxt(keras_cnn / "check.csv", delimiter=",", max_rows=20)
        body = json.dumps({"instances": rows[:, :-1].reshape(-1, 28, 28, 1).tolist()}).encode()
        request = urllib.request.Request(f"{started['url']}/v1/models/{started['name']}:predict", data=body,
                                         headers={"Content-Type": "application/json"})
        answer = wait_until(lambda: _answer(request), timeout=120)
        got = np.argmax(np.array(answer["predictions"]), axis=1)
        assert (got == rows[:, -1]).mean() >= 0.8   # the int8 model answers as checked
    finally:
        pai("kill", started["id"])


def _answer(request) -> dict | None:
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.load(answer)
    except OSError:
        return None
