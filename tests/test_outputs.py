"""A job's files (issue 17): the pure rules, the agent's frames into the master's
receiver (written aside, checked, renamed; a full disk), and local jobs end to end
(`pai outputs`, `pai get`, `pai kill`). SSH and Ray: test_outputs_ssh.py / _ray.py."""

from __future__ import annotations

import email.message
import email.utils
import json
import urllib.parse
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PAI, job_id_from, pai, pai_json, wait_until
from paicli.cluster import outputs
from paicli.runners import node_outputs
from paicli.store import Store
from test_outputs_ssh import SCRIPT


# -- pure rules -------------------------------------------------------------------------


def test_urls_and_shared_paths_are_never_watched(tmp_path):
    for url in ("s3://b/ckpt", "oss://b/x", "hdfs://nn/x", "gs://b/x"):
        assert outputs.checkpoint_dir(url, "/w") is None
    assert outputs.checkpoint_dir("/nfs/me/ckpt", "/w", shared=("/nfs",)) is None
    assert outputs.checkpoint_dir("/nfsx/ckpt", "/w", shared=("/nfs",)) == "/nfsx/ckpt"
    assert outputs.checkpoint_dir("ckpt", "/w") == "/w/ckpt"
    assert outputs.checkpoint_dir(None, "/w") is None
    assert [k for k, _ in outputs.targets("/j", "/w", "/c", "worker", 1)] == ["out", "ckpt", "cwd"]
    assert outputs.output_dir("/j", "worker", 1) == "/j/outputs/worker-1"


def test_size_and_shared_parsers_never_traceback():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from paicli.cluster.nodes import parse_nodes
    from paicli.errors import UsageError
    from paicli.spec import parse_size

    @settings(max_examples=300, deadline=None)
    @given(st.one_of(st.text(max_size=12), st.integers(), st.floats(), st.none()))
    def sizes(value):
        size = parse_size(value)
        assert size is None or (isinstance(size, int) and size >= 1)

    @settings(max_examples=200, deadline=None)
    @given(st.one_of(st.text(max_size=10), st.lists(st.one_of(st.text(max_size=8), st.integers()), max_size=3),
                     st.integers(), st.none()))
    def shared(value):
        try:
            config = parse_nodes(json.dumps({"shared": value, "nodes": [{"name": "h1", "host": "10.0.0.1"}]}))
        except UsageError as err:
            assert "shared" in str(err) and "\n" not in str(err)
        else:
            assert all(p.startswith("/") for p in config.shared)

    sizes()
    shared()
    assert parse_size("2G") == 2 << 30 and parse_size("500M") == 500 << 20 and parse_size("lots") is None


HOSTILE_NAMES = ("../x", "/etc/passwd", "a/../../x", "", "a//b", "a/./b", ".ssh/authorized_keys",
                 ".venv/lib/python3.11/site-packages/zz.pth", ".pai/nodes.yaml", "x\n[pai] job Succeeded",
                 "a\rb", "a\x1bb", "a\u2028b", "a\udcffb", "__pycache__/m.pyc", "n" * 256, None, 7)


def test_one_name_rule_for_the_scanner_and_the_receiver(tmp_path):
    """node_outputs.refused is the rule: the scanner leaves out every name it
    refuses (so an honest node never sends one), and the receiver refuses each such
    name from a node, writes nothing, and fails the job naming the node."""
    for bad in HOSTILE_NAMES:
        assert node_outputs.refused(bad), bad
    assert node_outputs.refused("models/model.h5") is None
    assert node_outputs.refused("home/x", "/w", {"/w/home"}) and node_outputs.refused("x", "/w/home", {"/w"}) is None
    src = tmp_path / "src"
    for rel in ("model.h5", ".hidden", ".venv/zz.pth", "a\nb", "__pycache__/m.pyc", "sub/ok.txt"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("x")
    assert sorted(node_outputs.scan(str(src))) == ["model.h5", "sub/ok.txt"]
    home, dest = tmp_path / "home", tmp_path / "here"
    dest.mkdir()
    for rel in [n for n in HOSTILE_NAMES if isinstance(n, str)] + ["home/jobs/x"]:
        lines: list[str] = []
        inst = receiver(tmp_path, dest, lines)
        inst.watch["skip"] = [str(dest / "home")]
        for kind, payload in ((b"F", {"key": "cwd", "rel": rel, "size": 1, "mtime": 1}), (b"D", b"x"),
                              (b"S", {"digest": "crc32:8cdc1683"})):
            inst.sink(kind, payload if kind == b"D" else json.dumps(payload).encode())
        assert inst.job.hostile and "node h2" in inst.job.hostile and "\n" not in inst.job.hostile, rel
        assert not inst.job._rows and [line for line in inst.job._lines if "h2" in line] == [
            f"outputs: {inst.job.hostile}"]
    assert not list(dest.rglob("*")) and not home.exists() and not (tmp_path / "x").exists()


def test_a_node_replaces_no_file_here_that_no_job_wrote(tmp_path):
    """In the working folder (maybe $HOME) a file that was there before the job is
    replaced only if a job's file went there (an earlier run, or this job); the
    output and checkpoint folders are the job's own. A link here never leads a
    file out of its folder. Neither fails the job: the file stays on its node."""
    src, dest, ckpt, elsewhere = (tmp_path / n for n in ("node", "here", "ckpt", "elsewhere"))
    for folder in (src / "linked", dest, ckpt, elsewhere):
        folder.mkdir(parents=True)
    for name in ("notes.txt", "model.h5", "step"):
        (src / name).write_text("from the node")
        (dest / name).write_text("mine")
    (ckpt / "step").write_text("old")
    (src / "linked" / "x").write_text("from the node")
    (dest / "linked").symlink_to(elsewhere)
    inst = receiver(tmp_path, dest, [])
    inst.dirs["ckpt"] = str(ckpt)
    inst.job.written = {str(dest / "model.h5")}
    frames = list(node_outputs.file_frames({"dirs": [["cwd", str(src)]]}, {}, None))
    frames += [f for f in node_outputs.file_frames({"dirs": [["ckpt", str(src)]]}, {}, None)
               if f[0] != b"F" or json.loads(f[1])["rel"] == "step"]
    for kind, payload in frames:
        inst.sink(kind, payload)
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "model.h5").read_text() == "from the node"
    assert (ckpt / "step").read_text() == "from the node" and not list(elsewhere.iterdir())
    rows = {r[2]: r for r in inst.job._rows}
    assert "no job wrote" in rows[str(dest / "notes.txt")][9] and "outside" in rows[str(dest / "linked" / "x")][9]
    assert rows[str(dest / "step")][6] == "node" and inst.job.hostile is None
    # the same file again, now that this job wrote it, is replaced
    again = [f for f in node_outputs.file_frames({"dirs": [["cwd", str(src)]]}, {}, None)
             if f[0] != b"F" or json.loads(f[1])["rel"] == "model.h5"]
    for kind, payload in again:
        inst.sink(kind, payload)
    assert inst.job._rows[-1][6] == "here"


