"""A node's data cache: table slices and bucket files by content digest.

Standard library only; runs on a node from the job's staged runners folder (over
SSH as a command, on Ray by a zero-CPU task pinned to the node).

    python3 node_cache.py missing ROOT               stdin: a JSON list of digests; those
                                                     ROOT lacks (JSON list)
    python3 node_cache.py put ROOT FOLDER            stdin: one JSON line (the node's job
                                                     plan: index, trees, files), then frames
                                                     b"BLOB <sha256> <size>\\n" + bytes, b"END\\n";
                                                     {"blobs", "bytes", "received": every
                                                     byte read from stdin}
    python3 node_cache.py parts FOLDER               the job's output parts, as frames

ROOT/blobs/<sha256> holds one slice or file, read-only (0400), written aside and
renamed once its digest is checked, hashed again when a job asks for it: a blob
that is there is whole. A bucket is a tree of hard links to blobs under
ROOT/trees/<tree digest>/, read-only, that the job's folder links to. The job's
table index goes to FOLDER/data/tables.json; a project folder's files
(cluster/workdir.py) are copies of their blobs in FOLDER/code/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys

try:   # as paicli.runners.<this> (the master, the local agent, the tests)
    from . import private_files
except ImportError:   # as a script in the job's staged runners folder: its folder is on sys.path
    import private_files

HEX = set("0123456789abcdef")


class Refused(Exception):
    pass


def _digest_ok(digest: str) -> bool:
    return len(digest) == 64 and set(digest) <= HEX


def own_dir(path: str) -> str:
    """`path` as a folder of ours alone (made 0700 if missing); Refused if it is a
    link, someone else's, or writable by others."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise Refused(f"{path}: not a folder of ours alone")
    return path


def blob_path(root: str, digest: str) -> str:
    if not _digest_ok(digest):
        raise Refused(f"not a digest: {digest[:80]!r}")
    return os.path.join(root, "blobs", digest)


def missing(root: str, digests) -> list:
    """The digests ROOT holds no sound blob of. Asked once a job before its blobs
    are used, so each blob there is hashed again: one whose bytes changed (a disk
    error, root), whatever its size and mtime say, is removed and so sent again."""
    own_dir(root)
    return [d for d in digests if not _sound(blob_path(root, d), d)]


def _sound(path: str, digest: str) -> bool:
    got = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                got.update(chunk)
    except FileNotFoundError:
        return False
    return got.hexdigest() == digest or os.unlink(path)    # (None) a corrupted blob goes


def store_blob(root: str, digest: str, chunks) -> int:
    """One blob into the cache (checked against `digest`); its size."""
    path = blob_path(root, digest)
    own_dir(os.path.join(root, "blobs"))
    got = hashlib.sha256()
    with private_files.ReplacingFile(path, 0o400) as out:
        for chunk in chunks:
            got.update(chunk)
            out.write(chunk)
        if got.hexdigest() != digest:
            raise Refused(f"blob {digest[:12]}: its bytes hash to {got.hexdigest()[:12]}")
    return os.path.getsize(path)


def _read_exact(stream, size: int):
    left = size
    while left:
        chunk = stream.read(min(left, 1 << 20))
        if not chunk:
            raise Refused("the stream ended inside a blob")
        left -= len(chunk)
        yield chunk


def place(root: str, folder: str, plan: dict) -> None:
    """The job's side of the cache: FOLDER/data/tables.json (paths in it are the
    node's) and each bucket tree, linked from FOLDER/buckets/K (its "link")."""
    folder = own_dir(folder)
    data = own_dir(os.path.join(folder, "data"))
    for out in (plan.get("index") or {}).get("outputs", []):
        os.makedirs(out["parts"], mode=0o700, exist_ok=True)
    if plan.get("index") is not None:
        private_files.write_private(os.path.join(data, "tables.json"), json.dumps(plan["index"]))
    for dst, digest, mode, target in plan.get("files") or []:
        _copy_out(root, folder, dst, digest, mode, target)
    for tree in plan.get("trees") or []:
        name = str(tree.get("link", "")).split("/")
        if len(name) != 2 or name[0] != "buckets" or not name[1].isdigit():
            raise Refused(f"a bucket link that is not buckets/K: {tree.get('link')!r}"[:120])
        top = build_tree(root, tree)
        link = os.path.join(own_dir(os.path.join(folder, "buckets")), name[1])
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(top, link)


def _copy_out(root: str, folder: str, dst: str, digest: str, mode: int, target: str) -> None:
    """A project folder's file (a copy of its blob, the script may change it) or
    link into the job's folder, written aside and renamed."""
    parts = dst.split("/")
    outside = os.path.normpath(os.path.join(os.path.dirname(dst), target)).startswith("..")
    if dst.startswith("/") or any(p in ("", ".", "..") for p in parts) or target.startswith("/") or outside:
        raise Refused(f"a project file that leaves the job's folder: {dst[:80]!r}")
    here = folder
    for name in parts[:-1]:
        here = own_dir(os.path.join(here, name))
    path = os.path.join(here, parts[-1])
    if target:
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(target, path)
        return
    with open(blob_path(root, digest), "rb") as src:
        out = private_files.ReplacingFile(path, 0o700 if mode & 0o100 else 0o600)
        try:
            shutil.copyfileobj(src, out)
        except BaseException:
            out.abandon()
            raise
        out.commit(sync=False)


