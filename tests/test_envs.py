"""A job's own environment (issue 18): `-Denv` / YAML `env:` on every instance with
secret-looking values masked, and `-Drequirements` as a layer on the runtime, built
once and reused. Pure logic first, then real jobs on this machine (the SSH and Ray
ones are in tests/test_envs_nodes.py).

Hermetic: the package a job needs is a tiny wheel this file builds itself, found
through `--no-index --find-links DIR`; nothing is fetched from an index.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from conftest import pai, pai_json

from paicli.envvars import MASK, Masker, looks_secret, parse_env, secret_values
from paicli.requirements import parse_requirements
from paicli.runners.runtimes import pip_one_line

SECRET = "s3cr3t-value-0123456789"


def make_wheel(folder: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel (py3-none-any) of one module package, written by hand."""
    dist = f"{name}-{version}"
    files = {f"{name}/__init__.py": source,
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: paicli-tests\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record + [f"{dist}.dist-info/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return out


def wheelhouse(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    make_wheel(folder, "paienvtiny", "1.0", "VALUE = 42\n")
    return folder


# -- pure logic -------------------------------------------------------------------


def test_env_from_text_yaml_and_the_shell():
    assert parse_env("A=1,B=x\\,y,C=", shell={}) == {"A": "1", "B": "x,y", "C": ""}
    assert parse_env({"A": 1, "HF_TOKEN": None}, shell={"HF_TOKEN": "t"}) == {"A": "1", "HF_TOKEN": "t"}
    assert parse_env("HF_TOKEN,A=b=c", shell={"HF_TOKEN": "t"}) == {"HF_TOKEN": "t", "A": "b=c"}
    for bad, words in [("1A=2", "not a variable name"), ("PAI_ROLE=x", "set by paicli"),
                       ("A=1,A=2", "given twice"), ("NOPE", "not set in your shell"), ("", "got nothing"),
                       ({"A": [1]}, "expected a text value")]:
        with pytest.raises(ValueError, match=words):
            parse_env(bad, shell={})


def test_what_looks_secret():
    assert all(looks_secret(n) for n in ("HF_TOKEN", "aws_secret_access_key", "DB_PASSWORD", "API_KEY"))
    assert not any(looks_secret(n) for n in ("FOO", "PATH", "TOKE"))


def test_the_masker_hides_a_secret_split_across_reads():
    masker = Masker([SECRET, "abc"])      # too short to mask: left alone
    stream = f"x={SECRET}\nabc {SECRET[:5]}".encode()
    out = b"".join(masker.feed(stream[i:i + 3]) for i in range(0, len(stream), 3))
    out += masker.feed(SECRET[5:].encode() + b" end\n") + masker.flush()
    assert out == f"x={MASK}\nabc {MASK} end\n".encode()
    held = Masker([SECRET])
    assert held.feed(SECRET[:4].encode()) == b"" and held.flush() == SECRET[:4].encode()   # not a secret after all


def test_secret_values_come_from_every_role():
    from paicli.jobplan import JobPlan, RolePlan

    plan = JobPlan("j", "python", "T", [RolePlan("worker", 1, ["x"], env={"MY_TOKEN": SECRET, "FOO": "bar"})])
    assert secret_values(plan) == [SECRET]


def test_requirements_are_normalised_and_what_would_not_travel_is_refused(tmp_path):
    links = wheelhouse(tmp_path)
    req = tmp_path / "requirements.txt"
    req.write_text(f"# ours\n--no-index\n-f {links.name}\npaienvtiny  ==1.0  # pinned\n\nrequests[socks]>=2\n")
    assert parse_requirements(f"file://{req}", tmp_path) == [
        "--no-index", f"--find-links {links}", "paienvtiny ==1.0", "requests[socks]>=2"]
    assert parse_requirements(["pandas"], tmp_path) == ["pandas"]
    for lines, words in [(["-r other.txt"], "only these pip options"), (["-e ."], "only these pip options"),
                         (["./pkg"], "not a requirement"), (["--no-index"], "no package"),
                         (["-f /nowhere/at/all", "x"], "not a folder"), ([3], "expected a requirement")]:
        with pytest.raises(ValueError, match=words):
            parse_requirements(lines, tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        parse_requirements("file:///no/such/requirements.txt", tmp_path)


def test_pip_one_line_names_the_package_and_the_reason():
    out = ("Looking in links: /w\nERROR: Could not find a version that satisfies the requirement nope==9 "
           "(from versions: none)\nERROR: No matching distribution found for nope==9\n")
    assert pip_one_line(out) == "Could not find a version that satisfies the requirement nope==9 (from versions: none)"
    conflict = ("ERROR: Cannot install numpy<2 because these package versions have conflicting dependencies.\n\n"
                "The conflict is caused by:\n    The user requested numpy<2\n"
                "    The user requested (constraint) numpy==2.4.0\n\nTo fix this you could try to:\n")
    assert pip_one_line(conflict) == ("Cannot install numpy<2 because these package versions have conflicting "
                                      "dependencies (The user requested numpy<2; the runtime has numpy==2.4.0)")


# -- real jobs on this machine ----------------------------------------------------------

SCRIPT = """\
import os, sys
import paienvtiny
print("FOO=%s TOKEN=%s VALUE=%s" % (os.environ.get("FOO"), os.environ.get("MY_TOKEN"), paienvtiny.VALUE))
print("the token again, split by nothing: " + os.environ["MY_TOKEN"], flush=True)
"""


def job_files(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "uses_tiny.py"
    script.write_text(SCRIPT)
    req = tmp_path / "requirements.txt"
    req.write_text(f"--no-index\n--find-links {wheelhouse(tmp_path)}\npaienvtiny\n")
    return script, req


def test_env_and_requirements_locally_then_the_layer_is_reused(pai_home, tmp_path):
    script, req = job_files(tmp_path)
    env = {"PAI_RUNTIME_DIR": str(tmp_path / "runtimes"), "MY_TOKEN": SECRET}
    first = pai("-name", "python", f"-Dscript={script}", f"-Drequirements=file://{req}",
                "-Denv=FOO=bar,MY_TOKEN", '-Dcluster={"worker":{"count":2}}', env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert first.stdout.count(f"FOO=bar TOKEN={MASK} VALUE=42") == 2
    assert "installing 1 package(s): paienvtiny==1.0" in first.stderr
    job_id = next(line[5:] for line in first.stdout.splitlines() if line.startswith("ID = "))
    job_dir = pai_home / "jobs" / job_id
    assert "paienvtiny" in (job_dir / "pip.log").read_text()   # pip's own output, kept with the job
    status = pai("status", job_id, "--json", env=env).stdout
    logs = pai("logs", job_id, env=env).stdout
    assert SECRET not in status and SECRET not in logs and MASK in logs
    for path in (job_dir / "logs").iterdir():
        assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET.encode() not in (job_dir / "job.log").read_bytes()

    layers = [r for r in pai_json("runtime", "list", env=env) if r.get("kind") == "layer"]
    assert len(layers) == 1 and layers[0]["installed_packages"] == ["paienvtiny==1.0"]
    second = pai("-name", "python", f"-Dscript={script}", f"-Drequirements=file://{req}",
                 "-Denv=MY_TOKEN=other-secret-value", env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "layer" not in second.stderr and "pip" not in second.stderr   # no pip run at all
    assert "VALUE=42" in second.stdout and "other-secret-value" not in second.stdout


def test_on_a_terminal_the_layer_build_is_a_bar_and_pip_says_nothing(pai_home, tmp_path):
    from conftest import PAI, run_on_pty

    script, req = job_files(tmp_path)
    env = dict(os.environ, PAI_RUNTIME_DIR=str(tmp_path / "runtimes"), MY_TOKEN=SECRET, PAI_LOGVIEW="file")
    code, out = run_on_pty([*PAI, "-name", "python", f"-Dscript={script}", f"-Drequirements={req}",
                            "-Denv=MY_TOKEN"], env)
    text = out.decode(errors="replace")
    assert code == 0, text[-2000:]
    assert "\r\x1b[2Kruntime: [" in text and " ready (1 package(s)" in text
    assert "Processing" not in text and "Successfully installed" not in text   # pip's own lines: in pip.log
    assert SECRET not in text and "VALUE=42" in text


def test_a_requirement_pip_cannot_satisfy_is_one_line_and_nothing_starts(pai_home, tmp_path):
    script, _ = job_files(tmp_path)
    req = tmp_path / "bad.txt"
    req.write_text(f"--no-index\n--find-links {wheelhouse(tmp_path)}\npaienvtiny\nno-such-package-paicli==9\n")
    result = pai("-name", "python", f"-Dscript={script}", f"-Drequirements={req}",
                 env={"PAI_RUNTIME_DIR": str(tmp_path / "runtimes")})
    assert result.returncode == 2
    error = [line for line in result.stderr.splitlines() if line.startswith("pai: error:")]
    assert len(error) == 1 and "no-such-package-paicli==9" in error[0] and "from versions: none" in error[0]
    log = Path(error[0].rsplit("pip's full log: ", 1)[1])
    assert "no-such-package-paicli" in log.read_text()
    assert pai_json("list") == []   # nothing recorded, nothing started
    assert not [p for p in (tmp_path / "runtimes" / "layers").iterdir() if p.is_dir()]   # no half-built layer


def test_env_reaches_every_role_of_a_yaml_job(pai_home, tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os; print('SEEN', os.environ['PAI_ROLE'], os.environ.get('GREETING'), "
                      "os.environ.get('DB_PASSWORD'))\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: python\nscript: {script}\ncluster: {{ps: {{count: 1}}, worker: {{count: 1}}}}\n"
                   "env:\n  GREETING: hello world\n  DB_PASSWORD: hunter2-long\n")
    result = pai("run", str(job))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SEEN worker hello world ***" in result.stdout
    assert "hunter2-long" not in result.stdout
    exported = pai("export", "-name", "python", f"-Dscript={script}", "-Denv=A=1")
    assert "env: {A: '1'}" in exported.stdout   # a job file `pai run` reads back as it was


def test_export_writes_a_bare_name_without_the_shells_value(pai_home, tmp_path):
    """The bare-name form keeps a token off the command line: the job file keeps it
    out too, and `pai run` takes it from the shell again."""
    script = tmp_path / "show.py"
    script.write_text("print('hi')\n")
    exported = pai("export", "-name", "python", f"-Dscript={script}", "-Denv=A=1,HF_TOKEN",
                   env={"HF_TOKEN": SECRET})
    assert exported.returncode == 0, exported.stderr
    assert SECRET not in exported.stdout
    assert "env: {A: '1', HF_TOKEN: null}" in exported.stdout
    job = tmp_path / "job.yaml"
    job.write_text(exported.stdout)
    again = pai("export", str(job), env={"HF_TOKEN": SECRET})
    assert again.stdout == exported.stdout


# -- fuzz: the new parsers never traceback ----------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from paicli import client  # noqa: E402
from paicli.errors import UsageError  # noqa: E402
from paicli.statement import parse_statement  # noqa: E402

values = st.one_of(st.text(max_size=40), st.sampled_from(
    ["A=1,B", "=x", "A=1\\", "PAI_ROLE=1", "A=\x00", "x" * 5, "-f", "--find-links", "-r x", "pandas==2 ;",
     "file://", "file:///nonexistent", "~nosuchuser_fz/r.txt", "a[b", "--no-index,pandas"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["env", "requirements"]), values)
def test_env_and_requirements_never_traceback(key, value):
    try:
        client.prepare(parse_statement(["-name", "python", f"-Dscript={__file__}", f"-D{key}={value}"]))
    except UsageError as err:
        assert str(err) and "\n" not in str(err).strip()


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.lists(st.one_of(st.text(max_size=20), st.integers(), st.none()), max_size=4),
                 st.dictionaries(st.text(max_size=8), st.one_of(st.text(max_size=8), st.none(), st.integers(),
                                                                 st.lists(st.integers(), max_size=2)), max_size=4)))
def test_yaml_structures_never_traceback(value):
    for parse in (lambda v: parse_env(v, shell={}), lambda v: parse_requirements(v, Path("/"))):
        try:
            parse(value)
        except ValueError as err:
            assert str(err) and "\n" not in str(err)


@pytest.mark.caffe
def test_a_caffe_script_imports_a_package_of_its_layer(pai_home, tmp_path):
    """Caffe's Debian Python 3.9 has no pip: the layer is built for it by this
    machine's pip (--python), and pycaffe and the package import side by side."""
    script = tmp_path / "caffe_tiny.py"
    script.write_text("import caffe, paienvtiny, sys\n"
                      "print('CAFFE', sys.version_info[:2], paienvtiny.VALUE, flush=True)\n")
    req = tmp_path / "requirements.txt"
    req.write_text(f"--no-index\n--find-links {wheelhouse(tmp_path)}\npaienvtiny\n")
    # The Caffe runtime is the shared one (3 minutes to build): so is the layer, removed after.
    result = pai("-name", "caffe", f"-Dscript={script}", f"-Drequirements={req}", timeout=900)
    try:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert "CAFFE (3, 9) 42" in result.stdout
    finally:
        for row in pai_json("runtime", "list"):
            if row.get("kind") == "layer" and row["name"].startswith("caffe-") and \
                    row["installed_packages"] == ["paienvtiny==1.0"]:
                assert pai("runtime", "remove", row["name"]).returncode == 0
                (Path(row["path"]).parent / f".{row['name']}.lock").unlink(missing_ok=True)
                try:
                    Path(row["path"]).parent.rmdir()   # the shared layers folder, if we made it and it is empty
                except OSError:
                    pass


# -- provisioning progress: a bar on a terminal, one line per phase in a pipe ------------

PIP_RUN = ["provisioning the mxnet runtime (MXNet 1.9.1) in /rt/mxnet",
           "  Collecting mxnet==1.9.1", "  Downloading mxnet-1.9.1-py3-none-manylinux2014_x86_64.whl (49.1 MB)",
           "  Collecting numpy==1.23.5", "  Downloading numpy-1.23.5-cp311-cp311-manylinux_2_17_x86_64.whl (17.1 MB)",
           "  Collecting requests<3", "  Downloading requests-2.32.3-py3-none-any.whl (64 kB)",
           "  Installing collected packages: numpy, requests, mxnet", "  Successfully installed mxnet numpy requests",
           "mxnet runtime ready in 19s"]


def test_the_tracker_counts_packages_and_megabytes():
    from paicli.progress import Tracker

    tracker = Tracker(now=0.0)
    changes = [tracker.feed(line) for line in PIP_RUN[:-1]]
    assert changes == ["phase", "step", "step", None, None, None, None, "step", None]   # forward only
    assert tracker.step == "installing" and len(tracker.packages) == 3 and round(tracker.mb, 1) == 66.3
    assert tracker.summary(now=75.0) == "installing, 3 packages, 66 MB, 1:15"
    tracker.feed(PIP_RUN[-1])
    assert tracker.done and tracker.fraction() == 1.0


def test_in_a_pipe_one_line_per_phase_and_no_pip_line():
    import io

    from paicli.progress import provisioning_progress

    out = io.StringIO()
    show = provisioning_progress(out, tty=False)
    for line in PIP_RUN:
        show(line)
    lines = out.getvalue().splitlines()
    assert lines[0] == "runtime: provisioning the mxnet runtime (MXNet 1.9.1) in /rt/mxnet"
    assert lines[-1] == "runtime: mxnet runtime ready in 19s"
    assert [line.split(",")[0] for line in lines[1:-1]] == [
        "runtime:   collecting", "runtime:   downloading", "runtime:   installing"]
    assert not any("Collecting" in line or ".whl" in line for line in lines)


def test_on_a_terminal_one_line_redrawn_with_a_bar():
    import io

    from paicli.progress import provisioning_progress

    out = io.StringIO()
    show = provisioning_progress(out, tty=True)
    for line in PIP_RUN:
        show(line)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1   # the finished line stays, nothing scrolls
    frames = text.split("\r\x1b[2K")[1:]
    assert "installing, 3 packages, 66 MB" in frames[-2] and frames[-2].startswith("runtime: [")
    assert frames[-1].startswith("runtime: [############] mxnet runtime ready in 19s")
    out.truncate(0)
    show("layer python-0123: resolving 1 requirement(s)")
    show("layer python-0123: failed")
    assert out.getvalue().endswith("layer python-0123: failed\n")   # the error prints on a line of its own


def test_a_failed_runtime_install_names_its_full_log(tmp_path, monkeypatch):
    from paicli.runners.runtimes import RuntimeSetupError, VenvRuntime

    monkeypatch.setenv("PAI_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")   # hermetic, and fast to fail
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    shown: list[str] = []
    with pytest.raises(RuntimeSetupError) as caught:
        VenvRuntime("bogus", ["no-such-package-paicli==9"]).ensure(shown.append)
    message = str(caught.value)
    assert "no-such-package-paicli==9" in message and "\n" not in message
    log = Path(message.rsplit("full log: ", 1)[1])
    assert "No matching distribution found for no-such-package-paicli==9" in log.read_text()
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    assert not (tmp_path / "rt" / "bogus").exists() and not (tmp_path / "rt" / ".bogus.partial").exists()


def test_a_layer_in_use_is_not_removed(pai_home, tmp_path):
    import fcntl

    layer = tmp_path / "rt" / "layers" / "python-0123456789abcdef"
    (layer / "site").mkdir(parents=True)
    marker = layer / "paicli-layer.json"
    marker.write_text(json.dumps({"base": "python", "requirements": ["x"], "installed": ["x==1"]}))
    env = {"PAI_RUNTIME_DIR": str(tmp_path / "rt")}
    holder = os.open(marker, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)   # what a running instance's runner holds (runtime_lock.py)
    try:
        refused = pai("runtime", "remove", "python-0123", env=env)
        assert refused.returncode == 1 and "a running job uses it" in refused.stderr and layer.exists()
    finally:
        os.close(holder)
    assert pai("runtime", "remove", "python-0123", env=env).stdout.strip() == "python-0123456789abcdef: removed"
    assert not layer.exists()
    missing = pai("runtime", "remove", "python-0123", env=env)
    assert missing.returncode == 2 and "no single layer named" in missing.stderr


def test_a_ray_node_builds_the_layer_once_and_a_failure_there_is_one_line(tmp_path, monkeypatch):
    """The Ray actor's side (ray_node.InstanceActor.ensure_runtime with a layer spec),
    run here without Ray as tests/test_ray.py runs the actor: the --find-links files
    come with the call, the layer is built with the staged runtimes code, cached; a
    pin pip cannot install is one line and pip's whole output."""
    from paicli.cluster import node_files
    from paicli.cluster.backends import ray_node
    from paicli.runners.runtimes import layer_digest

    monkeypatch.setattr(ray_node.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("PAI_RUNTIME_DIR", str(tmp_path / "node-runtimes"))
    actor = ray_node.InstanceActor("job1", "job1/worker:0", "n" * 20)
    assert "error" not in actor.stage(node_files.tar_stream(node_files.runner_files()))
    links = wheelhouse(tmp_path)
    lines = ["--no-index", f"--find-links {links}", "paienvtiny"]
    spec = {"base": "", "digest": layer_digest("", "test", lines), "lines": lines, "pins": ["paienvtiny==1.0"],
            "files": {str(links): [(p.name, p.read_bytes()) for p in links.iterdir()]}, "name": "x"}
    got = actor.ensure_runtime(None, spec)
    assert "error" not in got, got
    assert any("installing 1 package(s)" in line for line in got["lines"])
    assert not any(line.startswith("  ") for line in got["lines"])   # pip's own lines stay out of job.log
    site = next((tmp_path / "node-runtimes" / "layers").glob("python-*/site"))
    assert (site / "paienvtiny" / "__init__.py").exists()
    again = actor.ensure_runtime(None, spec)
    assert "error" not in again and not any("installing" in line for line in again["lines"])

    bad = dict(spec, digest=layer_digest("", "test", lines + ["x"]), pins=["paienvtiny==9.9"])
    failed = actor.ensure_runtime(None, bad)
    assert failed["error"].startswith("pip: ") and "paienvtiny==9.9" in failed["error"] and "\n" not in failed["error"]
    assert "No matching distribution found for paienvtiny==9.9" in failed["pip_log"]
