"""One replica of a `pai -name serving` job: a model behind two REST protocols.

Runs inside the model's framework runtime (stdlib, numpy and the framework only;
Caffe's runtime is Debian bullseye's Python 3.9):

    serving_runner.py --model PATH --kind KIND --name NAME [--version N] [--weights PATH]
                      [--max-batch-size N] [--batch-timeout-micros U] [--num-batch-threads T]
                      [--max-body-bytes B] [--request-log on|off]

KIND: savedmodel (PATH: its saved_model.pb), keras (.keras), gluon (the -symbol.json,
--weights the .params), caffe (the deploy prototxt, --weights the .caffemodel), onnx.

It binds PAI_HOST:PAI_PORT and answers TensorFlow Serving's REST API (/v1/models/...)
and the Open Inference Protocol's REST endpoints (/v2/...). With PAI_SERVING_TOKEN set,
every request carries it in X-Pai-Token. --max-batch-size > 0 combines concurrent
requests into one call of the model (TensorFlow Serving's batching knobs). SIGTERM:
no new connections, the requests in flight are answered, exit 0.

The protocol work (routes, JSON bodies to arrays and back, batches) is in pure
functions; the asyncio HTTP/1.1 server and the framework loaders only call them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import gc
import hmac
import json
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

import numpy as np

KINDS = ("savedmodel", "keras", "gluon", "caffe", "onnx")
PLATFORMS = {"savedmodel": "tensorflow_savedmodel", "keras": "tensorflow_keras", "gluon": "mxnet_gluon",
             "caffe": "caffe_caffemodel", "onnx": "onnxruntime_onnx"}
SIGNATURE = "serving_default"
TOKEN_HEADER = "X-Pai-Token"
DRAIN_SECONDS = 10.0
SUMMARY_SECONDS = 1.0
IDLE_SECONDS = 120.0   # a keep-alive connection idle this long is closed
HEALTH_PREFIX = "/v2/health/"
# The Open Inference Protocol's health answers: 200 is true, a 4xx false.
NOT_READY = 400

# numpy dtype name -> (Open Inference Protocol datatype, TensorFlow DataType name)
DTYPES = {
    "bool": ("BOOL", "DT_BOOL"), "uint8": ("UINT8", "DT_UINT8"), "uint16": ("UINT16", "DT_UINT16"),
    "uint32": ("UINT32", "DT_UINT32"), "uint64": ("UINT64", "DT_UINT64"), "int8": ("INT8", "DT_INT8"),
    "int16": ("INT16", "DT_INT16"), "int32": ("INT32", "DT_INT32"), "int64": ("INT64", "DT_INT64"),
    "float16": ("FP16", "DT_HALF"), "float32": ("FP32", "DT_FLOAT"), "float64": ("FP64", "DT_DOUBLE"),
    "object": ("BYTES", "DT_STRING"),
}
V2_DTYPES = {v2: name for name, (v2, _tf) in DTYPES.items()}
# What JSON values may fill a tensor of a numpy kind (b: bool, i/u: integers, f: floats).
ACCEPTS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "O": "OU"}


class HttpError(Exception):
    """An answer other than 200: its status and message, sent in the protocol's error form."""

    def __init__(self, status: int, message: str, allow: str = ""):
        super().__init__(message)
        self.status, self.message, self.allow = status, message, allow


class Tensor:
    """A model input or output: its name, numpy dtype and shape (-1: any size; the
    first dimension is the batch). shape None: the rank is not known."""

    def __init__(self, name: str, dtype, shape):
        self.name, self.dtype = name, np.dtype(dtype)
        self.shape = None if shape is None else [-1 if d is None or not isinstance(d, int) or d < 0 else int(d)
                                                 for d in shape]

    def v2(self) -> dict:
        return {"name": self.name, "datatype": datatype(self.dtype), "shape": self.shape or [-1]}

    def tf(self) -> dict:
        shape = ({"unknown_rank": True} if self.shape is None else
                 {"dim": [{"size": str(d), "name": ""} for d in self.shape], "unknown_rank": False})
        return {"dtype": DTYPES.get(self.dtype.name, ("", "DT_INVALID"))[1], "tensor_shape": shape,
                "name": self.name}


def datatype(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.kind in "OUS":
        return "BYTES"
    return DTYPES.get(dtype.name, ("BYTES", ""))[0]


# ---------------------------------------------------------------------------
# Routes


Route = collections.namedtuple("Route", "protocol action name version", defaults=("", ""))


V1_PATH = re.compile(r"^/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>[^/:]+)|/labels/(?P<label>[^/:]+))?"
                     r"(?:(?P<metadata>/metadata)|:(?P<verb>[A-Za-z]+))?/?$")
V2_MODEL_PATH = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
                           r"(?:/(?P<action>ready|infer))?/?$")
