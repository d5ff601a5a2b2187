"""A job's environment on its nodes: its declared variables
(paicli/envvars.py) and its requirements layer (runners/runtimes.py: Layer).

At submit (`prepare_job_env`): the job's `env` goes into every role; the layer is
built on this machine first (a requirement pip cannot satisfy is one line, before
anything starts), its `site` folder goes on every instance's PYTHONPATH, and
`layer.json` says what every other node must build, pinned.

On nodes, before any instance starts: SSH runs the staged runners/runtimes.py
(`ensure_on_ssh_node`), Ray the instance actor (`layer_spec`). A layer is cached per
node by digest.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from paicli.cluster import remote_paths, ssh_transport as ssh
from paicli.cluster.logsink import InstanceLog
from paicli.cluster.node_admin import stream_command
from paicli.cluster.node_files import NodeFile
from paicli.envvars import Masker, apply_to_plan, secret_values
from paicli.errors import PaiError, UsageError
from paicli.private import write_private
from paicli.requirements import find_links
from paicli.runners.runtimes import (DETAIL, Layer, PipError, RuntimeSetupError, folder_digest, get_runtime,
                                     layer_digest, runtime_root)

LAYER_FILE = "layer.json"
PIP_LOG = "pip.log"
Progress = Callable[[str], None]


def ensure_layer(runtime: str, lines: list[str], progress: Progress, log: Path | None = None) -> tuple[Layer, dict]:
    """The layer of `lines` on `runtime` ("": the Python paicli runs on), built here
    unless it is cached; Layer.ensure's result. pip's output goes to `log` when given."""
    if runtime:
        rt = get_runtime(runtime)
        # Your own interpreter (PAI_<NAME>_PYTHON) is another base than the provisioned one.
        version, python = rt.version + (f"|{rt.override}" if rt.override else ""), rt.python()
    else:
        version, python = f"python{sys.version_info[0]}.{sys.version_info[1]}", sys.executable
    layer = Layer(runtime, python, layer_digest(runtime, version, lines, folder_digest(find_links(lines))), lines)
    return layer, layer.ensure(progress, log_path=str(log) if log and not layer.installed() else None)


def prepare_job_env(spec, plan, job_dir: Path, progress: Progress, home: Path | None = None) -> None:
    """The job's declared env into its plan, and its requirements layer built here."""
    apply_to_plan(plan, spec.get("env") or {})
    lines = spec.get("requirements")
    if not lines:
        return

    log = job_dir / PIP_LOG
    try:
        layer, built = ensure_layer(plan.runtime or "", lines, progress, log)
    except PipError as err:
        kept = _keep_log(log, home or job_dir.parent.parent, job_dir.name)
        # pip's verdict on the requirements is bad input: exit 2, nothing submitted.
        raise UsageError(f"-Drequirements: {err.line}", f"pip's full log: {kept}") from None
    except RuntimeSetupError as err:
        raise PaiError(f"-Drequirements: {err}") from None
    for role in plan.roles:
        paths = [built["site"]] + ([role.env["PYTHONPATH"]] if role.env.get("PYTHONPATH") else [])
        role.env["PYTHONPATH"] = ":".join(paths)
        role.env["PAI_LAYER"] = built["path"]
    plan.notes.append(f"requirements: layer {layer.name} ({', '.join(built['pins']) or 'nothing to add'})")
    write_private(job_dir / LAYER_FILE, json.dumps(
        {"name": layer.name, "base": plan.runtime or "", "python": layer.python, "digest": layer.digest,
         "lines": lines, "pins": built["pins"], "links": find_links(lines), "path": built["path"]}, indent=2))


def _keep_log(log: Path, home: Path, job_id: str) -> str:
    """A submit that fails removes its job folder: the pip log moves out first."""
    if not log.exists():
        return "(no log)"
    folder = home / "pip-logs"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    kept = folder / f"{job_id}.log"

    shutil.move(str(log), kept)
    return str(kept)


def read_layer(job_dir: str | Path) -> dict | None:
    path = Path(job_dir) / LAYER_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())


def layer_files(layer: dict) -> dict[str, list[tuple[str, str]]]:
    """--find-links folder -> [(file name, local path)]: what travels to a node."""
    out = {}
    for folder in layer.get("links", []):
        out[folder] = [(name, os.path.join(folder, name)) for name in sorted(os.listdir(folder))
                       if os.path.isfile(os.path.join(folder, name))]
    return out


