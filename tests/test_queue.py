"""The queue's policy (cluster/queue.py, pure) and its store transactions
(cluster/queue_turns.py over paicli/store.py): who starts, who waits and why,
priorities, backfill, quotas. The real jobs are in tests/test_queue_jobs.py."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paicli.cluster import placement as placing
from paicli.cluster import queue
from paicli.cluster import lifecycle, queue_turns
from paicli.cluster.backends.base import NodeSpec
from paicli.errors import UsageError
from paicli.jobplan import JobPlan, RolePlan
from paicli.states import JobStatus
from paicli.store import Store


def nodes(*specs) -> tuple[NodeSpec, ...]:
    return tuple(NodeSpec(f"h{i + 1}", f"10.0.0.{i + 11}", cpu, mem, tuple(str(g) for g in range(gpus)))
                 for i, (cpu, mem, gpus) in enumerate(specs))


def entry(job_id, cluster, *, priority=0, project=None, submitted=0.0, **roles) -> queue.Entry:
    """roles: name=(count, cpu, memory, gpu_units)."""
    demands = []
    for name, (count, cpu, memory, gpu) in roles.items():
        demands += [placing.Demand(name, i, cpu, memory, placing.cards(gpu), name == "ps") for i in range(count)]
    return queue.Entry(job_id, priority, project, submitted, tuple(demands), cluster)


def verdicts(turns) -> dict[str, tuple[bool, str]]:
    return {t.job_id: (t.start, t.reason) for t in turns}


TWO = nodes((400, 8000, 0), (400, 8000, 1))   # h1: cpu only, h2: one card


def test_two_jobs_needing_the_same_card_start_one_after_the_other():
    a = entry("2026a", TWO, submitted=1, worker=(1, 100, 0, 100))
    b = entry("2026b", TWO, submitted=2, worker=(1, 100, 0, 100))
    first = queue.turns([a, b], [], {}, {})
    assert [t.start for t in first] == [True, False]
    assert first[0].placements[0].node == "h2" and first[0].placements[0].gpus == ("0",)
    assert queue.waiting_line(first[1]) == ("waiting: 1st in queue; worker needs gpu 100, h2 has 0 free "
                                            "(held by 2026a)")
    # once a holds the card (the store's view), b waits, first in the queue
    again = queue.turns([b], first[0].holds, {"h2": {"0"}}, {})
    assert queue.waiting_line(again[0]) == "waiting: 1st in queue; worker needs gpu 100, h2 has 0 free (held by 2026a)"
    assert queue.turns([b], [], {}, {})[0].start   # a ended: b's turn


def test_priority_then_submit_time_decide_the_order():
    one_slot = nodes((100, 8000, 0))
    low = entry("low", one_slot, submitted=1, worker=(1, 100, 0, 0))
    high = entry("high", one_slot, priority=5, submitted=3, worker=(1, 100, 0, 0))
    later = entry("later", one_slot, priority=5, submitted=4, worker=(1, 100, 0, 0))
    turns = queue.turns([low, later, high], [queue.Hold("run", None, "h1", 100, 0, 0)], {}, {})
    assert [(t.job_id, t.position) for t in turns] == [("high", 1), ("later", 2), ("low", 3)]
    assert not any(t.start for t in turns)
    assert turns[0].reason == "worker needs cpu 100, h1 has 0 free (held by run)"
    assert [t.start for t in queue.turns([low, later, high], [], {}, {})] == [True, False, False]


def test_backfill_only_when_it_cannot_delay_the_head():
    head = entry("head", TWO, submitted=1, worker=(1, 400, 0, 100))      # the whole of h2 and its card
    small = entry("small", TWO, submitted=2, worker=(1, 100, 0, 0))      # fits on h1: h1 is not the head's
    held = [queue.Hold("run", None, "h2", 100, 0, 100)]
    turns = queue.turns([head, small], held, {"h2": {"0"}}, {})
    assert verdicts(turns)["head"][0] is False
    assert turns[1].start and turns[1].placements[0].node == "h1" and turns[1].backfill == "head"
    # a job that would take cores on h2, which the head needs when the card frees: it waits
    h2_only = nodes((400, 8000, 1))
    head2 = entry("head", h2_only, submitted=1, worker=(1, 300, 0, 100))
    sneaky = entry("sneaky", h2_only, submitted=2, worker=(1, 100, 0, 0))
    turns = queue.turns([head2, sneaky], [queue.Hold("run", None, "h1", 100, 0, 100)], {"h1": {"0"}}, {})
    assert [t.start for t in turns] == [False, False]
    assert turns[1].reason == "behind head (starting now would delay it)"


def test_a_job_alone_on_idle_nodes_may_use_more_instances_than_cores_but_not_held_cores():
    local = nodes((200, 8000, 0))
    big = entry("big", local, ps=(1, 100, 0, 0), worker=(2, 100, 0, 0))   # 3 cores' worth on 2
    assert queue.turns([big], [], {}, {})[0].start
    busy = queue.turns([big], [queue.Hold("other", None, "h1", 100, 0, 0)], {}, {})[0]
    assert not busy.start and busy.reason == "the job needs cpu 300 in all, h1 has 100 free (held by other)"


def test_quotas_cap_what_a_project_holds_and_a_job_bigger_than_its_quota_never_fits():
    quotas = queue.parse_quota({"vision": {"cpu": 200, "gpu": 100}, "default": {"cpu": 800}}, "q.yaml")
    held = [queue.Hold("v1", "vision", "h1", 200, 0, 0)]
    v2 = entry("v2", TWO, project="vision", submitted=1, worker=(1, 100, 0, 0))
    nlp = entry("nlp", TWO, project="nlp", submitted=2, worker=(1, 100, 0, 0))
    turns = queue.turns([v2, nlp], held, {}, quotas)
    assert turns[0].reason == "project vision over its quota: holds cpu 200 of 200, needs 100 more"
    assert not turns[0].start and turns[1].start   # over quota does not block another project
    with pytest.raises(UsageError) as err:
        queue.check_submit(entry("big", TWO, project="vision", worker=(3, 100, 0, 0)), quotas)
    assert err.value.message == "the job needs cpu 300, more than the quota of -project vision (cpu 200)"
    with pytest.raises(UsageError) as err:   # bigger than the cluster: today's one line
        queue.check_submit(entry("huge", TWO, worker=(1, 100, 0, 200)), {})
    assert "needs 2 GPUs, the most free on one node is 1" in err.value.message


@pytest.mark.parametrize("data, words", [
    ([1, 2], "expected a mapping of project -> limits"),
    ({"v": {"cpus": 1}}, "project 'v': unknown key 'cpus'"),
    ({"v": {"cpu": -1}}, "project 'v': key 'cpu': expected a whole number 0 or more, got -1"),
    ({"v": {"gpu": True}}, "key 'gpu': expected a whole number"),
    ({"v": None}, "project 'v': expected a mapping of cpu/memory/gpu limits"),
])
def test_a_bad_quota_is_one_line(data, words):
    with pytest.raises(UsageError) as err:
        queue.parse_quota(data, "quota file q.yaml")
    assert words in err.value.message and "\n" not in err.value.message


quota_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=5),
                            lambda c: st.lists(c, max_size=3) | st.dictionaries(
                                st.sampled_from(["cpu", "memory", "gpu", "x", ""]) | st.text(max_size=4), c,
                                max_size=3), max_leaves=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quota_values)
def test_quota_files_never_traceback(data):
    try:
        parsed = queue.parse_quota(data, "q.yaml")
    except UsageError as err:
        assert "\n" not in err.message
        return
    assert all(isinstance(v, int) and v >= 0 for limits in parsed.values() for v in limits.values())


def reference_turns(entries, holds, held_gpus, quotas) -> list[queue.Turn]:
    """The rules of docs/queue.md step by step, with none of turns()'s shortcuts
    (one verdict per shape of job while nothing starts, the shadows of the waiting
    jobs taken only when a later job could backfill): the model turns() must agree with."""
    ahead = queue.ordered(entries)
    all_nodes = {n.name: n for e in ahead for n in e.nodes}
    holds, gpus = list(holds), {node: set(ids) for node, ids in held_gpus.items()}
    free = queue._free(all_nodes.values(), holds, gpus)
    spare = queue._free(all_nodes.values(), holds, gpus)
    blocked, out = None, []
    for position, e in enumerate(ahead, 1):
        turn = queue.Turn(e.job_id, position)
        out.append(turn)
        turn.reason = queue.over_quota(e, quotas, queue.held_by_project(holds)) or ""
        if turn.reason:
            continue
        placed = queue._try(e, free, set(all_nodes) - {h.node for h in holds} if blocked is None else set())
        if placed is not None and blocked is not None:
            placed = queue._try(e, spare, set())
            turn.backfill = blocked.job_id if placed is not None else None
        if placed is None:
            turn.reason = queue.why_waiting(e, free, holds, gpus, blocked)
            blocked = blocked or e
            shadow = queue._try(e, placing.free_resources(e.nodes), {n.name for n in e.nodes})
            if shadow is not None:
                queue._take(spare, e.demands, shadow)
            continue
        turn.start, turn.placements, turn.position = True, placed, 0
        turn.holds = queue.holds_of(e.job_id, e.project, e.demands, placed)
        holds.extend(turn.holds)
        for p in placed:
            gpus.setdefault(p.node, set()).update(p.gpus)
        queue._take(free, e.demands, placed)
        queue._take(spare, e.demands, placed)
    for position, turn in enumerate((t for t in out if not t.start), 1):
        turn.position = position
    return out


CLUSTERS = (nodes((200, 8000, 0)), TWO, nodes((400, 4000, 2), (200, 8000, 1), (100, 2000, 0)))
# A few shapes, so that a queue holds many jobs alike (as a sweep does) and some that differ.
SHAPES = ({"worker": (1, 100, 0, 0)}, {"worker": (1, 200, 0, 0)}, {"worker": (2, 100, 1000, 0)},
          {"worker": (1, 100, 0, 100)}, {"ps": (1, 100, 0, 0), "worker": (2, 100, 0, 100)},
          {"worker": (1, 400, 4000, 200)}, {"worker": (3, 100, 0, 0)})


@st.composite
def queues(draw):
    cluster = draw(st.sampled_from(CLUSTERS))
    names = [n.name for n in cluster]
    projects = st.sampled_from([None, "vision", "nlp"])
    entries = [entry(f"j{n:02d}", cluster, priority=draw(st.integers(0, 2)), project=draw(projects),
                     submitted=float(n), **draw(st.sampled_from(SHAPES)))
               for n in range(draw(st.integers(0, 14)))]
    holds = [queue.Hold(f"r{n}", draw(projects), draw(st.sampled_from(names)), draw(st.sampled_from([0, 100, 200])),
                        draw(st.sampled_from([0, 2000])), 0) for n in range(draw(st.integers(0, 3)))]
    held_gpus = {n.name: set(draw(st.lists(st.sampled_from(n.gpus), unique=True))) for n in cluster if n.gpus}
    quotas = draw(st.sampled_from([{}, {"vision": {"cpu": 300}}, {"default": {"gpu": 100}, "nlp": {"cpu": 400}}]))
    return entries, holds, held_gpus, quotas


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queues())
def test_the_turns_agree_with_the_rules_taken_step_by_step(case):
    assert queue.turns(*case) == reference_turns(*case)


def test_ordinals():
    assert [queue.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == \
        ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]


# -- through the store: one transaction decides, the verdicts are recorded --------------


def record(store: Store, job_id: str, cluster, priority=0, project=None, **roles) -> None:
    store.create_job(job_id, name=job_id, framework="python", project=project, task_name="T",
                     job_dir=store.jobs_dir / job_id,
                     roles=[{"name": r, "count": c[0], "must_finish": True} for r, c in roles.items()])
    plan = JobPlan("j", "python", "T", [RolePlan(r, c[0], ["true"], cpu=c[1], memory=c[2], gpu=c[3])
                                        for r, c in roles.items()])
    store.enqueue(job_id, priority, project, queue_turns.check_and_describe(store, plan, list(cluster),
                                                                              priority, project))


def test_the_store_records_turns_holds_claims_and_reasons(tmp_path, monkeypatch, store_kind):
    monkeypatch.delenv("PAI_QUOTA", raising=False)
    store = Store(tmp_path)
    record(store, "2026a", TWO, worker=(1, 100, 0, 100))
    record(store, "2026b", TWO, worker=(1, 100, 0, 100))
    queue_turns.dispatch(store)
    placed = json.loads(store.take_turn("2026a"))
    assert placed[0]["node"] == "h2" and placed[0]["gpus"] == ["0"]
    assert store.held("gpu") == {"h2": {"0"}}
    assert store.take_turn("2026b") is None
    assert store.job("2026b")["reason"] == "waiting: 1st in queue; worker needs gpu 100, h2 has 0 free (held by 2026a)"
    listed = queue_turns.listing(store)
    assert [(q["id"], q["position"], q["needs"]["gpu"]) for q in listed] == [("2026b", 1, 100)]
    store.set_job("2026a", JobStatus.RUNNING)
    store.set_job("2026a", JobStatus.SUCCEEDED)
    lifecycle.job_ended(store, "2026a")
    assert json.loads(store.take_turn("2026b"))[0]["gpus"] == ["0"]
    assert store.job("2026b")["reason"] is None
    assert queue_turns.listing(store) == []


def test_a_broken_quota_file_holds_the_queue_and_says_so(tmp_path, monkeypatch):
    store = Store(tmp_path)
    bad = tmp_path / "elsewhere.yaml"
    bad.write_text("vision: {cpu: [\n")
    monkeypatch.setenv("PAI_QUOTA", str(bad))
    with pytest.raises(UsageError) as err:
        queue_turns.load_quotas(store)
    assert err.value.message == f"quota file {bad}: not valid YAML"
    monkeypatch.delenv("PAI_QUOTA")
    record(store, "2026a", TWO, worker=(1, 100, 0, 0))
    monkeypatch.setenv("PAI_QUOTA", str(bad))
    queue_turns.dispatch(store)
    assert store.take_turn("2026a") is None
    assert "the quota file is broken" in store.job("2026a")["reason"]


def test_what_a_job_whose_master_is_gone_held_is_free(tmp_path, monkeypatch, store_kind):
    """After a reboot (or a master's kill -9) the jobs recorded Running hold
    nothing: nobody may be left waiting for them to be recorded lost."""
    monkeypatch.delenv("PAI_QUOTA", raising=False)
    store = Store(tmp_path)
    record(store, "2026a", TWO, worker=(1, 400, 0, 100))
    record(store, "2026b", TWO, worker=(1, 400, 0, 100))
    queue_turns.dispatch(store)
    assert store.take_turn("2026a") and store.take_turn("2026b") is None
    store.update_job("2026a", master_pid=os.getpid(), master_start="1")   # not this process's start: gone
    queue_turns.dispatch(store)
    assert json.loads(store.take_turn("2026b"))[0]["gpus"] == ["0"]


def test_a_moved_instance_takes_its_hold_along(tmp_path, monkeypatch, store_kind):
    from paicli.cluster.backends.base import Placement

    monkeypatch.delenv("PAI_QUOTA", raising=False)
    store = Store(tmp_path)
    record(store, "2026a", TWO, worker=(2, 100, 0, 0))
    queue_turns.dispatch(store)
    assert {p["node"] for p in json.loads(store.take_turn("2026a"))} == {"h1"}
    plan = JobPlan("j", "python", "T", [RolePlan("worker", 2, ["true"], cpu=100)])
    queue_turns.placed_again(store, "2026a", placing.demands(plan),
                             [Placement("worker", 0, "h1", "a"), Placement("worker", 1, "h2", "b")])
    assert [(h["node"], h["cpu"]) for h in store.queue_holds("2026a")] == [("h1", 100), ("h2", 100)]


def test_a_backfilled_job_says_so_in_its_event_log(tmp_path, monkeypatch, store_kind):
    monkeypatch.delenv("PAI_QUOTA", raising=False)
    store = Store(tmp_path)
    record(store, "2026a", TWO, worker=(1, 100, 0, 100))     # takes h2's card
    queue_turns.dispatch(store)
    assert store.take_turn("2026a")
    record(store, "2026b", TWO, worker=(1, 400, 0, 100))     # waits for h2, all of it
    record(store, "2026c", TWO, worker=(1, 100, 0, 0))       # h1 only: cannot delay b
    queue_turns.dispatch(store)
    assert store.take_turn("2026b") is None and store.take_turn("2026c")
    assert [e["message"] for e in store.events("2026c") if e["kind"] == "queue"] == \
        ["backfilled: starts ahead of 2026b, which it cannot delay (it uses only room that job will not need)"]
    assert store.job("2026b")["reason"] == "waiting: 1st in queue; worker needs gpu 100, h2 has 0 free (held by 2026a)"


def test_the_sweep_gives_a_queued_job_a_new_supervisor_instead_of_declaring_it_lost(tmp_path, monkeypatch, store_kind):
    """The next job's watchdog (lifecycle.sweep_lost) records jobs whose master is
    gone; a queued one, of which nothing ran, it revives instead (issue 16: no
    reader does any more)."""
    import subprocess

    from paicli.cluster import lifecycle, procinfo, spawn

    monkeypatch.delenv("PAI_QUOTA", raising=False)
    store = Store(tmp_path)
    record(store, "2026a", TWO, worker=(1, 100, 0, 0))
    gone = subprocess.Popen(["true"])
    gone.wait()
    store.update_job("2026a", master_pid=gone.pid, master_start="1")
    started = []

    class NewSupervisor:   # a process that is not a master
        def start(self, job_id):
            started.append(subprocess.Popen(["sleep", "60"]))
            return started[-1].pid

        def close(self):
            pass

    monkeypatch.setattr(spawn, "start_master", lambda home, job_dir: NewSupervisor())
    try:
        assert lifecycle.sweep_lost(store, report=lambda line: None) == []
        job = store.job("2026a")
        assert (job["status"], job["master_pid"]) == ("Waiting", started[0].pid)
        assert job["master_start"] == procinfo.start_time(started[0].pid)
        assert [e["message"] for e in store.events("2026a") if e["kind"] == "queue"] == \
            ["its supervisor was gone; a new one takes its place in the queue"]
        assert lifecycle.sweep_lost(store, report=lambda line: None) == [] and len(started) == 1   # alive now
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_only_the_owner_or_an_admin_may_act_on_a_job():
    admins = queue.parse_admins({"admins": ["ops"], "vision": {"gpu": 100}}, "q.yaml")
    assert queue.parse_quota({"admins": ["ops"], "vision": {"gpu": 100}}, "q.yaml") == {"vision": {"gpu": 100}}
    assert queue.may_act(("alice", None), ("alice", None), admins)
    assert not queue.may_act(("bob", None), ("alice", None), admins)
    assert not queue.may_act(("alice", "shared"), ("alice", "other"), admins)   # the role counts
    assert queue.may_act(("bob", None), ("ops", None), admins)
    assert queue.may_act(("bob", None), ("alice", "ops"), admins)               # an admin's role
    assert not queue.may_act(("bob", None), ("ops", "alice"), admins)           # a role that is not
    assert queue.may_act((None, None), ("alice", None), frozenset())            # recorded before users
    with pytest.raises(UsageError) as err:
        queue.parse_admins({"admins": "ops"}, "q.yaml")
    assert err.value.message == "q.yaml: admins: expected a list of user or role names, got 'ops'"
