"""The requirements layers in `pai runtime list` / `pai runtime remove`.

The runtime commands themselves are in cli.py; these are the layer rows they show
and the checked removal of one layer.
"""

from __future__ import annotations

import time

from paicli.errors import NotFound, PaiError


def layer_rows() -> list[dict]:
    """One row per layer here, shaped like a runtime's row (kind "layer")."""
    from paicli.runners.runtimes import list_layers

    return [{"kind": "layer", "name": layer["name"], "installed": True, "path": layer["path"],
             "version": " ".join(x for x in layer["requirements"] if not x.startswith("-")),
             "size": layer["size"], "source": f"layer on {layer['base']}", "base": layer["base"],
             "last_use": layer["last_use"], "installed_packages": layer["installed"]} for layer in list_layers()]


def age(seconds_ago: float) -> str:
    if seconds_ago < 120:
        return "just now"
    unit, size = next((unit, size) for unit, size in (("d", 86400), ("h", 3600), ("min", 60)) if seconds_ago >= size)
    return f"{seconds_ago / size:.0f}{unit} ago"


def layer_line(row: dict) -> str:
    size = f"{row['size'] / 1e6:.1f} MB" if row["size"] >= 1e5 else f"{row['size'] / 1e3:.0f} kB"
    return (f"{row['name']:<28} layer on {row['base']:<10} {size:>8}  used {age(time.time() - row['last_use'])}  "
            f"{', '.join(row['installed_packages']) or '(nothing added)'}")


def _jobs_using(name: str) -> list[str]:
    """Jobs of this machine's store that have not ended and run on the layer."""
    import json
    from pathlib import Path

    from paicli.jobstatus import read_job
    from paicli.states import JobStatus
    from paicli.store import Store

    store = Store()
    using = []
    for job in store.jobs(500):
        if JobStatus(job["status"]).is_terminal():
            continue
        layer = Path(job["job_dir"]) / "layer.json"
        try:
            if layer.exists() and json.loads(layer.read_text()).get("name") == name \
                    and not JobStatus(read_job(store, job["id"])["status"]).is_terminal():
                using.append(job["id"])
        except (OSError, ValueError):
            continue
    return using


def remove_layer(name: str) -> str | None:
    """Delete a layer (its name, or a unique prefix) unless a job uses it (its store
    says so, or an instance holds it). The full name, or None if it was gone already."""
    from paicli.runners.runtimes import RuntimeSetupError, list_layers, remove_layer as remove

    names = [layer["name"] for layer in list_layers()]
    matches = [n for n in names if n == name] or [n for n in names if n.startswith(name)]
    if len(matches) != 1:
        raise NotFound(f"no single layer named {name!r}" + (f" ({len(matches)} match)" if matches else ""),
                       "`pai runtime list` shows the runtimes and layers")
    users = _jobs_using(matches[0])
    if users:
        raise PaiError(f"cannot remove the layer {matches[0]}: job {users[0]} uses it",
                       "try again when its jobs have ended (`pai list`)")
    try:
        return matches[0] if remove(matches[0]) else None
    except RuntimeSetupError as err:
        raise PaiError(str(err)) from None
