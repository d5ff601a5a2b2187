"""Reading a job's logs for `pai logs`: which file, confined to the job's folder,
the last N lines, and following it until the job ends."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import IO

from paicli import client
from paicli.errors import NotFound, UsageError
from paicli.logtail import DirectoryWatch, FileFollower, colourise
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


def _last_lines(path: Path, count: int, size: int) -> bytes:
    """The last `count` lines of the first `size` bytes of the file."""
    if count == 0:
        return b""
    with open(path, "rb") as f:
        lines = f.read(size).splitlines(keepends=True)
    return b"".join(lines[-count:])


class LineOutput:
    """Writes log data as it comes: raw, coloured, or as one JSON object a line
    ({"instance": "worker:1", "line": "..."}) for scripts. Colour and JSON work
    on whole lines, so a chunk that ends inside a line keeps its end for later."""

    COMBINED = re.compile(r"^\[([A-Za-z][A-Za-z0-9_]*:\d+|pai)\] ?(.*)$")

    def __init__(self, out: IO[bytes], *, colour: bool, as_json: bool, instance: str | None):
        self.out = out
        self.colour = colour
        self.as_json = as_json
        self.instance = instance
        self.partial = b""

    def write(self, data: bytes, final: bool = False) -> None:
        if not (self.colour or self.as_json):
            self.out.write(data)
            self.out.flush()
            return
        data = self.partial + data
        cut = len(data) if final else data.rfind(b"\n") + 1
        whole, self.partial = data[:cut], data[cut:]
        if not whole:
            return
        if self.as_json:
            whole = b"".join(self._json(line) for line in whole.decode("utf-8", "replace").splitlines())
        else:
            whole = colourise(whole)
        self.out.write(whole)
        self.out.flush()

    def _json(self, line: str) -> bytes:
        if self.instance is not None:
            record = {"instance": self.instance, "line": line}
        else:
            match = self.COMBINED.match(line)
            record = {"instance": match.group(1), "line": match.group(2)} if match else \
                {"instance": None, "line": line}
        return (json.dumps(record) + "\n").encode()

    def close(self) -> None:
        self.write(b"", final=True)


def print_log(store: Store, job_id: str, path: Path, out: IO[bytes], *, tail: int | None,
              follow: bool, colour: bool, as_json: bool = False, instance: str | None = None) -> None:
    show = LineOutput(out, colour=colour and not as_json, as_json=as_json, instance=instance)
    rotated = path.with_name(path.name + ".1")
    if not path.exists() and not follow:
        raise NotFound(f"no log yet at {path}", "the instance may not have started; try --follow")
    if tail is not None:
        # The tail of what is there now, and following from exactly there.
        offset = path.stat().st_size if path.exists() else 0
        data = _last_lines(path, tail, offset) if offset else b""
    else:
        data = rotated.read_bytes() if rotated.exists() else b""
        offset = 0
    show.write(data)
    follower = FileFollower(path, offset)
    watch = DirectoryWatch(path.parent) if follow else None
    try:
        while True:
            data = follower.read()
            if data:
                show.write(data)
                continue
            if watch is None:
                break
            if client.job_over(client.refresh(store, job_id)):
                while data := follower.read():
                    show.write(data)
                break
            watch.wait(0.25)
    finally:
        show.close()
        follower.close()
        if watch:
            watch.close()
