"""JobSpec and the one table of job parameters.

Every parameter a job can take is a `Param` row: the -D parser, the YAML loader,
validation, `pai export` and the generated docs all read the same rows. The core
rows are `CORE_PARAMS`; an adapter adds its own rows through `Adapter.params`.

Pure data and parsing, shared by the adapters as vocabulary.
"""

from __future__ import annotations

import difflib
import errno
import json
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paicli.envvars import parse_env
from paicli.errors import SpecError
from paicli.requirements import parse_requirements

# ---------------------------------------------------------------------------
# Parameter table


def close_matches(word: str, possibilities, n: int = 1, cutoff: float = 0.6) -> list[str]:
    return difflib.get_close_matches(word, list(possibilities), n, cutoff)


def snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


@dataclass(frozen=True)
class Param:
    """One job parameter.

    kind: str, int, float, json (a JSON object), path (file:// URI or a local
    path; resolved to an absolute path), choice (one of `choices`), duration
    (seconds, or a number with s/m/h), args (shell-style argument string).
    """

    name: str
    kind: str = "str"
    default: Any = None
    help: str = ""
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    check: Callable[[Any], str | None] | None = None  # returns an error text or None

    @property
    def yaml_name(self) -> str:
        return snake_case(self.name)


# Upper bounds of a role's resources: a typo such as 1000000 workers is an input
# error, not an attempt to start a million processes. Instances per job: every one
# is a process (and a port) on this machine.
MAX_INSTANCES = 512
LIMITS = {"count": MAX_INSTANCES, "cpu": 100 * 1024, "memory": 16 * 1024 * 1024, "gpu": 100 * 64}


