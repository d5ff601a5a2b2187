"""The queue under load (issue 19): N jobs waiting behind one that holds the
machine, each with its own waiting JobMaster (no daemon).

Measures
  handoff   time from a job's end (its recorded `ended`) to the next job in the
            queue starting: its record moving to Running, and its first instance
            started (the process exists); --handoffs times, median and max.
            Goal: <= 1 s.
  queue     `pai queue` wall time (a fresh `pai` process, text and --json),
            median of 5.  Goal: <= 0.3 s.
  dispatch  one run of the policy over the whole queue in its store
            transaction (what every master that frees room pays), median and max of 20.
  memory    the waiting masters' proportional set size (Pss, /proc/PID/smaps_rollup),
            in all and per master.

Every job wants the whole machine (worker cpu = this machine's cores), so they
wait; each is a tiny python job waiting for its own gate file, so the order is
the benchmark's. The jobs are submitted through paicli.client.submit in this
process (each still gets a real forked master), then cancelled at the end.

Run from the repository root (~3 min for 500 on 2 cores):

    flock /tmp/paicli-bench.lock .venv/bin/python bench/bench_queue.py --jobs 500

--store postgresql runs it on a team store (docs/team.md): a PostgreSQL server the
bench starts itself (tests/pg.py: Debian's postgresql, psycopg), stopped after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GATE = """import os, sys, time
print("started", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500, help="waiting jobs (default 500)")
    parser.add_argument("--handoffs", type=int, default=5, help="job ends to time (default 5)")
    parser.add_argument("--json", dest="json_out", help="also write the figures to this file")
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite",
                        help="the job store (default sqlite under PAI_HOME)")
    args = parser.parse_args()
    server = None
    if args.store == "postgresql":
        sys.path.insert(0, str(ROOT / "tests"))
        import pg

        server = pg.PostgresServer(max_connections=2 * args.jobs + 50).start()
        os.environ["PAI_STORE"] = server.new_database()
    try:
        return run(args)
    finally:
        if server is not None:
            server.close()


def run(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    os.environ["PAI_HOME"] = str(work / "home")
    os.environ["PAI_LOGVIEW"] = "file"
    os.environ.pop("PAI_NODES", None)
    os.environ.pop("PAI_QUOTA", None)
    from paicli import client
    from paicli.cluster.scheduler import machine_cpu
    from paicli.statement import parse_statement
    from paicli.store import Store

    script = work / "gate.py"
    script.write_text(GATE)
    store = Store()
    cluster = json.dumps({"worker": {"count": 1, "cpu": machine_cpu()}})
    ids: list[str] = []

    def submit(n: int) -> str:
        stmt = parse_statement(["-name", "python", f"-Dscript={script}", f"-Dcluster={cluster}",
                                f"-DuserDefinedParameters={work / f'gate-{n}'}", f"-DjobName=q{n}"])
        ids.append(client.submit(client.prepare(stmt), store))
        return ids[-1]

    figures: dict[str, object] = {"jobs": args.jobs, "cores": machine_cpu() // 100, "store": args.store}
    try:
        t0 = time.monotonic()
        submit(0)
        wait_for(lambda: store.job(ids[0])["status"] == "Running", 30)
        for n in range(1, args.jobs + 1):
            submit(n)
        wait_for(lambda: sum(1 for r in store.queued() if r["reason"]) >= args.jobs, 600)
        figures["submit_s"] = round(time.monotonic() - t0, 1)
        print(f"{args.jobs} jobs waiting after {figures['submit_s']} s; load {os.getloadavg()[0]:.2f}", flush=True)
        figures["memory"] = masters_memory(store, ids[1:])
        print(f"waiting masters: {figures['memory']}", flush=True)
        figures["queue"] = time_queue(store.home)
        print(f"pai queue: {figures['queue']}; load {os.getloadavg()[0]:.2f}", flush=True)
        figures["dispatch"] = time_dispatch(store)
        print(f"dispatch over the queue: {figures['dispatch']}", flush=True)
        figures["handoff"] = time_handoffs(store, ids, work, args.handoffs)
        print(f"handoff: {figures['handoff']}; load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        cancel_all(store, ids, work)
        shutil.rmtree(work, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2))
    return 0


def wait_for(predicate, timeout: float, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting")
        time.sleep(interval)


def masters_memory(store, ids: list[str]) -> dict[str, float]:
    pss = []
    for job_id in ids:
        pid = store.job(job_id)["master_pid"]
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        pss.append(next(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:")) / 1024)
    return {"masters": len(pss), "pss_total_mb": round(sum(pss)), "pss_per_master_mb": round(statistics.mean(pss), 1)}


def time_queue(home: Path) -> dict[str, float]:
    out = {}
    for label, extra in (("text_s", []), ("json_s", ["--json"])):
        runs = []
        for _ in range(5):
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "paicli", "queue", *extra], capture_output=True, text=True,
                                  env={**os.environ, "PAI_HOME": str(home)})
            runs.append(time.monotonic() - start)
            assert done.returncode == 0, done.stderr
        out[label] = round(statistics.median(runs), 3)
    out["rows"] = len(json.loads(done.stdout))
    return out


def time_dispatch(store) -> dict[str, float]:
    from paicli.cluster import queue_turns

    runs = []
    for _ in range(20):
        start = time.monotonic()
        queue_turns.dispatch(store)
        runs.append(time.monotonic() - start)
    return {"median_s": round(statistics.median(runs), 3), "max_s": round(max(runs), 3)}


def time_handoffs(store, ids: list[str], work: Path, count: int) -> dict[str, object]:
    """Open the running job's gate; time its end to the next job's start."""
    to_running, to_process = [], []
    for n in range(count):
        (work / f"gate-{n}").touch()
        wait_for(lambda: store.job(ids[n])["ended"] is not None, 30, 0.01)
        wait_for(lambda: all(i["started"] for i in store.instances(ids[n + 1])), 30, 0.01)
        ended = store.job(ids[n])["ended"]
        nxt = store.job(ids[n + 1])
        to_running.append(nxt["started"] - ended)
        to_process.append(min(i["started"] for i in store.instances(ids[n + 1])) - ended)
    return {"to_running_median_s": round(statistics.median(to_running), 3),
            "to_running_max_s": round(max(to_running), 3),
            "to_instance_median_s": round(statistics.median(to_process), 3),
            "to_instance_max_s": round(max(to_process), 3),
            "each_to_instance_s": [round(x, 3) for x in to_process]}


def cancel_all(store, ids: list[str], work: Path) -> None:
    from paicli import client
    from paicli.states import JobStatus

    for job_id in reversed(ids):   # the last first: nobody moves up to start meanwhile
        if not JobStatus(store.job(job_id)["status"]).is_terminal():
            client.kill(store, job_id, wait=5.0)
    for n in range(len(ids)):
        (work / f"gate-{n}").touch()


if __name__ == "__main__":
    sys.exit(main())
