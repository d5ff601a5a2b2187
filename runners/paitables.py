"""PAI's tables for a job's script: read this worker's slice of a table, write rows.

Standard library only, Python 3.7 and later: it runs inside every framework's own
Python. A job imports it as `paitables`, a script run by hand as
`paicli.runners.paitables`.

    import paitables
    table = paitables.open_table(args.tables)      # this worker's slice
    table.columns, table.row_count                  # names; rows in this slice
    for batch in table.read(1024):                  # lists of up to 1024 rows
        ...
    with paitables.open_writer(args.outputs, ["id", "score"]) as out:
        out.write([1, 0.5])

A table is a CSV file (`.tsv`: tab-separated; the first line names the columns),
a folder of them (read in name order as one table), or a SQLite table:
`file:///data/train.csv`, `/data/train.csv`, `sqlite:///data/db.sqlite?table=NAME`.
Rows of a CSV are lists of strings; SQLite rows keep SQLite's types.

Slices are PAI's: one per worker, contiguous, their sizes differing by at most one
row. Inside a job the slice is the worker's own (PAI_SLICE_ID, else PAI_INDEX) and
the job's index (PAI_TABLES_INDEX) says where its rows are. Outside a job,
`open_table(url, slice_id, slice_count)` reads the table directly (slice 0 of 1).

Writers: inside a job with -Doutputs each worker writes its rows to a part file of
its own; the table appears on the submitting machine, whole, when the job succeeds.
Outside a job `open_writer(url, columns)` writes the table aside and renames it
into place (SQLite: one transaction) when closed without an error.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
import sqlite3
import tempfile
from urllib.parse import quote

ENV_TABLES = "PAI_TABLES"
ENV_OUTPUTS = "PAI_OUTPUTS"
ENV_INDEX = "PAI_TABLES_INDEX"
ENV_SLICE_ID = "PAI_SLICE_ID"
ENV_SLICE_COUNT = "PAI_SLICE_COUNT"
CHUNK = 1 << 20            # bytes read at a time while scanning a CSV
TABLE_SUFFIXES = (".csv", ".tsv")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TableError(ValueError):
    """A table that cannot be read as asked: one line saying which and why."""


# -- URLs ----------------------------------------------------------------------------


class TableURL:
    """A parsed table URL: kind "csv" (a file), "dir" (a folder of CSV files) or
    "sqlite" (`table` in the database at `path`). `key` is the canonical form."""

    def __init__(self, kind: str, path: str, table: str = ""):
        self.kind, self.path, self.table = kind, path, table

    @property
    def key(self) -> str:
        return f"sqlite://{self.path}?table={self.table}" if self.kind == "sqlite" else f"file://{self.path}"


def parse_url(url: str, base: str = "") -> TableURL:
    """`file:///abs`, a plain path (relative to `base`, else the current folder) or
    `sqlite:///abs/db?table=NAME` -> TableURL. Whether it exists is not checked
    here (`check_table` does), only its form; a folder is told by the disk."""
    text = str(url).strip()
    if not text:
        raise TableError("an empty table name; give file:///path/to/table.csv or sqlite:///path/db?table=NAME")
    if "\x00" in text:
        raise TableError(f"{text!r}: a NUL character in a table name")
    if text.startswith("sqlite://"):
        rest = text[len("sqlite://"):]
        path, sep, query = rest.partition("?")
        table = ""
        for item in query.split("&") if sep else ():
            name, _, value = item.partition("=")
            if name == "table":
                table = value
            elif item:
                raise TableError(f"{text}: unknown query {name!r}; only ?table=NAME is understood")
        if not path.startswith("/"):
            raise TableError(f"{text}: a sqlite:// URL needs an absolute path, "
                             "e.g. sqlite:///data/db.sqlite?table=NAME")
        if not table:
            raise TableError(f"{text}: which table? add ?table=NAME")
        if not _NAME.match(table):
            raise TableError(f"{text}: table name {table!r} must be letters, digits and _")
        return TableURL("sqlite", os.path.normpath(path), table)
    if text.startswith("file://"):
        text = text[len("file://"):]
        if not text.startswith("/"):
            raise TableError(f"file://{text}: a file:// URL needs an absolute path, e.g. file:///data/train.csv")
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise TableError(f"{text}: the {text.split('://', 1)[0]}:// scheme is not a table paitables reads; "
                         "use file:///path (CSV) or sqlite:///path?table=NAME")
    path = os.path.normpath(os.path.join(base or os.getcwd(), os.path.expanduser(text)))
    return TableURL("dir" if os.path.isdir(path) else "csv", path)


def split_urls(value: str) -> list:
    """-Dtables / --tables as a list of URLs (comma-separated; blanks dropped)."""
    return [part.strip() for part in str(value or "").split(",") if part.strip()]


# -- slices -------------------------------------------------------------------------


def slice_bounds(total: int, slice_id: int, slice_count: int) -> tuple:
    """Rows [start, end) of slice `slice_id` of `slice_count`: contiguous, even
    (sizes differ by at most one), every row of `total` in exactly one slice."""
    if slice_count < 1 or not 0 <= slice_id < slice_count:
        raise TableError(f"slice {slice_id} of {slice_count}: expected 0 <= slice_id < slice_count")
    return total * slice_id // slice_count, total * (slice_id + 1) // slice_count


def own_slice(slice_id=None, slice_count=None) -> tuple:
    """This process's (slice_id, slice_count): the arguments, else PAI_SLICE_ID
    (or PAI_INDEX) and PAI_SLICE_COUNT, else (0, 1)."""
    if slice_count is None:
        slice_count = int(os.environ.get(ENV_SLICE_COUNT) or 1)
    if slice_id is None:
        slice_id = int(os.environ.get(ENV_SLICE_ID) or (os.environ.get("PAI_INDEX") if slice_count > 1 else 0) or 0)
    return int(slice_id), int(slice_count)


# -- scanning a CSV file: record boundaries as Python's csv module finds them --------------


def delimiter_of(path: str) -> str:
    return "\t" if path.lower().endswith(".tsv") else ","


def _plain(data: bytes) -> bool:
    """No quote and no lone CR: csv's records are then the lines ending in LF, so
    they are counted without parsing a field (the common case: fast)."""
    return b'"' not in data and data.count(b"\r") == data.count(b"\r\n")


def _lines(data: bytes) -> int:
    return data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")


class CsvFile:
    """One CSV file's layout: its columns, where its rows begin (`data_start`), how
    many rows it has, and a checkpoint (byte offset, rows before) at every chunk
    so that a row's offset is found by rescanning one chunk. Records are those
    csv.reader reads from the file opened with newline="" (as `Table` reads it).
    `check=True` reads every row too: undecodable text, text csv refuses, or a row
    with another field count is a TableError naming the file and line."""

    def __init__(self, path: str, check: bool = False, delimiter: str = ""):
        self.path = path
        self.delimiter = delimiter or delimiter_of(path)
        self.columns, self.data_start, self.rows, self.size, self.checkpoints = [], 0, 0, 0, []
        self._scan(check)

    def _fail(self, line: int, why: str) -> TableError:
        return TableError(f"{self.path} line {line}: {why}")

    def _scan(self, check: bool) -> None:
        try:
            f = open(self.path, "rb")
        except OSError as err:
            raise TableError(f"{self.path}: cannot read it ({err.strerror or err})") from None
        with f:
            self.size = os.fstat(f.fileno()).st_size
            data = f.read(CHUNK)     # the header: the first record, read on until it ends
            first = next(self._records(data, len(data) == self.size, check), None)
            while first is None and len(data) < self.size:
                data += f.read(len(data))
                first = next(self._records(data, len(data) == self.size, check), None)
            if first is None or not any(field.strip() for field in first[1]):
                raise self._fail(1, "no header line naming the columns")
            self.data_start, self.columns = first
            self.columns[0] = self.columns[0].lstrip("\ufeff")     # a BOM (UTF-8 from Excel) names nothing
            if any(not c.strip() for c in self.columns):
                raise self._fail(1, f"the header {self.delimiter.join(self.columns)[:80]!r} has an empty column name")
            f.seek(self.data_start)
            self._scan_rows(f, check, 1 + _lines(data[:self.data_start]))

    def _decode(self, data: bytes, first_line: int) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self._fail(first_line + _lines(data[:err.start]), "not UTF-8 text (is it a CSV file?)") from None

    def _records(self, data: bytes, final: bool, strict: bool = False, line: int = 1, want: int = 0):
        """(end, row) of each record of `data` (which begins where a record does) as
        csv.reader reads it, `end` the offset just after it. Unless `final` (the
        file ends with `data`), a record that may go on past `data` is left out.
        `want`: the fields each row must have (0: not checked)."""
        lines = data.splitlines(keepends=True)
        if not final and lines and not lines[-1].endswith(b"\n"):
            lines.pop()    # cut by the chunk, or a CR that an LF may follow
        at = [0, False]    # bytes the reader has taken; whether it asked past the last line

        def feed():
            for n, raw in enumerate(lines):
                text = self._decode(raw, line + n)
                at[0] += len(raw)
                yield text
            at[1] = True

        reader = csv.reader(feed(), delimiter=self.delimiter, strict=strict)
        start = line      # where the record being read begins
        try:
            for row in reader:
                if at[1]:    # it ran out of lines inside a quoted field
                    break
                if want and len(row) != want:
                    got = "an empty line" if not row else f"{len(row)} fields"
                    raise self._fail(line + reader.line_num - 1, f"{got}, the header has {want} "
                                     f"({', '.join(self.columns)[:60]!r}); the table is ragged")
                start = line + reader.line_num
                yield at[0], row
        except csv.Error as err:
            if not at[1]:
                raise self._fail(line + reader.line_num - 1, f"not CSV: {err}") from None
        if final and start < line + len(lines):
            raise self._fail(start, "a quoted field is never closed")

    def _scan_rows(self, f, check: bool, line: int) -> None:
        offset, rows, carry = self.data_start, 0, b""
        want = len(self.columns) if check else 0
        while True:
            block = f.read(CHUNK)
            data = carry + block
            if not data:
                break
            final = not block
            if _plain(data):
                end = len(data) if final else data.rfind(b"\n") + 1
                count = data.count(b"\n", 0, end) + (final and not data.endswith(b"\n"))
                if check and end:
                    self._check_plain(data[:end], line, want)
            else:
                ends = [e for e, _row in self._records(data, final, check, line, want)]
                count, end = len(ends), (ends[-1] if ends else 0)
            if not end and not final:      # no record ends here: read on
                carry = data
                continue
            self.checkpoints.append((offset, rows))
            line += _lines(data[:end])
            rows, offset, carry = rows + count, offset + end, data[end:]
            if final:
                break
        self.rows = rows

    def _check_plain(self, chunk: bytes, line: int, want: int) -> None:
        """A chunk without quotes has `want` fields a row when its delimiters say so
        and no line is empty; else it is parsed row by row to name the line."""
        text = self._decode(chunk, line)
        lines = text.count("\n") + (0 if text.endswith("\n") else 1)
        if text.count(self.delimiter) != lines * (want - 1) or "\n\n" in text or "\n\r\n" in text \
                or text.startswith(("\n", "\r\n")):
            for _ in self._records(chunk, True, True, line, want):
                pass

    def _ends(self, data: bytes, final: bool) -> list:
        if not _plain(data):
            return [end for end, _row in self._records(data, final)]
        ends = [m.end() for m in re.finditer(b"\n", data)]
        return ends + [len(data)] if final and data and not data.endswith(b"\n") else ends

    def offset_of(self, row: int) -> int:
        """The byte offset where row `row` (0-based, `rows` = the end) begins."""
        if row >= self.rows:
            return self.size
        base, before = self.data_start, 0
        for off, rows_before in self.checkpoints:
            if rows_before > row:
                break
            base, before = off, rows_before
        if row == before:
            return base
        with open(self.path, "rb") as f:
            f.seek(base)
            data, skip = b"", row - before
            while True:
                block = f.read(CHUNK)
                data += block
                ends = self._ends(data, not block)
                if len(ends) >= skip:
                    return base + ends[skip - 1]
                if not block:
                    return base + len(data)


# -- tables --------------------------------------------------------------------------


def table_files(url: TableURL) -> list:
    """The CSV files of a table: the file, or a folder's *.csv/*.tsv in name order."""
    if url.kind != "dir":
        return [url.path]
    try:
        names = sorted(n for n in os.listdir(url.path) if n.lower().endswith(TABLE_SUFFIXES))
    except OSError as err:
        raise TableError(f"{url.path}: cannot list it ({err.strerror or err})") from None
    files = [os.path.join(url.path, n) for n in names if os.path.isfile(os.path.join(url.path, n))]
    if not files:
        raise TableError(f"{url.path}: a folder with no .csv or .tsv file in it")
    return files


