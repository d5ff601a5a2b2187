"""`-name serving`: a trained model answering requests, as a job whose instances do not finish.

One role, `replica` (-Dcluster='{"replica":{"count":2}}'): each instance runs
runners/serving_runner.py in the model's framework runtime on its own port, and is
restarted when it dies. The job ends on `pai kill`. A router on the submitting
machine (JobPlan.front, cluster/router.py) spreads requests over the ready replicas
at -DservingHost:-DservingPort.

The model is found on the submitting machine before planning (paicli/serving.py:
a path, a file:// URL or JOB_ID[:PATH]); `detect` below says which kind of model a
set of files holds. Its files are the plan's inputs, staged to every node.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import dataclass, field

from paicli.adapters.base import NUMBER, Adapter, StagedCode, cluster_roles
from paicli.errors import SpecError, UsageError
from paicli.jobplan import RESTART_INSTANCE, JobPlan, RolePlan, front_url, is_loopback
from paicli.runners.runtimes import get_runtime, runner_path
from paicli.spec import JobSpec, Param, parse_size

RUNNER = "serving_runner.py"
ROLE = "replica"
# kind -> the runtime its replicas run in (None: the interpreter paicli runs on, with a layer)
RUNTIMES = {"savedmodel": "tensorflow", "keras": "tensorflow", "gluon": "mxnet", "caffe": "caffe", "onnx": None}
ONNX_REQUIREMENTS = ("onnxruntime==1.32.0", "numpy")
# A replica that dies is restarted this many times unless -DmaxRetries says otherwise.
SERVING_RETRIES = 1000
MODEL_EXPECTED = ("a SavedModel folder (saved_model.pb), a .keras file, a Gluon export (NAME-symbol.json with "
                  "NAME-0000.params), a Caffe deploy .prototxt with its .caffemodel, or a .onnx file")
# The replica's once-a-second summary (runners/serving_runner.py): the service's metrics.
SERVING_METRIC = (rf"^serving: requests=(?P<requests>\d+), rps=(?P<rps>{NUMBER}), p50_ms=(?P<p50_ms>{NUMBER}), "
                  rf"p90_ms=(?P<p90_ms>{NUMBER}), p99_ms=(?P<p99_ms>{NUMBER}), errors=(?P<errors>\d+)")
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

SERVING_PARAMS: tuple[Param, ...] = (
    Param("model", help="The model to serve: a path or file:// URL (a SavedModel folder, a .keras file, a "
          "Gluon -symbol.json, a Caffe deploy .prototxt beside its .caffemodel, a .onnx file, or a folder "
          "holding one), or JOB_ID[:PATH]: the model a job wrote among its outputs (`pai outputs JOB_ID`)."),
    Param("modelName", check=lambda v: None if MODEL_NAME.fullmatch(v) else
          "expected letters, digits, '.', '_' or '-' (it goes into the URL)",
          help="The name clients use in the URL, /v1/models/NAME (default: the model's folder or file name)."),
    Param("modelVersion", "int", default=1, minimum=1, help="The version the model is served as."),
    Param("servingPort", "int", default=8501, minimum=1,
          check=lambda v: None if v <= 65535 else f"a port is at most 65535, not {v}",
          help="The port the router listens on, on the submitting machine."),
    Param("servingHost", default="127.0.0.1",
          help="The address the router binds (0.0.0.0: every interface of the submitting machine)."),
    Param("maxBatchSize", "int", default=0, minimum=0,
          help="Dynamic batching: concurrent requests are combined into one call of the model of up to this "
               "many rows (TensorFlow Serving's max_batch_size). 0: off, every request is its own call."),
    Param("batchTimeoutMicros", "int", default=1000, minimum=0,
          help="How long a batch waits for more requests once it has one (batch_timeout_micros)."),
    Param("numBatchThreads", "int", default=1, minimum=1,
          help="How many batches a replica runs at once (num_batch_threads)."),
    Param("maxBodyBytes", default="64M", check=lambda v: None if parse_size(v) is not None else
          f"expected a size such as 64M or 1048576 (bytes), not {v!r}",
          help="The largest request body a replica reads; a larger one gets 413."),
    Param("requestLog", "choice", default="true", choices=("true", "false"),
          help="true: one line per request in the replica's log (`pai logs`); the once-a-second summary "
               "(requests, rate, latency percentiles, errors) is written either way."),
    Param("quantize", "choice", default="none", choices=("none", "int8"),
          help="int8: serve the model converted to ONNX and quantised to 8-bit integers."),
    Param("checkData", "path",
          help="With -Dquantize=int8: a labelled CSV sample (last column the label) both models are checked on."),
    Param("maxAccuracyDrop", "float", default=1.0, minimum=0,
          help="With -Dquantize=int8: the most accuracy (in points) the int8 model may lose on -DcheckData."),
)


@dataclass
class Model:
    """A model found on this machine: its kind, the file the runner loads, the weights
    beside it (Gluon's .params, Caffe's .caffemodel), every file it needs, and the
    name it is served under by default."""

    kind: str
    main: str
    weights: str | None = None
    files: list[str] = field(default_factory=list)
    name: str = "model"


def model_error(what: str) -> SpecError:
    return SpecError("-Dmodel", what, f"give {MODEL_EXPECTED}, or JOB_ID[:PATH] of a job that saved one")


def _number(path: str) -> int:
    """The last number in a file name (a snapshot's iteration, an export's epoch): the newest wins."""
    found = re.findall(r"\d+", os.path.basename(path))
    return int(found[-1]) if found else -1


def _is_deploy(path: str) -> bool:
    """A Caffe net that takes its input from a caller (an Input layer or input: fields), not a solver."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return False
    return bool(re.search(r'type\s*:\s*"Input"|^\s*input\s*:', text, re.M)) and "base_lr" not in text


