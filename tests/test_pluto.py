"""Pluto: the cost model and the planner on fixed inputs (unit), calibration facts,
the cache, step timing, and `pai plan` on real jobs (errors are one clear line; the
forecast holds on a small real grid)."""

from __future__ import annotations

import json
import os
import stat
import statistics
from pathlib import Path

import pytest

from conftest import ROOT, pai
from paicli import steptime
from paicli.cluster.pluto import calibrate, model, planner
from paicli.cluster.pluto.strategy import GREEDY, ROUND_ROBIN, SLICED, Cluster, Node, Profile, Strategy

MB = 1e6
LINK_100M = 12.5e6   # bytes/s


def nodes(n: int, cores: float = 1.0, bandwidth: float = LINK_100M) -> Cluster:
    return Cluster(tuple(Node(f"h{i}", cores, bandwidth) for i in range(n)), loopback_Bps=2e9, source=f"{n} nodes")


# -- the model ------------------------------------------------------------------------


def test_round_robin_piles_alternating_weights_on_one_ps_and_greedy_balances_them():
    sizes = (4 * MB, 0.01 * MB, 4 * MB, 0.01 * MB, 2 * MB, 0.01 * MB)   # weight, bias, weight, ...
    assert model.ps_loads(sizes, 2, ROUND_ROBIN) == [10 * MB, 0.03 * MB]
    greedy = model.ps_loads(sizes, 2, GREEDY)
    assert max(greedy) <= 6.02 * MB and sum(greedy) == pytest.approx(sum(sizes))


def test_mxnet_slices_only_arrays_over_the_bound():
    sizes = (8 * MB, 1 * MB)   # 2M and 250k float32 elements
    assert model.ps_loads(sizes, 4, SLICED) == [3 * MB, 2 * MB, 2 * MB, 2 * MB]
    assert model.ps_loads(sizes, 4, SLICED, big_array_bound=10_000_000) == [8 * MB, 1 * MB, 0, 0]


def test_layout_spreads_services_then_fills_free_cores():
    ps, workers = model.layout(Strategy("tensorflow", 2, 3), nodes(4))
    assert ps == [0, 1] and workers == [2, 3, 0]


def test_communication_over_the_busiest_link():
    profile = Profile("tensorflow", param_bytes=10 * MB, var_bytes=(5 * MB, 5 * MB))
    one_ps = Strategy("tensorflow", 1, 2, sync=True)
    # 1 ps: its link carries both workers' pushes (20 MB in) then their pulls (20 MB out).
    assert model.comm_seconds(profile, one_ps, nodes(3)) == pytest.approx(2 * 20 * MB / LINK_100M)
    two_ps = Strategy("tensorflow", 2, 2, sync=True)
    # 2 ps with half each: every link carries 10 MB each way per phase.
    assert model.comm_seconds(profile, two_ps, nodes(4)) == pytest.approx(2 * 10 * MB / LINK_100M)


def test_2bit_shrinks_pushes_and_mxnet_overlaps_pulls_with_pushes():
    profile = Profile("mxnet", param_bytes=8 * MB, var_bytes=(4 * MB, 4 * MB))
    plain = Strategy("mxnet", 1, 1, partition=SLICED)
    packed = plain.with_(compression="2bit")
    t_plain = model.comm_seconds(profile, plain, nodes(2))
    t_packed = model.comm_seconds(profile, packed, nodes(2))
    # flow shop: push a1, then pull a1 while pushing a2, then pull a2 = 3 x 4 MB
    assert t_plain == pytest.approx(3 * 4 * MB / LINK_100M)
    assert t_packed == pytest.approx((4 * MB / 16 + 8 * MB) / LINK_100M)


def test_compute_slows_down_when_workers_share_cores():
    profile = Profile("tensorflow", param_bytes=0, compute_s_per_sample=0.001, batch_size=10)
    alone = model.compute_seconds(profile, Strategy("tensorflow", 1, 1), nodes(1, cores=4))
    crowded = model.compute_seconds(profile, Strategy("tensorflow", 1, 8), nodes(1, cores=4))
    assert alone == pytest.approx(0.01) and crowded == pytest.approx(0.01 * (8 + model.PS_CPU) / 4)
    shared = Cluster(nodes(8).nodes, machine_cores=2)
    assert model.compute_seconds(profile, Strategy("tensorflow", 1, 4), shared) == pytest.approx(
        0.01 * (4 + model.PS_CPU) / 2)


