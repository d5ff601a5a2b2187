"""Multi-host over SSH: `pai` versus the same processes started by hand with ssh,
and placing + launching 64 instances over 4 nodes.

    .venv/bin/python bench/bench_multihost.py [--runs 3] [--steps 200] [--skip-tf] [--skip-64]

Builds its own cluster first (tests/netns.py: network namespaces, veth, a bridge,
one sshd per host, private /tmp; needs root) and tears it down at the end.

1. Submit -> first step of a TensorFlow 1 ps + 2 worker job over 3 nodes: the time
   from starting `pai -name tensorflow ...` (nodes file: 3 nodes of one core each,
   so one instance per node) until the first `[worker:N] step=` line, against the
   time from starting the very same processes by hand (the plan's argv, env and
   PAI_* variables; one `ssh node env ... python -u runner script` per instance,
   OpenSSH's client, files already in place on the shared filesystem: no copying,
   so the by-hand side is a lower bound) until a worker's first `step=` line.
   Runs alternate; medians and their ratio are printed (goal <= 1.10).
2. 64 instances over 4 nodes (cpu 1600 each): submit -> every instance has printed
   its first line (placed, staged, started, streamed back), and the job's total.

Every job gets a fresh PAI_HOME, and PAI_LOGVIEW=file: a logview web server starting
for each fresh home (once per home in real use) would compete with the instances'
start-up inside the timed window. Prints a table and a JSON line. The machine is
shared: the load average is printed next to each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from netns import TestCluster, build_cluster, can_build  # noqa: E402

EXAMPLE = REPO / "examples" / "tensorflow" / "async_ps_worker.py"
CLUSTER = {"ps": {"count": 1}, "worker": {"count": 2}}
STEP_LINE = re.compile(rb"(?:^|\] )step=\d+, global_step=", re.M)
PAI = [sys.executable, "-m", "paicli"]
HAND_LIMIT_S = 600    # a hand-started job that hangs ends the bench, not the machine's afternoon


def load() -> str:
    return "%.1f" % os.getloadavg()[0]


def through_pai(nodes_file: Path, steps: int) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-mh-"))
    env = {**os.environ, "PAI_HOME": str(home), "PAI_NODES": str(nodes_file), "NO_COLOR": "1",
           "PAI_LOGVIEW": "file"}
    argv = [*PAI, "-name", "tensorflow", f"-Dscript=file://{EXAMPLE}", f"-Dcluster={json.dumps(CLUSTER)}",
            f"-DuserDefinedParameters=--steps {steps}"]
    started, t_submit = time.monotonic(), time.time()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    first = None
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if first is None and line.startswith(b"[worker:") and STEP_LINE.search(line):
            first = time.monotonic() - started
    code = proc.wait()
    total = time.monotonic() - started
    phases = job_events(home, t_submit) if code == 0 else {}
    shutil.rmtree(home, ignore_errors=True)
    if code != 0 or first is None:
        raise SystemExit(f"the pai job failed (exit {code}):\n" + b"".join(tail).decode(errors="replace"))
    return {"first_step": first, "total": total, "phases": phases}


def job_events(home: Path, t_submit: float) -> dict:
    """Seconds from the submit to the job recorded, the master running, and each
    instance started (its identity recorded), from the store's own timestamps."""
    db = sqlite3.connect(home / "pai.db")
    try:
        created, begun = db.execute("SELECT created, started FROM jobs").fetchone()
        starts = db.execute("SELECT role, idx, started FROM instances WHERE started IS NOT NULL").fetchall()
    finally:
        db.close()
    out = {"recorded": round(created - t_submit, 2), "master": round(begun - t_submit, 2)}
    out.update({f"{role}:{idx}": round(ts - t_submit, 2) for role, idx, ts in sorted(starts)})
    return out


