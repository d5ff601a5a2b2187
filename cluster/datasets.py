"""A job's data: -Dtables sliced per worker, -Doutputs assembled at the end.

At submit (`prepare`) every table is checked (each problem a one-line SpecError,
exit 2, before anything starts), cut into PAI's slices (runners/paitables.py), and
the job's index is written to `JOB/data/tables.json`:

    {"slice_role": "worker", "slice_count": N,
     "tables":  [{"key", "kind", "columns", "rows", "delimiter",
                  "slices": {"0": [part, ...], ...}}],
     "outputs": [{"key", "kind", "path", "table", "parts": "JOB/data/out/K"}]}

A part is a byte range of a CSV file ({"path", "start", "end", "rows"}) or rows
of a SQLite table ({"path", "table", "offset", "rows"}). On this machine the
parts name the tables themselves; a node gets an index of its own naming the
slice files shipped there (`stage`). The sliced role's instances get
PAI_TABLES_INDEX and PAI_SLICE_COUNT; every role gets PAI_TABLES / PAI_OUTPUTS and
JOB/data/py (paitables.py alone) on PYTHONPATH (`module_path`).

At the end (`finish`) the workers' part files become the output table, written
aside and renamed (CSV) or in one transaction (SQLite), only when the job
succeeded; a failed job leaves no table and says where its rows are.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paicli.cluster import RUNNERS_DIR
from paicli.cluster.node_files import data_trees, shared_paths, under_shared
from paicli.errors import PaiError, SpecError
from paicli.private import write_private
from paicli.runners import paitables

DATA = "data"
BATCH = 64 << 20        # bytes of blobs per SSH round
HASH_RATE = 20 << 20    # bytes/s a node is given to hash its cached blobs again (a slow disk)
INDEX = "tables.json"
OUT = "out"
PY = "py"


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
    URLs (PAI's odps://, s3://, ...) reach the script untouched."""
    if not value or not isinstance(value, str):
        return []   # most jobs name no table
    urls = paitables.split_urls(value)
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
                paitables.sqlite_shape(parsed)
            except paitables.TableError as err:
                if "no table" not in str(err):
                    raise SpecError("-Doutputs", str(err)) from None
        outputs.append({"key": parsed.key, "kind": parsed.kind, "path": parsed.path, "table": parsed.table,
                        "parts": str(job_dir / DATA / OUT / str(k))})
    return outputs


def prepare(spec: Any, plan: Any, job_dir: str | Path, base: str = "") -> dict | None:
    """Check -Dtables/-Doutputs, write the job's index, give the sliced role its
    environment. None when the job names no table."""
    job_dir = Path(os.path.abspath(job_dir))
    base = base or os.getcwd()
    buckets = check_buckets(spec.get("buckets"), job_dir, base)
    module_path(plan, job_dir)
    if not _urls(spec.get("tables")) and not _urls(spec.get("outputs")):
        return {"buckets": buckets} if buckets else None
    role = sliced_role(plan)
    index = {"slice_role": role.name, "slice_count": role.count,
             "tables": check_tables(spec.get("tables") or "", role.count, base),
             "outputs": check_outputs(spec.get("outputs") or "", job_dir, base)}
    folder = job_dir / DATA
    folder.mkdir(mode=0o700, exist_ok=True)
    for out in index["outputs"]:
        Path(out["parts"]).mkdir(mode=0o700, parents=True, exist_ok=True)
    path = index_path(job_dir)
    write_private(path, json.dumps(index))
    for r in plan.roles:
        r.env.update(_role_env(spec, r, path, role.name, role.count))
    return index


def _role_env(spec: Any, role: Any, path: Path, sliced: str, count: int) -> dict[str, str]:
    env = {"PAI_TABLES_INDEX": str(path), "PAI_SLICE_COUNT": str(count)} if role.name == sliced else {}
    if spec.get("tables"):
        env["PAI_TABLES"] = spec.get("tables")
    if spec.get("outputs"):
        env["PAI_OUTPUTS"] = spec.get("outputs")
    return env


