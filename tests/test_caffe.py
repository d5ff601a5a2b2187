"""Caffe through `pai -name caffe`: real Caffe 1.0 jobs in the real runtime.

The first test that needs it provisions the Caffe runtime (a Debian bullseye root
filesystem, about 1 GB and a few minutes, needs root; cached under
~/.cache/paicli/runtimes and reused). Jobs are tiny: other suites share the 2 cores.
The planning tests at the top start no process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import instance_groups, job_id_from, pai, pai_json, processes_in, wait_until
from paicli.adapters import get_adapter
from paicli.adapters.base import StagedCode
from paicli.adapters.caffe import CAFFE_METRIC_PATTERNS, CaffeAdapter
from paicli.runners.caffe_runner import solver_cwd
from paicli.errors import SpecError
from paicli.spec import CORE_PARAMS, JobSpec

pytestmark = pytest.mark.caffe

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "caffe"
JOB_TIMEOUT = 300
TWO_WORKERS = '{"ps":{"count":1},"worker":{"count":2}}'


# ---------------------------------------------------------------------------
# Planning: no processes


def make_spec(**params) -> JobSpec:
    table = {p.name: p for p in (*CORE_PARAMS, *CaffeAdapter.params)}
    return JobSpec(framework="caffe", params=params, table=table)


def plan_for(tmp_path: Path, **params):
    solver = tmp_path / "solver.prototxt"
    if not solver.exists():
        solver.write_text('net: "net.prototxt"\nmax_iter: 10\n')
        (tmp_path / "net.prototxt").write_text('name: "x"\n')
    params.setdefault("solver", str(solver))
    spec = make_spec(**params)
    adapter = CaffeAdapter()
    adapter.validate(spec)
    return adapter.plan(spec, StagedCode(None, None, tmp_path))


def test_registered_by_name_and_needs_no_script():
    adapter = get_adapter("Caffe")
    assert isinstance(adapter, CaffeAdapter) and not adapter.requires_script
    assert adapter.runtime == "caffe"


def test_one_worker_runs_caffe_train(tmp_path):
    plan = plan_for(tmp_path, checkpointDir=str(tmp_path / "ck"))
    (worker,) = plan.roles
    assert (worker.name, worker.count, worker.must_finish) == ("worker", 1, True)
    assert worker.argv[worker.argv.index("--solver") + 1] == str(tmp_path / "solver.prototxt")
    assert worker.argv[worker.argv.index("--checkpoint-dir") + 1] == str(tmp_path / "ck")
    assert "--caffe" in worker.argv and "--workers" not in worker.argv
    assert worker.cwd == str(tmp_path) and worker.env["GLOG_logtostderr"] == "1"
    assert "--top" not in worker.argv  # only for a solver inside an archive
    assert plan.restart == "instance" and plan.task_name == "CaffeTask"


def test_several_workers_average_through_a_ps_service(tmp_path):
    plan = plan_for(tmp_path, cluster={"ps": {"count": 1}, "worker": {"count": 3}}, maPeriod=7)
    ps, worker = plan.roles  # the ps starts first
    assert ps.name == "ps" and not ps.must_finish and ps.listens and "average" in ps.argv
    assert worker.must_finish and not worker.listens and worker.count == 3
    assert worker.argv[worker.argv.index("--workers") + 1] == "3"
    assert worker.argv[worker.argv.index("--ma-period") + 1] == "7"
    assert worker.env["OPENBLAS_NUM_THREADS"] == "1"
    assert plan.restart == "job"  # averaging rounds must stay in step


@pytest.mark.parametrize("params, where, text", [
    ({"solver": None}, "-Dsolver", "missing"),
    ({"weights": "W", "snapshot": "S"}, "-Dweights", "not both"),
    ({"cluster": {"worker": {"count": 2}}}, "-Dcluster", "no ps"),
    ({"cluster": {"chief": {"count": 1}}}, "-Dcluster", 'unknown role "chief"'),
    ({"cluster": {"ps": {"count": 1}}}, "-Dcluster", 'no "worker"'),
])
def test_bad_parameters_say_what_and_how(tmp_path, params, where, text):
    (tmp_path / "W").write_text("")
    (tmp_path / "S").write_text("")
    params = {k: (str(tmp_path / v) if k in ("weights", "snapshot") else v) for k, v in params.items()}
    if params.get("solver", "") is None:
        params.pop("solver")
        with pytest.raises(SpecError) as err:
            CaffeAdapter().validate(make_spec(**params))
    else:
        with pytest.raises(SpecError) as err:
            plan_for(tmp_path, **params)
    assert str(err.value).startswith(where) and text in str(err.value)


def test_working_directory_is_where_the_net_path_resolves(tmp_path):
    # BVLC layout: caffe/examples/mnist/lenet_solver.prototxt names examples/mnist/...
    mnist = tmp_path / "caffe" / "examples" / "mnist"
    mnist.mkdir(parents=True)
    (mnist / "lenet_train_test.prototxt").write_text("")
    solver = mnist / "lenet_solver.prototxt"
    elsewhere = str(tmp_path / "elsewhere")
    solver.write_text('net: "examples/mnist/lenet_train_test.prototxt"\n')
    assert solver_cwd(str(solver), elsewhere) == str(tmp_path / "caffe")
    # ...but never above an archive's root
    assert solver_cwd(str(solver), elsewhere, top=str(mnist)) == elsewhere
    # A solver beside its net runs in its own folder.
    solver.write_text('net: "lenet_train_test.prototxt"\n')
    assert solver_cwd(str(solver), elsewhere) == str(mnist)
    # Nothing resolves: where `pai` was started, as `caffe train` run there would.
    solver.write_text('net: "nowhere/net.prototxt"\n')
    assert solver_cwd(str(solver), elsewhere) == elsewhere


def metrics_of(line: str) -> dict:
    from paicli.cluster.logsink import MetricParser
    return MetricParser(list(CAFFE_METRIC_PATTERNS)).parse(line)[1]


def test_metric_patterns_read_caffe_lines():
    head = "I1122 04:53:15.198458 31216 solver.cpp:239] "
    got = metrics_of(head + "Iteration 20 (58.8235 iter/s, 0.34s/20 iters), loss = 1.23879")
    assert got["step"] == 20 and got["loss"] == 1.23879 and got["iter_per_s"] == 58.8235
    got = metrics_of(head + "Iteration 0 (-9.95738e+29 iter/s, 0.116s/20 iters), loss = 1.4459")
    assert got == {"step": 0, "loss": 1.4459}  # iteration 0's rate is garbage in Caffe
    assert metrics_of(head + "Iteration 40, lr = 0.00997011") == {"step": 40, "lr": 0.00997011}
    assert metrics_of(head + "    Test net output #0: accuracy = 0.998047") == {"accuracy": 0.998047}
    assert metrics_of(head + "    Test net output #1: loss = 0.06 (* 1 = 0.06 loss)") == {"test_loss": 0.06}
    assert metrics_of(head + "    Train net output #0: loss = 2.1 (* 1 = 2.1 loss)") == {}
    assert metrics_of(head + "Iteration 200, loss = 0.0026") == {"step": 200, "loss": 0.0026}


def test_mirror_comes_from_the_apt_sources(tmp_path, monkeypatch):
    from paicli.runners import caffe_rootfs
    sources = tmp_path / "sources.list.d"
    sources.mkdir()
    (sources / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.invalid/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n")
    (sources / "other.list").write_text("deb [arch=amd64] http://other.invalid/debian bookworm main\n")
    monkeypatch.setattr(caffe_rootfs, "APT_SOURCES_DIR", sources)
    monkeypatch.setattr(caffe_rootfs, "APT_SOURCES_LIST", tmp_path / "none.list")
    monkeypatch.delenv("PAI_CAFFE_MIRROR", raising=False)
    assert caffe_rootfs.apt_mirrors() == ["http://mirror.invalid/debian", "http://other.invalid/debian"]
    assert caffe_rootfs.choose_mirror() == "http://mirror.invalid/debian"
    for path in sources.iterdir():
        path.unlink()
    with pytest.raises(caffe_rootfs.RuntimeSetupError, match="PAI_CAFFE_MIRROR"):
        caffe_rootfs.choose_mirror()


def test_building_without_root_says_how_to(tmp_path, monkeypatch):
    from paicli.runners import caffe_rootfs
    monkeypatch.setattr(caffe_rootfs.os, "geteuid", lambda: 1000)
    with pytest.raises(caffe_rootfs.RuntimeSetupError) as err:
        caffe_rootfs.CaffeRuntime()._install(tmp_path / "caffe", lambda line: None)
    assert "needs root" in str(err.value) and "sudo pai runtime install caffe" in str(err.value)
    assert "PAI_CAFFE_PYTHON" in str(err.value)


def test_own_caffe_overrides_the_runtime(monkeypatch, tmp_path):
    from paicli.runners.caffe_rootfs import CaffeRuntime
    own = tmp_path / "opt-caffe"
    own.mkdir()
    for name in ("python", "caffe"):  # an installation of one's own: executables that exist
        (own / name).write_text("#!/bin/sh\n")
        (own / name).chmod(0o755)
    monkeypatch.setenv("PAI_CAFFE_PYTHON", str(own / "python"))
    monkeypatch.setenv("PAI_CAFFE_BIN", str(own / "caffe"))
    runtime = CaffeRuntime()
    assert runtime.is_installed()  # nothing to build
    assert (runtime.python(), runtime.caffe()) == (str(own / "python"), str(own / "caffe"))
    plan = plan_for(tmp_path)
    assert plan.roles[0].argv[0] == str(own / "python")
    assert plan.roles[0].argv[plan.roles[0].argv.index("--caffe") + 1] == str(own / "caffe")
    monkeypatch.setenv("PAI_CAFFE_PYTHON", str(own / "missing"))
    assert not CaffeRuntime().is_installed()  # a path that is not there is no interpreter


def test_absolute_links_are_pointed_inside_the_root(tmp_path):
    from paicli.runners.caffe_rootfs import relativize_symlinks
    (tmp_path / "etc" / "alternatives").mkdir(parents=True)
    (tmp_path / "usr" / "lib" / "blas").mkdir(parents=True)
    (tmp_path / "usr" / "lib" / "blas" / "libblas.so.3").write_text("real")
    os.symlink("/usr/lib/blas/libblas.so.3", tmp_path / "etc" / "alternatives" / "libblas.so.3")
    os.symlink("/etc/alternatives/libblas.so.3", tmp_path / "usr" / "lib" / "libblas.so.3")
    assert relativize_symlinks(tmp_path) == 2
    assert (tmp_path / "usr" / "lib" / "libblas.so.3").read_text() == "real"
    assert not os.readlink(tmp_path / "usr" / "lib" / "libblas.so.3").startswith("/")


# ---------------------------------------------------------------------------
# Real jobs


@pytest.fixture(scope="session")
def caffe_runtime():
    from paicli.runners.runtimes import get_runtime
    runtime = get_runtime("caffe")
    if not runtime.is_installed() and os.geteuid() != 0:
        pytest.skip("the Caffe runtime is not built and building it needs root "
                    "(run `sudo pai runtime install caffe` once)")
    runtime.ensure(lambda line: None)
    return runtime


def set_fields(text: str, **fields) -> str:
    for name, value in fields.items():
        rendered = f'{name}: "{value}"' if isinstance(value, str) else f"{name}: {value}"
        text, n = re.subn(rf"^{name}:.*$", rendered, text, flags=re.M)
        if not n:
            text += rendered + "\n"
    return text


@pytest.fixture(scope="session")
def lenet(caffe_runtime, tmp_path_factory):
    """The LeNet example with its data generated, and a short solver for tests."""
    folder = tmp_path_factory.mktemp("caffe") / "lenet"
    shutil.copytree(EXAMPLES / "lenet", folder, ignore=shutil.ignore_patterns("data", "snapshots"))
    subprocess.run([caffe_runtime.python(), str(folder / "make_data.py")], check=True, timeout=300)
    text = (folder / "lenet_solver.prototxt").read_text()
    (folder / "short_solver.prototxt").write_text(
        set_fields(text, max_iter=60, display=10, snapshot=30, test_interval=30, test_iter=4))
    (folder / "long_solver.prototxt").write_text(set_fields(text, max_iter=1000000, snapshot=0))
    return folder


def run(*args, cwd=None):
    result = pai(*args, timeout=JOB_TIMEOUT, cwd=cwd)
    lines = result.stdout.strip().splitlines()
    return result, lines


def status_of(output: str) -> dict:
    return pai_json("status", job_id_from(output))


def losses(status: dict, instance: str = "worker:0") -> list[tuple[float, float]]:
    return [(step, value) for step, value in status["metric_series"][instance]["loss"] if step is not None]


def test_single_worker_trains_with_falling_loss_and_snapshots(pai_home, lenet, tmp_path):
    checkpoints = tmp_path / "ck"
    result, lines = run("-name", "caffe", f"-Dsolver=file://{lenet}/short_solver.prototxt",
                        f"-DcheckpointDir={checkpoints}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[-1] == "OK"
    assert any(re.match(r"\[worker:0\] .*Iteration 10 \(.* iter/s, .*\), loss = ", x) for x in lines)
    series = losses(status_of(result.stdout))
    assert series[0][0] == 0 and series[-1][0] == 60
    assert series[-1][1] < series[0][1] * 0.8, series
    # checkpointDir replaced the solver's snapshots/ folder; the job made it
    assert {p.name for p in checkpoints.iterdir()} >= {"lenet_iter_30.caffemodel", "lenet_iter_30.solverstate",
                                                      "lenet_iter_60.caffemodel"}
    assert not list(lenet.glob("snapshots/*.caffemodel"))


def test_resume_from_snapshot_continues_the_iteration_count(pai_home, lenet, tmp_path):
    first = tmp_path / "first"
    result, _ = run("-name", "caffe", f"-Dsolver={lenet}/short_solver.prototxt", f"-DcheckpointDir={first}")
    assert result.returncode == 0, result.stdout
    resumed = tmp_path / "resumed"
    result, lines = run("-name", "caffe", f"-Dsolver={lenet}/short_solver.prototxt",
                        f"-Dsnapshot={first}/lenet_iter_30.solverstate", f"-DcheckpointDir={resumed}")
    assert result.returncode == 0, result.stdout
    assert any("Resuming from" in x for x in lines)
    steps = [step for step, _ in losses(status_of(result.stdout))]
    assert steps and min(steps) >= 30 and max(steps) == 60
    assert (resumed / "lenet_iter_60.caffemodel").exists() and not (resumed / "lenet_iter_30.caffemodel").exists()


def test_weights_fine_tune_from_a_trained_model(pai_home, lenet, tmp_path):
    result, _ = run("-name", "caffe", f"-Dsolver={lenet}/short_solver.prototxt", f"-DcheckpointDir={tmp_path}")
    assert result.returncode == 0, result.stdout
    fresh = losses(status_of(result.stdout))[0]
    result, lines = run("-name", "caffe", f"-Dsolver={lenet}/short_solver.prototxt",
                        f"-Dweights={tmp_path}/lenet_iter_60.caffemodel", f"-DcheckpointDir={tmp_path}/tuned")
    assert result.returncode == 0, result.stdout
    tuned = losses(status_of(result.stdout))[0]
    assert fresh[0] == tuned[0] == 0  # a new run from iteration 0...
    assert tuned[1] < fresh[1] * 0.5  # ...starting from the trained weights


def test_two_workers_and_a_ps_average_the_model(pai_home, lenet, tmp_path):
    result, lines = run("-name", "caffe", f"-Dsolver={lenet}/short_solver.prototxt", "-DmaPeriod=10",
                        f"-Dcluster={TWO_WORKERS}", f"-DcheckpointDir={tmp_path / 'ck'}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[-1] == "OK"
    status = status_of(result.stdout)
    worker0 = status["metrics"]["worker:0"]
    assert worker0["averaged_loss"] < worker0["starting_loss"] * 0.8, worker0
    assert sum("[ps:0] averaging round" in x for x in lines) == 6  # 60 iterations / maPeriod 10
    assert [s for s, _ in losses(status, "worker:1")][-1] == 60   # worker 1 reports its own loss
    assert (tmp_path / "ck" / "lenet_iter_60.caffemodel").exists()  # the averaged model, by worker 0


SHARD_LAYERS = {
    "hdf5": 'type: "HDF5Data" hdf5_data_param { source: "list.txt" batch_size: 4 }',
    "lmdb": 'type: "Data" data_param { source: "records_lmdb" backend: LMDB batch_size: 4 }',
}
SHARD_NET = """
name: "shards"
layer { name: "data" %s top: "data" top: "label" }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 1 weight_filler { type: "constant" } } }
layer { name: "label_loss" type: "Reduction" bottom: "label" top: "label_loss"
        reduction_param { operation: MEAN } loss_weight: 1 }