METHODS = {"status": "GET", "metadata": "GET", "predict": "POST", "live": "GET", "ready": "GET",
           "server": "GET", "model": "GET", "model_ready": "GET", "infer": "POST"}


def route(method: str, path: str) -> Route:
    """The endpoint a request names; HttpError 404 (no such endpoint) or 405 (another method)."""
    path = path.split("?", 1)[0]
    found = None
    match = V1_PATH.match(path)
    if match:
        if match.group("label"):
            raise HttpError(404, f"version labels are not served here; use /v1/models/{match.group('name')}"
                                 "/versions/N")
        verb = match.group("verb")
        if verb is not None and verb != "predict":
            raise HttpError(404 if verb not in ("classify", "regress") else 400,
                            f":{verb} is not served; this server answers :predict")
        action = "metadata" if match.group("metadata") else "predict" if verb else "status"
        found = Route("v1", action, match.group("name"), match.group("version") or "")
    elif path.startswith("/v2"):
        if path.rstrip("/") == "/v2":
            found = Route("v2", "server")
        elif path.rstrip("/") in ("/v2/health/live", "/v2/health/ready"):
            found = Route("v2", path.rstrip("/").rsplit("/", 1)[1])
        else:
            match = V2_MODEL_PATH.match(path)
            if match:
                action = {"ready": "model_ready", "infer": "infer", None: "model"}[match.group("action")]
                found = Route("v2", action, match.group("name"), match.group("version") or "")
    if found is None:
        raise HttpError(404, f"no such endpoint: {path[:200]} (TensorFlow Serving: /v1/models/NAME[:predict], "
                             "Open Inference Protocol: /v2/models/NAME[/infer])")
    if METHODS[found.action] != method:
        raise HttpError(405, f"{method} is not allowed on {path[:200]}; use {METHODS[found.action]}",
                        allow=METHODS[found.action])
    return found


def check_model(route_: Route, name: str, version: str) -> None:
    """404 unless the route names this model (and this version, when it names one)."""
    if route_.name and route_.name != name:
        raise HttpError(404, f"model {route_.name!r} is not served here; this replica serves {name!r}")
    if route_.version and route_.version != version:
        raise HttpError(404, f"model {name!r} has no version {route_.version!r}; it serves version {version}")


# ---------------------------------------------------------------------------
# JSON bodies -> arrays


def parse_json(body: bytes):
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise HttpError(400, f"the body is not JSON: {err}") from None
    except RecursionError:
        raise HttpError(400, "the body is nested too deeply") from None


def _b64(value):
    """TensorFlow Serving's {"b64": "..."} binary values, decoded, anywhere in a value."""
    if isinstance(value, dict):
        if set(value) == {"b64"} and isinstance(value["b64"], str):
            try:
                return base64.b64decode(value["b64"], validate=True)
            except ValueError:
                raise HttpError(400, "a {\"b64\": ...} value is not base64") from None
        raise HttpError(400, "a tensor value is an object; expected numbers or lists of numbers")
    if isinstance(value, list):
        return [_b64(v) for v in value]
    return value


def to_array(value, spec: Tensor, what: str, shape=None) -> np.ndarray:
    """A JSON value (reshaped to `shape` when given) as an array of the input's dtype;
    HttpError 400 naming `what` when its values or shape do not fit the input."""
    try:
        raw = np.array(value)   # numbers: numpy reads the lists at C speed
        if raw.dtype.kind == "O":   # objects among them: {"b64": ...} values, decoded
            raw = np.array(_b64(value))
    except ValueError as err:
        _b64(value)   # an object that is not {"b64": ...} is named as such
        raise HttpError(400, f"{what}: not a rectangular tensor ({err})") from None
    if raw.dtype.kind == "S":
        raw = raw.astype(object)
    if raw.size and raw.dtype.kind not in ACCEPTS.get(spec.dtype.kind, spec.dtype.kind):
        shown = {"b": "booleans", "U": "strings", "O": "mixed or ragged values", "f": "floats"}.get(
            raw.dtype.kind, raw.dtype.name)
        raise HttpError(400, f"{what}: {shown} given, the model takes {datatype(spec.dtype)} ({spec.dtype.name})")
    if shape is not None:
        raw = raw.reshape(shape)
    check_shape(raw.shape, spec, what)
    return raw.astype(spec.dtype)