def test_calibration_fit_recovers_compute_fan_in_and_per_ps_terms_non_negative():
    rows = [[1.0, 1.0, 1.0], [1.125, 2.0, 1.0], [1.25, 0.5, 2.0]]
    truth = (0.1, 0.02, 0.01)
    ys = [sum(c * v for c, v in zip(truth, r)) for r in rows]
    assert calibrate.nnls(rows, ys) == pytest.approx(list(truth))
    # a run that came out faster than the others allow: no negative overhead
    fit = calibrate.nnls(rows, [0.2, 0.1, 0.25])
    assert all(v >= 0 for v in fit)


def test_build_profile_splits_measured_steps_into_compute_and_overheads():
    where = nodes(4)
    sizes = (1 * MB, 1 * MB)
    truth = Profile("mxnet", param_bytes=2 * MB, var_bytes=sizes, compute_s_per_sample=0.001, batch_size=10,
                    fanin_s=0.02, per_ps_s=0.005, step_target=100)
    runs = []
    for ps, workers in ((1, 1), (1, 2), (2, 1)):
        s = model.default_strategy("mxnet", ps, workers)
        runs.append(calibrate.Run(ps=ps, workers=workers, step_s=model.forecast(truth, s, where).step_s,
                                  var_bytes=sizes))
    facts = calibrate.ScriptFacts(step_target=100, batch_size=10)
    got = calibrate.build_profile("mxnet", runs, facts, where)
    assert got.param_bytes == 2 * MB and got.step_target == 100
    assert (got.compute_s_per_sample, got.fanin_s, got.per_ps_s) == pytest.approx((0.001, 0.02, 0.005))


def test_forecast_names_the_bottleneck_and_the_time_to_target():
    profile = Profile("tensorflow", param_bytes=40 * MB, var_bytes=(40 * MB,), compute_s_per_sample=1e-4,
                      batch_size=32, step_target=100, target_global=True, sync=False)
    f = model.forecast(profile, Strategy("tensorflow", 1, 2, sync=False), nodes(3))
    assert f.bottleneck == "network" and f.time_to_target_s == pytest.approx(50 * f.step_s)
    assert f.samples_per_s == pytest.approx(64 / f.step_s)


# -- the planner ------------------------------------------------------------------------


def comm_bound_mxnet() -> Profile:
    return Profile("mxnet", param_bytes=12 * MB, var_bytes=(4 * MB, 4 * MB, 4 * MB), compute_s_per_sample=1e-4,
                   batch_size=32, step_target=50)


def test_a_communication_bound_mxnet_job_gets_more_servers_and_2bit():
    user = model.default_strategy("mxnet", 1, 2)
    plan = planner.plan(comm_bound_mxnet(), nodes(7), user)
    rec = plan.recommended
    assert rec.strategy.ps > 1 and rec.strategy.compression == "2bit" and rec.strategy.workers == 2
    assert rec.forecast.step_s < plan.default.forecast.step_s / 1.5
    data = plan.to_json()
    assert set(data) >= {"recommended", "alternatives", "reasons"}
    assert set(data["recommended"]) >= {"cluster", "params", "forecast_step_s"}
    assert data["recommended"]["cluster"]["server"]["count"] == rec.strategy.ps
    assert data["recommended"]["params"]["gradientCompression"] == "2bit"
    assert any(r.startswith("compression: 2bit") for r in data["reasons"])
    assert all(c["forecast_step_s"] >= data["recommended"]["forecast_step_s"] * (1 - planner.TIE)
               for c in data["alternatives"])


def test_a_compute_bound_job_keeps_one_ps_and_no_compression():
    profile = Profile("mxnet", param_bytes=0.1 * MB, var_bytes=(0.1 * MB,), compute_s_per_sample=0.01,
                      batch_size=32, step_target=50)
    plan = planner.plan(profile, nodes(7), model.default_strategy("mxnet", 1, 2))
    assert plan.recommended.strategy.ps == 1 and plan.recommended.strategy.compression == "none"
    assert any("compression: none" in r for r in plan.reasons)