def _check_cluster(value: Any) -> str | None:
    if not isinstance(value, dict) or not value:
        return 'expected a JSON object of roles, e.g. {"ps":{"count":1},"worker":{"count":2}}'
    for role, conf in value.items():
        if not isinstance(role, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", role):
            return f"role name {role!r} must be a word (letters, digits, _)"
        if not isinstance(conf, dict):
            return f'role "{role}" must be an object such as {{"count":2}}, not {json.dumps(conf)}'
        for key, val in conf.items():
            if key not in ("count", "cpu", "memory", "gpu"):
                close = close_matches(key, ["count", "cpu", "memory", "gpu"], 1)
                tip = f' (did you mean "{close[0]}"?)' if close else ""
                return f'role "{role}": unknown key "{key}"{tip}; known: count, cpu, memory, gpu'
            if isinstance(val, bool) or not isinstance(val, int):
                return f'role "{role}": "{key}" must be a whole number, not {json.dumps(val)}'
            if key == "count" and val <= 0:
                return f'role "{role}": count must be positive, not {val}'
            if val < 0:
                return f'role "{role}": "{key}" must not be negative, not {val}'
            if val > LIMITS[key]:
                return f'role "{role}": "{key}" must be at most {LIMITS[key]}, not {val}'
    total = sum(conf.get("count", 1) for conf in value.values())
    if total > MAX_INSTANCES:
        return f"{total} instances in all; a job may have at most {MAX_INSTANCES}"
    return None


CORE_PARAMS: tuple[Param, ...] = (
    Param("script", "path", help="The training script: a file:// URI or path to a .py file, "
          "or a .tar.gz/.tgz archive (then name the entry with entryFile)."),
    Param("entryFile", help="The entry script inside a script archive, relative to its root."),
    Param("cluster", "json", check=_check_cluster,
          help='Roles and instance counts as JSON, e.g. {"ps":{"count":1},"worker":{"count":2,'
               '"cpu":100,"memory":2000,"gpu":0}} (cpu 100 = one core, memory in MB, gpu 100 = one card).'),
    Param("userDefinedParameters", "args",
          help="Extra arguments for the script, shell-style quoting, e.g. '--lr=0.1 --name \"a b\"'."),
    Param("workDir", help="The project folder: its files (less what .gitignore and .paiignore exclude) travel "
          "to every SSH/Ray node and it is where instances start. Default: the folder pai runs in, when "
          "a plain -Dscript lies inside it; none: only the script and its imports travel."),
    Param("workDirMaxSize", default="100M", check=lambda v: None if parse_size(v) is not None else
          f"expected a size such as 100M or 1G, not {v!r}",
          help="The most a project folder may send to the nodes (default 100M)."),
    Param("hyperParameters", "path",
          help="A file of key=value lines; each line reaches the script as --key=value."),
    Param("checkpointDir", help="Where the script saves checkpoints; passed as --checkpointDir."),
    # -- data: what paicli does with these is in docs/data.md and cluster/datasets.py --
    Param("buckets", help="Input/output storage locations; passed as --buckets. A folder on this machine "
          "(file:///data/b/) is shipped read-only to each SSH/Ray node, cached there by content digest, and "
          "the script gets the node's path; storage URLs (s3://, oss://) pass through untouched."),
    Param("tables", help="Input tables, comma-separated; passed as --tables: CSV/TSV files, folders of them, "
          "or sqlite:///path/db?table=NAME. Each worker reads its own slice (paitables.open_table); "
          "checked before the job starts. Other URLs (odps://) pass through untouched."),
    Param("outputs", help="Output tables (file:///out/pred.csv or sqlite:///path/db?table=NAME); passed as "
          "--outputs. Workers write rows with paitables.open_writer; the table appears whole here when "
          "the job succeeds."),
    Param("gpuRequired", "int", default=0, minimum=0,
          help="GPUs per worker in PAI units (100 = one card). A job that asks for more GPUs "
               "than the machine has fails before it starts."),
    Param("jobName", help="A name for the job, shown by `pai list` (default: the script's name)."),
    Param("maxRetries", "int", default=3, minimum=0,
          help="How many times a failed instance (or, for frameworks that cannot take a restarted "
               "instance back, the whole job) is restarted after a retryable exit."),
    Param("timeout", "duration",
          help="Cancel the job after this long (seconds, or 90s/30m/2h); reason 'timeout'."),
    Param("autoStrategy", "choice", default="false", choices=("true", "false"),
          help="true: Pluto plans the job (ps and worker counts, partitioning, compression, "
               "averaging period) from a short calibration run, as `pai plan` would, and submits "
               "its recommendation; the plan and its forecast go into plan.json."),
    # -- a job's own environment variables and packages -------------------------------
    Param("env", "env",
          help="Environment variables for every instance on every backend: K=V,K2=V2 (\\, for a comma "
               "in a value; a bare NAME takes its value from your shell), YAML: a mapping. Instances see "
               "their node's own environment plus these; values of names with TOKEN, SECRET, PASSWORD or "
               "KEY in them are masked in logs, `pai status` and the logview."),
    Param("requirements", "requirements",
          help="Python packages the job needs on top of its framework runtime: "
               "file:///path/requirements.txt (YAML: a file or a list). Installed once per node into a "
               "layer cached beside the runtimes (`pai runtime list`); the framework stays the runtime's."),
    # -- the job's place in the queue (docs/queue.md) ----------------------------------
    Param("priority", "int", default=0,
          help="The job's place in the queue when the nodes are busy: higher first, then submit "
               "time (default 0; negative is allowed). `pai queue` shows the queue."),
    # -- what a job writes comes back (docs/outputs.md) --------------------------------
    Param("checkpointSyncSeconds", "int", default=60, minimum=0,
          help="How often what instances write in checkpointDir is copied back while the job runs "
               "(0: only when each instance ends); a restarted instance finds the latest copy in place."),
    Param("outputMaxSize", check=lambda v: None if parse_size(v) is not None else
          f"expected a size such as 500M, 2G or 1048576 (bytes), not {v!r}",
          help="The largest file brought back from a node (e.g. 500M, 2G); a larger one stays on its "
               "node, whose job folder is kept, and `pai outputs` says where."),
)


def parse_size(text: Any) -> int | None:
    """'500M', '2G', '1.5g', '1048576' -> bytes (K/M/G/T are powers of 1024); None if not a size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?\s*", str(text))
    if not match:
        return None
    value = float(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " ")
    return int(value) if value >= 1 else None


# ---------------------------------------------------------------------------
# JobSpec


@dataclass
class JobSpec:
    """What the user asked for, typed and validated. `params` holds only the keys
    the user set, by their PAI names; `get` falls back to the table's default."""

    framework: str
    params: dict[str, Any] = field(default_factory=dict)
    project: str | None = None
    table: dict[str, Param] = field(default_factory=dict, repr=False, compare=False)

    def get(self, name: str, default: Any = None) -> Any:
        if name in self.params:
            return self.params[name]
        param = self.table.get(name)
        if param is not None and param.default is not None:
            return param.default
        return default

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (snake_case keys), as `pai export` prints it."""
        out: dict[str, Any] = {"name": self.framework}
        if self.project:
            out["project"] = self.project
        for pname, value in self.params.items():
            out[self.table[pname].yaml_name if pname in self.table else pname] = value
        return out


# ---------------------------------------------------------------------------
# Value conversion


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr)?\s*$")


def resolve_path(value: str, base: Path) -> Path:
    """A file:// URI or a path (relative to `base`) as an absolute path."""
    if value.startswith("file://"):
        value = value[len("file://"):]
        if not value.startswith("/"):
            raise ValueError("a file:// URI needs an absolute path, e.g. file:///home/me/train.py")
    elif re.match(r"^[a-z][a-z0-9+.-]*://", value):
        scheme = value.split("://", 1)[0]
        raise ValueError(f"the {scheme}:// scheme is not supported here; use a file:// URI or a path")
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # `~name` of a user this machine does not know
        user = value[1:].split("/", 1)[0]
        raise ValueError(f"~{user}: no such user on this machine; give the path without ~{user}") from None
    if not path.is_absolute():
        path = base / path
    return Path(str(path.resolve()))


def _to_text(param: Param, raw: Any, base: Path) -> str:
    if isinstance(raw, (dict, list)):
        raise ValueError("expected text, not a structure")
    if isinstance(raw, bool) or raw is None:
        raise ValueError("expected text")
    text = str(raw)
    if not text:
        raise ValueError("expected a value, got nothing")
    return text


def _to_int(param: Param, raw: Any, base: Path) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"expected a whole number, not {raw}")
    try:
        value = int(raw) if not isinstance(raw, float) or raw.is_integer() else None
    except (TypeError, ValueError):
        value = None
    if value is None:
        raise ValueError(f"expected a whole number, not {raw!r}")
    return value


