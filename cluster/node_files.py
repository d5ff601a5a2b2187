"""What a node needs for a job, and where the job's paths are there: the one staging rule.

Every backend stages the same list into the node's per-job folder (the local
backend copies nothing: its mapping is the identity). The list:

- runners/*.py -> `runners/NAME`: the node agent and the framework runners.
- an archive's extracted code (the job folder's `code/`) -> `code/...`, whole:
  its folders, files and the relative links that stay inside it.
- the inputs the plan names (JobPlan.inputs, filled by the adapter): one under the
  job's working folder (where `pai` ran, for a plain script) -> `code/REL`, so the
  script's relative paths behave as here; any other -> `files/ABSOLUTE/PATH`, so
  inputs keep their places relative to each other (a Caffe solver and its net).
- the job folder's files instances read (INSTANCE_FILES): none; plan.json and
  spec.json hold the job's secrets, which reach an instance through its env only.

Nothing is guessed from argv: an absolute path the plan does not name as input
reaches the script unchanged (a shared filesystem, an output folder), as does one
below what the project folder left out; any other below the project folder maps.

`Manifest.mapping` gives the local prefixes -> node paths that translate argv, env
and cwd (cluster/remote_paths.py).

The contract other backends code against:
    NodeFile(src, dst, mode, kind="file", target="")
        src:    absolute path on the submitting machine
        dst:    path relative to the node's per-job folder ("runners/node_agent.py")
        mode:   0o700 for executables and folders, else 0o600
        kind:   "file", "dir" (a folder to create; src not read) or "link"
        target: for a link, its relative target (inside the same tree; src not read)
    Manifest.files (folders before what they hold), Manifest.mapping(folder, runtime_dir, python)
    manifest(job_dir, plan) -> Manifest
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paicli.cluster import RUNNERS_DIR, remote_paths
from paicli.cluster.nodes import config_from_dict
from paicli.runners.runtimes import runtime_root
from paicli.spec import parse_size

INSTANCE_FILES: tuple[str, ...] = ()   # job-folder files (by name) instances read
CODE = "code"
FILES = "files"


@dataclass(frozen=True)
class NodeFile:
    src: str
    dst: str
    mode: int
    kind: str = "file"
    target: str = ""


@dataclass
class Manifest:
    files: list[NodeFile]
    job_dir: str = ""
    trees: list[tuple[str, str]] = field(default_factory=list)    # local folder -> dst, by prefix
    exact: list[tuple[str, str]] = field(default_factory=list)    # local path -> dst, that path only
    here: list[str] = field(default_factory=list)                 # local folders and files that stay as they are

    def mapping(self, folder: str, runtime_dir: str, python: str) -> remote_paths.Mapping:
        folder = folder.rstrip("/")
        pairs: remote_paths.Mapping = [(str(runtime_root()), runtime_dir), (sys.executable, python)]
        pairs += [(local, f"{folder}/{dst}" if dst else folder) for local, dst in self.trees]
        pairs += [(remote_paths.Exact(local), f"{folder}/{dst}") for local, dst in self.exact]
        pairs += [(local, local) for local in self.here]
        return remote_paths.normalise(pairs)


def _mode(path: str) -> int:
    return 0o700 if os.stat(path).st_mode & stat.S_IXUSR else 0o600


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def _join(head: str, tail: str) -> str:
    return f"{head}/{tail}" if head and tail else head or tail


def runner_files() -> list[NodeFile]:
    return [NodeFile(str(p), f"runners/{p.name}", _mode(str(p))) for p in sorted(RUNNERS_DIR.glob("*.py"))]


def tree_files(local: str, dst: str) -> list[NodeFile]:
    """A folder whole: folders, files, and the relative links that stay inside it
    (any other link is left out: nothing outside the tree is reached)."""
    root = os.path.realpath(local)
    out = [NodeFile(local, dst, 0o700, "dir")]
    for dirpath, dirnames, filenames in os.walk(local):
        dirnames.sort()
        rel = os.path.relpath(dirpath, local)
        base = _join(dst, "" if rel == "." else rel)
        for name in [*dirnames, *sorted(filenames)]:
            src, here = os.path.join(dirpath, name), _join(base, name)
            if os.path.islink(src):
                link = os.readlink(src)
                if not os.path.isabs(link) and _inside(os.path.realpath(src), root):
                    out.append(NodeFile(src, here, 0o700, "link", link))
            elif os.path.isdir(src):
                out.append(NodeFile(src, here, 0o700, "dir"))
            elif os.path.isfile(src):
                out.append(NodeFile(src, here, _mode(src)))
    return out


def input_dst(path: str, cwds: list[str]) -> str:
    """Where an input goes in the node's per-job folder (see the module's docstring)."""
    for cwd in cwds:
        if _inside(path, cwd):
            return f"{CODE}/{os.path.relpath(path, cwd)}"
    return f"{FILES}/{path.lstrip('/')}"


def manifest(job_dir: str | Path, plan: Any) -> Manifest:
    job_dir = os.path.abspath(job_dir)   # as the plan and PAI_JOB_DIR spell it
    code = f"{job_dir}/{CODE}"
    files = runner_files()
    trees = [(str(RUNNERS_DIR), "runners"), (job_dir, "")]
    shared = shared_paths(job_dir)   # read in place on every node
    cwds = sorted({r.cwd.rstrip("/") for r in plan.roles if r.cwd and not _inside(r.cwd, job_dir)
                   and r.cwd.rstrip("/") != job_dir and not under(r.cwd, shared)}, key=len, reverse=True)
    exact = [(cwd, CODE) for cwd in cwds]
    if os.path.isdir(code):
        files += tree_files(code, CODE)
    else:   # the folder plain-script instances start in, standing for the working folder
        files.append(NodeFile(cwds[0] if cwds else code, CODE, 0o700, "dir"))
    folder = project_folder(job_dir)   # its files travel by cluster/workdir.py, through the nodes' cache
    here = []
    if folder:   # the instances' working folder, as a tree: every path below it maps but what it left out
        trees.append((folder["root"], CODE))
        exact = [pair for pair in exact if pair[0] != folder["root"]]
        here = [f"{folder['root']}/{rel}" for rel in folder.get("left", [])]
    seen = {f.dst for f in files} | ({f"{CODE}/{rel}" for rel, *_rest in folder["files"]} if folder else set())
    for path in getattr(plan, "inputs", None) or []:
        path = os.path.abspath(path)
        if _inside(path, job_dir) or not os.path.isfile(path) or under(path, shared):
            continue   # in the code tree already or on every node; a missing input is the script's to report
        dst = input_dst(path, cwds)
        if dst not in seen:
            seen.add(dst)
            files.append(NodeFile(path, dst, _mode(path)))
            exact.append((path, dst))
    files += [NodeFile(f"{job_dir}/{name}", name, 0o600) for name in INSTANCE_FILES
              if os.path.isfile(f"{job_dir}/{name}")]
    trees += data_trees(job_dir)
    files += module_files(job_dir)   # paitables for every job's scripts
    # -DcheckpointDir travels both ways (cluster/outputs.py brings it back).
    ckpt_files, ckpt_trees = staged_checkpoint(job_dir, plan, cwds)
    files += [f for f in ckpt_files if f.dst not in seen]
    trees += ckpt_trees
    return Manifest(files=files, job_dir=job_dir, trees=trees, exact=exact, here=here)


def project_folder(job_dir: str) -> dict | None:
    """JOB/workdir.json: the project folder and what of it is sent (cluster/workdir.py
    writes it at submit), or None: also when it lies under a `shared:` path, read in place."""
    try:
        with open(os.path.join(job_dir, "workdir.json")) as f:
            folder = json.load(f)
    except (OSError, ValueError):
        return None
    return None if under(folder["root"], shared_paths(job_dir)) else folder


def tar_stream(files: list[NodeFile]) -> bytes:
    """`files` as the tar stream runners/stage_writer.py writes on a node: how a node
    without SFTP gets them over an exec channel, and what Ray puts in its object
    store (so it must hold nothing secret: no plan.json, no env)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for f in files:
            if not f.dst:
                continue
            info = tarfile.TarInfo(f.dst)
            info.mode = f.mode
            if f.kind == "file":
                with open(f.src, "rb") as data:
                    info.size = os.fstat(data.fileno()).st_size
                    tar.addfile(info, data)
                continue
            info.type = tarfile.DIRTYPE if f.kind == "dir" else tarfile.SYMTYPE
            info.linkname = f.target
            tar.addfile(info)
    return buf.getvalue()


