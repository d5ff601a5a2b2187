"""Placement units (cluster/placement.py): bin-packing, spreading services, the
no-fit message, GPUs held by running jobs, nodes to avoid, and the exit policy
(cluster/policy.py) that decides when an instance is placed again."""

from __future__ import annotations

import pytest

from paicli.cluster import placement as placing
from paicli.cluster import policy
from paicli.cluster.backends.base import NODE_LOST, Backend, NodeSpec
from paicli.cluster.job_placement import place_job
from paicli.errors import UsageError
from paicli.jobplan import RESTART_INSTANCE, RESTART_JOB, JobPlan, RolePlan
from paicli.states import JobStatus
from paicli.store import Store


def nodes(*specs) -> list[NodeSpec]:
    return [NodeSpec(f"h{i + 1}", f"10.0.0.{i + 11}", cpu, mem, tuple(str(g) for g in range(gpus)))
            for i, (cpu, mem, gpus) in enumerate(specs)]


def plan(**roles) -> JobPlan:
    """roles: name=(count, cpu, memory, gpu, must_finish)."""
    return JobPlan("j", "python", "T", [RolePlan(name, c[0], ["true"], must_finish=c[4], cpu=c[1], memory=c[2],
                                                 gpu=c[3]) for name, c in roles.items()])


def where(placements) -> dict[str, str]:
    return {f"{p.role}:{p.idx}": p.node for p in placements}


def test_the_local_machine_is_a_one_node_cluster_that_takes_a_job_bigger_than_its_cores():
    one = nodes((200, 16000, 0))
    placed = placing.place_plan(plan(ps=(1, 100, 0, 0, False), worker=(2, 100, 0, 0, True)), one)
    assert set(where(placed).values()) == {"h1"}
    assert all(p.host == "10.0.0.11" and p.gpus == () for p in placed)


def test_workers_are_bin_packed_on_the_fullest_node_with_room():
    cluster = nodes((400, 8000, 0), (400, 8000, 0), (400, 8000, 0))
    placed = where(placing.place_plan(plan(worker=(6, 100, 1000, 0, True)), cluster))
    assert placed == {"worker:0": "h1", "worker:1": "h1", "worker:2": "h1", "worker:3": "h1",
                      "worker:4": "h2", "worker:5": "h2"}


def test_services_are_spread_and_workers_fill_in_around_them():
    cluster = nodes((200, 8000, 0), (200, 8000, 0), (200, 8000, 0))
    placed = where(placing.place_plan(plan(ps=(3, 100, 0, 0, False), worker=(3, 100, 0, 0, True)), cluster))
    assert sorted(placed[f"ps:{i}"] for i in range(3)) == ["h1", "h2", "h3"]
    assert sorted(placed[f"worker:{i}"] for i in range(3)) == ["h1", "h2", "h3"]


def test_one_ps_and_two_workers_on_three_one_core_nodes_use_every_node():
    cluster = nodes((100, 4000, 0), (100, 4000, 0), (100, 4000, 0))
    placed = where(placing.place_plan(plan(ps=(1, 100, 0, 0, False), worker=(2, 100, 0, 0, True)), cluster))
    assert sorted(placed.values()) == ["h1", "h2", "h3"]


def test_no_fit_names_the_role_and_what_is_short():
    cluster = nodes((200, 8000, 0), (200, 8000, 0))
    with pytest.raises(UsageError) as err:
        placing.place_plan(plan(worker=(2, 400, 0, 0, True)), cluster)
    assert err.value.message == "-Dcluster: worker needs cpu 400, the largest node has 200"
    with pytest.raises(UsageError) as err:
        placing.place_plan(plan(worker=(1, 100, 9000, 0, True)), cluster)
    assert err.value.message == "-Dcluster: worker needs memory 9000 MB, the largest free node has 8000 MB"
    # Each fits alone; the third no longer finds the memory.
    with pytest.raises(UsageError) as err:
        placing.place_plan(plan(worker=(3, 100, 6000, 0, True)), cluster)
    assert err.value.message.startswith("-Dcluster: worker:2 needs memory 6000 MB, the largest free node has 2000")
    assert err.value.exit_code == 2


