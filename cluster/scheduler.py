"""This machine's resources in PAI units (cpu 100 = one core, gpu 100 = one
card, memory in MB): what the local backend reports as its one node. Placing
instances on nodes is cluster/placement.py.
"""

from __future__ import annotations

import os
from pathlib import Path


def machine_cpu() -> int:
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) * 100


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