def _to_float(param: Param, raw: Any, base: Path) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, not {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number, not {raw!r}")
    return value


def _to_duration(param: Param, raw: Any, base: Path) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
    else:
        match = _DURATION.match(str(raw)) if isinstance(raw, str) else None
        if not match:
            raise ValueError(f"expected seconds or a duration such as 90s, 30m, 2h, not {raw!r}")
        unit = (match.group(2) or "s")[0]
        value = float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[unit]
    if value <= 0 or value != value or value == float("inf"):
        raise ValueError(f"expected a positive duration, not {raw!r}")
    return value


def _to_json(param: Param, raw: Any, base: Path) -> Any:
    if not isinstance(raw, str):
        return raw  # a YAML structure is already parsed
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        snippet = (raw[max(0, err.pos - 20):err.pos] + "⟨here⟩" + raw[err.pos:err.pos + 20]).replace("\n", " ")
        raise ValueError(f"broken JSON at character {err.pos + 1}: {err.msg}: …{snippet}…") from None
    except RecursionError:
        raise ValueError("nested too deeply for a parameter's value; give a few levels at most") from None


def _unique_keys(pairs: list) -> dict:
    value = dict(pairs)
    if len(value) < len(pairs):    # JSON would keep the last silently
        twice = next(k for n, (k, _v) in enumerate(pairs) if k in dict(pairs[:n]))
        raise ValueError(f"the key {json.dumps(twice)[:40]} is given twice in one object; give each key once")
    return value


def _to_path(param: Param, raw: Any, base: Path) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError("expected a file:// URI or a path")
    if "\x00" in raw:
        raise ValueError("a path cannot contain a NUL character")
    path = resolve_path(raw, base)
    try:
        path.stat()
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):   # what Path.exists() calls missing
            raise ValueError(f"{path} does not exist; check the path (file:// URIs take an absolute path)") from None
        raise ValueError(f"cannot use {raw!r} as a path: {err.strerror}") from None   # too long, no permission
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    return str(path)