def test_gpus_are_handed_out_once_and_those_held_by_running_jobs_are_not_free():
    cluster = nodes((800, 8000, 2), (800, 8000, 2))
    placed = placing.place_plan(plan(worker=(3, 100, 0, 100, True)), cluster)
    cards = [(p.node, g) for p in placed for g in p.gpus]
    assert len(cards) == len(set(cards)) == 3
    # Another job holds card 0 of h1 and both of h2: one card is left.
    held = {"h1": {"0"}, "h2": {"0", "1"}}
    placed = placing.place_plan(plan(worker=(1, 100, 0, 100, True)), cluster, held)
    assert (placed[0].node, placed[0].gpus) == ("h1", ("1",))
    with pytest.raises(UsageError) as err:
        placing.place_plan(plan(worker=(2, 100, 0, 100, True)), cluster, held)
    assert "worker:1 needs 1 GPU, the most free on one node is 0 (cards held by running jobs or by this" in err.value.message


def test_instances_asking_for_no_gpu_get_none():
    placed = placing.place_plan(plan(ps=(1, 100, 0, 0, False), worker=(1, 100, 0, 200, True)),
                                nodes((800, 8000, 4)))
    assert {p.role: p.gpus for p in placed} == {"ps": (), "worker": ("0", "1")}


def test_an_avoided_node_is_not_used_and_with_none_left_the_error_names_it():
    cluster = nodes((400, 8000, 0), (400, 8000, 0))
    placed = where(placing.place_plan(plan(worker=(2, 100, 0, 0, True)), cluster, avoid={"h1"}))
    assert set(placed.values()) == {"h2"}
    with pytest.raises(UsageError) as err:
        placing.place_plan(plan(worker=(1, 100, 0, 0, True)), cluster, avoid={"h1", "h2"})
    assert "no node is left (lost or avoided: h1, h2)" in err.value.message


def test_moving_one_instance_counts_what_the_others_use():
    cluster = nodes((200, 4000, 0), (200, 4000, 0), (200, 4000, 0))
    job = plan(worker=(3, 100, 3000, 0, True))
    placed = placing.place_plan(job, cluster)
    assert where(placed) == {"worker:0": "h1", "worker:1": "h2", "worker:2": "h3"}
    # h2 is lost: worker:1 must go where the memory still is, never h2.
    free = placing.free_resources(cluster)
    wanted = placing.demands(job)
    for p, d in zip(placed, wanted):
        if p.node != "h2":
            placing.reserve(free, p, d)
    with pytest.raises(UsageError):  # 1000 MB left on h1 and h3 each
        placing.place([wanted[1]], cluster, free, avoid={"h2"})
    bigger = nodes((200, 8000, 0), (200, 4000, 0), (200, 4000, 0))
    free = placing.free_resources(bigger)
    placing.reserve(free, placed[0], wanted[0])
    placing.reserve(free, placed[2], wanted[2])
    moved = placing.place([wanted[1]], bigger, free, avoid={"h2"})
    assert moved[0].node == "h1" and moved[0].host == "10.0.0.11"


def test_ten_thousand_instances_on_a_thousand_nodes_all_placed_within_capacity():
    cluster = [NodeSpec(f"n{i}", f"10.1.{i // 250}.{i % 250}", 1600, 64000, tuple(str(g) for g in range(10)))
               for i in range(1000)]
    job = plan(ps=(100, 100, 2000, 0, False), worker=(9900, 100, 2000, 50, True))
    placed = placing.place_plan(job, cluster)
    assert len(placed) == 10000
    per_node: dict[str, int] = {}
    for p in placed:
        per_node[p.node] = per_node.get(p.node, 0) + 1
    assert max(per_node.values()) <= 16  # cpu 1600 / 100
    assert len({p.node for p in placed if p.role == "ps"}) == 100  # spread
    cards = [(p.node, g) for p in placed for g in p.gpus]
    assert len(cards) == len(set(cards)) == 9900


# -- the exit policy -------------------------------------------------------------------------


def judge(code, tail=(), restart=RESTART_INSTANCE, max_retries=3, instance_retries=0, job_retries=0, **kw):
    return policy.judge_exit(code, list(tail), restart=restart, max_retries=max_retries,
                             instance_retries=instance_retries, job_retries=job_retries, name="worker:1", **kw)


