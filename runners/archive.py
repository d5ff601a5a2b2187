"""Safe extraction of a script archive (.tar.gz / .tgz).

Stdlib only: it runs on the submitting host and may run inside a runtime on a
remote node. Every member is checked before anything is written: no absolute
paths, no `..`, no links that point outside the extraction root, no devices.
"""

from __future__ import annotations

import os
import posixpath
import tarfile


class UnsafeArchive(Exception):
    pass


def check_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    for m in members:
        name = m.name
        norm = posixpath.normpath(name)
        if name.startswith("/") or norm == ".." or norm.startswith("../") or "\x00" in name:
            raise UnsafeArchive(f"member {name!r} would be written outside the archive's folder")
        if m.issym() or m.islnk():
            target = m.linkname
            base = posixpath.dirname(norm) if m.issym() else ""
            resolved = posixpath.normpath(posixpath.join(base, target))
            if target.startswith("/") or resolved == ".." or resolved.startswith("../"):
                raise UnsafeArchive(f"link {name!r} -> {target!r} points outside the archive's folder")
        elif not (m.isfile() or m.isdir()):
            raise UnsafeArchive(f"member {name!r} is a device or FIFO, which a script archive has no use for")
    return members


def extract(archive: str, dest: str) -> None:
    """Extract `archive` into `dest` (which must exist) or raise UnsafeArchive /
    tarfile.TarError without writing anything for an unsafe archive."""
    with tarfile.open(archive, "r:*") as tar:
        members = check_members(tar)
        # The "data" filter re-checks the same rules member by member.
        tar.extractall(dest, members=members, filter="data")
    # A symlink made by an earlier member must not redirect a later file.
    real_dest = os.path.realpath(dest)
    for root, dirs, files in os.walk(dest):
        for name in dirs + files:
            path = os.path.join(root, name)
            if not os.path.realpath(path).startswith(real_dest + os.sep) and os.path.realpath(path) != real_dest:
                raise UnsafeArchive(f"{os.path.relpath(path, dest)!r} resolves outside the archive's folder")
