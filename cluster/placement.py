"""Placement: which node runs each instance of a job, and with which GPUs.

One pure function, `place()`: demands (from the JobPlan) + nodes + their free
resources + nodes to avoid -> one Placement per instance, or UsageError (exit 2)
naming the role and what is short. Ports are picked afterwards ON the chosen
node by the backend.

Rules (PAI units: cpu 100 = one core, memory in MB, gpu 100 = one card):
- Services (roles that need not finish: ps, server, scheduler) are spread: each
  goes to the node holding the fewest of this job's services, the freest first.
- The other roles are bin-packed: fill the fullest node that still has room,
  then the next (fewer nodes used, whole nodes left for the next job).
- Memory and GPUs are hard limits. CPU is a packing weight: when every node's
  cores are taken, instances still run on the node with the most cpu left, but
  one instance asking for more cpu than any node has does not fit.
- GPUs held by running paicli jobs (the store's claims) are not free.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from paicli.cluster.backends.base import NodeSpec, Placement
from paicli.errors import UsageError
from paicli.jobplan import JobPlan


class Demand(NamedTuple):
    """One instance's needs: cpu (millicores), memory (MB), cards (GPUs), service (a ps)."""
    role: str
    idx: int
    cpu: int
    memory: int
    cards: int
    service: bool


@dataclass
class Free:
    """What is left on one node."""
    cpu: int
    memory: int
    gpus: list[str] = field(default_factory=list)
    services: int = 0       # this job's services placed there so far


def cards(gpu_units: int) -> int:
    return math.ceil(gpu_units / 100) if gpu_units > 0 else 0


def demands(plan: JobPlan) -> list[Demand]:
    out = []
    for role in plan.roles:
        need = (max(0, role.cpu), max(0, role.memory), cards(role.gpu), not role.must_finish)
        out.extend(Demand(role.name, idx, *need) for idx in range(role.count))
    return out


def free_resources(nodes: Iterable[NodeSpec], held_gpus: dict[str, set[str]] | None = None) -> dict[str, Free]:
    """Each node's capacity minus the GPUs other jobs hold on it."""
    held_gpus = held_gpus or {}
    return {n.name: Free(n.cpu, n.memory, [g for g in n.gpus if g not in held_gpus.get(n.name, ())])
            for n in nodes}


def reserve(free: dict[str, Free], placed: Placement, demand: Demand) -> None:
    """Take what `placed` uses out of `free` (an instance of this job that keeps running)."""
    room = free.get(placed.node)
    if room is None:
        return
    room.cpu -= demand.cpu
    room.memory -= demand.memory
    room.gpus = [g for g in room.gpus if g not in placed.gpus]
    room.services += demand.service


def place(wanted: list[Demand], nodes: list[NodeSpec], free: dict[str, Free] | None = None,
          avoid: Iterable[str] = (), soft_cpu: Iterable[str] | None = None) -> list[Placement]:
    """One Placement per demand, in the order of `wanted`. `free` is updated in
    place (pass a fresh one from free_resources()); `avoid`: node names not to use
    (nodes this job lost); `soft_cpu`: the nodes whose cores may be oversubscribed
    (None: all of them; the queue passes the nodes no other job holds)."""
    free = free_resources(nodes) if free is None else free
    avoid = set(avoid)
    soft = None if soft_cpu is None else set(soft_cpu)
    usable = [n for n in nodes if n.name not in avoid and n.name in free]
    order = {n.name: i for i, n in enumerate(usable)}
    hosts = {n.name: n.host for n in usable}
    biggest_cpu = max((n.cpu for n in usable), default=0)
    result: dict[tuple[str, int], Placement] = {}

    def take(node: str, d: Demand) -> None:
        room = free[node]
        gpus = ()
        if d.cards:
            gpus = tuple(room.gpus[:d.cards])
            room.gpus = room.gpus[d.cards:]
        room.cpu -= d.cpu
        room.memory -= d.memory
        room.services += d.service
        result[(d.role, d.idx)] = Placement(d.role, d.idx, node, hosts[node], gpus)

    def hard_fit(node: str, d: Demand) -> bool:
        room = free[node]
        return room.memory >= d.memory and len(room.gpus) >= d.cards

    groups: dict[tuple, list[Demand]] = {}
    for d in wanted:
        groups.setdefault((not d.service, d.role, d.cpu, d.memory, d.cards), []).append(d)
    # Services first (they are few and must spread), then each role in plan order.
    for key in sorted(groups, key=lambda k: (k[0], list(groups).index(k))):
        group = groups[key]
        probe = group[0]
        if probe.cpu > biggest_cpu or not usable:
            raise no_fit(probe, usable, free, biggest_cpu, avoid)
        if probe.service:
            _spread(group, usable, free, order, hard_fit, take)
        else:
            _pack(group, usable, free, order, take)
        left = [d for d in group if (d.role, d.idx) not in result]
        # CPU oversubscribed: the node with the most cpu left, while memory and GPUs allow.
        heap = [(-free[n.name].cpu, order[n.name], n.name) for n in usable
                if n.cpu >= probe.cpu and hard_fit(n.name, probe) and (soft is None or n.name in soft)]
        heapq.heapify(heap)
        for d in left:
            if not heap:
                raise no_fit(d, usable, free, biggest_cpu, avoid)
            _, _, node = heapq.heappop(heap)
            take(node, d)
            if hard_fit(node, d):
                heapq.heappush(heap, (-free[node].cpu, order[node], node))
    return [result[(d.role, d.idx)] for d in wanted]


