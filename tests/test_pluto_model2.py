"""Pluto's cost model on fixed inputs: TensorFlow async's per-other-worker overhead
(model.overhead_terms), fitted by calibration and forecast for other clusters."""

from __future__ import annotations

import pytest

from paicli.cluster.pluto import calibrate, model
from paicli.cluster.pluto.strategy import GREEDY, ROUND_ROBIN, SLICED, Cluster, Node, Profile, Strategy

MB = 1e6
LINK_100M = 12.5e6   # bytes/s


def hosts(n: int = 7) -> Cluster:
    """The bench's test cluster: n one-core hosts on 100 Mbit/s links sharing 2 cores."""
    return Cluster(tuple(Node(f"h{i}", 1.0, LINK_100M) for i in range(n)), loopback_Bps=2e9,
                   source=f"{n} nodes", machine_cores=2)


# the sizes tf_wide_mlp.py's variables report, in creation order
TF_WIDE = (8.0, 81920.0, 2560.0, 1638400.0, 2560.0, 819200.0, 1280.0, 1280.0, 4.0)


def tf_async(fanin_s: float = 0.05, per_ps_s: float = 0.0) -> Profile:
    return Profile("tensorflow", param_bytes=sum(TF_WIDE), var_bytes=TF_WIDE, compute_s_per_sample=0.0,
                   batch_size=32, fanin_s=fanin_s, per_ps_s=per_ps_s, step_target=1296, target_global=True,
                   sync=False)


def test_overhead_terms_are_optimus_for_sync_and_other_workers_for_tensorflow_async():
    # counted from one worker and one ps (issue 21): both vanish on calibration's 1 + 1 run
    assert model.overhead_terms(Strategy("tensorflow", 2, 4, sync=False)) == (3.0, 1.0)
    assert model.overhead_terms(Strategy("tensorflow", 1, 1, sync=False)) == (0.0, 0.0)
    assert model.overhead_terms(Strategy("tensorflow", 2, 4, sync=True)) == (1.5, 1.0)
    assert model.overhead_terms(Strategy("mxnet", 4, 2)) == (0.25, 3.0)
    assert model.overhead_terms(Strategy("mxnet", 1, 1)) == (0.0, 0.0)
    assert model.overhead_terms(Strategy("caffe", 0, 1)) == (0.0, 0.0)


def test_async_forecast_adds_the_same_seconds_per_other_worker_whatever_the_ps_count():
    where = hosts()
    one = 2547212.0 / LINK_100M           # the whole model over one link, one way: 0.2038 s
    profile = tf_async(fanin_s=0.05, per_ps_s=0.0)
    # 2 ps greedy, 3 workers: the worker's own link is the limit (push + pull of the model);
    # the busiest ps holds 64% of it, 3 x 64% < 2 models. Plus 2 x 0.05 for the other workers.
    f = model.forecast(profile, Strategy("tensorflow", 2, 3, partition=GREEDY, sync=False), where)
    assert f.comm_s == pytest.approx(2 * one, rel=1e-9)
    assert f.step_s == pytest.approx(2 * one + 0.10, rel=1e-9)
    # 4 ps: the same 0.10 (the W/P shape would have halved it)
    f4 = model.forecast(profile, Strategy("tensorflow", 4, 3, partition=GREEDY, sync=False), where)
    assert f4.step_s - f4.comm_s == pytest.approx(0.10, rel=1e-9)
    # 1 ps, 3 workers: the ps link carries three models each way, then the 0.10
    f1 = model.forecast(profile, Strategy("tensorflow", 1, 3, partition=ROUND_ROBIN, sync=False), where)
    assert f1.step_s == pytest.approx(3 * one + 0.10, rel=1e-9)
    # one worker: nobody to collide with
    solo = model.forecast(profile, Strategy("tensorflow", 1, 1, sync=False), where)
    assert solo.step_s == pytest.approx(2 * one, rel=1e-9)


