"""Pluto's optimizations applied to the unchanged script (issue 10, part 2): the
per-worker batch / learning-rate rule and sync vs async, chosen on fixed inputs
(unit), and applied values reaching real instances (a Caffe job's solver copy, an
MXNet script's kvstore and flags through -DautoStrategy=true)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, job_id_from, pai, pai_json
from paicli.cluster.pluto import model, planner
from paicli.cluster.pluto.strategy import SLICED, Cluster, Knobs, Node, Profile, Strategy

MB = 1e6
LINK_100M = 12.5e6


def nodes(n: int, cores: float = 1.0, bandwidth: float = LINK_100M) -> Cluster:
    return Cluster(tuple(Node(f"h{i}", cores, bandwidth) for i in range(n)), loopback_Bps=2e9, source=f"{n} nodes")


def reason(plan, head: str) -> str:
    return next(r for r in plan.reasons if r.startswith(head))


# -- the model: MXNet dist_async --------------------------------------------------------


def test_mxnet_async_overlaps_one_workers_traffic_with_the_others_compute():
    profile = Profile("mxnet", param_bytes=8 * MB, var_bytes=(4 * MB, 4 * MB), compute_s_per_sample=0.01,
                      batch_size=32)
    where = nodes(4)
    sync1, async1 = Strategy("mxnet", 1, 1, partition=SLICED), Strategy("mxnet", 1, 1, partition=SLICED, sync=False)
    # One worker: sync and async are the same thing.
    assert model.forecast(profile, async1, where).step_s == pytest.approx(model.forecast(profile, sync1, where).step_s)
    sync2 = Strategy("mxnet", 1, 2, partition=SLICED)
    async2 = sync2.with_(sync=False)
    # Two workers on one server: the server's link carries 2 x 8 MB each way. Sync waits
    # for both (pipelined: 1.92 s); async needs max(compute + own 0.96 s, shared 1.28 s).
    assert model.comm_seconds(profile, sync2, where) == pytest.approx(1.92)
    compute = model.compute_seconds(profile, async2, where)
    assert compute == pytest.approx(0.32)
    assert model.forecast(profile, async2, where).step_s == pytest.approx(max(compute + 0.96, 1.28))


# -- sync vs async: where both are the script's -------------------------------------------


COMM_BOUND = Profile("mxnet", param_bytes=8 * MB, var_bytes=(4 * MB, 4 * MB), compute_s_per_sample=0.01,
                     batch_size=32, step_target=100, learning_rate=0.05)


def test_async_is_chosen_and_applied_where_the_script_leaves_the_kvstore_to_pai():
    user = Strategy("mxnet", 1, 2, partition=SLICED)
    plan = planner.plan(COMM_BOUND, nodes(6), user, knobs=Knobs(sync_switch="-Dkvstore"))
    rec = plan.recommended
    assert not rec.strategy.sync and rec.strategy.params()["kvstore"] == "dist_async"
    line = reason(plan, "sync/async:")
    assert "async (-Dkvstore=dist_async), switched from the script's default sync" in line
    twin = planner.mode_twin(rec, [rec] + plan.alternatives)
    assert twin is not None and twin.strategy.sync and rec.score() <= twin.score() * 0.9
    # The learning rate is not scaled for async, and the line says why.
    assert "async applies each worker's update alone" in reason(plan, "batch/learning rate:")


def test_the_users_kvstore_is_kept_and_said():
    user = Strategy("mxnet", 1, 2, partition=SLICED)
    plan = planner.plan(COMM_BOUND, nodes(6), user,
                        knobs=Knobs(sync_switch=None, sync_pinned="-Dkvstore=dist_sync"))
    assert all(c.strategy.sync for c in [plan.recommended] + plan.alternatives)
    assert "kvstore" not in plan.recommended.strategy.params()
    assert reason(plan, "sync/async:") == "sync/async: sync, as you set it (-Dkvstore=dist_sync): kept"


def test_a_small_gain_keeps_the_scripts_default_mode():
    # Compute-bound: async saves next to nothing, so the default (sync) stays, applied explicitly.
    profile = Profile("mxnet", param_bytes=0.1 * MB, var_bytes=(0.1 * MB,), compute_s_per_sample=0.01,
                      batch_size=32, step_target=100)
    plan = planner.plan(profile, nodes(6), Strategy("mxnet", 1, 2, partition=SLICED),
                        knobs=Knobs(sync_switch="--kv-store"))
    rec = plan.recommended.strategy
    assert rec.sync and "--kv-store=dist_sync" in rec.script_flags
    assert rec.params()["userDefinedParameters"].endswith("--kv-store=dist_sync")
    assert "the script's default" in reason(plan, "sync/async:") and "under the 10%" in reason(plan, "sync/async:")


def test_one_worker_has_nothing_to_choose():
    plan = planner.plan(COMM_BOUND, nodes(4), Strategy("mxnet", 1, 1, partition=SLICED),
                        knobs=Knobs(sync_switch="-Dkvstore"))
    assert all(c.strategy.sync for c in [plan.recommended] + plan.alternatives)
    assert "one worker, so sync and async are the same thing" in reason(plan, "sync/async:")


def test_tensorflow_global_step_target_keeps_the_mode():
    profile = Profile("tensorflow", param_bytes=8 * MB, var_bytes=(4 * MB, 4 * MB), compute_s_per_sample=0.001,
                      batch_size=32, step_target=120, target_global=True, sync=False)
    knobs = Knobs(sync_switch="--sync_replicas", sync_flag_negation="--nosync_replicas")
    assert not planner.switchable(profile, knobs)
    plan = planner.plan(profile, nodes(6), Strategy("tensorflow", 1, 2, sync=False), knobs=knobs)
    assert all(not c.strategy.sync for c in [plan.recommended] + plan.alternatives)
    assert "would change what global_step counts" in reason(plan, "sync/async:")
    # A per-worker target: both modes are forecast; a flag on by default needs its negation.
    per_worker = Profile(**{**profile.to_dict(), "target_global": False, "var_bytes": (4 * MB, 4 * MB)})
    assert planner.switchable(per_worker, knobs)
    assert not planner.switchable(Profile(**{**per_worker.to_dict(), "sync": True, "var_bytes": ()}),
                                  Knobs(sync_switch="--sync_replicas"))


# -- batch / learning rate -------------------------------------------------------------------


def test_caffe_scales_base_lr_linearly_with_a_warm_up():
    profile = Profile("caffe", param_bytes=1 * MB, var_bytes=(1 * MB,), compute_s_per_sample=0.0005, batch_size=64,
                      step_target=300, learning_rate=0.01, ma_exchange_s=0.2, ma_workers=2)
    user = Strategy("caffe", 1, 4, ma_period=20)
    plan = planner.plan(profile, nodes(6), user, knobs=Knobs())
    params = plan.recommended.strategy.params()
    assert params["learningRate"] == pytest.approx(0.04) and params["warmupIterations"] == 15
    assert "batchSize" not in params          # the per-worker batch is kept
    line = reason(plan, "batch/learning rate:")
    assert "per-worker batch 64 kept (global batch 4 x 64 = 256)" in line and "base_lr 0.01 -> 0.04" in line
    # The user's own rate, an adaptive solver, one worker: kept, and said.
    assert "you set it" in planner.apply_scaling(user, profile, Knobs(lr_pinned=True))[1]
    kept, line = planner.apply_scaling(user, profile, Knobs(solver_type="Adam"))
    assert kept.learning_rate is None and "adapts its own step size" in line
    assert "one worker" in planner.apply_scaling(user.with_(workers=1, ps=0), profile, Knobs())[1]


def test_mxnet_gluon_sums_already_and_module_gets_the_flag():
    user = Strategy("mxnet", 1, 2, partition=SLICED)
    summed, line = planner.apply_scaling(user, COMM_BOUND, Knobs(lr_flag="--lr", aggregation="sum"))
    assert summed == user and "SUMS the 2 workers' gradients" in line
    mean, line = planner.apply_scaling(user, COMM_BOUND, Knobs(lr_flag="--lr", aggregation="mean"))
    assert mean.script_flags == ("--lr=0.1",) and "Module API averages" in line
    assert mean.with_(user_args="--width 8").params()["userDefinedParameters"] == "--width 8 --lr=0.1"


def test_tensorflow_sync_without_a_flag_names_the_helper_and_sets_its_scale():
    profile = Profile("tensorflow", param_bytes=1 * MB, var_bytes=(1 * MB,), compute_s_per_sample=0.001,
                      batch_size=32, step_target=400, sync=True, learning_rate=0.02)
    s, line = planner.apply_scaling(Strategy("tensorflow", 1, 4), profile, Knobs())
    assert s.params()["lrScale"] == 4.0 and s.params()["warmupSteps"] == 20
    assert "lr = pluto_helpers.learning_rate(base_lr, step)" in line
    s, line = planner.apply_scaling(Strategy("tensorflow", 1, 4), profile, Knobs(lr_flag="--learning_rate"))
    assert s.script_flags == ("--learning_rate=0.08",) and "SyncReplicasOptimizer averages" in line
    # Async TF: nothing combined, nothing scaled.
    s, line = planner.apply_scaling(Strategy("tensorflow", 1, 4, sync=False), profile, Knobs(lr_flag="--lr"))
    assert not s.script_flags and "async" in line


def test_the_helper_reads_what_the_plan_sets(monkeypatch):
    from paicli.runners import pluto_helpers

    monkeypatch.setenv("PAI_PLUTO_LR_SCALE", "4.0")
    monkeypatch.setenv("PAI_PLUTO_WARMUP_STEPS", "20")
    assert pluto_helpers.learning_rate(0.02, 10) == pytest.approx(0.05)
    assert pluto_helpers.learning_rate(0.02, 20) == pytest.approx(0.08)


def test_script_knobs_read_the_scripts_flags_and_the_users_pins(tmp_path):
    from paicli import client
    from paicli.pluto import script_inputs, script_knobs, tf_sync
    from paicli.statement import parse_statement

    mx_script = tmp_path / "mx.py"
    mx_script.write_text('import argparse, os\np = argparse.ArgumentParser()\np.add_argument("--lr", type=float, '
                         'default=0.05)\np.add_argument("--kv-store", default="dist_sync")\n'
                         'trainer = gluon.Trainer(params, "sgd")\n')
    tf_script = tmp_path / "tf.py"
    tf_script.write_text('from absl import flags\nflags.DEFINE_boolean("sync_replicas", False, "sync")\n'
                         'flags.DEFINE_float("learning_rate", 0.01, "lr")\n')

    def knobs(*statement):
        prepared = client.prepare(parse_statement(list(statement)))
        facts, _files, args = script_inputs(prepared)
        return script_knobs(prepared, facts, args), prepared, args

    k, _, _ = knobs("-name", "mxnet", f"-Dscript={mx_script}", "-DuserDefinedParameters=--width 8")
    assert (k.lr_flag, k.sync_switch, k.sync_pinned, k.aggregation, k.user_args) == \
        ("--lr", "--kv-store", None, "sum", "--width 8")
    k, _, _ = knobs("-name", "mxnet", f"-Dscript={mx_script}", "-DuserDefinedParameters=--kv-store dist_async --lr 1")
    assert k.sync_pinned == "--kv-store dist_async" and k.sync_switch is None and k.lr_pinned and k.lr_flag is None
    k, _, _ = knobs("-name", "mxnet", f"-Dscript={ROOT / 'examples' / 'pluto' / 'mxnet_wide_mlp.py'}",
                    "-Dkvstore=dist_sync")
    assert k.sync_pinned == "-Dkvstore=dist_sync"
    k, prepared, args = knobs("-name", "tensorflow", f"-Dscript={tf_script}")
    assert (k.sync_switch, k.sync_flag_negation, k.lr_flag) == ("--sync_replicas", "--nosync_replicas",
                                                                 "--learning_rate")
    assert tf_sync(prepared, args) is False
    k, prepared, args = knobs("-name", "tensorflow", f"-Dscript={tf_script}", "-DuserDefinedParameters=--sync_replicas")
    assert k.sync_pinned == "--sync_replicas" and tf_sync(prepared, args) is True


def test_a_caffe_users_batch_and_rate_are_the_plans_facts_and_pin_the_rate():
    from paicli import client
    from paicli.pluto import script_inputs, script_knobs
    from paicli.statement import parse_statement

    solver = ROOT / "examples" / "caffe" / "mlp" / "mlp_solver.prototxt"
    prepared = client.prepare(parse_statement(["-name", "caffe", f"-Dsolver={solver}"]))
    facts, _files, args = script_inputs(prepared)
    assert (facts.batch_size, facts.learning_rate) == (64, 0.01)
    assert not script_knobs(prepared, facts, args).lr_pinned
    prepared = client.prepare(parse_statement(["-name", "caffe", f"-Dsolver={solver}", "-DbatchSize=16",
                                               "-DlearningRate=0.03"]))
    facts, _files, args = script_inputs(prepared)
    assert (facts.batch_size, facts.learning_rate) == (16, 0.03) and facts.where["batch_size"] == "-DbatchSize"
    assert script_knobs(prepared, facts, args).lr_pinned


# -- applied values reach real instances ------------------------------------------------------


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The Caffe MLP example with its data, and a 40-iteration solver."""
    from paicli.runners.runtimes import get_runtime

    runtime = get_runtime("caffe")
    if not runtime.is_installed():
        pytest.skip("the Caffe runtime is not built (sudo pai runtime install caffe)")
    folder = tmp_path_factory.mktemp("g_caffe") / "mlp"
    shutil.copytree(ROOT / "examples" / "caffe" / "mlp", folder, ignore=shutil.ignore_patterns("data", "snapshots"))
    subprocess.run([runtime.python(), str(folder / "make_data.py")], check=True, timeout=120,
                   stdout=subprocess.DEVNULL)
    text = (folder / "mlp_solver.prototxt").read_text()
    for name, value in (("max_iter", 40), ("display", 10), ("snapshot", 0), ("test_interval", 1000)):
        text = re.sub(rf"^{name}:.*$", f"{name}: {value}", text, flags=re.M)
    (folder / "short_solver.prototxt").write_text(text)
    return folder


