"""What a table guarantees (docs/data.md), as properties. For any text Python's csv
module reads as a table (quotes, embedded newlines, CR LF and lone CR, a BOM, empty
fields, unicode) and any slice count from 1 to its rows, the slices are a partition
of the rows csv.reader gives, every row once and in order, whether read here (byte
ranges of the file) or from the blobs a node is sent; text csv does not read as a
table is refused at submit. The same for TSV, folders of files and SQLite. An
output table assembled from the workers' parts equals the rows they wrote, or is
absent."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT

sys.path.insert(0, str(ROOT / "runners"))
import paitables  # noqa: E402  (as a job's script imports it)

from paicli.cluster import datasets  # noqa: E402

SOME = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CHARS = list('ab ,\t"\r\né中\x85\u2028\x0b')
NAMES = st.sampled_from(["id", "name", "x y", "é", '"a,b"', '"q""t"', '"new\nline"'])


def unquoted(delim: str):
    return st.text(alphabet=[c for c in CHARS if c not in (delim, "\r", "\n")], max_size=5).filter(
        lambda cell: not cell.startswith('"'))        # a quote inside an unquoted field is a character


def quoted():
    return st.text(alphabet=CHARS, max_size=5).map(lambda cell: '"' + cell.replace('"', '""') + '"')


@st.composite
def csv_text(draw, delim: str = ",", header: list[str] | None = None) -> str:
    """A table as people write one: quoted or not, any line ends, maybe a BOM."""
    header = header or draw(st.lists(NAMES, min_size=1, max_size=3))
    rows = draw(st.lists(st.lists(unquoted(delim) | quoted(), min_size=len(header), max_size=len(header)),
                         max_size=20))
    ends = draw(st.lists(st.sampled_from(["\n", "\r\n", "\r"]), min_size=len(rows) + 1, max_size=len(rows) + 1))
    text = "".join(delim.join(row) + end for row, end in zip([header, *rows], ends))
    if draw(st.booleans()):
        text = text[:-len(ends[-1])]                 # no line end after the last row
    return ("\ufeff" if draw(st.booleans()) else "") + text


def csv_table(text: str, delim: str) -> list[list[str]] | None:
    """The rows csv.reader gives for `text` when it reads as a table (a header
    naming every column, every row as wide), else None; the columns without a BOM."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), delimiter=delim, strict=True))
    except csv.Error:
        return None
    if rows and rows[0]:
        rows[0][0] = rows[0][0].lstrip("\ufeff")     # a BOM before the header names no column
    if not rows or not rows[0] or any(not name.strip() for name in rows[0]) \
            or any(len(row) != len(rows[0]) for row in rows):
        return None
    return rows


def slices(url: str, count: int, folder: str) -> list[list[list]]:
    """Each of `count` slices of the table at `url` as submit cuts it, read here and
    from the blobs a node is sent (the same rows, or the assertion fails)."""
    entry = datasets.check_tables(url, count, "/")[0]
    node_index, blobs, _sizes = datasets._Slices({"tables": [entry], "slice_count": count, "outputs": []}) \
        .for_node(list(range(count)), f"{folder}/node/JOB")
    os.makedirs(f"{folder}/node/.cache/blobs", exist_ok=True)
    for digest, read in blobs.items():
        Path(f"{folder}/node/.cache/blobs/{digest}").write_bytes(read())
    got = []
    for sid in map(str, range(count)):
        for parts in (entry["slices"][sid], node_index["tables"][0]["slices"][sid]):
            with paitables.Table(entry["key"], entry["columns"], parts, delimiter=entry["delimiter"]) as table:
                got.append([list(row) for row in table])
        assert got[-1] == got[-2], sid
    return got[::2]


def assert_partition(url: str, rows: list, data) -> None:
    if not rows:
        return
    count = data.draw(st.integers(1, len(rows)), label="slices")
    with tempfile.TemporaryDirectory() as folder:
        got = slices(url, count, folder)
    assert [row for part in got for row in part] == rows
    assert max(map(len, got)) - min(map(len, got)) <= 1


@pytest.fixture
def chunked(monkeypatch):
    """paitables' read size, small enough that records cross chunk boundaries."""
    return lambda size: monkeypatch.setattr(paitables, "CHUNK", size)


# -- tables in -------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix, delim", [(".csv", ","), (".tsv", "\t")])
@SOME
@given(text=st.one_of(csv_text(","), csv_text("\t"), st.text(alphabet=CHARS, max_size=40)),
       chunk=st.sampled_from([5, 64, 1 << 20]), data=st.data())