def test_the_fitted_per_worker_term_is_what_calibration_measured_between_one_and_two_workers():
    where = hosts()
    truth = tf_async(fanin_s=0.035, per_ps_s=0.004)
    runs = []
    for ps, workers in ((1, 1), (1, 2), (2, 1)):      # calibration's three runs
        s = model.default_strategy("tensorflow", ps, workers).with_(sync=False)
        runs.append(calibrate.Run(ps=ps, workers=workers, step_s=model.forecast(truth, s, where).step_s,
                                  var_bytes=TF_WIDE, global_step=True))
    facts = calibrate.ScriptFacts(step_target=1296, batch_size=32)
    got = calibrate.build_profile("tensorflow", runs, facts, where, sync=False)
    assert got.fanin_s == pytest.approx(0.035) and got.per_ps_s == pytest.approx(0.004)
    # and the forecast for a cluster calibration never ran: 2 ps greedy, 4 workers
    s = Strategy("tensorflow", 2, 4, partition=GREEDY, sync=False)
    shared = 4 * max(model.ps_loads(TF_WIDE, 2, GREEDY)) / LINK_100M   # the busiest ps' link, 4 workers
    assert model.forecast(got, s, where).step_s == pytest.approx(shared + 3 * 0.035 + 1 * 0.004, rel=1e-6)


def test_more_workers_still_reach_a_global_step_target_sooner_when_collisions_cost_less_than_a_step():
    where = hosts()
    profile = tf_async(fanin_s=0.05)
    per_target = [model.forecast(profile, Strategy("tensorflow", 2, w, partition=GREEDY, sync=False),
                                 where).time_to_target_s for w in (1, 2, 3)]
    assert per_target[0] > per_target[1] > per_target[2]


def test_the_default_plan_of_an_async_tensorflow_script_is_forecast_async():
    from paicli.cluster.pluto import planner

    where = hosts()
    profile = tf_async(fanin_s=0.03)
    user = model.default_strategy("tensorflow", 1, 3)     # what `pai plan` reads from the statement
    result = planner.plan(profile, where, user)
    as_run = model.forecast(profile, Strategy("tensorflow", 1, 3, sync=False), where)
    assert result.default.forecast.step_s == pytest.approx(as_run.step_s)
    # 1 ps, 3 workers async: the ps link carries three models each way, overlapped, + 2 x 0.03
    assert result.default.forecast.step_s == pytest.approx(3 * sum(TF_WIDE) / LINK_100M + 0.06, rel=1e-9)


# -- processor sharing and the compute fit (issue 21's held-out misses) ---------------------

def one_machine(n: int = 3, cores: float = 2.0, loopback: float = 2e9) -> Cluster:
    """n virtual hosts of one `cores`-core machine (one boot id), 1 Gbit/s links."""
    return Cluster(tuple(Node(f"h{i}", cores, 125e6, "boot", cores) for i in range(n)), loopback_Bps=loopback)


def test_cpu_groups_are_machines_of_one_boot_id_else_each_node():
    assert model.cpu_groups(one_machine(3)) == [([0, 1, 2], 2.0)]
    apart = Cluster((Node("a", 4.0, 125e6), Node("b", 2.0, 125e6)), loopback_Bps=2e9)
    assert model.cpu_groups(apart) == [([0], 4.0), ([1], 2.0)]
    assert model.cpu_groups(hosts(3)) == [([0, 1, 2], 2)]          # PAI_PLUTO_SHARED_CORES: one set


def test_every_instance_asks_cpu_for_its_compute_and_each_byte_it_moves():
    profile = Profile("mxnet", param_bytes=4 * MB, var_bytes=(4 * MB,), compute_s_per_sample=0.001, batch_size=10)
    where = one_machine(3, loopback=1e9)
    s = Strategy("mxnet", 1, 2)
    demand = model.cpu_demand(profile, s, where)
    byte = 0.5 / 1e9                       # half a loopback byte at each end
    # two workers: 10 ms compute each, which holds their own push and pull of 4 MB (the
    # 1 + 1 calibration run's wall step; sixth pass); the server moves both workers' 8 MB
    assert sum(demand) == pytest.approx(2 * 0.010 + 2 * 8 * MB * byte)
    # 2bit costs the same CPU: every value is quantised and dequantised
    assert model.cpu_demand(profile, s.with_(compression="2bit"), where) == pytest.approx(demand)