def layout(url: TableURL, check: bool = False) -> dict:
    """What a job's index records of a table before slicing: columns, rows and
    per-file layouts (CSV) or the SQLite table's row count."""
    if url.kind == "sqlite":
        columns, rows = sqlite_shape(url)
        return {"key": url.key, "kind": "sqlite", "path": url.path, "table": url.table,
                "columns": columns, "rows": rows}
    files = [CsvFile(path, check) for path in table_files(url)]
    for other in files[1:]:
        if other.columns != files[0].columns:
            raise TableError(f"{other.path}: its columns ({', '.join(other.columns)[:60]!r}) are not those of "
                             f"{files[0].path} ({', '.join(files[0].columns)[:60]!r}); a folder is one table")
    return {"key": url.key, "kind": "csv", "columns": files[0].columns, "rows": sum(f.rows for f in files),
            "delimiter": files[0].delimiter, "files": files}


def slice_parts(shape: dict, slice_id: int, slice_count: int) -> list:
    """Where slice `slice_id` of the table `shape` (from `layout`) is: a list of
    parts, each {"path", "start", "end", "rows"} (CSV: byte range) or {"path",
    "table", "offset", "rows"} (SQLite)."""
    first, last = slice_bounds(shape["rows"], slice_id, slice_count)
    if shape["kind"] == "sqlite":
        return [{"path": shape["path"], "table": shape["table"], "offset": first, "rows": last - first}]
    parts, seen = [], 0
    for f in shape["files"]:
        lo, hi = max(first, seen), min(last, seen + f.rows)
        if lo < hi:
            parts.append({"path": f.path, "start": f.offset_of(lo - seen), "end": f.offset_of(hi - seen),
                          "rows": hi - lo})
        seen += f.rows
    return parts


