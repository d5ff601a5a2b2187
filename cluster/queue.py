"""The queue's policy: who starts now, who waits and why (pure functions).

No scheduler daemon: each waiting job's JobMaster and every master that frees room
run `turns()` inside one store transaction (paicli.cluster.queue_turns).

Rules (PAI units: cpu 100 = one core, gpu 100 = one card, memory in MB):
- What running paicli jobs hold (cpu, memory, cards, per node) is not free.
- Order: priority (higher first), then submit time, then job ID.
- A job starts when it fits in what is free NOW. Memory and cards are hard
  limits; cores are hard on a node another job holds, and a packing weight on an
  idle one (a job alone on idle nodes may run more instances than cores).
- A job that does not fit blocks those behind it, except one that fits in what is
  free minus the "shadow" of the blocked jobs ahead (backfill): job lengths are
  unknown, so a backfilled job never takes what a job ahead will need.
- Quotas cap what each project holds at once; a job over its project's quota
  waits (and does not block other projects); one bigger than its quota could
  never start (exit 2 at submit, `check_submit`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from dataclasses import dataclass, field

from paicli.cluster import placement as placing
from paicli.cluster.backends.base import NodeSpec, Placement
from paicli.errors import UsageError


KEYS = ("cpu", "memory", "gpu")
DEFAULT_PROJECT = "default"   # the quota file's entry for jobs without -project and unlisted projects


@dataclass(frozen=True)
class Entry:
    """A waiting job: what it needs and the nodes it was submitted against."""
    job_id: str
    priority: int
    project: str | None
    submitted: float
    demands: tuple[placing.Demand, ...]
    nodes: tuple[NodeSpec, ...]


@dataclass(frozen=True)
class Hold:
    """What a started, live job holds on one node."""
    job_id: str
    project: str | None
    node: str
    cpu: int
    memory: int
    gpu: int          # PAI units (cards * 100)


@dataclass
class Turn:
    """The verdict on one waiting job."""
    job_id: str
    position: int                      # 1-based among the jobs that still wait; 0 when it starts
    start: bool = False
    placements: list[Placement] | None = None
    reason: str = ""                   # why it waits (empty when it starts)
    backfill: str | None = None        # the job it starts ahead of, when it is backfilled
    holds: list[Hold] = field(default_factory=list)


# -- the demands of a job -----------------------------------------------------------


def totals(demands: Iterable[placing.Demand]) -> dict[str, int]:
    out = dict.fromkeys(KEYS, 0)
    for d in demands:
        out["cpu"] += d.cpu
        out["memory"] += d.memory
        out["gpu"] += d.cards * 100
    return out


def holds_of(job_id: str, project: str | None, demands: Iterable[placing.Demand],
             placements: list[Placement]) -> list[Hold]:
    """Per node, what a placed job holds."""
    where = {(p.role, p.idx): p.node for p in placements}
    per: dict[str, list[placing.Demand]] = {}
    for d in demands:
        per.setdefault(where[(d.role, d.idx)], []).append(d)
    return [Hold(job_id, project, node, **totals(on_node)) for node, on_node in per.items()]


# -- quotas ---------------------------------------------------------------------------


def parse_quota(data: Any, where: str) -> dict[str, dict[str, int]]:
    """The quota file's content (already read as YAML): project -> {cpu, memory, gpu},
    each optional. One-line UsageError naming the key on anything else."""
    hint = "e.g. vision: {cpu: 800, memory: 32000, gpu: 200} (PAI units: cpu 100 = one core, gpu 100 = one card)"
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping of project -> limits", hint)
    out: dict[str, dict[str, int]] = {}
    parse_admins(data, where)
    for project, limits in data.items():
        if project == ADMINS:
            continue
        name = f"{where}: project {project!r}"[:200]
        if not isinstance(project, str) or not project.strip():
            raise UsageError(f"{name}: expected a project name", hint)
        if not isinstance(limits, dict) or not limits:
            raise UsageError(f"{name}: expected a mapping of cpu/memory/gpu limits, got {limits!r}"[:200], hint)
        out[project] = {}
        for key, value in limits.items():
            if key not in KEYS:
                raise UsageError(f"{name}: unknown key {key!r}"[:200], f"known keys: {', '.join(KEYS)}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{name}: key {key!r}: expected a whole number 0 or more, got {value!r}"[:200],
                                 hint)
            out[project][key] = value
    return out


def parse_limits(words: tuple[str, ...]) -> dict[str, Any]:
    """`cpu=800 gpu=200` as {"cpu": 800, "gpu": 200} (parse_quota checks the keys)."""
    out: dict[str, Any] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not value.isdigit():
            raise UsageError(f"pai quota set: {word!r}: expected KEY=NUMBER"[:200],
                             "e.g. cpu=800 memory=32000 gpu=200 (PAI units)")
        out[key] = int(value)
    return out


ADMINS = "admins"   # the quota file's list of the users (or database roles) that may act on any job


def parse_admins(data: Any, where: str) -> frozenset[str]:
    """The quota file's `admins:` (a list of names; none: nobody)."""
    names = data.get(ADMINS) if isinstance(data, dict) else None
    if names is None:
        return frozenset()
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise UsageError(f"{where}: {ADMINS}: expected a list of user or role names, got {names!r}"[:200],
                         "e.g. admins: [alice, ops]")
    return frozenset(names)