def test_a_node_sends_no_more_than_it_listed_and_the_receiver_takes_no_more(tmp_path):
    """A file that grows while it is read goes no further than the size it was
    listed with; a node that sends more than it announced, or than -DoutputMaxSize,
    is refused; a frame longer than any agent sends ends the link."""
    from paicli.cluster.agent_link import Link

    src = tmp_path / "node"
    src.mkdir()
    (src / "log.txt").write_bytes(b"x" * 1000)
    watch = {"dirs": [["cwd", str(src)]], "max_bytes": 1000}
    frames = node_outputs.file_frames(watch, {}, None)
    assert next(frames)[0] == b"F"
    with open(src / "log.txt", "ab") as f:
        f.write(b"y" * 5_000_100)
    rest = list(frames)
    assert sum(len(p) for k, p in rest if k == b"D") == 1000
    assert json.loads(rest[-2][1])["error"] == "it changed while it was being sent"
    dest = tmp_path / "here"
    for size, sent, limit in ((10, 100, None), (2000, 2000, 1000)):
        inst = receiver(tmp_path, dest, [])
        inst.job.max_bytes = limit or inst.job.max_bytes
        inst.sink(b"F", json.dumps({"key": "cwd", "rel": "big.bin", "size": size, "mtime": 1}).encode())
        for _ in range(0, sent, 10):
            inst.sink(b"D", b"z" * 10)
        inst.sink(b"S", json.dumps({"digest": "crc32:00000000"}).encode())
        assert "more bytes than its size" in inst.job.hostile and "node h2" in inst.job.hostile
        assert not dest.exists() or not list(dest.iterdir())
    for feed in ("link", "collect"):
        inst = receiver(tmp_path, dest, [])
        claim = b"D" + (0xFFFFFFF0).to_bytes(4, "big") + b"z" * 65536
        if feed == "link":
            link = Link(None, "h2")
            link.sink = inst.sink
            assert link.feed(claim) == b"" and link.feed(b"z" * 65536) == b""
            assert link.status is not None and not link._buf
        else:
            outputs.feed_frames([claim, b"z" * 65536], inst.sink)
        assert "a frame of 4294967280 bytes" in inst.job.hostile and "node h2" in inst.job.hostile


def test_the_agent_lists_only_what_changed_and_leaves_out_other_watched_folders(tmp_path):
    work, ckpt = tmp_path / "work", tmp_path / "work" / "ckpt"
    (work / ".git").mkdir(parents=True)
    (work / ".git" / "HEAD").write_text("x")
    (work / "staged.py").write_text("print(1)")
    watch = {"dirs": [["ckpt", str(ckpt)], ["cwd", str(work)]], "state": str(tmp_path / "s" / "state.json")}
    sent = node_outputs.begin_watch(watch)
    assert sent == {"ckpt": {}, "cwd": {"staged.py": sent["cwd"]["staged.py"]}}
    (work / "model.h5").write_text("weights")
    (ckpt / "step-1").write_text("ckpt")
    frames = list(node_outputs.file_frames(watch, sent, None))
    heads = [json.loads(p) for k, p in frames if k == b"F"]
    assert [(h["key"], h["rel"]) for h in heads] == [("ckpt", "step-1"), ("cwd", "model.h5")]
    assert frames[-1] == (b"Z", json.dumps({"files": 2, "all": True}).encode())
    # a second pass sends nothing; `collect` from the state file sends both again
    assert [k for k, _ in node_outputs.file_frames(watch, sent, None)] == [b"Z"]
    again = [json.loads(p)["rel"] for k, p in node_outputs.collect({"state": watch["state"]}) if k == b"F"]
    assert again == ["step-1", "model.h5"]