INHERIT_PYTHONPATH = "PAI_INHERIT_PYTHONPATH"   # runners/node_agent.py reads it


def module_path(plan: Any, job_dir: Path) -> None:
    """Every job, tables or not: JOB/data/py holds paitables.py alone and comes
    first on every role's PYTHONPATH, so `import paitables` works in every runtime
    without the other runners in the way of the script's own imports."""
    folder = job_dir / DATA / PY
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(folder / "paitables.py", (RUNNERS_DIR / "paitables.py").read_bytes())
    for role in plan.roles:
        extra = role.env.get("PYTHONPATH") or ""
        role.env["PYTHONPATH"] = str(folder) + (f":{extra}" if extra else "")
        if not extra:
            # The instance's own PYTHONPATH follows ours where the instance starts (the
            # node agent adds it): this shell's locally, the node's own on a node. Taken
            # here, this shell's value would cross to every SSH and Ray node undeclared.
            role.env[INHERIT_PYTHONPATH] = "1"


def load(job_dir: str | Path) -> dict | None:
    try:
        return json.loads(index_path(job_dir).read_text())
    except (OSError, ValueError):
        return None


# -- the end: the outputs --------------------------------------------------------------


def finish(job_dir: str | Path, backend: Any, succeeded: bool, note: Callable[[str], None],
           nodes: set | None = None) -> str | None:
    """The master's last step for the data: the workers' parts brought home (from
    `nodes`, where the instances ended, else every staged node), then each output
    table, whole: only when the job succeeded and every node's parts came home.
    What fails the job when a table could not be written (None: nothing)."""
    index = load(job_dir)
    if not index or not index.get("outputs"):
        return None
    unfetched = fetch_parts(job_dir, backend, index, nodes)
    failed = []
    for out in index["outputs"]:
        if not succeeded:
            note(f"outputs: no table {out['key']} (the job did not succeed); its workers' rows are in {out['parts']}"
                 + (f"; {unfetched}" if unfetched else ""))
            continue
        try:
            if unfetched:
                raise PaiError(unfetched)
            rows = assemble(out)
        except Exception as err:  # noqa: BLE001 - the job fails with it; the master's end goes on
            failed.append(f"outputs: no table {out['key']}: {err}; the rows fetched are in {out['parts']}")
            note(failed[-1])
            continue
        note(f"outputs: {out['key']}: {rows} rows")
    return failed[0] if failed else None


def assemble(out: dict) -> int:
    """The parts in `out["parts"]` as the output table: a CSV written aside and
    renamed into place, or a SQLite table created in one transaction."""
    columns, rows = paitables.read_parts(out["parts"])
    if columns is None:
        raise paitables.TableError("no worker wrote a row (no part file)")
    if out["kind"] == "sqlite":
        return paitables.write_sqlite(out["path"], out["table"], columns, rows)
    with paitables.Writer(out["path"], columns, "csv") as writer:
        writer.write_rows(rows)
    return writer.rows


def fetch_parts(job_dir: str | Path, backend: Any, index: dict, nodes: set | None = None) -> str:
    """Remote backends: every node's part files into this machine's job folder
    (local: they are there already). The nodes whose parts did not come, each
    named with where its rows stay (its job folder, kept), or ""."""
    transports = node_caches(backend, nodes)
    if transports is None:
        return ""
    lost = {node: f"{node} does not answer; its rows stay in its job folder there"
            for node in set(nodes or ()) - set(transports)}
    outs = {str(k): Path(out["parts"]) for k, out in enumerate(index.get("outputs", []))}
    for node, transport in sorted(transports.items()):
        try:
            got = transport.parts()
        except Exception as err:  # noqa: BLE001 - named in the job's failure, the others go on
            lost[node] = (f"the rows written on {node} could not be fetched ({type(err).__name__}: {err}); "
                          f"they stay in {transport.folder}/{DATA}/{OUT} there")
            continue
        for rel, data in got.items():
            k, _, name = rel.partition("/")
            if k in outs and re.fullmatch(r"part-[A-Za-z0-9_]+-\d+\.jsonl", name):
                write_private(outs[k] / name, data)
    backend.keep_nodes |= set(lost)
    return "; ".join(lost[node] for node in sorted(lost))