def test_port_conflict_restarts_the_job_but_spends_retries_and_respects_max_retries_0():
    taken = ["E0000 could not start gRPC server", "address already in use"]
    verdict = judge(1, taken)
    assert (verdict.action, verdict.port_conflict) == (policy.RESTART_JOB_, True)
    stopped = judge(1, taken, max_retries=0)
    assert stopped.action == policy.FAIL
    assert stopped.reason == "worker:1 exited with code 1 (its port was taken) (no retries left of 0)"
    assert judge(1, taken, max_retries=2, job_retries=2).action == policy.FAIL
    assert judge(1, ["plain error"]).action == policy.FAIL  # exit 1 without the marker: permanent


def test_node_lost_is_retryable_and_a_listening_instance_restarts_the_job():
    assert judge(NODE_LOST, node="h2").action == policy.RESTART_INSTANCE
    assert judge(NODE_LOST, node="h2", moved_listens=True).action == policy.RESTART_JOB_
    out = judge(NODE_LOST, node="h2", max_retries=0)
    assert out.action == policy.FAIL and out.reason == "worker:1 lost with its node h2 (no retries left of 0)"
    assert judge(137, restart=RESTART_JOB, job_retries=1, max_retries=1).action == policy.FAIL
    assert judge(0).action == policy.FINISHED


@pytest.mark.parametrize("raw, ok", [("3", 3.0), ("0", 0.0), ("0.5", 0.5), ("", 3.0), ("abc", None),
                                     ("-1", None), ("nan", None), ("inf", None), ("1e9", None)])
def test_stop_timeout_values(raw, ok):
    if ok is None:
        with pytest.raises(UsageError) as err:
            policy.stop_timeout({"PAI_STOP_TIMEOUT": raw})
        assert err.value.message.startswith(f"PAI_STOP_TIMEOUT={raw!r}: expected seconds")
        value, note = policy.stop_timeout_or_default({"PAI_STOP_TIMEOUT": raw})
        assert value == 3.0 and "using 3" in note
    else:
        assert policy.stop_timeout({"PAI_STOP_TIMEOUT": raw}) == ok


# -- GPU claims across jobs (the store's claims table) ---------------------------------------


class GpuNodes(Backend):
    """Nodes as data only: what a backend with GPUs reports (placement needs no process)."""
    name = "gpu-data"

    def nodes(self):
        return nodes((800, 8000, 2), (800, 8000, 1))


def test_concurrent_jobs_never_get_the_same_card_and_an_ended_job_gives_its_cards_back(tmp_path, store_kind):
    store = Store(tmp_path)
    for job in ("a", "b", "c"):
        store.create_job(job, name=job, framework="python", project=None, task_name="T", job_dir=tmp_path,
                         roles=[{"name": "worker", "count": 1, "must_finish": True}])
    backend = GpuNodes()
    two = plan(worker=(1, 100, 0, 200, True))
    first = place_job(store, "a", two, backend)
    assert (first[0].node, first[0].gpus) == ("h1", ("0", "1"))
    one = plan(worker=(1, 100, 0, 100, True))
    second = place_job(store, "b", one, backend)
    assert (second[0].node, second[0].gpus) == ("h2", ("0",))
    with pytest.raises(UsageError) as err:
        place_job(store, "c", one, backend)
    assert "needs 1 GPU, the most free on one node is 0" in err.value.message
    store.set_job("a", JobStatus.CANCELLED, "done")  # an ended job's claims go with it
    third = place_job(store, "c", one, backend)
    assert (third[0].node, third[0].gpus) == ("h1", ("0",))
    assert store.held("gpu") == {"h1": {"0"}, "h2": {"0"}}


def test_a_claim_whose_job_was_never_recorded_lapses(tmp_path, monkeypatch, store_kind):
    """A submit killed between claiming its cards and recording its job must not
    hold them for good."""
    store = Store(tmp_path)
    assert store.claim("gpu", "h1", ["0"], "never-recorded")
    assert store.held("gpu") == {"h1": {"0"}}
    assert not store.claim("gpu", "h1", ["0"], "other")
    monkeypatch.setattr("paicli.store.time.time", lambda: 10 ** 10)  # long after
    assert store.held("gpu") == {}
    assert store.claim("gpu", "h1", ["0"], "other")
