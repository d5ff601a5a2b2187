"""A job's data: -Dtables sliced per worker, -Doutputs assembled at the end.

At submit (`prepare`, called by paicli/client.py once the plan exists) every
table is opened and checked (exists, readable, not ragged, a SQLite table that is
there, no more workers than rows: each a one-line SpecError, exit 2, before
anything starts), cut into PAI's slices (runners/paitables.py: one per worker,
contiguous, even), and the job's index is written to `JOB/data/tables.json`:

    {"slice_role": "worker", "slice_count": N,
     "tables":  [{"key", "kind", "columns", "rows", "delimiter",
                  "slices": {"0": [part, ...], ...}}],
     "outputs": [{"key", "kind", "path", "table", "parts": "JOB/data/out/K"}]}

A part is a byte range of a CSV file ({"path", "start", "end", "rows"}) or rows
of a SQLite table ({"path", "table", "offset", "rows"}). On this machine the
parts name the tables themselves; a node gets an index of its own naming the
slice files shipped there (`stage`). The sliced role's instances get
PAI_TABLES_INDEX, PAI_SLICE_COUNT, PAI_TABLES / PAI_OUTPUTS and the runners
folder on PYTHONPATH (so `import paitables` works in every runtime); their slice
is their PAI_INDEX.

At the end (`finish`, called by the master before clean-up) the workers' part
files (fetched from the nodes first) become the output table: written aside and
renamed (CSV) or created in one transaction (SQLite), only when the job
succeeded. A failed job leaves no table and says where its rows are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from paicli.errors import SpecError
from paicli.runners import paitables

DATA = "data"
INDEX = "tables.json"
OUT = "out"


def index_path(job_dir: str | Path) -> Path:
    return Path(job_dir) / DATA / INDEX


def sliced_role(plan: Any) -> Any:
    """The role whose instances each read a slice: `worker`, else the first role
    that must finish, else the first."""
    roles = list(plan.roles)
    named = [r for r in roles if r.name == "worker"]
    finishing = [r for r in roles if r.must_finish]
    return (named or finishing or roles)[0]


def _urls(value: Any) -> list[str]:
    """The tables of a -D value that are ours to read: files and SQLite. Other
    URLs (PAI's odps://, s3://, ...) reach the script untouched, as before."""
    urls = paitables.split_urls(value if isinstance(value, str) else "")
    return [u for u in urls if u.startswith(("file://", "sqlite://")) or "://" not in u]


def check_tables(value: str, slice_count: int, base: str) -> list[dict]:
    """Every table of -Dtables laid out and sliced, or a SpecError naming it."""
    tables = []
    for url in _urls(value):
        try:
            parsed = paitables.parse_url(url, base)
            if parsed.kind != "sqlite" and not os.path.exists(parsed.path):
                raise paitables.TableError(f"{parsed.path}: no such file or folder")
            shape = paitables.layout(parsed, check=True)
        except paitables.TableError as err:
            hint = "give a CSV file, a folder of them, or sqlite:///path/db.sqlite?table=NAME" \
                if "no such" in str(err) else None
            raise SpecError("-Dtables", str(err), hint) from None
        if shape["rows"] < slice_count:
            raise SpecError("-Dtables", f"{parsed.key} has {shape['rows']} rows for {slice_count} workers; "
                            "every worker needs at least one row", f"use at most {shape['rows']} workers")
        slices = {str(i): paitables.slice_parts(shape, i, slice_count) for i in range(slice_count)}
        tables.append({"key": shape["key"], "kind": shape["kind"], "columns": shape["columns"],
                       "rows": shape["rows"], "delimiter": shape.get("delimiter", ","), "slices": slices})
    return tables


def check_outputs(value: str, job_dir: Path, base: str) -> list[dict]:
    """Every table of -Doutputs with the folder its workers' parts go to."""
    outputs = []
    for k, url in enumerate(_urls(value)):
        try:
            parsed = paitables.parse_url(url, base)
        except paitables.TableError as err:
            raise SpecError("-Doutputs", str(err), "e.g. -Doutputs=file:///out/pred.csv") from None
        if parsed.kind == "dir":
            raise SpecError("-Doutputs", f"{parsed.path} is a folder; an output table is a file",
                            f"e.g. -Doutputs=file://{parsed.path.rstrip('/')}/pred.csv")
        folder = os.path.dirname(parsed.path)
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            raise SpecError("-Doutputs", f"{folder}: no such folder, or not writable",
                            "create it first; the table is written there when the job succeeds")
        if parsed.kind == "sqlite" and os.path.exists(parsed.path):
            try:
                paitables._sqlite_shape(parsed)
            except paitables.TableError as err:
                if "no table" not in str(err):
                    raise SpecError("-Doutputs", str(err)) from None
        outputs.append({"key": parsed.key, "kind": parsed.kind, "path": parsed.path, "table": parsed.table,
                        "parts": str(job_dir / DATA / OUT / str(k))})
    return outputs


def prepare(spec: Any, plan: Any, job_dir: str | Path, base: str = "") -> dict | None:
    """Check -Dtables/-Doutputs, write the job's index, give the sliced role its
    environment. None when the job names no table."""
    if not _urls(spec.get("tables")) and not _urls(spec.get("outputs")):
        return None
    job_dir = Path(os.path.abspath(job_dir))
    role = sliced_role(plan)
    base = base or os.getcwd()
    index = {"slice_role": role.name, "slice_count": role.count,
             "tables": check_tables(spec.get("tables") or "", role.count, base),
             "outputs": check_outputs(spec.get("outputs") or "", job_dir, base)}
    folder = job_dir / DATA
    folder.mkdir(mode=0o700, exist_ok=True)
    for out in index["outputs"]:
        Path(out["parts"]).mkdir(mode=0o700, parents=True, exist_ok=True)
    path = index_path(job_dir)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(index, f)
    for r in plan.roles:
        r.env.update(_role_env(spec, r, path, role.name, role.count))
    return index


def _role_env(spec: Any, role: Any, path: Path, sliced: str, count: int) -> dict[str, str]:
    from paicli.cluster.node_files import RUNNERS_DIR

    env = {"PAI_TABLES_INDEX": str(path)} if role.name == sliced else {}
    if role.name == sliced:
        env["PAI_SLICE_COUNT"] = str(count)
    if spec.get("tables"):
        env["PAI_TABLES"] = spec.get("tables")
    if spec.get("outputs"):
        env["PAI_OUTPUTS"] = spec.get("outputs")
    extra = role.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH") or ""
    env["PYTHONPATH"] = str(RUNNERS_DIR) + (f":{extra}" if extra else "")
    return env


def load(job_dir: str | Path) -> dict | None:
    try:
        return json.loads(index_path(job_dir).read_text())
    except (OSError, ValueError):
        return None


# -- the end: the outputs --------------------------------------------------------------


def finish(job_dir: str | Path, backend: Any, succeeded: bool, note: Callable[[str], None]) -> None:
    """The master's last step for the data: the workers' parts brought home (from
    the nodes), then each output table whole, only when the job succeeded."""
    index = load(job_dir)
    if not index or not index.get("outputs"):
        return
    fetch_parts(job_dir, backend, index, note)
    for out in index["outputs"]:
        if not succeeded:
            note(f"outputs: no table {out['key']} (the job did not succeed); its workers' rows are in {out['parts']}")
            continue
        try:
            rows = assemble(out)
        except (OSError, ValueError, paitables.TableError) as err:
            note(f"outputs: {out['key']} not written: {err}; the workers' rows are in {out['parts']}")
            continue
        note(f"outputs: {out['key']}: {rows} rows")


def assemble(out: dict) -> int:
    """The parts in `out["parts"]` as the output table: a CSV written aside and
    renamed into place, or a SQLite table created in one transaction."""
    columns, rows = paitables.read_parts(out["parts"])
    if columns is None:
        raise paitables.TableError("no worker wrote a row (no part file)")
    counted = _Counter(rows)
    if out["kind"] == "sqlite":
        paitables.write_sqlite(out["path"], out["table"], columns, counted)
        return counted.n
    writer = paitables.Writer(out["path"], columns, "csv")
    try:
        for row in counted:
            writer.csv.writerow(row)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return counted.n


class _Counter:
    def __init__(self, rows):
        self.rows, self.n = rows, 0

    def __iter__(self):
        for row in self.rows:
            self.n += 1
            yield row


def fetch_parts(job_dir: str | Path, backend: Any, index: dict, note: Callable[[str], None]) -> None:
    """Remote backends: the part files from every node's job folder into this
    machine's. Local: they are there already."""
    fetch = getattr(backend, "name", "local")
    if fetch == "local":
        return