# -- SSH and Ray nodes: slices and buckets by content digest -----------------------------------


def stage(backend: Any, job_dir: str | Path, plan: Any, placements: list, note: Callable[[str], None],
          only: set | None = None) -> dict:
    """After the backend staged the job on its nodes (`only` those, else every node
    of `placements`): each node gets the slices of its own workers (and the job's
    buckets), only the blobs it lacks, and an index naming them where they are on
    the node. {node: bytes sent}; {} when local."""
    transports = node_caches(backend, only or {p.node for p in placements})
    if transports is None:
        return {}   # local: read in place (and no bucket hashed while the instances wait to start)
    index = load(job_dir)
    trees = bucket_trees(job_dir)
    if index is None and not trees:
        return {}

    cutter = _Slices(index or {}, shared_paths(str(job_dir)))
    node_buckets_argv(plan, trees)
    sent = {}
    for node, transport in sorted(transports.items()):
        sids = sorted({p.idx for p in placements if p.node == node and index
                       and p.role == index.get("slice_role")})
        node_index, blobs, sizes = cutter.for_node(sids, transport.folder)
        blobs.update({d: Path(p).read_bytes for t in trees for _r, d, p in t["sources"]})
        sizes.update({d: os.path.getsize(p) for t in trees for _r, d, p in t["sources"]})
        plan_line = {"index": node_index, "trees": [{k: t[k] for k in ("digest", "files", "link")} for t in trees]}
        what = f"slices {','.join(map(str, sids))} of {index['slice_count']}" if sids and index else ""
        try:
            transport.sizes = sizes
            lacking = transport.missing(sorted(blobs))
            sent[node] = transport.put(plan_line, {d: blobs[d] for d in lacking})
        except CacheLinkLost as err:
            # A blob lands on the node under its digest only once whole, so nothing half-sent is used.
            raise PaiError(f"data: {what or 'the buckets'} did not reach node {node} ({err.why}); "
                           "they are still here") from err
        held = len(blobs) - len(lacking)
        note(f"data: {node}: {len(lacking)} blob(s) sent ({sent[node]} bytes), {held} already there"
             + (f"; {what}" if what else ""))
    record = Path(job_dir) / DATA / "sent.json"
    old = json.loads(record.read_text()) if record.exists() else []
    write_private(record, json.dumps(old + [sent]))
    return sent


class _Slices:
    """The slice blobs of a job's tables, digested once for all nodes and read
    again only for a node that lacks them (the master never holds a whole table):
    a CSV slice is its rows' bytes as they are in the file (each part ending with
    a newline), a SQLite slice its rows as JSON lines."""

    def __init__(self, index: dict, shared: list[str] = ()):
        self.index = index
        self.cut: dict[tuple[int, str], tuple[str, int]] = {}   # (table, slice) -> (digest, size)
        self.shared = list(shared)

    def in_place(self, table: dict) -> bool:
        """Every file of the table is under a `shared:` path: nodes read it there."""
        paths = {p["path"] for parts in table["slices"].values() for p in parts}
        return bool(self.shared) and all(under_shared(p, self.shared) for p in paths)

    def blob(self, t: int, sid: str) -> str:
        if (t, sid) not in self.cut:
            digest, size = hashlib.sha256(), 0
            for chunk in _slice_chunks(self.index["tables"][t], sid):
                digest.update(chunk)
                size += len(chunk)
            self.cut[(t, sid)] = (digest.hexdigest(), size)
        return self.cut[(t, sid)][0]

    def for_node(self, sids: list[int], folder: str) -> tuple[dict | None, dict, dict]:
        """The node's index, {digest: read()} and {digest: size} of its slices."""
        if not self.index:
            return None, {}, {}
        root = cache_root(folder)
        node_index = dict(self.index, tables=[], outputs=[
            dict(out, parts=f"{folder}/{DATA}/{OUT}/{k}") for k, out in enumerate(self.index.get("outputs", []))])
        blobs, sizes = {}, {}
        for t, table in enumerate(self.index.get("tables", [])):
            if self.in_place(table):
                node_index["tables"].append(dict(table, slices={str(i): table["slices"][str(i)] for i in sids}))
                continue
            slices = {}
            for sid in map(str, sids):
                digest = self.blob(t, sid)
                blobs[digest] = lambda table=table, sid=sid: b"".join(_slice_chunks(table, sid))
                sizes[digest] = self.cut[(t, sid)][1]
                rows = sum(p["rows"] for p in table["slices"][sid])
                path = f"{root}/blobs/{digest}"
                slices[sid] = [{"path": path, "format": "jsonl", "rows": rows} if table["kind"] == "sqlite"
                               else {"path": path, "start": 0, "end": sizes[digest], "rows": rows}]
            node_index["tables"].append(dict(table, slices=slices))
        return node_index, blobs, sizes