def _to_choice(param: Param, raw: Any, base: Path) -> str:
    value = str(raw)
    if value not in param.choices:
        close = close_matches(value, param.choices, 1)
        tip = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"expected one of {', '.join(param.choices)}, not {value!r}{tip}")
    return value


def _to_args(param: Param, raw: Any, base: Path) -> str:
    if isinstance(raw, list):
        value = " ".join(shlex.quote(str(x)) for x in raw)
    elif isinstance(raw, str):
        value = raw
    else:
        raise ValueError("expected an argument string such as '--lr=0.1 --epochs 3'")
    try:
        shlex.split(value)
    except ValueError as err:
        raise ValueError(f"cannot split the arguments: {err}") from None
    return value


# kind -> converter(param, raw value, base folder): the typed value, or ValueError
# saying what was expected. A new kind is one function and one row.
CONVERTERS: dict[str, Callable[[Param, Any, Path], Any]] = {
    "str": _to_text, "int": _to_int, "float": _to_float, "duration": _to_duration,
    "json": _to_json, "path": _to_path, "choice": _to_choice, "args": _to_args,
    "env": lambda _param, raw, _base: parse_env(raw),
    "requirements": lambda _param, raw, base: parse_requirements(raw, base),
}


def convert(param: Param, raw: Any, base: Path) -> Any:
    """Turn a raw value (a -D string or a YAML value) into the param's type.
    Raises ValueError with a message that says what was expected."""
    if isinstance(raw, str):
        # Quotes around a -D value are the shell's, not the value's; an argument
        # string keeps its own (they group its words).
        raw = raw.strip()
        if param.kind != "args" and len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            raw = raw[1:-1]
    value = CONVERTERS[param.kind](param, raw, base)
    if param.minimum is not None and value < param.minimum:
        raise ValueError(f"must be at least {param.minimum:g}, not {raw}")
    if param.check is not None:
        problem = param.check(value)
        if problem:
            raise ValueError(problem)
    return value


# ---------------------------------------------------------------------------
# Building a spec


def closest(name: str, known: Iterable[str]) -> str | None:
    known = list(known)
    lowered = {k.lower(): k for k in known}
    if name.lower() in lowered:
        return lowered[name.lower()]
    match = close_matches(name, known) or [lowered[m] for m in close_matches(name.lower(), lowered)]
    return match[0] if match else None


@dataclass(frozen=True)
class RawParam:
    """A parameter as the user gave it: key as written, raw value, how to name it
    in an error (`-Dcluster`, `job.yaml line 3: cluster`), and the directory a
    relative path is relative to."""

    key: str
    value: Any
    where: str
    base: Path


def build_spec(framework: str, raw: Iterable[RawParam], *, params: Iterable[Param],
               project: str | None = None) -> JobSpec:
    """A typed JobSpec from raw values keyed by PAI or snake_case names. A parameter
    given twice (under either name) is an error; -D over a job file's value is
    resolved before (statement.merge_overrides)."""
    table = {p.name: p for p in params}
    by_yaml = {p.yaml_name: p for p in table.values()}
    spec = JobSpec(framework=framework, project=project, table=table)
    given: dict[str, str] = {}
    for item in raw:
        param = table.get(item.key) or by_yaml.get(item.key)
        if param is None:
            guess = closest(item.key, list(table) + list(by_yaml))
            if guess:
                guess = guess if item.where.startswith("-D") or guess in by_yaml else table[guess].yaml_name
                shown = f"-D{guess}" if item.where.startswith("-D") else guess
                hint = f"did you mean {shown}? (`pai params` lists them all)"
            else:
                hint = "`pai params` lists the parameters"
            raise SpecError(item.where, "unknown parameter", hint)
        if param.name in given:
            # maxRetries and max_retries are one parameter: giving both is giving it twice.
            raise SpecError(item.where, f"given twice (also as {given[param.name]})", "keep one of them")
        given[param.name] = item.where
        try:
            spec.params[param.name] = convert(param, item.value, item.base)
        except ValueError as err:
            raise SpecError(item.where, str(err)) from None
    return spec
