"""Files written whole, readable by their owner alone.

Standard library only, so the host (through paicli.private) and the nodes write
files one way: a fresh random name in the target's folder, created with
O_CREAT|O_EXCL|O_NOFOLLOW (nothing planted is followed), fsynced, then renamed over
the target: a reader or a crash sees the old file or the whole new one.
"""

from __future__ import annotations

import os

FILE_MODE = 0o600
TEMP_PREFIX = ".pai-tmp-"
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class ReplacingFile:
    """The new content of `target`, written aside and renamed over it by `commit()`;
    `abandon()` (or leaving a `with` block by an exception) removes what was written.
    `mode` is the file's mode once committed (0600 while it is written); its
    temporary name starts with `prefix` (a reader that must skip such files, or a
    sweep that removes the ones a dead writer left, knows them by it)."""

    def __init__(self, target, mode: int = FILE_MODE, prefix: str = TEMP_PREFIX):
        self.target = os.fspath(target)
        self.mode = mode
        folder, name = os.path.split(self.target)
        for _ in range(100):
            self.temp = os.path.join(folder, f"{prefix}{os.urandom(6).hex()}-{name}"[:250])
            try:
                self.fd = os.open(self.temp, _FLAGS, FILE_MODE)
                break
            except FileExistsError:
                continue   # 48 random bits taken: someone is guessing; draw again
        else:
            raise FileExistsError(f"no free temporary name next to {self.target}")

    def write(self, data) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def commit(self, mtime_ns: int | None = None, sync: bool = True) -> None:
        """Make the written bytes the target's content. `sync=False` skips the fsync,
        for a file nobody needs after a crash (a live view rewritten every moment)."""
        try:
            if sync:
                os.fsync(self.fd)
            if self.mode != FILE_MODE:
                os.fchmod(self.fd, self.mode)
            if mtime_ns is not None:
                os.utime(self.fd, ns=(mtime_ns, mtime_ns))
            os.close(self.fd)
            self.fd = -1
            os.replace(self.temp, self.target)
            self.temp = ""
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Remove what was written; the target stays as it was."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.temp:
            try:
                os.unlink(self.temp)
            except OSError:
                pass
            self.temp = ""

    def __enter__(self) -> "ReplacingFile":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.abandon()


def write_private(path, data: str | bytes, mode: int = FILE_MODE, sync: bool = True) -> None:
    """Replace the file at `path` with `data` (text is UTF-8), through ReplacingFile."""
    out = ReplacingFile(path, mode)
    try:
        out.write(data.encode() if isinstance(data, str) else data)
    except BaseException:
        out.abandon()
        raise
    out.commit(sync=sync)
