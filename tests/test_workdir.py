"""The project folder (-DworkDir): what is sent, the size limit, links, the hint."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from conftest import pai
from paicli.errors import PaiError, SpecError
from paicli import staging
from paicli.cluster import workdir
from paicli.spec import JobSpec


def write(root, rel, data="x", mode=0o600):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data)
    path.chmod(mode)
    return path


def sent(root, **kw):
    return [f[0] for f in workdir.listing(str(root), **kw).files]


def test_ignore_files_decide_what_is_sent(tmp_path):
    write(tmp_path, "train.py", mode=0o700)
    write(tmp_path, "data.csv")
    write(tmp_path, "big.csv")
    write(tmp_path, "conf/params.yaml")
    write(tmp_path, "logs/run.log")
    write(tmp_path, ".gitignore", "# data\n*.csv\n\nlogs/\n")
    write(tmp_path, ".paiignore", "!data.csv\n")
    write(tmp_path, "cache/.gitignore", "*\n!.gitignore\n")
    write(tmp_path, "cache/blob.bin")
    assert sent(tmp_path) == [".gitignore", ".paiignore", "cache/.gitignore", "conf/params.yaml", "data.csv",
                              "train.py"]
    modes = {rel: mode for rel, _size, mode, _t in workdir.listing(str(tmp_path)).files}
    assert modes["train.py"] == 0o700 and modes["data.csv"] == 0o600


def test_git_caches_and_virtual_environments_never_travel(tmp_path):
    write(tmp_path, "train.py")
    write(tmp_path, ".git/HEAD")
    write(tmp_path, "pkg/__pycache__/m.cpython-311.pyc")
    write(tmp_path, "pkg/m.py")
    write(tmp_path, "env/pyvenv.cfg")
    write(tmp_path, "env/lib/site.py")
    write(tmp_path, "conda/conda-meta/history")
    assert sent(tmp_path) == ["pkg/m.py", "train.py"]
    assert workdir.why_left_out(str(tmp_path), "env/lib/site.py") == "env/ (a virtual environment, never sent)"
    assert workdir.why_left_out(str(tmp_path), ".git/HEAD") == ".git/ (never sent)"


def test_the_jobs_store_inside_the_folder_is_never_sent(tmp_path):
    write(tmp_path, "train.py")
    write(tmp_path, ".pai/jobs/j1/plan.json", "a secret")
    assert sent(tmp_path, skip=(str(tmp_path / ".pai"),)) == ["train.py"]


def test_links_out_of_the_folder_are_never_followed(tmp_path):
    project, outside = tmp_path / "p", tmp_path / "secret"
    write(outside, "key", "private")
    write(project, "train.py")
    write(project, "data/a.csv")
    os.symlink(outside / "key", project / "key")            # a file outside
    os.symlink("../secret", project / "more")                # a folder outside, relative
    os.symlink("data/a.csv", project / "a.csv")              # inside: sent as a link
    os.symlink(str(project / "train.py"), project / "abs.py")   # inside but absolute: would break there
    os.symlink("../../p/train.py", project / "data" / "t.py")     # out and back in: sent by its way inside
    files = workdir.listing(str(project)).files
    assert [f[0] for f in files] == ["a.csv", "data/a.csv", "data/t.py", "train.py"]
    assert files[0][3] == "data/a.csv" and files[2][3] == "../train.py"
    assert workdir.why_left_out(str(project), "more/key") == "more is a link out of the folder (never followed)"


def test_the_limit_stops_the_listing_and_names_the_biggest(tmp_path):
    write(tmp_path, "train.py", "x" * 10)
    write(tmp_path, "data/a.bin", "x" * 600)
    write(tmp_path, "data/b.bin", "x" * 600)
    write(tmp_path, "model.ckpt", "x" * 400)
    write(tmp_path, "notes.txt", "x" * 50)
    whole = workdir.listing(str(tmp_path), limit=1000)
    assert whole.over and whole.total == 1660
    assert whole.biggest() == [("data/", 1200), ("model.ckpt", 400), ("notes.txt", 50)]
    partial = workdir.listing(str(tmp_path), limit=1000, stop_over=True)
    assert partial.over and [f[0] for f in partial.files] == ["data/a.bin", "data/b.bin"]
    assert not workdir.listing(str(tmp_path), limit=2000).over


def test_why_a_file_was_left_out_names_the_rule(tmp_path):
    write(tmp_path, ".gitignore", "# outputs\n!\n*.csv\n")   # a lone `!` is no pattern: git passes over it
    write(tmp_path, "sub/.paiignore", "raw/\n")
    write(tmp_path, "data.csv")
    write(tmp_path, "sub/raw/x.txt")
    write(tmp_path, "train.py")
    assert workdir.why_left_out(str(tmp_path), "data.csv") == ".gitignore line 3: *.csv"
    assert workdir.why_left_out(str(tmp_path), "./sub/raw/x.txt") == "sub/.paiignore line 1: raw/"
    assert workdir.why_left_out(str(tmp_path), "train.py") is None
    assert workdir.why_left_out(str(tmp_path), "absent.csv") is None
    assert workdir.why_left_out(str(tmp_path), "../data.csv") is None


def test_the_hint_names_the_rule_for_a_missing_relative_file(tmp_path):
    project, job = tmp_path / "p", tmp_path / "job"
    job.mkdir()
    write(project, ".gitignore", "*.csv\n")
    write(project, "data.csv")
    write(project, "train.py")
    workdir.record(job, workdir.listing(str(project)))
    tail = ["Traceback (most recent call last):", "  File \"train.py\", line 3, in <module>",
            "FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'"]
    assert workdir.hint(job, tail) == (f"data.csv is in {project} but not sent to the nodes: .gitignore line 1: "
                                       "*.csv (a `!` line in .paiignore sends it)")
    caffe = ["F1203 db_leveldb.cpp:16] Check failed: status.ok() Failed to open leveldb examples/mnist.csv"]
    assert "examples/mnist.csv" not in (workdir.hint(job, caffe) or "")   # not in the folder: no hint
    assert workdir.hint(job, ["FileNotFoundError: 'train.py'"]) is None   # sent: something else is wrong
    assert workdir.hint(tmp_path, tail) is None                           # no folder sent


def test_an_explicit_folder_over_the_limit_is_refused_in_one_line_naming_the_biggest(tmp_path, pai_home):
    """Refused at submit (exit 2), before any node is reached: the nodes file names a
    host nobody answers on, and no job is left behind."""
    proj = tmp_path / "proj"
    write(proj, "train.py")
    write(proj, "data/a.bin", "x" * 3000)
    write(proj, "weights.h5", "x" * 2000)
    write(proj, "notes.md", "x" * 100)
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(json.dumps({"nodes": [{"name": "h1", "host": "192.0.2.1", "user": "nobody"}]}))
    write(proj, ".pai/jobs/old/logs/worker-0.log", "x" * 9000)   # the jobs' store, here: never sent
    result = pai("-name", "python", f"-Dscript={proj / 'train.py'}", f"-DworkDir={proj}", "-DworkDirMaxSize=4K",
                 env={"PAI_NODES": str(nodes), "PAI_HOME": str(proj / ".pai")}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"pai: error: -DworkDir: {proj} sends 5.1 KB, over -DworkDirMaxSize=4K; the biggest: data/ (3.0 KB), "
        "weights.h5 (2.0 KB), notes.md (100 bytes); list what stays here in .paiignore (gitignore syntax), "
        "or raise -DworkDirMaxSize"]
    assert [p.name for p in (proj / ".pai" / "jobs").iterdir()] == ["old"]


def test_the_folder_is_read_as_it_was_submitted_or_the_job_stops_naming_the_file(tmp_path):
    """Digests are taken at submit; staging reads each file without following a link
    and refuses one that is gone, is now a link or changed, so every node gets the
    submitted folder and nothing from outside it."""
    project, job = tmp_path / "p", tmp_path / "job"
    job.mkdir()
    for rel in ("train.log", "gone.txt", "key", "same.txt"):
        write(project, rel, "first")
    write(tmp_path, "outside", "first")
    workdir.record(job, workdir.listing(str(project)))
    digests = {f[0]: f[4] for f in json.loads((job / "workdir.json").read_text())["files"]}
    assert digests["train.log"] == hashlib.sha256(b"first").hexdigest()
    assert workdir._read(str(project), "same.txt", digests["same.txt"]) == b"first"
    (project / "train.log").write_text("second")
    (project / "gone.txt").unlink()
    (project / "key").unlink()
    os.symlink(tmp_path / "outside", project / "key")   # the same bytes, but from outside the folder
    for rel, why in (("train.log", "changed"), ("gone.txt", "is gone"), ("key", "is now a link")):
        with pytest.raises(PaiError, match=f"^workdir: {rel} {why} since the job was submitted; submit again"):
            workdir._read(str(project), rel, digests[rel])


def test_caffes_db_error_names_no_path_so_the_nets_sources_are_looked_up(tmp_path):
    project, job = tmp_path / "p", tmp_path / "job"
    job.mkdir()
    write(project, ".paiignore", "*_lmdb/\n")
    write(project, "examples/mnist/mnist_train_lmdb/data.mdb")
    net = write(project, "net.prototxt", 'layer { data_param { source: "examples/mnist/mnist_train_lmdb" } }')
    (job / "plan.json").write_text(json.dumps({"inputs": [str(net)]}))
    workdir.record(job, workdir.listing(str(project)))
    tail = ["F1203 db_lmdb.hpp:15] Check failed: mdb_status == 0 (2 vs. 0) No such file or directory"]
    assert workdir.hint(job, tail) == (f"examples/mnist/mnist_train_lmdb is in {project} but not sent to the nodes: "
                                       ".paiignore line 1: *_lmdb/ (a `!` line in .paiignore sends it)")


def default_folder(cwd, monkeypatch, tmp_path, **params):
    """What work_dir picks, and its notes, for `pai -Dscript=train.py` run in `cwd`
    toward other nodes."""
    monkeypatch.chdir(cwd)
    staging_dir, notes = tmp_path / "staging", []
    staging_dir.mkdir(exist_ok=True)
    spec = JobSpec(framework="python", params={"script": "train.py", "workDirMaxSize": "100M", **params})
    return staging.work_dir(spec, staging_dir, True, notes.append), notes


def test_home_or_a_folder_above_it_is_never_the_default_project_folder(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    write(home, "train.py")
    write(home, ".ssh/id_ed25519", "private")
    monkeypatch.setenv("HOME", str(home))
    for cwd in (home, home.parent, tmp_path):
        assert default_folder(cwd, monkeypatch, tmp_path) == (None, [
            f"workdir: {cwd} is your home folder or above it; only the script and its imports travel "
            "(set -DworkDir, or list what stays here in .paiignore)"])
    assert default_folder(home, monkeypatch, tmp_path, workDir=str(home))[0] == str(home)   # named: sent


def test_secrets_stay_here_unless_paiignore_names_them(tmp_path):
    for rel in (".ssh/id_ed25519", ".aws/credentials", ".netrc", ".bash_history", "certs/server.pem",
                "keys/id_rsa", ".env", "conf/.docker/config.json", "train.py"):
        write(tmp_path, rel)
    write(tmp_path, ".gitignore", "!*.pem\n")   # git's `!` lines do not send a secret
    assert sent(tmp_path) == [".gitignore", "train.py"]
    assert workdir.why_left_out(str(tmp_path), "keys/id_rsa") == "id_rsa (a secret's usual place, never sent)"
    write(tmp_path, ".paiignore", "!.env\n")
    assert sent(tmp_path) == [".env", ".gitignore", ".paiignore", "train.py"]


def test_a_default_folder_that_cannot_be_read_falls_back_to_the_script(tmp_path, monkeypatch):
    """A folder below the default one that cannot be listed (here: deeper than a path
    may be long, as root reads any folder a mode would close) is no reason to refuse
    a submit that named no folder; a named one is refused."""
    proj = tmp_path / "proj"
    write(proj, "train.py")
    fd = os.open(proj, os.O_RDONLY)
    for _ in range(20):
        os.mkdir("d" * 250, dir_fd=fd)
        fd, old = os.open("d" * 250, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    folder, notes = default_folder(proj, monkeypatch, tmp_path)
    assert folder is None and len(notes) == 1
    assert notes[0].startswith(f"workdir: {proj} cannot be read (") and notes[0].endswith(
        "); only the script and its imports travel (set -DworkDir, or list what stays here in .paiignore)")
    with pytest.raises(SpecError, match=r"-DworkDir: .*: cannot be read: "):
        default_folder(proj, monkeypatch, tmp_path, workDir=str(proj))
