"""Path translation for a remote node (pure functions, unit-tested).

plan.json's argv, env and cwd hold absolute paths of the submitting machine. A
mapping is a list of (local prefix, node prefix) pairs; the longest match wins.
A value is translated when it IS a mapped path, starts with one followed by '/',
or is `--flag=PATH` / `key=PATH` with such a path after the first '='. A local
path given as `Exact(path)` translates only itself, never what lies below it (the
working folder of a plain script: a file below it that is not staged stays as it is).
"""

from __future__ import annotations

Mapping = list[tuple[str, str]]


class Exact(str):
    """A local path in a mapping that matches only itself, not as a prefix."""


def normalise(mapping: Mapping) -> Mapping:
    """Longest local prefix first; trailing slashes dropped; empty or '/' prefixes
    ignored (they would translate everything)."""
    cleaned = []
    for local, remote in mapping:
        local = Exact(local.rstrip("/")) if isinstance(local, Exact) else local.rstrip("/")
        if local and remote:
            cleaned.append((local, remote.rstrip("/") or "/"))
    table: dict[str, str] = {}
    for local, remote in cleaned:
        table.pop(local, None)   # the later pair wins, its Exact-ness with it
        table[local] = remote
    return sorted(table.items(), key=lambda pair: len(pair[0]), reverse=True)


def translate_path(value: str, mapping: Mapping) -> str:
    for local, remote in mapping:
        if value == local:
            return remote
        if value.startswith(local + "/") and not isinstance(local, Exact):
            return remote + value[len(local):]
    return value


def translate(value: str, mapping: Mapping) -> str:
    """One argv item / env value / cwd, translated."""
    if value.startswith("/"):
        return translate_path(value, mapping)
    head, eq, tail = value.partition("=")
    if eq and tail.startswith("/") and "/" not in head:
        return head + eq + translate_path(tail, mapping)
    return value


def translate_argv(argv: list[str], mapping: Mapping) -> list[str]:
    return [translate(a, mapping) for a in argv]


def translate_env(env: dict[str, str], mapping: Mapping) -> dict[str, str]:
    """Each value; PATH-like lists (':'-separated absolute paths) item by item."""
    out = {}
    for key, value in env.items():
        if ":" in value and value.startswith("/") and all(p.startswith("/") or not p for p in value.split(":")):
            out[key] = ":".join(translate_path(p, mapping) if p else p for p in value.split(":"))
        else:
            out[key] = translate(value, mapping)
    return out


def job_folder(job_root: str, job_id: str) -> str:
    """The per-job folder on a node. Job IDs are [0-9a-z] only; anything else is refused
    here so that no path built from one can leave `job_root`."""
    if not job_id or not job_id.isalnum():
        raise ValueError(f"not a job ID: {job_id!r}")
    return f"{job_root.rstrip('/')}/{job_id}"


def translate_watch(watch: dict, mapping: Mapping) -> dict:
    """The node agent's "watch" (cluster/outputs.py): its folders and state file
    are local paths, translated as cwd is."""
    return dict(watch, dirs=[[key, translate(path, mapping)] for key, path in watch.get("dirs") or ()],
                state=translate(watch["state"], mapping) if watch.get("state") else None)