"""


def write_records(kind: str, folder: Path, runtime) -> None:
    """64 records labelled 0, 1, 0, 1, ... as HDF5, or as an LMDB made by Caffe's convert_imageset."""
    if kind == "hdf5":
        subprocess.run([runtime.python(), "-c", (
            "import h5py, numpy as np\n"
            "with h5py.File('records.h5', 'w') as f:\n"
            "    f['data'] = np.ones((64, 2), np.float32)\n"
            "    f['label'] = (np.arange(64) % 2).astype(np.float32)\n")], cwd=folder, check=True, timeout=120)
        (folder / "list.txt").write_text("records.h5\n")
        return
    for k in range(64):
        (folder / f"img_{k}.pgm").write_bytes(b"P5\n2 2\n255\n" + bytes([k % 2 * 255] * 4))
    (folder / "images.txt").write_text("".join(f"img_{k}.pgm {k % 2}\n" for k in range(64)))
    # GLOG_logtostderr: glog's default is a log file in /tmp for each run of the tool.
    subprocess.run([runtime.caffe(), "--gray", "./", "images.txt", "records_lmdb"], cwd=folder, check=True,
                   timeout=120, capture_output=True,
                   env=dict(os.environ, PAICLI_CAFFE_TOOL="convert_imageset", GLOG_logtostderr="1"))