def test_caffe_job_trains_with_the_scaled_rate_and_batch_in_its_own_copies(pai_home, mlp):
    solver, net = mlp / "short_solver.prototxt", mlp / "mlp_train_test.prototxt"
    before = (solver.read_text(), net.read_text())
    result = pai("-name", "caffe", f"-Dsolver={solver}", '-Dcluster={"ps":{"count":1},"worker":{"count":2}}',
                 "-DmaPeriod=10", "-DlearningRate=0.02", "-DbatchSize=32", "-DwarmupIterations=20", timeout=240)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # Caffe's own account of the solver and net it built (worker 0, the root solver):
    params = out[out.index("[worker:0]", out.index("Initializing solver from parameters")):]
    assert re.search(r"\[worker:0\] base_lr: 0\.02\b", params), params[:2000]
    assert re.search(r"\[worker:0\] .*Top shape: 32 16 \(512\)", out)   # the training batch, 32 of 16 features
    # The warm-up ramp, from base_lr / 2 at iteration 0 up to base_lr at 20.
    ramp = [float(x) for x in re.findall(r"\[worker:0\] pluto: warm-up at iteration \d+: learning rate x([\d.]+)", out)]
    assert ramp and ramp[0] == pytest.approx(0.5) and ramp == sorted(ramp) and max(ramp) < 1.0
    assert (solver.read_text(), net.read_text()) == before   # the user's files are unchanged
    # ...and the averaged model still learns at the doubled rate.
    metrics = pai_json("status", job_id_from(out))["metrics"]["worker:0"]
    assert metrics["averaged_loss"] < metrics["starting_loss"] * 0.8, metrics