def may_act(owner: tuple[str | None, str | None], me: tuple[str, str | None], admins: frozenset[str]) -> bool:
    """May `me` (Unix user, database role where it differs) kill, resume or get the
    files of a job of `owner`? Its owner may (a job recorded before jobs carried
    their user is the store's owner's), and an admin: one whose role (else user)
    the quota file's admins: names."""
    return owner[0] is None or tuple(owner) == tuple(me) or is_admin(me, admins)


def is_admin(me: tuple[str, str | None], admins: frozenset[str]) -> bool:
    """Does the admins: list name `me`'s database role (else its Unix user)?"""
    return (me[1] or me[0]) in admins


def quota_for(quotas: dict[str, dict[str, int]], project: str | None) -> dict[str, int] | None:
    if project and project in quotas:
        return quotas[project]
    return quotas.get(DEFAULT_PROJECT)


def check_submit(entry: Entry, quotas: dict[str, dict[str, int]]) -> None:
    """Exit 2 for a job that could never start: bigger than its project's quota,
    or not placeable on the cluster even when every node is idle."""
    quota = quota_for(quotas, entry.project)
    if quota:
        need = totals(entry.demands)
        for key, cap in quota.items():
            if need[key] > cap:
                who = f"-project {entry.project}" if entry.project else "jobs without -project"
                raise UsageError(f"the job needs {key} {need[key]}, more than the quota of {who} ({key} {cap})",
                                 "make the job smaller in -Dcluster, or raise the quota in the quota file")
    placing.place(list(entry.demands), list(entry.nodes))   # no_fit's one line when it never fits


def held_by_project(holds: Iterable[Hold]) -> dict[str | None, dict[str, int]]:
    """project -> what its started jobs hold in all (the quotas count that)."""
    out: dict[str | None, dict[str, int]] = {}
    for h in holds:
        held = out.setdefault(h.project, dict.fromkeys(KEYS, 0))
        held["cpu"] += h.cpu
        held["memory"] += h.memory
        held["gpu"] += h.gpu // 100 * 100   # whole cards
    return out


def over_quota(entry: Entry, quotas: dict[str, dict[str, int]], held: dict[str | None, dict[str, int]]) -> str | None:
    """Why the job must wait for its project's own jobs to end, or None. A
    project's quota counts what that project's started jobs hold (`held`, from
    held_by_project; `default` applies to each unlisted project alone, and to
    jobs without -project)."""
    quota = quota_for(quotas, entry.project)
    if not quota:
        return None
    holds = held.get(entry.project, dict.fromkeys(KEYS, 0))
    need = totals(entry.demands)
    for key, cap in quota.items():
        if holds[key] + need[key] > cap:
            who = f"project {entry.project}" if entry.project else "jobs without -project"
            return f"{who} over its quota: holds {key} {holds[key]} of {cap}, needs {need[key]} more"
    return None


# -- the turns ------------------------------------------------------------------------


