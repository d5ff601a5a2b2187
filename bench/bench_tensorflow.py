"""TensorFlow through `pai` versus the same processes started by hand.

    .venv/bin/python bench/bench_tensorflow.py [--runs 3] [--steps 300]

1. Submit -> first step line: the time from starting `pai -name tensorflow ...` until
   the first `[worker:N] step=` line reaches its stdout, against the time from starting
   the very same ps/worker processes (same runtime, runner, argv, PAI_* environment)
   until the first `step=` line of a worker. Runs alternate between the two so that
   background load hits both alike; medians and their ratio are reported (goal <= 1.05).
2. Memory: the peak RSS (VmHWM) of the `pai` CLI process and of the job's supervisor,
   and whether either mapped TensorFlow (they must not: TF runs in its own runtime).

Needs the TensorFlow runtime (provisioned on first use). Prints a table and a JSON line.
Three TensorFlow imports fill both cores for several seconds, so anything else running
on the machine moves these numbers by seconds: run it on a quiet machine, with --runs 5
or more, and read the per-pair ratios as well as the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tensorflow" / "async_ps_worker.py"
CLUSTER = {"ps": {"count": 1}, "worker": {"count": 2}}
STEP_LINE = re.compile(rb"(?:^|\] )step=\d+, global_step=", re.M)


def pai_command() -> str:
    beside = Path(sys.executable).with_name("pai")
    return str(beside) if beside.exists() else (shutil.which("pai") or "pai")


class PeakRss:
    """Polls /proc/PID/status for VmHWM (the kernel's own peak-RSS mark) and
    /proc/PID/maps for a loaded TensorFlow, until the process is gone."""

    def __init__(self, pid: int):
        self.pid, self.peak_kb, self.tensorflow = pid, 0, False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while True:
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                maps = Path(f"/proc/{self.pid}/maps").read_text()
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                return
            match = re.search(r"VmHWM:\s+(\d+) kB", status)
            if match:
                self.peak_kb = max(self.peak_kb, int(match.group(1)))
            self.tensorflow = self.tensorflow or "tensorflow" in maps
            if "State:\tZ" in status:
                return
            time.sleep(0.05)


def through_pai(home: Path, steps: int) -> dict:
    env = {**os.environ, "PAI_HOME": str(home)}
    argv = [pai_command(), "-name", "tensorflow", f"-Dscript=file://{EXAMPLE}",
            f"-Dcluster={json.dumps(CLUSTER)}", f"-DuserDefinedParameters=--steps {steps}"]
    started, submitted = time.monotonic(), time.time()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    cli = PeakRss(proc.pid)
    supervisor = None
    first_step = None
    job_id = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if job_id is None and line.startswith(b"ID = "):
            job_id = line.split()[-1].decode()
        if first_step is None and line.startswith(b"[worker:") and STEP_LINE.search(line):
            first_step = time.monotonic() - started
        if supervisor is None and job_id:
            pid = master_pid(env, job_id)
            if pid:
                supervisor = PeakRss(pid)
    code = proc.wait()
    total = time.monotonic() - started
    cli.thread.join(2)
    if supervisor:
        supervisor.thread.join(5)
    if code != 0 or first_step is None:
        raise SystemExit(f"the pai job failed (exit {code}); see {home}")
    status = json.loads(subprocess.run([pai_command(), "status", job_id, "--json"], env=env,
                                       capture_output=True, text=True, check=True).stdout)
    return {"first_step": first_step, "total": total,
            # pai's own share: from the command's start to its supervisor launching instances
            "to_launch": status["started"] - submitted, "cli_peak_kb": cli.peak_kb,
            "cli_tensorflow": cli.tensorflow,
            "supervisor_peak_kb": supervisor.peak_kb if supervisor else None,
            "supervisor_tensorflow": supervisor.tensorflow if supervisor else None}


def master_pid(env: dict, job_id: str) -> int | None:
    done = subprocess.run([pai_command(), "status", job_id, "--json"], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout).get("master_pid")


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def by_hand(workdir: Path, steps: int) -> dict:
    """The same processes the launcher starts, started directly: the plan's argv,
    cwd and env per role, with the PAI_* variables filled in here."""
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
    ports = free_ports(len(instances))
    cluster: dict[str, list[str]] = {}
    for (role, _i), port in zip(instances, ports):
        if role.listens:
            cluster.setdefault(role.name, []).append(f"127.0.0.1:{port}")
    procs = []
    selector = selectors.DefaultSelector()
    for (role, index), port in zip(instances, ports):
        env = {**os.environ, **role.env, "PAI_JOB_ID": "by-hand", "PAI_ROLE": role.name,
               "PAI_INDEX": str(index), "PAI_HOST": "127.0.0.1", "PAI_PORT": str(port),
               "PAI_CLUSTER": json.dumps(cluster), "PAI_ATTEMPT": "0", "PAI_JOB_ATTEMPT": "0",
               "PAI_JOB_DIR": str(workdir), "PYTHONUNBUFFERED": "1",
               # as the launcher does for an instance given no GPU
               "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.Popen(role.argv, cwd=role.cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        procs.append((role, proc))
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ, role.name)
    first_step = None
    buffers: dict[int, bytes] = {}
    try:
        workers = [p for r, p in procs if r.must_finish]
        while any(p.poll() is None for p in workers) or selector.get_map():
            for key, _ in selector.select(0.1):
                data = key.fileobj.read()
                if data is None:  # nothing yet (non-blocking)
                    continue
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                if first_step is None and key.data == "worker" and STEP_LINE.search(
                        buffers.get(key.fd, b"") + data):
                    first_step = time.monotonic() - started
                buffers[key.fd] = (buffers.get(key.fd, b"") + data)[-200:]
            if all(p.poll() is not None for p in workers):
                break
    finally:
        for _role, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _role, proc in procs:
            proc.wait(10)
    total = time.monotonic() - started
    failed = [(r.name, p.returncode) for r, p in procs if r.must_finish and p.returncode != 0]
    if failed or first_step is None:
        raise SystemExit(f"the hand-launched job failed: {failed}")
    return {"first_step": first_step, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind (alternating)")
    parser.add_argument("--steps", type=int, default=300, help="global steps per job")
    args = parser.parse_args()

    from paicli.runners.runtimes import get_runtime
    get_runtime("tensorflow").ensure(lambda line: print(line, file=sys.stderr))

    pai_runs, hand_runs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-tf-") as tmp:
        # One untimed run of each warms the page cache for the runtime's 1.6 GB.
        by_hand(Path(tmp), 50)
        for run in range(args.runs):
            # Alternate which goes first, so a pair's order does not favour either.
            if run % 2 == 0:
                hand_runs.append(by_hand(Path(tmp), args.steps))
                pai_runs.append(through_pai(Path(tmp) / f"home{run}", args.steps))
            else:
                pai_runs.append(through_pai(Path(tmp) / f"home{run}", args.steps))
                hand_runs.append(by_hand(Path(tmp), args.steps))
            print(f"run {run + 1}: first step line by hand {hand_runs[-1]['first_step']:.2f}s, "
                  f"through pai {pai_runs[-1]['first_step']:.2f}s", file=sys.stderr)

    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    result = {
        "runs": args.runs, "steps": args.steps, "cores": os.cpu_count(),
        "first_step_by_hand_s": round(med(hand_runs, "first_step"), 3),
        "first_step_pai_s": round(med(pai_runs, "first_step"), 3),
        "total_by_hand_s": round(med(hand_runs, "total"), 3),
        "total_pai_s": round(med(pai_runs, "total"), 3),
        "cli_peak_rss_mb": round(max(r["cli_peak_kb"] for r in pai_runs) / 1024, 1),
        "supervisor_peak_rss_mb": round(max(r["supervisor_peak_kb"] or 0 for r in pai_runs) / 1024, 1),
        "cli_loaded_tensorflow": any(r["cli_tensorflow"] for r in pai_runs),
        "supervisor_loaded_tensorflow": any(bool(r["supervisor_tensorflow"]) for r in pai_runs),
    }
    result["first_step_ratio"] = round(result["first_step_pai_s"] / result["first_step_by_hand_s"], 3)
    # Each pair ran back to back, so its ratio sees the most similar background load.
    result["first_step_ratio_pairs"] = [round(p["first_step"] / h["first_step"], 3)
                                        for p, h in zip(pai_runs, hand_runs)]
    result["pai_to_launch_s"] = round(med(pai_runs, "to_launch"), 3)
    print(f"submit -> first step line: by hand {result['first_step_by_hand_s']:.2f}s, "
          f"through pai {result['first_step_pai_s']:.2f}s, ratio {result['first_step_ratio']:.3f} "
          f"(goal <= 1.05; median of {args.runs}; per pair {result['first_step_ratio_pairs']})")
    print(f"pai's own time from the command to launching the instances: {result['pai_to_launch_s']:.2f}s")
    print(f"job total: by hand {result['total_by_hand_s']:.2f}s, through pai {result['total_pai_s']:.2f}s")
    print(f"peak RSS: pai CLI {result['cli_peak_rss_mb']} MB, supervisor {result['supervisor_peak_rss_mb']} MB; "
          f"TensorFlow loaded by CLI: {result['cli_loaded_tensorflow']}, "
          f"by supervisor: {result['supervisor_loaded_tensorflow']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