def test_any_text_is_refused_or_sliced_into_the_rows_csv_reads(chunked, suffix, delim, text, chunk, data):
    chunked(chunk)
    expected = csv_table(text, delim)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"t{suffix}"
        path.write_bytes(text.encode())
        try:
            shape = paitables.layout(paitables.parse_url(str(path)), check=True)
        except paitables.TableError as err:
            assert expected is None, f"refused a table csv reads: {err}"
            assert str(err).startswith(str(path)) and "\n" not in str(err)
            return
        assert expected is not None, f"took text csv does not read as a table: {shape['rows']} rows"
        assert (shape["columns"], shape["rows"]) == (expected[0], len(expected) - 1)
        assert_partition(str(path), expected[1:], data)


@SOME
@given(header=st.lists(NAMES, min_size=1, max_size=3), data=st.data(), chunk=st.sampled_from([5, 1 << 20]))
def test_a_folder_is_sliced_as_its_files_rows_in_name_order(chunked, header, data, chunk):
    chunked(chunk)
    texts = data.draw(st.lists(csv_text(",", header), min_size=1, max_size=3), label="files")
    tables = [csv_table(text, ",") for text in texts]
    with tempfile.TemporaryDirectory() as folder:
        for n, text in enumerate(texts):
            (Path(folder) / f"{n:02d}.csv").write_bytes(text.encode())
        try:
            paitables.layout(paitables.parse_url(folder), check=True)
        except paitables.TableError:
            assert None in tables or any(t[0] != tables[0][0] for t in tables)
            return
        assert None not in tables and all(t[0] == tables[0][0] for t in tables)
        assert_partition(folder, [row for t in tables for row in t[1:]], data)


values = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False),
                   st.text(alphabet=CHARS, max_size=5), st.binary(max_size=4))


@SOME
@given(rows=st.lists(st.lists(values, min_size=2, max_size=2), min_size=1, max_size=30), data=st.data())
def test_a_sqlite_table_is_sliced_into_its_rows(rows, data):
    with tempfile.TemporaryDirectory() as folder:
        db = f"{folder}/d.sqlite"
        with sqlite3.connect(db) as con:
            con.execute("CREATE TABLE t (a, b)")
            con.executemany("INSERT INTO t VALUES (?, ?)", rows)
        con.close()
        assert_partition(f"sqlite://{db}?table=t", [list(r) for r in rows], data)


# -- tables out ------------------------------------------------------------------------------


@st.composite
def worker_parts(draw):
    """What each worker wrote ([] for one that wrote no part) and, maybe, the length
    one part file is cut to (a full disk, a copy that stopped)."""
    columns = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    cells = st.one_of(st.integers(-10**6, 10**6), st.text(alphabet=CHARS, max_size=5))
    wrote = draw(st.lists(st.lists(st.lists(cells, min_size=len(columns), max_size=len(columns)), max_size=8),
                          min_size=1, max_size=4))
    cut = draw(st.none() | st.tuples(st.integers(0, len(wrote) - 1), st.floats(0, 1)))
    return columns, wrote, cut


@pytest.mark.parametrize("kind", ["csv", "sqlite"])
@SOME
@given(case=worker_parts())
def test_an_output_table_is_the_rows_the_workers_wrote_or_absent(kind, case):
    columns, wrote, cut = case
    with tempfile.TemporaryDirectory() as folder:
        parts = Path(folder) / "parts"
        parts.mkdir()
        for idx, rows in enumerate(wrote):
            if rows:
                with paitables.Writer(str(parts / f"part-worker-{idx:05d}.jsonl"), columns, "parts") as out:
                    out.write_rows(rows)
        if cut and wrote[cut[0]]:
            part = parts / f"part-worker-{cut[0]:05d}.jsonl"
            data = part.read_bytes()
            part.write_bytes(data[:int(len(data) * cut[1])] if cut[1] < 1 else data[:-1])
        target = f"{folder}/out.csv" if kind == "csv" else f"{folder}/out.sqlite"
        out = {"kind": kind, "path": target, "table": "t", "parts": str(parts)}
        want = [row for rows in wrote for row in rows]
        try:
            written = datasets.assemble(out)
        except Exception:  # noqa: BLE001 - any refusal will do, as long as nothing is left
            assert (cut and wrote[cut[0]]) or not want
            assert set(os.listdir(folder)) <= {"parts", "out.sqlite"} and not os.path.exists(f"{folder}/out.csv")
            if os.path.exists(f"{folder}/out.sqlite"):
                assert sqlite3.connect(target).execute("SELECT name FROM sqlite_master").fetchall() == []
            return
        assert written == len(want)
        if kind == "csv":
            got = list(csv.reader(open(target, newline="", encoding="utf-8")))
            assert got == [columns, *[[str(v) for v in row] for row in want]]
        else:
            got = sqlite3.connect(target).execute("SELECT * FROM t").fetchall()
            assert [list(r) for r in got] == want