def layer_spec(job_dir: str | Path) -> dict | None:
    """What a Ray node needs to build the job's layer: the layer.json and the
    --find-links files' bytes (small wheelhouses; an index is better for big ones)."""
    layer = read_layer(job_dir)
    if layer is None:
        return None
    files = {folder: [(name, Path(path).read_bytes()) for name, path in items]
             for folder, items in layer_files(layer).items()}
    return {**layer, "files": files}


def save_node_log(job_dir: str | Path, node: str, text: str) -> str:
    """A node's pip output, kept in the job folder."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
    path = Path(job_dir) / f"pip-{safe}.log"
    write_private(path, text)
    return str(path)


def ensure_on_ssh_node(session, node, job_dir: str, folder: str, info: dict, progress: Progress) -> None:
    """Build the job's layer on an SSH node (cached there by digest), before any
    instance starts; PaiError with pip's one line if it cannot be."""
    layer = read_layer(job_dir)
    if layer is None:
        return

    links = {}
    files = []
    for i, (local, items) in enumerate(layer_files(layer).items()):
        links[local] = f"{folder}/layer-links/{i}"
        files += [NodeFile(path, f"layer-links/{i}/{name}", 0o600) for name, path in items]
    if files:
        writer = ssh.open_files(session, node)
        try:
            writer.put_files(files, folder, {node.job_root.rstrip("/"), folder})
        finally:
            writer.close()
    mapping = remote_paths.normalise([(str(runtime_root()), info["runtime_dir"]),
                                      (sys.executable, info["python_path"])])
    spec = {"base": layer["base"], "digest": layer["digest"], "lines": layer["lines"], "pins": layer["pins"],
            "links": links, "python": remote_paths.translate(layer["python"], mapping)}
    # The node program Ray's actor runs too: progress lines, then the result as JSON
    # (or `ERROR one line`, then the pip log).
    argv = ["env", f"PAI_RUNTIME_DIR={info['runtime_dir']}", info["python_path"], "-u",
            f"{folder}/runners/node_runtime.py", "layer", json.dumps(spec)]
    started = time.monotonic()
    status, lines = stream_command(session, node, argv, lambda line: None, f"the layer {layer['name']}")
    ok = status == 0 and lines and lines[-1].startswith("{")
    if not ok:
        error = next((x[len("ERROR "):] for x in lines if x.startswith("ERROR ")), (lines or ["no output"])[-1])
        kept = save_node_log(job_dir, node.name, "\n".join(lines) + "\n")
        raise PaiError(f"-Drequirements on node {node.name}: {error}", f"pip's full log: {kept}")
    for line in lines[:-1]:
        if not line.startswith(DETAIL):   # pip's own lines stay in the node's pip.log
            progress(f"{node.name}: {line}")
    if json.loads(lines[-1]).get("built"):
        progress(f"{node.name}: layer {layer['name']} built in {time.monotonic() - started:.1f}s")


# -- the master's side: declared variables cross to nodes, secrets stay out of logs --


def declare_in_master(plan) -> None:
    """The backends send a node only the variables the master's own environment
    lacks or has otherwise (its PATH, HOME are this machine's). A variable the job
    declares must cross even when the submitting shell had the same value (as with
    `-Denv=HF_TOKEN`), so the master, in its own process, forgets its own copy of
    exactly those (a local instance still gets them: they are in its role's env)."""
    for role in plan.roles:
        for name, value in role.env.items():
            if os.environ.get(name) == value:
                del os.environ[name]


def instance_log(plan, path: Path, prefix: str, cap: int):
    """The master's log of one instance attempt, with secret values masked in
    everything it writes and shows (its file, job.log, the tail, live lines)."""
    secrets = secret_values(plan)
    if not secrets:
        return InstanceLog(path, prefix, cap)

    class MaskedInstanceLog(InstanceLog):
        def __init__(self):
            super().__init__(path, prefix, cap)
            self.masker = Masker(secrets)

        def feed(self, data: bytes) -> bytes:
            return super().feed(self.masker.feed(data))

        def flush(self) -> bytes:
            held = self.masker.flush()
            return (super().feed(held) if held else b"") + super().flush()

    return MaskedInstanceLog()
