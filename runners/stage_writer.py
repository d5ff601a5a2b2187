"""Writes a job's files into its per-job folder on a node whose sshd has no SFTP.

Standard library only. ssh_transport.ExecFiles runs it as `python3 -c PROGRAM ROOT
FOLDER`, the files coming as a tar stream on stdin, with the node agent's root
check (node_agent.root_fault), so this path and SFTP's refuse the same roots.

ROOT (the node's work_dir) is created 0700 when missing and must be ours alone;
FOLDER, below it, is created 0700. Each member lands below FOLDER: folders 0700,
files created anew (O_EXCL|O_NOFOLLOW) with their mode cut to 0700/0600, links
only when relative and inside FOLDER. Anything else is refused: exit 1, and the
last stderr line says why ("refused: ..." for a root that is not ours alone).
"""

import os
import sys
import tarfile


class Refused(Exception):
    pass


def check_root(root: str, root_fault) -> None:
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    fault = root_fault(st.st_mode, st.st_uid, os.geteuid())
    if fault:
        raise Refused(f"the per-job folder root {root} is {fault}; refused")


def _target(folder: str, name: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"member {name!r} is not a plain relative path")
    return os.path.join(folder, name)


def _inside(path: str, real_folder: str) -> bool:
    """`path`, with every link on the way resolved (earlier members' links
    included), is FOLDER or below it."""
    real = os.path.realpath(path)
    return real == real_folder or real.startswith(real_folder + os.sep)


def write(tar: tarfile.TarFile, folder: str) -> None:
    real_folder = os.path.realpath(folder)
    for member in tar:
        path = _target(folder, member.name)
        if not _inside(os.path.dirname(path), real_folder):
            raise ValueError(f"member {member.name!r} would be written through a link out of the folder")
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if member.isdir():
            os.makedirs(path, mode=0o700, exist_ok=True)
        elif member.issym():
            if os.path.isabs(member.linkname) or \
                    not _inside(os.path.join(os.path.dirname(path), member.linkname), real_folder):
                raise ValueError(f"link {member.name!r} leaves the folder")
            os.symlink(member.linkname, path)
        elif member.isfile():
            mode = 0o700 if member.mode & 0o100 else 0o600
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out, tar.extractfile(member) as data:
                while True:
                    chunk = data.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
        else:
            raise ValueError(f"member {member.name!r} is neither a file, a folder nor a link")


def main(argv: list, root_fault) -> int:
    root, folder = argv
    try:
        check_root(root, root_fault)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
            write(tar, folder)
    except Refused as err:
        print(f"refused: {err}", file=sys.stderr)
        return 1
    except (OSError, ValueError, tarfile.TarError) as err:
        print(f"{err.__class__.__name__}: {err}", file=sys.stderr)
        return 1
    return 0
