"""Resources in PAI units (cpu 100 = one core, gpu 100 = one card, memory in MB)
and placement on the local machine.

A job that asks for more GPUs or memory than the machine has is refused before it
starts: running it on the CPU while it claims a GPU would hide the problem.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from paicli.errors import UsageError
from paicli.plan import JobPlan


def machine_gpus() -> list[str]:
    """GPU indices visible on this machine (NVIDIA's driver lists one directory per card)."""
    cards = Path("/proc/driver/nvidia/gpus")
    count = len(list(cards.iterdir())) if cards.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [str(i) for i in range(count)]
    if visible is not None and count:
        ids = [v for v in visible.split(",") if v.strip() in ids]
    return ids


def machine_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


def cards(gpu_units: int) -> int:
    return math.ceil(gpu_units / 100) if gpu_units > 0 else 0


def check_fits(plan: JobPlan) -> None:
    wanted_gpus = sum(cards(r.gpu) * r.count for r in plan.roles)
    have = machine_gpus()
    if wanted_gpus > len(have):
        where = ", ".join(f"{r.name} x{r.count}: gpu {r.gpu}" for r in plan.roles if r.gpu)
        raise UsageError(
            f"-DgpuRequired/-Dcluster: the job asks for {wanted_gpus} GPU(s) ({where}) but this machine has "
            f"{len(have) or 'none'}",
            "set -DgpuRequired=0 (and gpu 0 in -Dcluster) to train on the CPU, or submit on a machine with GPUs")
    wanted_mb = sum(r.memory * r.count for r in plan.roles)
    if wanted_mb > machine_memory_mb():
        raise UsageError(f"-Dcluster: the job asks for {wanted_mb} MB of memory but this machine has "
                         f"{machine_memory_mb()} MB", "lower the memory per role or the instance counts")


def assign_gpus(plan: JobPlan) -> dict[tuple[str, int], str]:
    """CUDA_VISIBLE_DEVICES per instance: its own cards, or "" for an instance that
    asked for none (so it cannot grab a card another instance was given)."""
    free = machine_gpus()
    assignment = {}
    for role in plan.roles:
        for idx in range(role.count):
            n = cards(role.gpu)
            assignment[(role.name, idx)] = ",".join(free[:n])
            free = free[n:]
    return assignment
