"""Pluto's model on fixed inputs: costs calibration cannot see (issue 21):
2bit compression's quantising CPU, probed once with MXNet's kernels, and the
per-server overhead, charged only for servers across a link."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paicli.cluster.pluto import calibrate, model
from paicli.cluster.pluto.strategy import SLICED, Cluster, Node, Profile, Strategy

MB = 1e6


def one_machine(n: int = 3, cores: float = 2.0, quantize: float = 0.0) -> Cluster:
    """n virtual hosts of one `cores`-core machine (one boot id), 1 Gbit/s links."""
    return Cluster(tuple(Node(f"h{i}", cores, 125e6, "boot", cores) for i in range(n)), loopback_Bps=1e9,
                   quantize_s_per_value=quantize)


def test_2bit_quantising_is_charged_in_the_step_and_on_both_ends_cores():
    profile = Profile("mxnet", param_bytes=40 * MB, var_bytes=(20 * MB, 20 * MB), compute_s_per_sample=0.001,
                      batch_size=10, sync=False)
    packed = Strategy("mxnet", 2, 3, partition=SLICED, compression="2bit", sync=False)
    free, priced = one_machine(), one_machine(quantize=2e-9)
    per_push = 2e-9 * 10e6                   # 10 M float32 values, quantised and dequantised
    assert model.quantize_seconds(profile, packed, priced) == pytest.approx(per_push)
    # half on each worker, the other half on the servers for every worker's push
    extra = sum(model.cpu_demand(profile, packed, priced)) - sum(model.cpu_demand(profile, packed, free))
    assert extra == pytest.approx(3 * per_push)
    gained = model.forecast(profile, packed, priced).step_s - model.forecast(profile, packed, free).step_s
    assert gained == pytest.approx(per_push)
    # an uncompressed plan costs what it did
    plain = packed.with_(compression="none")
    assert model.forecast(profile, plain, priced) == model.forecast(profile, plain, free)
    assert model.quantize_seconds(profile, plain, priced) == 0.0


def test_the_quantise_probe_runs_mxnet_and_says_zero_when_it_cannot(tmp_path):
    from paicli.runners import pluto_helpers
    from paicli.runners.runtimes import get_runtime

    assert calibrate.measure_quantize(str(tmp_path / "no-python"), pluto_helpers.__file__) == 0.0
    runtime = get_runtime("mxnet")
    if not runtime.is_installed():
        pytest.skip("the mxnet runtime is not provisioned")
    cost = calibrate.measure_quantize(runtime.python(), pluto_helpers.__file__)
    # MXNet's kernels: nanoseconds per value, far from free and far from Python's speed
    assert 1e-11 < cost < 1e-7


def spread(n: int, cores: float) -> Cluster:
    return Cluster(tuple(Node(f"h{i}", cores, 125e6) for i in range(n)), loopback_Bps=2e9, source=f"{n} nodes")


def test_the_per_server_overhead_is_charged_only_for_servers_across_a_link():
    profile = Profile("tensorflow", param_bytes=4 * MB, var_bytes=(1 * MB,) * 4, compute_s_per_sample=0.0,
                      batch_size=10, per_ps_s=0.010, sync=False)
    three = Strategy("tensorflow", 3, 1, sync=False)
    # one-core nodes: the worker is on a node of its own, all three ps across a link
    apart = spread(4, 1.0)
    assert model.layout(three, apart) == ([0, 1, 2], [3])
    assert model.overhead_terms(three, apart) == (0.0, 2.0)
    # two-core nodes: one ps beside the worker, two across: one round trip beyond the first
    beside = spread(4, 2.0)
    assert model.layout(three, beside) == ([0, 1, 2], [0])
    assert model.overhead_terms(three, beside) == (0.0, 1.0)
    assert model.forecast(profile, three, apart).overhead_s - model.forecast(profile, three, beside).overhead_s \
        == pytest.approx(0.010)
    # every ps on the worker's one node: no link round trip, nothing charged
    big = spread(1, 8.0)
    assert model.overhead_terms(three, replace(big, nodes=big.nodes + (Node("h1", 8.0, 125e6),))) == (0.0, 0.0)
    # one node alone: what calibration there measured is loopback round trips, every ps counts
    assert model.overhead_terms(three, big) == (0.0, 2.0)
    assert model.overhead_terms(three) == (0.0, 2.0)


def test_calibration_fits_the_per_server_term_on_the_runs_servers_across_a_link():
    """A 2 ps + 1 worker run whose second ps is beside the worker says nothing about
    link round trips: the fit leaves the term at 0 instead of charging its extra
    step to every server of a plan."""
    beside = spread(3, 2.0)
    two = Strategy("tensorflow", 2, 1, sync=False)
    assert model.layout(two, beside) == ([0, 1], [0])
    assert model.overhead_terms(two, beside) == (0.0, 0.0)
    assert model.overhead_terms(two, spread(3, 1.0)) == (0.0, 1.0)
    tiny = (1000.0, 1000.0)
    runs = [calibrate.Run(ps=ps, workers=w, step_s=step, var_bytes=tiny, global_step=True)
            for ps, w, step in ((1, 1, 0.010), (1, 2, 0.012), (2, 1, 0.016))]
    facts = calibrate.ScriptFacts(step_target=100, batch_size=10)
    assert calibrate.build_profile("tensorflow", runs, facts, beside, sync=False).per_ps_s == 0.0
    assert calibrate.build_profile("tensorflow", runs, facts, spread(3, 1.0), sync=False).per_ps_s > 0.004