def check_shape(shape, spec: Tensor, what: str) -> None:
    if spec.shape is not None and (len(shape) != len(spec.shape) or any(
            want >= 0 and got != want for got, want in zip(shape[1:], spec.shape[1:]))):
        raise HttpError(400, f"{what}: shape {list(shape)}, the model takes {spec.shape} (-1: any size)")


def rows_of(arrays: dict) -> int:
    """The batch size every input shares (the column form lets them differ: -1)."""
    sizes = {a.shape[0] if a.ndim else 1 for a in arrays.values()}
    return sizes.pop() if len(sizes) == 1 else -1


def _named(inputs: list, value, what: str) -> dict:
    """A value for the one input, or an object naming every input."""
    names = [t.name for t in inputs]
    if isinstance(value, dict) and set(value) != {"b64"}:
        missing = [n for n in names if n not in value]
        unknown = [n for n in value if n not in names]
        if missing or unknown:
            raise HttpError(400, f"{what}: " + "; ".join(
                ([f"missing input(s) {missing}"] if missing else []) +
                ([f"unknown input(s) {unknown}"] if unknown else [])) + f"; the model's inputs: {names}")
        return value
    if len(names) != 1:
        raise HttpError(400, f"{what}: the model has inputs {names}; name each one in an object")
    return {names[0]: value}


def parse_tf_predict(data, inputs: list) -> tuple[dict, str]:
    """TensorFlow Serving's predict body -> ({input name: array}, "row" | "column")."""
    if not isinstance(data, dict):
        raise HttpError(400, 'expected a JSON object with "instances" (row form) or "inputs" (column form)')
    signature = data.get("signature_name", SIGNATURE)
    if signature != SIGNATURE:
        raise HttpError(400, f"signature_name {str(signature)[:80]!r}: this model has one signature, {SIGNATURE!r}")
    if ("instances" in data) == ("inputs" in data):
        raise HttpError(400, 'give exactly one of "instances" (row form) and "inputs" (column form)')
    if "instances" in data:
        instances = data["instances"]
        if not isinstance(instances, list) or not instances:
            raise HttpError(400, '"instances" must be a non-empty list, one element per row')
        rows = [_named(inputs, row, f"instances[{i}]") for i, row in enumerate(instances)]
        arrays = {}
        for spec in inputs:
            arrays[spec.name] = to_array([row[spec.name] for row in rows], spec, f'input "{spec.name}"')
        return arrays, "row"
    named = _named(inputs, data["inputs"], '"inputs"')
    return {spec.name: to_array(named[spec.name], spec, f'input "{spec.name}"') for spec in inputs}, "column"


def tf_response(outputs: dict, form: str) -> dict:
    """The predict answer: row form -> "predictions" (a value per row, an object per row
    when the model has several outputs), column form -> "outputs"."""
    if form == "column":
        if len(outputs) == 1:
            return {"outputs": next(iter(outputs.values())).tolist()}
        return {"outputs": {name: a.tolist() for name, a in outputs.items()}}
    if len(outputs) == 1:
        return {"predictions": next(iter(outputs.values())).tolist()}
    columns = {name: a.tolist() for name, a in outputs.items()}
    rows = len(next(iter(columns.values())))
    return {"predictions": [{name: col[i] for name, col in columns.items()} for i in range(rows)]}


def _flat(value) -> list:
    """The Open Inference Protocol's tensor data: flat, or nested in row-major order."""
    if not isinstance(value, list):
        return [value]
    if not any(isinstance(item, list) for item in value):
        return value   # flat already, as most clients send it
    out = []
    for item in value:
        out.extend(_flat(item) if isinstance(item, list) else [item])
    return out