def _one(found: list[str], kind: str) -> str:
    if len(found) > 1:
        shown = ", ".join(sorted(found)[:4]) + (" ..." if len(found) > 4 else "")
        raise UsageError(f"-Dmodel: {len(found)} {kind} models: {shown}",
                         "name one: JOB_ID:PATH, or the file's own path")
    return found[0]


def _stem_name(path: str, suffix: str = "") -> str:
    name = os.path.basename(path)
    name = name[:-len(suffix)] if suffix and name.endswith(suffix) else os.path.splitext(name)[0]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip("._-")
    return name[:128] or "model"


def detect(files: list[str]) -> Model | None:
    """The model among `files` (absolute paths), by kind in this order: a SavedModel,
    a .keras file, a Gluon export (its newest -NNNN.params), a Caffe deploy prototxt
    with the newest .caffemodel, a .onnx file. None: none of them."""
    files = sorted(set(files))
    saved = [os.path.dirname(f) for f in files if os.path.basename(f) == "saved_model.pb"]
    if saved:
        folder = _one(saved, "SavedModel")
        # TensorFlow Serving's layout, models/NAME/VERSION/saved_model.pb: named by NAME
        named = os.path.dirname(folder) if os.path.basename(folder).isdigit() else folder
        return Model("savedmodel", os.path.join(folder, "saved_model.pb"),
                     files=[f for f in files if f.startswith(folder + os.sep)], name=_stem_name(named))
    keras = [f for f in files if f.endswith(".keras")]
    if keras:
        path = _one(keras, ".keras")
        return Model("keras", path, files=[path], name=_stem_name(path))
    for symbol in (f for f in files if f.endswith("-symbol.json")):
        prefix = symbol[:-len("-symbol.json")]
        params = [f for f in files if re.fullmatch(re.escape(prefix) + r"-\d{4}\.params", f)]
        if params:
            weights = max(params, key=_number)
            return Model("gluon", symbol, weights, [symbol, weights], _stem_name(symbol, "-symbol.json"))
    weights = [f for f in files if f.endswith(".caffemodel")]
    deploy = [f for f in files if f.endswith((".prototxt", ".pbtxt")) and _is_deploy(f)]
    if weights and deploy:
        net = _one(deploy, "Caffe deploy prototxt")
        newest = max(weights, key=_number)
        return Model("caffe", net, newest, [net, newest], _stem_name(re.sub(r"_iter_\d+$", "", _stem_name(newest))))
    onnx = [f for f in files if f.endswith(".onnx")]
    if onnx:
        path = _one(onnx, ".onnx")
        return Model("onnx", path, files=[path], name=_stem_name(path))
    return None