def test_on_this_machine_an_instances_files_are_what_changed_from_its_start_on(tmp_path):
    """On this machine the agent lists nothing as the instance starts: what changed
    from the instance's start on (its ctime, which utime cannot set back) is the
    instance's, even a file it wrote with an old mtime; what was there and is
    untouched is not."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("kept.txt", "appended.log"):
        (work / name).write_text("before")
    os.utime(work / "kept.txt", ns=(1, 1))
    from paicli.runners.node_agent import CLOCK_SLACK_NS

    began = time.time_ns()
    while time.time_ns() < began + 3 * CLOCK_SLACK_NS:   # the files above well before the start
        time.sleep(0.005)
    since = time.time_ns() - CLOCK_SLACK_NS   # as the agent lists: its start less the file clock's lag
    with open(work / "appended.log", "a") as f:
        f.write("after")
    (work / "restored.bin").write_text("old")
    os.utime(work / "restored.bin", ns=(1, 1))   # `cp -p`, tar: an mtime from the past
    watch = {"dirs": [["cwd", str(work)]], "state": str(tmp_path / "s" / "state.json"), "inplace": True}
    files = node_outputs.Watch(watch, since_ns=since)
    frames = list(files.frames(None))
    # In place: no F, D, S per file, but one L frame that lists them (the master's
    # cost per file was ~14 us of JSON and bookkeeping per frame, twice).
    assert [k for k, _ in frames] == [b"L", b"Z"]
    listed = json.loads(frames[0][1])
    assert sorted(entry[1] for entry in listed) == ["appended.log", "restored.bin"]
    assert all(entry[4].startswith("crc32:") and entry[5] is None for entry in listed)
    assert [k for k, _ in files.frames(None)] == [b"Z"]   # sent once
    # a dead master's watchdog collects from the state file alone: the same files
    collected = list(node_outputs.collect({"state": watch["state"], "inplace": True}))
    assert sorted(entry[1] for k, p in collected if k == b"L" for entry in json.loads(p)) == \
        ["appended.log", "restored.bin"]


@pytest.mark.parametrize("inplace, order", [(True, ["start"]), (False, ["list", "start"])])
def test_the_agent_lists_a_local_instances_folders_only_at_its_end(tmp_path, monkeypatch, inplace, order):
    """A working folder of thousands of files took ~0.15 s per instance to list
    before it started (the ps first, the workers after it); listed after the start,
    this checkout's still took 2-4 ms of a core per instance as the instances'
    interpreters started. On this machine what changed from the start on is the
    instance's, found by the listing at its end: none at the start. A node's
    folders, just staged, are still listed before the start: the staged files are
    not its."""
    from paicli.runners import node_agent

    seen = []
    real_scan = node_outputs.scan
    monkeypatch.setattr(node_outputs, "scan", lambda *a: seen.append("list") or real_scan(*a))
    real_popen = node_agent.subprocess.Popen
    monkeypatch.setattr(node_agent.subprocess, "Popen", lambda *a, **k: seen.append("start") or real_popen(*a, **k))
    monkeypatch.setattr(node_agent.Instance, "_catch_signals", lambda self: None)
    out_r, out_w = os.pipe()
    try:
        watch = {"dirs": [["cwd", str(tmp_path)]], "state": str(tmp_path / "s.json"), "inplace": inplace}
        inst = node_agent.Instance({"argv": ["true"], "watch": watch}, -1, node_agent.Channel(out_w))
        assert inst.start()
        inst.proc.wait()
    finally:
        os.close(out_r)
        os.close(out_w)
    assert seen == order
    assert inst.files is not None and inst.files.sent == {"cwd": {}}


def test_pai_get_asks_a_node_for_the_chosen_files_alone(tmp_path):
    rows = [("j", "worker:0", "/w/big.bin", 9, 0, None, "node", "h1", "/n/code/big.bin", "over the size limit"),
            ("j", "worker:0", "/w/ckpt/other.bin", 9, 0, None, "node", "h1", "/n/c/other.bin", "over the size limit"),
            ("j", "worker:0", "/w/model.h5", 9, 0, "ab", "here", "h1", None, None),
            ("j", "worker:1", "*", 0, 0, None, "node", "h2", "the job's folder on h2", "node unreachable")]
    chosen = [(r[1], r[2]) for r in rows]
    assert outputs.left_on_nodes(rows, chosen) == {("worker:0", "h1"): ["/w/big.bin", "/w/ckpt/other.bin"],
                                                   ("worker:1", "h2"): None}
    assert outputs.left_on_nodes(rows, chosen[:1]) == {("worker:0", "h1"): ["/w/big.bin"]}
    # a checkpoint folder inside the working folder: its files are the checkpoint key's
    assert outputs.rels_of(["/w/big.bin", "/w/ckpt/other.bin"], {"cwd": "/w", "ckpt": "/w/ckpt"}) == \
        {"cwd": ["big.bin"], "ckpt": ["other.bin"]}
    # the agent's collect sends those and nothing else, whatever the size limit said
    work = tmp_path / "work"
    work.mkdir()
    (work / "big.bin").write_bytes(b"x" * 2000)
    (work / "small.txt").write_text("s")
    state = tmp_path / "state.json"   # as the agent wrote it when the folder was empty
    state.write_text(json.dumps({"watch": {"dirs": [["cwd", str(work)]], "max_bytes": 1000}, "base": {"cwd": {}}}))
    request = {"state": str(state), "only": {"cwd": ["big.bin"]}, "max_bytes": outputs.UNLIMITED}
    sent = [json.loads(p)["rel"] for k, p in node_outputs.collect(request) if k == b"F"]
    assert sent == ["big.bin"]
    assert [json.loads(p)["rel"] for k, p in node_outputs.collect(dict(request, only=None)) if k == b"F"] == \
        ["big.bin", "small.txt"]


class NodeFolders:
    """A backend's collect over folders of this machine standing for the nodes' job
    folders (the transport is test_outputs_ssh's business: here, what is done with it)."""

    def __init__(self, folders: dict):
        self.folders, self.removed = folders, []

    def collect_outputs(self, job_dir, node, role, idx, have, max_bytes, only=None):
        request = {"state": f"{self.folders[node]}/{outputs.state_rel(role, idx)}", "have": have,
                   "max_bytes": max_bytes, "only": only}
        yield b"".join(k + len(p).to_bytes(4, "big") + p for k, p in node_outputs.collect(request))

    def remove_job_folders(self, job_dir, names):
        self.removed += names


def test_pai_get_brings_what_a_node_held_marks_it_here_and_removes_the_folder(tmp_path, store_kind):
    store = Store(tmp_path / "home")
    job_dir, work, node = tmp_path / "home" / "jobs" / "j1", tmp_path / "work", tmp_path / "h1"
    job_dir.mkdir(parents=True)
    work.mkdir()
    (job_dir / "nodes.json").write_text('{"backend": "ssh"}')
    (job_dir / "spec.json").write_text('{"name": "python"}')
    (job_dir / "plan.json").write_text(json.dumps({"roles": [{"name": "worker", "cwd": str(work)}]}))
    store.create_job("j1", name="n", framework="python", project=None, task_name="T", job_dir=job_dir,
                     roles=[{"name": "worker", "count": 2, "must_finish": True}])
    node_outputs.begin_watch({"dirs": [["cwd", str(node / "code")]], "state": str(node / outputs.state_rel("worker", 0))})
    (node / "code" / "models").mkdir(parents=True)
    (node / "code" / "models" / "model.h5").write_bytes(b"weights" * 1000)
    unreachable = ("node unreachable", "the job's folder on h1")
    store.add_outputs([("j1", "worker:0", "*", 0, 0, None, "node", "h1", unreachable[1], unreachable[0]),
                       ("j1", "worker:1", "*", 0, 0, None, "node", "h2", "the job's folder on h2", unreachable[0])])
    backend, lines = NodeFolders({"h1": str(node), "h2": str(tmp_path / "h2")}), []
    wanted = outputs.left_on_nodes(store.outputs("j1"), [("worker:0", "*"), ("worker:1", "*")])
    arrived: list[int] = []   # pai get's progress bar is fed every byte that came
    assert outputs.fetch_from_nodes(store, "j1", backend, wanted, lines.append, arrived.append) == set()
    assert (work / "models" / "model.h5").read_bytes() == b"weights" * 1000
    assert sum(arrived) == len(b"weights" * 1000)
    rows = {(r[1], r[2]): r for r in store.outputs("j1")}
    assert set(rows) == {("worker:0", str(work / "models" / "model.h5")), ("worker:1", "*")}
    assert rows[("worker:0", str(work / "models" / "model.h5"))][6] == "here"
    # h2's folder is gone (a reboot): what it held is nowhere, and said so
    assert rows[("worker:1", "*")][6] == "missing" and "gone from node h2" in rows[("worker:1", "*")][9]
    assert any("no longer on node h2" in line for line in lines), lines
    assert backend.removed == ["h1", "h2"] and store.output_totals("j1")["missing"] == 1


class Recorder:
    def __init__(self):
        self.rows, self.events = [], []

    def output_paths(self, folder):
        return set()

    def jobs_since(self, job_id):
        return []

    def outputs(self, job_id):
        return []

    def add_outputs(self, rows):
        self.rows += rows

    def replace_outputs(self, *args):
        pass

    def event(self, *args):
        self.events.append(args)


def receiver(tmp_path: Path, dest: Path, lines: list) -> outputs.InstanceOutputs:
    """The master's side of one instance of a job on SSH nodes."""
    (tmp_path / "job").mkdir(exist_ok=True)
    (tmp_path / "job" / "nodes.json").write_text('{"backend": "ssh"}')
    job = outputs.JobOutputs(Recorder(), "j1", tmp_path / "job", lines.append)
    return outputs.InstanceOutputs(job, "worker:0", "h2", {"cwd": str(dest)}, {"dirs": [["cwd", str(dest)]]})


def frames_of(src: Path, rel: str) -> list[tuple[bytes, bytes]]:
    watch = {"dirs": [["cwd", str(src)]]}
    return [f for f in node_outputs.file_frames(watch, {}, None) if f[0] != b"F" or json.loads(f[1])["rel"] == rel]


def test_a_file_arrives_whole_or_not_at_all(tmp_path):
    src, dest = tmp_path / "node", tmp_path / "here"
    src.mkdir()
    (src / "sub").mkdir()
    (src / "sub" / "model.h5").write_bytes(os.urandom(700_000))
    lines: list[str] = []
    inst = receiver(tmp_path, dest, lines)
    for kind, payload in frames_of(src, "sub/model.h5"):
        inst.sink(kind, payload)
    assert (dest / "sub" / "model.h5").read_bytes() == (src / "sub" / "model.h5").read_bytes()
    assert os.stat(dest / "sub" / "model.h5").st_mtime_ns == os.stat(src / "sub" / "model.h5").st_mtime_ns
    assert inst.complete and inst.job._rows[0][6] == "here"
    # a copy whose bytes do not match the node's checksum is dropped, not renamed
    (src / "sub" / "model.h5").write_bytes(b"new weights")
    frames = frames_of(src, "sub/model.h5")
    frames = [(k, b"tampered!!!" if k == b"D" else p) for k, p in frames]
    for kind, payload in frames:
        inst.sink(kind, payload)
    assert (dest / "sub" / "model.h5").read_bytes() != b"tampered!!!"
    assert inst.job._rows[-1][6] == "node" and "checksum" in inst.job._rows[-1][9]
    assert not [p for p in dest.rglob("*") if p.name.startswith(".pai-part-")]
    assert "not brought back" in inst.job._lines[-1] and "h2" in inst.job._lines[-1]


def test_a_full_disk_here_is_one_line_and_nothing_half_written(tmp_path):
    src, dest = tmp_path / "node", tmp_path / "small"
    src.mkdir()
    dest.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(dest)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.decode().strip()}")
    try:
        (src / "big.bin").write_bytes(os.urandom(1_000_000))
        (src / "small.txt").write_text("fits")
        inst = receiver(tmp_path, dest, [])
        for kind, payload in node_outputs.file_frames({"dirs": [["cwd", str(src)]]}, {}, None):
            inst.sink(kind, payload)
        assert sorted(p.name for p in dest.iterdir()) == ["small.txt"]   # no partial big.bin, no part file
        rows = {os.path.basename(r[2]): r for r in inst.job._rows}
        assert rows["big.bin"][6] == "node" and rows["big.bin"][9] == "disk full on this machine"
        assert rows["small.txt"][6] == "here"
        full = [line for line in inst.job._lines if "disk" in line]
        assert len([line for line in full if "is full" in line]) == 1, inst.job._lines
    finally:
        subprocess.run(["umount", str(dest)], check=True)