def test_tensorflow_greedy_placement_wins_when_round_robin_piles_up():
    sizes = (4 * MB, 0.004 * MB, 4 * MB, 0.004 * MB, 2 * MB, 0.004 * MB)
    profile = Profile("tensorflow", param_bytes=sum(sizes), var_bytes=sizes, compute_s_per_sample=1e-5,
                      batch_size=32, step_target=100, target_global=False, sync=False)
    # Async with 3 workers: the ps links, not the workers' own, are the limit.
    plan = planner.plan(profile, nodes(7), model.default_strategy("tensorflow", 1, 3))
    rec = plan.recommended.strategy
    assert rec.ps >= 2 and rec.partition == GREEDY
    assert plan.recommended.to_json()["params"] == {"psStrategy": "greedy"}
    assert any("greedy" in r for r in plan.reasons)


def test_a_global_step_target_lets_the_planner_choose_the_worker_count():
    profile = Profile("tensorflow", param_bytes=0.01 * MB, var_bytes=(0.01 * MB,), compute_s_per_sample=1e-3,
                      batch_size=32, step_target=1000, target_global=True, sync=False)
    plan = planner.plan(profile, nodes(8, cores=1), model.default_strategy("tensorflow", 1, 1))
    assert plan.recommended.strategy.workers > 1
    per_worker = Profile(**{**profile.to_dict(), "target_global": False, "var_bytes": (0.01 * MB,)})
    plan = planner.plan(per_worker, nodes(8, cores=1), model.default_strategy("tensorflow", 1, 3))
    assert {c.strategy.workers for c in [plan.recommended, *plan.alternatives]} == {3}


def test_budget_picks_the_cheapest_plan_that_meets_it_or_says_why_none_does():
    profile = comm_bound_mxnet()
    user = model.default_strategy("mxnet", 1, 2)
    fastest = planner.plan(profile, nodes(7), user)
    loose = planner.plan(profile, nodes(7), user, budget_s=fastest.default.forecast.time_to_target_s * 2)
    assert loose.meets_budget and loose.recommended.strategy.instances == 3   # 1 server + 2 workers
    tight = planner.plan(profile, nodes(7), user, budget_s=fastest.recommended.forecast.time_to_target_s / 10)
    assert tight.meets_budget is False and "no plan meets it" in tight.reasons[0]
    unknown = planner.plan(Profile(**{**profile.to_dict(), "step_target": None, "var_bytes": profile.var_bytes}),
                           nodes(7), user, budget_s=60)
    assert unknown.meets_budget is None and "step target is unknown" in unknown.reasons[0]


def test_caffe_averaging_period_shortest_within_reach_of_the_fastest():
    profile = Profile("caffe", param_bytes=2 * MB, var_bytes=(2 * MB,), compute_s_per_sample=1e-3, batch_size=64,
                      step_target=300)
    plan = planner.plan(profile, nodes(3), model.default_strategy("caffe", 1, 2))
    period = plan.recommended.strategy.ma_period
    best = min(c.forecast.step_s for c in [plan.recommended, *plan.alternatives])
    assert plan.recommended.forecast.step_s <= best * (1 + planner.TIE)
    assert all(c.strategy.ma_period >= period for c in plan.alternatives
               if c.forecast.step_s <= best * (1 + planner.TIE))
    assert plan.recommended.to_json()["params"] == {"maPeriod": period}


def test_caffe_rounds_are_anchored_on_the_measured_one():
    profile = Profile("caffe", param_bytes=1 * MB, var_bytes=(1 * MB,), compute_s_per_sample=1e-4, batch_size=10,
                      ma_exchange_s=0.5, ma_workers=2)
    where = nodes(5)
    two = model.forecast(profile, Strategy("caffe", 1, 2, ma_period=5), where)
    assert two.comm_s == pytest.approx(0.5 / 5)
    four = model.forecast(profile, Strategy("caffe", 1, 4, ma_period=5), where)
    assert four.comm_s == pytest.approx(0.5 * 2 / 5)     # the ps link carries twice the bytes
    assert model.forecast(profile, Strategy("caffe", 0, 1), where).comm_s == 0