def parse_v2_infer(data, inputs: list, outputs: list) -> tuple[dict, list, dict]:
    """An inference request -> ({input name: array}, the output names asked for, the id echo)."""
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), list):
        raise HttpError(400, 'expected a JSON object with "inputs": [{"name", "shape", "datatype", "data"}, ...]')
    by_name = {t.name: t for t in inputs}
    arrays = {}
    for i, item in enumerate(data["inputs"]):
        if not isinstance(item, dict) or not all(k in item for k in ("name", "shape", "datatype", "data")):
            raise HttpError(400, f"inputs[{i}]: needs name, shape, datatype and data")
        name, shape, dtype = item["name"], item["shape"], item["datatype"]
        spec = by_name.get(name)
        if spec is None:
            raise HttpError(400, f"inputs[{i}]: the model has no input {str(name)[:80]!r}; its inputs: {list(by_name)}")
        if name in arrays:
            raise HttpError(400, f"inputs[{i}]: input {name!r} given twice")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise HttpError(400, f'input "{name}": shape must be a list of sizes, not {json.dumps(shape)[:80]}')
        if dtype != datatype(spec.dtype):
            raise HttpError(400, f'input "{name}": datatype {str(dtype)[:20]}, the model takes {datatype(spec.dtype)}')
        flat = _flat(item["data"])
        if len(flat) != int(np.prod(shape, dtype=np.int64)):
            raise HttpError(400, f'input "{name}": {len(flat)} values for shape {shape} '
                                 f"({int(np.prod(shape, dtype=np.int64))} expected)")
        arrays[name] = to_array(flat, spec, f'input "{name}"', shape)
    missing = [n for n in by_name if n not in arrays]
    if missing:
        raise HttpError(400, f"missing input(s) {missing}")
    wanted = data.get("outputs")
    known = [t.name for t in outputs]
    if wanted is None:
        names = known
    else:
        if not isinstance(wanted, list) or not all(isinstance(o, dict) and "name" in o for o in wanted):
            raise HttpError(400, '"outputs" must be a list of {"name": ...}')
        names = [o["name"] for o in wanted]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise HttpError(400, f"the model has no output(s) {unknown}; its outputs: {known}")
    echo = {"id": data["id"]} if isinstance(data.get("id"), str) else {}
    return arrays, names, echo


def v2_response(name: str, version: str, outputs: dict, wanted: list, echo: dict) -> dict:
    return {"model_name": name, "model_version": version, **echo,
            "outputs": [{"name": out, "datatype": datatype(outputs[out].dtype), "shape": list(outputs[out].shape),
                         "data": outputs[out].ravel().tolist()} for out in wanted]}


# ---------------------------------------------------------------------------
# Batches: requests combined into one call of the model, and split back


def combine(requests: list) -> tuple[dict, list]:
    """Several requests' {input: array} -> one {input: concatenated array}, each one's rows."""
    sizes = [rows_of(r) for r in requests]
    return {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}, sizes


def split(outputs: dict, sizes: list) -> list:
    """One call's outputs back into each request's rows."""
    bounds = np.cumsum([0] + sizes)
    return [{name: a[bounds[i]:bounds[i + 1]] for name, a in outputs.items()} for i in range(len(sizes))]


def batch_key(arrays: dict) -> tuple:
    """Requests combine only when their inputs agree beyond the batch dimension."""
    return tuple(sorted((name, a.shape[1:], a.dtype.str) for name, a in arrays.items()))


class Job:
    def __init__(self, arrays: dict, rows: int, future):
        self.arrays, self.rows, self.key, self.future = arrays, rows, batch_key(arrays), future


def run_batch(call, batch: list) -> list:
    """One call of the model for a batch's {input: array}s -> (outputs, error, rows of the
    call) for each. When the combined call fails, each runs alone again, so that one
    request's bad input does not fail the others."""
    if len(batch) > 1:
        joined, sizes = combine(batch)
        try:
            return [(part, None, sum(sizes)) for part in split(call(joined), sizes)]
        except Exception:
            pass
    answers = []
    for arrays in batch:
        try:
            answers.append((call(arrays), None, rows_of(arrays)))
        except Exception as err:
            answers.append((None, err, 0))
    return answers


