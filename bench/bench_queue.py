"""The queue under load (issue 19, a team store's figures: issue 47).

Measures
  decision  the turn decision: one run of the policy over the whole queue in its
            store transaction (cluster.queue_turns.dispatch), --decisions times each
            of three kinds, p50 / p99 / max:
              submit  a new job joins the queue (its master's first decision);
              turn    the running job ended: the head of the queue is granted its
                      turn and every job behind it moves up one place (written);
              steady  nothing changed (the head's look every second).
            On a queue of --jobs built in a store of its own through the store's
            calls (no masters: the decision alone), before the live part, beside
            --history ended jobs (a store's past: the decision must not scan it).
            Goal: p99 <= 50 ms with 1,000 waiting.
  live      --jobs waiting jobs behind one that holds the machine, each with its own
            waiting JobMaster (no daemon), submitted through paicli.client.submit:
    memory    the waiting masters' proportional set size (Pss, /proc/PID/smaps_rollup);
    queue     `pai queue` wall time (a fresh `pai`, text and --json), median of 5
              (goal <= 0.3 s);
    dispatch  --decisions runs of the decision over the live queue, its masters
              around (p50 / p99 / max), and the look every submit and job end
              takes first for queued jobs whose supervisor is gone (revive);
    handoff   a job's end (its recorded `ended`) to the next job's start: its
              record Running, and its first instance started (the process exists),
              --handoffs times (goal <= 1 s);
    users     (--users 2, PostgreSQL, root) the same across two Unix users made for
              the run (tests/pg.py UnixUser): jobs of pai-bench-a and pai-bench-b
              alternate ahead of the queue, each `pai` run as its user with its own
              database role; a job's end wakes the other user's waiting master through
              the store (LISTEN/NOTIFY), as no signal crosses users. --handoffs times.
            --handoffs 0 leaves the live part out.

Every job wants the whole machine (worker cpu = this machine's cores), so they
wait; each is a tiny python job waiting for its own gate file, so the order is
the benchmark's. The live jobs are cancelled at the end; the users, the server and
every folder made are removed, also when the run fails.

Run from the repository root (decisions alone: ~1 min; the live part ~3 min for 500 on
2 cores, ~8 min for 1,000):

    flock /tmp/paicli-bench.lock .venv/bin/python bench/bench_queue.py --jobs 1000 --history 50000 --handoffs 0
    flock /tmp/paicli-bench.lock .venv/bin/python bench/bench_queue.py --jobs 1000 --handoffs 5 --store postgresql --users 2

--store postgresql runs it on a team store (docs/team.md): a PostgreSQL server the
bench starts itself (tests/pg.py: Debian's postgresql, psycopg), stopped after.
"""

from __future__ import annotations

import argparse
import json
import math
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
USERS = ("pai-bench-a", "pai-bench-b")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500, help="waiting jobs (default 500)")
    parser.add_argument("--decisions", type=int, default=200, help="decisions to time of each kind (default 200)")
    parser.add_argument("--history", type=int, default=0,
                        help="ended jobs in the decision's store beside the queue (default 0)")
    parser.add_argument("--handoffs", type=int, default=5, help="job ends to time (default 5; 0: no live part)")
    parser.add_argument("--users", type=int, choices=(1, 2), default=1,
                        help="2: also time handoffs between two Unix users' jobs (PostgreSQL, root)")
    parser.add_argument("--json", dest="json_out", help="also write the figures to this file")
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite",
                        help="the job store (default sqlite under PAI_HOME)")
    args = parser.parse_args()
    if args.users == 2 and (args.store != "postgresql" or os.geteuid() != 0 or not args.handoffs):
        parser.error("--users 2 needs --store postgresql, --handoffs N and root (it makes Unix users)")
    sys.path.insert(0, str(ROOT / "tests"))
    import pg

    server = None
    os.environ["PAI_LOGVIEW"] = "file"
    for name in ("PAI_NODES", "PAI_QUOTA", "PAI_STORE"):
        os.environ.pop(name, None)
    figures: dict[str, object] = {"jobs": args.jobs, "history": args.history, "store": args.store}
    try:
        if args.store == "postgresql":
            server = pg.PostgresServer(max_connections=2 * args.jobs + 50).start()
        figures["decision"] = in_home(server, lambda work: time_decisions(work, args.jobs, args.decisions,
                                                                             args.history))
        if args.handoffs:
            in_home(server, lambda work: live(work, args, figures))
    finally:
        if server is not None:
            server.close()
    print(json.dumps(figures, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2))
    return 0