KV_SCRIPT = '''"""A tiny MXNet dist job that prints what it was given."""
import argparse
import time

import mxnet as mx

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--kv-store", default="dist_sync")
args = p.parse_args()
kv = mx.kv.create(args.kv_store)
print(f"kvstore={kv.type} lr={args.lr} steps={args.steps}", flush=True)
kv.set_optimizer(mx.optimizer.SGD(learning_rate=args.lr))   # async servers apply updates themselves
w = mx.nd.zeros((1000,))
kv.init(0, w)
for step in range(args.steps):
    kv.push(0, mx.nd.ones((1000,)))
    kv.pull(0, out=w)
    w.wait_to_read()
    print(f"step={step}", flush=True)
    time.sleep(0.05)
mx.nd.waitall()
'''


def test_auto_strategy_switches_an_mxnet_script_to_async_through_its_own_flag(pai_home, tmp_path):
    """-DautoStrategy=true on a script that takes its kvstore from --kv-store (left
    unset): with a calibration cached for a communication-bound profile, Pluto picks
    dist_async, the script sees --kv-store=dist_async after the user's own
    arguments, and plan.json records it."""
    import os

    from paicli import client
    from paicli.pluto import script_inputs, script_knobs, user_strategy
    from paicli.statement import parse_statement

    script = tmp_path / "kv.py"
    script.write_text(KV_SCRIPT)
    statement = ["-name", "mxnet", f"-Dscript={script}", '-Dcluster={"server":{"count":1},"worker":{"count":2}}',
                 "-DuserDefinedParameters=--steps 6"]
    prepared = client.prepare(parse_statement(statement))
    facts, files, args = script_inputs(prepared)
    cores = float(len(os.sched_getaffinity(0)))
    here = Cluster((Node("local", cores, 2e9),), loopback_Bps=2e9, source="this machine")
    # 400 MB over loopback with 0.5 s of compute: sync waits 0.6 s per step on the
    # transfers, async overlaps one worker's with the other's compute.
    profile = Profile("mxnet", param_bytes=400 * MB, var_bytes=(200 * MB, 200 * MB),
                      compute_s_per_sample=0.5 / 32 / max(1.0, 2.25 / cores), batch_size=32, step_target=6)
    knobs = script_knobs(prepared, facts, args)
    assert knobs.sync_switch == "--kv-store"
    expected = planner.plan(profile, here, user_strategy("mxnet", prepared.spec), knobs=knobs).recommended
    assert not expected.strategy.sync, expected.strategy.label()
    out = auto_strategy_with_calibration(statement, prepared, files, args, here, profile)
    seen = re.findall(r"\[worker:\d\] kvstore=(\S+) lr=(\S+) steps=(\d+)", out)
    assert seen == [("dist_async", "0.05", "6")] * 2, out
    job = pai_json("status", job_id_from(out))
    plan_json = json.loads((Path(job["job_dir"]) / "plan.json").read_text())["pluto"]
    assert plan_json["params"]["userDefinedParameters"] == "--steps 6 --kv-store=dist_async"
    assert any(r.startswith("sync/async: async (--kv-store=dist_async), switched") for r in plan_json["reasons"])