class Batcher:
    """TensorFlow Serving's batching knobs on the event loop: up to max_rows rows per
    call, a batch waits at most timeout seconds for more once it has its first
    request, `threads` calls at once, each in a thread of its own. A request with more
    rows than max_rows runs on its own; with max_rows 0 (no batching) every call goes
    straight to the pool, queued there so that none waits for the loop."""

    def __init__(self, call, max_rows: int, timeout: float, threads: int):
        self.call, self.max_rows, self.timeout, self.threads = call, max_rows, timeout, max(1, threads)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="model")
        self.queue: collections.deque = collections.deque()
        self.waiters: list = []
        self.workers: list = []

    async def run(self, arrays: dict) -> tuple[dict, int]:
        """(outputs, rows of the call that answered them)."""
        loop = asyncio.get_running_loop()
        rows = rows_of(arrays)
        if rows < 0 or self.max_rows <= 0:   # inputs of different batch sizes cannot join a batch
            return await loop.run_in_executor(self.pool, self.call, arrays), rows
        if not self.workers:
            self.workers = [loop.create_task(self._work()) for _ in range(self.threads)]
        job = Job(arrays, rows, loop.create_future())
        self.queue.append(job)
        for waiter in self.waiters:
            _settle(waiter)
        self.waiters.clear()
        return await job.future

    async def _wait(self, timeout: float | None = None) -> None:
        """Until a request arrives (or timeout seconds pass)."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _settle, waiter)
        await waiter
        if timer is not None:
            timer.cancel()

    async def _take(self) -> list:
        while not self.queue:
            await self._wait()
        first = self.queue.popleft()
        batch, rows = [first], first.rows
        deadline = asyncio.get_running_loop().time() + self.timeout
        while rows < self.max_rows:
            rest: collections.deque = collections.deque()
            for job in self.queue:
                if job.key == first.key and rows + job.rows <= self.max_rows:
                    batch.append(job)
                    rows += job.rows
                else:
                    rest.append(job)
            self.queue = rest
            left = deadline - asyncio.get_running_loop().time()
            if rows >= self.max_rows or left <= 0:
                break
            await self._wait(left)
        return batch

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._take()
            answers = await loop.run_in_executor(self.pool, run_batch, self.call, [job.arrays for job in batch])
            for job, (outputs, error, rows) in zip(batch, answers):
                if job.future.done():   # its client is gone
                    continue
                if error is not None:
                    job.future.set_exception(error)
                else:
                    job.future.set_result((outputs, rows))


def _settle(future) -> None:
    if not future.done():
        future.set_result(None)


# ---------------------------------------------------------------------------
# Statistics: the access lines and the summary line once a second


class Stats:
    def __init__(self):
        self.requests = self.errors = 0
        self.window: list = []
        self.since = time.monotonic()

    def record(self, ms: float, error: bool) -> None:
        self.requests += 1
        self.errors += error
        self.window.append(ms)

    def summary(self) -> str | None:
        """`serving: requests=N, rps=R, p50_ms=..., p90_ms=..., p99_ms=..., errors=E` over the
        time since the last one (requests and errors: totals), None without traffic."""
        window, self.window = self.window, []
        now, since, self.since = time.monotonic(), self.since, time.monotonic()
        requests, errors = self.requests, self.errors
        if not window:
            return None
        p50, p90, p99 = np.percentile(np.array(window), [50, 90, 99])
        return (f"serving: requests={requests}, rps={len(window) / max(now - since, 1e-3):.1f}, "
                f"p50_ms={p50:.2f}, p90_ms={p90:.2f}, p99_ms={p99:.2f}, errors={errors}")


# ---------------------------------------------------------------------------
# Models: each framework loaded by its own API, behind one interface


class Model:
    """inputs/outputs: Tensors; predict({input: array}) -> {output: array}, in outputs' order."""

    thread_safe = False
    inputs: list = []
    outputs: list = []

    def predict(self, arrays: dict) -> dict:
        raise NotImplementedError


class SavedModel(Model):
    thread_safe = True

    def __init__(self, path: str):
        import tensorflow as tf
        self.tf = tf
        self.fn = tf.saved_model.load(os.path.dirname(path)).signatures[SIGNATURE]
        _args, kwargs = self.fn.structured_input_signature
        self.inputs = [Tensor(n, s.dtype.as_numpy_dtype, s.shape.as_list() if s.shape.rank is not None else None)
                       for n, s in sorted(kwargs.items())]
        self.outputs = [Tensor(n, s.dtype.as_numpy_dtype, s.shape.as_list() if s.shape.rank is not None else None)
                        for n, s in sorted(self.fn.structured_outputs.items())]

    def predict(self, arrays: dict) -> dict:
        out = self.fn(**{n: self.tf.constant(a) for n, a in arrays.items()})
        return {t.name: out[t.name].numpy() for t in self.outputs}


class KerasModel(Model):
    def __init__(self, path: str):
        import keras
        self.model = keras.saving.load_model(path, compile=False)
        # Named by their layers (input_layer, dense_1), as the model's summary shows them.
        self.inputs = [Tensor(layer_name(t), t.dtype, list(t.shape)) for t in self.model.inputs]
        self.outputs = [Tensor(layer_name(t), t.dtype, list(t.shape)) for t in self.model.outputs]

    def predict(self, arrays: dict) -> dict:
        given = [arrays[t.name] for t in self.inputs]
        # Keras's compiled predict step: calling the model eagerly costs milliseconds of
        # Python a call, holding the lock every other thread (the server's) waits for.
        out = self.model.predict_on_batch(given[0] if len(given) == 1 else given)
        out = out if isinstance(out, (list, tuple)) else [out]
        return {t.name: np.asarray(o) for t, o in zip(self.outputs, out)}


