"""A model to ONNX, then quantised to int8, both checked on a labelled CSV.

Runs at submit (paicli/serving_quant.py), in two steps, each with a requirements layer:
- `convert`, in the model's framework runtime: tf2onnx for a SavedModel or a Keras
  file, MXNet's own ONNX export for a Gluon pair (MXNet 1.9's exporter needs an onnx
  older than ONNX Runtime's quantiser, hence a second interpreter);
- `quantise`, on the Python paicli runs on, with onnx and ONNX Runtime: static int8,
  calibrated on the CSV's rows, and both models' accuracy on them (argmax against
  the last column).
Each prints one JSON line last; bad input is one `ERROR ...` line and exit 2;
`STEP ...` lines are progress.

    serving_convert.py convert --model PATH --kind KIND --check CSV --out FLOAT.onnx
    serving_convert.py quantise --model FLOAT.onnx --check CSV --out INT8.onnx
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys

import numpy as np

OPSET = 17
CALIBRATION_ROWS = 1000   # min/max of the activations settle long before this


class BadInput(Exception):
    pass


def step(text: str) -> None:
    print(f"STEP {text}", flush=True)


def read_csv(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows as float32, labels as int): the last column is the label."""
    rows, labels = [], []
    with open(path, newline="") as fh:
        for number, cells in enumerate(csv.reader(fh), 1):
            if not cells:
                continue
            if len(cells) < 2:
                raise BadInput(f"{path}: line {number} has {len(cells)} column(s); expected the "
                               "input's values, then the label")
            try:
                rows.append([float(x) for x in cells[:-1]])
                labels.append(int(float(cells[-1])))
            except ValueError:
                if not rows and number == 1:
                    continue   # a header line
                raise BadInput(f"{path}: line {number} holds a value that is not a number") from None
            if len(rows[-1]) != len(rows[0]):
                raise BadInput(f"{path}: line {number} has {len(cells)} columns, the first row "
                               f"{len(rows[0]) + 1}")
    if not rows:
        raise BadInput(f"{path}: no rows; give labelled rows (input values, then the label)")
    return np.asarray(rows, dtype=np.float32), np.asarray(labels)


def tensorflow_to_onnx(model: str, kind: str, out: str) -> None:
    import tensorflow as tf
    import tf2onnx

    if kind == "keras":
        import keras
        net = keras.models.load_model(model)
        if len(net.inputs) != 1:
            raise BadInput(f"{model}: the model has {len(net.inputs)} inputs; quantising needs one")
        specs = [tf.TensorSpec((None, *net.inputs[0].shape[1:]), tf.float32, name="input")]
        function = tf.function(lambda x: net(x, training=False))
    else:
        loaded = tf.saved_model.load(model)   # held by the function: its variables live as long
        signature = loaded.signatures["serving_default"]
        inputs = signature.structured_input_signature[1]
        if len(inputs) != 1:
            raise BadInput(f"{model}: serving_default has {len(inputs)} inputs; quantising needs one")
        (name, spec), = inputs.items()
        specs = [tf.TensorSpec(spec.shape, tf.float32, name=name)]
        function = tf.function(lambda x: loaded.signatures["serving_default"](**{name: x}))
    tf2onnx.convert.from_function(function, input_signature=specs, opset=OPSET, output_path=out)


def gluon_to_onnx(symbol_file: str, out: str, width: int) -> None:
    import mxnet as mx

    prefix = symbol_file[:-len("-symbol.json")]
    params = sorted(glob.glob(glob.escape(prefix) + "-[0-9][0-9][0-9][0-9].params"))
    if not params:
        raise BadInput(f"{symbol_file}: no {os.path.basename(prefix)}-NNNN.params beside it")
    symbol = mx.sym.load(symbol_file)
    known = {name.split(":", 1)[-1]: value.shape for name, value in mx.nd.load(params[-1]).items()}
    shape = gluon_input_shape(symbol, known, width)
    mx.onnx.export_model(symbol_file, params[-1], [(1, *shape)], [np.float32], out, dynamic=True,
                         dynamic_input_shapes=[(None, *shape)])