def in_home(server, run):
    """run(work) with PAI_HOME in `work`, a new folder, and, on PostgreSQL, PAI_STORE a new
    database; the folder removed after."""
    work = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    os.environ["PAI_HOME"] = str(work / "home")
    if server is not None:
        os.environ["PAI_STORE"] = server.new_database()
    try:
        return run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def spread(runs: list[float]) -> dict[str, float]:
    """p50, p99 (nearest rank) and max, in ms."""
    ranked = sorted(runs)
    return {"n": len(ranked), "p50_ms": round(statistics.median(ranked) * 1000, 1),
            "p99_ms": round(ranked[math.ceil(0.99 * len(ranked)) - 1] * 1000, 1),
            "max_ms": round(ranked[-1] * 1000, 1)}


# -- the decision alone ------------------------------------------------------------------


def time_decisions(work: Path, jobs: int, count: int, history: int) -> dict[str, object]:
    from paicli.cluster import backends, queue_turns
    from paicli.cluster.procinfo import start_time
    from paicli.cluster.scheduler import machine_cpu
    from paicli.jobplan import JobPlan, RolePlan
    from paicli.states import JobStatus
    from paicli.store import Store

    store = Store()
    nodes = backends.get_backend(backends.submit_config(store.home)).nodes()
    plan = JobPlan("q", "python", "T", [RolePlan("worker", 1, ["true"], cpu=machine_cpu())])
    entry = queue_turns.check_and_describe(store, plan, nodes, 0, None)
    me = {"master_pid": os.getpid(), "master_start": start_time(os.getpid())}
    made = [0]

    def add() -> str:
        made[0] += 1
        job_id = f"20261203000000000q{made[0]:06d}"
        store.create_job(job_id, name=job_id, framework="python", project=None, task_name="T",
                         job_dir=work / job_id, roles=[{"name": "worker", "count": 1, "must_finish": True}])
        store.update_job(job_id, **me)   # this process stands for its master: alive
        store.enqueue(job_id, 0, None, entry)
        return job_id

    past = time.time() - 86400
    with store.tx() as db:
        db.executemany("INSERT INTO jobs (id, name, framework, status, created, started, ended) VALUES (?,?,?,?,?,?,?)",
                       [(f"20261202000000000h{n:06d}", "old", "python", JobStatus.SUCCEEDED.value, past + n, past + n,
                         past + n + 1) for n in range(history)])
    if store.postgres:
        store.db.execute("ANALYZE")   # as autovacuum would have by now: the planner knows the table's size
    running = add()
    queue_turns.dispatch(store)
    assert store.take_turn(running) is not None
    store.set_job(running, JobStatus.RUNNING)
    for _ in range(jobs):
        add()
    queue_turns.dispatch(store)
    print(f"decision: {jobs} waiting, {history} ended, in a store of their own ({load()})", flush=True)
    runs: dict[str, list[float]] = {"submit": [], "turn": [], "steady": []}

    def timed(kind: str, me: str | None = None) -> None:
        start = time.perf_counter()
        queue_turns.dispatch(store, me=me)
        runs[kind].append(time.perf_counter() - start)

    for _ in range(count):
        timed("submit", add())
        timed("steady")
        store.set_job(running, JobStatus.SUCCEEDED)   # what its master does at its end
        store.release_holds(running)
        timed("turn")
        running = store.db.execute("SELECT job_id FROM queue WHERE state = 'granted'").fetchone()[0]
        store.take_turn(running)
        store.set_job(running, JobStatus.RUNNING)
    store.close()
    out: dict[str, object] = {kind: spread(times) for kind, times in runs.items()}
    out["uptime"] = load()
    for kind in runs:
        print(f"decision {kind}: {out[kind]}", flush=True)
    print(f"  ({out['uptime']})", flush=True)
    return out


# -- live jobs ---------------------------------------------------------------------------


def live(work: Path, args, figures: dict[str, object]) -> None:
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

    figures["cores"] = machine_cpu() // 100
    team = None
    try:
        t0 = time.monotonic()
        submit(0)
        wait_for(lambda: store.job(ids[0])["status"] == "Running", 30)
        for n in range(1, args.jobs + 1):
            submit(n)
        wait_for(lambda: sum(1 for r in store.queued() if r["reason"]) >= args.jobs, 600)
        figures["submit_s"] = round(time.monotonic() - t0, 1)
        print(f"{args.jobs} jobs waiting after {figures['submit_s']} s ({load()})", flush=True)
        figures["memory"] = masters_memory(store, ids[1:])
        print(f"waiting masters: {figures['memory']}", flush=True)
        figures["queue"] = time_queue(store.home)
        print(f"pai queue: {figures['queue']} ({load()})", flush=True)
        figures["dispatch"] = time_dispatch(store, args.decisions)
        print(f"dispatch over the live queue: {figures['dispatch']}", flush=True)
        figures["handoff"] = time_handoffs(store, ids, work, args.handoffs)
        print(f"handoff: {figures['handoff']} ({load()})", flush=True)
        if args.users == 2:
            team = Team(work, store)
            figures["handoff_users"] = team.time_handoffs(ids[args.handoffs], work / f"gate-{args.handoffs}",
                                                          args.handoffs, cluster)
            print(f"handoff across users: {figures['handoff_users']} ({load()})", flush=True)
    finally:
        if team is not None:
            team.close()
        cancel_all(store, ids, work)
        store.close()


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