def _slice_chunks(table: dict, sid: str):
    """A slice's bytes, in chunks of up to 1 MB."""
    for part in table["slices"][sid]:
        if "table" in part:
            rows = paitables.Table(table["key"], table["columns"], [part])
            for batch in rows.read(4096):
                yield "".join(map(paitables.row_line, batch)).encode()
            rows.close()
            continue
        last = b"\n"
        with open(part["path"], "rb") as f:
            f.seek(part["start"])
            left = part["end"] - part["start"]
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                left -= len(chunk)
                last = chunk[-1:]
                yield chunk
        if last != b"\n":
            yield b"\n"     # a file's last row without its newline: the next part's rows stay apart


def cache_root(folder: str) -> str:
    """The node's data cache: beside the node's job folders (SSH: the nodes file's
    work_dir; Ray: the per-node root), so it outlives each job's folder."""
    return f"{os.path.dirname(folder.rstrip('/'))}/.cache"


def node_caches(backend: Any, nodes: set | None = None) -> dict | None:
    """node_cache.py on each staged node of the job that still answers, through the
    backend's public calls (base.Backend staged_folders / run_runner); None when
    local (the instances read this machine's files in place)."""
    folders = backend.staged_folders(nodes)
    if folders is None:
        return None
    return {node: _NodeCache(backend, node, folder) for node, folder in folders.items()}


class CacheLinkLost(PaiError):
    """The link to a node's data cache broke: what was on its way did not arrive."""

    def __init__(self, node: str, why: str):
        super().__init__(f"node {node}: its data cache did not answer ({why})")
        self.why = why


class _NodeCache:
    """runners/node_cache.py on one node, the same frames over SSH and Ray. The
    bytes a node is sent are what it acknowledges having read (`put`'s "received")."""

    RUNNER = "node_cache.py"

    def __init__(self, backend: Any, node: str, folder: str):
        self.backend, self.node, self.folder = backend, node, folder
        self.sizes: dict[str, int] = {}

    def _run(self, args: list[str], stdin: bytes = b"", timeout: float = 60.0) -> bytes:
        try:
            return self.backend.run_runner(self.node, self.RUNNER, args, stdin, timeout)
        except (PaiError, SpecError):
            raise
        except Exception as err:  # noqa: BLE001 - the transport's own (paramiko's, OSError, EOFError)
            raise CacheLinkLost(self.node, f"{type(err).__name__}: {err}") from err

    def missing(self, digests: list[str]) -> list[str]:
        if not digests:
            return []
        # The node hashes every blob it holds again: its time grows with their bytes.
        held = sum(self.sizes.get(d, 0) for d in digests)
        return json.loads(self._run(["missing", cache_root(self.folder)], json.dumps(digests).encode(),
                                    timeout=60.0 + held / HASH_RATE))

    def put(self, plan: dict, blobs: dict[str, Callable[[], bytes]]) -> int:
        """The blobs in rounds of up to BATCH bytes (one round in memory at a time),
        the plan line with the last round; the bytes the node acknowledges."""
        sent = 0
        for payload in _rounds(plan, blobs, self.sizes):
            said = json.loads(self._run(["put", cache_root(self.folder), self.folder], payload, timeout=600))
            if said.get("received") != len(payload):
                raise PaiError(f"node {self.node}: the data cache read {said.get('received')} of {len(payload)} bytes")
            sent += said["received"]
        return sent

    def parts(self) -> dict[str, bytes]:
        out, found = self._run(["parts", self.folder]), {}
        pos = 0
        while True:
            end = out.index(b"\n", pos)
            head = out[pos:end].decode()
            if head == "END":
                return found
            _, rel, size = head.split(" ")
            found[rel] = out[end + 1:end + 1 + int(size)]
            pos = end + 1 + int(size)