def build_tree(root: str, tree: dict) -> str:
    """A bucket as read-only hard links to blobs under ROOT/trees/<digest>: made
    once (aside, then renamed), reused by every job with the same tree."""
    if not _digest_ok(tree["digest"]):
        raise Refused("not a tree digest")
    trees = own_dir(os.path.join(root, "trees"))
    top = os.path.join(trees, tree["digest"])
    if os.path.isdir(top):
        if _intact(root, top, tree["files"]):
            return top
        _remove_tree(top)     # someone (root ignores modes) changed it: made again
    tmp = f"{top}.tmp{os.getpid()}"
    if os.path.lexists(tmp):
        _remove_tree(tmp)     # left by a build that failed
    os.mkdir(tmp, 0o700)
    try:
        _fill_tree(root, tmp, tree["files"])
        os.rename(tmp, top)
    except BaseException:
        _remove_tree(tmp)
        if not os.path.isdir(top):   # else another job made it meanwhile (ENOTEMPTY): theirs is ours
            raise
    return top


def _fill_tree(root: str, tmp: str, files: list) -> None:
    for rel, digest in files:
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise Refused(f"a bucket path that leaves its tree: {rel[:80]!r}")
        here = tmp
        for name in parts[:-1]:
            here = os.path.join(here, name)
            if not os.path.isdir(here):
                os.mkdir(here, 0o700)
        os.link(blob_path(root, digest), os.path.join(here, parts[-1]))
    for dirpath, _dirs, _files in os.walk(tmp):
        os.chmod(dirpath, 0o500)     # read-only: a script cannot change the cached data


def _intact(root: str, top: str, files: list) -> bool:
    """The tree holds exactly its files, each still a link to its blob."""
    want = {rel: digest for rel, digest in files}
    seen = 0
    for dirpath, _dirs, names in os.walk(top):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), top)
            try:
                same = os.path.samefile(os.path.join(dirpath, name), blob_path(root, want[rel]))
            except (KeyError, OSError):
                return False
            if not same:
                return False
            seen += 1
    return seen == len(want)


def _remove_tree(path: str) -> None:
    for dirpath, dirs, files in os.walk(path, topdown=True):
        os.chmod(dirpath, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def receive(root: str, folder: str, stream) -> dict:
    """`put`: the plan line, then blobs until END; the job's side placed last.
    "received" is every byte read from the stream, frames and all (a blob is read
    whole or refused): what really arrived here."""
    own_dir(root)
    line = stream.readline()
    plan = json.loads(line or b"{}")
    count = size = 0
    received = len(line)
    while True:
        head = stream.readline()
        received += len(head)
        if head in (b"END\n", b""):
            break
        kind, digest, length = head.decode().split()
        if kind != "BLOB":
            raise Refused(f"unknown frame {kind[:20]!r}")
        size += store_blob(root, digest, _read_exact(stream, int(length)))
        count += 1
        received += int(length)
    place(root, folder, plan)
    return {"blobs": count, "bytes": size, "received": received}


def run_staged(folder: str, runner: str, args: list, stdin: bytes) -> tuple:
    """A Ray task's body (this function is shipped by value): `runners/RUNNER ARGS`
    of the job's staged folder on this node, run by this Python with `stdin`, as
    sshd runs it on an SSH node. (exit status, stdout, stderr)."""
    if "/" in runner or not runner.endswith(".py"):
        raise Refused(f"not a runner: {runner[:80]!r}")
    done = subprocess.run([sys.executable, os.path.join(folder, "runners", runner), *args], input=stdin,
                          capture_output=True, timeout=3600)
    return done.returncode, done.stdout, done.stderr


def parts(folder: str) -> dict:
    """The job's output part files: {"K/part-...jsonl": bytes}."""
    found = {}
    out = os.path.join(folder, "data", "out")
    for k in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        sub = os.path.join(out, k)
        for name in sorted(os.listdir(sub)) if k.isdigit() and os.path.isdir(sub) else []:
            if name.startswith("part-") and name.endswith(".jsonl"):
                with open(os.path.join(sub, name), "rb") as f:
                    found[f"{k}/{name}"] = f.read()
    return found


def main(argv: list) -> int:
    try:
        if argv[:1] == ["missing"] and len(argv) == 2:
            print(json.dumps(missing(argv[1], json.loads(sys.stdin.read() or "[]"))))
        elif argv[:1] == ["put"] and len(argv) == 3:
            print(json.dumps(receive(argv[1], argv[2], sys.stdin.buffer)))
        elif argv[:1] == ["parts"] and len(argv) == 2:
            out = sys.stdout.buffer
            for rel, data in parts(argv[1]).items():
                out.write(f"PART {rel} {len(data)}\n".encode() + data)
            out.write(b"END\n")
        else:
            print("usage: node_cache.py missing ROOT | put ROOT FOLDER | parts FOLDER", file=sys.stderr)
            return 2
    except (Refused, OSError, ValueError) as err:
        print(json.dumps({"error": str(err)[:300]}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