def test_auto_strategy_scales_a_caffe_jobs_rate_in_its_solver_copy(pai_home, mlp):
    """-DautoStrategy=true on a 2-worker Caffe job (calibration cached): the plan's
    -DlearningRate (2 x the solver's 0.01) and warm-up reach Caffe's own solver."""
    import os

    from paicli import client
    from paicli.pluto import script_inputs
    from paicli.statement import parse_statement

    statement = ["-name", "caffe", f"-Dsolver={mlp / 'short_solver.prototxt'}",
                 '-Dcluster={"ps":{"count":1},"worker":{"count":2}}']
    prepared = client.prepare(parse_statement(statement))
    facts, files, args = script_inputs(prepared)
    assert (facts.learning_rate, facts.batch_size, facts.step_target) == (0.01, 64, 40)
    here = Cluster((Node("local", float(len(os.sched_getaffinity(0))), 2e9),), loopback_Bps=2e9)
    profile = Profile("caffe", param_bytes=0.01 * MB, var_bytes=(0.01 * MB,), compute_s_per_sample=1e-5,
                      batch_size=64, step_target=40, learning_rate=0.01, ma_exchange_s=0.001, ma_workers=2)
    out = auto_strategy_with_calibration(statement, prepared, files, args, here, profile)
    params = out[out.index("[worker:0]", out.index("Initializing solver from parameters")):]
    assert re.search(r"\[worker:0\] base_lr: 0\.02\b", params), params[:2000]
    assert re.search(r"\[worker:1\] pluto: learning-rate warm-up over 2 iterations", out)
    job = pai_json("status", job_id_from(out))
    pluto = json.loads((Path(job["job_dir"]) / "plan.json").read_text())["pluto"]
    assert pluto["params"]["learningRate"] == 0.02 and pluto["params"]["warmupIterations"] == 2
    assert any(r.startswith("batch/learning rate: per-worker batch 64 kept") for r in pluto["reasons"])


