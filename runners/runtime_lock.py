"""The runtime lock every framework runner holds while its instance runs.

Stdlib only (it runs inside a framework's runtime, Python 3.9 in Caffe's root
filesystem). The runners import it as a sibling module: each backend stages
every runners/*.py file next to them, on this machine and on nodes.
"""

from __future__ import annotations

import fcntl
import os
import sys


def hold_runtime_lock() -> int | None:
    """Hold the runtime's marker file (paicli-runtime.json, at the runtime's root:
    sys.prefix for a venv, its parent for a root filesystem's /usr) with a shared
    lock while this instance runs, so `pai runtime remove` refuses. The caller keeps
    the returned descriptor open until its process ends."""
    _hold_layer()
    here = os.path.realpath(sys.prefix)
    for folder in (here, os.path.dirname(here)):
        marker = os.path.join(folder, "paicli-runtime.json")
        if os.path.exists(marker):
            try:
                fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return None  # being removed right now: the run fails on its own
            return fd
    return None


_LAYER_FDS: list[int] = []


def _hold_layer() -> None:
    """The job's requirements layer ($PAI_LAYER, cluster/requirement_layers.py), held the same
    way for this process's life: `pai runtime remove LAYER` refuses while it is."""
    layer = os.environ.get("PAI_LAYER")
    if not layer:
        return
    try:
        fd = os.open(os.path.join(layer, "paicli-layer.json"), os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return
    _LAYER_FDS.append(fd)
