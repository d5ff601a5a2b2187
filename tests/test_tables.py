"""PAI's tables (issue 18): runners/paitables.py and cluster/datasets.py on this
machine. Slices, the CSV scanner against Python's csv module, URL and CSV fuzzing,
the one-line input errors, and 2-worker jobs over a CSV and a SQLite table whose
workers report their rows (disjoint, complete) and write an output table."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import sqlite3
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, job_id_from, pai, pai_json

sys.path.insert(0, str(ROOT / "runners"))
import paitables  # noqa: E402  (as a job's script imports it)

WORKER = ROOT / "tests" / "scripts" / "table_worker.py"
TWO = '-Dcluster={"worker":{"count":2}}'


# -- slices --------------------------------------------------------------------------


@given(st.integers(0, 10**6), st.integers(1, 300))
def test_slices_are_contiguous_even_and_cover_every_row_once(total, count):
    bounds = [paitables.slice_bounds(total, i, count) for i in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_a_slice_outside_the_count_is_refused():
    with pytest.raises(paitables.TableError):
        paitables.slice_bounds(10, 2, 2)


# -- the CSV scanner is Python's csv module, sliced ---------------------------------------

cells = st.text(alphabet=st.sampled_from(list('ab,"\n\r é\t')), max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(cells, min_size=3, max_size=3), min_size=1, max_size=40),
       count=st.integers(1, 6), chunk=st.sampled_from([7, 64, 1 << 20]), crlf=st.booleans())
def test_slices_of_any_csv_are_what_the_csv_module_reads(tmp_path, monkeypatch, rows, count, chunk, crlf):
    monkeypatch.setattr(paitables, "CHUNK", chunk)
    if not crlf:   # csv.writer leaves a CR unquoted with "\n" lines, and csv.reader ends a record at it
        rows = [[c.replace("\r", "") for c in row] for row in rows]
    path = tmp_path / "t.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\r\n" if crlf else "\n").writerows([["x", "y", "z"], *rows])
    expected = list(csv.reader(open(path, newline="", encoding="utf-8")))[1:]
    checked = paitables.CsvFile(str(path), check=True)
    assert checked.rows == len(expected)
    if count > len(expected):
        return
    got = []
    for i in range(count):
        table = paitables.open_table(str(path), i, count)
        got += list(table)
        table.close()
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40) | st.sampled_from(["sqlite://", "sqlite:///x?table=", "sqlite:///x?table=a;b",
                                               "sqlite://rel?table=t", "file://rel", "odps://p/tables/t",
                                               "sqlite:///x?table=t&z=1", "~nosuchuser_x/t.csv"]))
def test_table_urls_parse_or_say_why_in_one_line(text):
    try:
        url = paitables.parse_url(text, "/base")
    except paitables.TableError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert url.kind in ("csv", "dir", "sqlite") and url.path.startswith("/")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=120))
def test_any_bytes_as_a_csv_are_rows_or_one_line_naming_the_file(tmp_path, blob):
    path = tmp_path / "f.csv"
    path.write_bytes(blob)
    try:
        paitables.CsvFile(str(path), check=True)
    except paitables.TableError as err:
        assert str(err).startswith(str(path)) and "\n" not in str(err)


@pytest.mark.parametrize("text, words", [
    ("a,b\n1,2\n3\n4,5\n", "line 3: 1 fields, the header has 2"),
    ("a,b\n1,2\n\n4,5\n", "line 3: an empty line"),
    ("a,b\n1,2\n3,4,5\n", "line 3: 3 fields"),
    ('a,b\n1,"2\n3\n', "line 2: a quoted field is never closed"),
    ("", "line 1: no header line"),
    ("a,,b\n1,2,3\n", "line 1: the header"),
])
def test_a_ragged_or_broken_csv_names_the_line(tmp_path, text, words):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(paitables.TableError, match=re.escape(words)):
        paitables.CsvFile(str(path), check=True)


@pytest.mark.parametrize("text", [
    'item,size\nscreen,27"\nkeyboard,full\ncable,6"\nmouse,small\n',   # quotes inside unquoted fields
    'item,size\r\nscreen,"27"" wide"\r\nkeyboard,full\rcable,"6\r\nlong"\nmouse,\n',   # bare CR ends a record
    'id\n1\n2,3\n4\n',                                                  # one column: a comma is a field
])
def test_rows_are_those_the_csv_module_reads_or_the_table_is_refused(tmp_path, text):
    path = tmp_path / "t.csv"
    path.write_bytes(text.encode())
    expected = list(csv.reader(open(path, newline="", encoding="utf-8")))[1:]
    if any(len(row) != len(expected[0]) for row in expected):
        with pytest.raises(paitables.TableError, match="line 3: 2 fields, the header has 1"):
            paitables.CsvFile(str(path), check=True)
        return
    assert paitables.CsvFile(str(path), check=True).rows == len(expected)
    for count in range(1, len(expected) + 1):
        got = [row for i in range(count) for row in paitables.open_table(str(path), i, count)]
        assert got == expected, count


def test_a_slice_that_ends_short_is_an_error_never_fewer_rows(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,b\n1,2\n3,4\n5,6\n")
    shape = paitables.layout(paitables.parse_url(str(path)))
    parts = paitables.slice_parts(shape, 0, 1)
    path.write_text("a,b\n1,2\n")          # the table changed after it was sliced
    with pytest.raises(paitables.TableError, match="t.csv: gave 1 of its 3 rows"):
        list(paitables.Table(shape["key"], shape["columns"], parts))


def test_bytes_that_are_not_utf8_name_their_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"a,b\n1,2\n3,\xff\xfe\n")
    with pytest.raises(paitables.TableError, match="line 3: not UTF-8"):
        paitables.CsvFile(str(path), check=True)


def test_a_folder_is_one_table_in_name_order_and_tsv_is_tabs(tmp_path):
    (tmp_path / "b.csv").write_text("id,v\n3,c\n4,d\n")
    (tmp_path / "a.csv").write_text("id,v\n1,a\n2,b\n")
    (tmp_path / "notes.txt").write_text("not a table")
    table = paitables.open_table(f"file://{tmp_path}", 1, 2)
    assert (table.columns, list(table)) == (["id", "v"], [["3", "c"], ["4", "d"]])
    (tmp_path / "c.csv").write_text("id,w\n5,e\n")
    with pytest.raises(paitables.TableError, match="c.csv: its columns"):
        paitables.layout(paitables.parse_url(str(tmp_path)))
    tsv = tmp_path / "t.tsv"
    tsv.write_text("id\tv\n1\ta,b\n")
    assert list(paitables.open_table(str(tsv))) == [["1", "a,b"]]


def test_a_writer_outside_a_job_writes_whole_tables_or_nothing(tmp_path):
    out = tmp_path / "out.csv"
    with pytest.raises(RuntimeError):
        with paitables.open_writer(str(out), ["id", "v"]) as w:
            w.write([1, "a"])
            raise RuntimeError("the script failed half-way")
    assert list(tmp_path.iterdir()) == []          # nothing, not even the file aside
    with paitables.open_writer(str(out), ["id", "v"]) as w:
        w.write_rows([[1, "a"], [2, "b"]])
    assert out.read_text() == "id,v\n1,a\n2,b\n"
    db = tmp_path / "o.sqlite"
    with paitables.open_writer(f"sqlite://{db}?table=p", ["id", "v"]) as w:
        w.write([1, 0.5])
    assert sqlite3.connect(db).execute("SELECT * FROM p").fetchall() == [(1, 0.5)]


# -- jobs -------------------------------------------------------------------------------


def make_tables(folder, rows: int = 101):
    with open(folder / "train.csv", "w", newline="") as f:
        csv.writer(f).writerows([["id", "name"], *[[i, f"n,{i}" if i % 9 == 0 else f"n{i}"] for i in range(rows)]])
    con = sqlite3.connect(folder / "db.sqlite")
    with con:
        con.execute("CREATE TABLE t (id INTEGER, v REAL)")
        con.executemany("INSERT INTO t VALUES (?, ?)", [(i, i / 3) for i in range(rows)])
    con.close()
    return f"file://{folder}/train.csv", f"sqlite://{folder}/db.sqlite?table=t"


def expected_slices(url: str, count: int) -> list[str]:
    out = []
    for i in range(count):
        digest = hashlib.sha256()
        for row in paitables.open_table(url, i, count):
            digest.update(json.dumps([str(v) for v in row]).encode())
        out.append(digest.hexdigest())
    return out


def reports(text: str) -> dict[int, dict[str, str]]:
    found = {}
    for line in text.splitlines():
        if "slice=" in line:
            fields = dict(item.split("=", 1) for item in line.split("] ", 1)[-1].split())
            found[int(fields["slice"])] = fields
    return found


def assert_disjoint_and_complete(text: str, url: str, total: int) -> None:
    got = reports(text)
    assert sorted(got) == [0, 1], text
    assert sum(int(r["rows"]) for r in got.values()) == total
    assert int(got[0]["hi"]) + 1 == int(got[1]["lo"]) and got[0]["lo"] == "0" and int(got[1]["hi"]) == total - 1
    assert [got[i]["checksum"] for i in (0, 1)] == expected_slices(url, 2)


@pytest.mark.parametrize("which", ["csv", "sqlite"])
def test_two_workers_read_disjoint_complete_slices_and_write_one_table(tmp_path, pai_home, which):
    csv_url, db_url = make_tables(tmp_path)
    url = csv_url if which == "csv" else db_url
    out = f"file://{tmp_path}/pred.csv" if which == "csv" else f"sqlite://{tmp_path}/out.sqlite?table=pred"
    result = pai("-name", "python", f"-Dscript={WORKER}", f"-Dtables={url}", f"-Doutputs={out}", TWO)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("OK"), result.stdout + result.stderr
    assert_disjoint_and_complete(result.stdout, url, 101)
    assert f"outputs: {paitables.parse_url(out).key}: 101 rows" in result.stdout
    if which == "csv":
        rows = list(csv.reader(open(tmp_path / "pred.csv")))
        assert rows[0] == ["id", "double"] and rows[1:] == [[str(i), str(2 * i)] for i in range(101)]
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # nothing left aside
    else:
        got = sqlite3.connect(tmp_path / "out.sqlite").execute("SELECT id, double FROM pred").fetchall()
        assert got == [(i, 2 * i) for i in range(101)]


@pytest.mark.parametrize("framework", [
    "python", pytest.param("tensorflow", marks=pytest.mark.tensorflow),
    pytest.param("mxnet", marks=pytest.mark.mxnet), pytest.param("caffe", marks=pytest.mark.caffe)])
def test_every_runtime_imports_paitables_in_a_job_with_tables_or_without(tmp_path, pai_home, framework):
    """TensorFlow's and MXNet's Pythons, Caffe's root filesystem Python 3.9 and
    -name python: the job's own JOB/data/py is first on every instance's path."""
    csv_url, _ = make_tables(tmp_path, 11)
    with_tables = pai("-name", framework, f"-Dscript={WORKER}", f"-Dtables={csv_url}", TWO)
    assert with_tables.returncode == 0, with_tables.stdout[-3000:] + with_tables.stderr[-2000:]
    assert_disjoint_and_complete(with_tables.stdout, csv_url, 11)
    if framework in ("python", "caffe"):
        bare = pai("-name", framework, f"-Dscript={WORKER}", TWO)
        assert bare.returncode == 0, bare.stdout[-3000:] + bare.stderr[-2000:]
        assert bare.stdout.count("imported=data/py/paitables.py role=worker") == 2, bare.stdout


def test_a_failed_job_leaves_no_table_and_says_where_its_rows_are(tmp_path, pai_home):
    csv_url, _ = make_tables(tmp_path, 20)
    result = pai("-name", "python", f"-Dscript={WORKER}", f"-Dtables={csv_url}",
                 f"-Doutputs=file://{tmp_path}/pred.csv", TWO, "-DmaxRetries=0",
                 "-DuserDefinedParameters=--fail")
    assert result.returncode == 1, result.stdout
    assert not (tmp_path / "pred.csv").exists()
    job = pai_json("status", job_id_from(result.stdout))
    said = re.search(r"outputs: no table \S+ \(the job did not succeed\); its workers' rows are in (\S+)",
                     result.stdout)
    assert said and said.group(1).startswith(str(pai_home)), result.stdout
    assert job["status"] == "Failed"


@pytest.mark.parametrize("tables, extra, words", [
    ("file://{d}/nope.csv", TWO, "-Dtables: {d}/nope.csv: no such file or folder"),
    ("{d}/rag.csv", TWO, "-Dtables: {d}/rag.csv line 3: 1 fields, the header has 2"),
    ("sqlite://{d}/db.sqlite?table=nope", TWO, "no table 'nope' in it (tables: t)"),
    ("file://{d}/train.csv", '-Dcluster={"worker":{"count":7}}', "has 5 rows for 7 workers"),
])
def test_bad_tables_are_one_line_exit_2_before_anything_starts(tmp_path, pai_home, tables, extra, words):
    make_tables(tmp_path, 5)
    (tmp_path / "rag.csv").write_text("a,b\n1,2\n3\n")
    result = pai("-name", "python", f"-Dscript={WORKER}", "-Dtables=" + tables.format(d=tmp_path),
                 extra, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert words.format(d=tmp_path) in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (pai_home / "jobs").exists() or not any((pai_home / "jobs").iterdir())


def test_storage_urls_pass_through_untouched_and_a_missing_bucket_is_exit_2(tmp_path):
    from paicli.cluster import datasets, node_files
    from paicli.errors import SpecError

    assert datasets._urls("odps://proj/tables/t,s3://b/k,file:///x.csv,/y.csv") == ["file:///x.csv", "/y.csv"]
    assert datasets.check_buckets("s3://b/k,oss://b/", tmp_path, "/") == []
    assert not (tmp_path / "data").exists()
    with pytest.raises(SpecError, match=f"-Dbuckets: {tmp_path}/nope: no such folder"):
        datasets.check_buckets(f"file://{tmp_path}/nope/", tmp_path, "/")
    (tmp_path / "b1").mkdir()
    (tmp_path / "nfs" / "b2").mkdir(parents=True)
    assert datasets.check_buckets(f"file://{tmp_path}/b1/,{tmp_path}/nfs/b2", tmp_path, "/") == \
        [f"{tmp_path}/b1", f"{tmp_path}/nfs/b2"]
    (tmp_path / "nodes.json").write_text(json.dumps({"backend": "ssh", "shared": [f"{tmp_path}/nfs"]}))
    assert node_files.data_trees(str(tmp_path)) == [(f"{tmp_path}/b1", "buckets/0")]   # shared: not shipped


# -- the node's cache (runners/node_cache.py), without a node --------------------------------


def cache_put(root: str, folder: str, plan: dict, blobs: dict[str, bytes]) -> dict:
    """node_cache's `put` fed the very stream datasets sends a node; what it says."""
    import io

    import node_cache

    from paicli.cluster.datasets import _rounds

    [payload] = list(_rounds(plan, {d: (lambda b=b: b) for d, b in blobs.items()}, {}))
    said = node_cache.receive(root, folder, io.BytesIO(payload))
    assert said["received"] == len(payload) and said["blobs"] == len(blobs)
    return said


