"""The backend registry: a backend by name, and the backend a job uses.

Which backend a job uses is decided once, at submit, from the nodes config:

    PAI_RAY_ADDRESS set                  -> {"backend": "ray", "address": ...}
    PAI_NODES=/path/nodes.yaml           -> paicli.cluster.nodes.load_config(path)
    else $PAI_HOME/nodes.yaml if present -> the same
    else                                 -> {"backend": "local"} (this machine alone)

The config's "backend" key names a backend registered here; the rest is what its
constructor reads. It is snapshotted into the job folder as `nodes.json` (0600),
so any process rebuilds the same backend with `backend_for_job(job_dir)`.
Backends are imported by name when used: a local job never imports paramiko or ray.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from paicli.errors import UsageError
from paicli.private import write_private


BACKENDS: dict[str, str] = {
    "local": "paicli.cluster.backends.local:LocalBackend",
    "ssh": "paicli.cluster.backends.ssh:SSHBackend",
    "ray": "paicli.cluster.backends.ray:RayBackend",
}
SNAPSHOT = "nodes.json"


def register(name: str, target: str) -> None:
    """Add a backend: `target` is "module:Class" (imported when first used)."""
    BACKENDS[name] = target


def get_backend(config: dict[str, Any]):
    return backend_class(config)(config)


def backend_class(config: dict[str, Any]) -> type:   # not built: Ray's constructor connects to its head
    return _backend_attr(config, BACKENDS[_backend_name(config)].partition(":")[2])


def probed_by_login(config: dict[str, Any]) -> bool:
    """Whether finding the nodes of `config` means reaching out to them (SSH logins,
    a Ray head): a job's master does that and keeps the connections for the job.
    This machine alone is read where the question is asked."""
    return _backend_name(config) != "local"


def list_nodes(config: dict[str, Any]) -> list[dict[str, Any]]:
    """`pai nodes` rows for a cluster that lists its own nodes (Ray): the backend
    module's `list_nodes(config)`."""
    return _backend_attr(config, "list_nodes")(config)


def _backend_name(config: dict[str, Any]) -> str:
    name = config.get("backend") or "local"
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}", f"valid backends: {', '.join(sorted(BACKENDS))}")
    return name


def _backend_attr(config: dict[str, Any], attr: str):
    """`attr` of the config's backend module, imported now (paramiko and ray only when used)."""
    name = _backend_name(config)
    module_name = BACKENDS[name].partition(":")[0]
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UsageError(f"the {name} backend is not available: {err}",
                         "pip install 'paicli[ray]' for Ray" if name == "ray" else "check the installation") from None


def nodes_file(home: Path) -> Path | None:
    given = os.environ.get("PAI_NODES")
    if given:
        return Path(given).expanduser()
    default = home / "nodes.yaml"
    return default if default.is_file() else None


def submit_config(home: Path) -> dict[str, Any]:
    """The nodes config a job submitted now would use (see the module docstring)."""
    address = os.environ.get("PAI_RAY_ADDRESS")
    if address:
        return {"backend": "ray", "address": address}
    path = nodes_file(home)
    if path is None:
        return {"backend": "local"}
    try:
        from paicli.cluster import nodes
    except ImportError:
        raise UsageError(f"{path}: nodes files are not supported by this installation",
                         "unset PAI_NODES / remove the file to run on this machine") from None
    config = nodes.load_config(path)
    if config.get("backend") not in BACKENDS:
        raise UsageError(f"{path}: unknown backend {config.get('backend')!r}",
                         f"valid backends: {', '.join(sorted(BACKENDS))}")
    return config


def write_snapshot(job_dir: Path, config: dict[str, Any]) -> None:
    write_private(Path(job_dir) / SNAPSHOT, json.dumps(config, indent=2, sort_keys=True))


def job_config(job_dir: Path) -> dict[str, Any]:
    """The snapshot; a job folder without one (recorded before multi-host) ran locally."""
    try:
        return json.loads((Path(job_dir) / SNAPSHOT).read_text())
    except FileNotFoundError:
        return {"backend": "local"}


def backend_for_job(job_dir: Path):
    """The backend the job was submitted with, rebuilt from its snapshot."""
    return get_backend(job_config(job_dir))