def test_strategy_values_are_what_a_submit_takes():
    from paicli.spec import CORE_PARAMS, RawParam, build_spec
    from paicli.adapters import get_adapter

    for s in (Strategy("mxnet", 3, 2, partition=SLICED, big_array_bound=1000, compression="2bit"),
              Strategy("tensorflow", 2, 3, partition=GREEDY), Strategy("caffe", 1, 2, ma_period=5)):
        adapter = get_adapter(s.framework)
        raw = [RawParam("cluster", json.dumps(s.cluster_value()), "-Dcluster", ROOT)]
        raw += [RawParam(k, str(v), f"-D{k}", ROOT) for k, v in s.params().items()]
        spec = build_spec(adapter.name, raw, params=(*CORE_PARAMS, *adapter.params))
        assert spec.get("cluster") == s.cluster_value()


# -- calibration facts, the cache, step timing -------------------------------------------


def test_script_facts_prefer_arguments_then_flag_defaults_then_the_solver():
    source = 'p.add_argument("--steps", type=int, default=300)\np.add_argument("--batch_size", default=64)\n' \
             'flags.DEFINE_float("learning_rate", 0.05, "lr")\n'
    facts = calibrate.script_facts(["--steps=40"], source=source)
    assert (facts.step_target, facts.batch_size, facts.learning_rate) == (40, 64, 0.05)
    assert facts.where["step_target"] == "arguments"
    caffe = calibrate.script_facts([], solver="base_lr: 0.01\nmax_iter: 300\n",
                                   net='hdf5_data_param { source: "t.txt" batch_size: 64 shuffle: true }\n'
                                       'hdf5_data_param { source: "v.txt" batch_size: 128 }\n')
    assert (caffe.step_target, caffe.batch_size, caffe.learning_rate) == (300, 64, 0.01)


def test_reports_are_read_from_instance_logs(tmp_path):
    log = tmp_path / "worker-0.0.log"
    log.write_text('noise\npluto-report: {"kind":"variable","role":"worker","index":"0","name":"w","bytes":400}\n'
                   'pluto-report: {"kind":"variable","role":"worker","index":"0","name":"b","bytes":8}\n')
    other = tmp_path / "worker-1.0.log"
    other.write_text('pluto-report: {"kind":"variable","role":"worker","index":"1","name":"w","bytes":999}\n')
    assert calibrate.read_report([other, log]) == (400.0, 8.0)


def test_the_cache_is_private(tmp_path):
    calibrate.cache_put(tmp_path, "k", {"profile": {"framework": "mxnet", "param_bytes": 1.0}})
    path = calibrate.cache_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert calibrate.cache_get(tmp_path, "k")["profile"]["param_bytes"] == 1.0
    assert calibrate.cache_get(tmp_path, "other") is None


def test_step_seconds_drops_the_first_interval_and_restarts():
    points = [(0, 0.0), (10, 5.0), (20, 6.0), (30, 7.0), (0, 20.0), (10, 30.0), (20, 31.0)]
    assert steptime.instance_step_seconds(points) == pytest.approx(0.1)
    assert steptime.step_seconds({}, {"worker:0": {"iter_per_s": [50.0, 40.0, 50.0]}}) == pytest.approx(0.02)
    assert steptime.step_seconds({"worker:0": [(0, 0.0)]}, {}) is None


def test_learning_rate_helper_scales_linearly_with_warm_up(monkeypatch):
    from paicli.runners import pluto_helpers

    monkeypatch.setenv("PAI_PLUTO_LR_SCALE", "4")
    monkeypatch.setenv("PAI_PLUTO_WARMUP_STEPS", "10")
    assert pluto_helpers.learning_rate(0.1, 0) == pytest.approx(0.1)
    assert pluto_helpers.learning_rate(0.1, 5) == pytest.approx(0.25)
    assert pluto_helpers.learning_rate(0.1, 50) == pytest.approx(0.4)


# -- pai plan on real jobs ---------------------------------------------------------------


