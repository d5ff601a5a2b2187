"""The one staging rule (cluster/node_files.py): what a node needs for a job and how
its paths map there. Pure: real adapters plan real statements into a job folder,
nothing is started. tests/test_multihost.py checks SSH writes exactly this list on a
real node; the Ray tests check the same for Ray."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from paicli.client import prepare
from paicli.cluster import node_files, remote_paths, workdir
from paicli.staging import stage_code
from paicli.statement import parse_statement

FOLDER = "/node/work/job1"


def planned(tmp_path: Path, monkeypatch, *statement: str):
    """(job folder, plan) for a statement submitted from tmp_path/proj."""
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    monkeypatch.chdir(proj)
    prepared = prepare(parse_statement(list(statement)))
    job_dir = tmp_path / "home" / "jobs" / "job1"
    job_dir.mkdir(parents=True)
    code = stage_code(prepared.spec, job_dir)
    plan = prepared.adapter.plan(prepared.spec, code)
    for name in ("plan.json", "spec.json", "nodes.json", "placement.json", "master.log", "job.log",
                 "summary.txt"):
        (job_dir / name).write_text("{}")
    (job_dir / "logs").mkdir()
    (job_dir / "logs" / "worker-0.0.log").write_text("x")
    return job_dir, plan


def dsts(manifest) -> dict[str, node_files.NodeFile]:
    return {f.dst: f for f in manifest.files}


def translated(plan, manifest, role: str = "worker") -> list[str]:
    mapping = manifest.mapping(FOLDER, "/node/rt", "/usr/bin/python3")
    return remote_paths.translate_argv(plan.role(role).argv, mapping)


def assert_runners_and_no_master_files(files: dict) -> None:
    assert {f"runners/{p.name}" for p in node_files.RUNNERS_DIR.glob("*.py")} <= set(files)
    for dst in files:
        # secrets (plan.json/spec.json) and the master's own files never travel
        assert dst.split("/")[0] not in ("plan.json", "spec.json", "nodes.json", "placement.json", "logs",
                                         "master.log", "job.log", "summary.txt"), dst


def test_a_plain_script_stages_the_script_it_names_and_nothing_guessed_from_argv(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "x").write_text("an existing file named in argv, not an input")
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "sub" / "train.py").write_text("print(1)\n")
    (proj / "notes.txt").write_text("under the working folder, not named")
    job_dir, plan = planned(tmp_path, monkeypatch, "-name", "python", f"-Dscript={proj / 'sub' / 'train.py'}",
                            f"-DuserDefinedParameters=--out {data / 'x'} --notes {proj / 'notes.txt'}")
    assert plan.inputs == [str(proj / "sub" / "train.py")]
    manifest = node_files.manifest(job_dir, plan)
    files = dsts(manifest)
    assert_runners_and_no_master_files(files)
    assert files["code/sub/train.py"].src == str(proj / "sub" / "train.py")
    assert files["code/sub/train.py"].mode == 0o600
    assert files["code"].kind == "dir"
    assert not any(f.src in (str(data / "x"), str(proj / "notes.txt")) for f in manifest.files)
    argv = translated(plan, manifest)
    assert argv[:3] == ["/usr/bin/python3", "-u", f"{FOLDER}/code/sub/train.py"]
    # what is not staged reaches the script as it is, even below the working folder
    assert argv[3:] == ["--out", str(data / "x"), "--notes", str(proj / "notes.txt")]
    mapping = manifest.mapping(FOLDER, "/node/rt", "/usr/bin/python3")
    assert remote_paths.translate(plan.role("worker").cwd, mapping) == f"{FOLDER}/code"
    assert remote_paths.translate(str(job_dir), mapping) == FOLDER          # PAI_JOB_DIR


def test_a_script_outside_the_working_folder_keeps_its_absolute_place(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "train.py").write_text("print(1)\n")
    job_dir, plan = planned(tmp_path, monkeypatch, "-name", "python", f"-Dscript={elsewhere / 'train.py'}")
    manifest = node_files.manifest(job_dir, plan)
    dst = f"files{elsewhere}/train.py"
    assert dsts(manifest)[dst].src == str(elsewhere / "train.py")
    assert translated(plan, manifest)[2] == f"{FOLDER}/{dst}"


def test_an_archive_travels_whole_with_its_inner_links_and_names_no_inputs(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("import pkg\n")
    (src / "pkg" / "__init__.py").write_text("")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    (src / "empty").mkdir()
    os.symlink("train.py", src / "alias.py")
    archive = tmp_path / "code.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=".")
    job_dir, plan = planned(tmp_path, monkeypatch, "-name", "python", f"-Dscript={archive}",
                            "-DentryFile=train.py")
    assert plan.inputs == []
    manifest = node_files.manifest(job_dir, plan)
    files = dsts(manifest)
    assert_runners_and_no_master_files(files)
    assert files["code/train.py"].mode == 0o600 and files["code/run.sh"].mode == 0o700
    assert files["code/empty"].kind == "dir" and files["code/pkg"].kind == "dir"
    assert files["code/alias.py"].kind == "link" and files["code/alias.py"].target == "train.py"
    order = [f.dst for f in manifest.files]
    assert order.index("code/pkg") < order.index("code/pkg/__init__.py")   # folders first
    assert translated(plan, manifest)[2] == f"{FOLDER}/code/train.py"


def test_a_caffe_solver_job_stages_solver_net_and_weights_but_not_its_secret(tmp_path, monkeypatch):
    models = tmp_path / "models"
    (models / "examples" / "mnist").mkdir(parents=True)
    solver = models / "examples" / "mnist" / "solver.prototxt"
    solver.write_text('net: "examples/mnist/net.prototxt"\nmax_iter: 10\n')
    (models / "examples" / "mnist" / "net.prototxt").write_text('name: "x"\n')
    weights = tmp_path / "w.caffemodel"
    weights.write_bytes(b"\0")
    job_dir, plan = planned(tmp_path, monkeypatch, "-name", "caffe", f"-Dsolver={solver}",
                            f"-Dweights={weights}", '-Dcluster={"ps":{"count":1},"worker":{"count":2}}')
    assert plan.role("ps").env["PAI_CAFFE_SECRET"]
    assert plan.inputs == [str(solver), str(models / "examples" / "mnist" / "net.prototxt"), str(weights)]
    manifest = node_files.manifest(job_dir, plan)
    files = dsts(manifest)
    assert_runners_and_no_master_files(files)
    # solver and net keep their places relative to each other (the runner finds the net from the solver)
    assert f"files{solver}" in files and f"files{models}/examples/mnist/net.prototxt" in files
    argv = translated(plan, manifest)
    assert argv[argv.index("--solver") + 1] == f"{FOLDER}/files{solver}"
    assert argv[argv.index("--weights") + 1] == f"{FOLDER}/files{weights}"
    assert not any(plan.role("ps").env["PAI_CAFFE_SECRET"] in Path(f.src).read_text(errors="replace")
                   for f in manifest.files if f.kind == "file" and not f.dst.startswith("runners/"))


@pytest.mark.parametrize("archive", [False, True])
def test_every_staged_path_translates_to_its_copy_on_the_node(tmp_path, monkeypatch, archive):
    """So that argv, env and cwd naming a staged file or folder find it there."""
    script = tmp_path / "proj" / "sub" / "train.py"
    script.parent.mkdir(parents=True)
    script.write_text("print(1)\n")
    (script.parent / "helper.py").write_text("")
    if archive:
        packed = tmp_path / "code.tgz"
        with tarfile.open(packed, "w:gz") as tar:
            tar.add(script.parent, arcname=".")
        statement = (f"-Dscript={packed}", "-DentryFile=train.py")
    else:
        statement = (f"-Dscript={script}",)
    job_dir, plan = planned(tmp_path, monkeypatch, "-name", "python", *statement)
    manifest = node_files.manifest(job_dir, plan)
    mapping = manifest.mapping(FOLDER, "/node/rt", "/usr/bin/python3")
    for f in manifest.files:
        assert remote_paths.translate(f.src, mapping) == f"{FOLDER}/{f.dst}", f
    assert remote_paths.translate(plan.role("worker").cwd, mapping) == f"{FOLDER}/code"


@pytest.mark.parametrize("value,expected", [
    ("/w/proj", "/n/code"),             # the working folder itself
    ("/w/proj/train.py", "/n/code/train.py"),
    ("/w/proj/out/x", "/w/proj/out/x"),  # below it but not staged: unchanged
    ("--dir=/w/proj", "--dir=/n/code"),
    ("/r/runners/x.py", "/n/runners/x.py"),
])
def test_exact_entries_translate_only_themselves(value, expected):
    mapping = remote_paths.normalise([(remote_paths.Exact("/w/proj"), "/n/code"),
                                      (remote_paths.Exact("/w/proj/train.py"), "/n/code/train.py"),
                                      ("/r/runners", "/n/runners")])
    assert remote_paths.translate(value, mapping) == expected


@pytest.mark.parametrize("framework, cluster", [
    ("python", '{"worker":{"count":1}}'),
    ("tensorflow", '{"ps":{"count":1},"worker":{"count":1}}'),
    ("mxnet", '{"server":{"count":1},"worker":{"count":1}}'),
    ("caffe", '{"worker":{"count":1}}'),
])
def test_every_adapter_names_a_plain_script_as_its_input(tmp_path, monkeypatch, framework, cluster):
    script = tmp_path / "proj" / "train.py"
    script.parent.mkdir()
    script.write_text("print(1)\n")
    _job_dir, plan = planned(tmp_path, monkeypatch, "-name", framework, f"-Dscript={script}", f"-Dcluster={cluster}")
    assert plan.inputs == [str(script)]


# -- the writer for nodes without SFTP (runners/stage_writer.py), run here as on a node


def run_writer(root: Path, folder: Path, members) -> tuple[int, str]:
    import io
    import subprocess
    import sys

    from paicli.cluster.ssh_transport import writer_argv

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size, info.mode = len(extra), 0o755
                tar.addfile(info, io.BytesIO(extra))
            elif kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, extra
                tar.addfile(info)
            else:
                info.type = {"dir": tarfile.DIRTYPE, "fifo": tarfile.FIFOTYPE}[kind]
                tar.addfile(info)
    proc = subprocess.run(writer_argv(sys.executable, str(root), str(folder)), input=buf.getvalue(),
                          capture_output=True, timeout=60)
    return proc.returncode, proc.stderr.decode()


def test_the_exec_writer_writes_private_files_and_inner_links(tmp_path):
    root = tmp_path / "root"
    status, err = run_writer(root, root / "job1", [("runners/a.py", "file", b"x"), ("code/d", "dir", None),
                                                   ("code/d/l", "link", "../../runners/a.py")])
    assert status == 0, err
    assert oct(root.stat().st_mode & 0o777) == "0o700" and oct((root / "job1").stat().st_mode & 0o777) == "0o700"
    assert oct((root / "job1" / "runners" / "a.py").stat().st_mode & 0o777) == "0o700"   # its x bit kept
    assert (root / "job1" / "code" / "d" / "l").read_text() == "x"


@pytest.mark.parametrize("members, words", [
    ([("../escape", "file", b"x")], "not a plain relative path"),
    ([("/etc/x", "file", b"x")], "not a plain relative path"),
    ([("l", "link", "/etc/passwd")], "leaves the folder"),
    ([("a/l", "link", "../../x")], "leaves the folder"),
    ([("p", "fifo", None)], "neither a file"),
])
def test_the_exec_writer_refuses_what_would_leave_the_folder(tmp_path, members, words):
    status, err = run_writer(tmp_path / "root", tmp_path / "root" / "job1", members)
    assert status == 1 and words in err.strip().splitlines()[-1], err
    assert not (tmp_path / "escape").exists()


def test_the_exec_writer_refuses_a_root_others_could_write_to(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o777)
    status, err = run_writer(root, root / "job1", [("a", "file", b"x")])
    assert status == 1 and err.strip().splitlines()[-1].startswith(f"refused: the per-job folder root {root} is "
                                                                     "writable by others")
    assert list(root.iterdir()) == []


def test_the_exec_writer_resolves_a_chain_of_links_before_it_writes(tmp_path):
    """Each link looks inside on its own (`sub/l2 -> ..`, `sub/l3 -> l2/..`), yet the
    second resolves above the folder: the writer resolves what is on disk."""
    root = tmp_path / "root"
    status, err = run_writer(root, root / "job1", [("sub", "dir", None), ("sub/l2", "link", ".."),
                                                   ("sub/l3", "link", "l2/.."), ("sub/l3/escape", "file", b"x")])
    assert status == 1 and "leaves the folder" in err.strip().splitlines()[-1], err
    assert not (root / "escape").exists()


def test_only_what_the_project_folder_sent_maps_below_it(tmp_path, monkeypatch):
    """Paths below the project folder map to `code/` on the node, but those it left
    out (ignored, never sent, links out), which stay as they are; a project folder
    under a `shared:` path is neither sent nor mapped."""
    proj = tmp_path / "proj"
    for rel, text in (("train.py", "print(1)\n"), (".gitignore", "data/\n*.log\n"), ("data/big.csv", "1"),
                      ("conf/p.yaml", "a: 1"), ("run.log", "x")):
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(text)
    job_dir, plan = planned(tmp_path, monkeypatch, "-name", "python", "-Dscript=train.py",
                            f"-DuserDefinedParameters=--data={proj}/data/big.csv --conf {proj}/conf/p.yaml "
                            f"--log {proj}/run.log --out {proj}/out/model.ckpt")
    workdir.record(job_dir, workdir.listing(str(proj)))
    assert translated(plan, node_files.manifest(job_dir, plan))[3:] == [
        f"--data={proj}/data/big.csv", "--conf", f"{FOLDER}/code/conf/p.yaml", "--log", f"{proj}/run.log",
        "--out", f"{FOLDER}/code/out/model.ckpt"]
    (job_dir / "nodes.json").write_text(json.dumps({"nodes": [{"name": "h1", "host": "h1"}],
                                                    "shared": [str(tmp_path)]}))
    manifest = node_files.manifest(job_dir, plan)
    assert translated(plan, manifest)[3:] == plan.role("worker").argv[3:]
    mapping = manifest.mapping(FOLDER, "/node/rt", "/usr/bin/python3")
    assert remote_paths.translate(plan.role("worker").cwd, mapping) == plan.role("worker").cwd
    assert workdir.stage(None, job_dir, print) == {}