def layer_name(tensor) -> str:
    history = getattr(tensor, "_keras_history", None)
    return (getattr(history[0], "name", None) if history else None) or tensor.name


class GluonModel(Model):
    def __init__(self, symbol: str, params: str):
        import mxnet as mx
        self.mx = mx
        sym = mx.sym.load(symbol)
        stored = {k.split(":", 1)[-1] for k in mx.nd.load(params)}
        names = [n for n in sym.list_inputs() if n not in stored]
        self.net = mx.gluon.SymbolBlock.imports(symbol, names, params)
        # The symbol keeps no input shape: any rank and size (a bad one is MXNet's 400).
        self.inputs = [Tensor(n, "float32", None) for n in names]
        self.outputs = [Tensor(n, "float32", None) for n in sym.list_outputs()]

    def predict(self, arrays: dict) -> dict:
        out = self.net(*[self.mx.nd.array(arrays[t.name], dtype=t.dtype) for t in self.inputs])
        out = out if isinstance(out, (list, tuple)) else [out]
        return {t.name: o.asnumpy() for t, o in zip(self.outputs, out)}


class CaffeModel(Model):
    def __init__(self, prototxt: str, weights: str):
        import caffe
        caffe.set_mode_cpu()
        # A net Caffe cannot load aborts the process (a glog CHECK), which the launcher would
        # take for a retryable death and restart for ever: a child tries first.
        child = os.fork()
        if child == 0:
            caffe.Net(prototxt, caffe.TEST, weights=weights)
            os._exit(0)
        _pid, status = os.waitpid(child, 0)
        if status != 0:
            raise RuntimeError("Caffe could not load the net with these weights (its F line above says why)")
        self.net = caffe.Net(prototxt, caffe.TEST, weights=weights)
        self.inputs = [Tensor(n, "float32", [-1, *self.net.blobs[n].data.shape[1:]]) for n in self.net.inputs]
        self.outputs = [Tensor(n, "float32", [-1, *self.net.blobs[n].data.shape[1:]]) for n in self.net.outputs]

    def predict(self, arrays: dict) -> dict:
        for t in self.inputs:
            self.net.blobs[t.name].reshape(*arrays[t.name].shape)
            self.net.blobs[t.name].data[...] = arrays[t.name]
        out = self.net.forward()
        return {t.name: np.array(out[t.name]) for t in self.outputs}


ONNX_TYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8",
              "tensor(uint8)": "uint8", "tensor(bool)": "bool", "tensor(string)": "object"}


class OnnxModel(Model):
    thread_safe = True

    def __init__(self, path: str):
        import onnxruntime
        options = onnxruntime.SessionOptions()
        # Its threads sleep between calls rather than spin: the cores are the server's too.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.inputs = [Tensor(i.name, ONNX_TYPES.get(i.type, "float32"), i.shape) for i in self.session.get_inputs()]
        self.outputs = [Tensor(o.name, ONNX_TYPES.get(o.type, "float32"), o.shape)
                        for o in self.session.get_outputs()]

    def predict(self, arrays: dict) -> dict:
        out = self.session.run([t.name for t in self.outputs], arrays)
        return {t.name: np.asarray(o) for t, o in zip(self.outputs, out)}


def load_model(kind: str, path: str, weights: str | None) -> Model:
    if kind == "savedmodel":
        return SavedModel(path)
    if kind == "keras":
        return KerasModel(path)
    if kind == "gluon":
        return GluonModel(path, weights)
    if kind == "caffe":
        return CaffeModel(path, weights)
    return OnnxModel(path)


def warm_up(model: Model) -> None:
    """One call on a row of zeros, so the first request does not pay for the framework's
    first-call set-up; skipped when an input's size is not known."""
    if all(t.shape is not None and all(d >= 0 for d in t.shape[1:]) for t in model.inputs):
        model.predict({t.name: np.zeros([1, *t.shape[1:]], t.dtype) for t in model.inputs})


# ---------------------------------------------------------------------------
# The server