def ordered(entries: Iterable[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (-e.priority, e.submitted, e.job_id))


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _free(nodes: Iterable[NodeSpec], holds: list[Hold], held_gpus: dict[str, set[str]]) -> dict[str, placing.Free]:
    free = placing.free_resources(nodes, held_gpus)
    for h in holds:
        if h.node in free:
            free[h.node].cpu -= h.cpu
            free[h.node].memory -= h.memory
    return free


def _try(entry: Entry, free: dict[str, placing.Free], idle: set[str]) -> list[Placement] | None:
    """Where the job would go in `free` (left as it is), or None."""
    room = {n.name: _copy(free[n.name]) for n in entry.nodes if n.name in free}
    try:
        return placing.place(list(entry.demands), list(entry.nodes), room, soft_cpu=idle)
    except UsageError:
        return None


def _take(free: dict[str, placing.Free], demands: Iterable[placing.Demand], placements: list[Placement]) -> None:
    by = {(d.role, d.idx): d for d in demands}
    for p in placements:
        placing.reserve(free, p, by[(p.role, p.idx)])


def turns(entries: Iterable[Entry], holds: list[Hold], held_gpus: dict[str, set[str]],
          quotas: dict[str, dict[str, int]]) -> list[Turn]:
    """The verdict on every waiting job, in queue order. `holds`: what started live
    jobs hold (cpu and memory; `held_gpus`: their cards, node -> ids)."""
    queue = ordered(entries)
    nodes: dict[str, NodeSpec] = {}
    for e in queue:
        nodes.update((n.name, n) for n in e.nodes)
    holds = list(holds)
    held = held_by_project(holds)
    gpus = {node: set(ids) for node, ids in held_gpus.items()}
    free = _free(nodes.values(), holds, gpus)
    idle = set(nodes) - {h.node for h in holds}
    # What jobs ahead that wait will take when they start (none may be delayed). Only
    # a job that fits in what is free now needs it: the waiting jobs' shadows are
    # taken from it then, not for every job of a long queue that waits.
    spare = _free(nodes.values(), holds, gpus)
    shadows: list[Entry] = []
    # The reason a job waits depends on its shape and on what is free (which changes
    # only when a job starts): a long queue of jobs alike is judged once per start.
    waits: dict[tuple, str] = {}
    blocked: Entry | None = None
    out = []
    for position, entry in enumerate(queue, 1):
        turn = Turn(entry.job_id, position)
        out.append(turn)
        quota = over_quota(entry, quotas, held)
        if quota:
            turn.reason = quota
            continue
        shape = (entry.demands, entry.nodes, blocked.job_id if blocked else None)
        placed = None if shape in waits else _try(entry, free, idle if blocked is None else set())
        if placed is None:
            if shape not in waits:
                waits[shape] = why_waiting(entry, free, holds, gpus, blocked)
            turn.reason = waits[shape]
        elif blocked is not None:
            # Backfill: only into what the jobs ahead that wait leave free.
            for ahead in shadows:
                # Its shadow: where it would go on its nodes if they were all idle.
                shadow = _try(ahead, placing.free_resources(ahead.nodes), {n.name for n in ahead.nodes})
                if shadow is not None:
                    _take(spare, ahead.demands, shadow)
            shadows.clear()
            placed = _try(entry, spare, set())
            turn.backfill = blocked.job_id if placed is not None else None
            if placed is None:
                turn.reason = why_waiting(entry, free, holds, gpus, blocked)
        if placed is None:
            blocked = blocked or entry
            shadows.append(entry)
            continue
        turn.start, turn.placements, turn.position = True, placed, 0
        turn.holds = holds_of(entry.job_id, entry.project, entry.demands, placed)
        holds.extend(turn.holds)
        project = held.setdefault(entry.project, dict.fromkeys(KEYS, 0))
        for key, value in totals(entry.demands).items():
            project[key] += value
        idle.difference_update(h.node for h in turn.holds)
        for p in placed:
            gpus.setdefault(p.node, set()).update(p.gpus)
        _take(free, entry.demands, placed)
        _take(spare, entry.demands, placed)
        waits.clear()
    for position, turn in enumerate((t for t in out if not t.start), 1):
        turn.position = position
    return out


def _copy(room: placing.Free) -> placing.Free:
    return placing.Free(room.cpu, room.memory, list(room.gpus), room.services)


def why_waiting(entry: Entry, free: dict[str, placing.Free], holds: list[Hold], gpus: dict[str, set[str]],
                blocked: Entry | None) -> str:
    """PAI's Waiting List line, e.g. "worker needs gpu 100, h2 has 0 free (held by 2026...)":
    the first instance that fits on no node now (naming the node that could take
    it when free), else the job as a whole, else the job ahead it must not delay."""
    usable = [n for n in entry.nodes if n.name in free]
    amount = {"gpu": lambda n: len(free[n.name].gpus) * 100, "memory": lambda n: free[n.name].memory,
              "cpu": lambda n: free[n.name].cpu}
    capacity = {"gpu": lambda n: len(n.gpus) * 100, "memory": lambda n: n.memory, "cpu": lambda n: n.cpu}
    for d in entry.demands:
        need = {"gpu": d.cards * 100, "memory": d.memory, "cpu": d.cpu}
        for key in ("gpu", "memory", "cpu"):
            if need[key] and not any(amount[key](n) >= need[key] for n in usable):
                node = max(usable, key=lambda n: (capacity[key](n) >= need[key], amount[key](n)))
                return (f"{d.role} needs {key} {need[key]}, {node.name} has {max(0, amount[key](node))} free"
                        f"{_held_by([node.name], holds, key)}")
    if blocked is not None:
        return f"behind {blocked.job_id} (starting now would delay it)"
    need = totals(entry.demands)
    for key in ("gpu", "memory", "cpu"):
        left = sum(max(0, amount[key](n)) for n in usable)
        if need[key] > left:
            names = [n.name for n in usable]
            where = f"{names[0]} has" if len(names) == 1 else f"{', '.join(names)} have"
            return f"the job needs {key} {need[key]} in all, {where} {left} free{_held_by(names, holds, key)}"
    return f"needs cpu {need['cpu']}, memory {need['memory']}, gpu {need['gpu']} free at once"


def _held_by(nodes: list[str], holds: list[Hold], key: str) -> str:
    jobs = list(dict.fromkeys(h.job_id for h in holds if h.node in nodes and getattr(h, key)))
    if not jobs:
        return ""
    more = f" and {len(jobs) - 2} more" if len(jobs) > 2 else ""
    return f" (held by {', '.join(jobs[:2])}{more})"


def waiting_line(turn: Turn) -> str:
    return f"waiting: {ordinal(turn.position)} in queue; {turn.reason}"