# A model file -> the name endings of the files it needs beside it
PARTNERS = {".prototxt": (".caffemodel",), ".pbtxt": (".caffemodel",), "-symbol.json": (".params",),
            ".caffemodel": (".prototxt", ".pbtxt"), ".params": ("-symbol.json",)}


def files_under(path: str) -> list[str]:
    """Every file of a folder, or a model file and its partners beside it (a Caffe net and
    its weights, a Gluon symbol and its parameters); a SavedModel by its saved_model.pb."""
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _dirs, names in os.walk(path) for f in names]
    folder = os.path.dirname(path)
    if os.path.basename(path) == "saved_model.pb":
        return files_under(folder)
    ends = next((partners for end, partners in PARTNERS.items() if path.endswith(end)), ())
    return [path] + [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if ends and f.endswith(ends)]


class ServingAdapter(Adapter):
    name = "serving"
    task_name = "ServingTask"
    params = SERVING_PARAMS
    metric_patterns = (SERVING_METRIC,)
    requires_script = False
    model: Model | None = None   # set by paicli.serving.resolve before the plan

    def validate(self, spec: JobSpec) -> None:
        if not spec.get("model"):
            raise model_error("missing")
        if spec.get("script"):
            raise SpecError("-Dscript", "a serving job runs no script", "drop -Dscript; -Dmodel names what is served")
        for role in spec.get("cluster") or {}:
            if role != ROLE:
                raise SpecError("-Dcluster", f'a serving job has no role "{role}"',
                                'its one role is "replica", e.g. {"replica":{"count":2}}')

    def plan(self, spec: JobSpec, code: StagedCode) -> JobPlan:
        model = self.model
        if model is None:
            raise UsageError("-Dmodel: the model was not resolved",
                             "call paicli.serving.resolve(prepared, store) before client.submit")
        self.runtime = RUNTIMES[model.kind]
        python = get_runtime(self.runtime).python() if self.runtime else None
        name = spec.get("modelName") or model.name
        max_body = parse_size(spec.get("maxBodyBytes"))
        argv = [python or sys.executable, "-u", runner_path(RUNNER), "--model", model.main, "--kind", model.kind,
                "--name", name, "--version", str(spec.get("modelVersion")),
                *(["--weights", model.weights] if model.weights else []),
                "--max-batch-size", str(spec.get("maxBatchSize")),
                "--batch-timeout-micros", str(spec.get("batchTimeoutMicros")),
                "--num-batch-threads", str(spec.get("numBatchThreads")),
                "--max-body-bytes", str(max_body),
                "--request-log", "on" if spec.get("requestLog") == "true" else "off"]
        # The router and the replicas share this secret: nobody else reaches a replica's port.
        env = {"PAI_SERVING_TOKEN": secrets.token_hex(16), "TF_CPP_MIN_LOG_LEVEL": "2", "GLOG_minloglevel": "1"}
        conf = cluster_roles(spec, {ROLE: {"count": 1}})[ROLE]
        role = RolePlan(name=ROLE, count=conf["count"], argv=argv, must_finish=True, listens=True, env=env,
                        cwd=str(code.cwd), cpu=conf["cpu"], memory=conf["memory"],
                        gpu=conf["gpu"] or spec.get("gpuRequired"))
        front = {"host": spec.get("servingHost"), "port": spec.get("servingPort"), "role": ROLE, "max_body": max_body}
        if not is_loopback(front["host"]):
            # Told to listen beyond this machine: clients show a bearer token, as for the logview.
            front["token"] = secrets.token_urlsafe(24)
        notes = [f"serving {model.kind} model {model.main} as {name} version {spec.get('modelVersion')} on "
                 f"{conf['count']} replica(s), in the {self.runtime or 'python'} runtime",
                 f"router at {front_url(front)}; a replica that dies is restarted"]
        if spec.get("maxBatchSize"):
            notes.append(f"dynamic batching: up to {spec.get('maxBatchSize')} rows, waiting at most "
                         f"{spec.get('batchTimeoutMicros')} us, {spec.get('numBatchThreads')} batch thread(s)")
        plan = self.job_plan(spec, name, [role], restart=RESTART_INSTANCE, notes=notes, inputs=list(model.files),
                             front=front)
        if "maxRetries" not in spec.params:
            plan.max_retries = SERVING_RETRIES
        return plan