def auto_strategy_with_calibration(statement, prepared, files, args, here, profile) -> str:
    """Submit with -DautoStrategy=true over a calibration seeded in the cache (so
    the test runs one job, not calibration's three); the job's output."""
    import os

    from paicli.pluto import calibration_key
    from paicli.cluster.pluto import calibrate

    # the probed CPU costs seeded as none, so the plan is the one the test computed on `here`
    calibrate.cache_put(Path(os.environ["PAI_HOME"]), calibration_key(prepared, files, args, here),
                        {"profile": profile.to_dict(), "runs": [], "jobs": [], "loopback_Bps": 2e9,
                         "links_Bps": None, "quantize_s_per_value": 0.0, "update_s_per_value": 0.0,
                         "kvstore_s_per_value": {}, "rpc": {}})
    result = pai(*statement, "-DautoStrategy=true", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_library_submit_of_an_unplanned_auto_strategy_job_is_refused(pai_home):
    """-DautoStrategy=true is applied by the statement submit (pai, pai run, the
    console) through paicli.pluto, so client.submit no longer imports a command
    module; a library caller that skips planning is told, and nothing is left."""
    from paicli import client
    from paicli.errors import UsageError
    from paicli.statement import parse_statement
    from paicli.store import Store

    stmt = parse_statement(["-name", "tensorflow", f"-Dscript={ROOT / 'examples' / 'pluto' / 'tf_wide_mlp.py'}",
                            "-DautoStrategy=true"])
    store = Store()
    with pytest.raises(UsageError, match="pluto.auto_strategy"):
        client.submit(client.prepare(stmt), store)
    assert store.jobs(10) == [] and list(store.jobs_dir.iterdir()) == []