class Replica:
    """The server: the model once loaded, its calls (batched or not), the connections,
    statistics. Everything runs on the event loop but the model's calls, which run in
    a pool of threads."""

    def __init__(self, args):
        self.args = args
        self.name, self.version, self.kind = args.name, str(args.version), args.kind
        self.model: Model | None = None
        self.ready = False
        self.call = None
        self.stats = Stats()
        self.token = os.environ.get("PAI_SERVING_TOKEN", "").encode()
        self.log = args.request_log == "on"
        self.idle: dict = {}        # the connections waiting for a request: writer -> since when
        self.in_flight = 0
        self.draining = False

    def loaded(self, model: Model) -> None:
        lock = threading.Lock()

        def predict(arrays: dict) -> dict:
            if model.thread_safe:
                return model.predict(arrays)
            with lock:
                return model.predict(arrays)

        warm_up(model)
        a = self.args
        threads = a.num_batch_threads if a.max_batch_size > 0 else os.cpu_count() or 1   # unbatched: a call a core
        self.call = Batcher(predict, a.max_batch_size, a.batch_timeout_micros / 1e6, threads).run
        self.model, self.ready = model, True

    def say(self, line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async def answer(self, method: str, path: str, body: bytes | None) -> tuple[int, dict, int, int, str]:
        """(status, JSON answer, rows, rows of the model call, the Allow header of a 405)
        for one request; errors in the protocol's form."""
        try:
            return (*await self._answer(route(method, path), body), "")
        except HttpError as err:
            return err.status, {"error": err.message}, 0, 0, err.allow
        except Exception as err:   # the framework refused the input (a shape it cannot take)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            return 400, {"error": f"the model could not run on this input: {first}"}, 0, 0, ""

    async def _answer(self, found: Route, body: bytes | None) -> tuple[int, dict, int, int]:
        a = found.action
        if a == "live":
            return 200, {"live": True}, 0, 0
        if a == "ready":
            return (200 if self.ready else NOT_READY), {"ready": self.ready}, 0, 0
        if a == "server":
            return 200, {"name": "paicli-serving", "version": "1", "extensions": []}, 0, 0
        check_model(found, self.name, self.version)
        if a == "status":
            return 200, {"model_version_status": [{"version": self.version,
                                                   "state": "AVAILABLE" if self.ready else "LOADING",
                                                   "status": {"error_code": "OK", "error_message": ""}}]}, 0, 0
        if a == "model_ready":
            return (200 if self.ready else NOT_READY), {"name": self.name, "ready": self.ready}, 0, 0
        model = self.model
        if model is None:
            raise HttpError(503, f"model {self.name!r} is loading; /v2/health/ready says when it is ready")
        if a == "metadata":
            return 200, {"model_spec": {"name": self.name, "signature_name": "", "version": self.version},
                         "metadata": {"signature_def": {"signature_def": {SIGNATURE: {
                             "inputs": {t.name: t.tf() for t in model.inputs},
                             "outputs": {t.name: t.tf() for t in model.outputs},
                             "method_name": "tensorflow/serving/predict"}}}}}, 0, 0
        if a == "model":
            return 200, {"name": self.name, "versions": [self.version], "platform": PLATFORMS[self.kind],
                         "inputs": [t.v2() for t in model.inputs], "outputs": [t.v2() for t in model.outputs]}, 0, 0
        data = parse_json(body or b"")
        if a == "predict":
            arrays, form = parse_tf_predict(data, model.inputs)
            outputs, batch = await self.call(arrays)
            return 200, tf_response(outputs, form), rows_of(arrays), batch
        arrays, wanted, echo = parse_v2_infer(data, model.inputs, model.outputs)
        outputs, batch = await self.call(arrays)
        return 200, v2_response(self.name, self.version, outputs, wanted, echo), rows_of(arrays), batch

    # -- HTTP/1.1: keep-alive connections, one request at a time each (pipelined ones in turn)

    async def connection(self, reader, writer) -> None:
        # asyncio's TCP transports set TCP_NODELAY, and an answer goes out in one write.
        try:
            while not self.draining:
                self.idle[writer] = time.monotonic()
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                finally:
                    self.idle.pop(writer, None)
                if not await self.request(head, reader, writer):
                    return
        finally:
            writer.close()

    async def request(self, head: bytes, reader, writer) -> bool:
        """Reads the body, answers, logs: whether the connection stays open."""
        started = time.perf_counter()
        method, path, keep, status, rows, batch, allow = "", "", False, 0, 0, 0, ""
        self.in_flight += 1
        try:
            try:
                method, path, keep, headers = parse_head(head)
            except ValueError as err:
                status, answer = 400, {"error": f"not an HTTP/1.1 request: {err}"}
            else:
                length = headers.get("content-length", "")
                length = int(length) if length.isascii() and length.isdigit() else -1
                if self.token and not hmac.compare_digest(headers.get(TOKEN_HEADER.lower(), "").encode(), self.token):
                    status, answer, keep = 401, {"error": f"missing or wrong {TOKEN_HEADER} header"}, False
                elif length < 0 and method == "POST":
                    status, answer, keep = 411, {"error": "a POST needs a Content-Length header"}, False
                elif length > self.args.max_body_bytes:
                    status, answer, keep = 413, {"error": f"the body is {length} bytes, over the limit of "
                                                          f"{self.args.max_body_bytes}"}, False   # its body is not read
                else:
                    if length > 0 and headers.get("expect", "").lower() == "100-continue":
                        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    body = await reader.readexactly(length) if length > 0 else None
                    status, answer, rows, batch, allow = await self.answer(method, path, body)
            keep = keep and not self.draining
            writer.write(response(status, answer, allow, keep))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            status, keep = 0, False
        finally:
            self.in_flight -= 1
            ms = (time.perf_counter() - started) * 1000
            # The router's health checks (four a second) are neither traffic nor errors.
            if not path.startswith(HEALTH_PREFIX):
                self.stats.record(ms, status >= 400 or status == 0)
                if self.log:
                    self.say(f"{method} {path[:200]} {status} {ms:.2f}ms" + (f" {rows} rows" if rows > 0 else "")
                             + (f" in a batch of {batch}" if batch > rows > 0 else ""))
        return keep

    async def ticks(self) -> None:
        """Once a second: the summary line, and idle keep-alive connections closed."""
        while True:
            await asyncio.sleep(SUMMARY_SECONDS)
            line = self.stats.summary()
            if line:
                self.say(line)
            old = time.monotonic() - IDLE_SECONDS
            for writer in [w for w, since in self.idle.items() if since < old]:
                writer.close()


def parse_head(head: bytes) -> tuple[str, str, bool, dict]:
    """A request's line and headers -> (method, target, whether the connection stays open,
    {lower-case name: value}); ValueError when it is not HTTP/1.x. HTTP/1.1 keeps a
    connection open unless told to close, HTTP/1.0 closes it unless told not to."""
    lines = head.decode("latin-1").split("\r\n")
    words = lines[0].split(" ")
    if len(words) != 3 or not words[2].startswith("HTTP/1."):
        raise ValueError(f"request line {lines[0][:100]!r}")
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep = connection != "close" if words[2] != "HTTP/1.0" else connection == "keep-alive"
    return words[0], words[1], keep, headers


def response(status: int, answer: dict, allow: str, keep: bool) -> bytes:
    data = json.dumps(answer, separators=(",", ":")).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nServer: paicli-serving\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            + (f"Allow: {allow}\r\n" if allow else "") + ("" if keep else "Connection: close\r\n")
            + "\r\n").encode() + data