def test_the_node_cache_checks_digests_and_keeps_trees_inside(tmp_path):
    import hashlib as h

    import node_cache

    root, folder = str(tmp_path / "cache"), str(tmp_path / "job")
    data = b"rows\n" * 10
    digest = h.sha256(data).hexdigest()
    assert node_cache.missing(root, [digest]) == [digest]
    with pytest.raises(node_cache.Refused, match="hash to"):
        node_cache.store_blob(root, digest, [b"other bytes"])
    assert node_cache.missing(root, [digest]) == [digest] and not list((tmp_path / "cache" / "blobs").iterdir())
    with pytest.raises(node_cache.Refused, match="not a digest"):
        node_cache.missing(root, ["../../etc/passwd"])
    tree = {"digest": "ab" * 32, "files": [["sub/f.txt", digest]], "link": "buckets/0"}
    cache_put(root, folder, {"index": None, "trees": [tree]}, {digest: data})
    linked = tmp_path / "job" / "buckets" / "0" / "sub" / "f.txt"
    assert linked.read_bytes() == data and not linked.stat().st_mode & 0o222
    (tmp_path / "job" / "buckets" / "0").resolve().chmod(0o700)
    (linked.parent.parent / "planted").write_text("x")      # root ignores modes: the tree is made again
    cache_put(root, folder, {"index": None, "trees": [tree]}, {})
    assert sorted(p.name for p in (tmp_path / "job" / "buckets" / "0").iterdir()) == ["sub"]
    for bad in (["../x", digest], ["/etc/x", digest], ["a//b", digest]):
        with pytest.raises(node_cache.Refused, match="leaves its tree"):
            node_cache.build_tree(root, {"digest": "cd" * 32, "files": [bad]})
    with pytest.raises(node_cache.Refused, match="buckets/K"):
        node_cache.place(root, folder, {"trees": [dict(tree, link="../../x")]})


