#!/usr/bin/env python3
"""MXNet benchmark: submit -> first training step, through `pai` vs by hand.

    .venv/bin/python bench/bench_mxnet.py                 # 5 pairs, 1 server + 2 workers
    .venv/bin/python bench/bench_mxnet.py --reps 9 --json out.json

What is timed, in both arms, from just before the first process is started to
the moment this script reads the first `step=0` line of any worker:

  pai   `pai -name mxnet -Dscript=examples/mxnet/gluon_dist_sync.py -Dcluster=
        {"server":1,"worker":2}` attached, stdout on a pipe read here (so the
        figure includes the CLI's start, staging, the supervisor, port
        assignment and the log tail's delay);
  hand  the same four processes (scheduler, server, two workers) started here
        with subprocess: the MXNet runtime's python running runners/mxnet_runner.py
        with the PAI_* variables set as the launcher would, worker stdout on
        pipes read here.

Both arms run the job to its end before the next one starts; the arms alternate
so that load drift on the shared 2-core machine hits both alike. The figure is
the ratio of medians (pai / hand); the issue's goal is <= 1.05. The median of the
paired ratios and of the paired differences are printed beside it. The load average
is printed before and after, since other work on the machine moves the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "mxnet" / "gluon_dist_sync.py"
RUNNER = REPO / "runners" / "mxnet_runner.py"
PAI = Path(sys.executable).with_name("pai")
GOAL = 1.05
FIRST_STEP = b"step=0,"


def mxnet_python() -> str:
    sys.path.insert(0, str(REPO))
    from paicli.runners.runtimes import get_runtime

    runtime = get_runtime("mxnet")
    runtime.ensure(lambda line: print(f"  {line}", flush=True))
    return runtime.python()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_first_step(streams, started: float, timeout: float = 120) -> float:
    """Seconds from `started` until a `step=0,` line appears on any stream."""
    selector = selectors.DefaultSelector()
    buffers = {}
    for stream in streams:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
        buffers[stream] = b""
    deadline = started + timeout
    try:
        while time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                chunk = key.fileobj.read()
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fileobj] += chunk
                if FIRST_STEP in buffers[key.fileobj]:
                    return time.monotonic() - started
            if not selector.get_map():
                break
    finally:
        selector.close()
    raise RuntimeError("no worker printed step=0; output:\n" +
                       b"\n".join(buffers.values()).decode(errors="replace")[-2000:])


def drain(proc: subprocess.Popen) -> None:
    """Let a process run to its end without its pipe filling up."""
    if proc.stdout is not None:
        os.set_blocking(proc.stdout.fileno(), True)
        proc.stdout.read()
    proc.wait(timeout=180)


def through_pai(steps: int, home: Path) -> float:
    argv = [str(PAI), "-name", "mxnet", f"-Dscript=file://{SCRIPT}",
            '-Dcluster={"server":{"count":1},"worker":{"count":2}}', "-Dkvstore=dist_sync",
            f"-DuserDefinedParameters=--steps {steps}"]
    env = dict(os.environ, PAI_HOME=str(home))
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    try:
        elapsed = wait_for_first_step([proc.stdout], started)
    finally:
        drain(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"pai exited {proc.returncode}")
    return elapsed


def by_hand(steps: int, python: str) -> float:
    roles = [("scheduler", 1), ("server", 1), ("worker", 2)]
    cluster = {role: [f"127.0.0.1:{free_port()}" for _ in range(count)] for role, count in roles}
    procs = []
    started = time.monotonic()
    for role, count in roles:
        for index in range(count):
            env = dict(os.environ, PAI_ROLE=role, PAI_INDEX=str(index), PAI_HOST="127.0.0.1",
                       PAI_PORT=cluster[role][index].rsplit(":", 1)[1],
                       PAI_CLUSTER=json.dumps(cluster), PAI_JOB_ID="bench", PAI_ATTEMPT="0",
                       PAI_MXNET_KVSTORE="dist_sync", PAI_MXNET_GRADIENT_COMPRESSION="none",
                       PYTHONUNBUFFERED="1")
            if role != "worker":
                env["OMP_NUM_THREADS"] = "1"  # as the adapter sets for the services
            argv = [python, "-u", str(RUNNER)]
            if role == "worker":
                argv += [str(SCRIPT), "--steps", str(steps)]
            procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    try:
        elapsed = wait_for_first_step([p.stdout for p in procs[2:]], started)
    finally:
        for proc in procs:
            drain(proc)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"hand-launched job exit codes {codes}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description="submit -> first step, pai vs by hand")
    parser.add_argument("--reps", type=int, default=5, help="pairs of runs (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per job")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    python = mxnet_python()
    load_before = os.getloadavg()
    pai_times, hand_times = [], []
    with tempfile.TemporaryDirectory(prefix="bench-mxnet-") as tmp:
        home = Path(tmp) / "pai-home"
        # One warm-up of each arm: the first MXNet import after a while reads ~300 MB
        # of libraries from disk, which would land on whichever arm runs first.
        by_hand(args.steps, python)
        through_pai(args.steps, home)
        for rep in range(args.reps):
            hand_times.append(by_hand(args.steps, python))
            pai_times.append(through_pai(args.steps, home))
            print(f"  rep {rep + 1}: hand {hand_times[-1]:.2f}s  pai {pai_times[-1]:.2f}s", flush=True)
    load_after = os.getloadavg()

    hand, pai = statistics.median(hand_times), statistics.median(pai_times)
    ratio = pai / hand
    # Paired figures too: each pai run against the hand run just before it, which
    # saw about the same load. On a busy machine the two can tell different stories.
    pair_ratio = statistics.median(p / h for p, h in zip(pai_times, hand_times))
    pair_extra = statistics.median(p - h for p, h in zip(pai_times, hand_times))
    print(f"submit -> first step, 1 scheduler + 1 server + 2 workers, dist_sync, "
          f"median of {args.reps}:")
    print(f"  by hand {hand:.2f}s   through pai {pai:.2f}s   ratio {ratio:.3f} "
          f"(goal <= {GOAL}) {'met' if ratio <= GOAL else 'NOT met'}")
    print(f"  paired: median ratio {pair_ratio:.3f}, median extra time through pai {pair_extra:+.2f}s")
    print(f"  load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "hand_seconds": hand_times, "pai_seconds": pai_times, "hand_median": hand,
            "pai_median": pai, "ratio": ratio, "goal": GOAL,
            "paired_median_ratio": pair_ratio, "paired_median_extra_seconds": pair_extra,
            "load_before": load_before, "load_after": load_after}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