def _spread(group, usable, free, order, hard_fit, take) -> None:
    heap = [(free[n.name].services, -free[n.name].cpu, order[n.name], n.name) for n in usable]
    heapq.heapify(heap)
    for d in group:
        while heap:
            _, _, _, node = heapq.heappop(heap)
            if hard_fit(node, d) and free[node].cpu >= d.cpu:
                take(node, d)
                heapq.heappush(heap, (free[node].services, -free[node].cpu, order[node], node))
                break
            # Too small for this role now; resources only shrink, so drop it for the role.
        else:
            return  # the rest go through the oversubscription pass


def _pack(group, usable, free, order, take) -> None:
    probe = group[0]
    next_ = 0
    # Fullest first (least cpu left), among the nodes where one more still fits.
    for n in sorted(usable, key=lambda n: (free[n.name].cpu, order[n.name])):
        left = len(group) - next_
        if not left:
            return
        room = free[n.name]
        fit = min(room.cpu // probe.cpu if probe.cpu else left,
                  room.memory // probe.memory if probe.memory else left,
                  len(room.gpus) // probe.cards if probe.cards else left, left)
        for d in group[next_:next_ + max(0, fit)]:
            take(n.name, d)
        next_ += max(0, fit)


def no_fit(d: Demand, usable: list[NodeSpec], free: dict[str, Free], biggest_cpu: int,
           avoid: set[str]) -> UsageError:
    """One line naming the role and what is short, e.g. "-Dcluster: worker needs
    cpu 400, the largest node has 200"."""
    name = f"-Dcluster: {d.role}" + (f":{d.idx}" if d.idx else "")
    hint = "lower the role's cpu/memory/gpu or count in -Dcluster, or add nodes"
    if not usable:
        lost = f" (lost or avoided: {', '.join(sorted(avoid))})" if avoid else ""
        return UsageError(f"{name} cannot be placed: no node is left{lost}", hint)
    if d.cpu > biggest_cpu:
        return UsageError(f"{name} needs cpu {d.cpu}, the largest node has {biggest_cpu}", hint)
    most_memory = max(free[n.name].memory for n in usable)
    if d.memory > most_memory:
        return UsageError(f"{name} needs memory {d.memory} MB, the largest free node has {max(0, most_memory)} MB",
                          hint)
    most_gpus = max(len(free[n.name].gpus) for n in usable)
    if d.cards > most_gpus:
        held = ("" if most_gpus == max(len(n.gpus) for n in usable)
                else " (cards held by running jobs or by this job's other instances are not free)")
        return UsageError(f"{name} needs {d.cards} GPU{'s' if d.cards > 1 else ''}, the most free on one node "
                          f"is {most_gpus}{held}",
                          "set -DgpuRequired=0 (and gpu 0 in -Dcluster) to train on the CPU, or add nodes with GPUs")
    return UsageError(f"{name} needs memory {d.memory} MB and {d.cards} GPU(s) on one node; no node has both free",
                      hint)


def place_plan(plan: JobPlan, nodes: list[NodeSpec], held_gpus: dict[str, set[str]] | None = None,
               avoid: Iterable[str] = ()) -> list[Placement]:
    """The whole job: the submit-time check and the master's first placement."""
    return place(demands(plan), nodes, free_resources(nodes, held_gpus), avoid)