def test_many_processes_on_few_cores_are_priced_by_processor_sharing():
    """3 workers + 3 servers on one 2-core machine at 1 Gbit/s: each worker alone
    would step in its compute plus a little link time, but the machine does all six
    instances' work on 2 cores; the floor sets the step and names compute."""
    profile = Profile("mxnet", param_bytes=2 * MB, var_bytes=(MB, MB), compute_s_per_sample=0.0005, batch_size=32)
    # bytes cost CPU: a slow loopback (1e8, was 2e8 while the workers' own bytes were
    # charged on top of their compute too: the servers' bytes now bind the floor alone)
    where = one_machine(3, loopback=1e8)
    s = Strategy("mxnet", 3, 3, partition=SLICED, big_array_bound=100_000, compression="2bit")
    floor = model.cpu_floor(profile, s, where)
    work = 3 * 0.016 + 3 * 4 * MB * 0.5 / 1e8   # the workers' own bytes are in their compute
    assert floor == pytest.approx(work / 2)
    serial = (model.compute_seconds(profile, s, where) + model.comm_seconds(profile, s, where))
    assert serial < floor
    f = model.forecast(profile, s, where)
    assert f.step_s == pytest.approx(floor) and f.bottleneck == "compute"
    assert f.compute_s + f.comm_s + f.overhead_s == pytest.approx(f.step_s)
    # with the cores of three separate 2-core machines the floor is a third and does not bind
    apart = Cluster(tuple(Node(f"h{i}", 2.0, 125e6) for i in range(3)), loopback_Bps=1e9)
    assert model.cpu_floor(profile, s, apart) < model.forecast(profile, s, apart).step_s


def test_calibration_pins_compute_on_the_one_worker_run_when_another_run_beats_its_bytes():
    """The 2 + 1 run measured faster than its modelled communication (the held-out
    deep MLP: 0.015 s against 0.52 s of bytes). It used to drive the non-negative fit
    to compute 0 (no coefficient can lower a run below its bytes); it is left out,
    said so, and the 1 + 1 run's time outside communication is compute."""
    where = one_machine(3)
    var = (1 * MB, 1 * MB, 1 * MB)
    base = Profile("mxnet", param_bytes=3 * MB, var_bytes=var, batch_size=32)
    one = model.comm_seconds(base, Strategy("mxnet", 1, 1, partition="sliced"), where)
    two = model.comm_seconds(base, Strategy("mxnet", 1, 2, partition="sliced"), where)
    runs = [calibrate.Run(1, 1, one + 0.0128, var_bytes=var),
            calibrate.Run(1, 2, two + 0.0128 * 36 / 32 + 0.02, var_bytes=var),
            calibrate.Run(2, 1, 0.5 * model.comm_seconds(base, Strategy("mxnet", 2, 1, partition="sliced"), where),
                          var_bytes=var)]
    got = calibrate.build_profile("mxnet", runs, calibrate.ScriptFacts(batch_size=32), where)
    assert got.compute_s_per_sample == pytest.approx(0.0128 / 32)
    assert got.fanin_s == pytest.approx(0.02) and got.per_ps_s == 0.0
    assert any("2 + 1 calibration run" in note and "left out of the fit" in note for note in got.notes)


def test_pai_plan_says_which_calibration_run_the_fit_left_out():
    from paicli.cli_plan import render_text
    from paicli.cluster.pluto import planner
    from paicli.pluto import PlanResult

    where = one_machine(3)
    var = (1 * MB, 1 * MB)
    base = Profile("mxnet", param_bytes=2 * MB, var_bytes=var, batch_size=32)
    runs = [calibrate.Run(1, 1, 0.02, var_bytes=var), calibrate.Run(1, 2, 0.5, var_bytes=var),
            calibrate.Run(2, 1, 0.001, var_bytes=var)]
    profile = calibrate.build_profile("mxnet", runs, calibrate.ScriptFacts(batch_size=32), where)
    assert model.comm_seconds(base, Strategy("mxnet", 2, 1, partition=SLICED), where) > 0.001
    result = PlanResult(plan=planner.plan(profile, where, model.default_strategy("mxnet", 1, 2)), profile=profile,
                        cluster=where, cached=True, calibration_jobs=[])
    notes = [line for line in render_text(result) if line.startswith("  note: ")]
    assert len(notes) == 1 and "the 2 + 1 calibration run (0.0010 s/step)" in notes[0], notes
