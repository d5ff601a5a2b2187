"""The nodes file: where jobs run.

    PAI_NODES=/path/nodes.yaml, else $PAI_HOME/nodes.yaml if it exists, else this
    machine alone (load_nodes() returns None: the local backend).

    known_hosts: /path/known_hosts      # optional; default ~/.ssh/known_hosts
    store: postgresql://pai@db/pai      # optional: the team's job store (PAI_STORE wins; docs/team.md)
    shared: [/nfs, /data]               # optional: paths that are the same on every node
                                        # (an NFS home, a mounted bucket): never copied
    nodes:
      - name: h1                        # shown in status, logs, errors
        host: 10.0.0.11                 # ssh to it; peers are told this address
        port: 22                        # optional
        user: root                      # optional; default: the current user
        key: /path/id_ed25519           # optional; default: agent / ~/.ssh keys
        cpu: 800                        # optional PAI units (100 = 1 core); default: detected
        memory: 16000                   # optional MB; default: detected
        gpu: 0                          # optional cards; default: detected
        python: python3                 # optional: the node's interpreter for the agent
        runtime_dir: /opt/paicli/rt     # optional: framework runtimes already on the node
        work_dir: /tmp/paicli-root      # optional: where per-job folders go on the node

A top-level `ray:` mapping is kept as is (`NodesConfig.ray`) for the Ray backend.

Relative paths (key, known_hosts) are relative to the nodes file. A bad file is a
UsageError (exit 2) of one line naming the file, the node and the key.
"""

from __future__ import annotations

import difflib
import getpass
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paicli.errors import UsageError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# A host name or an IPv4/IPv6 address: no spaces, no shell metacharacters, no leading '-'.
HOST_RE = re.compile(r"^[A-Za-z0-9_.:\[\]%-]{1,253}$")
USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")
PYTHON_RE = re.compile(r"^[A-Za-z0-9_./+-]{1,255}$")

NODE_KEYS = ("name", "host", "port", "user", "key", "cpu", "memory", "gpu", "python",
             "runtime_dir", "work_dir")
TOP_KEYS = ("known_hosts", "nodes", "ray", "shared", "store")


@dataclass(frozen=True)
class NodeEntry:
    """One node as the file declares it; None means "detect it" / "the default"."""

    name: str
    host: str
    port: int = 22
    user: str = ""
    key: str | None = None
    cpu: int | None = None        # PAI units
    memory: int | None = None     # MB
    gpu: int | None = None        # cards
    python: str = "python3"
    runtime_dir: str | None = None
    work_dir: str | None = None

    @property
    def job_root(self) -> str:
        """Where per-job folders live on the node (private to the user, 0700)."""
        return self.work_dir or f"/tmp/paicli-{self.user}"

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in NODE_KEYS}


@dataclass(frozen=True)
class NodesConfig:
    path: str
    nodes: tuple[NodeEntry, ...]
    known_hosts: str
    ray: dict | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    shared: tuple[str, ...] = ()      # absolute paths the same on every node
    store: str | None = None          # the team's job store (a PostgreSQL URL)

    def node(self, name: str) -> NodeEntry:
        for node in self.nodes:
            if node.name == name:
                return node
        raise UsageError(f"no node named {name!r} in {self.path}",
                         f"nodes: {', '.join(n.name for n in self.nodes)}")

    def to_dict(self) -> dict[str, Any]:
        """The resolved config (absolute paths), for the job folder's snapshot."""
        out: dict[str, Any] = {"known_hosts": self.known_hosts,
                               "nodes": [n.to_dict() for n in self.nodes]}
        if self.ray is not None:
            out["ray"] = self.ray
        if self.shared:
            out["shared"] = list(self.shared)
        return out


def nodes_file_path(environ: dict[str, str] | None = None) -> Path | None:
    """The nodes file in effect, or None for "this machine alone"."""
    env = os.environ if environ is None else environ
    if env.get("PAI_NODES"):
        return Path(env["PAI_NODES"]).expanduser()
    home = Path(env.get("PAI_HOME") or Path.home() / ".pai").expanduser()
    candidate = home / "nodes.yaml"
    return candidate if candidate.exists() else None


def load_nodes(environ: dict[str, str] | None = None) -> NodesConfig | None:
    path = nodes_file_path(environ)
    return None if path is None else load_nodes_file(path)


