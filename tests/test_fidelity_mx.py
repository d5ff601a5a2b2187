"""Framework fidelity, MXNet and Caffe side (issue 20): the frameworks' own published
examples (../shared/peer) run unmodified, their own flags and log lines understood,
and a "distributed" job that never talked to its servers said to be so.

Fast tier: the runner's flag detection on the peer scripts and on small scripts of
our own, the parser tables on captured lines, the "not distributed" verdict. The
real jobs of the peer examples are in tests/test_fidelity_mx_jobs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paicli.runners import mxnet_runner

REPO = Path(__file__).resolve().parent.parent
PEER_MX = REPO.parent / "shared" / "peer" / "mxnet" / "image-classification"
needs_peer = pytest.mark.skipif(not PEER_MX.is_dir(), reason="the peer examples are not on this machine")


# ---------------------------------------------------------------------------
# -Dkvstore reaches a script through its own --kv-store / --kvstore flag


@needs_peer
@pytest.mark.parametrize("script", ["train_imagenet.py", "train_mnist.py"])
def test_the_kv_store_flag_is_found_in_the_module_the_peer_script_imports(script):
    # train_*.py define no --kv-store themselves: common/fit.py does, imported as
    # `from common import find_mxnet, data, fit`.
    path = PEER_MX / script
    assert "--kv-store" not in path.read_text()
    assert mxnet_runner.defined_flags(str(path), mxnet_runner.KVSTORE_FLAGS) == ["kv-store"]
    args, said = mxnet_runner.kvstore_flag_args(str(path), ["--network", "lenet"], "dist_async")
    assert args == ["--network", "lenet", "--kv-store=dist_async"] and "-Dkvstore" in said


@needs_peer
@pytest.mark.parametrize("given", [["--kv-store", "local"], ["--kv-store=local"]])
def test_the_users_own_kv_store_flag_wins(given):
    args, said = mxnet_runner.kvstore_flag_args(str(PEER_MX / "train_mnist.py"), given, "dist_sync")
    assert args == given and "was given" in said


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("layout, flag", [
    # Gluon examples: --kvstore in the script itself
    ({"train.py": "import argparse\np = argparse.ArgumentParser()\n"
                  "p.add_argument('--kvstore', type=str, default='device')\n"}, "kvstore"),
    # a short option first, a relative import inside a package two levels down
    ({"train.py": "from pkg.sub import opts\n", "pkg/__init__.py": "", "pkg/sub/__init__.py": "",
      "pkg/sub/opts.py": "from . import flags\n",
      "pkg/sub/flags.py": "parser.add_argument('-k', '--kv-store', default='device')\n"}, "kv-store"),
    # absl-style, in a module imported as `import util.flags`
    ({"train.py": "import util.flags as f\n", "util/__init__.py": "",
      "util/flags.py": "flags.DEFINE_string('kv_store', 'device', 'kvstore type')\n"}, "kv_store"),
])
def test_kvstore_flags_are_found_across_the_scripts_own_imports(tmp_path, layout, flag):
    for name, text in layout.items():
        write(tmp_path / name, text)
    assert mxnet_runner.defined_flags(str(tmp_path / "train.py"), mxnet_runner.KVSTORE_FLAGS) == [flag]
    args, _ = mxnet_runner.kvstore_flag_args(str(tmp_path / "train.py"), [], "dist_sync")
    assert args == [f"--{flag}=dist_sync"]


def test_a_script_without_a_kvstore_flag_gets_no_flag(tmp_path):
    # A module of the same name outside the script's folder is not followed, nor is a
    # flag that only resembles one (--kv-store-type), nor a syntax error fatal.
    write(tmp_path / "other" / "fit.py", "parser.add_argument('--kv-store')\n")
    write(tmp_path / "job" / "train.py", "import fit\nimport broken\np.add_argument('--kv-store-type')\n")
    write(tmp_path / "job" / "broken.py", "def (:\n")
    script = str(tmp_path / "job" / "train.py")
    assert mxnet_runner.defined_flags(script, mxnet_runner.KVSTORE_FLAGS) == []
    assert mxnet_runner.kvstore_flag_args(script, ["--lr", "0.1"], "dist_sync") == (["--lr", "0.1"], None)


# ---------------------------------------------------------------------------
# Parser tables: each row's captured line, through the master's parser with the whole table


def table_errors(table, parse) -> list[str]:
    """Rows whose sample the whole table does not read as the row says (`parse`:
    the master's line parser over table_patterns(table))."""
    errors = []
    for rule in table:
        _step, found = parse(rule.sample)
        if found != rule.reads:
            errors.append(f"{rule.what}: {rule.sample!r} reads {found}, expected {rule.reads}")
    return errors


@pytest.mark.parametrize("framework", ["mxnet", "caffe"])
def test_every_row_of_the_parser_table_reads_its_captured_line(framework):
    from metric_lines import CAFFE_LINES, MXNET_LINES, table_patterns

    from paicli.cluster.logsink import MetricParser

    table = {"mxnet": MXNET_LINES, "caffe": CAFFE_LINES}[framework]
    parser = MetricParser(list(table_patterns(table)))
    assert table_errors(table, parser.parse) == []


def test_a_table_row_that_reads_too_much_is_reported():
    from metric_lines import LineRule, table_patterns

    from paicli.cluster.logsink import MetricParser
    from paicli.jobplan import KEY_VALUE_METRIC

    table = (LineRule("tf_cnn_benchmarks step", KEY_VALUE_METRIC,
                      "20  images/sec: 104.5 +/- 2.0 (jitter = 10.1)  33.330", {}),)
    errors = table_errors(table, MetricParser(list(table_patterns(table))).parse)
    assert len(errors) == 1 and "jitter" in errors[0]


def test_the_peer_examples_lines_are_read_in_a_whole_log():
    """A captured stretch of train_mnist.py's log, as the master reads a chunk."""
    from paicli.adapters.mxnet import MxnetAdapter
    from paicli.cluster.logsink import MetricParser

    log = ("INFO:root:start with arguments Namespace(batch_size=64, kv_store='dist_sync', lr=0.05)\n"
           "INFO:root:Epoch[0] Batch [0-10]\tSpeed: 1717.36 samples/sec\taccuracy=0.272727\n"
           "INFO:root:Epoch[0] Batch [10-20]\tSpeed: 2169.50 samples/sec\taccuracy=0.789062\n"
           "INFO:root:Epoch[0] Train-accuracy=0.777593\n"
           "INFO:root:Epoch[0] Time cost=1.464\n"
           "INFO:root:Epoch[0] Validation-accuracy=0.996094\n")
    found = MetricParser(list(MxnetAdapter.metric_patterns)).parse_text(log)
    assert [step for step, _ in found] == [10, 20, None, None, None]
    assert [values.get("accuracy") for values, in [(v,) for _, v in found]][:2] == [0.272727, 0.789062]
    assert found[-1][1] == {"epoch": 0, "Validation-accuracy": 0.996094}


def captured(name: str) -> str:
    """A log captured from a real run (tests/data; its header, `# ` lines, says how)."""
    path = Path(__file__).resolve().parent / "data" / name
    return "".join(line for line in path.read_text().splitlines(keepends=True) if not line.startswith("# "))


def test_mxnets_own_gluon_examples_give_curves_from_their_captured_logs():
    """MXNet 1.9.1's example/gluon mnist.py and image_classification.py, as they printed
    in a real run: batch lines are steps with their scores and speed; an epoch's
    validation scores are validation_<name>, never the training scores' names."""
    from paicli.adapters.mxnet import MxnetAdapter
    from paicli.cluster.logsink import MetricParser

    parser = MetricParser(list(MxnetAdapter.metric_patterns))
    found = parser.parse_text(captured("gluon_mnist_1.9.1.log"))
    assert [step for step, _ in found if step is not None] == [10, 20, 30, 10, 20, 30]
    assert found[2][1] == {"epoch": 0, "batch": 30, "accuracy": 0.566028}
    assert [v for _s, v in found if "validation_accuracy" in v] == [
        {"epoch": 0, "validation_accuracy": 0.914062}, {"epoch": 1, "validation_accuracy": 1.0}]
    assert [v["accuracy"] for s, v in found if s is None and "accuracy" in v] == [0.627344, 0.990234]

    found = parser.parse_text(captured("gluon_image_classification_1.9.1.log"))
    steps = [(s, v) for s, v in found if s is not None]
    assert [s for s, _ in steps] == [24, 49, 74, 99] * 2
    assert all(set(v) == {"epoch", "batch", "speed", "accuracy", "top_k_accuracy_5"} and v["speed"] > 80
               for _, v in steps), steps
    epochs = [v for s, v in found if s is None]
    assert [v.get("epoch_seconds") for v in epochs if "epoch_seconds" in v] == [4.479419, 4.575507]
    validation = [v for v in epochs if any(k.startswith("validation_") for k in v)]
    assert validation == [{"epoch": e, "validation_accuracy": 1.0, "validation_top_k_accuracy_5": 1.0} for e in (0, 1)]
    assert [v["top_k_accuracy_5"] for v in epochs if "top_k_accuracy_5" in v] == [0.99, 1.0]   # training's
    assert len(found) == 8 + 6    # the settings line, the checkpoint notice, the average: nothing


def test_the_tables_and_the_import_scanner_take_any_text(tmp_path):
    """Fuzz: any line gives finite numbers, a long line costs linear time; any
    source file (binary, broken, huge) leaves the scanner with an answer."""
    import time

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from metric_lines import CAFFE_LINES, MXNET_LINES, table_patterns

    from paicli.cluster.logsink import MetricParser

    parsers = [MetricParser(list(table_patterns(t))) for t in (MXNET_LINES, CAFFE_LINES)]
    pieces = st.sampled_from(["Epoch[", "] ", "Batch [", "-", "Speed: ", "=", "1.5", "e9", "\t", "(", ")",
                              "Iteration ", ", loss = ", "nan", "[Epoch 2] validation: ", "acc", "x"])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces | st.text(max_size=5), max_size=30).map("".join))
    def lines(text):
        for parser in parsers:
            for _step, values in parser.parse_text(text + "\n"):
                assert all(v == v and abs(v) != float("inf") for v in values.values())

    lines()
    long_line = "a=1 " * 20000 + "a=1, " * 20000 + "(" + "Epoch[1] Batch [" * 5000
    for parser in parsers:
        start = time.monotonic()
        parser.parse_text(long_line + "\n")
        assert time.monotonic() - start < 2.0

    @settings(max_examples=100, deadline=None)
    @given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
    def sources(blob):
        (tmp_path / "train.py").write_bytes(b"import helper\nfrom . import x\n" + blob)
        (tmp_path / "helper.py").write_bytes(blob)
        assert isinstance(mxnet_runner.defined_flags(str(tmp_path / "train.py"), mxnet_runner.KVSTORE_FLAGS), list)

    sources()