def parse_args(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serving_runner.py")
    parser.add_argument("--model", required=True)
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--name", required=True)
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--weights")
    parser.add_argument("--max-batch-size", type=int, default=0)
    parser.add_argument("--batch-timeout-micros", type=int, default=1000)
    parser.add_argument("--num-batch-threads", type=int, default=1)
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20)
    parser.add_argument("--request-log", choices=("on", "off"), default="on")
    return parser.parse_args(argv)


RUNTIME_LOCK: int | None = None


async def serve(args, host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    replica = Replica(args)
    server = await asyncio.start_server(replica.connection, host, port, backlog=128)
    ticks = loop.create_task(replica.ticks())
    try:
        model = await loop.run_in_executor(None, load_model, args.kind, args.model, args.weights)
        await loop.run_in_executor(None, replica.loaded, model)
    except Exception as err:
        replica.say(f"serving: cannot load the {args.kind} model {args.model}: {type(err).__name__}: {err}")
        return 1
    # The framework's objects, hundreds of thousands, are kept out of the collector's
    # full passes, which every request's JSON lists set off now and then: a pass over
    # them all costs the loop more than the request itself.
    gc.freeze()
    replica.say(f"serving {args.name} version {args.version} ({args.kind}) ready on {host}:{port}")
    await stop.wait()
    # Drain: no new connections, idle ones closed; the requests already read are answered.
    server.close()
    replica.draining = True
    for writer in list(replica.idle):
        writer.close()
    deadline = time.monotonic() + DRAIN_SECONDS
    while replica.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    ticks.cancel()
    line = replica.stats.summary()
    if line:
        replica.say(line)
    replica.say(f"serving {args.name}: stopped")
    return 0


def main(argv: list) -> int:
    global RUNTIME_LOCK
    from runtime_lock import hold_runtime_lock  # siblings in runners/, staged with us on every node

    RUNTIME_LOCK = hold_runtime_lock()  # kept open until this process ends
    args = parse_args(argv)
    host, port = os.environ.get("PAI_HOST", "127.0.0.1"), int(os.environ.get("PAI_PORT", "8501"))
    return asyncio.run(serve(args, host, port))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