def load_nodes_file(path: Path | str) -> NodesConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"nodes file {path} does not exist",
                         "create it (see docs/multihost.md) or unset PAI_NODES") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"nodes file {path}: cannot read it ({err.__class__.__name__})",
                         "check its permissions and encoding") from None
    return parse_nodes(text, str(path))


def _fail(where: str, message: str, hint: str | None = None) -> UsageError:
    return UsageError(f"{where}: {message}", hint)


def _suggest(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {close[0]!r}? known keys: {', '.join(known)}" if close else \
        f"known keys: {', '.join(known)}"


def _int(where: str, value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"expected {what}, got {value!r}"[:200])
    if not low <= value <= high:
        raise _fail(where, f"expected {what}, got {value}")
    return value


def _str(where: str, value: Any, pattern: re.Pattern | None, what: str) -> str:
    if (not isinstance(value, str) or not value.strip() or "\0" in value or "\n" in value
            or (pattern is not None and not pattern.match(value))):
        raise _fail(where, f"expected {what}, got {value!r}"[:200])
    return value


def _path(where: str, value: Any, base: Path) -> str:
    p = Path(_str(where, value, None, "a path")).expanduser()
    return str(p if p.is_absolute() else (base / p))


def _remote_path(where: str, value: Any) -> str:
    text = _str(where, value, None, "an absolute path on the node")
    if not text.startswith("/"):
        raise _fail(where, f"expected an absolute path on the node, got {text!r}"[:200])
    return text.rstrip("/") or "/"


# How each optional key of a node is checked: (where, value, the file's folder) -> the value kept.
OPTIONAL_CHECKS = {
    "port": lambda where, value, base: _int(where, value, 1, 65535, "a port 1-65535"),
    "user": lambda where, value, base: _str(where, value, USER_RE, "a user name"),
    "key": _path,
    "cpu": lambda where, value, base: _int(where, value, 1, 10**7,
                                           "PAI cpu units, a positive integer (100 = one core)"),
    "memory": lambda where, value, base: _int(where, value, 1, 10**9, "memory in MB, a positive integer"),
    "gpu": lambda where, value, base: _int(where, value, 0, 1024, "a number of GPU cards, 0 or more"),
    "python": lambda where, value, base: _str(where, value, PYTHON_RE, "an interpreter name or path on the node"),
    "runtime_dir": lambda where, value, base: _remote_path(where, value),
    "work_dir": lambda where, value, base: _remote_path(where, value),
}


def parse_nodes(text: str, path: str = "nodes.yaml") -> NodesConfig:
    import yaml

    base = Path(path).resolve().parent
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"nodes file {path}" + (f" line {mark.line + 1}" if mark is not None else "")
        problem = getattr(err, "problem", None) or "not valid YAML"
        raise _fail(where, str(problem), "see docs/multihost.md for the format") from None
    except (ValueError, RecursionError):
        raise _fail(f"nodes file {path}", "not valid YAML", "see docs/multihost.md for the format") from None
    where_file = f"nodes file {path}"
    if not isinstance(data, dict):
        raise _fail(where_file, "expected a mapping with a 'nodes' list",
                    "e.g. nodes: [{name: h1, host: 10.0.0.11}]")
    for key in data:
        if key not in TOP_KEYS:
            raise _fail(f"{where_file}: key {key!r}"[:200], "unknown key", _suggest(str(key), TOP_KEYS))
    known_hosts = str(Path("~/.ssh/known_hosts").expanduser())
    if data.get("known_hosts") is not None:
        known_hosts = _path(f"{where_file}: key 'known_hosts'", data["known_hosts"], base)
    store = data.get("store")
    if store is not None and not (isinstance(store, str) and store.startswith(("postgresql://", "postgres://"))):
        raise _fail(f"{where_file}: key 'store'", f"expected a PostgreSQL URL, got {str(store).split('@')[-1]!r}"[:200],
                    "e.g. store: postgresql://USER@HOST/DATABASE (docs/team.md)")
    ray = data.get("ray")
    if ray is not None and not isinstance(ray, dict):
        raise _fail(f"{where_file}: key 'ray'", f"expected a mapping, got {ray!r}"[:200])
    raw_nodes = data.get("nodes")
    if raw_nodes is None and ray is not None:
        raw_nodes = []
    if not isinstance(raw_nodes, list) or (not raw_nodes and ray is None):
        raise _fail(f"{where_file}: key 'nodes'", "expected a non-empty list of nodes",
                    "e.g. nodes: [{name: h1, host: 10.0.0.11}]")
    nodes: list[NodeEntry] = []
    seen: set[str] = set()
    default_user = _current_user()
    for i, raw in enumerate(raw_nodes):
        label = f"node {i + 1}"
        if isinstance(raw, dict) and isinstance(raw.get("name"), str) and raw["name"].strip():
            label = f"node {raw['name']!r}"[:80]
        where = f"{where_file}: {label}"
        if not isinstance(raw, dict):
            raise _fail(where, f"expected a mapping with name and host, got {raw!r}"[:200])
        for key in raw:
            if key not in NODE_KEYS:
                raise _fail(f"{where}: key {key!r}"[:200], "unknown key", _suggest(str(key), NODE_KEYS))
        for key in ("name", "host"):
            if key not in raw:
                raise _fail(f"{where}: key {key!r}", "missing", "every node needs a name and a host")
        name = _str(f"{where}: key 'name'", raw["name"], NAME_RE,
                    "a name of letters, digits, '.', '_' or '-'")
        if name in seen:
            raise _fail(f"{where}: key 'name'", "used by an earlier node", "node names must be unique")
        seen.add(name)
        entry: dict[str, Any] = {"name": name,
                                 "host": _str(f"{where}: key 'host'", raw["host"], HOST_RE,
                                              "a host name or an IP address")}
        if entry["host"].startswith("-"):
            raise _fail(f"{where}: key 'host'", f"expected a host name or an IP address, got {entry['host']!r}")
        entry["user"] = default_user
        for key, check in OPTIONAL_CHECKS.items():
            if raw.get(key) is not None:
                entry[key] = check(f"{where}: key {key!r}", raw[key], base)
        nodes.append(NodeEntry(**entry))
    return NodesConfig(path=path, nodes=tuple(nodes), known_hosts=known_hosts, ray=ray, raw=data,
                       shared=_shared(where_file, data.get("shared")), store=store)


def select_store() -> None:
    """The nodes file's `store:` as PAI_STORE (the caller checked it is not set): in
    the environment, so that the job's master and watchdog use the same store."""
    path = nodes_file_path()
    try:
        text = path.read_text() if path else ""
    except (OSError, UnicodeDecodeError):
        return   # the commands that use the nodes say what is wrong with the file
    # Parsed only when it names a store: a command that uses no node is not held up
    # by a mistake elsewhere in the file.
    if re.search(r"^store\s*:", text, re.M):
        os.environ["PAI_STORE"] = parse_nodes(text, str(path)).store


def _shared(where: str, value: Any) -> tuple[str, ...]:
    """`shared:`: a list of absolute paths, the same on every node."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail(f"{where}: key 'shared'", f"expected a list of absolute paths, got {value!r}"[:200],
                    "e.g. shared: [/nfs, /data]")
    return tuple(_remote_path(f"{where}: key 'shared'", item).rstrip("/") or "/" for item in value)


def config_from_dict(data: dict, path: str = "nodes snapshot") -> NodesConfig:
    """A resolved config back from its snapshot (`NodesConfig.to_dict()`)."""
    nodes = tuple(NodeEntry(**{k: v for k, v in n.items() if k in NODE_KEYS}) for n in data.get("nodes", []))
    return NodesConfig(path=path, nodes=nodes, known_hosts=data.get("known_hosts") or
                       str(Path("~/.ssh/known_hosts").expanduser()), ray=data.get("ray"), raw=data,
                       shared=tuple(data.get("shared") or ()))


def _current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "root" if os.geteuid() == 0 else str(os.geteuid())


def load_config(path: Path | str) -> dict[str, Any]:
    """The backend registry's entry point (cluster/backends/__init__.py): the file
    parsed and resolved into the JSON-serialisable config snapshotted into each job
    folder; "backend" is "ray" for a file with a top-level `ray:`, else "ssh"."""
    config = load_nodes_file(path)
    data = config.to_dict()
    data["backend"] = "ray" if config.ray is not None else "ssh"
    data["path"] = str(path)
    return data