@pytest.mark.parametrize("kind", ["hdf5", "lmdb"])
def test_each_worker_trains_on_its_own_shard(pai_home, caffe_runtime, tmp_path, kind):
    # Records alternate label 0, 1, 0, 1...; the "loss" is the mean label of a batch.
    # Sharded by worker index, worker 0 sees only 0s and worker 1 only 1s; unsharded, 0.5.
    write_records(kind, tmp_path, caffe_runtime)
    (tmp_path / "net.prototxt").write_text(SHARD_NET % SHARD_LAYERS[kind])
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.0\nlr_policy: "fixed"\ndisplay: 5\nmax_iter: 10\nsnapshot_after_train: false\n')
    result, _ = run("-name", "caffe", f"-Dsolver={tmp_path}/solver.prototxt", "-DmaPeriod=5",
                    f"-Dcluster={TWO_WORKERS}")
    assert result.returncode == 0, result.stdout + result.stderr
    status = status_of(result.stdout)
    assert [v for _s, v in losses(status, "worker:0")][-1] == 0.0
    assert [v for _s, v in losses(status, "worker:1")][-1] == 1.0


def test_solver_in_an_archive_runs_in_the_archive_root(pai_home, lenet, tmp_path):
    archive = tmp_path / "lenet.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("short_solver.prototxt", "lenet_train_test.prototxt", "data"):
            tar.add(lenet / name, arcname=f"lenet/{name}")
    result, lines = run("-name", "caffe", f"-Dscript={archive}", "-DentryFile=lenet/short_solver.prototxt")
    assert result.returncode == 0, result.stdout + result.stderr
    job_dir = pai_home / "jobs" / job_id_from(result.stdout)
    # snapshot_prefix "snapshots/lenet" resolved in the extracted folder that holds the net
    assert (job_dir / "code" / "lenet" / "snapshots" / "lenet_iter_60.caffemodel").exists()