def step_lines(pending: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of `pending + data` and what is left of a line not yet
    ended; at end of stream (`data` empty) the rest is a line of its own."""
    buffered = pending + data
    if not data:
        return ([buffered] if buffered else []), b""
    *lines, rest = buffered.split(b"\n")
    return lines, rest


def by_hand(cluster: TestCluster, steps: int) -> dict:
    """The plan's processes, one `ssh host env ... argv` each, ps on h1, workers on h2, h3."""
    from paicli.adapters import get_adapter
    from paicli.adapters.base import StagedCode
    from paicli.spec import CORE_PARAMS, JobSpec

    adapter = get_adapter("tensorflow")
    table = {p.name: p for p in (*CORE_PARAMS, *adapter.params)}
    spec = JobSpec("tensorflow", {"script": str(EXAMPLE), "cluster": CLUSTER,
                                  "userDefinedParameters": f"--steps {steps}"}, table=table)
    started = time.monotonic()
    plan = adapter.plan(spec, StagedCode(EXAMPLE, None, EXAMPLE.parent))
    instances = [(role, i) for role in plan.roles for i in range(role.count)]
    hosts = cluster.hosts[:len(instances)]
    ports = [23000 + n for n in range(len(instances))]   # each host has its own network stack
    pai_cluster: dict[str, list[str]] = {}
    for (role, _i), host, port in zip(instances, hosts, ports):
        if role.listens:
            pai_cluster.setdefault(role.name, []).append(f"{host.addr}:{port}")
    procs = []
    selector = selectors.DefaultSelector()
    for (role, index), host, port in zip(instances, hosts, ports):
        env = {**role.env, "PAI_JOB_ID": "by-hand", "PAI_ROLE": role.name, "PAI_INDEX": str(index),
               "PAI_HOST": host.addr, "PAI_PORT": str(port), "PAI_CLUSTER": json.dumps(pai_cluster),
               "PAI_ATTEMPT": "0", "PAI_JOB_ATTEMPT": "0", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
        remote = ["cd", role.cwd or "/", "&&", "exec", "env", *[f"{k}={v}" for k, v in env.items()], *role.argv]
        command = " ".join(a if a in ("&&",) else shlex.quote(a) for a in remote)
        proc = subprocess.Popen(
            ["ssh", "-i", str(cluster.client_key), "-o", f"UserKnownHostsFile={cluster.known_hosts}",
             "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"{cluster.user}@{host.addr}", command],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append((role, proc))
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ, role.name)
    first = None
    pending: dict = {}   # stream -> the part of a line not yet ended by a newline
    try:
        workers = {proc.stdout for role, proc in procs if role.must_finish}
        # Until every worker's output has ended (they exit after the last step): what
        # is still in a pipe when a process exits is read, not dropped.
        deadline = time.monotonic() + HAND_LIMIT_S
        while workers & set(key.fileobj for key in selector.get_map().values()) and time.monotonic() < deadline:
            for key, _ in selector.select(0.1):
                data = key.fileobj.read()
                if data is None:
                    continue
                if data == b"":
                    selector.unregister(key.fileobj)
                # Whole lines only: a step line split across two reads is seen once it is complete.
                lines, pending[key.fileobj] = step_lines(pending.get(key.fileobj, b""), data)
                if first is None and key.data == "worker" and any(STEP_LINE.search(line) for line in lines):
                    first = time.monotonic() - started
    finally:
        for _role, proc in procs:
            if proc.poll() is None:
                proc.terminate()   # closes the ssh session: sshd hangs up the ps
        for _role, proc in procs:
            proc.wait(10)
        for name, left in cluster.all_leftovers().items():
            for pid, _cmd in left:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
    total = time.monotonic() - started
    if first is None:
        raise SystemExit("the hand-started job printed no step")
    return {"first_step": first, "total": total}


def sixty_four(cluster: TestCluster, workdir: Path) -> dict:
    script = workdir / "hello.py"
    script.write_text("import os\nprint('up', os.environ['PAI_ROLE'], os.environ['PAI_INDEX'], flush=True)\n")
    nodes_file = cluster.write_nodes_file(workdir / "nodes64.yaml", cpu=1600)
    home = Path(tempfile.mkdtemp(prefix="bench-mh64-"))
    env = {**os.environ, "PAI_HOME": str(home), "PAI_NODES": str(nodes_file), "NO_COLOR": "1",
           "PAI_LOGVIEW": "file"}
    started = time.monotonic()
    proc = subprocess.Popen([*PAI, "-name", "python", f"-Dscript={script}", '-Dcluster={"worker":{"count":64}}'],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seen, all_up = set(), None
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-10:]
        match = re.match(rb"\[worker:(\d+)\] up", line)
        if match:
            seen.add(int(match.group(1)))
            if len(seen) == 64 and all_up is None:
                all_up = time.monotonic() - started
    code = proc.wait()
    total = time.monotonic() - started
    shutil.rmtree(home, ignore_errors=True)
    if code != 0 or all_up is None:
        raise SystemExit(f"the 64-instance job failed (exit {code}, {len(seen)} up):\n"
                         + b"".join(tail).decode(errors="replace"))
    return {"all_up": all_up, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind (alternating)")
    parser.add_argument("--steps", type=int, default=200, help="global steps per TensorFlow job")
    parser.add_argument("--skip-tf", action="store_true")
    parser.add_argument("--skip-64", action="store_true")
    args = parser.parse_args()
    reason = can_build()
    if reason:
        raise SystemExit(f"cannot build the test cluster here: {reason}")
    result: dict = {}
    cluster = build_cluster(hosts=4, prefix="pcb", first_subnet=140)
    with cluster, tempfile.TemporaryDirectory(prefix="bench-mh-") as tmp:
        workdir = Path(tmp)
        if not args.skip_tf:
            from paicli.runners.runtimes import get_runtime

            get_runtime("tensorflow").ensure(print)
            from paicli.runners.runtimes import runtime_root

            nodes_file = cluster.write_nodes_file(workdir / "nodes.yaml", cpu=100, runtime_dir=str(runtime_root()))
            pai_runs, hand_runs = [], []
            for run in range(args.runs):
                order = (("pai", lambda: through_pai(nodes_file, args.steps)),
                         ("hand", lambda: by_hand(cluster, args.steps)))
                for kind, fn in (order if run % 2 == 0 else order[::-1]):
                    figure = fn()
                    figure["load"] = load()
                    (pai_runs if kind == "pai" else hand_runs).append(figure)
                    print(f"run {run + 1} {kind:4}: first step {figure['first_step']:.2f}s, "
                          f"total {figure['total']:.2f}s (load {figure['load']})"
                          + (f"; started (s after submit): {figure['phases']}" if figure.get("phases") else ""),
                          flush=True)
            pai_first = statistics.median(r["first_step"] for r in pai_runs)
            hand_first = statistics.median(r["first_step"] for r in hand_runs)
            result["tf_first_step"] = {"pai": pai_first, "hand": hand_first, "ratio": pai_first / hand_first,
                                       "pairs": [p["first_step"] / h["first_step"] for p, h in zip(pai_runs, hand_runs)]}
            print(f"submit -> first step, 1 ps + 2 workers on 3 nodes: pai {pai_first:.2f}s, by hand over ssh "
                  f"{hand_first:.2f}s, ratio {pai_first / hand_first:.3f} (goal <= 1.10)")
        if not args.skip_64:
            runs = [sixty_four(cluster, workdir) for _ in range(max(1, args.runs // 2 + 1))]
            up = statistics.median(r["all_up"] for r in runs)
            result["launch_64"] = {"all_up": up, "runs": runs, "load": load()}
            print(f"64 instances over 4 nodes: submit -> all 64 running and heard from {up:.2f}s "
                  f"(median of {len(runs)}; load {load()})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