# ---------------------------------------------------------------------------
# "Not distributed": the runner's cause, the master's verdict


@pytest.mark.parametrize("asked, pushes, flag, given, words", [
    (["device"], 0, "kv-store", True,
     "worker:0 trained alone: the script created kvstore 'device'; pass --kv-store dist_sync, or leave "
     "--kv-store out so that -Dkvstore reaches the script"),
    (["device"], 0, "kv-store", False,
     "worker:0 trained alone: the script created kvstore 'device'; pass --kv-store dist_sync or -Dkvstore"),
    ([], 0, None, False, "worker:0 trained alone: the script created no kvstore; create it with "
                         "mx.kv.create(os.environ['PAI_MXNET_KVSTORE'])"),
    (["local", "dist_sync"], 0, None, False,
     "worker:0 pushed nothing to the servers: the script created kvstore 'dist_sync'"),
    (["dist_async"], 12, "kvstore", False, None),
])
def test_the_runner_names_why_a_worker_was_not_distributed(asked, pushes, flag, given, words):
    cause = mxnet_runner.not_distributed_cause("worker:0", asked, pushes, flag, given)
    assert cause == words if words is None else cause.startswith(words)


def test_the_master_keeps_success_but_says_why_or_fails_when_required():
    from paicli.cluster import distribution
    from paicli.jobplan import JobPlan, RolePlan
    from paicli.states import JobStatus

    tails = {"server:0": ["ps-lite: bye"],
             "worker:1": ["INFO:root:Epoch[0] Time cost=1.2",
                          "mxnet_runner: not distributed: worker:1 trained alone: the script created kvstore 'device'"],
             "worker:0": ["mxnet_runner: not distributed: worker:0 trained alone: the script created kvstore 'device'"]}
    plan = JobPlan("j", "mxnet", "MXNetTask", [RolePlan("worker", 2, ["x"])])
    status, reason = distribution.judge(plan, tails, JobStatus.SUCCEEDED, None)
    assert status == JobStatus.SUCCEEDED
    assert reason == "not distributed: worker:0, worker:1 trained alone: the script created kvstore 'device'"
    assert distribution.cause_of("Succeeded", reason).startswith("worker:0, worker:1 trained alone")
    different = {"worker:0": ["not distributed: worker:0 pushed nothing"], "ps:0": ["not distributed: averaged nothing"]}
    assert distribution.judge(plan, different, JobStatus.SUCCEEDED, None)[1] == \
        "not distributed: worker:0 pushed nothing | averaged nothing"
    # Nothing said, or a job that failed anyway: unchanged.
    assert distribution.judge(plan, {"worker:0": ["step=1"]}, JobStatus.SUCCEEDED, None) == (JobStatus.SUCCEEDED, None)
    assert distribution.judge(plan, tails, JobStatus.FAILED, "exit 1") == (JobStatus.FAILED, "exit 1")
    required = JobPlan("j", "mxnet", "MXNetTask",
                       [RolePlan("worker", 2, ["x"], env={"PAI_REQUIRE_DISTRIBUTED": "1"})])
    status, reason = distribution.judge(required, tails, JobStatus.SUCCEEDED, None)
    assert status == JobStatus.FAILED and reason.startswith("-DrequireDistributed=true: not distributed: worker:0, ")