def test_a_broken_prototxt_fails_with_caffes_message(pai_home, lenet, tmp_path):
    solver = tmp_path / "broken.prototxt"
    solver.write_text('net: "lenet_train_test.prototxt"\nbase_lr 0.01\n')
    result, lines = run("-name", "caffe", f"-Dsolver={solver}")
    assert result.returncode == 1
    assert lines[-1].startswith("FAILED:") and 'Expected ":", found "0.01"' in lines[-1]
    status = status_of(result.stdout)
    assert status["status"] == "Failed" and status["instances"][0]["attempts"] == 1  # not retried


def test_a_missing_data_source_fails_with_caffes_message(pai_home, lenet, tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text((lenet / "lenet_train_test.prototxt").read_text().replace("data/train.txt", "data/gone.txt"))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(set_fields((lenet / "short_solver.prototxt").read_text(), net=str(net)))
    result, lines = run("-name", "caffe", f"-Dsolver={solver}", "-Dcluster=" + TWO_WORKERS)
    assert result.returncode == 1
    assert lines[-1].startswith("FAILED:") and "Failed to open source file: data/gone.txt" in lines[-1]


def test_cancel_stops_every_instance(pai_home, lenet, tmp_path):
    """...and leaves nothing of theirs in the temporary folder: a stopped runner
    never removes its scratch folder, which is in the job's folder for that."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = pai("-name", "caffe", f"-Dsolver={lenet}/long_solver.prototxt",
                 f"-Dcluster={TWO_WORKERS}", "--detach", env={"TMPDIR": str(temp)})
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().splitlines()[-1]

    def training():
        log = pai("logs", job_id, "--instance", "worker:1").stdout
        return "model averaging round 1 " in log
    assert wait_until(training, timeout=120, interval=0.5)
    status = pai_json("status", job_id)
    groups = instance_groups(status)
    assert len(groups) == 3 and processes_in(groups)
    killed = pai("kill", job_id)
    assert killed.returncode == 0, killed.stderr
    assert wait_until(lambda: pai_json("status", job_id)["status"] == "Cancelled", timeout=60)
    assert wait_until(lambda: not processes_in(groups), timeout=30), processes_in(groups)
    assert not [p.name for p in temp.iterdir() if "caffe" in p.name]
