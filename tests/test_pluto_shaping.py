"""Honest link shaping for Pluto's measurements (issue 21), and its unit test.

tests/netns.py shapes a test host's link with `tbf burst 256kb`: the bucket holds
256 KB, refilled in 21 ms at 100 Mbit/s, so any step that moves less than that
between two refills crosses the link at veth speed, unshaped. Held-out rows that
move ~176 KB a step then measured several times faster than a 100 Mbit/s link
allows, and the forecast (which trusts the rate) looked 170% off when the link
was the one lying. `shape_links` re-shapes every host with a bucket of at most
0.2 ms of the rate (never under 16 KB, so the timer is not asked for more than
~10 000 refills a second): a step of 176 KB sees at most 16 KB of it unshaped.
The kernel here has no netem, so tbf it stays. bench/bench_pluto.py and
tests/test_pluto_cluster.py shape through this.
"""

from __future__ import annotations

import re

BUCKET_S = 0.0002          # the bucket holds this much of the rate...
MIN_BURST = 16 * 1024      # ...but never less than this (bytes)
QUEUE_S = 0.05             # packets wait at most this long before tbf drops them


def rate_bytes(rate: str) -> float:
    """tc's rate spelling (100mbit, 1gbit, 500kbit) as bytes per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"expected a rate such as 100mbit or 1gbit, not {rate!r}")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)] / 8


def tbf_burst(rate: str) -> int:
    """The bucket (bytes) for `rate`: 0.2 ms of it, at least 16 KB."""
    return max(MIN_BURST, int(rate_bytes(rate) * BUCKET_S))


def tbf_argv(rate: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", str(tbf_burst(rate)), "latency", f"{int(QUEUE_S * 1000)}ms"]


def shape_links(cluster, rate: str) -> None:
    """Every host's link, both directions, at `rate` with an honest bucket."""
    from netns import IP, TC, _run

    for host in cluster.hosts:
        for argv in ([TC, "qdisc", "replace", "dev", host.veth, "root"],
                     [IP, "netns", "exec", host.netns, TC, "qdisc", "replace", "dev", "eth0", "root"]):
            _run([*argv, *tbf_argv(rate)])


def test_the_bucket_is_far_smaller_than_a_small_step():
    # a step of 176 KB at 100 Mbit/s takes 14 ms on the link: the bucket lets at most
    # 16 KB (9%) of it through unshaped, where netns' 256 KB let all of it
    assert tbf_burst("100mbit") == MIN_BURST
    assert tbf_burst("100mbit") < 0.1 * 176e3
    assert tbf_burst("1gbit") == 25000          # 0.2 ms of 125 MB/s
    assert tbf_argv("100mbit") == ["tbf", "rate", "100mbit", "burst", "16384", "latency", "50ms"]
    assert rate_bytes("500kbit") == 62500.0