def test_a_corrupted_blob_is_never_reused_even_with_its_size_and_mtime(tmp_path):
    import hashlib as h
    import os

    import node_cache

    root, folder = str(tmp_path / "cache"), str(tmp_path / "job")
    data = b"label\n" * 100
    digest = h.sha256(data).hexdigest()
    tree = {"digest": "ab" * 32, "files": [["f.txt", digest]], "link": "buckets/0"}
    cache_put(root, folder, {"index": None, "trees": [tree]}, {digest: data})
    blob = tmp_path / "cache" / "blobs" / digest
    seen = blob.stat()
    blob.chmod(0o600)
    blob.write_bytes(b"LABEL\n" * 100)                     # a disk error or root: same size, same mtime
    os.utime(blob, ns=(seen.st_atime_ns, seen.st_mtime_ns))
    assert node_cache.missing(root, [digest]) == [digest]   # the next job's first use hashes it again
    cache_put(root, folder, {"index": None, "trees": [tree]}, {digest: data})
    assert (tmp_path / "job" / "buckets" / "0" / "f.txt").read_bytes() == data
    assert node_cache.missing(root, [digest]) == []


def test_a_table_under_a_shared_path_is_read_in_place_on_the_nodes(tmp_path):
    from paicli.cluster import datasets

    csv_url, _ = make_tables(tmp_path, 10)
    index = {"slice_role": "worker", "slice_count": 2, "outputs": [],
             "tables": datasets.check_tables(csv_url, 2, "/")}
    shipped, blobs, _sizes = datasets._Slices(index, ["/elsewhere"]).for_node([1], "/tmp/root/JOB")
    assert list(blobs) and shipped["tables"][0]["slices"]["1"][0]["path"].startswith("/tmp/root/.cache/blobs/")
    assert b"".join(blobs[next(iter(blobs))]().splitlines(keepends=True)[:1]) == b"5,n5\r\n"
    in_place, blobs, _sizes = datasets._Slices(index, [str(tmp_path)]).for_node([1], "/tmp/root/JOB")
    assert blobs == {} and in_place["tables"][0]["slices"] == {"1": index["tables"][0]["slices"]["1"]}