def gluon_input_shape(symbol, known: dict, width: int) -> tuple:
    """A Gluon export does not record its input's shape: the first of a flat row,
    (channels, side, side) or (side, side) that the weights accept."""
    candidates = [(width,)]
    for channels in (1, 3):
        side = int(round((width / channels) ** 0.5))
        if channels * side * side == width:
            candidates += [(channels, side, side)]
    for shape in candidates:
        try:
            symbol.infer_shape(data=(1, *shape), **{k: v for k, v in known.items() if k in symbol.list_inputs()})
            return shape
        except Exception:   # MXNetError: the weights do not fit this shape
            continue
    raise BadInput(f"the model takes no input of {width} values (the check rows' width) as a row, "
                   "(C, H, W) or (H, W)")


def without_initializer_inputs(path: str) -> None:
    """Weights listed as graph inputs (MXNet's export) are not constants to ONNX
    Runtime: neither folded nor quantised."""
    import onnx
    model = onnx.load(path)
    weights = {x.name for x in model.graph.initializer}
    kept = [x for x in model.graph.input if x.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    onnx.save(model, path)


def quantise(float_path: str, int8_path: str, name: str, rows: np.ndarray) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Batches(CalibrationDataReader):
        def __init__(self):
            calibration = rows[:CALIBRATION_ROWS]
            self.batches = iter([{name: calibration[i:i + 100]} for i in range(0, len(calibration), 100)])

        def get_next(self):
            return next(self.batches, None)

    ready = float_path + ".pre"
    quant_pre_process(float_path, ready, skip_symbolic_shape=True)
    # Static (calibrated) QDQ: dynamic quantisation runs convolutions as ConvInteger,
    # slower on CPU than float (docs/decisions.md, "int8 serving").
    quantize_static(ready, int8_path, Batches(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    os.unlink(ready)


def accuracy(path: str, rows: np.ndarray, labels: np.ndarray) -> float:
    import onnxruntime as ort
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    scores = np.concatenate([session.run(None, {name: rows[i:i + 256]})[0] for i in range(0, len(rows), 256)])
    if scores.ndim != 2 or scores.shape[1] < 2:
        raise BadInput(f"the model's output has shape {list(scores.shape)}; the check needs one score per class")
    return float((scores.argmax(axis=1) == labels).mean() * 100)


def input_of(path: str, width: int) -> tuple[str, tuple]:
    """The model's input name and the shape of one row (a dynamic size is fitted to `width`)."""
    import onnx
    graph = onnx.load(path).graph
    weights = {x.name for x in graph.initializer}
    first = next(x for x in graph.input if x.name not in weights)
    dims = [d.dim_value or -1 for d in first.type.tensor_type.shape.dim][1:]
    size = int(np.prod([d for d in dims if d > 0]))
    if dims.count(-1) > 1 or width % size or (-1 not in dims and size != width):
        raise BadInput(f"the model's input row has shape {dims}, the check rows {width} values")
    return first.name, tuple(width // size if d == -1 else d for d in dims)


def convert(args) -> dict:
    width = read_csv(args.check)[0].shape[1]
    if args.kind == "gluon":
        gluon_to_onnx(args.model, args.out, width)
        without_initializer_inputs(args.out)
    else:
        tensorflow_to_onnx(args.model, args.kind, args.out)
    return {"converted": args.out}


def quantise_and_check(args) -> dict:
    rows, labels = read_csv(args.check)
    name, shape = input_of(args.model, rows.shape[1])
    rows = rows.reshape((len(rows), *shape))
    step(f"quantising to int8, calibrated on {min(len(rows), CALIBRATION_ROWS)} rows")
    quantise(args.model, args.out, name, rows)
    step(f"checking both models on {len(rows)} rows")
    return {"rows": len(rows), "float_accuracy": accuracy(args.model, rows, labels),
            "int8_accuracy": accuracy(args.out, rows, labels),
            "float_bytes": os.path.getsize(args.model), "int8_bytes": os.path.getsize(args.out)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["convert", "quantise"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--kind", choices=["savedmodel", "keras", "gluon"])
    parser.add_argument("--check", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        report = convert(args) if args.action == "convert" else quantise_and_check(args)
    except BadInput as err:
        print(f"ERROR {err}", flush=True)
        return 2
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