def test_partial_copies_a_dead_master_left_are_removed(tmp_path):
    (tmp_path / "a" / ".git").mkdir(parents=True)
    (tmp_path / "a" / f"{outputs.PART}1234-model.h5").write_text("half")
    (tmp_path / "a" / "model.h5").write_text("whole")
    (tmp_path / "a" / ".git" / f"{outputs.PART}x").write_text("not ours to look at")
    assert outputs.remove_parts(str(tmp_path)) == 1
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".git", "model.h5"]


def test_two_instances_writing_one_path_name_both_and_the_last_wins(tmp_path):
    lines: list[str] = []
    job = outputs.JobOutputs(Recorder(), "j1", tmp_path / "job", lines.append)
    for name, digest in (("worker:0", "aa"), ("worker:1", "aa"), ("worker:1", "bb")):
        inst = outputs.InstanceOutputs(job, name, "h", {}, {"inplace": True})
        job.arrived(inst, {"local": "/w/model.h5", "rel": "model.h5", "size": 1, "mtime": 1}, digest, None)
    job.flush()
    assert lines == ["outputs: worker:0 and worker:1 both wrote /w/model.h5 (different content); "
                     "worker:1's copy, the last to finish, is kept"]
    # the same content seen by both (a shared folder) is worker:0's alone: no second row
    assert [r[1] for r in job.store.rows] == ["worker:0", "worker:1"]