def test_require_distributed_reaches_every_role():
    from paicli.adapters import get_adapter
    from paicli.adapters.base import StagedCode
    from paicli.spec import CORE_PARAMS, RawParam, build_spec

    adapter = get_adapter("mxnet")
    script = REPO / "examples" / "mxnet" / "gluon_dist_sync.py"
    raw = [RawParam("script", str(script), "-Dscript", REPO),
           RawParam("requireDistributed", "true", "-DrequireDistributed", REPO)]
    spec = build_spec("mxnet", raw, params=(*CORE_PARAMS, *adapter.params))
    plan = adapter.plan(spec, StagedCode(entry=script, root=None, cwd=REPO))
    assert all(role.env.get("PAI_REQUIRE_DISTRIBUTED") == "1" for role in plan.roles)


# ---------------------------------------------------------------------------
# solver_mode: GPU, the same for one worker and for many


def test_a_gpu_solver_runs_on_cpu_without_a_placed_gpu_and_on_the_gpu_with_one(tmp_path):
    from paicli.runners import caffe_runner as cr

    asked = []

    def works():
        asked.append(1)
        return True

    assert cr.solver_wants_gpu('net: "n"\n') and cr.solver_wants_gpu("solver_mode: GPU\n")
    assert not cr.solver_wants_gpu("solver_mode: CPU  # here\n")
    # The launcher's CUDA_VISIBLE_DEVICES: "" when no card is placed.
    assert not cr.gpus_placed({"CUDA_VISIBLE_DEVICES": ""}) and cr.gpus_placed({"CUDA_VISIBLE_DEVICES": "1"})
    device, note = cr.choose_device(True, False, works)
    assert device == "cpu" and note.startswith("solver_mode: GPU, but no GPU is placed") and not asked
    device, note = cr.choose_device(True, True, lambda: False)
    assert device == "cpu" and "cannot use the placed GPU" in note
    assert cr.choose_device(True, True, works) == ("gpu", None) and asked
    assert cr.choose_device(False, True, works) == ("cpu", None)

    # On CPU the job's copy of the solver says CPU; the user's file is unchanged.
    solver = tmp_path / "s.prototxt"
    solver.write_text('net: "n.prototxt"\nsolver_mode: GPU\nmax_iter: 5\n')
    args = cr.parse_args(["solve", "--solver", str(solver)])
    work = tmp_path / "w"
    work.mkdir()
    path, text = cr.prepare_solver(args, str(work), "cpu")
    assert path != str(solver) and cr.solver_field(text, "solver_mode") == "CPU"
    assert "solver_mode: GPU" in solver.read_text()
    assert cr.prepare_solver(args, str(work), "gpu")[0] == str(solver)


def test_the_verdict_line_of_a_job_that_was_not_distributed_is_not_ok():
    from paicli.jobview import verdict_line

    cause = "worker:0, worker:1 trained alone: the script created kvstore 'device'"
    assert verdict_line({"status": "Succeeded", "reason": None, "not_distributed": None}) == "OK"
    assert verdict_line({"status": "Succeeded", "reason": f"not distributed: {cause}",
                         "not_distributed": cause}) == f"NOT DISTRIBUTED (the job succeeded): {cause}"
