"""Quantised CPU serving: a model turned into an int8 ONNX model at submit, or refused.

`quantize` converts the model to ONNX in its framework's runtime, quantises it on the
Python paicli runs on (runners/serving_convert.py, each step with a requirements layer
built and cached as -Drequirements layers are), and checks the float and the int8 model
on the user's labelled CSV. The result is kept under $PAI_HOME/serving-models/DIGEST
(of the model's files, the CSV and the converter): the same model and CSV submitted
again convert nothing. An int8 model that loses more than the allowed points is one
line and exit 2, before anything starts.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from paicli.adapters.serving import ONNX_REQUIREMENTS
from paicli.cluster.requirement_layers import ensure_layer
from paicli.errors import PaiError, UsageError
from paicli.private import open_append_fd, private_dir, write_private
from paicli.runners.runtimes import PipError, RuntimeSetupError, get_runtime, runner_path
from paicli.store import pai_home

Progress = Callable[[str], None]
# kind -> (the runtime that converts it, its layer). MXNet 1.9's exporter reads
# onnx.mapping, which onnx 1.16 removed.
CONVERTERS = {"savedmodel": ("tensorflow", ["tf2onnx", "onnx"]), "keras": ("tensorflow", ["tf2onnx", "onnx"]),
              "gluon": ("mxnet", ["onnx<1.16"])}
# The accuracy is checked on the onnxruntime the replicas serve with.
QUANTISER = ["onnx", *ONNX_REQUIREMENTS]
SCRIPT = runner_path("serving_convert.py")
REPORT = "report.json"
CHECK_HINT = "give a CSV of labelled rows: the input's values, then the label (a class index)"


def quantize(model_path: str, kind: str, check_csv: str, max_drop: float, progress: Progress) -> tuple[str, dict]:
    """(the int8 .onnx, the report: rows, float_accuracy, int8_accuracy, line);
    UsageError when the model cannot be quantised or loses more than `max_drop` points."""
    if kind not in CONVERTERS and kind != "onnx":
        raise UsageError(f"-Dquantize=int8: a {kind} model has no ONNX converter here",
                         f"serve it without -Dquantize (kinds that convert: {', '.join([*CONVERTERS, 'onnx'])})")
    if kind == "savedmodel" and os.path.basename(model_path) == "saved_model.pb":
        model_path = os.path.dirname(model_path)   # as the replica is given it: the folder is the model
    if not check_csv:
        raise UsageError("-DcheckData: -Dquantize=int8 needs a labelled sample to check the int8 model on",
                         CHECK_HINT)
    if not os.path.isfile(check_csv):
        raise UsageError(f"-DcheckData: {check_csv}: no such file", CHECK_HINT)
    folder = private_dir(pai_home() / "serving-models", parents=True) / model_digest(model_path, kind, check_csv)
    if not (folder / REPORT).exists():
        _convert(folder, model_path, kind, check_csv, progress)
    report = json.loads((folder / REPORT).read_text())
    refusal = accuracy_refusal(report, max_drop, check_csv)
    if refusal:
        raise UsageError(refusal, "allow more with -DmaxAccuracyDrop (--max-accuracy-drop) or serve without "
                                  "-Dquantize")
    report["line"] = report_line(report, check_csv)
    progress(report["line"])
    return str(folder / "int8.onnx"), report


def accuracy_refusal(report: dict, max_drop: float, check_csv: str) -> str | None:
    """The one line that refuses an int8 model losing more than `max_drop` points, or None."""
    drop = report["float_accuracy"] - report["int8_accuracy"]
    if drop <= max_drop:
        return None
    return (f"-DmaxAccuracyDrop={max_drop:g}: the int8 model's accuracy {report['int8_accuracy']:.2f}% is "
            f"{drop:.2f} points below the float model's {report['float_accuracy']:.2f}% on "
            f"{report['rows']} rows of {os.path.basename(check_csv)}")


def report_line(report: dict, check_csv: str) -> str:
    return (f"quantize int8: accuracy {report['float_accuracy']:.2f}% float, {report['int8_accuracy']:.2f}% "
            f"int8 on {report['rows']} rows of {os.path.basename(check_csv)}; model "
            f"{report['float_bytes'] / 1e6:.2f} -> {report['int8_bytes'] / 1e6:.2f} MB")


def model_digest(model_path: str, kind: str, check_csv: str) -> str:
    """Of the model's files (a Gluon pair's every epoch), the CSV and the converter."""
    if os.path.isdir(model_path):
        files = sorted(os.path.join(top, name) for top, _, names in os.walk(model_path) for name in names)
    elif kind == "gluon" and model_path.endswith("-symbol.json"):
        files = [model_path, *sorted(glob.glob(glob.escape(model_path[:-len("-symbol.json")]) + "-*.params"))]
    else:
        files = [model_path]
    digest = hashlib.sha256(kind.encode() + b"\0")
    for path in [SCRIPT, check_csv, *files]:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:24]


def _convert(folder: Path, model_path: str, kind: str, check_csv: str, progress: Progress) -> None:
    """Both steps into a staging folder renamed to `folder`: whole or absent."""
    staging = folder.parent / f".{folder.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)   # a dead submit's, whose pid this one has
    private_dir(staging)
    log = folder.parent / f"{folder.name}.log"   # both steps' stderr, kept when one fails: the error names it
    log.unlink(missing_ok=True)
    try:
        float_path = model_path
        if kind != "onnx":
            runtime, lines = CONVERTERS[kind]
            float_path = str(staging / "float.onnx")
            progress(f"quantize: converting the {kind} model to ONNX in the {runtime} runtime")
            _step(runtime, lines, ["convert", "--model", model_path, "--kind", kind, "--check", check_csv,
                                   "--out", float_path], log, progress)
        report = _step("", QUANTISER, ["quantise", "--model", float_path, "--check", check_csv,
                                       "--out", str(staging / "int8.onnx")], log, progress)
        write_private(staging / REPORT, json.dumps(report))
        log.unlink()
        try:
            os.rename(staging, folder)
        except OSError:   # another submit made the same one first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _step(runtime: str, lines: list[str], args: list[str], log: Path, progress: Progress) -> dict:
    """One step of runners/serving_convert.py in `runtime` ("": this Python) with its
    layer: the step's JSON line."""
    try:
        if runtime:
            get_runtime(runtime).ensure(progress)
        _, built = ensure_layer(runtime, lines, progress)
    except (PipError, RuntimeSetupError) as err:
        raise PaiError(f"-Dquantize=int8: the layer {' '.join(lines)} on {runtime or 'python'}: {err}") from None
    python = get_runtime(runtime).python() if runtime else sys.executable
    env = {**os.environ, "PYTHONPATH": built["site"], "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = []
    with open(open_append_fd(log), "w") as errors:
        proc = subprocess.Popen([python, "-u", SCRIPT, *args], stdout=subprocess.PIPE, stderr=errors,
                                stdin=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("STEP "):
                progress(f"quantize: {line[5:].strip()}")
            else:
                out.append(line.strip())
    status = proc.wait()
    bad = next((line[len("ERROR "):] for line in out if line.startswith("ERROR ")), None)
    if bad:   # the user's input: the one line says it all
        log.unlink()
        check_csv = args[args.index("--check") + 1]
        raise UsageError(f"-Dquantize=int8: {bad}", CHECK_HINT if bad.startswith(check_csv) else None)
    if status != 0 or not out or not out[-1].startswith("{"):
        raise PaiError(f"-Dquantize=int8: the {args[0]} step failed (exit {status})", f"its log: {log}")
    return json.loads(out[-1])
