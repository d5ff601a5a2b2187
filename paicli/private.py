"""Files and folders only their owner can read.

What paicli writes holds argv (buckets, checkpointDir, user parameters, where
people put keys) and log tails, so folders are 0700 and files 0600 whatever the
umask says. Existing ones are tightened when we open them.
"""

from __future__ import annotations

import os
from pathlib import Path

# The one way a whole file is written (the nodes' runners write theirs with it too).
from paicli.runners.private_files import FILE_MODE, ReplacingFile, write_private

__all__ = ["DIR_MODE", "FILE_MODE", "ReplacingFile", "open_append_fd", "private_dir", "touch_private",
           "write_private"]

DIR_MODE = 0o700


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


def touch_private(path: Path) -> None:
    """Make sure `path` exists and is 0600 (a file another program then opens,
    such as an SQLite database).

    An existing file is never opened: closing any descriptor of a file drops every
    POSIX lock this process holds on it, SQLite's included."""
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