def _connect(path: str, write: bool = False) -> sqlite3.Connection:
    if write:
        return sqlite3.connect(path, timeout=30)
    return sqlite3.connect(f"file:{quote(path, safe='/')}?mode=ro", uri=True, timeout=30)


def sqlite_shape(url: TableURL) -> tuple:
    if not os.path.isfile(url.path):
        raise TableError(f"{url.path}: no such SQLite database")
    try:
        con = _connect(url.path)
        try:
            names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table','view')")]
            if url.table not in names:
                known = ", ".join(sorted(names)[:8]) or "none"
                raise TableError(f"{url.path}: no table {url.table!r} in it (tables: {known})")
            cur = con.execute(f'SELECT * FROM "{url.table}" LIMIT 0')
            columns = [d[0] for d in cur.description]
            rows = con.execute(f'SELECT COUNT(*) FROM "{url.table}"').fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error as err:
        raise TableError(f"{url.path}: cannot read it as SQLite ({err})") from None
    return columns, rows


class Table:
    """One slice of one table (see the module's docstring). Iterating gives rows;
    `read(batch)` gives lists of rows."""

    def __init__(self, key: str, columns: list, parts: list, slice_id: int = 0, slice_count: int = 1,
                 delimiter: str = ",", total_rows: int = -1):
        self.key, self.columns, self.parts = key, list(columns), parts
        self.slice_id, self.slice_count, self.delimiter = slice_id, slice_count, delimiter
        self.row_count = sum(p["rows"] for p in parts)
        self.total_rows = total_rows if total_rows >= 0 else self.row_count
        self._open: list = []

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for thing in self._open:
            thing.close()
        self._open = []

    def __len__(self) -> int:
        return self.row_count

    def __iter__(self):
        for batch in self.read():
            yield from batch

    def read(self, batch_size: int = 1024):
        """This slice's rows in lists of up to `batch_size` rows."""
        batch_size = max(1, int(batch_size))
        for part in self.parts:
            rows = self._part_rows(part)
            while True:
                batch = list(itertools.islice(rows, batch_size))
                if not batch:
                    break
                yield batch

    def _part_rows(self, part: dict):
        if part["rows"] <= 0:
            return
        if part.get("format") == "jsonl":   # a SQLite slice shipped to a node: one JSON array a row
            lines = open(part["path"], encoding="utf-8")
            self._open.append(lines)
            rows = (tuple(line_row(line)) for line in lines)
        elif "table" in part:
            con = _connect(part["path"])
            self._open.append(con)
            rows = con.execute(f'SELECT * FROM "{part["table"]}" LIMIT ? OFFSET ?', (part["rows"], part["offset"]))
        else:
            raw = open(part["path"], "rb")
            raw.seek(part["start"])
            rows = io.TextIOWrapper(raw, encoding="utf-8", newline="")
            self._open.append(rows)
            rows = csv.reader(rows, delimiter=self.delimiter)
        n = 0
        for n, row in enumerate(itertools.islice(rows, part["rows"]), 1):
            yield row
        if n < part["rows"]:    # never fewer rows than the job was told: the table changed since
            raise TableError(f"{part['path']}: gave {n} of its {part['rows']} rows; "
                             "was it changed after the job was submitted?")


