"""Serving's library: the model a `-name serving` job serves, found on this machine
before the job is planned, and the statement `pai serve` submits.

-Dmodel is a path or file:// URL (a model file, or a folder holding one), or
JOB_ID[:PATH]: the files that job left among its outputs (`pai outputs JOB_ID`;
files an ended job left on a node are brought here first), those under PATH when
given. adapters/serving.py says which kind of model the files hold.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from paicli import client, job_outputs
from paicli.adapters.serving import ONNX_REQUIREMENTS, Model, detect, files_under, model_error
from paicli.errors import NotFound, SpecError, UsageError
from paicli.jobplan import JobPlan, front_url
from paicli.requirements import project_name
from paicli.serving_quant import quantize
from paicli.spec import RawParam, resolve_path
from paicli.statement import Statement
from paicli.states import JobStatus

# A job ID (or a unique prefix of one: the ID starts with its submit time) and a path in its outputs.
JOB_MODEL = re.compile(r"(?P<job>\d{8}[0-9a-z]*)(?::(?P<path>.+))?")
Say = Callable[[str], None]


def resolve(prepared: client.Prepared, store, say: Say = lambda line: None) -> Model:
    """The model of a serving statement found and handed to its adapter; an ONNX model's
    replicas get onnxruntime and numpy as a requirements layer."""
    model = find_model(prepared.spec.get("model"), store, say)
    if prepared.spec.get("quantize") == "int8":   # served as the int8 ONNX model, or refused here
        path, _report = quantize(model.main, model.kind, prepared.spec.get("checkData"),
                                 prepared.spec.get("maxAccuracyDrop"), say)
        model = Model("onnx", path, files=[path], name=model.name)
    prepared.adapter.model = model
    if model.kind == "onnx":
        lines = list(prepared.spec.get("requirements") or [])
        names = {project_name(line) for line in lines}
        prepared.spec.params["requirements"] = lines + [r for r in ONNX_REQUIREMENTS if project_name(r) not in names]
    return model


def find_model(text: str, store, say: Say = lambda line: None) -> Model:
    """-Dmodel's model: a path that exists wins over a job ID of the same spelling."""
    try:
        exists = Path(os.path.expanduser(text)).exists()
    except (OSError, ValueError):   # a name too long, a NUL
        exists = False
    match = JOB_MODEL.fullmatch(text)
    if text.startswith("file://") or match is None or exists:
        try:
            path = resolve_path(text, Path.cwd())
            if not path.exists():
                raise model_error(f"{path} does not exist")
            files = files_under(str(path))
        except (OSError, ValueError) as err:
            raise model_error(f"cannot use {text[:80]!r} as a path: {getattr(err, 'strerror', None) or err}") from None
        model = detect(files)
        if model is None:
            raise model_error(f"{path} is no model paicli serves")
        return model
    return job_model(store, match.group("job"), match.group("path"), say)


def job_model(store, job_id: str, path: str | None, say: Say) -> Model:
    """The model among a job's outputs (under `path` when given)."""
    try:
        job = client.refresh(store, client.resolve_job(store, job_id, to="get the files of")["id"])
    except NotFound as err:
        raise SpecError("-Dmodel", str(err.message), "`pai list` shows the jobs; a model file's path works too") from None
    if not JobStatus(job["status"]).is_terminal():
        raise SpecError("-Dmodel", f"job {job['id']} has not ended, so its model may be half-written",
                        f"wait for it (`pai wait {job['id']}`), then serve it")
    try:
        chosen = job_outputs.choose(store, job["id"], say=say)
    except UsageError:
        chosen = job_outputs.Chosen(job["id"])
    files = [row["path"] for row in chosen.here]
    if path:
        files = [f for f in files if under(f, path)]
    model = detect(files + deploy_nets(files, job["job_dir"]))
    if model is None:
        where = f" under {path}" if path else ""
        raise model_error(f"no model among the outputs of job {job['id']}{where} ({len(files)} file(s); "
                          f"`pai outputs {job['id']}` lists them)")
    return model


def deploy_nets(files: list[str], job_dir: str) -> list[str]:
    """The prototxt files beside a job's .caffemodel outputs and beside its inputs (the
    solver's folder): a Caffe job writes weights, and its deploy net is the user's own file."""
    if not any(f.endswith(".caffemodel") for f in files):
        return []
    try:
        inputs = json.loads((Path(job_dir) / "plan.json").read_text()).get("inputs") or []
    except (OSError, ValueError):
        inputs = []
    folders = {os.path.dirname(f) for f in files if f.endswith(".caffemodel")} | {os.path.dirname(f) for f in inputs}
    return [str(p) for folder in sorted(folders) if os.path.isdir(folder) for p in Path(folder).glob("*.prototxt")]


def under(file: str, path: str) -> bool:
    """Whether an output's absolute path is `path` or lies under it (`path` absolute, or
    the end of the output's path: `export/mnist`, `mnist.keras`)."""
    path = path.rstrip("/")
    if os.path.isabs(path):
        return file == path or file.startswith(path + "/")
    return file.endswith("/" + path) or f"/{path}/" in file


# -- pai serve --------------------------------------------------------------------------

# `pai serve` options -> the statement's -D keys
SERVE_OPTIONS = {"name": "modelName", "port": "servingPort", "host": "servingHost", "max_batch_size": "maxBatchSize",
                 "batch_timeout_micros": "batchTimeoutMicros", "num_batch_threads": "numBatchThreads",
                 "version": "modelVersion", "quantize": "quantize", "check": "checkData",
                 "max_accuracy_drop": "maxAccuracyDrop"}


def serve_statement(model: str, replicas: int, options: dict, cwd: Path | None = None) -> Statement:
    """The `-name serving` statement `pai serve MODEL ...` stands for; a value's error
    names the option it came from."""
    base = cwd or Path.cwd()
    params = [RawParam("model", model, "MODEL", base),
              RawParam("cluster", {"replica": {"count": replicas}}, "--replicas", base)]
    params += [RawParam(key, options[opt], "--" + opt.replace("_", "-"), base)
               for opt, key in SERVE_OPTIONS.items() if options.get(opt) is not None]
    return Statement(framework="serving", params=params)


def service(store, job_id: str) -> dict:
    """What a serving job serves and where: id, name, kind, replicas, url (its plan)."""
    job = client.resolve_job(store, job_id)
    plan = JobPlan.from_json((Path(job["job_dir"]) / "plan.json").read_text())
    argv = plan.role(plan.front["role"]).argv
    return {"id": job["id"], "name": plan.job_name, "kind": argv[argv.index("--kind") + 1],
            "replicas": plan.role(plan.front["role"]).count,
            "url": front_url(plan.front), **({"token": plan.front["token"]} if plan.front.get("token") else {})}