def test_plan_of_a_plain_python_job_is_one_clear_line(pai_home):
    result = pai("plan", "-name", "python", f"-Dscript={ROOT / 'examples' / 'python' / 'ps_worker.py'}")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pai plan plans tensorflow, mxnet, caffe jobs" in lines[0]
    assert "Traceback" not in result.stderr


def test_plan_with_a_bad_budget_is_one_clear_line(pai_home):
    result = pai("plan", "-name", "mxnet", f"-Dscript={ROOT / 'examples' / 'pluto' / 'mxnet_wide_mlp.py'}",
                 "--budget", "soon")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--budget" in result.stderr and "10m" in result.stderr


@pytest.mark.mxnet
def test_plan_of_a_script_that_fails_in_calibration_is_one_clear_line(pai_home, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('step=0, loss=1')\nsys.exit('no data here')\n")
    result = pai("plan", "-name", "mxnet", f"-Dscript={script}", timeout=300)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("pluto:")]
    assert len(lines) == 1 and "calibration: the script failed" in lines[0] and "pai logs" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("framework", ["mxnet", "tensorflow"])
def test_a_plan_calibrates_the_script_before_it_probes_the_runtime(pai_home, tmp_path, monkeypatch, framework):
    """The runtime's probes take ~5-20 s: a script that fails in calibration says so
    before any of them runs (before, a broken MXNet script's one line came after ~15 s)."""
    from paicli import client, pluto
    from paicli.errors import PaiError
    from paicli.statement import parse_statement

    probed = []
    for name in ("probe_quantize", "probe_update", "probe_kvstore", "probe_rpc"):
        monkeypatch.setattr(pluto, name, lambda name=name: probed.append(name) or None)

    def calibration_fails(*args, **kwargs):
        raise PaiError("calibration: the script failed")

    monkeypatch.setattr(pluto, "calibration_run", calibration_fails)
    monkeypatch.setattr(calibrate, "measure_loopback", lambda: 1e9)
    script = tmp_path / "train.py"
    script.write_text("print('step=0, loss=1')\n")
    prepared = client.prepare(parse_statement(["-name", framework, f"-Dscript={script}"]))
    with pytest.raises(PaiError, match="the script failed"):
        pluto.plan_prepared(prepared)
    assert probed == []
    # A calibration that went through: the probes run after it, before the profile is made.
    monkeypatch.setattr(pluto, "calibration_run", lambda *args, **kwargs: ("job", None))

    def profile_made(*args, **kwargs):
        raise RuntimeError("profile")

    monkeypatch.setattr(calibrate, "build_profile", profile_made)
    with pytest.raises(RuntimeError, match="profile"):
        pluto.plan_prepared(prepared)
    assert probed == (["probe_quantize", "probe_update", "probe_kvstore"] if framework == "mxnet" else ["probe_rpc"])