def _rounds(plan: dict, blobs: dict[str, Callable[[], bytes]], sizes: dict[str, int]):
    """node_cache's `put` streams: blobs grouped up to BATCH bytes, each round
    `{}` or (the last) the plan line, `BLOB <digest> <size>` frames, `END`."""
    rounds: list[list[str]] = [[]]
    size = 0
    for digest in blobs:
        if rounds[-1] and size >= BATCH:
            rounds.append([])
            size = 0
        rounds[-1].append(digest)
        size += sizes.get(digest, 0)
    for n, digests in enumerate(rounds):
        stream = [json.dumps(plan if n == len(rounds) - 1 else {}).encode() + b"\n"]
        for digest in digests:
            data = blobs[digest]()
            stream += [f"BLOB {digest} {len(data)}\n".encode(), data]
        stream.append(b"END\n")
        yield b"".join(stream)


# -- buckets --------------------------------------------------------------------------


BUCKETS = "buckets.json"


def check_buckets(value: Any, job_dir: Path, base: str) -> list[str]:
    """The folders of -Dbuckets on this machine (file:// or a path), recorded in
    JOB/data/buckets.json for the nodes; storage URLs (s3://, oss://, ...) are the
    script's alone. A folder that is not there is a SpecError."""
    folders = []
    for url in _urls(value):
        path = url[len("file://"):] if url.startswith("file://") else url
        path = os.path.normpath(os.path.join(base, os.path.expanduser(path)))
        if not os.path.isdir(path):
            raise SpecError("-Dbuckets", f"{path}: no such folder",
                            "give a folder on this machine (file:///data/bucket/) or a storage URL")
        folders.append(path)
    if folders:
        (job_dir / DATA).mkdir(mode=0o700, exist_ok=True)
        write_private(job_dir / DATA / BUCKETS, json.dumps(folders))
    return folders


def bucket_trees(job_dir: str | Path) -> list[dict]:
    """Each -Dbuckets folder (but those under a `shared:` path) as a tree of files by
    content digest: {"digest" (of the whole tree), "files": [[rel, sha256]],
    "sources": [(rel, sha256, path)]}. Regular files only."""
    trees = []
    for folder, dst in data_trees(str(job_dir)):
        sources = []
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    sources.append((os.path.relpath(path, folder), _file_digest(path), path))
        files = [[rel, digest] for rel, digest, _ in sources]
        trees.append({"digest": hashlib.sha256(json.dumps(files).encode()).hexdigest(), "files": files,
                      "sources": sources, "path": folder, "link": dst})
    return trees


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def node_buckets_argv(plan: Any, trees: list[dict]) -> None:
    """On a node a bucket is a staged folder: `--buckets=file:///x` becomes
    `--buckets=/x` in the plan the master launches from, so the node's path
    mapping (cluster/node_files.py) turns it into the node's path."""
    staged, flag = {t["path"] for t in trees}, "--buckets=file://"
    for role in plan.roles:
        role.argv = [f"--buckets={a[len(flag):]}" if a.startswith(flag) and os.path.normpath(a[len(flag):]) in staged
                     else a for a in role.argv]
