"""Framework fidelity, real jobs (issue 20): MXNet's own published examples
(../shared/peer/mxnet/image-classification, byte-identical to MXNet 1.9.1) run
unmodified through `pai`, here (mx_cells.LOCAL_CELLS and mnist-sync; the other
cells on the SSH test cluster, test_fidelity_mx_ssh.py); a BVLC-style GPU
solver runs on this CPU-only Caffe for one worker as for two.

Kept to one job per point (the comparison against MXNet's own launcher, dist_async
and the other variants are in bench/bench_fidelity_mx.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import mx_cells
from conftest import ROOT, job_id_from, pai, pai_json

PEER_MX, SERVER_AND_TWO = mx_cells.PEER_MX, mx_cells.SERVER_AND_TWO
needs_peer = pytest.mark.skipif(not PEER_MX.is_dir(), reason="the peer examples are not on this machine")


@pytest.fixture(scope="module")
def mx_runtime():
    from paicli.runners.runtimes import get_runtime

    rt = get_runtime("mxnet")
    rt.ensure(lambda line: None)
    return rt


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else ""


@needs_peer
def test_plain_peer_script_takes_its_own_modules_to_other_nodes():
    from paicli.adapters.base import StagedCode
    from paicli.adapters.mxnet import script_inputs

    script = PEER_MX / "train_mnist.py"
    inputs = script_inputs(StagedCode(entry=script, root=None, cwd=ROOT))
    assert inputs[0] == str(script)
    assert {str(PEER_MX / "common" / "fit.py"), str(PEER_MX / "symbols" / "lenet.py")} <= set(inputs)
    assert script_inputs(StagedCode(entry=script, root=PEER_MX, cwd=PEER_MX)) == []  # an archive travels whole


@needs_peer
@pytest.mark.mxnet
def test_peer_train_mnist_runs_unmodified_and_a_lone_worker_is_named(mx_runtime, pai_home, tmp_path):
    # The matrix's mnist-sync cell: no --kv-store, so -Dkvstore (dist_sync by default)
    # reaches the script through its own flag; both workers push, and it learns from
    # our own digits (mx_cells.check_cell).
    info = mx_cells.check_cell("mnist-sync", mx_cells.run_cell("mnist-sync", tmp_path))
    for worker in ("worker:0", "worker:1"):
        assert "Validation-accuracy" in info["metrics"][worker], info["metrics"][worker]
    # Its settings line (Namespace(batch_size=64, ...)) gave no metric.
    assert "batch_size" not in info["metrics"]["worker:0"] and "lr" not in info["metrics"]["worker:0"]

    # The user's own --kv-store device wins: two lone trainings, which
    # -DrequireDistributed=true turns into a failure that names the cause.
    script = f"-Dscript=file://{PEER_MX / 'train_mnist.py'}"   # ./data: the cell's, in tmp_path
    result = pai("-name", "mxnet", script, f"-Dcluster={SERVER_AND_TWO}", "-DrequireDistributed=true",
                 f"-DuserDefinedParameters={mx_cells.MNIST_ARGS} --kv-store device", cwd=tmp_path, timeout=240)
    assert result.returncode == 1, result.stdout[-3000:]
    assert last_line(result) == (
        "FAILED: -DrequireDistributed=true: not distributed: worker:0, worker:1 trained alone: the script "
        "created kvstore 'device'; pass --kv-store dist_sync, or leave --kv-store out so that -Dkvstore "
        "reaches the script")
    info = pai_json("status", job_id_from(result.stdout))
    assert info["status"] == "Failed" and info["not_distributed"].startswith("worker:0, worker:1 trained alone")
    assert "not distributed: worker:0, worker:1 trained alone" in Path(info["summary_file"]).read_text()


@pytest.mark.caffe
def test_a_gpu_solver_runs_on_cpu_for_one_worker_as_for_two(pai_home, tmp_path):
    from paicli.runners.runtimes import get_runtime

    runtime = get_runtime("caffe")
    if not runtime.is_installed() and os.geteuid() != 0:
        pytest.skip("the Caffe runtime is not built and building it needs root")
    runtime.ensure(lambda line: None)
    folder = tmp_path / "mlp"
    shutil.copytree(ROOT / "examples" / "caffe" / "mlp", folder, ignore=shutil.ignore_patterns("data", "snapshots"))
    subprocess.run([runtime.python(), str(folder / "make_data.py")], check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
    text = (folder / "mlp_solver.prototxt").read_text()
    text = re.sub(r"^solver_mode:.*$", "solver_mode: GPU", text, flags=re.M)   # as BVLC's solvers say
    text = re.sub(r"^max_iter:.*$", "max_iter: 60", text, flags=re.M)
    (folder / "gpu_solver.prototxt").write_text(text)
    said = "solver_mode: GPU, but no GPU is placed for this instance"
    for cluster in ('{"worker":{"count":1}}', '{"ps":{"count":1},"worker":{"count":2}}'):
        result = pai("-name", "caffe", f"-Dsolver={folder / 'gpu_solver.prototxt'}", f"-Dcluster={cluster}",
                     "-DmaPeriod=20", timeout=240)
        assert result.returncode == 0 and last_line(result) == "OK", result.stdout[-3000:]
        workers = 1 if "ps" not in cluster else 2
        assert sum(said in line for line in result.stdout.splitlines()) == workers, result.stdout[-3000:]
        assert "Cannot use GPU" not in result.stdout


# ---------------------------------------------------------------------------
# The matrix: MXNet's own example in the cells of tests/mx_cells.py that run here
# (mx_cells.LOCAL_CELLS; mnist-sync above, the rest across nodes in test_fidelity_mx_ssh.py).

@needs_peer
@pytest.mark.mxnet
@pytest.mark.parametrize("cell", mx_cells.LOCAL_CELLS)
def test_every_cell_of_the_peer_example_runs_here(cell, mx_runtime, pai_home, tmp_path):
    mx_cells.check_cell(cell, mx_cells.run_cell(cell, tmp_path))