# -- per-node data -------------------------------------------------------------------
# Table slices and -Dbuckets folders travel by cluster/datasets.py, not here; the
# manifest holds only their mapping: a bucket folder here -> `buckets/K` on the node.


def shared_paths(job_dir: str) -> list[str]:
    """The `shared:` paths of the job's nodes file, from its snapshot (nodes.json)
    through cluster/nodes.py, the one reader of that key: the same on every node,
    so what lies below them is read in place there."""
    try:
        with open(os.path.join(job_dir, "nodes.json")) as f:
            snapshot = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(snapshot, dict) or not snapshot.get("shared"):
        return []   # none (every local and Ray job): cluster.nodes is not imported to say so

    try:
        return list(config_from_dict(snapshot).shared)
    except (AttributeError, TypeError):   # not a snapshot paicli wrote
        return []


def under_shared(path: str, shared: list[str]) -> bool:
    """`path` is a `shared:` path or below one (cluster/outputs.py's test, for
    checkpoints, is the same one)."""
    return under(path, shared)


def data_trees(job_dir: str) -> list[tuple[str, str]]:
    """The -Dbuckets folders of the job (JOB/data/buckets.json) -> buckets/K, but
    those under a `shared:` path (passed through untouched)."""
    try:
        with open(os.path.join(job_dir, "data", "buckets.json")) as f:
            folders = json.load(f)
    except (OSError, ValueError):
        return []
    shared = shared_paths(job_dir)
    return [(str(folder), f"buckets/{k}") for k, folder in enumerate(folders) if not under_shared(folder, shared)]