def test_every_job_stages_paitables_alone_first_on_every_role_path(tmp_path, monkeypatch):
    """No tables needed: JOB/data/py (paitables.py alone) heads every role's
    PYTHONPATH, also past a declared PYTHONPATH, and is staged at the same place
    in the node's folder, so the path maps there."""
    import node_agent

    from paicli.client import prepare
    from paicli.cluster import datasets, node_files, remote_paths
    from paicli.envvars import apply_to_plan
    from paicli.staging import stage_code
    from paicli.statement import parse_statement

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/shell/lib")
    prepared = prepare(parse_statement(["-name", "python", f"-Dscript={WORKER}",
                                        '-Dcluster={"ps":{"count":1},"worker":{"count":2}}']))
    job_dir = tmp_path / "jobs" / "job1"
    job_dir.mkdir(parents=True)
    plan = prepared.adapter.plan(prepared.spec, stage_code(prepared.spec, job_dir))
    assert datasets.prepare(prepared.spec, plan, job_dir) is None          # no tables: no index
    py = job_dir / "data" / "py"
    assert [p.name for p in py.iterdir()] == ["paitables.py"] and (py.stat().st_mode & 0o777) == 0o700
    # The shell's PYTHONPATH is not in the plan (it would cross to every node): the
    # node agent adds the instance's own where it starts (this shell's, locally).
    assert {r.name: r.env["PYTHONPATH"] for r in plan.roles} == {"ps": str(py), "worker": str(py)}
    assert all(r.env["PAI_INHERIT_PYTHONPATH"] == "1" for r in plan.roles)
    assert node_agent.instance_env({"env": plan.roles[0].env})["PYTHONPATH"] == f"{py}:/shell/lib"
    monkeypatch.delenv("PYTHONPATH")                           # a node with none of its own
    assert node_agent.instance_env({"env": plan.roles[0].env})["PYTHONPATH"] == str(py)
    assert "PAI_INHERIT_PYTHONPATH" not in node_agent.instance_env({"env": plan.roles[0].env})
    apply_to_plan(plan, {"PYTHONPATH": "/mine"})               # declared: replaces the instance's own
    assert all(r.env["PYTHONPATH"] == f"{py}:/mine" and "PAI_INHERIT_PYTHONPATH" not in r.env for r in plan.roles)
    manifest = node_files.manifest(job_dir, plan)
    staged = [f for f in manifest.files if f.dst.startswith("data")]
    assert [f.dst for f in staged] == ["data", "data/py", "data/py/paitables.py"]
    mapping = manifest.mapping("/node/job1", "/node/rt", "/usr/bin/python3")
    assert all(remote_paths.translate(f.src, mapping) == f"/node/job1/{f.dst}" for f in staged)
    assert remote_paths.translate(plan.roles[0].env["PYTHONPATH"], mapping).startswith("/node/job1/data/py:")


