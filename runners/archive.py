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


class ArchiveTooLarge(UnsafeArchive):
    pass


# What a script archive may hold. Sizes come from the members' headers, read one
# by one before anything is written, so a gzip bomb is refused after reading
# only as far as its first oversized header (not after filling the disk).
MAX_MEMBERS = 10_000
MAX_BYTES = 1 << 30


class BadLimit(ValueError):
    """A limit variable that is not a positive whole number."""


def limit(name: str, default: int) -> int:
    """$name as a positive whole number, else `default` when it is unset. Read at
    extraction time, so a bad value is an error of the submit that uses it (a
    plain script never reads it)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise BadLimit(f"{name}={raw!r}: expected a positive whole number, e.g. {name}={default}")
    return value


def _size(count: int) -> str:
    return f"{count / (1 << 20):.0f} MiB" if count >= 1 << 20 else f"{count} bytes"


def check_members(tar: tarfile.TarFile, max_members: int | None = None,
                  max_bytes: int | None = None) -> list[tarfile.TarInfo]:
    max_members = limit("PAI_ARCHIVE_MAX_MEMBERS", MAX_MEMBERS) if max_members is None else max_members
    max_bytes = limit("PAI_ARCHIVE_MAX_BYTES", MAX_BYTES) if max_bytes is None else max_bytes
    members = []
    total = 0
    for m in tar:  # lazily: stop at the first member over a limit
        members.append(m)
        total += m.size
        if len(members) > max_members:
            raise ArchiveTooLarge(f"more than {max_members} members")
        if total > max_bytes:
            raise ArchiveTooLarge(f"more than {_size(max_bytes)} once unpacked")
        if m.issparse():
            raise UnsafeArchive(f"member {m.name!r} is a sparse file, which a script archive has no use for")
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
    if not hasattr(tarfile, "data_filter"):  # PEP 706 came in 3.11.4; setup.cfg asks for it
        raise UnsafeArchive("this Python cannot extract archives safely; use Python 3.11.4 or later")
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