def module_files(job_dir: str) -> list[NodeFile]:
    """JOB/data/py/paitables.py (written at submit by cluster/datasets.py module_path,
    which puts that folder first on every role's PYTHONPATH) at the same place in
    the node's per-job folder, so the path maps like any other path of the job."""
    src = os.path.join(job_dir, "data", "py", "paitables.py")
    if not os.path.isfile(src):
        return []
    return [NodeFile(os.path.dirname(os.path.dirname(src)), "data", 0o700, "dir"),
            NodeFile(os.path.dirname(src), "data/py", 0o700, "dir"), NodeFile(src, "data/py/paitables.py", 0o600)]


# -- what a job's settings say about its files; its checkpoint folder travels too --------

PART = ".pai-part-"   # a file being written aside, never staged nor brought back


def is_url(value: str) -> bool:
    """A storage location the script reads and writes itself (s3://, oss://, hdfs://, gs://...)."""
    head, sep, _ = value.partition("://")
    return bool(sep) and head.replace("+", "").isalnum()


def under(path: str, prefixes: Iterable[str]) -> bool:
    """`path` is one of `prefixes` or below one."""
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def state_rel(role: str, idx: int) -> str:
    """Where the agent keeps what it listed before the instance started, relative to
    the job's folder (on a node: the per-job folder)."""
    return f"outputs/.{role}-{idx}.state.json"


def checkpoint_dir(value: str | None, cwd: str | None, shared: Iterable[str] = ()) -> str | None:
    """-DcheckpointDir as a local absolute path to watch and stage, or None (not
    given, a storage URL, or under a `shared:` path)."""
    if not value or is_url(value):
        return None
    path = os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(value)))
    return None if under(path, shared) else path


def job_settings(job_dir: str | Path) -> dict[str, Any]:
    """What spec.json and nodes.json say about files: checkpointDir, the sync period,
    the size limit, the shared paths."""
    try:
        spec = json.loads((Path(job_dir) / "spec.json").read_text())
    except (OSError, ValueError):
        spec = {}
    try:
        nodes = json.loads((Path(job_dir) / "nodes.json").read_text())
    except (OSError, ValueError):
        nodes = {}
    sync = spec.get("checkpoint_sync_seconds")
    return {"checkpoint_dir": spec.get("checkpoint_dir"), "sync": 60 if sync is None else int(sync),
            "max_bytes": parse_size(spec["output_max_size"]) if spec.get("output_max_size") else None,
            "shared": tuple(shared_paths(str(job_dir))), "backend": nodes.get("backend", "local")}


def staged_checkpoint(job_dir: str, plan: Any, cwds: list[str]) -> tuple[list, list[tuple[str, str]]]:
    """For manifest(): the checkpoint folder's contents as they are
    here (an earlier run's, the latest sync of a restarted instance's, a resumed
    job's) and the mapping of its path on the nodes. Nothing when there is none, or
    it is a URL or a shared path."""
    settings = job_settings(job_dir)
    cwd = next((r.cwd for r in plan.roles if r.cwd), None)
    ckpt = checkpoint_dir(settings["checkpoint_dir"], cwd, settings["shared"])
    if not ckpt or under(ckpt, [job_dir]):
        return [], []
    dst = input_dst(ckpt, cwds or ([cwd] if cwd else []))
    if os.path.isdir(ckpt):
        files = [f for f in tree_files(ckpt, dst) if PART not in os.path.basename(f.dst)]
    else:
        files = [NodeFile(ckpt, dst, 0o700, "dir")]
    return files, [(ckpt, dst)]