def test_a_node_runs_only_staged_runners_and_local_reaches_no_node(tmp_path):
    """base.Backend's public data calls: the local backend has no node to reach;
    node_cache.run_staged (Ray's task body) runs a runner of the job's folder only."""
    import node_cache

    from paicli.cluster.backends.base import runner_words
    from paicli.cluster.backends.local import LocalBackend

    assert LocalBackend().staged_folders() is None
    with pytest.raises(NotImplementedError):
        LocalBackend().run_runner("here", "node_cache.py", ["parts", str(tmp_path)])
    (tmp_path / "runners").mkdir()
    (tmp_path / "runners" / "echo.py").write_text("import sys; sys.stdout.write(sys.stdin.read()[::-1])\n")
    assert node_cache.run_staged(str(tmp_path), "echo.py", [], b"abc") == (0, b"cba", b"")
    for bad in ("../echo.py", "echo.sh", "/bin/sh"):
        with pytest.raises(node_cache.Refused, match="not a runner"):
            node_cache.run_staged(str(tmp_path), bad, [], b"")
    assert runner_words(b'{"error": "no room"}\n', b"", 1) == '{"error": "no room"}'
    assert runner_words(b"", b"", 3) == "exit 3"


def test_numpy_values_travel_as_their_numbers_never_as_bytes():
    np = pytest.importorskip("numpy")
    line = paitables.row_line([np.int64(3), np.float32(0.5), np.bool_(True), b"\x00\x01", "x", None])
    assert paitables.line_row(line) == [3, 0.5, True, b"\x00\x01", "x", None]
    with pytest.raises(TypeError, match="not object"):
        paitables.row_line([object()])


def test_a_nodes_check_of_its_cached_blobs_is_given_time_for_their_bytes():
    """The node hashes every cached blob a job asks for: 20 GB must not meet a fixed
    60 s limit (the staging would fail as if the node did not answer)."""
    from paicli.cluster import datasets

    asked = []

    class Backend:
        def run_runner(self, node, runner, args, stdin, timeout):
            asked.append(timeout)
            return b"[]"

    cache = datasets._NodeCache(Backend(), "h1", "/tmp/job")
    cache.sizes = {"a": 10 << 30, "b": 10 << 30, "c": 5}
    assert cache.missing(["a", "b"]) == []
    assert cache.missing(["c"]) == []
    assert asked[0] >= (20 << 30) / (50 << 20) and asked[1] <= 61


def test_a_header_longer_than_a_read_is_still_the_header(tmp_path):
    columns = [f"column_{i}" for i in range(200_000)]    # 2.5 MB of names: over two reads
    path = tmp_path / "wide.csv"
    path.write_text(",".join(columns) + "\n" + ",".join(["1"] * len(columns)) + "\n")
    table = paitables.open_table(f"file://{path}")
    assert table.columns == columns and table.row_count == 1
