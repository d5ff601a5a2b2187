"""Reading a job's logs for `pai logs`: which file, confined to the job's folder,
the last N lines, and following it until the job ends."""

from __future__ import annotations

import os
import re
import time
from collections import deque
from pathlib import Path
from typing import IO

from paicli.errors import NotFound, UsageError
from paicli.states import JobStatus
from paicli.store import Store

INSTANCE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*):(\d+)$")


def log_path(store: Store, job, instance: str | None, attempt: int | None) -> Path:
    job_dir = Path(job["job_dir"]).resolve()
    if instance is None:
        if attempt is not None:
            raise UsageError("--attempt goes with --instance", "e.g. --instance worker:1 --attempt 0")
        path = job_dir / "job.log"
    else:
        match = INSTANCE.match(instance)
        if not match:
            raise UsageError(f"--instance {instance!r}: expected role:index", "e.g. --instance worker:1")
        role, idx = match.group(1), int(match.group(2))
        rows = [i for i in store.instances(job["id"]) if i["role"] == role and i["idx"] == idx]
        if not rows:
            known = ", ".join(f"{i['role']}:{i['idx']}" for i in store.instances(job["id"]))
            raise NotFound(f"--instance {instance}: job {job['id']} has no such instance", f"it has {known}")
        if attempt is None:
            attempt = rows[0]["attempt"] or 0
        path = job_dir / "logs" / f"{role}-{idx}.{attempt}.log"
    # Confine reads to the job's own folder whatever the store or arguments say.
    resolved = path.resolve()
    if not str(resolved).startswith(str(job_dir) + os.sep):
        raise UsageError(f"{path} is outside the job's folder")
    return resolved


def _last_lines(path: Path, count: int) -> bytes:
    if count == 0:
        return b""
    lines: deque[bytes] = deque(maxlen=count)
    with open(path, "rb") as f:
        for line in f:
            lines.append(line)
    return b"".join(lines)


def print_log(store: Store, job_id: str, path: Path, out: IO[bytes], *, tail: int | None,
              follow: bool, colour: bool) -> None:
    from paicli import client
    from paicli.logtail import FileFollower, colourise

    show = colourise if colour else (lambda data: data)
    rotated = path.with_name(path.name + ".1")
    if not path.exists() and not follow:
        raise NotFound(f"no log yet at {path}", "the instance may not have started; try --follow")
    if tail is not None:
        data = _last_lines(path, tail) if path.exists() else b""
        offset: int | str = "end"
    else:
        data = rotated.read_bytes() if rotated.exists() else b""
        offset = 0
    out.write(show(data))
    out.flush()
    if tail is None and path.exists():
        follower = FileFollower(path, 0)
    else:
        follower = FileFollower(path, offset)
    try:
        while True:
            data = follower.read()
            if data:
                out.write(show(data))
                out.flush()
                continue
            if not follow:
                break
            job = client.refresh(store, job_id)
            if JobStatus(job["status"]).is_terminal() and not client.master_alive(job):
                while data := follower.read():
                    out.write(show(data))
                out.flush()
                break
            time.sleep(0.1)
    finally:
        follower.close()