def load_index(path: str = "") -> dict:
    """The job's table index (PAI_TABLES_INDEX), or {} outside a job."""
    path = path or os.environ.get(ENV_INDEX, "")
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise TableError(f"{ENV_INDEX}={path}: cannot read the job's table index ({err})") from None


def open_table(url: str = "", slice_id=None, slice_count=None, base: str = "") -> Table:
    """This worker's slice of table `url` (default: the first of PAI_TABLES).
    Inside a job the job's index decides where the rows are; outside one the table
    is read directly, slice (`slice_id`, `slice_count`) (default: 0 of 1)."""
    url = url or (split_urls(os.environ.get(ENV_TABLES, "")) or [""])[0]
    urls = split_urls(url)
    if len(urls) > 1:
        raise TableError(f"{url}: {len(urls)} tables; open them one at a time")
    parsed = parse_url(url, base)
    index = load_index()
    entry = next((t for t in index.get("tables", []) if t["key"] == parsed.key), None)
    if entry is not None and slice_id is None and slice_count is None:
        sid, count = own_slice(None, index.get("slice_count"))
        slices = entry["slices"]
        if str(sid) in slices:
            return Table(entry["key"], entry["columns"], slices[str(sid)], sid, count,
                         entry.get("delimiter", ","), entry["rows"])
    sid, count = own_slice(slice_id, slice_count)
    shape = layout(parsed)
    return Table(parsed.key, shape["columns"], slice_parts(shape, sid, count), sid, count,
                 shape.get("delimiter", ","), shape["rows"])


