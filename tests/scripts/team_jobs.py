"""One team member's jobs through the shared store, run as that Unix user by
tests/test_store_pg.py: COUNT one-card jobs queued at once (priorities COUNT down
to 1) against a cluster of 4 cards, each run for a moment once its turn comes (several at once), ended, and
the queue handed over, as a job's master does. Prints, as JSON, each job's span:
[job, node, cards, started, ended], the times inside the span its claim held.

    python3 team_jobs.py COUNT
"""

import json
import os
import sys
import time

from paicli.cluster import lifecycle, queue_turns
from paicli.cluster.backends.base import NodeSpec
from paicli.cluster.procinfo import start_time
from paicli.jobplan import JobPlan, RolePlan
from paicli.states import JobStatus
from paicli.store import Store, new_job_id

CLUSTER = [NodeSpec("g1", "10.0.0.1", 800, 8000, ("0", "1")), NodeSpec("g2", "10.0.0.2", 800, 8000, ("0", "1"))]

store = Store()
count = int(sys.argv[1])
waiting = []
for n in range(count):
    job_id = new_job_id()
    store.create_job(job_id, name=f"j{n}", framework="python", project=None, task_name="T",
                     job_dir=store.jobs_dir / job_id, roles=[{"name": "worker", "count": 1, "must_finish": True}])
    store.update_job(job_id, master_pid=os.getpid(), master_start=start_time(os.getpid()))  # this process is its master
    plan = JobPlan("j", "python", "T", [RolePlan("worker", 1, ["true"], cpu=100, gpu=100)])
    # Each user's n-th job as urgent as the other's: the queue interleaves the users.
    store.enqueue(job_id, count - n, None, queue_turns.check_and_describe(store, plan, CLUSTER, count - n, None))
    waiting.append(job_id)
running: dict[str, tuple] = {}
spans = []
while waiting or running:
    queue_turns.dispatch(store)
    for job_id in list(waiting):
        taken = store.take_turn(job_id)
        if taken:
            placed = json.loads(taken)[0]
            store.set_job(job_id, JobStatus.RUNNING)
            waiting.remove(job_id)
            running[job_id] = (placed["node"], placed["gpus"], time.time())
    time.sleep(0.05)
    for job_id, (node, gpus, started) in list(running.items()):
        if time.time() - started > 0.2:
            ended = time.time()
            store.set_job(job_id, JobStatus.SUCCEEDED)
            lifecycle.job_ended(store, job_id)
            spans.append([job_id, node, gpus, started, ended])
            del running[job_id]
print(json.dumps(spans))
