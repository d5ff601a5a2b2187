"""The project folder travels to SSH nodes (cluster/workdir.py): the same statement
as on this machine, only what changed sent again, the ignore rule named when a
file it kept here is missing there. Real hosts (tests/netns.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, job_id_from, pai
from netns import module_cluster, module_nodes
from paicli.cluster import workdir

cluster = module_cluster(2, "pwd", 210)
nodes = module_nodes(cpu=100)

TWO = '-Dcluster={"worker":{"count":2}}'
TRAIN = ("import os\n"
         "rows = open('data.csv').read().split()\n"
         "conf = dict(line.split(': ') for line in open('conf/params.yaml').read().splitlines())\n"
         "idx = os.environ['PAI_INDEX']\n"
         "print('rows', len(rows), 'lr', conf['lr'], 'on', os.environ.get('PAI_HOST'), flush=True)\n"
         "open(f'out-{idx}.txt', 'w').write(f'{len(rows)} rows\\n')\n")


def project(folder: Path) -> Path:
    (folder / "conf").mkdir(parents=True)
    (folder / "train.py").write_text(TRAIN)
    (folder / "data.csv").write_text("\n".join(str(i) for i in range(100)) + "\n")
    (folder / "conf" / "params.yaml").write_text("lr: 0.1\nepochs: 2\n")
    return folder


def sent_lines(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"workdir: (\S+): (\d+ file\(s\) sent \([^)]*\), \d+ already there)", stdout))


def test_the_three_file_project_runs_on_two_nodes_as_here_and_sends_only_what_changed(cluster, nodes, tmp_path):
    proj = project(tmp_path / "proj")
    here = pai("-name", "python", "-Dscript=train.py", TWO, cwd=str(proj), env={"PAI_NODES": ""}, timeout=90)
    assert here.returncode == 0, here.stdout + here.stderr
    for out in proj.glob("out-*.txt"):
        out.unlink()
    os.symlink("conf/params.yaml", proj / "params.yaml")   # a link: never counted as a file sent or there
    first = pai("-name", "python", "-Dscript=train.py", TWO, cwd=str(proj), timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    hosts = set(re.findall(r"\[worker:\d\] rows 100 lr 0\.1 on (\S+)", first.stdout))
    assert len(hosts) == 2 and all(h.startswith(cluster.subnet) for h in hosts), first.stdout
    sent = sent_lines(first.stdout)
    size = sum(os.path.getsize(proj / rel) for rel in ("train.py", "data.csv", "conf/params.yaml"))
    assert list(sent.values()) == [f"3 file(s) sent ({workdir.human(size)}), 0 already there"] * 2, first.stdout
    # what the workers wrote came back beside the script; what came with the folder is no output
    assert (proj / "out-0.txt").read_text() == (proj / "out-1.txt").read_text() == "100 rows\n"
    written = json.loads(pai("outputs", job_id_from(first.stdout), "--json").stdout)["files"]
    assert sorted(os.path.basename(f["path"]) for f in written) == ["out-0.txt", "out-1.txt"], written
    # A second job, one file changed (the outputs moved away): that file alone travels.
    for out in proj.glob("out-*.txt"):
        out.unlink()
    (proj / "conf" / "params.yaml").write_text("lr: 0.2\nepochs: 2\n")
    second = pai("-name", "python", "-Dscript=train.py", TWO, cwd=str(proj), timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("lr 0.2 on") == 2
    again = sent_lines(second.stdout)
    assert list(again.values()) == ["1 file(s) sent (18 bytes), 2 already there"] * 2, second.stdout


def test_a_file_an_ignore_rule_kept_here_is_named_when_the_job_fails(cluster, nodes, tmp_path):
    proj = project(tmp_path / "proj")
    (proj / ".gitignore").write_text("# data stays out of git\n*.csv\n")
    result = pai("-name", "python", "-Dscript=train.py", "-DmaxRetries=0", cwd=str(proj), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (f"data.csv is in {proj} but not sent to the nodes: .gitignore line 2: *.csv "
            "(a `!` line in .paiignore sends it)") in result.stdout + result.stderr, result.stdout + result.stderr
    (proj / ".paiignore").write_text("!data.csv\n")
    ok = pai("-name", "python", "-Dscript=train.py", cwd=str(proj), timeout=120)
    assert ok.returncode == 0 and "rows 100 lr 0.1" in ok.stdout, ok.stdout + ok.stderr


def test_a_default_folder_over_the_limit_falls_back_to_the_script(cluster, nodes, tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "big.bin").write_bytes(b"\0" * 4096)
    (proj / "hello.py").write_text("import os\nprint('files', sorted(os.listdir('.')), flush=True)\n")
    result = pai("-name", "python", "-Dscript=hello.py", "-DworkDirMaxSize=1K", cwd=str(proj), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"workdir: {proj} sends more than 1K; only the script and its imports travel" in result.stdout + result.stderr
    assert "[worker:0] files ['hello.py']" in result.stdout
    assert job_id_from(result.stdout)


LMDB_LAYERS = '''layer {
  name: "data" type: "Data" top: "data" top: "label"
  include { phase: TRAIN }
  transform_param { scale: 0.00390625 }
  data_param { source: "examples/mnist/mnist_train_lmdb" backend: LMDB batch_size: 16 }
}
layer {
  name: "data" type: "Data" top: "data" top: "label"
  include { phase: TEST }
  transform_param { scale: 0.00390625 }
  data_param { source: "examples/mnist/mnist_test_lmdb" backend: LMDB batch_size: 16 }
}
'''


def lenet_folder(folder: Path, caffe) -> None:
    """BVLC LeNet's solver and net, unpacked, reading LMDBs beside them that Caffe's
    convert_imageset makes here from 28x28 images: one bright quadrant per class."""
    folder.mkdir()
    net = (ROOT / "examples" / "caffe" / "lenet" / "lenet_train_test.prototxt").read_text()
    first, last = net.index("layer {"), net.index('layer {\n  name: "conv1"')
    (folder / "lenet_train_test.prototxt").write_text(net[:first] + LMDB_LAYERS + net[last:])
    solver = (ROOT / "examples" / "caffe" / "lenet" / "lenet_solver.prototxt").read_text()
    for name, value in (("max_iter", 40), ("display", 10), ("snapshot", 40), ("test_interval", 1000)):
        solver = re.sub(rf"^{name}:.*$", f"{name}: {value}", solver, flags=re.M)
    (folder / "lenet_solver.prototxt").write_text(solver)
    images = folder / "images"
    images.mkdir()
    for k in range(128):
        pixels = bytearray(28 * 28)
        for y in range(14):
            for x in range(14):
                pixels[(y + 14 * (k % 4 // 2)) * 28 + x + 14 * (k % 2)] = 255
        (images / f"img_{k}.pgm").write_bytes(b"P5\n28 28\n255\n" + bytes(pixels))
    (folder / "images.txt").write_text("".join(f"img_{k}.pgm {k % 4}\n" for k in range(128)))
    (folder / "examples" / "mnist").mkdir(parents=True)
    for lmdb in ("mnist_train_lmdb", "mnist_test_lmdb"):
        subprocess.run([caffe.caffe(), "--gray", f"{images}/", str(folder / "images.txt"),
                        str(folder / "examples" / "mnist" / lmdb)], check=True, timeout=120, capture_output=True,
                       env=dict(os.environ, PAICLI_CAFFE_TOOL="convert_imageset", GLOG_logtostderr="1"))


@pytest.mark.caffe
def test_lenet_from_an_unpacked_folder_trains_on_two_nodes(cluster, nodes, tmp_path):
    from paicli.runners.runtimes import get_runtime

    caffe = get_runtime("caffe")
    caffe.ensure(lambda line: None)
    folder = tmp_path / "lenet"
    lenet_folder(folder, caffe)
    result = pai("-name", "caffe", "-Dsolver=lenet_solver.prototxt", "-DworkDir=.", "-DmaPeriod=10",
                 '-Dcluster={"ps":{"count":1,"cpu":0},"worker":{"count":2}}', cwd=str(folder), timeout=600)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("OK"), result.stdout[-3000:] + result.stderr
    assert len(sent_lines(result.stdout)) == 2, result.stdout
    info = json.loads(pai("status", job_id_from(result.stdout), "--json").stdout)
    workers = {i["host"] for i in info["instances"] if i["role"] == "worker"}
    assert len(workers) == 2, info["instances"]
    worker0 = info["metrics"]["worker:0"]
    assert worker0["averaged_loss"] < worker0["starting_loss"] * 0.8, worker0
    assert (folder / "snapshots" / "lenet_iter_40.caffemodel").is_file()   # back where the solver says
    # Left out by an ignore rule, the LMDB is missing there: Caffe's error names no path, the hint does.
    (folder / ".paiignore").write_text("*_lmdb/\n")
    failed = pai("-name", "caffe", "-Dsolver=lenet_solver.prototxt", "-DworkDir=.", "-DmaxRetries=0",
                 '-Dcluster={"worker":{"count":1}}', cwd=str(folder), timeout=600)
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr
    assert (f"examples/mnist/mnist_train_lmdb is in {folder} but not sent to the nodes: .paiignore line 1: "
            "*_lmdb/") in failed.stdout, failed.stdout[-3000:]