def test_plan_when_no_node_is_reachable_is_one_clear_line(pai_home, tmp_path, monkeypatch):
    import socket

    nodes_file = tmp_path / "nodes.yaml"
    # Nodes whose sshd is not there: ports on 127.0.0.1 that were free a moment ago
    # (no traffic leaves this machine).
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    nodes_file.write_text(json.dumps({"known_hosts": str(tmp_path / "known_hosts"),
                                      "nodes": [{"name": f"gone{i + 1}", "host": "127.0.0.1", "port": port,
                                                 "cpu": 100} for i, port in enumerate(ports)]}))
    (tmp_path / "known_hosts").write_text("")
    result = pai("plan", "-name", "mxnet", f"-Dscript={ROOT / 'examples' / 'pluto' / 'mxnet_wide_mlp.py'}",
                 env={"PAI_NODES": str(nodes_file)}, timeout=120)
    assert result.returncode in (1, 2), result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("pluto:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "gone1" in lines[0] and "gone2" in lines[0], lines[0]


@pytest.mark.mxnet
def test_plan_json_then_run_the_recommendation_forecast_holds(pai_home):
    """A small real grid on this machine: `pai plan --json` (calibrating through
    pai), then two of its plans run for real; the forecast is within the bench's
    stated error budget widened for a shared 2-core machine (50%), and a second
    plan is served from the cache."""
    script = ROOT / "examples" / "pluto" / "mxnet_wide_mlp.py"
    base = ["-name", "mxnet", f"-Dscript={script}", '-Dcluster={"server":{"count":1},"worker":{"count":2}}',
            "-DuserDefinedParameters=--steps=30 --width=300"]
    # --no-verify: the forecast itself is what this test holds to measurement (and what
    # -DautoStrategy=true, which does not verify, applies below)
    result = pai("plan", *base, "--json", "--no-verify", timeout=400)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["profile"]["param_bytes"] > 0.3e6 and data["calibration"]["cached"] is False
    errors = []
    for choice in (data["recommended"], data["default"]):
        run = pai("-name", "mxnet", f"-Dscript={script}",
                  f"-Dcluster={json.dumps(choice['cluster'])}", "-DuserDefinedParameters=--steps=30 --width=300",
                  *[f"-D{k}={v}" for k, v in choice["params"].items()], timeout=300)
        assert run.returncode == 0, run.stdout[-2000:]
        job = next(line[5:] for line in run.stdout.splitlines() if line.startswith("ID = "))
        status = json.loads(pai("status", job, "--json").stdout)
        assert status["step_seconds"] and status["step_seconds"] > 0
        errors.append(abs(choice["forecast_step_s"] - status["step_seconds"]) / status["step_seconds"])
    assert statistics.median(errors) <= 0.5, errors
    again = pai("plan", *base, "--json", "--no-verify", timeout=120)
    assert json.loads(again.stdout)["calibration"]["cached"] is True
    # -DautoStrategy=true applies the same recommendation (calibration cached) and tells
    # forecast against measurement at the end, in plan.json and in pai status.
    auto = pai(*base, "-DautoStrategy=true", timeout=300)
    assert auto.returncode == 0, auto.stdout[-2000:] + auto.stderr[-2000:]
    assert "Pluto: forecast" in auto.stdout and "measured" in auto.stdout
    job = next(line[5:] for line in auto.stdout.splitlines() if line.startswith("ID = "))
    status = json.loads(pai("status", job, "--json").stdout)
    assert status["pluto"]["cluster"] == data["recommended"]["cluster"]
    assert status["pluto"]["params"] == data["recommended"]["params"]
    plan_json = json.loads((Path(status["job_dir"]) / "plan.json").read_text())
    assert plan_json["pluto"]["forecast_step_s"] == data["recommended"]["forecast_step_s"]
    text = pai("status", job).stdout
    assert "Pluto plan:" in text and "Bytes per server" in text and "Pluto: forecast" in text


def _runtime_python(name: str) -> str:
    from paicli.runners.runtimes import get_runtime

    runtime = get_runtime(name)
    if not runtime.is_installed():
        pytest.skip(f"the {name} runtime is not provisioned")
    return runtime.python()


@pytest.mark.tensorflow
def test_greedy_placement_and_partitioners_inside_tensorflow(tmp_path):
    """pluto_helpers in the real TF runtime: replica_device_setter with the greedy
    strategy spreads alternating weights/biases by bytes (round-robin piles the
    weights on ps 0), sizes are reported, and the TF2 partitioner shards big variables."""
    import subprocess

    probe = tmp_path / "probe.py"
    probe.write_text('''
import json, os, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import pluto_helpers
tf.compat.v1.disable_eager_execution()
pluto_helpers.install_tensorflow(tf)
spec = {"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3"]}
out = {}
for mode in ("roundRobin", "greedy"):
    os.environ["PAI_TF_PS_STRATEGY"] = mode
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(cluster=spec)):
        for i, (rows, cols) in enumerate(((500, 500), (500, 400), (400, 300))):
            tf.compat.v1.get_variable(f"w{i}", [rows, cols])
            tf.compat.v1.get_variable(f"b{i}", [cols])
    out[mode] = {v.op.name: v.device for v in g.get_collection("variables")}
part = pluto_helpers.tf2_partitioner(tf, 2)
out["shards_big"] = list(part(tf.TensorShape([1000, 1000]), tf.float32))
out["shards_small"] = list(part(tf.TensorShape([10, 10]), tf.float32))
print("RESULT " + json.dumps(out))
''')
    env = {**os.environ, "PAI_PLUTO_REPORT": "stderr", "PAI_ROLE": "worker", "PAI_INDEX": "0",
           "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([_runtime_python("tensorflow"), str(probe), str(ROOT / "runners")],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(next(line[7:] for line in result.stdout.splitlines() if line.startswith("RESULT ")))

    def ps_bytes(devices):
        sizes = {"w0": 500 * 500, "b0": 500, "w1": 500 * 400, "b1": 400, "w2": 400 * 300, "b2": 300}
        loads = [0, 0]
        for name, device in devices.items():
            loads[int(device.split("task:")[1][0])] += sizes[name] * 4
        return loads

    rr, greedy = ps_bytes(data["roundRobin"]), ps_bytes(data["greedy"])
    assert min(rr) < 0.01 * max(rr)                  # every weight on one ps
    assert min(greedy) > 0.3 * max(greedy)           # spread by size
    assert data["shards_big"] == [2, 1] and data["shards_small"] == [1, 1]
    assert '"name":"w0"' in result.stderr and '"bytes":1000000.0' in result.stderr


def test_bandwidth_probe_measures_a_real_transfer_in_rounds(tmp_path):
    """runners/pluto_helpers.py bandwidth SECONDS ROUNDS: the ps sinks one connection a
    round, the worker sends and prints a line a round with bytes_per_s and
    cpu_ns_per_byte (what measure_links reads, every round); on loopback here."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    helper = str(ROOT / "runners" / "pluto_helpers.py")
    base = {**os.environ, "PAI_HOST": "127.0.0.1", "PAI_CLUSTER": json.dumps({"ps": [f"127.0.0.1:{port}"]})}
    sink = subprocess.Popen([sys.executable, helper, "bandwidth", "0.2", "3"],
                            env={**base, "PAI_ROLE": "ps", "PAI_PORT": str(port)})
    try:
        source = subprocess.run([sys.executable, helper, "bandwidth", "0.2", "3"], env={**base, "PAI_ROLE": "worker"},
                                capture_output=True, text=True, timeout=60)
        assert source.returncode == 0, source.stderr
        lines = source.stdout.splitlines()
        assert [line.split("round=")[1].split()[0] for line in lines] == ["1", "2", "3"], lines
        for line in lines:
            rate = float(line.split("bytes_per_s=")[1].split()[0])
            assert rate > 10e6   # loopback moves far more than 10 MB/s
            # and what moving them cost both ends' CPU: copies at least, far from a microsecond
            cpu_ns = float(line.split("cpu_ns_per_byte=")[1].split()[0])
            assert 0.01 < cpu_ns < 1000
        assert sink.wait(timeout=30) == 0   # it took all three rounds and ended
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()


def test_the_link_is_its_best_round_and_a_byte_costs_the_median_cpu():
    """One round of the probe read 729 Mbit/s on a 1 Gbit/s link where an hour earlier it
    read 884, and every forecast over those links moved with it (issue 21, fifth pass).
    Measured here (sixth pass, 4 virtual hosts at 1 Gbit/s, 5 rounds of 0.5 s): rounds
    of 858-947 Mbit/s with the machine idle, every round lower with 3 busy processes
    beside it (796-887), none faster: other load only slows a round. So the rate is the
    best round; the CPU a byte is the median (8.2-9.6 ns, either way)."""
    from paicli.pluto import LINK_ROUNDS, link_figures

    mbit = 1e6 / 8
    rate, cpu = link_figures([894 * mbit, 936 * mbit, 729 * mbit, 937 * mbit, 935 * mbit], [9.6, 9.9, 14.0, 9.4, 9.2])
    assert rate == 937 * mbit and cpu == 9.6
    # a round that moved nothing (the sink gone) says nothing; no rounds: no rate
    assert link_figures([0.0, 500 * mbit], [0.0, 8.0]) == (500 * mbit, 8.0)
    assert link_figures([], []) == (None, 0.0)
    assert LINK_ROUNDS >= 3   # a median and a best need rounds to choose from