def time_dispatch(store, count: int) -> dict[str, object]:
    from paicli.cluster import lifecycle, queue_turns

    runs, revive = [], []
    for _ in range(count):
        start = time.perf_counter()
        queue_turns.dispatch(store)
        runs.append(time.perf_counter() - start)
    for _ in range(20):
        start = time.perf_counter()
        lifecycle.revive_queued(store)
        revive.append(time.perf_counter() - start)
    return {**spread(runs), "revive_median_ms": round(statistics.median(revive) * 1000, 1), "uptime": load()}


def handoff(store, ended_id: str, next_id: str) -> tuple[float, float]:
    """(to Running, to its first instance) from the ended job's end."""
    wait_for(lambda: store.job(ended_id)["ended"] is not None, 30, 0.01)
    wait_for(lambda: all(i["started"] for i in store.instances(next_id)), 30, 0.01)
    ended = store.job(ended_id)["ended"]
    return (store.job(next_id)["started"] - ended,
            min(i["started"] for i in store.instances(next_id)) - ended)


def summary(pairs: list[tuple[float, float]]) -> dict[str, object]:
    to_running, to_process = [p[0] for p in pairs], [p[1] for p in pairs]
    return {"to_running_median_s": round(statistics.median(to_running), 3),
            "to_running_max_s": round(max(to_running), 3),
            "to_instance_median_s": round(statistics.median(to_process), 3),
            "to_instance_max_s": round(max(to_process), 3),
            "each_to_instance_s": [round(x, 3) for x in to_process]}


def time_handoffs(store, ids: list[str], work: Path, count: int) -> dict[str, object]:
    """Open the running job's gate; time its end to the next job's start."""
    pairs = []
    for n in range(count):
        (work / f"gate-{n}").touch()
        pairs.append(handoff(store, ids[n], ids[n + 1]))
    return summary(pairs)


class Team:
    """Two Unix users with a database role each in the role `team` (docs/team.md),
    the store's tables granted to it; close() removes them and all they run."""

    def __init__(self, work: Path, store) -> None:
        import pg
        import psycopg

        self.url = os.environ["PAI_STORE"]
        self.base = Path(tempfile.mkdtemp(prefix="bench-team-"))   # theirs to read: the gate and its files
        self.base.chmod(0o755)
        self.users, self.store = [], store
        try:
            with psycopg.connect(self.url, autocommit=True) as con:
                con.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'team')"
                            " THEN CREATE ROLE team; END IF; END $$")
                for name in USERS:
                    self.users.append(pg.UnixUser(name, self.base))
                    con.execute(f'DROP ROLE IF EXISTS "{name}"')
                    con.execute(f'CREATE ROLE "{name}" LOGIN IN ROLE team')
                con.execute("GRANT ALL ON ALL TABLES IN SCHEMA public TO team")
                con.execute("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO team")
            (self.base / "gate.py").write_text(GATE)
            (self.base / "gate.py").chmod(0o644)
        except BaseException:
            self.close()
            raise

    def time_handoffs(self, running: str, running_gate: Path, count: int, cluster: str) -> dict[str, object]:
        """count + 1 jobs, the users' in turn, ahead of the queue (priority 1); the
        running job's gate opened, then each of theirs: count handoffs between them."""
        jobs = []
        for n in range(count + 1):
            user = self.users[n % 2]
            done = user.run("--detach", "-name", "python", f"-Dscript={self.base / 'gate.py'}",
                            f"-DuserDefinedParameters={self.base / f'open-{n}'}", f"-Dcluster={cluster}",
                            "-Dpriority=1", env={"PAI_STORE": self.url.replace("//pai@", f"//{user.name}@")})
            if done.returncode != 0:
                raise SystemExit(f"{user.name}'s submit failed: {done.stderr.strip()}")
            jobs.append(done.stdout.split()[0])
        wait_for(lambda: all(self.store.job(j)["reason"] for j in jobs), 60)
        running_gate.touch()
        handoff(self.store, running, jobs[0])
        pairs = []
        for n in range(count):
            (self.base / f"open-{n}").touch()
            pairs.append(handoff(self.store, jobs[n], jobs[n + 1]))
        (self.base / f"open-{count}").touch()
        wait_for(lambda: self.store.job(jobs[-1])["ended"] is not None, 30)
        return summary(pairs)

    def close(self) -> None:
        for user in self.users:
            user.close()
        shutil.rmtree(self.base, ignore_errors=True)


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
