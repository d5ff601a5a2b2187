"""Pluto's model on fixed inputs: costs calibration cannot see (issue 21):
2bit compression's quantising CPU, probed once with MXNet's kernels."""

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
