"""Files and folders only their owner can read.

What paicli writes holds argv (buckets, checkpointDir, user parameters, where
people put keys) and log tails, so folders are 0700 and files 0600 whatever the
umask says. Existing ones are tightened when we open them.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path, parents: bool = False) -> Path:
    """Create `path` (0700) or tighten it if it is ours and looser."""
    try:
        path.mkdir(mode=DIR_MODE, parents=parents)
    except FileExistsError:
        pass
    _tighten(path, DIR_MODE)
    return path


def open_append_fd(path: Path | str) -> int:
    """A descriptor appending to `path`, created readable by its owner only (logs
    hold argv and whatever the script prints)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def write_private(path: Path, text: str | bytes) -> None:
    """Write a whole file, 0600, through a temporary name: a reader (or a full
    disk) never sees half of it. The temporary is a fresh random name created
    with O_EXCL|O_NOFOLLOW: a file or symlink someone planted in the folder
    (known_hosts may live wherever the user says) is never opened or followed."""
    data = text.encode() if isinstance(text, str) else text
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _create_temporary(path: Path) -> tuple[int, Path]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, flags, FILE_MODE), tmp
        except FileExistsError:
            continue  # 48 random bits taken: someone is guessing; draw again
    raise FileExistsError(f"no free temporary name next to {path}")


def touch_private(path: Path) -> None:
    """Make sure `path` exists and is 0600 (a file another program then opens,
    such as an SQLite database).

    An existing file is never opened: closing any descriptor of a file drops
    every POSIX lock this process holds on it, so touching the job store while
    another Store of the process is open would take SQLite's locks from under
    it (another process could then delete the WAL that connection still uses:
    "database disk image is malformed")."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
    except FileExistsError:
        pass
    _tighten(path, FILE_MODE)


def _tighten(path: Path, mode: int) -> None:
    try:
        st = os.stat(path)
        if st.st_uid == os.getuid() and st.st_mode & 0o777 & ~mode:
            os.chmod(path, st.st_mode & 0o777 & mode)
    except OSError:
        pass