# -- writing -----------------------------------------------------------------------------


class Writer:
    """Rows into a table; nothing is visible until `close()` succeeds (a writer left
    by an exception, `with` or `abort()`, leaves nothing)."""

    def __init__(self, target: str, columns: list, kind: str, table: str = ""):
        self.target, self.columns, self.kind, self.table = target, list(columns), kind, table
        self.rows = 0
        folder = os.path.dirname(target) or "."
        fd, self.aside = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".part", dir=folder)
        os.fchmod(fd, 0o600)
        # sqlite: the rows wait in a part file; close() inserts them in one transaction
        self.file = os.fdopen(fd, "w", encoding="utf-8", newline="" if kind == "csv" else None)
        if kind == "parts":
            self.file.write(json.dumps({"columns": self.columns}) + "\n")
        elif kind == "csv":
            self.csv = csv.writer(self.file, delimiter=delimiter_of(target), lineterminator="\n")
            self.quoted = csv.writer(self.file, delimiter=delimiter_of(target), lineterminator="\n",
                                     quoting=csv.QUOTE_ALL)
            self.csv.writerow(self.columns)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def write(self, row) -> None:
        row = list(row)
        if len(row) != len(self.columns):
            raise TableError(f"{self.target}: a row of {len(row)} values for {len(self.columns)} columns")
        if self.kind == "csv":   # a CR ends a record where it is not quoted, and only "\n" makes csv quote
            (self.quoted if any(isinstance(v, str) and "\r" in v for v in row) else self.csv).writerow(row)
        else:
            self.file.write(row_line(row))
        self.rows += 1

    def write_rows(self, rows) -> None:
        for row in rows:
            self.write(row)

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        _remove(self.aside)

    def close(self) -> None:
        if self.file.closed:
            return
        if self.kind == "parts":    # the end, with the count: a part cut short is told from a whole one
            self.file.write(json.dumps({"rows": self.rows}) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        try:
            if self.kind == "sqlite":
                with open(self.aside, encoding="utf-8") as f:
                    write_sqlite(self.target, self.table, self.columns, map(line_row, f))
                _remove(self.aside)
            else:
                os.replace(self.aside, self.target)
        except BaseException:
            _remove(self.aside)
            raise


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_sqlite(path: str, table: str, columns: list, rows) -> int:
    """`table` (new; an existing one is replaced) with `rows`, in one transaction:
    a reader sees the old state or the whole new table, never part of it. The rows written."""
    con = _connect(path, write=True)
    try:
        con.execute("BEGIN")    # else sqlite3 commits the DROP and the CREATE on their own
        cols = ", ".join('"%s"' % c.replace('"', '""') for c in columns)
        marks = ", ".join("?" for _ in columns)
        with con:
            con.execute(f'DROP TABLE IF EXISTS "{table}"')
            con.execute(f'CREATE TABLE "{table}" ({cols})')
            return con.executemany(f'INSERT INTO "{table}" VALUES ({marks})', rows).rowcount
    finally:
        con.close()


def open_writer(url: str = "", columns=None, base: str = "") -> Writer:
    """A writer for output table `url` (default: the first of PAI_OUTPUTS) with
    `columns`. Inside a job this worker's rows go to its own part file (the job
    assembles the table); outside one, to the table itself when closed."""
    if not columns:
        raise TableError("open_writer: name the columns, e.g. open_writer(args.outputs, ['id', 'score'])")
    url = url or (split_urls(os.environ.get(ENV_OUTPUTS, "")) or [""])[0]
    parsed = parse_url(url, base)
    index = load_index()
    entry = next((o for o in index.get("outputs", []) if o["key"] == parsed.key), None)
    if entry is not None:
        role, idx = os.environ.get("PAI_ROLE", "worker"), os.environ.get("PAI_INDEX", "0")
        os.makedirs(entry["parts"], mode=0o700, exist_ok=True)
        return Writer(os.path.join(entry["parts"], f"part-{role}-{int(idx):05d}.jsonl"), list(columns), "parts")
    if parsed.kind == "sqlite":
        return Writer(parsed.path, list(columns), "sqlite", parsed.table)
    if parsed.kind == "dir":
        raise TableError(f"{parsed.path}: a folder; an output table is a file, e.g. {parsed.path}/out.csv")
    return Writer(parsed.path, list(columns), "csv")


def row_line(row) -> str:
    """A row as one JSON line, a SQLite BLOB as {"hex": ...}: part files and the
    SQLite slices a node is sent."""
    return json.dumps(list(row), default=_json_value) + "\n"


def _json_value(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"hex": bytes(value).hex()}
    if callable(getattr(value, "item", None)):   # a numpy scalar: its Python number
        return value.item()
    raise TypeError(f"a table value must be a number, a string, bytes or None, not {type(value).__name__}")


def line_row(line: str) -> list:
    return json.loads(line, object_hook=lambda d: bytes.fromhex(d["hex"]) if d.keys() == {"hex"} else d)


def read_parts(folder: str):
    """(columns, rows) of the part files a job's workers wrote into `folder`, in
    (role, index) order: what the job assembles into its output table. A part
    that does not end as its writer ended it (cut short) is a TableError."""
    columns, sources = None, []
    names = sorted(n for n in os.listdir(folder) if n.startswith("part-") and n.endswith(".jsonl"))
    for name in names:
        f = open(os.path.join(folder, name), encoding="utf-8")
        sources.append((name, f))
        head = json.loads(f.readline() or "{}").get("columns")
        if head is None or columns not in (None, head):
            raise TableError(f"{folder}/{name}: columns {head} differ from the other workers' {columns}")
        columns = head

    def rows():
        for name, f in sources:
            with f:
                n, end = 0, None
                for n, line in enumerate(f):
                    if line.startswith("{"):     # the writer's last line
                        end = json.loads(line).get("rows")
                        break
                    yield line_row(line)
                if end != n or f.read():
                    raise TableError(f"{folder}/{name}: cut short (no end line after its rows)")

    return columns, rows()