# -- local jobs, end to end ----------------------------------------------------------------


def test_a_bad_size_limit_is_one_line_exit_2(pai_home, tmp_path):
    (tmp_path / "t.py").write_text("print(1)")
    result = pai("-name", "python", f"-Dscript={tmp_path / 't.py'}", "-DoutputMaxSize=lots")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "outputMaxSize" in result.stderr and "500M" in result.stderr
    assert not (pai_home / "jobs").exists() or not any((pai_home / "jobs").iterdir())


def test_local_files_are_listed_got_and_kept_after_pai_kill(pai_home, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    statement = ["-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":2}}',
                 f"-DcheckpointDir={tmp_path / 'ckpt'}", "-DmaxRetries=0"]
    result = subprocess.run([*PAI, *statement], cwd=work, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = job_id_from(result.stdout)
    listed = pai_json("outputs", job_id)
    where = {os.path.relpath(f["path"], tmp_path): f["where"] for f in listed["files"]}
    assert where["ckpt/ckpt-0"] == where["ckpt/ckpt-1"] == where["work/models/model-1.txt"] == "here"
    assert where[f"pai-home/jobs/{job_id}/outputs/worker-0/out.txt"] == "here"
    assert listed["count"] == len([f for f in listed["files"] if f["where"] != "replaced"]) == 7
    assert listed["missing"] == 0
    same = {f["instance"]: f["where"] for f in listed["files"] if f["path"].endswith("same.txt")}
    assert same == {"worker:0": "replaced", "worker:1": "here"}   # worker:1 wrote it last
    assert pai_json("status", job_id)["outputs"]["count"] == listed["count"]
    got = pai("get", job_id, "model-*.txt", "-o", str(tmp_path / "got"))
    assert got.returncode == 0, got.stderr
    assert sorted(p.name for p in (tmp_path / "got").rglob("*.txt")) == ["model-0.txt", "model-1.txt"]
    got = pai("get", job_id, "out.txt", "-o", str(tmp_path / "one"), "--instance", "worker:1")
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "one" / "out.txt").read_text() == "out of worker 1\n"
    missing = pai("get", job_id, "nothing-*")
    assert missing.returncode == 2 and "no output matches" in missing.stderr

    proc = subprocess.Popen([*PAI, *statement, "-DuserDefinedParameters=--hang"], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job_id = proc.stdout.readline()[5:].strip()
        assert wait_until(lambda: len(pai_json("status", job_id).get("metric_series", {})) == 2, timeout=30)
        assert pai("kill", job_id).returncode == 0
    finally:
        proc.kill()
        proc.wait()
    listed = pai_json("outputs", job_id)
    assert {os.path.basename(f["path"]) for f in listed["files"]} >= {"ckpt-0", "ckpt-1", "out.txt", "same.txt"}


WAITER = r'''
import argparse, os, time
p = argparse.ArgumentParser()
p.add_argument("--tag")
tag = p.parse_known_args()[0].tag
idx = os.environ["PAI_INDEX"]
open(os.path.join(os.environ["PAI_OUTPUT_DIR"], "ready"), "w").close()
while not os.path.exists(".go"):
    time.sleep(0.05)
with open(f"{tag}-{idx}.txt", "w") as f:
    f.write(tag)
while not os.path.exists(".end"):
    time.sleep(0.05)
print("done", flush=True)
'''


def test_a_local_job_claims_only_what_its_own_processes_wrote(pai_home, tmp_path):
    """`pai ... > out.txt` and `pai ... | tee log.txt` in the script's folder, two
    jobs there at once: neither claims pai's own output, nor the other's files."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(WAITER)
    statement = ["-name", "python", "-Dscript=train.py", '-Dcluster={"worker":{"count":2,"cpu":0}}', "-DmaxRetries=0"]
    with open(work / "out.txt", "w") as out:
        first = subprocess.Popen([*PAI, *statement, "-DuserDefinedParameters=--tag a"], cwd=work, stdout=out,
                                 stderr=subprocess.STDOUT)
    tee = subprocess.Popen(["tee", "log.txt"], cwd=work, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    second = subprocess.Popen([*PAI, *statement, "-DuserDefinedParameters=--tag b"], cwd=work, stdout=tee.stdin,
                              stderr=subprocess.STDOUT)
    tee.stdin.close()
    try:
        assert wait_until(lambda: len(list((pai_home / "jobs").glob("*/outputs/*/ready"))) == 4, timeout=90)
        (work / ".go").touch()
        assert wait_until(lambda: len(list(work.glob("[ab]-*.txt"))) == 4, timeout=30)
        (work / ".end").touch()
        assert first.wait(timeout=90) == 0 and second.wait(timeout=90) == 0
    finally:
        for proc in (first, second, tee):
            proc.kill()
            proc.wait()
        for flag in (".go", ".end"):   # the jobs outlive their `pai`: a failed test ends them too
            (work / flag).touch()
    said = {"a": (work / "out.txt").read_text(), "b": (work / "log.txt").read_text()}
    for tag, text in said.items():
        assert "both wrote" not in text, text
        names = {os.path.basename(f["path"]) for f in pai_json("outputs", job_id_from(text))["files"]}
        assert names == {"ready"}, (tag, names)   # the others changed while the other job ran: neither's


def test_pai_outputs_answers_fast_for_ten_thousand_files(pai_home, store_kind):
    store = Store()
    store.create_job("j10k", name="big", framework="python", project=None, task_name="T",
                     job_dir=pai_home / "jobs" / "j10k", roles=[{"name": "worker", "count": 1, "must_finish": True}])
    store.add_outputs([("j10k", "worker:0", f"/w/out/file-{i:05d}.bin", 1000 + i, 1_700_000_000_000_000_000,
                        "ab" * 32, "here", "local", None, None) for i in range(10_000)])
    for args in (("outputs", "j10k"), ("outputs", "j10k", "--json")):
        started = time.monotonic()
        result = pai(*args)
        took = time.monotonic() - started
        assert result.returncode == 0 and result.stdout.count("file-") == 10_000
        print(f"pai {' '.join(args)}: {took:.3f}s")
        assert took < 1.5   # the 0.3 s goal is bench/bench_outputs.py's; this catches a slow path


def test_the_console_has_outputs_and_get(pai_home, tmp_path, capsys):
    from paicli.cli import cli
    from paicli.console import Console

    store = Store()
    store.create_job("jcon", name="c", framework="python", project=None, task_name="T",
                     job_dir=pai_home / "jobs" / "jcon", roles=[{"name": "worker", "count": 1, "must_finish": True}])
    (tmp_path / "model.h5").write_text("weights")
    store.add_outputs([("jcon", "worker:0", str(tmp_path / "model.h5"), 7, 0, None, "here", "local", None, None)])
    console = Console(cli)
    assert console.execute("outputs jcon") == 0
    assert str(tmp_path / "model.h5") in capsys.readouterr().out
    assert console.execute(f"get jcon model.h5 -o {tmp_path / 'got'}") == 0
    assert (tmp_path / "got" / "model.h5").read_text() == "weights"


def test_pai_get_never_follows_a_link_planted_where_it_writes(pai_home, tmp_path):
    """A name next to the target that another user could guess (the old scheme:
    TARGET.pai-get-PID) linked to a file of theirs: the model's bytes must land in
    the target alone."""
    from paicli.cli import cli
    from paicli.console import Console

    store = Store()
    store.create_job("jlink", name="c", framework="python", project=None, task_name="T",
                     job_dir=pai_home / "jobs" / "jlink", roles=[{"name": "worker", "count": 1, "must_finish": True}])
    (tmp_path / "model.h5").write_text("weights")
    store.add_outputs([("jlink", "worker:0", str(tmp_path / "model.h5"), 7, 0, None, "here", "local", None, None)])
    (tmp_path / "got").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    os.symlink(victim, tmp_path / "got" / f"model.h5.pai-get-{os.getpid()}")
    assert Console(cli).execute(f"get jlink model.h5 -o {tmp_path / 'got'}") == 0
    assert victim.read_text() == "keep me"
    got = tmp_path / "got" / "model.h5"
    assert not got.is_symlink() and got.read_text() == "weights" and got.stat().st_mode & 0o777 == 0o600


def test_pai_resume_of_a_cancelled_job_continues_from_its_checkpoint(pai_home, tmp_path):
    from test_outputs_ssh import RESUMING

    work = tmp_path / "work"
    work.mkdir()
    (work / "resume.py").write_text(RESUMING)
    ckpt = tmp_path / "ckpt" / "step"
    proc = subprocess.Popen([*PAI, "-name", "python", "-Dscript=resume.py", f"-DcheckpointDir={tmp_path / 'ckpt'}"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job_id = proc.stdout.readline()[5:].strip()
        assert wait_until(lambda: ckpt.exists() and int(ckpt.read_text() or 0) >= 5, timeout=30)
        assert pai("kill", job_id).returncode == 0
    finally:
        proc.kill()
        proc.wait()
    assert pai("resume", "nosuchjob").returncode == 2
    # from another folder: the resumed job runs where the first one did
    resumed = pai("resume", job_id, "-DjobName=again", cwd=str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr
    assert f"Resumes {job_id}" in resumed.stdout
    first = int(resumed.stdout.split("first step ", 1)[1].split()[0])
    assert first >= 5 and ckpt.read_text() == "60"
    new_id = job_id_from(resumed.stdout)
    assert pai_json("status", new_id)["resumed_from"] == job_id
    assert pai_json("status", job_id)["resumed_by"] == [new_id]
    assert f"Resumed by {new_id}" in pai("status", job_id).stdout
    assert pai_json("list")[0]["name"] == "again"
    # and each logview job page says it
    from paicli.web import data

    assert f"Resumes {job_id}." in data.job_page(Store(), new_id)["notices"]
    assert f"Resumed by {new_id}." in data.job_page(Store(), job_id)["notices"]


def test_pai_resume_of_an_archive_job_continues_from_the_checkpoints_in_its_code_folder(pai_home, tmp_path):
    """An archive runs in the job's own code/ folder: -DcheckpointDir=ckpt is there,
    and the resumed job (a new code/ folder) must still start from it."""
    import tarfile

    from test_outputs_ssh import RESUMING

    (tmp_path / "resume.py").write_text(RESUMING.replace("range(start, 60)", "range(start, 25)"))
    with tarfile.open(tmp_path / "code.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "resume.py", arcname="resume.py")
    proc = subprocess.Popen([*PAI, "-name", "python", f"-Dscript={tmp_path / 'code.tar.gz'}", "-DentryFile=resume.py",
                             "-DcheckpointDir=ckpt"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        job_id = proc.stdout.readline()[5:].strip()
        ckpt = pai_home / "jobs" / job_id / "code" / "ckpt" / "step"
        assert wait_until(lambda: ckpt.exists() and int(ckpt.read_text() or 0) >= 5, timeout=30)
        assert pai("kill", job_id).returncode == 0
    finally:
        proc.kill()
        proc.wait()
    stopped_at = int(ckpt.read_text())
    resumed = pai("resume", job_id, cwd=str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr
    assert f"Resumes {job_id}" in resumed.stdout
    assert int(resumed.stdout.split("first step ", 1)[1].split()[0]) == stopped_at
    assert ckpt.read_text() == "25"
    new_id = job_id_from(resumed.stdout)
    assert pai_json("status", new_id)["resumed_from"] == job_id
    assert pai_json("status", job_id)["resumed_by"] == [new_id]


def test_the_logview_lists_outputs_with_download_links_behind_the_token(tmp_path, store_kind):
    import asyncio
    import threading
    import urllib.error
    import urllib.request

    pytest.importorskip("aiohttp")
    from aiohttp import web

    from paicli.web import server

    store = Store(tmp_path)
    store.create_job("j1", name="n", framework="python", project=None, task_name="T", job_dir=tmp_path,
                     roles=[{"name": "worker", "count": 1, "must_finish": True}])
    (tmp_path / "model.h5").write_bytes(b"weights")
    (tmp_path / "secret").write_text("not an output")
    odd = ['say "hi".txt', "two\nlines\r.txt", "naïve;x=1.bin"]   # named on the download as they are
    for name in odd:
        (tmp_path / name).write_text(name)
    store.add_outputs([("j1", "worker:0", str(tmp_path / "model.h5"), 7, 0, None, "here", "local", None, None),
                       ("j1", "worker:1", "/far/<b>x</b>", 9, 0, None, "node", "h3", "/tmp/j1/x", "disk full")]
                      + [("j1", "worker:0", str(tmp_path / n), 1, 0, None, "here", "local", None, None) for n in odd])
    disposition = {}

    def get(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as response:
                disposition[path] = response.headers["Content-Disposition"]
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.make_app(tmp_path, "tok"))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        code, page = get("/api/jobs/j1/outputs?token=tok")
        assert code == 200 and b"still on node h3 at /tmp/j1/x (disk full)" in page
        assert b"&lt;b&gt;x&lt;/b&gt;" in page and b"<b>x</b>" not in page
        link = f"/api/jobs/j1/file?instance=worker%3A0&path={urllib.parse.quote(str(tmp_path / 'model.h5'))}"
        assert link.encode() in page.replace(b"&amp;", b"&")
        assert get(link + "&token=tok") == (200, b"weights")
        assert get(link)[0] == 403
        other = f"/api/jobs/j1/file?instance=worker%3A0&path={urllib.parse.quote(str(tmp_path / 'secret'))}&token=tok"
        assert get(other)[0] == 404
        for name in odd:
            link = f"/api/jobs/j1/file?instance=worker%3A0&path={urllib.parse.quote(str(tmp_path / name))}&token=tok"
            assert get(link) == (200, name.encode())
            header = email.message.Message()
            header["Content-Disposition"] = disposition[link]
            params = header.get_params(header="Content-Disposition")
            assert params[0][0] == "attachment"   # filename* (RFC 6266's choice) is the name; filename a plain stand-in
            assert [email.utils.collapse_rfc2231_value(v) for k, v in params if isinstance(v, tuple)] == [name]
            assert header.get_filename().isprintable() and '"' not in header.get_filename()
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_a_timed_out_job_still_records_its_files(pai_home, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    result = subprocess.run([*PAI, "-name", "python", "-Dscript=train.py", f"-DcheckpointDir={tmp_path / 'ckpt'}",
                             "-Dtimeout=3", "-DuserDefinedParameters=--hang"], cwd=work, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "timeout" in result.stdout
    listed = pai_json("outputs", job_id_from(result.stdout))
    assert {os.path.basename(f["path"]) for f in listed["files"]} == {"model-0.txt", "ckpt-0", "out.txt", "same.txt"}


def test_a_shared_checkpoint_folder_is_neither_staged_nor_watched_nor_translated(tmp_path):
    from paicli.cluster import node_files, remote_paths
    from paicli.jobplan import JobPlan, RolePlan

    job_dir, shared, mine = tmp_path / "job", tmp_path / "nfs", tmp_path / "ckpt"
    job_dir.mkdir()
    for folder in (shared, mine):
        folder.mkdir()
        (folder / "step-1").write_text("ckpt")
    plan = JobPlan(job_name="j", framework="python", task_name="T",
                   roles=[RolePlan("worker", 1, ["python3", "t.py"], cwd=str(tmp_path / "work"))])
    for ckpt, staged in ((shared, False), (mine, True)):
        (job_dir / "spec.json").write_text(json.dumps({"name": "python", "checkpoint_dir": str(ckpt)}))
        (job_dir / "nodes.json").write_text(json.dumps({"backend": "ssh", "shared": [str(shared)]}))
        manifest = node_files.manifest(job_dir, plan)
        dst = f"files{ckpt}/step-1"
        assert (dst in [f.dst for f in manifest.files]) is staged
        mapping = manifest.mapping("/tmp/paicli-u/j", "/rt", "/usr/bin/python3")
        assert (remote_paths.translate(f"--checkpointDir={ckpt}", mapping) != f"--checkpointDir={ckpt}") is staged
        watch = outputs.JobOutputs(Recorder(), "j", job_dir, print).prepare("worker:0", "worker", 0, "h1",
                                                                             str(tmp_path / "work"), {})
        assert ("ckpt" in dict(watch.watch["dirs"])) is staged


def test_the_link_decodes_file_frames_split_anywhere(tmp_path):
    """Output, file frames and the exit status in one stream, fed in slices of every
    size (a byte at a time included): the same output, the same file, the status."""
    import random

    from paicli.cluster.agent_link import Link

    src = tmp_path / "node"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(300_000))
    frames = [(b"O", b"line one\n"), *node_outputs.file_frames({"dirs": [["out", str(src)]]}, {}, None),
              (b"O", b"line two\n"), (b"X", b'{"status": 0}')]
    stream = b"".join(k + len(p).to_bytes(4, "big") + p for k, p in frames)
    for sizes in ((1, 2, 4096), (5, 7, 3000), (65536, 1 << 20), (3, 300_000)):
        dest = tmp_path / f"here-{sizes[0]}"
        (tmp_path / "job").mkdir(exist_ok=True)
        (tmp_path / "job" / "nodes.json").write_text('{"backend": "ssh"}')
        job = outputs.JobOutputs(Recorder(), "j", tmp_path / "job", print)
        inst = outputs.InstanceOutputs(job, "w:0", "h", {"out": str(dest)}, {"dirs": []})
        link = Link(None, "h")
        link.sink = inst.sink
        out, pos, rng = b"", 0, random.Random(sizes[0])
        while pos < len(stream):
            step = rng.choice(sizes)
            out += link.feed(stream[pos:pos + step])
            pos += step
        assert out == b"line one\nline two\n" and link.status == 0 and inst.complete
        assert (dest / "model.bin").read_bytes() == (src / "model.bin").read_bytes()


def test_files_listed_in_place_are_recorded_as_their_f_and_s_frames_would_be(tmp_path):
    """An L frame (this machine's files, already where they belong): each entry is
    recorded with its digest; a path outside the watched folder is refused (the job
    fails), one that
    changed while it was read waits for the next pass; Z still ends the pass."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.h5").write_text("weights")
    (work / "run.log").write_text("x")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "nodes.json").write_text('{"backend": "local"}')
    lines: list = []
    store = Recorder()
    job = outputs.JobOutputs(store, "j1", tmp_path / "job", lines.append)
    inst = outputs.InstanceOutputs(job, "worker:0", "local", {"cwd": str(work)},
                                   {"dirs": [["cwd", str(work)]], "inplace": True})
    watch = {"dirs": [["cwd", str(work)]], "inplace": True}
    for kind, payload in node_outputs.file_frames(watch, {}, None):
        inst.sink(kind, payload)
    inst.sink(b"L", json.dumps([["cwd", "../escape", 1, 1, "crc32:00000000", None, False],
                                ["cwd", "gone.tmp", 1, 1, None, "it changed while it was being sent", True]]).encode())
    job.flush()
    rows = {row[2]: row for row in store.rows}
    assert set(rows) == {str(work / "model.h5"), str(work / "run.log")}, rows
    assert rows[str(work / "model.h5")][5].startswith("crc32:") and rows[str(work / "model.h5")][6] == "here"
    assert "'../escape'" in job.hostile and inst.complete and inst.received == 4


def test_a_collect_stream_cut_mid_file_leaves_no_partial_copy(tmp_path):
    """The agent's `collect` (a dead master's watchdog, `pai get`) whose stream ends
    in the middle of a file, without an error: the copy under way is removed, and the
    instance's files are said to be still on its node."""
    src, work = tmp_path / "node", tmp_path / "work"
    src.mkdir()
    (src / "same.txt").write_bytes(b"x" * 300_000)
    frames = node_outputs.file_frames({"dirs": [["cwd", str(src)]]}, {}, None)
    cut = b"".join(k + len(p).to_bytes(4, "big") + p for k, p in [next(frames), next(frames)])   # F, one D

    class Cut:
        def collect_outputs(self, *args, **kwargs):
            yield cut

    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "nodes.json").write_text('{"backend": "ssh"}')
    job = outputs.JobOutputs(Recorder(), "j1", tmp_path / "job", print)
    inst = outputs.InstanceOutputs(job, "worker:0", "h2", {"cwd": str(work)}, {"dirs": [["cwd", str(work)]]})
    job.attempts.append(inst)
    job.collect(Cut(), [inst])
    assert work.is_dir() and not list(work.iterdir())
    assert job._rows[-1][2] == "*" and job._rows[-1][6] == "node"
